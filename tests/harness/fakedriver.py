"""A CPU stand-in for the CUDA driver's process checkpoint API, beside ``fakecuda``: it fakes
only the driver's five calls, which ``worker.cuda_checkpoint.Driver`` makes on it as on
``libcuda`` (the same arguments, ``CUresult`` codes, deadlines).

Each process's CUDA state is kept here. Lock stops the process (SIGSTOP), as a locked
worker's CUDA calls wait, and unlock lets it go on (SIGCONT), each returning once the kernel
shows the process stopped or running again, as the driver's calls return once the process is
locked or unlocked: a save or a close handed to a worker that is still suspended hangs, as on
a GPU. Checkpoint and restore change the state
only. A call on a process that is gone returns 304, as the H200's driver did for a worker
killed while checkpointed. ``FAULTS`` names what a test can make go wrong.
"""

import os
import signal
import threading
import time

from nvrx_ipc_fix.worker import cuda_checkpoint as cc
from nvrx_ipc_fix.worker.guardian_process import stat_fields

OS_ERROR, ILLEGAL_STATE, TIMEOUT = 304, 401, 909  # CUresult codes
FAULTS = {
    "lock-busy": "lock waits out its timeout and fails (a worker busy on the device)",
    "lock-hangs": "lock never returns, whatever its timeout (a worker that maps another "
    "process's memory)",
    "checkpoint-fails": "checkpoint fails after the lock",
    "restore-fails": "restore fails on a live worker",
    "unlock-fails": "unlock fails",
    "absent": "the driver has no process checkpoint API",
}


class StandIn:
    """The driver's process states and the calls made on it."""

    def __init__(self, faults=()):
        unknown = set(faults) - set(FAULTS)
        if unknown:
            raise ValueError(f"unknown faults {sorted(unknown)}; known: {sorted(FAULTS)}")
        self.faults = set(faults)
        self.states = {}  # pid -> CUprocessState, for the pids a call reached
        self.calls = []  # (name, pid), in order

    def load(self, in_use=True):
        """What ``cuda_checkpoint.load`` returns: ``(Driver, None)`` or ``(None, why)``."""
        if "absent" in self.faults:
            return None, "this CUDA driver has no process checkpoint API (stand-in)"
        return cc.Driver(
            {
                "cuInit": lambda flags: 0,
                "cuDriverGetVersion": lambda out: self._out(out, cc.FIRST_VERSION),
                "cuCheckpointProcessGetState": self._state,
                "cuCheckpointProcessLock": self._lock,
                "cuCheckpointProcessCheckpoint": self._step(
                    "checkpoint", cc.LOCKED, cc.CHECKPOINTED
                ),
                "cuCheckpointProcessRestore": self._step("restore", cc.CHECKPOINTED, cc.LOCKED),
                "cuCheckpointProcessUnlock": self._unlock,
            }
        ), None

    @staticmethod
    def _out(pointer, value):
        pointer._obj.value = value
        return 0

    def _alive(self, pid):
        try:
            os.kill(pid, 0)
        except OSError:
            return False
        return _proc_state(pid) not in (None, b"Z")  # a zombie is gone too

    def _signal(self, pid, signum, stopped, timeout=60.0):
        """Send ``signum``; return once ``pid`` is ``stopped`` (or not), or is gone (or at the
        bound: what the caller then reads of its state says so)."""
        os.kill(pid, signum)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            state = _proc_state(pid)
            if state in (None, b"Z") or (state in (b"T", b"t")) == stopped:
                return
            time.sleep(0.001)

    def _state(self, pid, out):
        self.calls.append(("state", pid))
        if not self._alive(pid):
            return OS_ERROR
        return self._out(out, self.states.get(pid, cc.RUNNING))

    def _lock(self, pid, args):
        self.calls.append(("lock", pid))
        if not self._alive(pid):
            return OS_ERROR
        if "lock-hangs" in self.faults:
            threading.Event().wait()
        if "lock-busy" in self.faults:
            threading.Event().wait(args._obj.timeoutMs / 1000)
            return TIMEOUT
        if self.states.get(pid, cc.RUNNING) != cc.RUNNING:
            return ILLEGAL_STATE
        self._signal(pid, signal.SIGSTOP, stopped=True)
        self.states[pid] = cc.LOCKED
        return 0

    def _step(self, name, before, after):
        def call(pid, args):
            self.calls.append((name, pid))
            if not self._alive(pid):
                return OS_ERROR
            if f"{name}-fails" in self.faults or self.states.get(pid) != before:
                return ILLEGAL_STATE
            self.states[pid] = after
            return 0

        return call

    def _unlock(self, pid, args):
        self.calls.append(("unlock", pid))
        if not self._alive(pid):
            return OS_ERROR
        if "unlock-fails" in self.faults or self.states.get(pid) != cc.LOCKED:
            return ILLEGAL_STATE
        self._signal(pid, signal.SIGCONT, stopped=False)
        self.states[pid] = cc.RUNNING
        return 0


def _proc_state(pid):
    """The state letter of ``pid`` in /proc (``b"T"``: stopped), or None when it is gone."""
    try:
        return stat_fields(pid)[0]
    except (OSError, IndexError):
        return None


def install(faults=()):
    """Make ``worker.suspend`` open this stand-in instead of ``libcuda``; returns it."""
    stand_in = StandIn(faults)
    cc.load = stand_in.load
    return stand_in
