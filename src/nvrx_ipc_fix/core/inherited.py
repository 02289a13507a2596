"""In a child made by ``os.fork()``: let go of the parent's NVRx checkpoint workers.

The child inherits NVRx's objects that name the parent's processes (each queue's caller and
its pending saves, NVRx's warm-up slot ``AsyncCallsQueue._warmup_persistent_caller``,
megatron-core's class-level worker ``PersistentAsyncCaller._persistent_process``, the
results-queue manager), and ``multiprocessing.process._children``, which lists those
processes as the child's own. Both act on the parent's worker when the child ends:

* multiprocessing's exit handler SIGTERMs the daemonic ones (the persistent worker: the
  parent's next save dies in its preload handshake, exit code 143; without the package it
  waits for ever) and fails on the others ("can only join a child process").
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
the child's (multiprocessing empties the set in the children it starts itself): the others
(a DataLoader's workers, the user's daemons) are none of this package's business, and it
does not change what Python does to them.
"""

import sys

from . import fork
from .detect import CORE, FS
from .targets import MCORE_ASYNC

_kept = []  # what the child dropped, kept from the garbage collector until it exits


def let_go():
    """Detach this child's copies of NVRx's objects from the parent's processes."""
    if _active():
        _leave(_nvrx(sys.modules.get(CORE)) + _mcore(sys.modules.get(MCORE_ASYNC))
               + [_results_manager()])


def forget(callers):
    """Detach ``callers`` too: a fix's records of the callers it saw (NVRx 0.4.1 keeps no
    list of its queues)."""
    if _active():
        _leave([_forget(caller) for caller in callers])


def _active():
    from . import lifecycle

    return lifecycle._active  # deactivated: NVRx's own behaviour


def _leave(processes):
    """``processes`` are not this child's: multiprocessing's exit handler leaves them alone."""
    children = getattr(sys.modules.get("multiprocessing.process"), "_children", set())
    for process in processes:
        children.discard(process)


def _results_manager():
    """The process of NVRx's results-queue manager; the child makes its own."""
    results = getattr(sys.modules.get(FS), "_results_queue", None)
    if results is None:
        return None
    _kept.append(results)
    sys.modules[FS]._results_queue = None
    return getattr(getattr(results, "_manager", None), "_process", None)


def _nvrx(core):
    """The processes of NVRx's queues and of its warm-up slot, detached from them."""
    queue_class = getattr(core, "AsyncCallsQueue", None)
    if queue_class is None:
        return []
    callers = []
    for queue in getattr(queue_class, "get_instances", list)():
        pending = list(getattr(queue, "async_calls", ()))
        callers += [vars(queue).get("persistent_caller")] + [entry[1] for entry in pending]
        _kept.append(pending)
        if pending:
            queue.async_calls.clear()
        if vars(queue).get("persistent_caller") is not None:
            queue.persistent_caller = None
    callers.append(vars(queue_class).get("_warmup_persistent_caller"))
    if callers[-1] is not None:
        queue_class._warmup_persistent_caller = None
    return [_forget(caller) for caller in callers if caller is not None]


def _mcore(module):
    """megatron-core's worker (on its classes) and the caller that holds it, detached."""
    caller_class = getattr(module, "PersistentAsyncCaller", None)
    queue_class = getattr(module, "AsyncCallsQueue", None)
    if caller_class is None or queue_class is None:
        return []
    processes = [vars(caller_class).get("_persistent_process")]
    for name in ("_persistent_process", "_persistent_queue", "_persistent_preload_q",
                 "_persistent_comp_q"):
        if vars(caller_class).get(name) is not None:
            _kept.append(getattr(caller_class, name))
            setattr(caller_class, name, None)
    caller = vars(queue_class).get("_persistent_caller")
    if caller is not None:
        processes.append(_forget(caller))
        queue_class._persistent_caller = None
    return processes


def _forget(caller):
    """The caller's process, which the caller no longer has (its close does nothing)."""
    _kept.append(caller)
    process = getattr(caller, "process", None)
    if process is not None:
        caller.process = None
    return process


fork.in_child(let_go, f"{CORE}:PersistentAsyncCaller.close")
