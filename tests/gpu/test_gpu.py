"""The real CUDA IPC path on a GPU (marked ``gpu``; skipped without CUDA): the model's
memory stays allocated after an offload without the package and is freed by ``flush``
(worker kept) and ``terminate``; stale data and the hang after close, without and with.
Run on an H200 with NVRx 0.6.0 and 0.7.0 (BENCHMARKS.md)."""

import importlib.util

import pytest

from conftest import expect, needs_cache, scenario


def _cuda():
    if importlib.util.find_spec("torch") is None:
        return False
    import torch

    return torch.cuda.is_available()


pytestmark = [pytest.mark.gpu, needs_cache,
              pytest.mark.skipif(not _cuda(), reason="no CUDA device")]

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
