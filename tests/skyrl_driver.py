"""Run SkyRL 0.4.0's real ``MegatronStrategy`` checkpoint path on the real NVRx worker (CPU);
print one JSON report. Used by tests/test_skyrl.py, in a child process per rank:

    python tests/skyrl_driver.py [--rank R --world-size N --dir SHARED] [--timeout S] STEP ...

What SkyRL does (skyrl/backends/skyrl_train/distributed/megatron/megatron_strategy.py, the
0.4.0 wheel): ``MegatronStrategy.__init__`` sets the module's ``_async_calls =
AsyncCallsQueue(persistent=True)`` (NVRx's queue); ``save_checkpoint`` finalizes pending
saves first (``maybe_finalize_async_calls(blocking=True)``) when saving asynchronously, then
calls ``dist_checkpointing.save(..., async_sharded_save=...)`` and schedules the returned
request on that queue, or, for a sync save, closes the queue and makes a new one;
``load_checkpoint`` finalizes pending saves before loading. The driver calls those methods
as they are; it supplies what a SkyRL worker would: the process group, the config fields
they read, a model with ``sharded_state_dict``, and an ``hf_config``.

Steps: ``async`` (an async save of new values, left pending, as SkyRL leaves it),
``async-kill`` (the same, but its worker is SIGKILLed while writing), ``sync`` (a sync
save), ``kill-idle`` (SIGKILL the idle worker, as the OOM killer would), ``finalize``
(``finalize_pending_saves``), ``load`` (``load_checkpoint`` of every save not yet loaded
into a fresh model; counts the tensors whose values are not the ones saved), ``workers``
(this rank's live child processes: pid, name). A step that
raises is reported (type, message; the saves a ``CheckpointWorkerError`` names as not saved
are never loaded) and the run goes on. A step still running ``--timeout`` s later, or a few
seconds after the worker it waits for died, is reported as the hang
(``harness.scenario``'s watchdog) and ends the run.

Several ranks (``--world-size``; one process each, gloo, meeting in a file in ``--dir``,
where the checkpoints go too, as on a shared file system): every rank runs every step, as
SkyRL's workers do, except that ``kill-idle@R`` and ``async-kill@R`` kill rank R's worker
only (the other ranks skip the kill, or save normally). Each rank's tensors are its own
shard of each global tensor, with its own values. A rank still in a collective a few seconds
after another rank reported a hang is reported as stranded there (it waits for that rank,
which never comes: see ``Watchdog``); the ranks leave together once each has reported or ended
(files in ``--dir``).

On the CPU, NVRx's queue is made with ``cpu_shm_mode=True`` (its worker must not set a
CUDA device) and the model's tensors are ``fakecuda`` tensors: the documented CUDA stand-in.
That worker reads the trainer's storage where a GPU's would have copied it to the host
first, so a save's values may change only once it is finalized: the tests load (which
finalizes) before the next save. A sync save is written by the trainer itself, where fakecuda has
nothing to stand in for: it gets the same storage as plain CPU tensors.
"""

import argparse
import json
import multiprocessing
import os
import signal
import sys
import tempfile
import threading
import time
import types

STARTED = time.monotonic()

import stand_ins  # noqa: E402

stand_ins.install()

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import nvrx_ipc_fix  # noqa: E402
from harness import faults, scenario  # noqa: E402
from nvrx_ipc_fix.cli import driver, fakecuda  # noqa: E402
from nvrx_ipc_fix.core.shapes import caller_of  # noqa: E402
from nvrx_ipc_fix.worker.registry import process_of  # noqa: E402

from megatron.core.dist_checkpointing.mapping import ShardedTensor  # noqa: E402
from skyrl.backends.skyrl_train.distributed.megatron import megatron_strategy as ms  # noqa: E402

N_TENSORS, NUMEL, TIMEOUT = 4, 256, 30.0
NVRX_CORE = os.path.join("nvidia_resiliency_ext", "checkpointing", "async_ckpt", "core.py")
PEER_GRACE = 5.0  # a rank in one collective call this long after a peer hung is stranded


class CpuQueue(ms.AsyncCallsQueue):
    """NVRx's queue as SkyRL makes it, with the CPU stand-in's ``cpu_shm_mode`` (fakecuda)."""

    def __init__(self, persistent=False):
        super().__init__(persistent=persistent, cpu_shm_mode=True)
        fakecuda.mark_queue(self)
        self.versions = {}  # the queue's call_idx of each save scheduled on it -> its version


class Model(torch.nn.Module):
    """The module SkyRL unwraps: ``sharded_state_dict()`` for saves, ``load_state_dict``."""

    def __init__(self, device, rank=0, world_size=1):
        super().__init__()
        self.rank, self.world_size = rank, world_size
        zeros = [torch.zeros(NUMEL) for _ in range(N_TENSORS)]
        self.tensors = [fakecuda.on_fake_device(t) if device else t for t in zeros]
        self.loaded = None
        self.on_host = False  # a sync save: the trainer writes, from the same storage

    def sharded_state_dict(self):
        return {
            f"layer{i}.weight": ShardedTensor.from_rank_offsets(  # this rank's shard
                f"layer{i}.weight",
                t.as_subclass(torch.Tensor) if self.on_host else t,
                (0, self.rank, self.world_size),
                replica_id=0,
            )
            for i, t in enumerate(self.tensors)
        }

    def load_state_dict(self, state_dict, strict=True):
        self.loaded = {k: v.as_subclass(torch.Tensor).clone() for k, v in state_dict.items()}


def expected(version, i, rank):
    return float(version * 1000 + i * 10 + rank)


class Run:
    def __init__(self, directory, rank=0, world_size=1):
        self.directory, self.rank, self.world_size = directory, rank, world_size
        self.config = types.SimpleNamespace(
            tensor_model_parallel_size=1,
            pipeline_model_parallel_size=1,
            expert_model_parallel_size=1,
            expert_tensor_parallel_size=1,
            context_parallel_size=1,
            async_dist_ckpt_save=True,
            async_save_prestage_to_cpu=False,
            dist_ckpt_optim_fully_reshardable=False,
        )
        self.strategy = ms.MegatronStrategy(self.config)
        self.strategy.setup_distributed()
        self.strategy.hf_config = types.SimpleNamespace(save_pretrained=lambda path: None)
        self.model = Model(device=True, rank=rank, world_size=world_size)
        self.version = 0
        self.saves = []  # {"version", "path", "mode", "stale", "lost"}
        self.queues = [id(ms._async_calls)]

    def worker(self):  # for the watchdog: the worker that takes or holds the next save
        return process_of(caller_of(ms._async_calls))

    def save(self, mode):
        self.version += 1
        with torch.no_grad():
            for i, t in enumerate(self.model.tensors):
                t.fill_(expected(self.version, i, self.rank))
        path = os.path.join(self.directory, f"global_step_{self.version}")
        self.saves.append(
            {
                "version": self.version,
                "path": path,
                "mode": mode,
                "stale": None,
                "lost": False,
                "worker_before": getattr(self.worker(), "pid", None),
            }
        )
        self.config.async_dist_ckpt_save = mode != "sync"
        self.model.on_host = mode == "sync"  # fakecuda: only NVRx's worker may see "cuda"
        queue = ms._async_calls
        if mode == "async-kill":  # the worker dies while it writes this save
            original = type(queue).schedule_async_request
            queue.schedule_async_request = lambda request: original(
                queue, request._replace(async_fn=faults.kill_self)
            )
        try:
            self.strategy.save_checkpoint(
                types.SimpleNamespace(actor_module=[self.model]), path, node_local_rank=self.rank
            )
        except BaseException:
            self.saves[-1]["lost"] = True  # this save did not happen: nothing to load
            raise
        finally:
            queue.__dict__.pop("schedule_async_request", None)
        if mode != "sync":  # scheduled on that queue, as its call_idx
            queue.versions[queue.call_idx] = self.version
        if id(ms._async_calls) not in self.queues:
            self.queues.append(id(ms._async_calls))

    def lost(self, error):
        """The saves ``error`` names as not saved (``err.lost_saves``: the queue's call_idx)
        are never loaded."""
        versions = getattr(ms._async_calls, "versions", {})
        lost = {versions.get(i) for i in getattr(error, "lost_saves", ()) or ()}
        for save in self.saves:
            if save["version"] in lost:
                save["lost"] = True

    def load(self):
        self.strategy.finalize_pending_saves()  # as load_checkpoint does first: may raise
        for save in self.saves:
            if save["stale"] is not None or save["lost"]:
                continue
            fresh = Model(device=False, rank=self.rank, world_size=self.world_size)
            save["stale"] = N_TENSORS  # unless it loads
            self.strategy.load_checkpoint(
                types.SimpleNamespace(actor_module=[fresh]),
                save["path"],
                load_optimizer_states=False,
                load_lr_scheduler_states=False,
            )
            save["stale"] = sum(
                not torch.all(
                    fresh.loaded[f"layer{i}.weight"] == expected(save["version"], i, self.rank)
                )
                for i in range(N_TENSORS)
            )

    def kill_idle(self):
        worker = self.worker()
        os.kill(worker.pid, signal.SIGKILL)
        while worker.is_alive():
            time.sleep(0.05)


def main_thread_in(filename):
    """The innermost frame of the main thread that runs code of ``filename`` (a path's
    tail), or None."""
    frame = sys._current_frames().get(threading.main_thread().ident)
    while frame is not None:
        if frame.f_code.co_filename.endswith(filename):
            return frame
        frame = frame.f_back
    return None


def collective_call():
    """The frame of the torch.distributed call the main thread is in, or None."""
    return main_thread_in(os.sep + "distributed_c10d.py")


def waiting_in():
    """The name of that call, or None."""
    frame = collective_call()
    return frame and frame.f_code.co_name


class Watchdog(driver.Watchdog):
    """``scenario``'s watchdog (a step past ``timeout``, or a few seconds past its worker's
    death, is the hang), but the seconds after a death count only while the main thread is
    in NVRx's queue code (``NVRX_CORE``), where it waits on the worker: a step may take
    longer than that grace to get there (a sync save, before its ``close()``). For several
    ranks: a rank that has waited in one torch.distributed
    call for ``PEER_GRACE`` s since another rank reported a hang is reported as stranded
    there (the hang names the call, ``waiting_in``). The other rank may have been slow to
    get to where it waits for ever (a step past ``timeout``), so a stranded rank may be reported at
    a collective it would have passed. A rank that reported waits
    (up to ``timeout``) until every rank has reported or ended, then ends its workers and
    leaves. Ranks tell each other by files in the shared directory."""

    def __init__(self, run, report, timeout, directory, rank, world_size):
        self.rank, self.lock = rank, threading.Lock()
        self.mark = lambda kind, r: os.path.join(directory, f"{kind}.{r}")
        self.others = [r for r in range(world_size) if r != rank]
        super().__init__(run, report, timeout)
        if self.others:
            threading.Thread(target=self._peers, daemon=True).start()

    def ended(self, kind):
        """Tell the other ranks that this one ``hung`` or ``ended``."""
        with open(self.mark(kind, self.rank) + ".tmp", "w") as f:
            f.write(str(time.time()))
        os.replace(self.mark(kind, self.rank) + ".tmp", self.mark(kind, self.rank))

    def _peer_hung_at(self):
        times = []
        for r in self.others:
            try:
                times.append(os.path.getmtime(self.mark("hung", r)))
            except OSError:
                pass
        return min(times, default=None)

    def _worker_dead(self):  # scenario's rule, but a death counts while the rank waits in NVRx
        worker = self.trainer.worker()
        if worker is None or main_thread_in(NVRX_CORE) is None:
            return None  # none, or not waiting in NVRx at this tick: keep the answer (a wait
            # that polls NVRx between other calls is not a fresh worker)
        return worker.exitcode is not None

    def _peers(self):
        call = since = None  # the collective call the main thread is in, and since when
        while True:
            time.sleep(0.2)
            step, hung_at, frame = self.step, self._peer_hung_at(), collective_call()
            if frame is not call:
                call, since = frame, time.time()
            if step is None or hung_at is None or call is None:
                continue
            if time.time() - max(hung_at, since) > PEER_GRACE and step == self.step:
                self._hang(step, time.monotonic(), False, stranded=True)

    def _hang(self, step, now, died, stranded=False):
        with self.lock:
            if scenario.HUNG.is_set():
                return
            self.report["hang"] = {
                "step": step,
                "after_s": round(now - self.started, 1),
                "worker_died": died,
                "stranded": stranded,
                "waiting_in": waiting_in(),
            }
            self.report["fix"] = driver.fix_states()
            scenario.HUNG.set()
            print(json.dumps(self.report), flush=True)
            self.ended("hung")
        deadline = time.monotonic() + self.timeout
        while time.monotonic() < deadline and not all(
            os.path.exists(self.mark("hung", r)) or os.path.exists(self.mark("ended", r))
            for r in self.others
        ):
            time.sleep(0.2)
        self.exit()


def main(argv):
    parser = argparse.ArgumentParser(prog="skyrl_driver.py")
    parser.add_argument("--rank", type=int, default=0)
    parser.add_argument("--world-size", type=int, default=1)
    parser.add_argument("--dir", default=None, help="shared by the ranks (default: a new one)")
    parser.add_argument("--timeout", type=float, default=TIMEOUT)
    parser.add_argument("steps", nargs="+")
    args = parser.parse_args(argv)
    rank, steps = args.rank, args.steps
    directory = args.dir or tempfile.mkdtemp(prefix="skyrl-")
    fakecuda.install()
    # NVRx's workers from a forkserver forked from this rank, before it has a thread: a
    # spawned one would import torch, megatron-core and SkyRL again (this script is its
    # main module); the start is not what these tests are about
    scenario.start_workers_from_forkserver(sys.modules[ms.AsyncCallsQueue.__module__])
    ms.AsyncCallsQueue = CpuQueue  # before MegatronStrategy makes its first queue
    dist.init_process_group(
        "gloo", rank=rank, world_size=args.world_size, init_method=f"file://{directory}/pg"
    )
    report = {
        "steps": steps,
        "rank": rank,
        "errors": [],
        "hang": None,
        "fix": driver.fix_states(),
        "package": nvrx_ipc_fix.__file__,
        "started_s": round(time.monotonic() - STARTED, 2),
        "step_s": [],
        "workers": [],
    }
    run = Run(directory, rank, args.world_size)
    watchdog = Watchdog(run, report, args.timeout, directory, rank, args.world_size)
    actions = {
        "async": lambda: run.save("async"),
        "async-kill": lambda: run.save("async-kill"),
        "sync": lambda: run.save("sync"),
        "kill-idle": run.kill_idle,
        "finalize": run.strategy.finalize_pending_saves,
        "load": run.load,
        "workers": lambda: report["workers"].append(
            [(p.pid, p.name) for p in multiprocessing.active_children()]
        ),
    }
    for index, step in enumerate(steps):
        step, _, only = step.partition("@")  # kill-idle@R, async-kill@R: rank R's worker only
        if only and int(only) != rank:
            if step == "kill-idle":
                report["step_s"].append(None)  # another rank's
                continue
            step = "async"
        watchdog.begin(index)
        report["saves"] = run.saves  # the watchdog prints the report as it is
        try:
            actions[step]()
        except BaseException as exc:  # noqa: BLE001 torch's CheckpointException is a BaseException
            if scenario.HUNG.is_set():  # reported; a peer's exit broke the collective
                threading.Event().wait()  # the watchdog ends the process
            report["errors"].append(
                {
                    "step": index,
                    "type": type(exc).__name__,
                    "message": str(exc).splitlines()[0][:300],
                }
            )
            run.lost(exc)
        watchdog.end()
        report["step_s"].append(round(time.monotonic() - watchdog.started, 2))
    report["queues"] = len(run.queues)
    watchdog.begin(len(steps))
    ms._async_calls.close()  # the end of the job must not hang either
    watchdog.end()
    print(json.dumps(report), flush=True)
    watchdog.ended("ended")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
