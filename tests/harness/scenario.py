"""The tests' harness: the demo's driver (``nvrx_ipc_fix.cli.driver``: a trainer rank, its
steps, the watchdog, the report) with what the tests add: worker faults, NVRx's workers from
a forkserver, and the steps below.

``python -m harness.scenario --steps save,fault-kill,save`` (``tests/`` on the path) runs as
the driver does, with ``--starts``. Steps added here: ``fault-<kind>`` or
``fault-<kind>@<rank>`` (a save whose worker fails as ``harness.faults.KINDS`` says, on every
rank or only on ``<rank>``; the others save normally; the exception each rank saw is
reported, and a rank whose save could not be handed over then finalizes, as a training loop
does, so the failure reaches the others), ``fault-<kind>-async`` (the same save, left
pending), ``finalize`` (finalize pending saves), ``kill-worker`` (SIGKILL the worker that
would take the next save), ``stop-worker`` (SIGSTOP it), ``kill-worker-later`` (SIGKILL it
a second later, from a thread), ``activate`` and ``deactivate`` (the package's own calls, to
test late activation), ``offloading-<strategy>`` (offload, measure and onload inside
``nvrx_ipc_fix.offloading(strategy=...)``), ``prewarm`` (``nvrx_ipc_fix.prewarm``), ``ready``
(wait until the prewarmed worker answered; how long it took to start, its parent),
``standby`` (wait until the standby restart's workers are forked from is ready),
``kill-standby`` (SIGKILL it), ``kill-manager`` (SIGKILL NVRx's results-queue manager, as
the OOM killer would, and wait until it is gone), ``env-change`` (set a variable),
``user-forkserver`` (what a child the user starts with ``get_context("forkserver")`` saw),
``driver`` and ``driver-<faults>`` (suspend through ``fakedriver``), ``resumed`` (wait for a
resumed worker), ``probe`` (ask the worker what it holds: its pid, cached keys and mapped
shared-memory segments), ``resources`` (what this process holds: file descriptors, threads,
semaphores), ``fork-exit`` (``os.fork()`` a child that exits at once with ``sys.exit(0)``;
its exit code, how long its exit took, its stderr, and whether it hung: then where it
waited, ``waits_in``, from the traceback ``faulthandler`` writes at SIGABRT),
``fork-close-exit`` (the same child closes the queue it inherited first, as NVRx's
``__del__`` does when the queue is collected). A fault step, and a ``finalize`` step that
raises, reports what was raised, by which call, which saves the error names as not saved,
what is still pending after it, and what one more finalize then raises (nothing, by the
protocol); a ``fault-stop`` also when its worker was seen stopped and when it was sent
SIGCONT (``stopped``, on the clock of the log lines' ``t``). Any step but a fault, written
``<step>?``, may raise (a call the package finalizes in), and ``calls`` reports what it
raised. A hang report says where the main thread waits (``waits_in``: ``stacks``).
"""

import dataclasses
import faulthandler
import gc
import importlib
import json
import multiprocessing
import os
import shutil
import signal
import sys
import tempfile
import threading
import time
from functools import partial

import torch

from harness import faults, gates, stacks
from nvrx_ipc_fix.cli import driver
from nvrx_ipc_fix.cli.driver import HUNG, IMPLS, _add, _step, checkpoint_workers, step
from nvrx_ipc_fix.worker.monitor import stat_fields

import nvrx_ipc_fix

STOP_SECONDS = 6.0  # how long fault-stop keeps the worker stopped
FORK_EXIT_BOUND = 8.0  # seconds a forked child may take to exit before it counts as hung
CHANGED = "SCENARIO_ENV_CHANGED"  # the variable env-change sets
EXTRA_STEPS = driver.EXTRA_STEPS  # where tests add their steps
driver.where_waits = stacks.main  # a hang report names the main thread's frames


def _stopped(process):
    """Is ``process`` stopped by a signal (state T in /proc; False where it cannot tell)?"""
    try:
        return stat_fields(process.pid)[0] == b"T"
    except (AttributeError, OSError, IndexError):
        return False


def start_workers_from_forkserver(core):
    """Let NVRx start its processes (its workers; its results queue's manager) from a
    forkserver instead of a fresh interpreter each, which imports torch and NVRx again
    (3.5 s of a 2-core VM's CPU): NVRx asks ``mp.get_context("spawn")`` for each, which
    ``SpawnFrom`` (the standby's redirection too) answers with the server; both pickle what
    they send the same way. The server is the harness's own
    (``worker.private_forkserver``: multiprocessing's stays the test's), forked from this
    process now, before it has a thread of its own, so it has torch and NVRx already
    (``_fork_server``), their writer's module too (its ``torch.distributed.checkpoint``:
    1.6 s of CPU in each worker otherwise). For tests whose subject is not the cold start:
    the standby (``NVRX_IPC_FIX_STANDBY``), a cold start of its own, is off unless the test
    sets it."""
    from nvrx_ipc_fix.core import config
    from nvrx_ipc_fix.worker.private_forkserver import Context, SpawnFrom

    os.environ.setdefault(config.STANDBY, "off")
    server = Context()
    writer = importlib.import_module(driver.FS)
    _fork_server(server)
    for module in (core, writer):
        module.mp = SpawnFrom(module.mp, server, every_thread=True)


def _fork_server(context):
    """Start ``context``'s server as a fork of this process rather than a fresh interpreter:
    its ``ensure_running`` as it is, but ``spawnv_passfds`` forks and runs the server's
    ``main`` on the two descriptors it passes (the listening socket, the read end of the
    "alive" pipe), every other descriptor but the resource tracker's closed there, as the
    spawn would. The resource tracker is started first, as multiprocessing starts it. The
    server freezes the heap it inherited (``gc.freeze``), so that the workers' collections
    neither walk nor copy torch's objects."""
    from multiprocessing import forkserver, resource_tracker, util

    tracker = resource_tracker.getfd()  # started as it is (spawned), before spawnv is replaced

    def fork_server(_path, _args, passfds):
        pid = os.fork()
        if pid == 0:
            try:
                keep = {0, 1, 2, *passfds, tracker}
                for fd in map(int, os.listdir("/proc/self/fd")):
                    if fd not in keep:
                        try:
                            os.close(fd)
                        except OSError:
                            pass
                gc.freeze()
                forkserver.main(*passfds, [])
            finally:
                os._exit(0)
        return pid

    spawnv, util.spawnv_passfds = util.spawnv_passfds, fork_server
    try:
        context.start()
    finally:
        util.spawnv_passfds = spawnv


class Trainer(driver.Trainer):
    """The driver's trainer, with worker faults (``inject``: ``faults.KINDS``), ``gate`` and
    ``starts``: how NVRx starts its workers, ``spawn`` (its own way) or ``forkserver``
    (``start_workers_from_forkserver``)."""

    def __init__(self, directory, n_tensors=8, numel=4096, cached=True, rank=0, world_size=1,
                 impl="nvrx", finalize="blocking", no_dist=False, starts="spawn"):
        if starts not in ("spawn", "forkserver"):
            raise ValueError(f"starts must be 'spawn' or 'forkserver', not {starts!r}")
        # megatron-core's worker is forked on the CPU; on a GPU, NVRx spawns its own (CUDA
        # cannot be used in a process forked from one that initialized it)
        if starts == "forkserver" and impl == "nvrx" and not torch.cuda.is_available():
            start_workers_from_forkserver(importlib.import_module(IMPLS[impl]))
        self.stop_window = [None, None]  # fault-stop's: worker seen stopped, SIGCONT sent
        self.gate = None  # (gate, done): the next save's write waits and signals (gates)
        super().__init__(directory, n_tensors, numel, cached, rank, world_size, impl, finalize,
                         no_dist)

    def inject(self, fault, path, save_fn, preload_fn):
        """The request's functions with ``fault`` put in (see ``faults.KINDS``), and the
        ``gate`` set for this save (``gates.gated``)."""
        if self.gate is not None:
            save_fn, self.gate = partial(gates.gated, *self.gate, save_fn), None
        if fault == "preload":
            preload_fn = partial(faults.fail, "preload_fn")
        elif fault == "raise":
            save_fn = partial(faults.fail, "async_fn")
        elif fault == "exit":
            save_fn = partial(faults.exit_now, 3)
        elif fault == "kill":
            save_fn = faults.kill_self
        elif fault == "segv":
            save_fn = faults.segfault
        elif fault == "stop":
            save_fn = partial(faults.stop_then, save_fn)
            threading.Thread(target=self._continue_worker, daemon=True).start()
        elif fault == "write":  # the checkpoint directory becomes a file
            shutil.rmtree(path, ignore_errors=True)
            open(path, "w").close()
        elif fault == "idle":
            self.kill_worker()
        elif fault == "lock":
            save_fn = partial(faults.holding, threading.Lock(), save_fn)
        elif fault in ("lambda", "lambda-nopreload"):
            real = save_fn
            save_fn = lambda *args, **kwargs: real(*args, **kwargs)  # noqa: E731
            preload_fn = preload_fn if fault == "lambda" else None
        elif fault in ("hold", "hold-tree"):
            save_fn = partial(faults.hold_tree if fault == "hold-tree" else faults.hold,
                              os.path.join(self.directory, "writing"))
        elif fault is not None:
            raise ValueError(f"unknown fault {fault!r} (known: {', '.join(faults.KINDS)})")
        return save_fn, preload_fn

    def kill_worker(self):
        """SIGKILL the worker that would take the next save (if any) and wait until it is gone."""
        worker = self.worker()
        if worker is not None:
            os.kill(worker.pid, signal.SIGKILL)
            while worker.is_alive():
                time.sleep(0.05)

    def _continue_worker(self, limit=60.0):
        """SIGCONT the worker ``STOP_SECONDS`` after it stopped itself (timed from the stop,
        so that a slow save's handshake on a loaded machine does not shorten the stall)."""
        deadline = time.monotonic() + limit
        while time.monotonic() < deadline and not _stopped(self.worker()):
            time.sleep(0.05)
        self.stop_window[0] = time.monotonic()
        time.sleep(STOP_SECONDS)
        worker = self.worker()
        self.stop_window[1] = time.monotonic()  # before: nothing after it can precede it
        if worker is not None and worker.pid:
            os.kill(worker.pid, signal.SIGCONT)

    def probe(self):
        """What the worker holds now (see ``_worker.describe_cache``)."""
        from nvrx_ipc_fix.worker.inside import describe_cache
        from nvrx_ipc_fix.worker.release import run_in_worker

        path = os.path.join(self.directory, "probe.json")
        error = run_in_worker(self.queue, describe_cache, (path,), 30)
        if error:
            raise RuntimeError(error)
        with open(path) as found:
            return json.load(found)


def run(steps, directory, timeout=60.0, n_tensors=8, numel=4096, cached=True, rank=0,
        world_size=1, impl="nvrx", finalize="blocking", no_dist=False, starts="spawn"):
    """``driver.run`` with this module's ``Trainer``; ``starts``: how NVRx starts its workers."""
    return driver.run(steps, directory, timeout, n_tensors, numel, cached, rank, world_size,
                      impl, finalize, no_dist, make=Trainer, starts=starts)


@step("fault-", adds="faults", prefix=True)
def _fault_step(trainer, report, index, name):
    return _fault(trainer, report, index, name)


@step("finalize", adds="faults")
def _finalize(trainer, report, index, name):
    outcome = _finalize_step(trainer, report, index)
    return outcome if outcome["error"] is not None else None


@step("kill-worker")
def _kill_worker(trainer, report, index, name):
    trainer.kill_worker()


@step("activate", "deactivate")
def _lifecycle(trainer, report, index, name):
    getattr(nvrx_ipc_fix, name)()


@step("offloading-", adds="releases", prefix=True)
def _offloading(trainer, report, index, name):
    with nvrx_ipc_fix.offloading(trainer.queue, strategy=name[len("offloading-"):]) as released:
        trainer.offload()
        _add(report, "measures", trainer.measure())
        trainer.onload()
    _add(report, "prewarms", _started(trainer))
    return dataclasses.asdict(released)


@step("driver")
@step("driver-", prefix=True)
def _driver(trainer, report, index, name):
    """Suspend through the CPU stand-in of the driver (``fakedriver``), with the faults that
    follow ``driver-`` (joined by ``+``); the stand-in is ``trainer.driver``."""
    from harness import fakedriver

    faults = name[len("driver-"):].split("+") if name.startswith("driver-") else ()
    trainer.driver = fakedriver.install(faults)


@step("resumed", adds="resumes")
def _resumed(trainer, report, index, name):
    """Wait until the suspended worker of the queue is running again; the last suspend's and
    resume's timings, and the driver calls the stand-in saw."""
    from nvrx_ipc_fix.worker import suspend

    suspend.ready(trainer.queue)
    driver = getattr(trainer, "driver", None)
    return dict(suspend.last, calls=[c for c, _ in driver.calls] if driver else None)


@step("prewarm", adds="prewarms")
def _prewarm(trainer, report, index, name):
    return dict(dataclasses.asdict(nvrx_ipc_fix.prewarm(trainer.queue)), **_started(trainer))


@step("ready", adds="ready")
def _ready_step(trainer, report, index, name):
    return _ready(trainer)


@step("standby", adds="standby")
def _standby_step(trainer, report, index, name):
    """Wait (up to 120 s) until the standby that restart's workers are forked from is ready
    or failed; its pid and what ``status()`` says of it."""
    from nvrx_ipc_fix.worker import standby

    current = standby._standby
    if current is not None:
        current.ready.wait(120.0)
    pid = getattr(current, "pid", None)
    return {"pid": pid, "ready": bool(current and current.ready.is_set()),
            "status": nvrx_ipc_fix.status().standby,
            "earlier_alive": [s["pid"] for s in report.get("standby", [])
                              if s["pid"] not in (None, pid) and standby._alive(s["pid"])]}


@step("kill-standby", adds="standby_kills")
def _kill_standby(trainer, report, index, name):
    """SIGKILL the standby; its pid, and those of its children still alive 2 s later."""
    from nvrx_ipc_fix.worker import standby
    from nvrx_ipc_fix.worker.monitor import _children

    pid = standby._standby.pid
    children = _children(pid)
    os.kill(pid, signal.SIGKILL)
    time.sleep(2.0)
    return {"pid": pid, "orphans": [c for c in children if standby._alive(c)]}


@step("kill-manager", adds="manager_kills")
def _kill_manager(trainer, report, index, name):
    """SIGKILL NVRx's results-queue manager and reap it; its pid."""
    from nvrx_ipc_fix.core.shapes import results_manager_process

    process = results_manager_process(sys.modules[driver.FS])
    os.kill(process.pid, signal.SIGKILL)
    process.join()
    return {"pid": process.pid, "exitcode": process.exitcode}


@step("env-change")
def _env_change(trainer, report, index, name):
    """Set a variable: the environment is no longer the one the standby started with."""
    os.environ[CHANGED] = str(index)


@step("user-forkserver", adds="user_children")
def _user_forkserver(trainer, report, index, name):
    """Start a child as the user's own code does, ``multiprocessing.get_context("forkserver")``:
    what it saw (``harness.user_child``), ``env-change``'s variable among it."""
    from harness.user_child import start

    return start(multiprocessing.get_context("forkserver"), CHANGED)


@step("resources", adds="resources")
def _resources(trainer, report, index, name):
    return resources()


@step("fork-exit", "fork-close-exit", adds="fork_exits")
def _fork_exit_step(trainer, report, index, name):
    return _fork_exit(trainer, name == "fork-close-exit")


@step("stop-worker")
def _stop_worker(trainer, report, index, name):
    os.kill(trainer.worker().pid, signal.SIGSTOP)


@step("kill-worker-later")
def _kill_worker_later(trainer, report, index, name):
    threading.Timer(1.0, os.kill, (trainer.worker().pid, signal.SIGKILL)).start()


@step("probe", adds="probes")
def _probe(trainer, report, index, name):
    return trainer.probe()


@step("?", adds="calls")
def _call_step(trainer, report, index, name):
    return _call(trainer, report, index, name)


def resources(settle=5.0):
    """What this process holds that a dead worker could leak: open file descriptors, threads,
    and live ``multiprocessing`` semaphores (each queue has several; each is a named POSIX
    semaphore until it is collected). What is held, not what is in passing: finished
    children reaped and garbage collected, sampled for a second and until two samples agree
    (at most ``settle`` seconds; a descriptor lent to a worker is closed once the worker took
    it), the least of each kind (what is held is in every sample)."""
    from multiprocessing.synchronize import SemLock

    def sample():
        multiprocessing.active_children()  # reaps finished children, closing their pipes
        gc.collect()
        return {"fds": len(os.listdir("/proc/self/fd")) if os.path.isdir("/proc/self/fd")
                else None, "threads": threading.active_count(),
                "semaphores": sum(isinstance(o, SemLock) for o in gc.get_objects())}

    started = time.monotonic()
    found = least = sample()
    while time.monotonic() < started + settle:
        time.sleep(0.2)
        again = sample()
        least = {kind: min(least[kind], again[kind]) if again[kind] is not None else None
                 for kind in again}
        if again == found and time.monotonic() >= started + 1.0:
            break
        found = again
    return least


def _started(trainer):
    """After a prewarm: the worker that waits for the next save, and whether its process
    exists (``/proc``)."""
    pid = getattr(trainer.worker(), "pid", None)
    return {"pid": pid, "exists": pid is not None and os.path.exists(f"/proc/{pid}"),
            "workers": len(checkpoint_workers())}


def _parent(pid):
    """The parent pid of ``pid`` (``/proc``), or None."""
    try:
        return int(stat_fields(pid)[1])
    except (OSError, IndexError, ValueError):
        return None


def _environ(pid):
    """The environment ``pid`` was started with (``/proc``; a forked process: its parent's at
    the exec), or an empty dict."""
    try:
        with open(f"/proc/{pid}/environ", "rb") as found:
            entries = found.read().split(b"\0")
    except OSError:
        return {}
    return dict(e.decode(errors="replace").partition("=")[::2] for e in entries if e)


def _ready(trainer):
    """Wait for the prewarmed worker (the scenario's stand-in for the training between
    onload and save); how long it took to start, in the background."""
    from nvrx_ipc_fix.worker.prewarm import wait_ready

    began = time.monotonic()
    start = wait_ready(trainer.queue)
    waited = round(time.monotonic() - began, 3)
    if start is None:
        return {"pid": None, "ready_s": None, "error": None, "waited_s": waited,
                "pinning": 0, "pinned_bytes": 0, "pin_error": None}
    return {"pid": start.process.pid, "waited_s": waited, "error": start.error,
            "standby": start.standby, "parent": _parent(start.process.pid),
            "env_changed": _environ(start.process.pid).get(CHANGED),
            "ready_s": None if start.ready_s is None else round(start.ready_s, 3),
            "pinning": start.pinning, "pinned_bytes": start.pinned_bytes,
            "pin_error": start.pin_error, "first_request_s": start.first_request_s,
            "pin_s": start.pin_s}


def _fork_exit(trainer, close=False):
    """Fork a child with ``os.fork()`` that ends at once as a script does, ``sys.exit(0)``
    (every exit handler it inherited runs), after closing the queue with ``close``: its pid,
    exit code, how long its exit took, its stderr, and whether it hung (still there after
    ``FORK_EXIT_BOUND`` s: stopped with SIGABRT, and where it waited)."""
    trainer.phase = "fork"  # for the watchdog: this step waits on the child, not the worker
    with tempfile.TemporaryFile() as stderr:
        began = time.monotonic()
        pid = os.fork()
        if pid == 0:
            os.dup2(stderr.fileno(), 2)
            faulthandler.enable()  # SIGABRT at the bound: where it waits, on its stderr
            try:
                if close:
                    trainer.close()
            finally:
                sys.exit(0)
        done, status = os.waitpid(pid, os.WNOHANG)
        while not done and time.monotonic() - began < FORK_EXIT_BOUND:
            time.sleep(0.05)
            done, status = os.waitpid(pid, os.WNOHANG)
        seconds = time.monotonic() - began
        if not done:
            os.kill(pid, signal.SIGABRT)
            for _ in range(40):  # faulthandler's dump, then the signal's own end
                if os.waitpid(pid, os.WNOHANG)[0]:
                    break
                time.sleep(0.05)
            else:
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
        stderr.seek(0)
        text = stderr.read().decode(errors="replace")
    trainer.phase = None
    return {"pid": pid, "exit_s": round(seconds, 2), "hung": not done,
            "exitcode": os.waitstatus_to_exitcode(status) if done else None,
            "waits_in": None if done else stacks.dumped(text), "stderr": text[-2000:]}


def _fault(trainer, report, index, step):
    """One ``fault-<kind>[-async][@<rank>]`` step: a save whose worker fails on the chosen
    ranks (the others save normally); ``-async`` leaves it pending for a later step."""
    kind, _, only = step[len("fault-"):].partition("@")
    kind, wait = (kind[:-len("-async")], False) if kind.endswith("-async") else (kind, True)
    mine = not only or int(only) == trainer.rank
    outcome = _outcome(index, kind, mine)
    start, version = time.monotonic(), trainer.version + 1
    path = os.path.join(trainer.directory, f"ckpt{version}")
    report["saves"].append({"step": index, "path": path, "version": version, "stale": None,
                            "tensors": len(trainer.names), "fault": kind if mine else None})
    try:
        blocked, total, _, _ = trainer.save(wait=wait, fault=kind if mine else None)
        report["saves"][-1].update(blocked_s=round(blocked, 4), total_s=total and round(total, 4))
        if kind == "stop" and mine:  # on the log lines' clock
            outcome["stopped"] = [None if at is None else round(at - driver._log_start[0], 2)
                                  for at in trainer.stop_window]
    except (KeyboardInterrupt, SystemExit):
        raise
    except BaseException as exc:  # noqa: BLE001 torch's CheckpointException is a BaseException
        _raised(trainer, report, outcome, exc, start)
        if not outcome["lost"]:  # NVRx's own error (a failed write): this save is not saved
            report["saves"][-1]["lost"] = True
    trainer.phase = None
    return outcome


def _finalize_step(trainer, report, index):
    """A ``finalize`` step: what it raised, if anything (see ``_raised``)."""
    outcome, start = _outcome(index, None, None), time.monotonic()
    try:
        trainer.finalize()
    except (KeyboardInterrupt, SystemExit):
        raise
    except BaseException as exc:  # noqa: BLE001 the save's failure is the verdict: recorded
        _raised(trainer, report, outcome, exc, start)
    trainer.phase = None
    return outcome


def _call(trainer, report, index, step):
    """A ``<step>?`` step: ``step``, which may raise (a call the package finalizes in); what it
    raised (see ``_raised``), how often the model's storage moved in it (``moved``: the
    framework's own work), and the checkpoint workers alive after it."""
    outcome, start, moved = _outcome(index, None, None), time.monotonic(), trainer.moves
    outcome["call"] = trainer.phase = step
    try:
        if step == "finalize":  # not the finalize step's own report
            trainer.finalize()
        else:
            _step(trainer, report, index, step)
    except (KeyboardInterrupt, SystemExit):
        raise
    except BaseException as exc:  # noqa: BLE001 the save's failure is the verdict: recorded
        _raised(trainer, report, outcome, exc, start)
    trainer.phase = None
    outcome.update(moved=trainer.moves - moved, workers_after=len(checkpoint_workers()))
    return outcome


def _outcome(index, kind, mine):
    return {"step": index, "fault": kind, "faulted": mine, "error": None, "raised_in": None,
            "after_s": None, "lost": [], "pending_after": None, "again": None}


def _raised(trainer, report, outcome, exc, start):
    """Record ``exc`` and the saves it names as not saved (never loaded then); then
    finalize once more, as a training loop's next call would: that must raise nothing."""
    if HUNG.is_set():
        raise exc
    outcome.update(error=_describe(exc), raised_in=trainer.phase,
                   after_s=round(time.monotonic() - start, 2),
                   finalize_calls=trainer.finalize_calls)
    lost = [trainer.call_idx.get(i) for i in getattr(exc, "lost_saves", ()) or ()]
    for save in report["saves"]:
        if save["version"] in lost:
            save["lost"] = True
    outcome["lost"] = lost
    outcome["pending_after"] = trainer.queue.get_num_unfinalized_calls()
    try:
        trainer.finalize()
    except (KeyboardInterrupt, SystemExit):
        raise
    except BaseException as again:  # noqa: BLE001 the second failure is the verdict: recorded
        outcome["again"] = _describe(again)


def _describe(exc):
    return {"type": type(exc).__name__, "message": str(exc).splitlines()[0][:400],
            "text": str(exc)[-2000:],
            "notes": list(getattr(exc, "__notes__", ())),
            "worker_traceback": bool(getattr(exc, "worker_traceback", None)),
            "failed_ranks": list(getattr(exc, "failed_ranks", ()) or ())}


def main(argv=None):
    """``python -m harness.scenario``: the driver's command line with ``--starts``."""
    return driver.main(argv, Trainer, (("--starts", dict(
        choices=("spawn", "forkserver"), default="spawn",
        help="how NVRx starts its workers (forkserver: torch and NVRx imported once)")),))


if __name__ == "__main__":
    sys.exit(main())
