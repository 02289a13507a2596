"""Run SkyRL 0.4.0's real ``MegatronStrategy`` checkpoint path on the real NVRx worker (CPU);
print one JSON report. Used by tests/test_skyrl.py, in a child process:

    python tests/skyrl_driver.py STEP [STEP ...]

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
into a fresh model; counts the tensors whose values are not the ones saved). A step that
raises is reported (type, message) and the run goes on. A step still running
``--timeout`` s later, or a few seconds after the worker it waits for died, is reported
as the hang (``nvrx_ipc_fix.testing.scenario``'s watchdog) and ends the run.

On the CPU, NVRx's queue is made with ``cpu_shm_mode=True`` (its worker must not set a
CUDA device) and the model's tensors are ``fakecuda`` tensors: the documented CUDA stand-in.
That worker reads the trainer's storage where a GPU's would have copied it to the host
first, so a save's values may change only once it is finalized: the tests load (which
finalizes) before the next save. A sync save is written by the trainer itself, where fakecuda has nothing to stand in for:
it gets the same storage as plain CPU tensors.
"""

import json
import os
import signal
import sys
import tempfile
import time
import types

import stand_ins

stand_ins.install()

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from nvrx_ipc_fix.testing import fakecuda, faults, scenario  # noqa: E402
from nvrx_ipc_fix.fixes.worker_watch import caller_of, process_of  # noqa: E402

from megatron.core.dist_checkpointing.mapping import ShardedTensor  # noqa: E402
from skyrl.backends.skyrl_train.distributed.megatron import megatron_strategy as ms  # noqa: E402

N_TENSORS, NUMEL, TIMEOUT = 4, 256, 30.0


class CpuQueue(ms.AsyncCallsQueue):
    """NVRx's queue as SkyRL makes it, with the CPU stand-in's ``cpu_shm_mode`` (fakecuda)."""

    def __init__(self, persistent=False):
        super().__init__(persistent=persistent, cpu_shm_mode=True)
        fakecuda.mark_queue(self)


class Model(torch.nn.Module):
    """The module SkyRL unwraps: ``sharded_state_dict()`` for saves, ``load_state_dict``."""

    def __init__(self, device):
        super().__init__()
        zeros = [torch.zeros(NUMEL) for _ in range(N_TENSORS)]
        self.tensors = [fakecuda.on_fake_device(t) if device else t for t in zeros]
        self.loaded = None
        self.on_host = False  # a sync save: the trainer writes, from the same storage

    def sharded_state_dict(self):
        return {f"layer{i}.weight": ShardedTensor.from_rank_offsets(
            f"layer{i}.weight", t.as_subclass(torch.Tensor) if self.on_host else t,
            replica_id=0) for i, t in enumerate(self.tensors)}

    def load_state_dict(self, state_dict, strict=True):
        self.loaded = {k: v.as_subclass(torch.Tensor).clone() for k, v in state_dict.items()}


def expected(version, i):
    return float(version * 1000 + i)


class Run:
    def __init__(self, directory):
        self.directory = directory
        self.config = types.SimpleNamespace(
            tensor_model_parallel_size=1, pipeline_model_parallel_size=1,
            expert_model_parallel_size=1, expert_tensor_parallel_size=1,
            context_parallel_size=1, async_dist_ckpt_save=True,
            async_save_prestage_to_cpu=False, dist_ckpt_optim_fully_reshardable=False)
        self.strategy = ms.MegatronStrategy(self.config)
        self.strategy.setup_distributed()
        self.strategy.hf_config = types.SimpleNamespace(save_pretrained=lambda path: None)
        self.model = Model(device=True)
        self.version = 0
        self.saves = []  # {"version", "path", "mode", "stale", "lost"}
        self.queues = [id(ms._async_calls)]

    def worker(self):  # for the watchdog: the worker that takes or holds the next save
        return process_of(caller_of(ms._async_calls))

    def save(self, mode):
        self.version += 1
        with torch.no_grad():
            for i, t in enumerate(self.model.tensors):
                t.fill_(expected(self.version, i))
        path = os.path.join(self.directory, f"global_step_{self.version}")
        self.saves.append({"version": self.version, "path": path, "mode": mode,
                           "stale": None, "lost": False})
        self.config.async_dist_ckpt_save = mode != "sync"
        self.model.on_host = mode == "sync"  # fakecuda: only NVRx's worker may see "cuda"
        queue = ms._async_calls
        if mode == "async-kill":  # the worker dies while it writes this save
            original = type(queue).schedule_async_request
            queue.schedule_async_request = lambda request: original(
                queue, request._replace(async_fn=faults.kill_self))
        try:
            self.strategy.save_checkpoint(types.SimpleNamespace(actor_module=[self.model]),
                                          path, node_local_rank=0)
        except BaseException:
            self.saves[-1]["lost"] = True  # this save did not happen: nothing to load
            raise
        finally:
            queue.__dict__.pop("schedule_async_request", None)
        if mode == "async-kill":
            self.saves[-1]["lost"] = True  # never loaded: the error says so
        if id(ms._async_calls) not in self.queues:
            self.queues.append(id(ms._async_calls))

    def load(self):
        for save in self.saves:
            if save["stale"] is not None or save["lost"]:
                continue
            fresh = Model(device=False)
            save["stale"] = N_TENSORS  # unless it loads
            self.strategy.load_checkpoint(types.SimpleNamespace(actor_module=[fresh]),
                                          save["path"], load_optimizer_states=False,
                                          load_lr_scheduler_states=False)
            save["stale"] = sum(
                not torch.all(fresh.loaded[f"layer{i}.weight"] == expected(save["version"], i))
                for i in range(N_TENSORS))

    def kill_idle(self):
        worker = self.worker()
        os.kill(worker.pid, signal.SIGKILL)
        while worker.is_alive():
            time.sleep(0.05)


def main(steps):
    directory = tempfile.mkdtemp(prefix="skyrl-")
    fakecuda.install()
    ms.AsyncCallsQueue = CpuQueue  # before MegatronStrategy makes its first queue
    dist.init_process_group("gloo", rank=0, world_size=1, init_method=f"file://{directory}/pg")
    report = {"steps": steps, "errors": [], "hang": None, "fix": scenario._fix_states()}
    run = Run(directory)
    watchdog = scenario._Watchdog(run, report, TIMEOUT)
    actions = {"async": lambda: run.save("async"), "async-kill": lambda: run.save("async-kill"),
               "sync": lambda: run.save("sync"), "kill-idle": run.kill_idle,
               "finalize": run.strategy.finalize_pending_saves, "load": run.load}
    for index, step in enumerate(steps):
        watchdog.begin(index)
        report["saves"] = run.saves  # the watchdog prints the report as it is
        try:
            actions[step]()
        except BaseException as exc:  # torch's CheckpointException is a BaseException
            if scenario.HUNG.is_set():
                raise
            report["errors"].append({"step": index, "type": type(exc).__name__,
                                     "message": str(exc).splitlines()[0][:300]})
        watchdog.end()
    report["queues"] = len(run.queues)
    watchdog.begin(len(steps))
    ms._async_calls.close()  # the end of the job must not hang either
    watchdog.end()
    print(json.dumps(report), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
