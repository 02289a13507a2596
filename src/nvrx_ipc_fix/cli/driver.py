"""The demo's trainer: what ``python -m nvrx_ipc_fix demo`` and ``selftest`` drive, each run in
a fresh interpreter (``runner``), with and without the package (``NVRX_IPC_FIX_DISABLE=1``).
It ships in the wheel for those two commands; the tests' scenarios build on it.

``python -m nvrx_ipc_fix.cli.driver --steps save,save,replace,save`` saves a state dict through
``AsyncCallsQueue(persistent=True)`` and ``FileSystemWriterAsync(use_cached_data_structure=True)``
in this process and prints its report, one JSON object. Steps (``STEPS``): ``save`` (write new
values into every tensor in place, save, finalize), ``replace`` (give every tensor new storage,
as ``model.to("cpu")`` and back does), ``offload`` and ``onload`` (those two halves),
``measure`` (device memory allocated and reserved by this process), ``close`` (close the
queue, as ``maybe_finalize_async_save(terminate=True)`` does), and ``flush``, ``terminate``,
``restart``, ``suspend`` (``nvrx_ipc_fix.release`` with that strategy). Once no save is
pending, each checkpoint is loaded back, and the tensors whose values are not the ones saved
are counted (``stale``).

A watchdog turns a step into a reported hang when it has not finished within ``--timeout``
seconds, or a few seconds after the worker it waits for has died (NVRx would wait for ever):
it reports, ends the worker and exits. Uses CUDA when present, else ``fakecuda``.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import importlib
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
from operator import methodcaller

import nvrx_ipc_fix  # activates unless NVRX_IPC_FIX_DISABLE=1

import torch
import torch.distributed as dist

CORE = "nvidia_resiliency_ext.checkpointing.async_ckpt.core"
HUNG = threading.Event()  # set once the watchdog has reported a hang
_scratch = None  # main()'s temp directory: this process's and its children's TMPDIR


def kwargs_accepted(fn, **wanted):
    """``wanted`` without the keywords ``fn`` does not take (an older NVRx's signature)."""
    params = inspect.signature(fn).parameters
    return {k: v for k, v in wanted.items() if k in params}


def use_scratch(path):
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
    """One rank: a state dict of ``n_tensors`` tensors of ``numel`` floats, saved through
    NVRx's persistent queue (``core``: the module of its ``AsyncCallsQueue`` and
    ``AsyncRequest``) into ``directory``."""

    def __init__(self, directory, n_tensors=8, numel=4096, cached=True):
        self.core = importlib.import_module(CORE)
        self.cuda = torch.cuda.is_available()
        if not self.cuda:
            from . import fakecuda

            fakecuda.install()
        self.directory, self.cached, self.numel = directory, cached, numel
        self.names = [f"rank0.layer{i}.weight" for i in range(n_tensors)]
        self.owns_group = not dist.is_initialized()  # close() destroys the group it made
        if self.owns_group:
            dist.init_process_group(
                "nccl" if self.cuda else "gloo",
                rank=0,
                world_size=1,
                init_method=f"file://{directory}/pg",
            )
        self.queue = self.core.AsyncCallsQueue(
            **kwargs_accepted(
                self.core.AsyncCallsQueue.__init__, persistent=True, cpu_shm_mode=not self.cuda
            )
        )
        if not self.cuda:
            fakecuda.mark_queue(self.queue)
        self.state, self.version = {}, 0
        self.replace()

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
        self.state = {
            name: t.as_subclass(torch.Tensor).to("cpu", copy=True) for name, t in self.state.items()
        }
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
        """Device memory this process has allocated and reserved now (None without CUDA)."""
        if not self.cuda:
            return {"allocated": None, "reserved": None}
        torch.cuda.synchronize()
        return {
            "allocated": torch.cuda.memory_allocated(),
            "reserved": torch.cuda.memory_reserved(),
        }

    def expected(self, i, version):
        """The value of tensor ``i`` in the save of ``version``."""
        return float(version * 1000 + i)

    def worker(self):
        """The worker process that takes the next save, if any: the queue's, else the one
        NVRx's warm-up slot holds for it."""
        from ..core.shapes import caller_of
        from ..worker.registry import process_of

        caller = caller_of(self.queue)
        if caller is None:
            caller = getattr(self.core.AsyncCallsQueue, "_warmup_persistent_caller", None)
        return process_of(caller)

    def fill(self):
        """The next version's values, written into every tensor in place; its checkpoint's
        path and version."""
        self.version += 1
        with torch.no_grad():
            for i, name in enumerate(self.names):
                self.state[name].fill_(self.expected(i, self.version))
        return os.path.join(self.directory, f"ckpt{self.version}"), self.version

    def request(self, path):
        """The state dict's save into ``path`` as NVRx's ``AsyncRequest``, planned."""
        from nvidia_resiliency_ext.checkpointing.async_ckpt.filesystem_async import (
            FileSystemWriterAsync,
        )
        from nvidia_resiliency_ext.checkpointing.async_ckpt.state_dict_saver import (
            save_state_dict_async_finalize,
            save_state_dict_async_plan,
        )
        from torch.distributed.checkpoint import DefaultSavePlanner

        writer = FileSystemWriterAsync(
            path,
            **kwargs_accepted(
                FileSystemWriterAsync.__init__, use_cached_data_structure=self.cached
            ),
        )
        writer, metadata, dist_wrapper = save_state_dict_async_plan(
            dict(self.state), writer, None, planner=DefaultSavePlanner()
        )
        save_fn, preload_fn, save_args = writer.get_save_function_and_args()
        finalize = partial(save_state_dict_async_finalize, writer, metadata, dist_wrapper)
        return self.core.AsyncRequest(save_fn, save_args, [finalize], preload_fn=preload_fn)

    def save(self):
        """Save new values and finalize: (seconds blocked, seconds in total, path, version)."""
        path, version = self.fill()
        start = time.perf_counter()
        self.queue.schedule_async_request(self.request(path))
        blocked = time.perf_counter() - start
        self.finalize()
        return blocked, time.perf_counter() - start, path, version

    def finalize(self):
        self.queue.maybe_finalize_async_calls(blocking=True)

    def stale_tensors(self, path, version):
        """How many of this rank's tensors in the checkpoint at ``path`` are not ``version``'s."""
        from torch.distributed.checkpoint import FileSystemReader, load

        loaded = {name: torch.empty(self.numel) for name in self.names}
        load(loaded, storage_reader=FileSystemReader(path), process_group=None, no_dist=True)
        return sum(
            not torch.all(loaded[name] == self.expected(i, version)).item()
            for i, name in enumerate(self.names)
        )

    def close(self):
        self.queue.close()


def save_entry(trainer):
    blocked, total, path, version = trainer.save()
    return {
        "blocked_s": round(blocked, 4),
        "total_s": round(total, 4),
        "path": path,
        "version": version,
        "stale": None,
        "tensors": len(trainer.names),
    }


def release_entry(trainer, strategy):
    return dataclasses.asdict(nvrx_ipc_fix.release(trainer.queue, strategy=strategy))


#: Step name -> (the report's list its entry goes to, or None; function(trainer) -> the entry)
STEPS = {
    "save": ("saves", save_entry),
    "measure": ("measures", methodcaller("measure")),
    **{name: (None, methodcaller(name)) for name in ("replace", "offload", "onload", "close")},
    **{
        name: ("releases", partial(release_entry, strategy=name))
        for name in ("flush", "terminate", "restart", "suspend")
    },
}


def check_saves(trainer, saves):
    """Load back each save not checked yet (``stale`` None) nor known lost, and count its
    stale tensors (a checkpoint that cannot be loaded: why); the paths checked."""
    checked = []
    for save in saves:
        if save["stale"] is None and not save.get("lost"):
            try:
                save["stale"] = trainer.stale_tensors(save["path"], save["version"])
            except (KeyboardInterrupt, SystemExit):
                raise
            except BaseException as exc:  # noqa: BLE001 lost, no error (no metadata, say)
                save["stale"] = f"unloadable ({type(exc).__name__}: {exc})"[:300]
            checked.append(save["path"])
    return checked


def run(steps, directory, timeout=60.0, n_tensors=8, numel=4096):
    """Run ``steps``; return the report (a JSON-ready dict)."""
    report = {
        "device": "cuda" if torch.cuda.is_available() else "cpu (fakecuda stand-in)",
        "nvrx": nvrx_ipc_fix.status().nvrx_version,
        "steps": list(steps),
        "saves": [],
        "hang": None,
    }
    trainer = Trainer(directory, n_tensors, numel)
    watchdog = Watchdog(trainer, report, timeout)
    for index, step in enumerate(steps):
        if step not in STEPS:
            raise ValueError(f"unknown step {step!r} (known: {', '.join(STEPS)})")
        key, function = STEPS[step]
        watchdog.begin(index)
        ended = False
        try:
            entry = function(trainer)
            ended = True
        finally:
            if not ended and HUNG.is_set():  # reported: the watchdog ends the process
                threading.Event().wait()
        watchdog.end()
        if key is not None:
            report.setdefault(key, []).append(entry)
        if not trainer.queue.get_num_unfinalized_calls():
            for path in check_saves(trainer, report["saves"]):
                shutil.rmtree(path, ignore_errors=True)  # checked: free the disk
    watchdog.begin(len(steps))  # the close at the end must not hang either
    trainer.close()
    if trainer.owns_group:
        dist.destroy_process_group()
    watchdog.end()
    return report


def fix_states():
    """Each fix's name -> its state, as ``status()`` says."""
    return {f.name: str(f.state) for f in nvrx_ipc_fix.status().fixes}


class Watchdog:
    """Turns a step that does not end into a reported hang: after ``timeout`` seconds, or
    a few seconds after the worker died (the package ends such a wait within about a
    second; NVRx never does). It reports, ends the worker and exits."""

    def __init__(self, trainer, report, timeout):
        self.trainer, self.report, self.timeout = trainer, report, timeout
        self.grace = 8.0 if fix_states().get("worker_watch") == "active" else 0.5
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
        """Has the worker that takes this step died (None: there is none; keep the answer)?"""
        worker = self.trainer.worker()
        return None if worker is None else worker.exitcode is not None

    def _hang(self, step, now, died):
        self.report["hang"] = {
            "step": step,
            "after_s": round(now - self.started, 1),
            "worker_died": died,
        }
        HUNG.set()
        print(json.dumps(self.report), flush=True)
        self.exit()

    @staticmethod
    def exit():
        """End this process's descendants (NVRx's worker, its writer processes, the results
        manager: stopped, then killed, as the guardian ends them) and the process, with no
        clean-up but the scratch, which none of them can write into any more."""
        from ..worker.guardian_process import alive, children, end_trees, pidfd

        found = end_trees({pid: pidfd(pid) for pid in children(os.getpid())})
        multiprocessing.active_children()  # reaps the children multiprocessing started
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and any(map(alive, found)):
            time.sleep(0.01)
        if _scratch is not None:  # os._exit runs no clean-up
            shutil.rmtree(_scratch, ignore_errors=True)
        os._exit(0)


def main(argv=None):
    """The command line: run the steps, print the report."""
    parser = argparse.ArgumentParser(prog="python -m nvrx_ipc_fix.cli.driver")
    parser.add_argument("--steps", default="save,save,replace,save")
    parser.add_argument(
        "--timeout", type=float, default=60.0, help="seconds before a save counts as hung"
    )
    parser.add_argument("--tensors", type=int, default=8)
    parser.add_argument("--numel", type=int, default=4096)
    args = parser.parse_args(argv)
    scratch = tempfile.mkdtemp(prefix="nvrx-ipc-fix-")
    use_scratch(scratch)  # removed at exit, however the run ends
    report = run(args.steps.split(","), scratch, args.timeout, args.tensors, args.numel)
    print(json.dumps(report), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
