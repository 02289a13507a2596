"""What the package knows of NVRx's (and megatron-core's) persistent callers and their workers:
the watch's record of each caller (its outstanding and failed saves, how its worker died),
how to let a dead worker go (reached in either implementation through ``shapes``), and each
queue's finalize mode. Shared by the worker watch, ``release()`` and
prewarm; at exit, workers nobody closed are told to stop (``at_exit``); in a forked child the
parent's are forgotten.
"""

from __future__ import annotations

import collections
import threading
import weakref
from queue import Empty

from ..core import cleanup as _cleanup, fork as _fork, shapes as _shapes
from ..core.detect import CORE
from ..core.log import guard
from . import exit_status as _exit_status, inherited, monitor as _monitor

TYPE_CHECKING = False  # typing.TYPE_CHECKING, without importing typing
if TYPE_CHECKING:
    from typing import Any

#: ``call_idx`` of ``release()``'s own requests (NVRx's count up from 0).
SENTINEL = -7331


class _CallerState:
    """What the watch knows about one persistent caller."""

    __slots__ = ("outstanding", "failed", "completed", "death", "unsent", "aborting", "__weakref__")

    def __init__(self):
        self.outstanding = collections.deque()  # call_idx scheduled on it, not yet finalized
        self.failed = {}  # call_idx -> CheckpointWorkerError: failed before its finalize
        self.completed = set()  # call_idx a dead worker had completed (read from its comp_q)
        self.death = None  # Death of its worker: what that had not completed is lost
        self.unsent = {}  # call_idx -> why its request never reached the worker (``unsent``)
        self.aborting = None  # the thread name of a close(abort=True) of it under way


class Death(
    collections.namedtuple("_Death", "save pid exitcode worker_traceback by", defaults=(None,))
):
    """How a caller's worker died (no exception object: a raised one's frames would hold
    the caller, and with it the dead worker's queues and semaphores, for ever); ``by``: the
    thread name of the ``close(abort=True)`` that ended it, None for a death of its own."""


#: caller -> _CallerState; also the callers at_exit stops
_callers: weakref.WeakKeyDictionary[Any, _CallerState] = weakref.WeakKeyDictionary()
#: _callers: written by the trainer, the resume and prewarm threads
_lock = _fork.renewed(threading.Lock())
#: Callers whose dead worker is no longer tracked. megatron-core keeps its worker and queues
#: on the class: no other caller may reach them through the class (a closed caller's
#: ``__del__`` closes "its" worker whenever the garbage collector runs).
_abandoned: weakref.WeakSet[Any] = weakref.WeakSet()
#: queue -> no_dist of its last finalize call
_no_dist: weakref.WeakKeyDictionary[Any, bool] = weakref.WeakKeyDictionary()


def _forget_the_parent():
    """In a child of ``os.fork()``: the callers the watch saw drop the parent's workers
    (``worker.inherited``, which finds the others), and the watch keeps no record of them."""
    global _callers, _abandoned
    inherited.forget(list(_callers))
    _callers, _abandoned = weakref.WeakKeyDictionary(), weakref.WeakSet()


_fork.in_child(_forget_the_parent, f"{CORE}:PersistentAsyncCaller.close")


def state(caller):
    with _lock:
        state = _callers.get(caller)
        if state is None:
            state = _callers[caller] = _CallerState()
            _fork.at_exit(at_exit)
    return state


def at_exit():
    """At interpreter exit, before multiprocessing joins its non-daemonic children (NVRx
    0.4.1 and 0.5.0 workers: the exit would wait on them for ever) and terminates the
    daemonic ones: ask every worker nobody closed to stop after its current request, and
    forget it, so NVRx's own close from ``__del__`` later has nothing to wait on. Nothing
    is finalized (that would take collectives)."""
    with _lock:
        callers = list(_callers.items())
    for caller, state in callers:
        process = _monitor.started_process(process_of(caller))
        if process is None or state.death is not None:
            continue
        requests = queues_of(caller)[0]
        if requests is not None and alive(process):
            try:
                requests.put("DONE")
            except (OSError, ValueError):  # a closed queue: nothing to tell it
                pass
        forget_process(caller, process)


# -- the two implementations (``shapes``), as the watch sees them -------------------------------


def process_of(caller):
    """The caller's worker process (None for one whose dead worker is no longer tracked); its
    status is read by one thread at a time (``exit_status``)."""
    if caller is None or caller in _abandoned:
        return None
    return _exit_status.one_reader(getattr(caller, "process", None))


def queues_of(caller):
    """``(request queue, preload queue, completion queue)`` of the caller (None for a caller
    whose dead worker is no longer tracked)."""
    if caller is None or caller in _abandoned:
        return None, None, None
    return _shapes.worker_queues(caller)


def dead(process):
    """Has ``process`` (a ``multiprocessing`` process, or None) started, and exited?"""
    process = _monitor.started_process(process)
    return process is not None and process.exitcode is not None


def alive(process):
    """Has ``process`` (a ``multiprocessing`` process, or None) started, and not exited?"""
    process = _monitor.started_process(process)
    return process is not None and process.exitcode is None


# -- wrappers -------------------------------------------------------------------------------


def finalized_with(queue, no_dist):
    """Note the ``no_dist`` of a ``maybe_finalize_async_calls`` call on ``queue``."""
    with _lock:
        _no_dist[queue] = no_dist


def known(caller):
    """The record of ``caller``, if the watch has one (``state`` makes one)."""
    return _callers.get(caller)


def finalize_no_dist(queue):
    """``no_dist`` of the last ``maybe_finalize_async_calls`` on ``queue`` (before any:
    NVRx's default, False): how a finalize the package makes for the user runs."""
    with _lock:
        return _no_dist.get(queue, False)


def abandon(caller):
    """Let a dead worker go: keep the completions it sent, close its queues (no feeder
    thread may hold up the exit, nor their semaphores outlive them), reap it, and clear
    what the trainer believed it cached."""
    process = process_of(caller)
    comp_q = queues_of(caller)[2]
    known = _callers.get(caller)
    completed = known.completed if known is not None else set()
    while comp_q is not None:
        try:
            item = comp_q.get_nowait()
        except (Empty, OSError, ValueError, EOFError):
            break
        if isinstance(item, int) and item != SENTINEL:
            completed.add(item)
    for q in queues_of(caller):
        if q is not None:
            try:
                q.cancel_join_thread()
                q.close()
            except (OSError, ValueError, AttributeError):  # closed as far as it goes
                pass
    if _monitor.started_process(process) is not None:
        try:
            process.join(1.0)
        except (AssertionError, ValueError, OSError):  # forgotten all the same
            pass
    forget_process(caller, process)
    with guard("nvrx_ipc_fix.worker.registry", own=True):  # a failed cleanup is the package's
        if _cleanup.cached_key_count():
            _cleanup.clear_trainer_caches("the checkpoint worker failed")


def forget_process(caller, process):
    """The caller no longer has a worker (its close does nothing)."""
    with _lock:
        _abandoned.add(caller)
    _shapes.detach_worker(caller, process)


def abandoned(caller):
    """Is the caller's dead worker no longer tracked (``abandon``)? Its queues are closed."""
    return caller is not None and caller in _abandoned


def forget_caller(queue, caller):
    """The queue starts a fresh caller (and worker) at its next save."""
    _shapes.detach_caller(queue, caller)


def aborted_by(caller):
    """The thread name of the ``close(abort=True)`` that is ending, or ended, ``caller``'s
    worker; None where none did."""
    known = None if caller is None else _callers.get(caller)
    if known is None:
        return None
    death = known.death
    return known.aborting or (death.by if death is not None else None)


def release_join(joinable):
    """End ``joinable.join()`` in this process: count its unfinished tasks down to zero."""
    if joinable is None:
        return
    cond, unfinished = joinable._cond, joinable._unfinished_tasks
    if not cond.acquire(timeout=2.0):  # the dead worker died holding it
        raise RuntimeError("the queue's lock is held by the dead worker")
    try:
        while unfinished.acquire(False):
            pass
        cond.notify_all()
    finally:
        cond.release()


def describe_exit(code):
    """multiprocessing's exit code in words."""
    if code is None or code == -1:
        return "exit status unknown"
    if code < 0:
        import signal

        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}" + (": an uncaught exception" if code == 1 else "")
