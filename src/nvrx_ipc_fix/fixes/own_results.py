"""Fix ``own_results``: each save's write results reach its own finalize.

NVRx collects the write results of every save of the process through one queue of a
``multiprocessing`` manager (``get_write_results_queue()``): the worker puts one save's
results there, and the finalize (``retrieve_write_results``) takes whatever is first. With
saves of two queues in flight at once (a model and its EMA), or two saves of a queue that
forks a process per save, a finalize takes the other save's results and writes them into its
metadata: the checkpoint does not load, and nothing is raised.

After NVRx's ``prepare_write_data`` the writer gets a queue of its own from NVRx's manager;
NVRx then hands that one to the worker (``get_save_function_and_args``) and reads it in the
finalize. Making a queue, and letting one go, are calls to the manager process (a few ms a
save): a thread of the fix's makes the next save's queue ahead, as a save takes
the last one, and lets a save's queue go once its finalize has taken the results
(``_ahead``). A save finds its queue ready, unless saves come faster than the manager makes
them: then it makes its own. The thread is a daemon (it never holds up the exit), and a
child of ``os.fork()`` starts its own.

Where NVRx's manager has died (the OOM killer), the save in flight fails as NVRx's does (its
finalize raises; the worker watch names the worker's error), and the next save starts a new
manager, from the same ``multiprocessing`` context, which becomes NVRx's: that save and
those after it are saved. Without the package the next save waits for ever.

Where the fix cannot make a queue (the package's defect, a shape it does not know), the save
keeps NVRx's shared queue, with one warning. Such saves cannot be told apart when their times
in flight overlap: each of them then fails in its finalize, as NVRx's finalize fails for lost
results (every rank raises), instead of writing another save's metadata.
"""

from __future__ import annotations

import sys
import threading
import weakref

from ..core import fork as _fork, shapes as _shapes
from ..core.detect import FS
from ..core.log import guard, logger

TYPE_CHECKING = False  # typing.TYPE_CHECKING, without importing typing
if TYPE_CHECKING:
    from typing import Any

FIX = "own_results"
PREPARE_TARGET = f"{FS}:FileSystemWriterAsync.prepare_write_data"
RETRIEVE_TARGET = f"{FS}:FileSystemWriterAsync.retrieve_write_results"

_lock = _fork.renewed(threading.Lock())
#: writers on NVRx's shared queue whose results are not taken yet
_shared: weakref.WeakSet[Any] = weakref.WeakSet()
#: of those, the ones whose time in flight overlapped another's
_mixed: weakref.WeakSet[Any] = weakref.WeakSet()
_fell_back = [False]  # has any save of this process kept NVRx's shared queue?
#: writer -> its own results queue (its proxy is released once its finalize took the results)
_given: weakref.WeakKeyDictionary[Any, Any] = weakref.WeakKeyDictionary()


def prepare_write_data_wrapper(wrapped, instance, args, kwargs):
    """Around ``FileSystemWriterAsync.prepare_write_data(plan, planner)``."""
    result = wrapped(*args, **kwargs)
    with guard(PREPARE_TARGET, fix=FIX) as it:
        made = _shapes.own_results_queue(instance, _ahead.take)
        if made is not None:
            _given[instance] = made[0]
            if made[1] is not None:
                logger.warning(
                    "nvrx_ipc_fix: NVRx's results-queue manager (pid %s) had died "
                    "(exit code %s); a new one takes its place",
                    made[1].pid,
                    made[1].exitcode,
                )
    if it.failed:  # NVRx's shared queue stays
        _share(instance)
    return result


def retrieve_write_results_wrapper(wrapped, instance, args, kwargs):
    """Around ``FileSystemWriterAsync.retrieve_write_results()``: NVRx's result, or, for a
    save on the shared queue that overlapped another, a failure. The save's own queue, whose
    results are now taken, is released (``shapes.let_go``, off this thread)."""
    result = wrapped(*args, **kwargs)
    with guard(RETRIEVE_TARGET, fix=FIX) as it:
        with _lock:
            mixed = instance in _mixed
            _shared.discard(instance)
            _mixed.discard(instance)
        given = _given.pop(instance, None)
        if given is not None and given is _shapes.results_queue_of(instance):
            _ahead.let_go(given)
    if it.failed:
        mixed = _fell_back[0]  # unknown: only a save that had its own queue is sure
    if not mixed:
        return result
    return _shapes.failed_retrieval(
        sys.modules[FS],
        RuntimeError(
            "nvrx_ipc_fix own_results: this save's write results cannot be told from another's: "
            "both took NVRx's one results queue while in flight (the fix could not give them "
            "queues of their own: see nvrx_ipc_fix.status()); not finalized"
        ),
    )


class _Ahead:
    """The thread that creates the next save's results queue in advance and releases the
    proxies of finalized saves' queues, off the training thread; started by the first save."""

    def __init__(self):
        self.cond = threading.Condition()
        self.spare = None  # (manager, queue): the next save's queue
        self.wanted = None  # the manager to make the next queue from
        self.done = []  # queues whose proxies to release
        self.thread = None

    def take(self, manager):
        """The queue made ahead by ``manager``, or None (none ready); the next is asked for."""
        with self.cond:
            spare, self.spare, self.wanted = self.spare, None, manager
            if spare is not None and spare[0] is not manager:
                self.done.append(spare[1])  # another manager's (one that died)
                spare = None
            self._wake()
        return spare and spare[1]

    def let_go(self, queue):
        with self.cond:
            self.done.append(queue)
            self._wake()

    def _wake(self):
        if self.thread is None:
            self.thread = threading.Thread(
                target=self._serve, daemon=True, name="nvrx_ipc_fix results queues"
            )
            self.thread.start()
        self.cond.notify()

    def _serve(self):
        while True:
            with self.cond:
                while self.wanted is None and not self.done:
                    self.cond.wait()
                manager, self.wanted = self.wanted, None
                done, self.done = self.done, []
            try:
                made = manager and (manager, manager.Queue())  # first: a save may come
                for queue in done:
                    _shapes.let_go(queue)
            except Exception:  # noqa: BLE001 a manager gone (any error of its proxy): the next
                continue  # save makes its own queue (and logs why, where it cannot)
            with self.cond:
                if made and self.wanted in (None, manager):  # else a new manager's is wanted
                    made, self.spare, self.wanted = self.spare, made, None
                if made:
                    self.done.append(made[1])


_ahead = _Ahead()


def _share(writer):
    """``writer`` keeps NVRx's shared queue: it and every other such save in flight are
    mixed."""
    _fell_back[0] = True
    with guard(PREPARE_TARGET, fix=FIX):
        if _shapes.results_queue_of(writer) is None:
            return  # nothing to write, no results
        with _lock:
            _shared.add(writer)
            if len(_shared) > 1:
                _mixed.update(_shared)


def _forget():
    """No save of this process is in flight (a reset), or none is this process's (a child
    of ``os.fork()``: the parent's saves)."""
    _shared.clear()
    _mixed.clear()
    _given.clear()
    _fell_back[0] = False


def _forget_parent():
    """In a child of ``os.fork()``: the parent's thread and queues are not its own; its
    saves get a manager of their own. The thread may have held ``multiprocessing``'s lock of
    proxies at the fork: the child gets a fresh one."""
    global _ahead
    _forget()
    if _ahead.thread is not None:
        _shapes.renew_proxy_lock()
    _ahead = _Ahead()


_fork.in_child(_forget_parent)
