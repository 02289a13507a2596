"""The monitor thread. On its own (no NVRx): a worker's death ends only a wait that is still
registered. The thread blocks for up to a tick on the sentinels of the waits it saw; a wait
that ended meanwhile must not be unblocked, because its ``unblock`` resolves the queue's
*current* caller: found in CI (NVRx 0.5.0, a save, ``close(abort=True)``, a save), where the
first save's handshake wait, ended but still in the thread's hands, drained the next
worker's preload queue when the aborted worker's death came in. With the real worker: the
waits it ends still end after the thread was killed once."""

import logging
import os
import signal
import subprocess
import sys
import threading
import time

import pytest

from conftest import needs_nvrx, run_python, scenario
from nvrx_ipc_fix.worker import monitor as _monitor


class FakeProcess:
    """What the monitor reads of a ``multiprocessing.Process``: a sentinel (the read end of a
    pipe, ready once the write end is closed), ``join``, ``exitcode``, and a ``pid`` whose
    progress it samples once a wait is older than a tick (a loaded machine's: this process's,
    which makes progress). Reading the sentinel tells the test that the thread has taken this
    wait into its next blocking wait."""

    exitcode = -9
    pid = os.getpid()

    def __init__(self):
        self._popen = object()  # "started"
        self._read, self._write = os.pipe()
        self.seen = threading.Event()

    @property
    def sentinel(self):
        self.seen.set()
        return self._read

    def join(self, timeout=None):
        pass

    def die(self):
        os.close(self._write)

    def close(self):
        os.close(self._read)


def test_a_death_seen_after_the_wait_ended_does_not_unblock_it():
    process, unblocked = FakeProcess(), threading.Event()
    with _monitor.watching("a handshake", lambda: process, unblocked.set) as wait:
        assert process.seen.wait(120), "the monitor thread never looked at the wait"
    process.die()  # the thread is still blocked on this sentinel (a tick is up to 1 s)
    assert not unblocked.wait(2.5)
    assert wait.exitcode is None
    process.close()


def test_a_death_during_the_wait_unblocks_it_and_records_the_exit_code():
    process, unblocked = FakeProcess(), threading.Event()
    with _monitor.watching("a handshake", lambda: process, unblocked.set) as wait:
        assert process.seen.wait(120)
        process.die()
        assert unblocked.wait(120)
    assert wait.exitcode == -9
    process.close()


# The monitor thread killed on purpose, at its first look (the first save's handshake wait):
# by an exception that escapes everything (SystemExit), or as a setting's RuntimeWarning does
# under -W error (the invalid NVRX_IPC_FIX_STALL_TIMEOUT is read there first).
KILLED = """
    from nvrx_ipc_fix.core import config as _config
    _read, _killed = _config.stall_timeout, []
    def _kills_once():
        if not _killed:
            _killed.append(True)
            raise SystemExit("the monitor thread, killed on purpose")
        return _read()
    _config.stall_timeout = _kills_once
"""
WARNS = {"PYTHONWARNINGS": "error::RuntimeWarning", "NVRX_IPC_FIX_STALL_TIMEOUT": "soon"}


@needs_nvrx
@pytest.mark.worker
@pytest.mark.parametrize("how", ["killed", "warning-as-error"])
def test_after_the_monitor_thread_died_a_death_in_the_handshake_or_in_close_still_ends(how):
    """Then a worker that dies in a save's preload handshake is one error from that save's
    finalize, and one killed while close() waits on it ends the close; the next save loads."""
    report = scenario(
        ["save", "fault-preload", "save", "stop-worker", "kill-worker-later", "close?", "save"],
        timeout=30,
        prelude=KILLED if how == "killed" else "",
        env=WARNS if how == "warning-as-error" else None,
    )
    assert report["hang"] is None, report["stderr"]
    (handshake,) = report["faults"]
    assert handshake["error"]["type"] == "CheckpointWorkerError", handshake
    assert "during the preload handshake" in handshake["error"]["message"]
    (close,) = report["calls"]
    assert close["error"] is None and close["workers_after"] == 0
    assert [s["stale"] for s in report["saves"] if not s.get("lost")] == [0, 0, 0]


class Writer:
    """A child process that makes progress the monitor can see, a few bytes of I/O every 50
    ms, with what the monitor reads of a ``multiprocessing.Process`` (its sentinel: a pidfd)."""

    def __init__(self):
        self._popen = subprocess.Popen(
            [
                sys.executable,
                "-c",
                "import os, time\nwhile True:\n    os.write(1, b'.')\n    time.sleep(0.05)",
            ],
            stdout=subprocess.DEVNULL,
        )
        self.pid = self._popen.pid
        self.sentinel = os.pidfd_open(self.pid)

    @property
    def exitcode(self):
        return self._popen.returncode

    def join(self, timeout=None):
        try:
            self._popen.wait(timeout)
        except subprocess.TimeoutExpired:
            pass

    def end(self):
        self._popen.kill()
        self._popen.wait()
        os.close(self.sentinel)


class Lines(logging.Handler):
    """The monitor's log lines, each with when it came; ``error`` and ``warning`` are set by
    the first of each."""

    def __init__(self):
        super().__init__()
        self.lines, self.error, self.warning = [], threading.Event(), threading.Event()

    def emit(self, record):
        self.lines.append((time.monotonic(), record.levelname, record.getMessage()))
        {"ERROR": self.error, "WARNING": self.warning}.get(
            record.levelname, threading.Event()
        ).set()


@pytest.mark.skipif(not os.path.exists("/proc/self/task"), reason="samples /proc")
def test_a_stopped_worker_is_reported_while_another_process_of_the_rank_is_busy(monkeypatch):
    """The stall watch samples the worker and what it may wait on, not every process of the
    rank: with the worker stopped and another child of the trainer busy (as the forkserver, the
    resource tracker may be), the stall ERROR comes, and the WARNING that the worker makes
    progress again only after it is continued."""
    monkeypatch.setenv("NVRX_IPC_FIX_STALL_TIMEOUT", "1")
    busy, worker, lines = Writer(), Writer(), Lines()
    os.kill(worker.pid, signal.SIGSTOP)
    _monitor.logger.addHandler(lines)
    try:
        with _monitor.watching("the finalize of save #1", lambda: worker):
            assert lines.error.wait(120), lines.lines
            assert not lines.warning.is_set(), lines.lines  # the worker is still stopped
            continued = time.monotonic()
            os.kill(worker.pid, signal.SIGCONT)
            assert lines.warning.wait(120), lines.lines
    finally:
        _monitor.logger.removeHandler(lines)
        busy.end()
        worker.end()
    (_, error, stalled), (at, warning, recovered) = lines.lines[:2]
    assert (error, warning) == ("ERROR", "WARNING"), lines.lines
    assert f"(pid {worker.pid})" in stalled and "made progress" in stalled
    assert "makes progress again" in recovered and at >= continued, (continued, lines.lines)


@pytest.mark.skipif(not os.path.exists("/proc/self/task"), reason="samples /proc")
def test_a_busy_results_manager_is_no_progress_of_a_stopped_worker(monkeypatch):
    """The results-queue manager the worker may wait on also serves the trainer (``own_results``
    makes the next save's queue ahead): while the worker is stopped, the manager's work is not
    the worker's, and the WARNING that it makes progress again comes only after SIGCONT (CI
    saw it 1.3 s before the SIGCONT when the manager counted)."""
    monkeypatch.setenv("NVRX_IPC_FIX_STALL_TIMEOUT", "1")
    manager, worker, lines = Writer(), Writer(), Lines()
    monkeypatch.setattr(_monitor, "watched", lambda process: [process.pid, manager.pid])
    os.kill(worker.pid, signal.SIGSTOP)
    _monitor.logger.addHandler(lines)
    try:
        with _monitor.watching("the finalize of save #1", lambda: worker):
            assert lines.error.wait(30), lines.lines
            before = _monitor.progress(manager.pid)
            while _monitor.progress(manager.pid) == before:  # the manager works meanwhile
                time.sleep(0.05)
            time.sleep(1.5)  # beyond a tick of the watch (half the bound)
            assert not lines.warning.is_set(), lines.lines
            continued = time.monotonic()
            os.kill(worker.pid, signal.SIGCONT)
            assert lines.warning.wait(30), lines.lines
    finally:
        _monitor.logger.removeHandler(lines)
        manager.end()
        worker.end()
    at, warning, recovered = lines.lines[1]
    assert warning == "WARNING" and "makes progress again" in recovered, lines.lines
    assert at >= continued, (continued, lines.lines)


@needs_nvrx
def test_the_stall_watch_samples_nvrx_s_results_queue_manager_with_the_worker():
    """The worker's writes wait on NVRx's results-queue manager, a process of the trainer's
    that NVRx starts at the first save that writes: its progress is the worker's too."""
    found = run_python("""
        import json, os
        from nvidia_resiliency_ext.checkpointing.async_ckpt import filesystem_async as fs
        from nvrx_ipc_fix.worker import monitor

        class Worker:
            pid = os.getpid()

        before = monitor.watched(Worker)
        (getattr(fs, "get_write_results_queue", None) or fs._get_write_results_queue)()
        manager = fs._results_queue._manager._process
        print(json.dumps([before, monitor.watched(Worker), Worker.pid, manager.pid]))
    """)
    before, after, worker, manager = found
    assert before == [worker] and after == [worker, manager], found
