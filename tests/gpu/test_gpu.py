"""The real CUDA IPC path on a GPU (marked ``gpu``; skipped without CUDA): the model's
memory stays allocated after an offload without the package and is freed by ``flush``
(worker kept) and ``terminate``; stale data and the hang after close, without and with.
Run on an H200 with NVRx 0.6.0 and 0.7.0 (BENCHMARKS.md)."""

import importlib.util

import pytest

from conftest import expect, needs_cache, scenario, scenario_ranks


def _cuda():
    if importlib.util.find_spec("torch") is None:
        return False
    import torch

    return torch.cuda.is_available()


pytestmark = [
    pytest.mark.gpu,
    needs_cache,
    pytest.mark.skipif(not _cuda(), reason="no CUDA device"),
]

TENSORS, NUMEL = 8, (64 << 20) // 4 // 8  # a 64 MiB model
MODEL = TENSORS * NUMEL * 4
LIFECYCLE = ["offload", "measure", "onload", "save"]


def run(steps, **kwargs):
    return scenario(steps, tensors=TENSORS, numel=NUMEL, **kwargs)


def test_without_the_package_the_model_stays_allocated_after_offload():
    report = run(["save", "save", *LIFECYCLE], fix=False)
    assert report["measures"][0]["allocated"] >= MODEL
    expected_stale = TENSORS if expect("stale") else 0
    assert [s["stale"] for s in report["saves"]] == [0, 0, expected_stale]


def test_flush_frees_the_model_and_keeps_the_worker():
    report = run(["save", "save", "probe", "flush", "probe", *LIFECYCLE, "probe"])
    assert report["measures"][0]["allocated"] < MODEL // 20
    primed, flushed, after = report["probes"]
    assert primed["pid"] == flushed["pid"] == after["pid"] and flushed["keys"] == []
    assert [s["stale"] for s in report["saves"]] == [0, 0, 0]


def test_terminate_frees_the_model():
    report = run(["save", "save", "terminate", *LIFECYCLE])
    assert report["measures"][0]["allocated"] < MODEL // 20
    assert report["releases"][0]["worker_terminated"]
    assert [s["stale"] for s in report["saves"]] == [0, 0, 0]


def test_hang_after_close_without_the_package_and_not_with_it():
    steps = ["save", "save", "close", "save"]
    without = run(steps, fix=False)
    assert without["hang"] is not None and without["cache_miss"]
    with_fix = run(steps + ["replace", "save"])
    assert with_fix["hang"] is None
    assert [s["stale"] for s in with_fix["saves"]] == [0, 0, 0, 0]


def test_restart_leaves_no_worker_and_the_prewarmed_worker_takes_the_next_save():
    report = run(["save", "save", "restart", *LIFECYCLE[:3], "prewarm", "ready", "save"])
    measure = report["measures"][0]
    assert measure["allocated"] < MODEL // 20 and measure["workers"] == 0
    ready = report["ready"][0]
    assert ready["error"] is None and ready["ready_s"] > 0
    after = report["saves"][-1]
    assert after["worker_before"] == after["worker"] == ready["pid"]
    assert [s["stale"] for s in report["saves"]] == [0, 0, 0]


# -- suspend: the CUDA driver's process checkpoint API on a real worker ---------------------

SUSPEND_CYCLE = [
    "save",
    "save",
    "probe",
    "suspend",
    "offload",
    "measure",
    "onload",
    "resumed",
    "probe",
    "save",
    "suspend",
    "prewarm",
    "resumed",
    "save",
]


def test_suspend_leaves_nothing_of_the_worker_on_the_device_and_keeps_it():
    report = run(SUSPEND_CYCLE)
    first = report["releases"][0]
    assert first["strategy"] == "suspend" and first["worker_suspended"], first
    measure = report["measures"][0]
    assert measure["workers"] == 1 and measure["workers_on_device"] == {}, measure
    assert measure["allocated"] < MODEL // 20
    before, after = report["probes"]
    assert before["pid"] == after["pid"]  # the same warm worker, not a new one
    assert all(s["worker"] == before["pid"] for s in report["saves"])
    assert all(r["restore_s"] is not None for r in report["resumes"])
    assert report["prewarms_total"] == 0
    assert [s["stale"] for s in report["saves"]] == [0, 0, 0, 0] and report["hang"] is None


def test_a_worker_killed_while_suspended_is_one_error_and_the_next_save_loads():
    report = run(["save", "save", "suspend", "kill-worker", "offload", "onload", "save?", "save"])
    assert report["hang"] is None
    (call,) = report["calls"]
    assert call["error"]["type"] == "CheckpointWorkerError", call
    assert report["saves"][-1]["stale"] == 0
    assert any("died while suspended" in r["message"] for r in report["log"])


LOCK_WHILE_MAPPED = """
    from nvrx_ipc_fix.worker import suspend as _suspend
    from harness import scenario as _s

    # the worker still maps the trainer's memory: the lock may not come back
    def _unflushed(trainer):
        _suspend.LOCK_TIMEOUT = 3.0
        assert _suspend.unavailable() is None
        caller = trainer.queue.persistent_caller
        return {"error": _suspend.suspend(trainer.queue, caller, 20.0), "pid": caller.process.pid}

    _s.EXTRA_STEPS["suspend-unflushed"] = _unflushed
"""


def test_a_lock_on_a_worker_that_maps_the_trainers_memory_ends_in_time_and_the_next_save_loads():
    """The package always flushes first; here it does not. Whatever the driver does with the
    lock, nothing hangs and the save after the next loads: a suspend that failed ended the
    worker (the next save takes a fresh one); a worker that died under the lock or after the
    restore (seen on the H200, driver 580: the suspend succeeds, the next save meets a dead
    worker) is one error, from the save after it."""
    report = scenario(
        ["save", "save", "suspend-unflushed#unflushed", "save?", "save"],
        tensors=TENSORS,
        numel=NUMEL,
        prelude=LOCK_WHILE_MAPPED,
    )
    assert report["hang"] is None
    unflushed = report["named"]["unflushed"]
    (call,) = report["calls"]
    print("suspend:", unflushed, "save after it:", call)  # what this driver did (-rA shows it)
    if call["error"] is not None:  # a worker death: one error, from the save after it
        assert call["error"]["type"] == "CheckpointWorkerError", (call, unflushed)
    assert report["saves"][-1]["stale"] == 0 and report["saves"][-1]["worker"] != unflushed["pid"]


def test_without_the_driver_api_suspend_falls_back_to_restart_with_one_line():
    report = run(
        [
            "driver-absent",
            "save",
            "save",
            "suspend",
            "offload",
            "measure",
            "onload",
            "prewarm",
            "ready",
            "save",
        ]
    )
    release = report["releases"][0]
    assert release["strategy"] == "restart" and release["worker_terminated"], release
    assert report["measures"][0]["workers"] == 0
    assert report["stderr"].count("uses restart instead of suspend") == 1
    assert [s["stale"] for s in report["saves"]] == [0, 0, 0]


def test_two_ranks_on_one_device_suspend_their_own_workers_and_a_kill_on_one_is_one_error_each(
    tmp_path,
):
    """gloo: NCCL refuses two ranks on one device. Rank 1's worker is killed while suspended."""
    reports = scenario_ranks(
        "save,save,suspend,offload,measure,onload,save,suspend,"
        "kill-worker@1,offload,onload,save?,save",
        tmp_path,
        backstop=300,
    )
    for report in reports:
        assert report["hang"] is None
        assert [r["worker_suspended"] for r in report["releases"]] == [True, True]
        assert report["measures"][0]["workers_on_device"] == {}
        (call,) = report["calls"]
        assert call["error"]["type"] == "CheckpointWorkerError", (report["rank"], call)
        assert report["saves"][-1]["stale"] == 0
        assert [s["stale"] for s in report["saves"] if not s.get("lost")][:3] == [0, 0, 0]
