"""The tests' harness: a trainer rank on the real NVRx worker, built on the demo's driver
(``nvrx_ipc_fix.cli.driver``: its trainer, steps and watchdog), with what the tests add:
several ranks, megatron-core's queue, a training loop's finalize, worker faults, NVRx's
workers from a forkserver, and the steps below.

``python -m harness.scenario --steps save,fault-kill,save`` (``tests/`` on the path) runs one
trainer rank and prints one JSON object, its report; ``run`` does the same in this process.
``--rank``/``--world-size`` (default: torchrun's ``RANK``/``WORLD_SIZE``) and ``--dir`` (the
directory the ranks share) run one rank of several; ``--impl mcore`` uses megatron-core's own
``AsyncCallsQueue``; ``--finalize poll`` finalizes as a training loop does (``blocking=False``
every 50 ms until nothing is pending); ``--no-dist`` passes ``no_dist=True``; ``--no-cache``
saves with ``use_cached_data_structure=False`` (the reference); ``--starts forkserver``
starts NVRx's workers from a forkserver (``start_workers_from_forkserver``).

Steps: the driver's (``save``, ``replace``, ``offload``, ``onload``, ``measure``, which here
also counts the checkpoint workers and, on a GPU, the device memory used and each worker's,
``close``, ``flush``, ``terminate``, ``restart``, ``suspend``), and ``save-async`` (a save left
pending until a later step finalizes it), ``sleep<seconds>``, ``fault-<kind>`` or
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
``__del__`` does when the queue is collected). Tests add steps of their own to
``EXTRA_STEPS`` (name -> function of the trainer).

Any step written ``<step>@<rank>`` runs on that rank only; ``<step>#<name>`` also puts its
entry in ``report["named"][name]``. A fault step, and a ``finalize`` step that raises,
reports what was raised, by which call, which saves the error names as not saved, what is
still pending after it, and what one more finalize then raises (nothing, by the protocol); a
``fault-stop`` also when its worker stopped itself, when it was seen stopped and when it was
sent SIGCONT (``stopped``, on the clock of the log lines' ``t``). Any step but a fault, written
``<step>?``, may raise (a call the package finalizes in), and ``calls`` reports what it
raised. The report also holds the package's WARNING and ERROR log lines (``log``), each
fix's state, and its totals at the end; a hang report says where the main thread waits
(``waits_in``: ``stacks``).
"""

import argparse
import dataclasses
import faulthandler
import gc
import importlib
import json
import logging
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
import torch.distributed as dist

from harness import faults, gates, stacks
from nvrx_ipc_fix.cli import driver, fakecuda
from nvrx_ipc_fix.cli.driver import HUNG, kwargs_accepted
from nvrx_ipc_fix.worker.guardian_process import stat_fields

import nvrx_ipc_fix

FS = "nvidia_resiliency_ext.checkpointing.async_ckpt.filesystem_async"
#: ``--impl`` -> the module whose AsyncCallsQueue and AsyncRequest the trainer uses
IMPLS = {"nvrx": driver.CORE, "mcore": "megatron.core.dist_checkpointing.strategies.async_utils"}
STOP_SECONDS = 6.0  # how long fault-stop keeps the worker stopped
FORK_EXIT_BOUND = 20.0  # seconds a forked child may take to exit before it counts as hung
#                        (0.06 s unloaded; it waits for ever where it hangs)
CHANGED = "SCENARIO_ENV_CHANGED"  # the variable env-change sets
#: Steps tests add: name -> function of the trainer (its entry goes to ``report["named"]``
#: where the step is written ``<step>#<name>``)
EXTRA_STEPS = {}


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
    writer = importlib.import_module(FS)
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
    """The driver's trainer as rank ``rank`` of ``world_size``, on ``impl``'s queue, finalized
    as ``finalize`` says, with worker faults (``inject``: ``faults.KINDS``), ``gate`` and
    ``starts``: how NVRx starts its workers, ``spawn`` (its own way) or ``forkserver``
    (``start_workers_from_forkserver``)."""

    def __init__(
        self,
        directory,
        n_tensors=8,
        numel=4096,
        cached=True,
        rank=0,
        world_size=1,
        impl="nvrx",
        finalize="blocking",
        no_dist=False,
        starts="spawn",
    ):
        # the driver's set-up, generalized (its own is one rank on NVRx's queue): no super()
        if starts not in ("spawn", "forkserver"):
            raise ValueError(f"starts must be 'spawn' or 'forkserver', not {starts!r}")
        if finalize not in ("blocking", "poll"):
            raise ValueError(f"finalize must be 'blocking' or 'poll', not {finalize!r}")
        self.core = importlib.import_module(IMPLS[impl])
        self.cuda = torch.cuda.is_available()
        # megatron-core's worker is forked on the CPU; on a GPU, NVRx spawns its own (CUDA
        # cannot be used in a process forked from one that initialized it)
        if starts == "forkserver" and impl == "nvrx" and not self.cuda:
            start_workers_from_forkserver(self.core)
        if not self.cuda:
            fakecuda.install(forked_worker=impl == "mcore")
        self.directory, self.cached, self.numel = directory, cached, numel
        self.names = [f"rank{rank}.layer{i}.weight" for i in range(n_tensors)]
        self.owns_group = not dist.is_initialized()  # run() destroys the group it made
        if self.owns_group:
            if self.cuda:
                torch.cuda.set_device(rank % torch.cuda.device_count())
            # torchrun sets MASTER_ADDR/RANK/WORLD_SIZE; otherwise ranks meet in a shared file
            init = "env://" if "MASTER_ADDR" in os.environ else f"file://{directory}/pg"
            # NCCL refuses two ranks on one device: ranks that share one meet over gloo
            nccl = self.cuda and world_size <= torch.cuda.device_count()
            dist.init_process_group(
                "nccl" if nccl else "gloo", rank=rank, world_size=world_size, init_method=init
            )
        self.queue = self.core.AsyncCallsQueue(
            **kwargs_accepted(
                self.core.AsyncCallsQueue.__init__, persistent=True, cpu_shm_mode=not self.cuda
            )
        )
        self.rank, self.impl = rank, impl
        self.poll, self.no_dist = finalize == "poll", no_dist
        self.finalize_calls = 0  # maybe_finalize_async_calls calls so far
        if impl == "mcore":
            self.warm_up()
        elif not self.cuda:
            fakecuda.mark_queue(self.queue)
        self.pending = []  # (path, version) of saves scheduled but not finalized
        self.phase = None  # "schedule" or "finalize" while a save runs
        self.workers = [None, None]  # pids of the worker before and after the last schedule
        self.call_idx = {}  # the queue's call_idx of each save -> its version
        # fault-stop's: the worker stopped itself, was seen stopped, was sent SIGCONT
        self.stop_window = [None, None, None]
        self.gate = None  # (gate, done): the next save's write waits and signals (gates)
        self.state, self.moves = {}, 0  # moves: how often the storage moved (replace, offload…)
        self.replace()
        self.version = 0

    def replace(self):
        super().replace()
        self.moves += 1

    def offload(self):
        super().offload()
        self.moves += 1

    def onload(self):
        super().onload()
        self.moves += 1

    def measure(self):
        """The driver's measure, with how many checkpoint workers (processes) are alive; on a
        GPU also the memory used on the whole device and the device memory (MiB) of each
        worker that has any (``nvidia-smi``)."""
        found = dict(super().measure(), device_used=None, workers_on_device=None)
        workers = checkpoint_workers()
        found["workers"] = len(workers)
        if self.cuda:
            free, total = torch.cuda.mem_get_info()
            apps = on_device()
            found.update(
                device_used=total - free,
                workers_on_device=None
                if apps is None
                else {str(pid): mib for pid, mib in apps.items() if pid in workers},
            )
        return found

    def warm_up(self):
        """megatron-core: start its worker now (as Megatron does at start-up). Its worker
        sets a CUDA device first thing: on the CPU it is forked from here (``fakecuda``)."""
        if self.impl == "mcore" and self.core.PersistentAsyncCaller._persistent_process is None:
            self.core.AsyncCallsQueue.warmup_persistent_caller(
                self.rank, "spawn" if self.cuda else "fork"
            )

    def save(self, wait=True, fault=None):
        """Save new values; return (seconds blocked, seconds in total or None, path, version).

        ``wait=False`` leaves the save pending (finalized by a later step); ``fault``: how the
        worker fails during this save (``inject``)."""
        self.warm_up()  # megatron-core after a failure: the next worker, as at start-up
        path, version = self.fill()
        start = time.perf_counter()
        request = self.inject(fault, path, self.request(path))
        self.phase = "schedule"
        self.workers = [getattr(self.worker(), "pid", None), None]  # before and after
        self.queue.schedule_async_request(request)
        self.call_idx[self.queue.call_idx] = version
        blocked = time.perf_counter() - start
        self.workers[1] = getattr(self.worker(), "pid", None)
        if not wait:
            self.pending.append((path, version))
            return blocked, None, path, version
        self.finalize()
        return blocked, time.perf_counter() - start, path, version

    def finalize(self):
        """Finalize every pending save: one blocking call, or (``poll``) a training loop's
        non-blocking call every 50 ms until none is pending."""
        self.phase = "finalize"
        if self.poll:
            while self.queue.get_num_unfinalized_calls():
                self.finalize_calls += 1
                self.queue.maybe_finalize_async_calls(blocking=False, no_dist=self.no_dist)
                if self.queue.get_num_unfinalized_calls():
                    time.sleep(0.05)
        else:
            self.finalize_calls += 1
            self.queue.maybe_finalize_async_calls(blocking=True, no_dist=self.no_dist)
        self.phase = None

    def inject(self, fault, path, request):
        """``request`` with ``fault`` put in (see ``faults.KINDS``), and the ``gate`` set for
        this save (``gates.gated``)."""
        save_fn, preload_fn = request.async_fn, request.preload_fn
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
            save_fn = partial(faults.stop_then, path + ".stopped", save_fn)
            threading.Thread(
                target=self._continue_worker, args=(path + ".stopped",), daemon=True
            ).start()
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
            save_fn = partial(
                faults.hold_tree if fault == "hold-tree" else faults.hold,
                os.path.join(self.directory, "writing"),
            )
        elif fault is not None:
            raise ValueError(f"unknown fault {fault!r} (known: {', '.join(faults.KINDS)})")
        return request._replace(async_fn=save_fn, preload_fn=preload_fn)

    def kill_worker(self):
        """SIGKILL the worker that would take the next save (if any) and wait until it is gone."""
        worker = self.worker()
        if worker is not None:
            os.kill(worker.pid, signal.SIGKILL)
            while worker.is_alive():
                time.sleep(0.05)

    def _continue_worker(self, marker, limit=120.0):
        """SIGCONT the worker ``STOP_SECONDS`` after it stopped itself (timed from the stop,
        so that a slow save's handshake on a loaded machine does not shorten the stall);
        ``marker``: the file where it wrote when it stopped."""
        deadline = time.monotonic() + limit
        while time.monotonic() < deadline and not _stopped(self.worker()):
            time.sleep(0.05)
        self.stop_window[1] = time.monotonic()
        try:
            with open(marker) as stopped:
                self.stop_window[0] = float(stopped.read())
        except (OSError, ValueError):
            pass
        time.sleep(STOP_SECONDS)
        worker = self.worker()
        self.stop_window[2] = time.monotonic()  # before: nothing after it can precede it
        if worker is not None and worker.pid:
            os.kill(worker.pid, signal.SIGCONT)

    def probe(self):
        """What the worker holds now (see ``faults.describe_cache``)."""
        from nvrx_ipc_fix.worker.release import run_in_worker

        path = os.path.join(self.directory, "probe.json")
        error = run_in_worker(self.queue, faults.describe_cache, (path,), 30)
        if error:
            raise RuntimeError(error)
        with open(path) as found:
            return json.load(found)


def run(
    steps,
    directory,
    timeout=60.0,
    n_tensors=8,
    numel=4096,
    cached=True,
    rank=0,
    world_size=1,
    impl="nvrx",
    finalize="blocking",
    no_dist=False,
    starts="spawn",
):
    """Run ``steps``; return the report (a JSON-ready dict)."""
    status = nvrx_ipc_fix.status()
    report = {
        "device": "cuda" if torch.cuda.is_available() else "cpu (fakecuda stand-in)",
        "nvrx": status.nvrx_version,
        "source": status.source,
        "fix": driver.fix_states(),
        "steps": list(steps),
        "rank": rank,
        "impl": impl,
        "finalize": finalize,
        "no_dist": no_dist,
        "saves": [],
        "named": {},
        "hang": None,
        "log": [],
    }
    _capture_log(report["log"])
    trainer = Trainer(
        directory, n_tensors, numel, cached, rank, world_size, impl, finalize, no_dist, starts
    )
    watchdog = Watchdog(trainer, report, timeout)
    for index, step in enumerate(steps):
        step, _, label = step.partition("#")
        name, _, only = step.partition("@")
        if only and not name.startswith("fault-"):  # a fault step sees every rank
            if int(only) != rank:
                continue  # another rank's step
            step = name
        watchdog.begin(index)
        try:
            entry = _step(trainer, report, index, step)
            if label:
                report["named"][label] = {"step": index} if entry is None else entry
        except BaseException:
            if HUNG.is_set():  # reported; a peer's exit broke the collective
                threading.Event().wait()  # the watchdog ends the process
            raise
        watchdog.end()
        if not trainer.queue.get_num_unfinalized_calls():  # verify what is finalized
            checked = driver.check_saves(trainer, report["saves"])
            if checked and world_size > 1:
                dist.barrier()  # every rank has read them (all ranks run the same steps)
            if rank == 0:  # checked: free the disk
                for path in checked:
                    shutil.rmtree(path, ignore_errors=True)
            if checked and world_size > 1:
                dist.barrier()  # the next step starts together, so no rank times the deletion
    status = nvrx_ipc_fix.status()
    report.update(
        fix=driver.fix_states(),
        call_idx=sorted(trainer.call_idx),
        cleanups=status.cleanups,
        releases_total=status.releases,
        prewarms_total=status.prewarms,
        prewarm_failures=status.prewarm_failures,
        pinned_bytes=status.pinned_bytes,
    )
    watchdog.begin(len(steps))  # the close at the end must not hang either
    trainer.close()
    if trainer.owns_group:  # else NCCL's teardown at exit can hang (megatron-core 0.19.2 loaded)
        dist.destroy_process_group()
    watchdog.end()
    return report


def _step(trainer, report, index, step):
    """Run one step (see the module doc): the registered step (``EXTRA_STEPS``, ``STEPS``,
    ``PREFIXED``; ``<step>?``: ``STEPS["?"]``, given ``<step>``), whose entry, if it makes
    one, goes to its list in the report. Returns that entry (None: it makes none)."""
    if step in EXTRA_STEPS:
        return EXTRA_STEPS[step](trainer)
    if step.endswith("?"):
        found, step = STEPS["?"], step[:-1]
    else:
        found = STEPS.get(step) or next(
            (
                (key, function)
                for prefix, (key, function) in PREFIXED.items()
                if step.startswith(prefix) and step != prefix
            ),
            None,
        )
    if found is None:
        raise ValueError(f"unknown step {step!r}")
    key, function = found
    entry = function(trainer, report, index, step)
    return _add(report, key, entry) if key and entry is not None else entry


def _add(report, key, entry):
    report.setdefault(key, []).append(entry)
    return entry


#: Step name -> (the report's list its entry goes to, or None; function(trainer, report,
#: index, step) -> the entry or None): the driver's steps, and those below. ``PREFIXED``: the
#: same for steps named by a prefix and an argument (``sleep2``, ``fault-kill``).
STEPS = {
    name: (key, lambda trainer, report, index, step, function=function: function(trainer))
    for name, (key, function) in driver.STEPS.items()
}
PREFIXED = {}


def step(*names, adds=None, prefix=False):
    """Register the decorated function as the step(s) ``names`` (see ``STEPS``)."""

    def register(function):
        for name in names:
            (PREFIXED if prefix else STEPS)[name] = (adds, function)
        return function

    return register


@step("save", "save-async", adds="saves")
def _save(trainer, report, index, name):
    blocked, total, path, version = trainer.save(wait=name == "save")
    return {
        "step": index,
        "blocked_s": round(blocked, 4),
        "total_s": total and round(total, 4),
        "path": path,
        "version": version,
        "stale": None,
        "tensors": len(trainer.names),
        "worker_before": trainer.workers[0],
        "worker": trainer.workers[1],
    }


@step("sleep", prefix=True)
def _sleep(trainer, report, index, name):
    time.sleep(float(name[len("sleep") :]))


class Watchdog(driver.Watchdog):
    """The driver's watchdog; its hang report also says where the main thread waits
    (``stacks``) and each fix's state. A rank of several that reported a hang stays hung
    for ``timeout`` s, so that the other ranks see a hang too. A ``fork-exit`` step waits on
    its child, not on the worker."""

    def _worker_dead(self):
        return None if self.trainer.phase == "fork" else super()._worker_dead()

    def _hang(self, step, now, died):
        self.report["hang"] = {
            "step": step,
            "after_s": round(now - self.started, 1),
            "worker_died": died,
            "waits_in": stacks.main(),
        }
        self.report["fix"] = driver.fix_states()
        HUNG.set()
        print(json.dumps(self.report), flush=True)
        if dist.is_initialized() and dist.get_world_size() > 1:
            time.sleep(self.timeout)
        self.exit()


def on_device():
    """``{pid: MiB}`` of the processes with memory on the device (``nvidia-smi``), or None."""
    import subprocess

    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"],
            capture_output=True,
            text=True,
            timeout=30,
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    rows = [line.split(",") for line in out.splitlines() if line.strip()]
    return {
        int(pid): int(mib) for pid, mib in rows if pid.strip().isdigit() and mib.strip().isdigit()
    }


def checkpoint_workers():
    """The pids of this process's live checkpoint workers: its children but NVRx's results
    queue manager (``SyncManager-N``)."""
    return [p.pid for p in multiprocessing.active_children() if "Manager" not in p.name]


_log_start = [time.monotonic()]  # the clock of the log lines' "t" (seconds since this)


def _capture_log(records):
    """Collect the package's WARNING and ERROR lines into ``records``."""
    _log_start[0] = start = time.monotonic()

    class Keep(logging.Handler):
        def emit(self, record):
            records.append(
                {
                    "level": record.levelname,
                    "message": record.getMessage()[:400],
                    "t": round(time.monotonic() - start, 2),
                }
            )

    logging.getLogger("nvrx_ipc_fix").addHandler(Keep(logging.WARNING))


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
    with nvrx_ipc_fix.offloading(trainer.queue, strategy=name[len("offloading-") :]) as released:
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

    faults = name[len("driver-") :].split("+") if name.startswith("driver-") else ()
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
    or failed; its pid, what ``status()`` says of it, and the earlier standbys still alive
    (waited for, up to 60 s: one that was let go exits once its last child has)."""
    from nvrx_ipc_fix.worker import standby
    from nvrx_ipc_fix.worker.guardian_process import alive

    current = standby._standby
    if current is not None:
        current.ready.wait(120.0)
    pid = getattr(current, "pid", None)
    earlier = [s["pid"] for s in report.get("standby", []) if s["pid"] not in (None, pid)]
    return {
        "pid": pid,
        "ready": bool(current and current.ready.is_set()),
        "status": nvrx_ipc_fix.status().standby,
        "earlier_alive": _left_alive(earlier, alive),
    }


@step("kill-standby", adds="standby_kills")
def _kill_standby(trainer, report, index, name):
    """SIGKILL the standby; its pid, and those of its children still alive once they are
    gone (waited for, up to 60 s)."""
    from nvrx_ipc_fix.worker import standby
    from nvrx_ipc_fix.worker.guardian_process import alive, children

    pid = standby._standby.pid
    below = children(pid)
    os.kill(pid, signal.SIGKILL)
    return {"pid": pid, "orphans": _left_alive(below, alive)}


def _left_alive(pids, alive, bound=60.0):
    """Those of ``pids`` still ``alive`` once none is, or at the bound."""
    deadline = time.monotonic() + bound
    while any(map(alive, pids)) and time.monotonic() < deadline:
        time.sleep(0.05)
    return [pid for pid in pids if alive(pid)]


@step("kill-manager", adds="manager_kills")
def _kill_manager(trainer, report, index, name):
    """SIGKILL NVRx's results-queue manager and reap it; its pid."""
    from nvrx_ipc_fix.core.shapes import results_manager_process

    process = results_manager_process(sys.modules[FS])
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
        return {
            "fds": len(os.listdir("/proc/self/fd")) if os.path.isdir("/proc/self/fd") else None,
            "threads": threading.active_count(),
            "semaphores": sum(isinstance(o, SemLock) for o in gc.get_objects()),
        }

    started = time.monotonic()
    found = least = sample()
    while time.monotonic() < started + settle:
        time.sleep(0.2)
        again = sample()
        least = {
            kind: min(least[kind], again[kind]) if again[kind] is not None else None
            for kind in again
        }
        if again == found and time.monotonic() >= started + 1.0:
            break
        found = again
    return least


def _started(trainer):
    """After a prewarm: the worker that waits for the next save, and whether its process
    exists (``/proc``)."""
    pid = getattr(trainer.worker(), "pid", None)
    return {
        "pid": pid,
        "exists": pid is not None and os.path.exists(f"/proc/{pid}"),
        "workers": len(checkpoint_workers()),
    }


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
    from nvrx_ipc_fix.worker import prewarm

    began = time.monotonic()
    caller = prewarm._serving(trainer.queue, sys.modules[prewarm.CORE])
    start = prewarm._starts.get(caller) if caller is not None else None
    if start is not None:  # until it is ready or failed
        start.thread.join()
    waited = round(time.monotonic() - began, 3)
    if start is None:
        return {
            "pid": None,
            "ready_s": None,
            "error": None,
            "waited_s": waited,
            "pinning": 0,
            "pinned_bytes": 0,
            "pin_error": None,
        }
    return {
        "pid": start.process.pid,
        "waited_s": waited,
        "error": start.error,
        "standby": start.standby,
        "parent": _parent(start.process.pid),
        "env_changed": _environ(start.process.pid).get(CHANGED),
        "ready_s": None if start.ready_s is None else round(start.ready_s, 3),
        "pinning": start.pinning,
        "pinned_bytes": start.pinned_bytes,
        "pin_error": start.pin_error,
        "first_request_s": start.first_request_s,
        "pin_s": start.pin_s,
    }


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
    return {
        "pid": pid,
        "exit_s": round(seconds, 2),
        "hung": not done,
        "exitcode": os.waitstatus_to_exitcode(status) if done else None,
        "waits_in": None if done else stacks.dumped(text),
        "stderr": text[-2000:],
    }


def _fault(trainer, report, index, step):
    """One ``fault-<kind>[-async][@<rank>]`` step: a save whose worker fails on the chosen
    ranks (the others save normally); ``-async`` leaves it pending for a later step."""
    kind, _, only = step[len("fault-") :].partition("@")
    kind, wait = (kind[: -len("-async")], False) if kind.endswith("-async") else (kind, True)
    mine = not only or int(only) == trainer.rank
    outcome = _outcome(index, kind, mine)
    start, version = time.monotonic(), trainer.version + 1
    path = os.path.join(trainer.directory, f"ckpt{version}")
    report["saves"].append(
        {
            "step": index,
            "path": path,
            "version": version,
            "stale": None,
            "tensors": len(trainer.names),
            "fault": kind if mine else None,
        }
    )
    try:
        blocked, total, _, _ = trainer.save(wait=wait, fault=kind if mine else None)
        report["saves"][-1].update(blocked_s=round(blocked, 4), total_s=total and round(total, 4))
        if kind == "stop" and mine:  # on the log lines' clock
            outcome["stopped"] = [
                None if at is None else round(at - _log_start[0], 2) for at in trainer.stop_window
            ]
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
    return {
        "step": index,
        "fault": kind,
        "faulted": mine,
        "error": None,
        "raised_in": None,
        "after_s": None,
        "lost": [],
        "pending_after": None,
        "again": None,
    }


def _raised(trainer, report, outcome, exc, start):
    """Record ``exc`` and the saves it names as not saved (never loaded then); then
    finalize once more, as a training loop's next call would: that must raise nothing."""
    if HUNG.is_set():
        raise exc
    outcome.update(
        error=_describe(exc),
        raised_in=trainer.phase,
        after_s=round(time.monotonic() - start, 2),
        finalize_calls=trainer.finalize_calls,
    )
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
    return {
        "type": type(exc).__name__,
        "message": str(exc).splitlines()[0][:400],
        "text": str(exc)[-2000:],
        "notes": list(getattr(exc, "__notes__", ())),
        "worker_traceback": bool(getattr(exc, "worker_traceback", None)),
        "failed_ranks": list(getattr(exc, "failed_ranks", ()) or ()),
    }


def main(argv=None):
    """``python -m harness.scenario``: run the steps, print the report."""
    parser = argparse.ArgumentParser(prog="python -m harness.scenario")
    parser.add_argument("--steps", default="save,save,replace,save")
    parser.add_argument(
        "--timeout", type=float, default=60.0, help="seconds before a save counts as hung"
    )
    parser.add_argument("--tensors", type=int, default=8)
    parser.add_argument("--numel", type=int, default=4096)
    parser.add_argument(
        "--rank", type=int, default=int(os.environ.get("RANK", 0)), help="default: $RANK (torchrun)"
    )
    parser.add_argument(
        "--world-size",
        type=int,
        default=int(os.environ.get("WORLD_SIZE", 1)),
        help="default: $WORLD_SIZE (torchrun)",
    )
    parser.add_argument("--dir", default=None, help="shared directory (several ranks)")
    parser.add_argument(
        "--no-cache", action="store_true", help="use_cached_data_structure=False (the reference)"
    )
    parser.add_argument(
        "--impl",
        choices=tuple(IMPLS),
        default="nvrx",
        help="whose persistent worker: NVRx's or megatron-core's",
    )
    parser.add_argument(
        "--finalize",
        choices=("blocking", "poll"),
        default="blocking",
        help="one blocking finalize, or a training loop's non-blocking polls",
    )
    parser.add_argument("--no-dist", action="store_true", help="finalize with no_dist=True")
    parser.add_argument(
        "--starts",
        choices=("spawn", "forkserver"),
        default="spawn",
        help="how NVRx starts its workers (forkserver: torch and NVRx imported once)",
    )
    args = parser.parse_args(argv)
    scratch = tempfile.mkdtemp(prefix="nvrx-ipc-fix-")
    driver.use_scratch(scratch)  # removed at exit, however the run ends
    report = run(
        args.steps.split(","),
        args.dir or scratch,
        args.timeout,
        args.tensors,
        args.numel,
        not args.no_cache,
        args.rank,
        args.world_size,
        args.impl,
        args.finalize,
        args.no_dist,
        args.starts,
    )
    print(json.dumps(report), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
