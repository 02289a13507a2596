"""Strategy ``suspend``: the NVRx checkpoint worker keeps its process, its pinned host memory
and its warm caches through inference, with nothing of it on the device.

``release()`` flushes first (the worker drops its CUDA IPC mappings: a process that maps
another's memory may never come back from a lock), then ``suspend`` locks the worker through
the CUDA driver's process checkpoint API (``worker.cuda_checkpoint``) and checkpoints it: its
device state moves to host memory. ``resume`` restores and unlocks it: at the onload
(``offloading()``'s exit, NeMo RL's and slime's onload points, ``prewarm()``), in a thread
beside the training step, and in any case before the worker is given anything (a save, a
close: ``ready``), which waits for that thread or resumes in line. At exit and at
``deactivate()`` every worker is resumed.

The driver is probed once (library, symbols, version; ``unavailable``); each worker's state
is read before its lock. Every driver call has a deadline (the release timeout; the lock also
``LOCK_TIMEOUT`` in the driver). A suspend or resume that fails while the worker lives is the
package's own defect: the worker is unlocked and closed, or, where that fails too, killed;
the queue's next save starts a fresh worker (``ended``: the onload prewarms it, as after
``restart``), one ``RuntimeWarning`` says why, and the automatic release uses ``restart``
from then on. A worker that died while suspended is a worker death like any other: the worker
watch raises it from the next save's finalize.
"""

from __future__ import annotations

import sys
import threading
import time
import weakref

from ..core import config as _config, fork as _fork, log as _log, state as _state
from ..core.detect import CORE
from ..core.errors import STOP
from ..core.fix_names import FIXES
from ..core.log import logger
from . import cuda_checkpoint as _cc, registry as _workers

TYPE_CHECKING = False  # typing.TYPE_CHECKING, without importing typing
if TYPE_CHECKING:
    from typing import Any

FIX_NOT_ACTIVE = "the suspend fix is not active (see nvrx_ipc_fix.status())"
LOCK_TIMEOUT = 10.0  # seconds the driver may take to lock an idle worker
UNDO_TIMEOUT = 10.0  # seconds for each call that undoes a failed suspend


class _Suspension:
    """One suspended worker."""

    __slots__ = ("queue", "caller", "process", "thread", "resumed", "began")

    def __init__(self, queue, caller, process):
        self.queue = weakref.ref(queue)
        self.caller = caller
        self.process = process
        self.began = time.monotonic()
        self.thread = None  # the resume in the background, once started
        self.resumed = threading.Event()


_lock = _fork.renewed(threading.Lock())
_suspended: dict[int, _Suspension] = {}  # pid -> _Suspension, until resumed
#: queues whose worker a failed suspend or resume ended
_ended: weakref.WeakSet[Any] = weakref.WeakSet()
_driver = None
_why = None  # why suspend is not used in this process, once known
_counts = {"suspends": 0, "resumes": 0}
#: The last suspend's and resume's timings: ``pid``, ``checkpoint_s`` (lock and checkpoint),
#: ``restore_s`` (restore and unlock), ``resumed_at`` (``time.perf_counter()``). Read by
#: ``benchmarks/restart_wait.py`` and the tests.
last: dict[str, float] = {}


def unavailable():
    """Why ``suspend`` cannot be used in this process, or None: the fix that resumes the
    worker must be active, and the driver work. Probes the driver once; where this process
    uses CUDA, a driver without the API is one ``RuntimeWarning``."""
    global _driver, _why
    missing = _fix_missing()
    if missing:
        return missing
    with _lock:
        if _driver is not None or _why is not None:
            return _why
        _driver, _why = _cc.load()
    if _why is not None:
        message = f"nvrx_ipc_fix: the release uses restart instead of suspend: {_why}"
        logger.warning("%s", message)
        if _why != _cc.NO_CUDA:
            _log.warn(message, ("suspend", "unavailable"))
    return _why


def _fix_missing():
    """Why the fix that resumes a suspended worker is not in place, or None."""
    if not all(
        _state.installed("suspend", attr)
        for attr in ("AsyncCallsQueue.schedule_async_request", "PersistentAsyncCaller.close")
    ):
        return FIX_NOT_ACTIVE
    return None


def _fix_turned_off():
    """Before NVRx's import, while the fix's targets wait for it: why it will not be in place
    (turned off by ``NVRX_IPC_FIX_DISABLE``), or None."""
    off = _config.disabled_fixes(tuple(FIXES))
    return None if off is not None and "suspend" not in off else FIX_NOT_ACTIVE


def probe():
    """Open the driver now, whether or not this process uses CUDA, as the first suspend of a
    job on this machine would: for the command line (``doctor``, the status), which runs no
    job. A trainer's own ``status()`` never opens the driver before its first suspend."""
    global _driver, _why
    with _lock:
        if _driver is None and _why is None:
            _driver, _why = _cc.load(in_use=False)


def automatic_release():
    """The automatic release's strategy in force and why, in the one wording ``status()``,
    ``doctor`` and ``python -m nvrx_ipc_fix`` (``--no-import`` too) share."""
    chosen = _config.auto_strategy()
    if chosen != "suspend":
        return f"{chosen} ({_config.STRATEGY})"
    why = (_fix_missing() if CORE in sys.modules else _fix_turned_off()) or _why
    if why is not None:
        return f"restart: suspend is not used here ({why})"
    if _driver is not None:
        return (
            f"suspend: the CUDA driver's process checkpoint API works here (driver API "
            f"{_driver.version()})"
        )
    from ..core.status import SUSPEND_NOT_PROBED  # status()'s types: loaded when it is asked

    return SUSPEND_NOT_PROBED


def in_force(strategy):
    """``strategy``, or ``restart`` for ``suspend`` where it is known to be unavailable (the
    fix is off, or the driver failed). Does not probe the driver."""
    if strategy == "suspend" and (_why is not None or _fix_missing()):
        return "restart"
    return strategy


def suspended(queue):
    """Is a worker of ``queue`` suspended (nothing of it on the device)?"""
    with _lock:
        return any(s.queue() is queue for s in _suspended.values())


def mark_ended(queue):
    """``queue``'s worker was stopped instead of suspended: its onload starts the next."""
    with _lock:
        _ended.add(queue)


def ended(queue):
    """Did a failed suspend or resume end ``queue``'s worker since its last onload? (Forgets.)"""
    with _lock:
        found = queue in _ended
        _ended.discard(queue)
        return found


def suspend(queue, caller, timeout, held=None):
    """Lock and checkpoint ``caller``'s idle, flushed worker. None when it is suspended; else
    why not, the worker then closed or killed (``queue``'s next save starts a fresh one) and
    ``suspend`` off in this process. What NVRx's close raises then goes to ``held`` (the
    release's: raised by its caller once the release is done), else it is raised."""
    process = caller.process
    pid, began = process.pid, time.monotonic()
    deadline = began + timeout
    settled = False
    try:
        state = _driver.state(pid, _left(deadline))
        if state != _cc.RUNNING:
            raise _cc.DriverError(
                f"its CUDA state is {_cc.STATES.get(state, state)}, not running:", state
            )
        _driver.lock(pid, min(LOCK_TIMEOUT, _left(deadline)))
        _driver.checkpoint(pid, _left(deadline))
        settled = True
    except (_cc.DriverError, _cc.Timeout) as exc:
        settled = True
        if process.exitcode is not None:  # a worker death: the watch reports it at the next save
            return (
                f"the checkpoint worker (pid {pid}) died during its suspend "
                f"({_workers.describe_exit(process.exitcode)})"
            )
        why = f"the suspend of the checkpoint worker (pid {pid}) failed ({exc})"
        # a call past its deadline may still lock the worker later: never close it then
        _end(queue, caller, process, why, undo=not isinstance(exc, _cc.Timeout), held=held)
        return why
    finally:
        if not settled:  # interrupted: its state is unknown, and no one resumes it
            _finish(queue, caller, process, undo=False)
    with _lock:
        _suspended[pid] = _Suspension(queue, caller, process)
        _counts["suspends"] += 1
        last.clear()
        last.update(pid=pid, checkpoint_s=time.monotonic() - began)
    _fork.at_exit(resume, None, True)
    logger.info(
        "suspended the NVRx checkpoint worker (pid %s) in %.2f s: nothing of it is on "
        "the device until it resumes",
        pid,
        time.monotonic() - began,
    )
    return None


def resume(queue=None, wait=True):
    """Restore and unlock the suspended workers of ``queue`` (None: all): in line, or with
    ``wait=False`` each in a thread that ``ready`` waits for."""
    with _lock:
        mine = [s for s in _suspended.values() if queue is None or s.queue() is queue]
    _resuming(mine, wait)


def ready(queue=None, caller=None):
    """Before ``queue``'s worker (or ``caller``'s) is given anything: resume it in line, or
    wait for its resume in the background."""
    with _lock:
        found = [
            s
            for s in _suspended.values()
            if (caller is not None and s.caller is caller)
            or (queue is not None and s.queue() is queue)
        ]
    try:
        _resuming(found, wait=True)
    except RuntimeError as exc:  # no thread to resume in: no worker may stay suspended
        for s in found:
            if s.thread is None:  # its resume could not start: end it, as a failed resume
                with _lock:
                    _suspended.pop(s.process.pid, None)
                _end(
                    s.queue(),
                    s.caller,
                    s.process,
                    f"the resume of the checkpoint worker "
                    f"(pid {s.process.pid}) could not run ({type(exc).__name__}: {exc})",
                    undo=False,
                )
                s.resumed.set()


def _resuming(suspensions, wait):
    """Start the resume of each of ``suspensions`` not yet started; with ``wait``, wait for
    each (bounded: every driver call has the release timeout)."""
    timeout = _config.release_timeout()
    with _lock:
        for s in suspensions:
            if s.thread is None:
                thread = threading.Thread(
                    target=_resume, args=(s, timeout), daemon=True, name="nvrx_ipc_fix-resume"
                )
                thread.start()
                s.thread = thread
    if wait:
        for s in suspensions:
            s.resumed.wait()


def _resume(s, timeout):
    """The resume thread: restore and unlock; a live worker that does not come back is
    killed (its state is unknown), one that died is left to the watch."""
    process, pid = s.process, s.process.pid
    began = time.monotonic()
    deadline = began + timeout
    failed = None
    try:
        if process.exitcode is None:
            _driver.restore(pid, _left(deadline))
            _driver.unlock(pid, _left(deadline))
    except (_cc.DriverError, _cc.Timeout) as exc:
        failed = exc
    try:  # still suspended for ``ready``, which waits for ``resumed``, until it is ended
        if process.exitcode is not None:
            logger.warning(
                "the NVRx checkpoint worker (pid %s) died while suspended (%s); "
                "its queue's next save reports it",
                pid,
                _workers.describe_exit(process.exitcode),
            )
        elif failed is not None:
            _end(
                s.queue(),
                s.caller,
                process,
                f"the resume of the checkpoint worker (pid {pid}) failed ({failed})",
                undo=False,
            )
        else:
            restore_s = time.monotonic() - began
            with _lock:
                _counts["resumes"] += 1
                last.update(pid=pid, restore_s=restore_s, resumed_at=time.perf_counter())
            logger.info(
                "resumed the NVRx checkpoint worker (pid %s) in %.2f s, %.2f s after its suspend",
                pid,
                restore_s,
                time.monotonic() - s.began,
            )
    finally:
        with _lock:
            _suspended.pop(pid, None)
        s.resumed.set()


def _end(queue, caller, process, why, undo, held=None):
    """After a failed suspend or resume of a live worker: end it (``_finish``); ``suspend``
    is off from now on, with one warning."""
    global _why
    _why = f"{why}; the worker was killed"
    try:
        _why = f"{why}; the worker was {_finish(queue, caller, process, undo, held)}"
    finally:
        message = (
            f"nvrx_ipc_fix: {_why}. Its queue's next save starts a fresh worker; the "
            f"automatic release uses restart from now on"
        )
        logger.warning("%s", message)
        _log.warn(message, ("suspend", "failed"))


def _finish(queue, caller, process, undo, held=None):
    """End a worker whose suspend or resume did not complete: with ``undo``, bring it back to
    running and close it as ``restart`` does; where that fails, or without ``undo``, kill it.
    The queue's next save starts a fresh worker (the onload prewarms it). Returns how. What
    NVRx's close raises goes to ``held`` where there is one."""
    pid = process.pid
    how = "killed"
    if undo:
        try:
            state = _driver.state(pid, UNDO_TIMEOUT)
            if state == _cc.CHECKPOINTED:
                _driver.restore(pid, UNDO_TIMEOUT)
            if state in (_cc.CHECKPOINTED, _cc.LOCKED):
                _driver.unlock(pid, UNDO_TIMEOUT)
            how = "closed" if _driver.state(pid, UNDO_TIMEOUT) == _cc.RUNNING else how
        except (_cc.DriverError, _cc.Timeout):
            pass
    try:
        if how == "closed" and queue is not None:
            try:
                queue.close()
            except BaseException as failure:  # noqa: BLE001 NVRx's: not the package's to catch
                if held is None or isinstance(failure, STOP):
                    raise
                held.append(failure)
        else:
            process.kill()
            process.join(5.0)
    finally:
        _workers.abandon(caller)
        if queue is not None:
            _workers.forget_caller(queue, caller)
            with _lock:
                _ended.add(queue)
    return how


def _left(deadline):
    left = deadline - time.monotonic()
    if left <= 0:
        raise _cc.Timeout("the deadline passed")
    return left


@_state.on_status("suspend")
def describe():
    """For ``status()``: the automatic release's strategy in force and why; the counts."""
    return (
        f"{automatic_release()}; {_counts['suspends']} suspend(s), {_counts['resumes']} "
        f"resume(s), {len(_suspended)} suspended now"
    )


def _forget():
    """In a child of ``os.fork()``, or at ``reset()``: no worker is suspended by us."""
    global _suspended, _ended, _driver, _why
    _suspended, _ended = {}, weakref.WeakSet()
    _driver = _why = None
    _counts.update(suspends=0, resumes=0)
    last.clear()


_fork.in_child(_forget)
# deactivate() resumes first: without the fix, nothing would resume them
_state.on_deactivate(lambda: resume(wait=True), first=True)
