"""Drive the real NVRx persistent worker through a save lifecycle and report what happened:
what ``python -m nvrx_ipc_fix demo`` and ``selftest`` run, each in a fresh interpreter
(``runner``), with and without the fix (``NVRX_IPC_FIX_DISABLE=1``).

``python -m nvrx_ipc_fix.cli.driver --steps save,save,replace,save`` runs one trainer rank
with ``AsyncCallsQueue(persistent=True)`` and
``FileSystemWriterAsync(use_cached_data_structure=True)`` in this process; it prints one JSON
object. Steps: ``save`` (write new values into every tensor in place, save, finalize, load the
checkpoint back and count tensors whose values are not the ones saved), ``save-async`` (the same,
left pending until a later step finalizes it), ``replace`` (give every tensor new storage, as
``model.to("cpu")`` and back does), ``offload`` and ``onload`` (those two halves), ``measure``
(device memory used, allocated, reserved), ``close`` (close the queue, as
``maybe_finalize_async_save(terminate=True)`` does), ``flush``, ``terminate``, ``restart`` and
``suspend`` (``nvrx_ipc_fix.release`` with that strategy) and ``sleep<seconds>``. Any step written
``<step>@<rank>`` runs on that rank only; ``<step>#<name>`` also puts its entry in
``report["named"][name]``. The steps are registered in ``STEPS`` and ``PREFIXED`` (``step``); the
tests' harness (``tests/harness/scenario.py``) registers more, and its trainer injects worker
faults. ``--impl mcore`` uses megatron-core's own ``AsyncCallsQueue``; ``--finalize poll``
finalizes as a training loop does (``blocking=False`` every 50 ms until nothing is pending);
``--no-dist`` passes ``no_dist=True``.

A watchdog turns a step into a reported hang when it has not finished within ``--timeout``
seconds, or a few seconds after the worker it waits for has died (NVRx would wait for ever):
it reports, kills the worker and exits. Uses CUDA when present, else ``fakecuda``.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import inspect
import json
import logging
import multiprocessing
import os
import shutil
import sys
import tempfile
import threading
import time
from functools import partial

import nvrx_ipc_fix  # activates unless NVRX_IPC_FIX_DISABLE=1

import torch
import torch.distributed as dist

TYPE_CHECKING = False  # typing.TYPE_CHECKING, without importing typing
if TYPE_CHECKING:
    from collections.abc import Callable
    from typing import Any


def _kwargs_accepted(fn, **wanted):
    params = inspect.signature(fn).parameters
    return {k: v for k, v in wanted.items() if k in params}


FS = "nvidia_resiliency_ext.checkpointing.async_ckpt.filesystem_async"
#: ``--impl`` -> the module whose AsyncCallsQueue and AsyncRequest the trainer uses
IMPLS = {"nvrx": "nvidia_resiliency_ext.checkpointing.async_ckpt.core",
         "mcore": "megatron.core.dist_checkpointing.strategies.async_utils"}
HUNG = threading.Event()  # set once the watchdog has reported a hang
_scratch = None  # main()'s temp directory: this process's and its children's TMPDIR


def where_waits():
    """Where the main thread waits, for the hang report: nothing here (the tests' harness
    names the frames)."""
    return None


def _use_scratch(path):
    """Make ``path`` the temp directory of this process and of the processes it starts
    (NVRx's worker and results manager, multiprocessing's ``pymp-*`` directories), so that
    removing it removes all they left: at the end, after multiprocessing's own clean-up, or
    at the hang exit, which skips every clean-up. Not where ``path`` is too long for a
    manager's socket below it (``scratch.fits``)."""
    global _scratch
    from multiprocessing import util

    from .scratch import fits

    _scratch = path
    if fits(path):  # else the processes keep their TMPDIR, and the hang exit removes only path
        os.environ["TMPDIR"] = tempfile.tempdir = path
    util.Finalize(None, shutil.rmtree, (path,), {"ignore_errors": True}, exitpriority=-200)


class Trainer:
    """One rank: a state dict of ``n_tensors`` tensors and an NVRx queue."""

    def __init__(self, directory, n_tensors=8, numel=4096, cached=True, rank=0, world_size=1,
                 impl="nvrx", finalize="blocking", no_dist=False):
        import importlib

        self.core = importlib.import_module(IMPLS[impl])
        self.cuda = torch.cuda.is_available()
        if not self.cuda:
            from . import fakecuda

            fakecuda.install(forked_worker=impl == "mcore")
        self.directory = directory
        self.cached = cached
        self.numel = numel
        self.names = [f"rank{rank}.layer{i}.weight" for i in range(n_tensors)]
        self.pending = []  # (path, version) of saves scheduled but not finalized
        self.owns_group = not dist.is_initialized()  # run() destroys the group it made
        if self.owns_group:
            if self.cuda:
                torch.cuda.set_device(rank % torch.cuda.device_count())
            # torchrun sets MASTER_ADDR/RANK/WORLD_SIZE; otherwise ranks meet in a shared file
            init = "env://" if "MASTER_ADDR" in os.environ else f"file://{directory}/pg"
            # NCCL refuses two ranks on one device: ranks that share one meet over gloo
            nccl = self.cuda and world_size <= torch.cuda.device_count()
            dist.init_process_group("nccl" if nccl else "gloo", rank=rank,
                                    world_size=world_size, init_method=init)
        self.queue = self.core.AsyncCallsQueue(**_kwargs_accepted(
            self.core.AsyncCallsQueue.__init__, persistent=True, cpu_shm_mode=not self.cuda))
        self.rank, self.impl = rank, impl
        if finalize not in ("blocking", "poll"):
            raise ValueError(f"finalize must be 'blocking' or 'poll', not {finalize!r}")
        self.poll, self.no_dist = finalize == "poll", no_dist
        self.finalize_calls = 0  # maybe_finalize_async_calls calls so far
        if impl == "mcore":
            self.warm_up()
        elif not self.cuda:
            fakecuda.mark_queue(self.queue)
        self.phase = None  # "schedule" or "finalize" while a save runs
        self.workers = [None, None]  # pids of the worker before and after the last schedule
        self.call_idx = {}  # the queue's call_idx of each save -> its version
        self.state, self.moves = {}, 0  # moves: how often the storage moved (replace, offload…)
        self.replace()
        self.version = 0

    def _new_tensor(self):
        if self.cuda:
            return torch.zeros(self.numel, device="cuda")
        from .fakecuda import on_fake_device

        return on_fake_device(torch.zeros(self.numel))

    def replace(self):
        """New storage for every tensor (what an offload to CPU and back does)."""
        self.state = {name: self._new_tensor() for name in self.names}
        self.moves += 1

    def offload(self):
        """Move every tensor to host memory and return freed device blocks (``model.to("cpu")``)."""
        self.state = {name: t.as_subclass(torch.Tensor).to("cpu", copy=True)
                      for name, t in self.state.items()}
        self.moves += 1
        gc.collect()
        if self.cuda:
            torch.cuda.empty_cache()

    def onload(self):
        """Back to the device, in new storage."""
        if self.cuda:
            self.state = {name: t.to("cuda") for name, t in self.state.items()}
        else:
            from .fakecuda import on_fake_device

            self.state = {name: on_fake_device(t.clone()) for name, t in self.state.items()}
        self.moves += 1

    def measure(self):
        """Device memory now: used on the whole device, allocated and reserved by this process;
        how many checkpoint workers (processes) are alive, and the device memory (MiB) of
        each that has any (``nvidia-smi``)."""
        workers = checkpoint_workers()
        if not self.cuda:
            return {"device_used": None, "allocated": None, "reserved": None,
                    "workers": len(workers), "workers_on_device": None}
        torch.cuda.synchronize()
        free, total = torch.cuda.mem_get_info()
        apps = on_device()
        return {"device_used": total - free, "allocated": torch.cuda.memory_allocated(),
                "reserved": torch.cuda.memory_reserved(), "workers": len(workers),
                "workers_on_device": None if apps is None else
                {str(pid): mib for pid, mib in apps.items() if pid in workers}}

    def _expected(self, i, version):
        return float(version * 1000 + i)

    def warm_up(self):
        """megatron-core: start its worker now (as Megatron does at start-up). Its worker
        sets a CUDA device first thing: on the CPU it is forked from here (``fakecuda``)."""
        if self.impl == "mcore" and self.core.PersistentAsyncCaller._persistent_process is None:
            self.core.AsyncCallsQueue.warmup_persistent_caller(
                self.rank, "spawn" if self.cuda else "fork")

    def worker(self):
        """The worker process that takes the next save, if any: the queue's, else the one
        NVRx's warm-up slot holds for it."""
        from ..core.shapes import caller_of
        from ..worker.registry import process_of

        caller = caller_of(self.queue)
        if caller is None and self.impl == "nvrx":
            caller = getattr(self.core.AsyncCallsQueue, "_warmup_persistent_caller", None)
        return process_of(caller)

    def save(self, wait=True, fault=None):
        """Save new values; return (seconds blocked, seconds in total or None, path, version).

        ``wait=False`` leaves the save pending (finalized by a later step); ``fault``: how the
        worker fails during this save (``inject``)."""
        from nvidia_resiliency_ext.checkpointing.async_ckpt.filesystem_async import (
            FileSystemWriterAsync,
        )
        from nvidia_resiliency_ext.checkpointing.async_ckpt.state_dict_saver import (
            save_state_dict_async_finalize,
            save_state_dict_async_plan,
        )
        from torch.distributed.checkpoint import DefaultSavePlanner

        self.warm_up()  # megatron-core after a failure: the next worker, as at start-up
        self.version += 1
        with torch.no_grad():
            for i, name in enumerate(self.names):
                self.state[name].fill_(self._expected(i, self.version))
        path = os.path.join(self.directory, f"ckpt{self.version}")
        start = time.perf_counter()
        writer = FileSystemWriterAsync(path, **_kwargs_accepted(
            FileSystemWriterAsync.__init__, use_cached_data_structure=self.cached))
        writer, metadata, dist_wrapper = save_state_dict_async_plan(
            dict(self.state), writer, None, planner=DefaultSavePlanner())
        save_fn, preload_fn, save_args = writer.get_save_function_and_args()
        save_fn, preload_fn = self.inject(fault, path, save_fn, preload_fn)
        finalize = partial(save_state_dict_async_finalize, writer, metadata, dist_wrapper)
        self.phase = "schedule"
        before = self.worker()
        self.workers = [getattr(before, "pid", None), None]  # before and after the schedule
        self.queue.schedule_async_request(
            self.core.AsyncRequest(save_fn, save_args, [finalize], preload_fn=preload_fn))
        self.call_idx[self.queue.call_idx] = self.version
        blocked = time.perf_counter() - start
        self.workers[1] = getattr(self.worker(), "pid", None)
        if not wait:
            self.pending.append((path, self.version))
            return blocked, None, path, self.version
        self.finalize()
        return blocked, time.perf_counter() - start, path, self.version

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

    def inject(self, fault, path, save_fn, preload_fn):
        """The request's functions with ``fault`` put in: none here (the tests' harness
        injects worker faults)."""
        if fault is not None:
            raise ValueError(f"unknown fault {fault!r}")
        return save_fn, preload_fn

    def stale_tensors(self, path, version):
        """How many of this rank's tensors in the checkpoint at ``path`` are not ``version``'s."""
        from torch.distributed.checkpoint import FileSystemReader, load

        loaded = {name: torch.empty(self.numel) for name in self.names}
        load(loaded, storage_reader=FileSystemReader(path), process_group=None, no_dist=True)
        return sum(not torch.all(loaded[name] == self._expected(i, version)).item()
                   for i, name in enumerate(self.names))

    def close(self):
        self.queue.close()


#: Steps callers add (name -> function of the Trainer), e.g. a framework's offload method.
EXTRA_STEPS: dict[str, Callable[[Trainer], object]] = {}


def run(steps, directory, timeout=60.0, n_tensors=8, numel=4096, cached=True, rank=0,
        world_size=1, impl="nvrx", finalize="blocking", no_dist=False, make=None, **options):
    """Run ``steps``; return the report (a JSON-ready dict). ``make``: the trainer's class
    (default ``Trainer``), given ``options`` too."""
    status = nvrx_ipc_fix.status()
    report = {"device": "cuda" if torch.cuda.is_available() else "cpu (fakecuda stand-in)",
              "nvrx": status.nvrx_version, "source": status.source, "fix": _fix_states(),
              "steps": list(steps), "rank": rank, "impl": impl, "finalize": finalize,
              "no_dist": no_dist, "saves": [], "named": {}, "hang": None, "log": []}
    _capture_log(report["log"])
    trainer = (make or Trainer)(directory, n_tensors, numel, cached, rank, world_size, impl,
                                finalize, no_dist, **options)
    watchdog = _Watchdog(trainer, report, timeout)
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
            checked = []
            for save in report["saves"]:
                if save["stale"] is None and not save.get("lost"):
                    try:
                        save["stale"] = trainer.stale_tensors(save["path"], save["version"])
                    except (KeyboardInterrupt, SystemExit):
                        raise
                    except BaseException as exc:  # noqa: BLE001 lost, no error (no metadata, say)
                        save["stale"] = f"unloadable ({type(exc).__name__}: {exc})"[:300]
                    checked.append(save["path"])
            if checked and world_size > 1:
                dist.barrier()  # every rank has read them (all ranks run the same steps)
            if rank == 0:  # checked: free the disk
                for path in checked:
                    shutil.rmtree(path, ignore_errors=True)
            if checked and world_size > 1:
                dist.barrier()  # the next step starts together, so no rank times the deletion
    report["fix"] = _fix_states()
    report["call_idx"] = sorted(trainer.call_idx)  # NVRx's count of each save scheduled
    report["cleanups"] = nvrx_ipc_fix.status().cleanups
    report["releases_total"] = nvrx_ipc_fix.status().releases
    report["prewarms_total"] = nvrx_ipc_fix.status().prewarms
    report["prewarm_failures"] = nvrx_ipc_fix.status().prewarm_failures
    report["pinned_bytes"] = nvrx_ipc_fix.status().pinned_bytes
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
    if step.endswith("?") and "?" in STEPS:
        found, step = STEPS["?"], step[:-1]
    else:
        found = STEPS.get(step) or next(
            ((key, function) for prefix, (key, function) in PREFIXED.items()
             if step.startswith(prefix) and step != prefix), None)
    if found is None:
        raise ValueError(f"unknown step {step!r}")
    key, function = found
    entry = function(trainer, report, index, step)
    return _add(report, key, entry) if key and entry is not None else entry


def _add(report, key, entry):
    report.setdefault(key, []).append(entry)
    return entry


#: Step name -> (the report's list its entry goes to, or None; function(trainer, report,
#: index, step) -> the entry or None). ``PREFIXED``: the same for steps named by a prefix and
#: an argument (``sleep2``; the tests' ``fault-kill``, ``offloading-flush``).
STEPS: dict[str, tuple[str | None, Callable[..., Any]]] = {}
PREFIXED: dict[str, tuple[str | None, Callable[..., Any]]] = {}


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
    return {"step": index, "blocked_s": round(blocked, 4), "total_s": total and round(total, 4),
            "path": path, "version": version, "stale": None, "tensors": len(trainer.names),
            "worker_before": trainer.workers[0], "worker": trainer.workers[1]}


@step("replace", "offload", "onload", "close")
def _trainer_method(trainer, report, index, name):
    getattr(trainer, name.replace("-", "_"))()


@step("sleep", prefix=True)
def _sleep(trainer, report, index, name):
    time.sleep(float(name[len("sleep"):]))


@step("measure", adds="measures")
def _measure(trainer, report, index, name):
    return trainer.measure()


@step("flush", "terminate", "restart", "suspend", adds="releases")
def _release(trainer, report, index, name):
    return dataclasses.asdict(nvrx_ipc_fix.release(trainer.queue, strategy=name))


def on_device():
    """``{pid: MiB}`` of the processes with memory on the device (``nvidia-smi``), or None."""
    import subprocess

    try:
        out = subprocess.run(["nvidia-smi", "--query-compute-apps=pid,used_memory",
                              "--format=csv,noheader,nounits"], capture_output=True, text=True,
                             timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    rows = [line.split(",") for line in out.splitlines() if line.strip()]
    return {int(pid): int(mib) for pid, mib in rows if pid.strip().isdigit()
            and mib.strip().isdigit()}


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
            records.append({"level": record.levelname, "message": record.getMessage()[:400],
                            "t": round(time.monotonic() - start, 2)})

    logging.getLogger("nvrx_ipc_fix").addHandler(Keep(logging.WARNING))


def _fix_states():
    return {f.name: str(f.state) for f in nvrx_ipc_fix.status().fixes}


class _Watchdog:
    """Turns a step that does not end into a reported hang: after ``timeout`` seconds, or
    a few seconds after the worker died (the package ends such a wait within about a
    second; NVRx never does). It reports, kills the worker and exits."""

    def __init__(self, trainer, report, timeout):
        self.trainer, self.report, self.timeout = trainer, report, timeout
        watched = _fix_states().get("worker_watch") == "active"
        self.grace = 8.0 if watched else 0.5
        self.step = self.started = self.died_at = None
        threading.Thread(target=self._run, daemon=True).start()

    def begin(self, index):
        self.step, self.started, self.died_at = index, time.monotonic(), None

    def end(self):
        self.step = None

    def _run(self):
        while True:
            time.sleep(0.2)
            step, now = self.step, time.monotonic()
            if step is None:
                continue
            dead = self._worker_dead()
            if dead is False:
                self.died_at = None  # a fresh worker took over
            elif dead and self.died_at is None:
                self.died_at = now
            died = self.died_at is not None
            limit = self.timeout + (60 if step == 0 else 0)  # a cold start under load
            if (died and now - self.died_at > self.grace) or now - self.started > limit:
                if step == self.step:
                    self._hang(step, now, died)

    def _worker_dead(self):
        """Has the worker that takes this step died (None: there is none, or the step does
        not wait on it; keep the answer)?"""
        if self.trainer.phase == "fork":
            return None
        worker = self.trainer.worker()
        return None if worker is None else worker.exitcode is not None

    def _hang(self, step, now, died):
        self.report["hang"] = {"step": step, "after_s": round(now - self.started, 1),
                               "worker_died": died, "waits_in": where_waits()}
        self.report["fix"] = _fix_states()
        HUNG.set()
        print(json.dumps(self.report), flush=True)
        if dist.is_initialized() and dist.get_world_size() > 1:
            time.sleep(self.timeout)  # stay hung, so that the other ranks see a hang too
        self.exit()

    @staticmethod
    def exit():
        """End this process's descendants (NVRx's worker, its writer processes, the results
        manager: stopped, then killed, as the guardian ends them) and the process, with no
        clean-up but the scratch, which none of them can write into any more."""
        from ..worker.guardian_process import children, end_trees, pidfd

        found = end_trees({pid: pidfd(pid) for pid in children(os.getpid())})
        multiprocessing.active_children()  # reaps the children multiprocessing started
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and any(_running(pid) for pid in found):
            time.sleep(0.01)
        if _scratch is not None:  # os._exit runs no clean-up
            shutil.rmtree(_scratch, ignore_errors=True)
        os._exit(0)


def _running(pid):
    """Is ``pid`` still a process that can write (not gone, not a zombie)?"""
    from ..worker.monitor import stat_fields

    try:
        return stat_fields(pid)[0] != b"Z"
    except OSError:  # gone
        return False


def main(argv=None, make=None, options=()):
    """The command line: run the steps, print the report. ``make`` and ``options`` (``(flag,
    add_argument's keywords)`` each, passed to ``make`` by their names): a trainer of the
    caller's (the tests' harness)."""
    parser = argparse.ArgumentParser(prog="python -m nvrx_ipc_fix.cli.driver")
    parser.add_argument("--steps", default="save,save,replace,save")
    parser.add_argument("--timeout", type=float, default=60.0, help="seconds before a save "
                        "counts as hung")
    parser.add_argument("--tensors", type=int, default=8)
    parser.add_argument("--numel", type=int, default=4096)
    parser.add_argument("--rank", type=int, default=int(os.environ.get("RANK", 0)),
                        help="default: $RANK (torchrun)")
    parser.add_argument("--world-size", type=int, default=int(os.environ.get("WORLD_SIZE", 1)),
                        help="default: $WORLD_SIZE (torchrun)")
    parser.add_argument("--dir", default=None, help="shared directory (several ranks)")
    parser.add_argument("--no-cache", action="store_true",
                        help="use_cached_data_structure=False (the reference)")
    parser.add_argument("--impl", choices=tuple(IMPLS), default="nvrx",
                        help="whose persistent worker: NVRx's or megatron-core's")
    parser.add_argument("--finalize", choices=("blocking", "poll"), default="blocking",
                        help="one blocking finalize, or a training loop's non-blocking polls")
    parser.add_argument("--no-dist", action="store_true", help="finalize with no_dist=True")
    for flag, how in options:
        parser.add_argument(flag, **how)
    args = parser.parse_args(argv)
    extra = {flag.lstrip("-").replace("-", "_"): None for flag, _ in options}
    scratch = tempfile.mkdtemp(prefix="nvrx-ipc-fix-")
    _use_scratch(scratch)  # removed at exit, however the run ends
    report = run(args.steps.split(","), args.dir or scratch, args.timeout, args.tensors,
                 args.numel, not args.no_cache, args.rank, args.world_size, args.impl,
                 args.finalize, args.no_dist, make, **{k: getattr(args, k) for k in extra})
    print(json.dumps(report), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
