"""Drive the real NVRx persistent worker through a save lifecycle and report what happened.

``python -m nvrx_ipc_fix.scenario --steps save,save,replace,save`` runs, in this process,
one trainer rank with ``AsyncCallsQueue(persistent=True)`` and
``FileSystemWriterAsync(use_cached_data_structure=True)``; it prints one JSON object.
Steps: ``save`` (write new values into every tensor in place, save, finalize, load the
checkpoint back and count tensors whose values are not the ones saved), ``save-async``
(the same, left pending until a later step finalizes it), ``replace`` (give
every tensor new storage, as ``model.to("cpu")`` and back does), ``offload`` and
``onload`` (those two halves), ``measure`` (device memory used, allocated, reserved), ``close`` (close the
queue, as ``maybe_finalize_async_save(terminate=True)`` does), ``activate`` and
``deactivate`` (the package's own calls, to test late activation), ``flush`` and
``terminate`` (``nvrx_ipc_fix.release`` with that strategy), ``probe`` (ask the worker
what it holds: its pid, cached keys and mapped shared-memory segments).

A watchdog turns a save into a reported hang when it has not finished within
``--timeout`` seconds, or as soon as the worker it waits for has died (NVRx would wait
for ever): it reports, kills the worker and exits. Uses CUDA when present, else ``fakecuda``. The tests
and ``python -m nvrx_ipc_fix demo`` run it in a subprocess, with and without the fix
(``NVRX_IPC_FIX_DISABLE=1``).
"""

import argparse
import dataclasses
import gc
import inspect
import json
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


def _kwargs_accepted(fn, **wanted):
    params = inspect.signature(fn).parameters
    return {k: v for k, v in wanted.items() if k in params}


class Trainer:
    """One rank: a state dict of ``n_tensors`` tensors and an NVRx queue."""

    def __init__(self, directory, n_tensors=8, numel=4096, cached=True, rank=0, world_size=1):
        from nvidia_resiliency_ext.checkpointing.async_ckpt import core

        self.cuda = torch.cuda.is_available()
        if not self.cuda:
            from . import fakecuda

            fakecuda.install()
        self.directory = directory
        self.cached = cached
        self.numel = numel
        self.names = [f"rank{rank}.layer{i}.weight" for i in range(n_tensors)]
        self.pending = []  # (path, version) of saves scheduled but not finalized
        if not dist.is_initialized():
            if self.cuda:
                torch.cuda.set_device(rank % torch.cuda.device_count())
            # torchrun sets MASTER_ADDR/RANK/WORLD_SIZE; otherwise ranks meet in a shared file
            init = "env://" if "MASTER_ADDR" in os.environ else f"file://{directory}/pg"
            dist.init_process_group("nccl" if self.cuda else "gloo", rank=rank,
                                    world_size=world_size, init_method=init)
        self.queue = core.AsyncCallsQueue(**_kwargs_accepted(
            core.AsyncCallsQueue.__init__, persistent=True, cpu_shm_mode=not self.cuda))
        if not self.cuda:
            fakecuda.mark_queue(self.queue)
        self.state = {}
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

    def offload(self):
        """Move every tensor to host memory and return freed device blocks (``model.to("cpu")``)."""
        self.state = {name: t.as_subclass(torch.Tensor).to("cpu", copy=True)
                      for name, t in self.state.items()}
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

    def measure(self):
        """Device memory now: used on the whole device, allocated and reserved by this process."""
        if not self.cuda:
            return {"device_used": None, "allocated": None, "reserved": None}
        torch.cuda.synchronize()
        free, total = torch.cuda.mem_get_info()
        return {"device_used": total - free, "allocated": torch.cuda.memory_allocated(),
                "reserved": torch.cuda.memory_reserved()}

    def _expected(self, i, version):
        return float(version * 1000 + i)

    def save(self, wait=True):
        """Save new values; return (seconds blocked, seconds in total or None, path, version).

        ``wait=False`` leaves the save pending (finalized by a later step)."""
        from nvidia_resiliency_ext.checkpointing.async_ckpt.core import AsyncRequest
        from nvidia_resiliency_ext.checkpointing.async_ckpt.filesystem_async import (
            FileSystemWriterAsync,
        )
        from nvidia_resiliency_ext.checkpointing.async_ckpt.state_dict_saver import (
            save_state_dict_async_finalize,
            save_state_dict_async_plan,
        )
        from torch.distributed.checkpoint import DefaultSavePlanner

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
        finalize = partial(save_state_dict_async_finalize, writer, metadata, dist_wrapper)
        self.queue.schedule_async_request(
            AsyncRequest(save_fn, save_args, [finalize], preload_fn=preload_fn))
        blocked = time.perf_counter() - start
        if not wait:
            self.pending.append((path, self.version))
            return blocked, None, path, self.version
        self.queue.maybe_finalize_async_calls(blocking=True)
        return blocked, time.perf_counter() - start, path, self.version

    def stale_tensors(self, path, version):
        """How many of this rank's tensors in the checkpoint at ``path`` are not ``version``'s."""
        from torch.distributed.checkpoint import FileSystemReader, load

        loaded = {name: torch.empty(self.numel) for name in self.names}
        load(loaded, storage_reader=FileSystemReader(path), process_group=None, no_dist=True)
        return sum(not torch.all(loaded[name] == self._expected(i, version)).item()
                   for i, name in enumerate(self.names))

    def close(self):
        self.queue.close()

    def probe(self):
        """What the worker holds now (see ``_worker.describe_cache``)."""
        from nvidia_resiliency_ext.checkpointing.async_ckpt import core

        from ._release import run_in_worker
        from ._worker import describe_cache

        path = os.path.join(self.directory, "probe.json")
        error = run_in_worker(core, self.queue, describe_cache, (path,), 30)
        if error:
            raise RuntimeError(error)
        with open(path) as found:
            return json.load(found)


#: Steps callers add (name -> function of the Trainer), e.g. a framework's offload method.
EXTRA_STEPS = {}


def run(steps, directory, timeout=60.0, n_tensors=8, numel=4096, cached=True, rank=0,
        world_size=1):
    """Run ``steps``; return the report (a JSON-ready dict)."""
    status = nvrx_ipc_fix.status()
    report = {"device": "cuda" if torch.cuda.is_available() else "cpu (fakecuda stand-in)",
              "nvrx": status.nvrx_version, "source": status.source, "fix": _fix_states(),
              "steps": list(steps), "rank": rank, "saves": [], "hang": None}
    trainer = Trainer(directory, n_tensors, numel, cached, rank, world_size)
    for index, step in enumerate(steps):
        if step in ("save", "save-async"):
            done = threading.Event()
            watchdog = threading.Thread(target=_watch, args=(trainer, done, report, index,
                                                              timeout), daemon=True)
            watchdog.start()
            blocked, total, path, version = trainer.save(wait=step == "save")
            done.set()
            report["saves"].append({"step": index, "blocked_s": round(blocked, 4),
                                    "total_s": total and round(total, 4), "path": path,
                                    "version": version, "stale": None, "tensors": n_tensors})
        elif step in ("replace", "offload", "onload"):
            getattr(trainer, step)()
        elif step == "measure":
            report.setdefault("measures", []).append(trainer.measure())
        elif step == "close":
            trainer.close()
        elif step in ("activate", "deactivate"):
            getattr(nvrx_ipc_fix, step)()
        elif step in ("flush", "terminate"):
            released = nvrx_ipc_fix.release(trainer.queue, strategy=step)
            report.setdefault("releases", []).append(dataclasses.asdict(released))
        elif step == "probe":
            report.setdefault("probes", []).append(trainer.probe())
        elif step in EXTRA_STEPS:
            EXTRA_STEPS[step](trainer)
        else:
            raise ValueError(f"unknown step {step!r}")
        if not trainer.queue.get_num_unfinalized_calls():  # verify what is finalized
            checked = []
            for save in report["saves"]:
                if save["stale"] is None:
                    save["stale"] = trainer.stale_tensors(save["path"], save["version"])
                    checked.append(save["path"])
            if checked and world_size > 1:
                dist.barrier()  # every rank has read them (all ranks run the same steps)
            if rank == 0:  # checked: free the disk
                for path in checked:
                    shutil.rmtree(path, ignore_errors=True)
            if checked and world_size > 1:
                dist.barrier()  # the next step starts together, so no rank times the deletion
    report["fix"] = _fix_states()
    report["cleanups"] = nvrx_ipc_fix.status().cleanups
    report["releases_total"] = nvrx_ipc_fix.status().releases
    trainer.close()
    return report


def _fix_states():
    return {f.name: str(f.state) for f in nvrx_ipc_fix.status().fixes}


def _watch(trainer, done, report, index, timeout):
    """Watchdog of the save at ``index``: report a hang, kill the worker, exit."""
    start = time.monotonic()
    while not done.wait(0.2):
        caller = getattr(trainer.queue, "persistent_caller", None)
        worker = getattr(caller, "process", None)
        died = worker is not None and worker.exitcode is not None
        if died or time.monotonic() - start > timeout:
            break
    else:
        return
    report["hang"] = {"step": index, "after_s": round(time.monotonic() - start, 1),
                      "worker_died": died}
    report["fix"] = _fix_states()
    for child in multiprocessing.active_children():
        child.kill()
    print(json.dumps(report), flush=True)
    os._exit(0)


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m nvrx_ipc_fix.scenario")
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
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="nvrx-ipc-fix-") as scratch:
        report = run(args.steps.split(","), args.dir or scratch, args.timeout, args.tensors,
                     args.numel, not args.no_cache, args.rank, args.world_size)
    print(json.dumps(report), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
