"""Automatic release, no code change: NeMo RL's offload points (test doubles of its
workers, tests/doubles/README.md) release the worker's IPC mappings before storage moves;
``NVRX_IPC_FIX_RELEASE`` picks the policy; builds with NeMo RL PR #3322 are not released
twice; with the ``restart`` strategy the offload points leave no worker and the onload points
start the next one ahead of the save."""

import os

import pytest

from conftest import needs_cache, run_python, scenario

pytestmark = [needs_cache, pytest.mark.worker]

DOUBLES = os.path.join(os.path.dirname(__file__), "doubles")

# Steps that call the NeMo RL doubles' methods on a worker around the scenario's tensors.
NEMO = f"""
    import sys, types
    sys.path.insert(0, {DOUBLES!r})
    from megatron.bridge.training import checkpointing as _bridge
    from nemo_rl.models.policy.workers import megatron_policy_worker as _policy
    from nemo_rl.models.value.workers import megatron_value_worker as _value
    from harness import scenario as _s

    def _worker(cls, trainer, colocated):
        w = cls.__new__(cls)
        ckpt = types.SimpleNamespace(async_save=True, use_persistent_ckpt_worker=True,
                                     ckpt_assume_constant_structure=True,
                                     async_ckpt_use_cpu_shm=False)
        w.mcore_state = types.SimpleNamespace(cfg=types.SimpleNamespace(checkpoint=ckpt),
                                              async_calls_queue=trainer.queue)
        w.cfg = {{"generation": {{"colocated": {{"enabled": colocated}}}},
                 "megatron_cfg": {{"empty_unused_memory_level": 0}}}}
        w.model = types.SimpleNamespace(eval=lambda: None, train=lambda: None)
        def move_model(model, device, **kwargs):
            if device == "cpu":
                trainer.replace()
            return model
        w.move_model = move_model
        w.move_optimizer = lambda device: trainer.replace()
        w.optimizer, w.optimizer_cpu_offload = object(), False
        w.offload_optimizer_for_refit = w.offload_optimizer_for_logprob = True
        w._async_checkpoint_cuda_cache_active = True  # what NeMo RL's save_checkpoint sets
        return w

    def _call(cls, method, colocated=False):
        return lambda trainer: getattr(_worker(cls, trainer, colocated), method)()

    def _bridge_finalize(trainer):
        _bridge.maybe_finalize_async_save(
            types.SimpleNamespace(async_calls_queue=trainer.queue),
            types.SimpleNamespace(async_save=True), blocking=True)

    _s.EXTRA_STEPS.update({{
        "offload_before_refit": _call(_policy.MegatronPolicyWorkerImpl, "offload_before_refit"),
        "offload_after_refit+colocated": _call(_policy.MegatronPolicyWorkerImpl,
                                               "offload_after_refit", colocated=True),
        "prepare_for_lp_inference": _call(_policy.MegatronPolicyWorkerImpl,
                                          "prepare_for_lp_inference"),
        "finish_training": _call(_value.MegatronValueWorkerImpl, "finish_training"),
        "prepare_for_training": _call(_policy.MegatronPolicyWorkerImpl, "prepare_for_training"),
        "value_prepare_for_training": _call(_value.MegatronValueWorkerImpl,
                                            "prepare_for_training"),
        "bridge_finalize": _bridge_finalize,
    }})
"""
OFFLOADS = [
    "save",
    "save",
    "offload_before_refit",
    "probe",
    "save",
    "prepare_for_lp_inference",
    "probe",
    "save",
    "finish_training",
    "probe",
    "save",
    "prepare_for_training",
]


def keys_per_probe(report):
    return [len(p["keys"]) for p in report["probes"]]


def test_without_the_package_offload_leaves_the_old_storage_mapped():
    report = scenario(OFFLOADS[:4], prelude=NEMO, fix=False)
    assert keys_per_probe(report) == [1]


def test_each_offload_point_releases_first_and_keeps_the_worker_with_flush():
    report = scenario(OFFLOADS, prelude=NEMO, env={"NVRX_IPC_FIX_STRATEGY": "flush"})
    assert keys_per_probe(report) == [0, 0, 0]
    assert len({p["pid"] for p in report["probes"]}) == 1
    assert report["releases_total"] == 3
    assert report["prewarms_total"] == 0  # flush: the onload points start nothing
    assert report["hang"] is None and [s["stale"] for s in report["saves"]] == [0] * 5


def test_a_build_with_nemo_rl_pr_3322_is_not_released_twice():
    report = scenario(
        ["save", "save", "offload_after_refit+colocated", "save", "save"], prelude=NEMO
    )
    assert report["releases_total"] == 0  # NeMo RL terminated the worker itself
    assert report["cleanups"] >= 1
    assert report["hang"] is None and [s["stale"] for s in report["saves"]] == [0] * 4


def test_policy_never_leaves_offloads_alone():
    report = scenario(OFFLOADS[:4], prelude=NEMO, env={"NVRX_IPC_FIX_RELEASE": "never"})
    assert keys_per_probe(report) == [1] and report["releases_total"] == 0


def test_policy_finalize_releases_after_a_blocking_finalize():
    report = scenario(
        ["save", "save", "bridge_finalize", "probe", "replace", "save"],
        prelude=NEMO,
        env={"NVRX_IPC_FIX_RELEASE": "finalize"},
    )
    assert keys_per_probe(report) == [0] and report["releases_total"] == 1
    assert [s["stale"] for s in report["saves"]] == [0] * 3


def test_the_kill_switch_of_release_on_offload_stops_the_finalize_release_too():
    report = scenario(
        ["save", "save", "bridge_finalize", "probe", "replace", "save"],
        prelude=NEMO,
        env={"NVRX_IPC_FIX_RELEASE": "finalize", "NVRX_IPC_FIX_DISABLE": "release_on_offload"},
    )
    assert keys_per_probe(report) == [1] and report["releases_total"] == 0
    assert [s["stale"] for s in report["saves"]] == [0] * 3  # clear_on_close, stale_guard: on


def test_status_shows_the_policy():
    code = f"""
        import json, sys
        sys.path.insert(0, {DOUBLES!r})
        import nvrx_ipc_fix
        import nemo_rl.models.policy.workers.megatron_policy_worker
        fix = nvrx_ipc_fix.status().fix("release_on_offload")
        print(json.dumps([str(fix.state), fix.reason]))
    """
    assert run_python(code)[0] == "active"
    assert run_python(code, env={"NVRX_IPC_FIX_RELEASE": "never"}) == [
        "disabled",
        "NVRX_IPC_FIX_RELEASE=never",
    ]


# restart: the optimizer offload for log-prob inference flushes (the model comes back); the
# refit offload terminates; the onload points start the next worker, the save takes it.
RESTART = [
    "save",
    "save",
    "prepare_for_lp_inference",
    "probe",
    "offload_before_refit",
    "measure",
    "prepare_for_lp_inference",
    "ready",
    "prepare_for_training",
    "save",
    "probe",
    "finish_training",
    "measure",
    "value_prepare_for_training",
    "ready",
    "save",
]


def test_restart_at_nemo_rl_s_offload_and_onload_points_by_default():
    report = scenario(RESTART, prelude=NEMO)  # NVRX_IPC_FIX_STRATEGY unset
    assert report["hang"] is None, report["stderr"]
    assert [s["stale"] for s in report["saves"]] == [0] * 4
    flushed, prewarmed = report["probes"]
    assert flushed["pid"] == report["saves"][1]["worker"] and flushed["keys"] == []
    assert [m["workers"] for m in report["measures"]] == [0, 0]  # none during inference
    at_lp, at_value = report["ready"]
    _, _, after_lp, after_value = report["saves"]
    assert after_lp["worker_before"] == after_lp["worker"] == prewarmed["pid"] == at_lp["pid"]
    assert after_value["worker_before"] == after_value["worker"] == at_value["pid"]
    assert report["prewarms_total"] == 2  # prepare_for_training found the worker started
    assert report["releases_total"] == 3 and report["prewarm_failures"] == 0


# NVRx's own close raises once (after doing its work), as a failing close of NVRx would.
CLOSE_RAISES = """
    from nvidia_resiliency_ext.checkpointing.async_ckpt import core as _core
    _close = _core.AsyncCallsQueue.close
    _raised = []

    def close(self, *args, **kwargs):
        _close(self, *args, **kwargs)
        if not _raised:
            _raised.append(True)
            raise RuntimeError("NVRx's close failed")

    _core.AsyncCallsQueue.close = close
"""


def test_an_nvrx_error_in_the_release_s_close_reaches_the_offload_s_caller():
    """Not the package's defect: the offload does its work, then raises NVRx's error, once;
    the next save loads."""
    report = scenario(
        ["save", "save", "offload_before_refit?", "prepare_for_training", "save"],
        prelude=NEMO + CLOSE_RAISES,
        env={"NVRX_IPC_FIX_STRATEGY": "restart"},
    )
    assert report["hang"] is None, report["stderr"]
    (call,) = report["calls"]
    assert call["error"] is not None, report["stderr"]  # without the hold: a warning only
    assert call["error"]["type"] == "RuntimeError", call
    assert call["error"]["message"].startswith("NVRx's close failed"), call
    assert call["moved"] == 2  # the offload moved the model and the optimizer all the same
    assert "hook on" not in report["stderr"]  # not reported as the package's own defect
    assert [s["stale"] for s in report["saves"]] == [0, 0, 0]
