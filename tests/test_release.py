"""``release()`` on the real NVRx worker: flush keeps the worker and empties its cache,
terminate replaces the worker; the worker itself is asked what it holds (a probe request),
and on the CPU stand-in "holds" is a mapped shared-memory segment of the trainer's storage.
"""

import sys

import pytest

from conftest import needs_cache, needs_nvrx, run_process, run_python, scenario, scenario_ranks

TENSORS = 8


@needs_cache
@pytest.mark.worker
def test_without_release_the_worker_keeps_the_old_storage_mapped():
    report = scenario(["save", "save", "probe", "replace", "probe"], tensors=TENSORS)
    before, after = report["probes"]
    assert len(after["keys"]) == 1
    assert after["shm_segments"] == before["shm_segments"]  # the abandoned storage stays mapped


# One run covers flush, a pending save finalized by release, and terminate.
STEPS = [
    "save",
    "save",
    "probe",
    "flush",
    "probe",
    "replace",
    "save",
    "probe",
    "save-async",
    "terminate",
    "replace",
    "save",
    "probe",
]


@pytest.fixture(scope="module")
def released():
    return scenario(STEPS, tensors=TENSORS)


@needs_cache
@pytest.mark.worker
def test_flush_empties_the_worker_cache_and_keeps_the_worker(released):
    primed, flushed, resent, _ = released["probes"]
    assert len(primed["keys"]) == 1 and flushed["keys"] == []
    assert primed["shm_segments"] - flushed["shm_segments"] >= TENSORS  # really unmapped
    assert primed["pid"] == flushed["pid"] == resent["pid"]
    assert len(resent["keys"]) == 1  # the next save sent full tensors again
    flush = released["releases"][0]
    assert flush["strategy"] == "flush" and flush["worker_kept"]
    assert flush["queues_released"] == 1 and flush["keys_cleared"] == 1
    assert flush["error"] is None


@needs_cache
@pytest.mark.worker
def test_terminate_replaces_the_worker_after_finalizing_the_pending_save(released):
    _, _, before, after = released["probes"]
    assert before["pid"] != after["pid"]
    terminate = released["releases"][1]
    assert terminate["worker_terminated"] and not terminate["worker_kept"]


@needs_cache
@pytest.mark.worker
def test_nothing_stale_and_no_hang_around_releases(released):
    assert released["hang"] is None, released["stderr"]
    assert [s["stale"] for s in released["saves"]] == [0] * 5


@needs_cache
@pytest.mark.worker
def test_two_ranks_release_in_the_same_order(tmp_path):
    """gloo on CPU: a pending save is finalized collectively inside release(); each rank
    prewarms its own worker after a restart."""
    steps = (
        "save,save,save-async,flush,replace,save,terminate,replace,save,"
        "save-async,restart,replace,prewarm,ready,save"
    )
    reports = scenario_ranks(steps, tmp_path)
    for report in reports:
        assert report["hang"] is None
        assert [s["stale"] for s in report["saves"]] == [0] * 7
        assert [r["queues_released"] for r in report["releases"]] == [1, 1, 1]
        assert report["saves"][-1]["worker"] == report["ready"][0]["pid"]
    assert reports[0]["ready"][0]["pid"] != reports[1]["ready"][0]["pid"]


@needs_cache
@pytest.mark.worker
def test_a_worker_that_does_not_answer_is_terminated_not_waited_for():
    result = run_python(
        """
        import json, tempfile, time
        import nvrx_ipc_fix
        from harness import scenario
        from nvidia_resiliency_ext.checkpointing.async_ckpt import core
        with tempfile.TemporaryDirectory() as d:
            t = scenario.Trainer(d, 4, 256, starts="forkserver")
            t.save()
            caller = t.queue.persistent_caller
            # a request that keeps the worker busy for longer than the bound
            caller.queue.put(core.AsyncRequest(time.sleep, (60,), [], call_idx=99))
            start = time.monotonic()
            report = nvrx_ipc_fix.release(t.queue, timeout=2)
            took = time.monotonic() - start
            _, _, path, version = t.save()
            stale = t.stale_tensors(path, version)
            t.close()  # NVRx 0.6.0 hangs at exit after an abort without this, fix or not
            print(json.dumps({"error": report.error, "took": took,
                              "terminated": report.worker_terminated, "stale_after": stale}))
    """,
        timeout=240,
    )
    assert "did not answer within 2 s and was terminated" in result["error"]
    assert result["terminated"] and result["took"] < 45
    assert result["stale_after"] == 0


def test_bad_strategy_and_no_nvrx():
    result = run_python("""
        import json, nvrx_ipc_fix
        try:
            nvrx_ipc_fix.release(strategy="kill")
        except ValueError as exc:
            error = str(exc)
        report = nvrx_ipc_fix.release()
        print(json.dumps({"error": error, "skipped": list(report.skipped),
                          "released": report.queues_released, "freed": report.freed_bytes}))
    """)
    assert result["error"] == (
        "strategy must be one of flush, terminate, restart, suspend, not 'kill'"
    )
    assert result["skipped"] == ["all: NVRx is not imported"]
    assert result["released"] == 0 and result["freed"] == 0


def test_invalid_strategy_env_warns_once_and_uses_flush():
    rc, out, err = run_process(
        [
            sys.executable,
            "-c",
            (
                "import nvrx_ipc_fix; print(nvrx_ipc_fix.release().strategy, "
                "nvrx_ipc_fix.release().strategy)"
            ),
        ],
        env={"NVRX_IPC_FIX_STRATEGY": "nuke"},
    )
    assert rc == 0 and out.split() == ["flush", "flush"]
    assert err.count("NVRX_IPC_FIX_STRATEGY='nuke' is not one of flush, terminate, restart") == 1


@needs_nvrx
def test_release_with_no_queue_says_so_and_counts_no_cleanup():
    result = run_python("""
        import json, nvrx_ipc_fix
        from nvidia_resiliency_ext.checkpointing.async_ckpt import core
        r = nvrx_ipc_fix.release()
        idle = core.AsyncCallsQueue()  # a queue that never saved: no worker, no cached keys
        again = nvrx_ipc_fix.release(idle)
        s = nvrx_ipc_fix.status()
        print(json.dumps({"skipped": list(r.skipped), "released": r.queues_released,
                          "again": [again.queues_released, again.keys_cleared],
                          "counted": [s.cleanups, s.releases]}))
    """)
    assert result["released"] == 0
    assert result["skipped"] in (
        ["queues: no live AsyncCallsQueue"],
        ["all: this NVRx has no worker cache"],
    )
    assert result["again"] == [0, 0]
    assert result["counted"] == [0, 0]  # nothing was released: no cleanup, no release


@needs_cache
@pytest.mark.worker
def test_a_rank_that_releases_alone_is_reported_and_goes_on_once_the_other_finalizes(tmp_path):
    """Rank 0 calls release() with a save pending, rank 1 does not (it finalizes 8 s
    later): rank 0 logs one ERROR naming the all-reduce and the rule, then goes on."""
    steps = "save,save-async,flush@0,sleep8@1,finalize,save"
    alone, other = scenario_ranks(
        steps, tmp_path, env={"NVRX_IPC_FIX_STALL_TIMEOUT": "3"}, backstop=300
    )
    assert [s["stale"] for s in alone["saves"]] == [s["stale"] for s in other["saves"]] == [0] * 3
    assert [entry["level"] for entry in alone["log"]] == ["ERROR", "WARNING"]
    assert "finalize all-reduce (sync_all_async_calls)" in alone["log"][0]["message"]
    assert "call release() on every rank, in the same order" in alone["log"][0]["message"]
    assert other["log"] == []


@needs_cache
@pytest.mark.worker
def test_release_finalizes_as_the_ranks_own_finalize_so_ranks_that_polled_apart_meet(tmp_path):
    """Ranks that poll with ``no_dist=True`` finalize alone, so their pending saves can
    differ: rank 0 finalizes a save while rank 1 has not yet (rank 0 then waits inside the
    save's own finalize, DCP's gather), and rank 1 reaches its offload point and releases. A
    release that entered NVRx's finalize all-reduce there would meet rank 0 in another
    collective. release() finalizes as the ranks' own finalize did (``no_dist`` of the
    queue's last finalize), so rank 1 joins rank 0's gather; then both release, and every
    save loads. (With ``no_dist=False`` every poll is an all-reduce of all ranks: their
    pending saves never differ, ``test_two_ranks_release_in_the_same_order``.)"""
    steps = "save,save-async,finalize@0,sleep2@1,flush,save"
    reports = scenario_ranks(
        steps,
        tmp_path,
        timeout=40,
        backstop=300,
        flags=["--starts", "forkserver", "--finalize", "poll", "--no-dist"],
    )
    for report in reports:
        assert report["hang"] is None, report["stderr"]
        assert [s["stale"] for s in report["saves"]] == [0, 0, 0]
    assert [r["queues_released"] for r in reports[0]["releases"]] == [1]
    assert [r["queues_released"] for r in reports[1]["releases"]] == [1]
