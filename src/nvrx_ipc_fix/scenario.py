"""Drive the real NVRx persistent worker through a save lifecycle and report what happened.

``python -m nvrx_ipc_fix.scenario --steps save,save,replace,save`` runs, in this process,
one trainer rank with ``AsyncCallsQueue(persistent=True)`` and
``FileSystemWriterAsync(use_cached_data_structure=True)``; it prints one JSON object.
Steps: ``save`` (write new values into every tensor in place, save, finalize, load the
checkpoint back and count tensors whose values are not the ones saved), ``replace`` (give
every tensor new storage, as ``model.to("cpu")`` and back does), ``close`` (close the
queue, as ``maybe_finalize_async_save(terminate=True)`` does), ``activate`` and
``deactivate`` (the package's own calls, to test late activation).

A watchdog turns a save into a reported hang when it has not finished within
``--timeout`` seconds, or as soon as the worker it waits for has died (NVRx would wait
for ever): it reports, kills the worker and exits. Uses CUDA when present, else ``fakecuda``. The tests
and ``python -m nvrx_ipc_fix demo`` run it in a subprocess, with and without the fix
(``NVRX_IPC_FIX_DISABLE=1``).
"""

import argparse
import inspect
import json
import multiprocessing
import os
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

    def __init__(self, directory, n_tensors=8, numel=4096, cached=True):
        from nvidia_resiliency_ext.checkpointing.async_ckpt import core

        self.cuda = torch.cuda.is_available()
        if not self.cuda:
            from . import fakecuda

            fakecuda.install()
        self.directory = directory
        self.cached = cached
        self.numel = numel
        self.names = [f"layer{i}.weight" for i in range(n_tensors)]
        if not dist.is_initialized():
            dist.init_process_group("nccl" if self.cuda else "gloo", rank=0, world_size=1,
                                    init_method=f"file://{directory}/pg")
        self.queue = core.AsyncCallsQueue(**_kwargs_accepted(
            core.AsyncCallsQueue.__init__, persistent=True, cpu_shm_mode=not self.cuda))
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

    def _expected(self, i):
        return float(self.version * 1000 + i)

    def save(self):
        """Save new values; return (seconds blocked, seconds in total, path)."""
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
                self.state[name].fill_(self._expected(i))
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
        self.queue.maybe_finalize_async_calls(blocking=True)
        return blocked, time.perf_counter() - start, path

    def stale_tensors(self, path):
        """How many tensors in the checkpoint at ``path`` differ from what was saved."""
        from torch.distributed.checkpoint import FileSystemReader, load

        loaded = {name: torch.empty(self.numel) for name in self.names}
        load(loaded, storage_reader=FileSystemReader(path))
        return sum(not torch.all(loaded[name] == self._expected(i)).item()
                   for i, name in enumerate(self.names))

    def close(self):
        self.queue.close()


def run(steps, directory, timeout=60.0, n_tensors=8, numel=4096, cached=True):
    """Run ``steps``; return the report (a JSON-ready dict)."""
    status = nvrx_ipc_fix.status()
    report = {"device": "cuda" if torch.cuda.is_available() else "cpu (fakecuda stand-in)",
              "nvrx": status.nvrx_version, "source": status.source, "fix": _fix_states(),
              "steps": list(steps), "saves": [], "hang": None}
    trainer = Trainer(directory, n_tensors, numel, cached)
    for index, step in enumerate(steps):
        if step == "save":
            done = threading.Event()
            watchdog = threading.Thread(target=_watch, args=(trainer, done, report, index,
                                                              timeout), daemon=True)
            watchdog.start()
            blocked, total, path = trainer.save()
            done.set()
            report["saves"].append({"step": index, "blocked_s": round(blocked, 4),
                                    "total_s": round(total, 4),
                                    "stale": trainer.stale_tensors(path),
                                    "tensors": n_tensors})
        elif step == "replace":
            trainer.replace()
        elif step == "close":
            trainer.close()
        elif step in ("activate", "deactivate"):
            getattr(nvrx_ipc_fix, step)()
        else:
            raise ValueError(f"unknown step {step!r} (save, replace, close, activate, "
                             "deactivate)")
    report["fix"] = _fix_states()
    report["cleanups"] = nvrx_ipc_fix.status().cleanups
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
    parser.add_argument("--no-cache", action="store_true",
                        help="use_cached_data_structure=False (the reference)")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="nvrx-ipc-fix-") as directory:
        report = run(args.steps.split(","), directory, args.timeout, args.tensors, args.numel,
                     not args.no_cache)
    print(json.dumps(report), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
