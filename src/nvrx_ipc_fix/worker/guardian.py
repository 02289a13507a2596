"""The guardian: a small process per trainer process that ends, when the trainer dies by any
signal (the OOM killer, a segfault, a launcher's SIGKILL), every process the package or NVRx
started for it: the checkpoint worker (idle, writing, suspended), NVRx's process of a save
on a queue that is not persistent, NVRx's results-queue manager, the standby and what it
forked, and their descendants. Without it they outlive the trainer: nothing in them watches
the trainer, and the standby and its workers keep each other alive.

It is started by the first ``guard`` (never at import or activation), as
``python -S -I worker/guardian_process.py <trainer pid>``, with every descriptor but a pipe
closed (``close_fds``; stdout and stderr to ``/dev/null``: it holds none of the trainer's
pipes), and watches the trainer through the kernel (a pidfd, Linux 5.3+; without one, the
pipe's EOF). ``guard`` writes ``<pid> <start time>`` to the pipe. A guarded process that ends
is forgotten there; one the trainer leaves when it dies is killed with its descendants. At
the trainer's clean exit the guardian sees the exit too and kills what is left (nothing,
normally: the package's and multiprocessing's exit handlers stop the workers). A guardian
that died is replaced by the next ``guard``, which hands the new one what is still alive.

A child made by ``os.fork()`` closes its copy of the pipe and forgets the guardian (a
forked worker must not keep the trainer's pipe open: without pidfds that EOF is the
trainer's death); it starts its own if it starts workers. ``status().guardian`` says what
runs and why not.
"""

from __future__ import annotations

import os
import subprocess
import threading
import weakref

from ..core import fork as _fork, shapes as _shapes, state as _state
from ..core.log import hook_failed, logger
from ..core.status import GUARDIAN_NOT_STARTED
from .guardian_process import start_time

TYPE_CHECKING = False  # typing.TYPE_CHECKING, without importing typing
if TYPE_CHECKING:
    from typing import Any

PROGRAM = os.path.join(os.path.dirname(os.path.abspath(__file__)), "guardian_process.py")


class _Guardian(subprocess.Popen):
    """The guardian's ``Popen``: it outlives this object by design (it ends after the
    trainer), so collecting the object warns of nothing and waits for nothing."""

    def __del__(self):
        pass


_lock = threading.Lock()
_process = None  # the _Guardian running for this process
_pipe = None  # the write end of its stdin (a descriptor)
_guarded: dict[int, float | None] = {}  # pid -> start time, of what the guardian was told
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
    try:
        with _lock:
            _guard(process)
    except Exception as exc:  # noqa: BLE001 the package's defect: said once
        _failure = f"{type(exc).__name__}: {exc}"
        hook_failed(__name__, exc)


def adopt(queue):
    """After NVRx's ``schedule_async_request`` on ``queue``: guard the processes of that
    save (the queue's persistent worker, or NVRx's process of this save) and the writers'
    results-queue managers; a guardian that died is replaced. Never raises."""
    global _adopted
    try:
        processes = tuple(_shapes.save_processes(queue))
        if processes == _adopted and _process is not None and _process.poll() is None:
            return  # the same objects as the last save's, guarded by a live guardian
        if _process is not None:
            with _lock:
                _running()  # one that died is replaced, and told what is still alive
    except Exception as exc:  # noqa: BLE001 the package's defect: this save unguarded, said once
        hook_failed(__name__, exc)
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
        except BrokenPipeError:  # it died since: the next attempt starts another
            if attempt == 2:
                raise
        except BlockingIOError as error:
            raise RuntimeError(
                f"the guardian (pid {_process.pid}) does not read its pipe") from error


def _running():
    """Start the guardian if none runs; a new one is told what is still alive."""
    global _process, _pipe, _started
    if _process is not None and _process.poll() is None:
        return
    if _process is not None:
        logger.warning("nvrx_ipc_fix: the guardian (pid %s) ended (exit status %s); another "
                       "takes over", _process.pid, _process.returncode)
        os.close(_pipe)
        _process = _pipe = None
    from multiprocessing import spawn  # the interpreter multiprocessing spawns with

    read, write = os.pipe()
    try:
        _process = _Guardian([spawn.get_executable(), "-S", "-I", PROGRAM, str(os.getpid())],
                             stdin=read, stdout=subprocess.DEVNULL,
                             stderr=subprocess.DEVNULL, close_fds=True, cwd="/")
    except BaseException:
        os.close(write)
        raise
    finally:
        os.close(read)
    os.set_blocking(write, False)
    _pipe = write
    _started += 1
    for pid, start in list(_guarded.items()):
        if start_time(pid) == start:
            os.write(_pipe, f"{pid} {start}\n".encode())
        else:
            del _guarded[pid]


@_state.on_status("guardian")
def describe():
    """For ``status()``: the guardian's pid and how many live processes it guards, or why
    none runs; the last defect."""
    process = _process
    failed = f"; failed ({_failure}): what was started since may outlive this process" \
        if _failure else ""
    if process is None:
        return (GUARDIAN_NOT_STARTED if not _failure else "not running") + failed
    alive = sum(start_time(pid) == start for pid, start in list(_guarded.items()))
    state = (f"running (pid {process.pid})" if process.poll() is None else
             f"ended (pid {process.pid}, exit status {process.returncode}); the next process "
             "to guard starts another")
    replaced = f"; {_started - 1} replaced" if _started > 1 else ""
    return f"{state}, guarding {alive} process(es){replaced}{failed}"


def _forget():
    """In a child of ``os.fork()``: the parent's guardian is not this child's. Its pipe is
    closed here (a raw descriptor, never a file object: no lock of the parent's is taken)."""
    global _lock, _process, _pipe, _guarded, _seen, _started, _failure, _adopted
    if _pipe is not None:
        os.close(_pipe)
    if _process is not None:
        _inherited.append(_process)
    _lock, _process, _pipe, _guarded, _seen = threading.Lock(), None, None, {}, weakref.WeakSet()
    _started, _failure, _adopted = 0, None, ()


_fork.in_child(_forget)
