"""In a child made by ``os.fork()``: detach from the parent's NVRx checkpoint workers.

The child inherits NVRx's objects that name the parent's processes (each queue's caller and
its pending saves, NVRx's warm-up slot ``AsyncCallsQueue._warmup_persistent_caller``,
megatron-core's class-level worker ``PersistentAsyncCaller._persistent_process``, the
results-queue manager), and ``multiprocessing.process._children``, which lists those
processes as the child's own. Both act on the parent's worker when the child ends:

* multiprocessing's exit handler SIGTERMs the daemonic ones (the persistent worker: the
  parent's next save dies in its preload handshake, exit code 143; without the package it
  waits for ever) and fails on the non-daemonic ones ("can only join a child process").
* NVRx's close, which its ``__del__`` runs when the child collects the queue or the caller,
  puts ``DONE`` on the worker's request queue and waits in ``queue.join()``. In the child the
  put only buffers the item for the queue's feeder thread, which is the parent's (the child
  has none), while it raises the unfinished-task count the processes share: the child waits
  for ever, and so does the parent's own close later.

So, in the child only: those processes leave ``_children``, the callers forget their
process, the queues their caller and pending saves, the slots their worker; a save the child
makes starts a worker and a manager of its own. What is dropped stays referenced until the
child exits, so that no ``__del__`` runs inside the fork.

Only NVRx's processes leave ``_children``, not every inherited one, although none of them is
the child's (multiprocessing empties the set in the children it starts itself). The other
processes (a DataLoader's workers, the user's daemons) are not this package's concern, and
it does not change what Python does to them.
"""

from __future__ import annotations

import sys

from ..core import fork, shapes as _shapes, state as _state
from ..core.detect import CORE, FS, MCORE_ASYNC

_kept: list[object] = []  # what the child dropped, kept from the garbage collector until it exits


def let_go():
    """Detach this child's copies of NVRx's objects from the parent's processes."""
    if _active():
        _leave(
            _nvrx(sys.modules.get(CORE))
            + _mcore(sys.modules.get(MCORE_ASYNC))
            + [_results_manager()]
        )


def forget(callers):
    """Detach ``callers`` too: a fix's records of the callers it saw (NVRx 0.4.1 keeps no
    list of its queues)."""
    if _active():
        _leave([_forget(caller) for caller in callers])


def _active():
    return _state.activated()  # deactivated: NVRx's own behaviour


def _leave(processes):
    """``processes`` are not this child's: multiprocessing's exit handler leaves them alone."""
    children = getattr(sys.modules.get("multiprocessing.process"), "_children", set())
    for process in processes:
        children.discard(process)


def _results_manager():
    """The process of NVRx's results-queue manager; the child makes its own."""
    results, process = _shapes.results_manager(sys.modules.get(FS))
    if results is not None:
        _kept.append(results)
    return process


def _nvrx(core):
    """The processes of NVRx's queues and of its warm-up slot, detached from them."""
    if getattr(core, "AsyncCallsQueue", None) is None:
        return []
    callers = []
    for queue in _shapes.live_queues(core):
        caller, pending = _shapes.caller_of(queue), list(getattr(queue, "async_calls", ()))
        callers += [caller] + [entry[1] for entry in pending]
        _kept.append(pending)
        if pending:
            queue.async_calls.clear()
        if caller is not None:
            _shapes.detach_caller(queue, caller)
    callers.append(_shapes.warm_slot(core))
    _shapes.empty_slot(core)
    return [_forget(caller) for caller in callers if caller is not None]


def _mcore(module):
    """megatron-core's worker (on its classes) and the caller that holds it, detached."""
    process, held, caller = _shapes.detach_class_worker(module)
    _kept.extend(held)
    return [process] + ([_forget(caller)] if caller is not None else [])


def _forget(caller):
    """The caller's process, which the caller no longer has (its close does nothing)."""
    _kept.append(caller)
    process = getattr(caller, "process", None)
    _shapes.detach_worker(caller, process)
    return process


fork.in_child(let_go, f"{CORE}:PersistentAsyncCaller.close")
