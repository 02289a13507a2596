"""The guardian: a small process per trainer process that ends, when the trainer dies by any
signal (the OOM killer, a segfault, a launcher's SIGKILL), every process the package or NVRx
started for it: the checkpoint worker (idle, writing, suspended), NVRx's process of a save
on a queue that is not persistent, NVRx's results-queue manager, the standby and what it
forked, and their descendants. Without it they outlive the trainer: nothing in them watches
the trainer, and the standby and its workers keep each other alive.

It is started by the first ``guard`` (never at import or activation), as
``python -S -I worker/guardian_process.py <trainer pid> <private directory>``, with every
descriptor but its three closed (``close_fds``: it holds none of the trainer's pipes): stdin a
pipe from the trainer, stdout a pipe to which it writes one byte once it watches, stderr a file
in the package's private directory (``inside.directory()``). It watches the trainer through the
kernel (a pidfd, Linux 5.3+; without one, the pipe's EOF). ``guard`` writes ``<pid> <start
time>`` to the pipe. A guarded process that ends is forgotten there; one the trainer leaves when
it dies is killed with its descendants, and then the private directory (the guardian's stderr,
what the workers left) is removed. At the trainer's clean exit the guardian sees the exit too
and kills what is left (nothing, normally: the package's and multiprocessing's exit handlers
stop the workers, and the directory is removed by then). A guardian that was killed is replaced
by the next ``guard``, which sends the new one the pids of the processes still alive. One that
ended by itself or before it watched could not run here (a Python that cannot start ``-S -I``,
no process to spare): none is started again in this process, one ``RuntimeWarning`` gives its
exit status and stderr, and saves go on as NVRx's.

A child made by ``os.fork()`` closes its copy of the pipe and drops its record of the guardian
(a forked worker must not keep the trainer's pipe open: without pidfds that EOF is the trainer's
death); it starts its own if it starts workers. ``status().guardian`` says what runs and why
not.
"""

from __future__ import annotations

import os
import subprocess
import threading
import weakref

from ..core import fork as _fork, shapes as _shapes, state as _state
from ..core import log as _log
from ..core.log import logger, warn
from ..core.status import GUARDIAN_NOT_STARTED
from .guardian_process import start_time
from .inside import directory

TYPE_CHECKING = False  # typing.TYPE_CHECKING, without importing typing
if TYPE_CHECKING:
    from typing import Any

PROGRAM = os.path.join(os.path.dirname(os.path.abspath(__file__)), "guardian_process.py")


class _Guardian(subprocess.Popen):
    """The guardian's ``Popen``: it outlives this object by design (it ends after the
    trainer), so collecting the object warns of nothing and waits for nothing."""

    def __del__(self):
        pass


_lock = _fork.renewed(threading.Lock())
_process = None  # the _Guardian running for this process
_pipe = None  # the write end of its stdin (a descriptor)
_ready = None  # the read end of its stdout, where it writes a byte once it is watching
_broken = None  # why no guardian can run in this process: none is started again
_guarded: dict[int, float | None] = {}  # pid -> start time, of each process sent to the guardian
#: the process objects guarded (their pid is not read again)
_seen: weakref.WeakSet[Any] = weakref.WeakSet()
_started = 0  # guardians started by this process
_failure = None  # the last defect, for status()
_adopted = ()  # the processes the last adopt guarded
#: a forked child's copy of its parent's guardian: never waited for
_inherited: list[subprocess.Popen[bytes]] = []


def guard(process):
    """Have the guardian kill ``process`` (a process object with ``pid``, or a pid) and its
    descendants if this process dies first; starts the guardian the first time. Never
    raises: a defect of the package warns once and ``status().guardian`` says why."""
    global _failure
    with _log.guard(__name__) as it:
        try:
            with _lock:
                _guard(process)
        except _CannotRun:  # already warned once, when it was first found
            pass
    if it.failed:
        _failure = f"{type(it.failed).__name__}: {it.failed}"


def adopt(queue):
    """After NVRx's ``schedule_async_request`` on ``queue``: guard the processes of that
    save (the queue's persistent worker, or NVRx's process of this save) and the writers'
    results-queue managers; a guardian that died is replaced. Never raises."""
    global _adopted
    if _broken:
        return
    with _log.guard(__name__) as it:  # a defect: this save unguarded
        try:
            processes = tuple(_shapes.save_processes(queue))
            if processes == _adopted and _process is not None and _process.poll() is None:
                return  # the same objects as the last save's, guarded by a live guardian
            if _process is not None:
                with _lock:
                    _running()  # a dead guardian is replaced; the new one gets the pids still alive
        except _CannotRun:
            return
    if it.failed:
        return
    for process in processes:
        guard(process)
    _adopted = processes


def _guard(process):
    if process is None or (not isinstance(process, int) and process in _seen):
        return
    pid = process if isinstance(process, int) else process.pid
    if pid is None:  # not started yet
        return
    start = start_time(pid)
    if start is not None and pid != os.getpid() and _guarded.get(pid) != start:
        _tell(pid, start)
        _guarded[pid] = start
    if pid is not process:
        _seen.add(process)


def _tell(pid, start):
    """Tell the guardian (started, or replaced if it died) to guard ``pid``."""
    for attempt in (1, 2):
        _running()
        try:
            os.write(_pipe, f"{pid} {start}\n".encode())
            return
        except BrokenPipeError:  # it ended since: the next attempt starts another
            if attempt == 2:
                raise
            _process.wait(10)  # it closed its stdin as it exits: its status is coming
        except BlockingIOError as error:
            raise RuntimeError(
                f"the guardian (pid {_process.pid}) does not read its pipe"
            ) from error


class _CannotRun(Exception):
    """No guardian can run in this process (``_broken`` says why)."""


def _running():
    """Start the guardian if none runs; a new one gets the pids still alive. Raises
    ``_CannotRun`` where none can run here."""
    global _process, _pipe, _ready, _started
    if _process is not None and _process.poll() is None:
        return
    if _process is not None:
        _ended()
    if _broken:
        raise _CannotRun(_broken)
    from multiprocessing import spawn  # the interpreter multiprocessing spawns with

    read, write = os.pipe()
    ready, said = os.pipe()
    started = False
    try:
        private = directory()
        with open(os.path.join(private, "guardian.stderr"), "ab") as stderr:
            _process = _Guardian(
                [spawn.get_executable(), "-S", "-I", PROGRAM, str(os.getpid()), private],
                stdin=read,
                stdout=said,
                stderr=stderr,
                close_fds=True,
                cwd="/",
            )
        started = True
    except OSError as error:  # no such interpreter, no process to spare
        _cannot_run(f"{type(error).__name__}: {error}")
        raise _CannotRun(_broken) from error
    finally:
        os.close(read)
        os.close(said)
        if not started:
            os.close(write)
            os.close(ready)
    os.set_blocking(write, False)
    os.set_blocking(ready, False)
    _pipe, _ready = write, ready
    _started += 1
    for pid, start in list(_guarded.items()):
        if start_time(pid) == start:
            os.write(_pipe, f"{pid} {start}\n".encode())
        else:
            del _guarded[pid]


def _ended():
    """The guardian has ended: forget it. One that was killed after it watched is replaced
    by the next start; one that ended by itself (it never does while this process lives) or
    before it watched could not run here (``_cannot_run``)."""
    global _process, _pipe, _ready
    try:
        watched = os.read(_ready, 1) == b"."
    except BlockingIOError:
        watched = False
    process = _process
    os.close(_pipe)
    os.close(_ready)
    _process = _pipe = _ready = None
    if watched and process.returncode < 0:
        logger.warning(
            "nvrx_ipc_fix: the guardian (pid %s) was killed (signal %s); another takes over",
            process.pid,
            -process.returncode,
        )
        return
    path = os.path.join(directory(), "guardian.stderr")
    try:
        with open(path, "rb") as stderr:
            said = stderr.read()[-600:].decode(errors="replace").strip()
    except OSError:
        said = ""
    _cannot_run(
        f"the guardian (pid {process.pid}) ended with exit status "
        f"{process.returncode} {'after' if watched else 'before'} it watched; its "
        f"stderr ({path}): {said or '(empty)'}"
    )


def _cannot_run(reason):
    """No guardian can run in this process: say so once, and start none again."""
    global _broken
    _broken = reason
    message = (
        f"nvrx_ipc_fix: the guardian could not run ({reason}). None is started again "
        f"in this process; its checkpoint workers may outlive it if it is killed"
    )
    logger.warning("%s", message)
    warn(message, ("guardian", "cannot run"))


@_state.on_status("guardian")
def describe():
    """For ``status()``: the guardian's pid and how many live processes it guards, or why
    none runs; the last defect."""
    process = _process
    if _broken:
        return f"cannot run: {_broken}; none is started again in this process"
    failed = (
        f"; failed ({_failure}): what was started since may outlive this process"
        if _failure
        else ""
    )
    if process is None:
        return (GUARDIAN_NOT_STARTED if not _failure else "not running") + failed
    alive = sum(start_time(pid) == start for pid, start in list(_guarded.items()))
    state = (
        f"running (pid {process.pid})"
        if process.poll() is None
        else f"ended (pid {process.pid}, exit status {process.returncode}); the next process "
        "to guard starts another, or says why none can run"
    )
    replaced = f"; {_started - 1} replaced" if _started > 1 else ""
    return f"{state}, guarding {alive} process(es){replaced}{failed}"


def _forget():
    """In a child of ``os.fork()``: the parent's guardian is not this child's. Its pipe is
    closed here (a raw descriptor, never a file object: no lock of the parent's is taken)."""
    global _process, _pipe, _ready, _broken, _guarded, _seen, _started, _failure, _adopted
    for fd in (_pipe, _ready):
        if fd is not None:
            os.close(fd)
    if _process is not None:
        _inherited.append(_process)
    _process, _pipe, _ready, _broken = None, None, None, None
    _guarded, _seen, _started, _failure, _adopted = {}, weakref.WeakSet(), 0, None, ()


_fork.in_child(_forget)
