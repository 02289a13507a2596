"""The monitor: one daemon thread that unblocks the trainer's waits on a dead checkpoint
worker and reports waits that make no progress.

A *wait* is a stretch of trainer code that waits on its persistent checkpoint worker (the
preload handshake of a save, a blocking finalize, a close) or in NVRx's finalize all-reduce.
The waiting code registers it with ``watching()``, which only appends it to a list: an
ordinary save pays no system call and wakes no thread. The thread, started with the first
wait, looks at the list every ``tick`` (one second) and blocks in
``multiprocessing.connection.wait`` on the sentinels of the workers it found there, so a
death is seen within a tick: it records the exit code and calls the wait's ``unblock``.
For a wait older than a tick it also samples progress (CPU time and I/O, from ``/proc``, of
the worker, its descendants and the processes it may wait on: ``watched``); after
``NVRX_IPC_FIX_STALL_TIMEOUT`` seconds without any (for an all-reduce: without an end) it
logs one ERROR, and one WARNING when the wait goes on or ends.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from contextlib import contextmanager
from multiprocessing import connection

from ..core import config as _config, fork as _fork, shapes as _shapes
from ..core.detect import FS, MCORE_FS
from ..core.log import guard, logger
from . import exit_status as _exit_status
from .guardian_process import children, stat_fields


class Wait:
    """One registered wait (see the module doc)."""

    __slots__ = (
        "where",
        "process_of",
        "unblock",
        "hint",
        "started",
        "exitcode",
        "progress",
        "progress_at",
        "sampled_at",
        "stalled_at",
        "ended",
    )

    def __init__(self, where, process_of, unblock, hint):
        self.where = where  # "the preload handshake of save #3", shown in log lines
        self.process_of = process_of  # () -> the worker's multiprocessing.Process, or None
        self.unblock = unblock  # called from the monitor thread when the worker has died
        self.hint = hint  # the likely cause, for the stall ERROR of a wait with no worker
        self.started = self.progress_at = self.sampled_at = time.monotonic()
        self.exitcode = None  # set when the worker died during the wait
        self.progress = None
        self.stalled_at = None  # when the stall ERROR was logged
        self.ended = False


def dist_rank():
    """This process's rank, or None while ``torch.distributed`` is not initialized."""
    dist = sys.modules.get("torch.distributed")
    try:
        if dist is not None and dist.is_available() and dist.is_initialized():
            return dist.get_rank()
    except (RuntimeError, ValueError):  # torch.distributed cannot say: no rank
        pass
    return None


def rank():
    """This process's rank in torch.distributed, else $RANK, else None."""
    found = dist_rank()
    value = os.environ.get("RANK", "")
    return found if found is not None else (int(value) if value.isdigit() else None)


def started_process(process):
    """``process`` if it is a started ``multiprocessing.Process``, else None; from now on its
    status is read by one thread at a time (``exit_status``)."""
    if getattr(process, "_popen", None) is None:
        return None
    return _exit_status.one_reader(process)


def exitcode(process, settle=1.0):
    """The exit code of a process whose sentinel fired (waits up to ``settle`` for the reap)."""
    try:
        process.join(settle)
        return process.exitcode
    except (AssertionError, ValueError, OSError):  # not our child, or closed: unknown
        return None


class _Monitor:
    """Registering a wait costs a list append: the thread, once started, looks at the list
    every tick and blocks on the sentinels of the workers it found there."""

    def __init__(self):
        self.lock = threading.Lock()
        self.waits = []
        self.thread = None

    def add(self, wait):
        with self.lock:
            self.waits.append(wait)
            if self.thread is None or not self.thread.is_alive():
                self.thread = threading.Thread(
                    target=self._run, name="nvrx_ipc_fix-monitor", daemon=True
                )
                self.thread.start()

    def remove(self, wait):
        with self.lock:
            wait.ended = True
            self.waits.remove(wait)
        if wait.stalled_at is not None:
            self.recovered(
                wait, "%s ended after %.0f s", wait.where, time.monotonic() - wait.started
            )

    def recovered(self, wait, message, *args):
        """The WARNING that follows a stall ERROR, once per stall."""
        with self.lock:
            if wait.stalled_at is None:
                return
            wait.stalled_at = None
        logger.warning("rank %s: " + message, rank(), *args)

    def _run(self):
        """Look every tick, for ever: an error in one look (the package's own defect, a
        setting's warning raised under ``-W error``) is reported and the watch goes on, since
        the waits it watches end only here."""
        while True:
            try:
                self._look()
            except BaseException as exc:  # noqa: BLE001 nothing must end this thread
                self._failed(exc)
                time.sleep(0.05)

    def _look(self):
        with self.lock:
            waits = list(self.waits)
        bound = _config.stall_timeout()
        tick = min(1.0, max(0.05, bound / 4))
        sentinels = {}
        for wait in waits:
            process = started_process(wait.process_of()) if wait.process_of else None
            if process is not None and wait.exitcode is None:
                sentinels[process.sentinel] = (wait, process)
        try:
            ready = connection.wait(list(sentinels), tick) if sentinels else time.sleep(tick)
        except OSError:  # a sentinel closed under us: look again
            return
        for handle in ready or ():
            self._died(*sentinels[handle])
        now = time.monotonic()
        for wait in waits:
            if now - wait.sampled_at >= tick:  # a short wait is never sampled
                wait.sampled_at = now
                self._check_progress(wait, now, bound)

    @staticmethod
    def _failed(exc):
        from ..core.log import hook_failed

        hook_failed("nvrx_ipc_fix.worker.monitor", exc)  # never raises, even with -W error

    def _died(self, wait, process):
        code = exitcode(process)
        with self.lock:  # remove() waits: a wait is unblocked only while it is registered
            if wait.ended:
                # It ended while the thread waited on its worker's sentinel (one tick): the
                # death belongs to what came after (a close(abort=True), a later save), and
                # its ``unblock`` would now reach that save's queues.
                return
            wait.exitcode = -1 if code is None else code  # -1: gone, code unknown
            if wait.unblock is not None:
                with guard("nvrx_ipc_fix.worker.monitor"):  # the death is reported all the same
                    wait.unblock()

    def _check_progress(self, wait, now, bound):
        if wait.exitcode is not None:
            return
        process = started_process(wait.process_of()) if wait.process_of else None
        if process is not None:
            sample = progress(*watched(process))  # None (no /proc): by time alone
            if sample is not None and sample != wait.progress:
                if wait.stalled_at is not None:
                    self.recovered(
                        wait,
                        "the checkpoint worker (pid %s) makes progress again in %s, after %.0f s",
                        process.pid,
                        wait.where,
                        now - wait.progress_at,
                    )
                wait.progress, wait.progress_at = sample, now
                return
        with self.lock:
            if wait.stalled_at is not None or now - wait.progress_at < bound or wait.ended:
                return
            wait.stalled_at = now
        if process is not None:
            logger.error(
                "rank %s: %s has waited %.0f s on the checkpoint worker (pid %s), "
                "which is alive, but neither it nor what it may wait on made "
                "progress (CPU or I/O) for %.0f s: stopped, swapping, or blocked on "
                "storage? (%s=%g s)",
                rank(),
                wait.where,
                now - wait.started,
                process.pid,
                now - wait.progress_at,
                _config.STALL_TIMEOUT,
                bound,
            )
        else:
            logger.error(
                "rank %s: %s has waited %.0f s: %s (%s=%g s)",
                rank(),
                wait.where,
                now - wait.started,
                wait.hint or "another rank has not reached it",
                _config.STALL_TIMEOUT,
                bound,
            )

    def reset_after_fork(self):
        self.lock = threading.Lock()
        self.waits, self.thread = [], None


_monitor = _Monitor()
_fork.in_child(_monitor.reset_after_fork)


@contextmanager
def watching(where, process_of=None, unblock=None, hint=None):
    """Register a wait for the ``with`` block; yields the ``Wait`` (``.exitcode`` is set if
    the worker died during it)."""
    wait = Wait(where, process_of, unblock, hint)
    _monitor.add(wait)
    try:
        yield wait
    finally:
        _monitor.remove(wait)


def watched(process):
    """The pids whose progress is the worker ``process``'s: its own, then those of the
    processes its writes may wait on (NVRx's results-queue manager, megatron-core's copy),
    not the rank's other processes (a forkserver, the resource tracker, a standby)."""
    pids = [process.pid]
    for name in (FS, MCORE_FS):
        manager = started_process(_shapes.results_manager_process(sys.modules.get(name)))
        if manager is not None and manager.pid not in pids:
            pids.append(manager.pid)
    return pids


def progress(pid, *others):
    """CPU ticks plus I/O bytes of ``pid``, of ``others`` and of their descendants, each
    counted once; None without /proc or without ``pid``. A stopped ``pid`` (SIGSTOP) makes
    no progress through ``others``: a manager serving someone else is not its work."""
    try:
        if stat_fields(pid)[0] in (b"T", b"t"):
            others = ()
    except (OSError, IndexError):
        return None
    total, seen, todo = 0, set(), [*others, pid]
    while todo:
        current = todo.pop()
        if current in seen:
            continue
        seen.add(current)
        try:
            fields = stat_fields(current)
            total += int(fields[11]) + int(fields[12])  # utime, stime
            todo.extend(children(current))
        except (OSError, ValueError, IndexError):
            if current == pid:
                return None
            continue
        try:
            with open(f"/proc/{current}/io", "rb") as io:
                total += sum(
                    int(line.split()[1]) for line in io if line.startswith((b"rchar", b"wchar"))
                )
        except (OSError, ValueError, IndexError):
            pass
    return total
