"""Faults for the real checkpoint worker, used by ``harness.scenario`` (the tests, the GPU
benchmarks) to show what a dying or stuck worker does to the trainer.

Each is a plain module-level function: pickled by reference in an ``AsyncRequest`` in place
of NVRx's ``preload_fn`` or ``async_fn``, it runs inside the worker, which imports this
module to call it. ``KINDS`` maps a scenario step (``fault-<kind>``) to where it goes.
``describe_cache`` (the scenario's ``probe``) runs there the same way.
"""

import os
import signal
import time


def fail(where, *_args, **_kwargs):
    """Raise, as a bug in NVRx or torch would (the worker's loop dies with it)."""
    raise RuntimeError(f"injected fault in the worker's {where}")


def exit_now(code, *_args, **_kwargs):
    """Leave at once, without cleanup (``os._exit``)."""
    os._exit(code)


def kill_self(*_args, **_kwargs):
    """SIGKILL, as the OOM killer sends it."""
    os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(60)


def segfault(*_args, **_kwargs):
    """SIGSEGV, as a crash in native code (a CUDA driver, say) ends the worker."""
    os.kill(os.getpid(), signal.SIGSEGV)
    time.sleep(60)


def holding(_held, real, *args, **kwargs):
    """``real``'s call, with ``_held`` (say, a lock, which cannot be pickled) in the request."""
    return real(*args, **kwargs)


def nothing(*_args, **_kwargs):
    """A request that does nothing (a replacement worker's first task)."""


def sigterm_to_other_threads(*_args, **_kwargs):
    """Block SIGTERM in the calling thread, the worker's main one (a request runs there),
    so that the kernel gives it to another of the worker's threads, as it may at any time:
    its queue's feeder thread. Python runs the handler only when the main thread, blocked
    reading its next request, wakes."""
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})


def hold(marker, *_args, **_kwargs):
    """Stay in the write: create ``marker`` (the harness waits for it), then block until
    killed, as a write to a slow file system does."""
    with open(marker + ".tmp", "w") as out:
        out.write(str(os.getpid()))
    os.replace(marker + ".tmp", marker)
    while True:
        signal.pause()


def hold_tree(marker, *_args, **_kwargs):
    """``hold``, above a chain the worker started, all there before ``marker`` says the worker
    is: 300 shells, each the parent of the next, the last one a ``sleep`` (it takes 300
    rounds of stops to walk)."""
    import subprocess

    chain = 'if [ "$1" -gt 0 ]; then sh -c "$CHAIN" sh $(($1 - 1)) & wait; else exec sleep 600; fi'
    first = subprocess.Popen(["sh", "-c", chain, "sh", "300"], env={**os.environ, "CHAIN": chain})
    deadline, found = time.monotonic() + 120, 0
    while found <= 300 and time.monotonic() < deadline:
        time.sleep(0.05)
        found, pid = 0, first.pid
        while pid is not None:
            found += 1
            pid = next(iter(_children(pid)), None)
    hold(marker)


def _children(pid):
    found = []
    try:
        for task in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{task}/children") as listed:
                found += map(int, listed.read().split())
    except OSError:
        pass
    return found


def stop_then(marker, real, *args, **kwargs):
    """Write the time (``time.monotonic()``, one clock for every process) to ``marker``, then
    SIGSTOP (no progress until someone sends SIGCONT), then do the real work."""
    with open(marker + ".tmp", "w") as out:
        out.write(repr(time.monotonic()))
    os.replace(marker + ".tmp", marker)
    os.kill(os.getpid(), signal.SIGSTOP)
    return real(*args, **kwargs)


def describe_cache(path):
    """Not a fault: write what the worker holds to ``path`` as JSON: its pid, the keys of
    NVRx's tensor cache, and how many shared-memory segments it maps (the CPU stand-in's
    equivalent of IPC mappings)."""
    import json
    import sys

    from nvrx_ipc_fix.core.detect import CORE
    from nvrx_ipc_fix.core.shapes import worker_data_cache

    cache = worker_data_cache(sys.modules[CORE])
    with open("/proc/self/maps") as maps:
        shm = {
            line.split()[-2] if line.rstrip().endswith("(deleted)") else line.split()[-1]
            for line in maps
            if "/dev/shm/" in line or "torch_" in line
        }
    with open(path, "w") as out:
        json.dump({"pid": os.getpid(), "keys": sorted(cache), "shm_segments": len(shm)}, out)


#: fault kind -> (what it replaces: "preload", "write", "path", "idle" or "request", description)
KINDS = {
    "preload": ("preload", "preload_fn raises"),
    "raise": ("write", "async_fn raises"),
    "write": ("path", "the checkpoint's files cannot be written (NVRx reports it)"),
    "exit": ("write", "os._exit(3) while writing"),
    "kill": ("write", "SIGKILL while writing"),
    "segv": ("write", "SIGSEGV while writing"),
    "idle": ("idle", "SIGKILL while idle, before the save"),
    "stop": ("write", "SIGSTOP while writing, SIGCONT later"),
    "lock": ("request", "a threading.Lock in the request: it cannot be pickled"),
    "lambda": ("request", "the request's async_fn is a lambda: it cannot be pickled"),
    "lambda-nopreload": (
        "request",
        "the same, in a request without a preload_fn (NVRx does "
        "not wait for its worker in the schedule)",
    ),
    "hold": ("write", "blocks in its write until killed (the file `writing` says it is there)"),
    "hold-tree": ("write", "the same, above a chain of 300 shells it started"),
}
