"""A save's request that NVRx's queue could not send to the checkpoint worker.

NVRx's caller puts each request on its worker's request queue, whose feeder thread pickles
it. One that cannot be pickled (a lock, a lambda) goes to the queue's
``_on_queue_feeder_error``, which only prints it: the request is dropped, the worker never
receives it, and the trainer waits for ever in ``preload_q.join()`` for the worker's answer
to the handshake (without a ``preload_fn``, in the finalize). ``watch(caller)`` sets that
attribute on the caller's request queue (the instance's: the class's, and every other
queue, keep Python's), before the queue's first put, when the feeder thread looks it up.
The handler keeps the error for its save (``take``), takes back the unfinished task the put
added (NVRx's close joins the queue), and, for a request with a ``preload_fn``, answers the
handshake in the worker's place: the item NVRx put on the preload queue just before the
request is taken and marked done, so NVRx's schedule returns.
"""

from __future__ import annotations

import weakref
from queue import Empty

from ..core import shapes as _shapes
from ..core.log import guard
from . import registry as _registry

#: Seconds to wait for the item NVRx put on the preload queue just before the request (it
#: is in the pipe already, or on its way from that queue's own feeder thread).
PRELOAD_TIMEOUT = 30.0


class _Unsent:
    """The request queue's ``_on_queue_feeder_error``, for one caller (held weakly: the
    caller holds the queue)."""

    __slots__ = ("caller",)

    def __init__(self, caller):
        self.caller = weakref.ref(caller)

    def __call__(self, error, request):
        """In the feeder thread; it must not raise (the thread would end, and every later
        request with it)."""
        with guard("nvrx_ipc_fix.worker.unsent"):  # the feeder thread must not end
            caller = self.caller()
            if caller is None:
                return
            requests, preloads, _ = _shapes.worker_queues(caller)
            _registry.state(caller).unsent[_shapes.call_index(request)] = error
            requests.task_done()
            if _shapes.preloads(request):
                try:
                    preloads.get(timeout=PRELOAD_TIMEOUT)
                except Empty:  # left in the pipe: the next request's preload takes it
                    pass
                preloads.task_done()


def watch(caller):
    """Keep what ``caller``'s request queue cannot send (call before its first put)."""
    requests = _shapes.worker_queues(caller)[0]
    if requests is not None:
        requests._on_queue_feeder_error = _Unsent(caller)


def take(caller, save):
    """The error that kept ``save``'s request from the worker, once; None if there is none
    (yet: a request without a ``preload_fn`` may fail after its schedule returned)."""
    state = _registry.known(caller)
    return None if state is None else state.unsent.pop(save, None)
