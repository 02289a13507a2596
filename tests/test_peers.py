"""Every rank runs the package, or the ranks that do say which do not at their first save
(``worker.peers``), on two gloo ranks and the real NVRx worker; a rank without the package
runs with ``NVRX_IPC_FIX_DISABLE=1``.

Before the check, the package on rank 0 only and rank 0's worker killed during the second
save (``save,fault-kill@0,save``, NVRx 0.7.0): rank 0 raised ``CheckpointWorkerError`` from
that save's finalize; rank 1 returned from its blocking finalize with no error and the save
still pending, and at its next save waited in NVRx's finalize all-reduce
(``sync_all_async_calls``) that rank 0 never made, while rank 0 waited in the next collective
(the harness's barrier): a hang, ended by the watchdog after 10 s."""

import textwrap

import pytest

from conftest import NVRX, last_json, needs_nvrx, run_codes

pytestmark = [needs_nvrx, pytest.mark.worker]

#: The steps the children add: ``peers`` (what the check found and cost so far), ``regroup``
#: (destroy the default group and make a new one, as an in-process restart does).
STEPS = """
    import nvrx_ipc_fix
    import torch.distributed as dist
    from harness import scenario

    def _peers(trainer):
        try:
            from nvrx_ipc_fix.worker import peers
        except ImportError:  # a package without the check
            return {"status": getattr(nvrx_ipc_fix.status(), "peers", None)}
        return {"status": nvrx_ipc_fix.status().peers, "counts": dict(peers.counts),
                "last": dict(peers.last)}

    def _regroup(trainer):
        rank, world = dist.get_rank(), dist.get_world_size()
        dist.destroy_process_group()
        dist.init_process_group("gloo", rank=rank, world_size=world,
                                init_method=f"file://{trainer.directory}/pg-again")

    scenario.EXTRA_STEPS.update(peers=_peers, regroup=_regroup)
"""


def two_ranks(tmp_path, steps, without=(), timeout=30, env=None, prelude=""):
    """``steps`` on two gloo ranks at once (``harness.scenario``), the ranks in ``without``
    with the package off; each rank's ``(exit code, report or None, stderr)``. A rank still
    running after the backstop is killed with the other and fails the test."""
    codes = [textwrap.dedent(f"""
        import os, sys
        if {rank in without}:
            os.environ["NVRX_IPC_FIX_DISABLE"] = "1"  # read as the driver imports the package
    """) + textwrap.dedent(prelude) + textwrap.dedent(STEPS) + textwrap.dedent(f"""
        sys.exit(scenario.main({["--steps", steps, "--rank", str(rank), "--world-size", "2",
                                 "--dir", str(tmp_path), "--timeout", str(timeout),
                                 "--numel", "512", "--starts", "forkserver"]!r}))
    """) for rank in range(2)]
    results = []
    for rc, out, err in run_codes(codes, env=env, timeout=4 * timeout + 60):
        try:
            report = last_json(out)
        except AssertionError:
            report = None
        results.append((rc, report, err[-3000:]))
    return results


def test_a_rank_without_the_package_is_named_at_the_first_save_and_the_job_ends(tmp_path):
    """Rank 0 (the package) waits for rank 1's word, up to the bound, and raises one
    ``RanksWithoutPackageError`` from the first save's schedule, naming rank 1 and the
    doctor, before NVRx's call: no worker started, NVRx's count unchanged. Rank 1 (without
    it) waits in NVRx's finalize all-reduce for rank 0 until rank 0's process is gone."""
    bound = 3
    (rc, report, err), (_, other, other_err) = two_ranks(
        tmp_path, "save?,peers#peers", without=(1,), timeout=10,
        env={"NVRX_IPC_FIX_PEERS_TIMEOUT": str(bound)})
    assert rc == 0 and report["hang"] is None, err
    call, = report["calls"]
    error = call["error"]
    assert error["type"] == "RanksWithoutPackageError", call
    assert error["message"].startswith("rank 0: rank 1 of 2 does not run nvrx-ipc-fix"), error
    assert "`python -m nvrx_ipc_fix doctor`" in error["text"]
    assert call["raised_in"] == "schedule" and call["after_s"] >= bound
    assert call["workers_after"] == 0 and report["call_idx"] == []  # nothing handed over
    peers = report["named"]["peers"]
    assert peers["status"].startswith("rank(s) 1 of 2 did not say") and peers["counts"][
        "checks"] == 1
    if other is None:  # that all-reduce failed once rank 0 was gone, and ended the process
        assert "sync_all_async_calls" in other_err, other_err
    elif other["calls"]:  # the same, recorded (NVRx 0.4.1: its exit then waits for its
        # non-daemonic worker, as without the package anywhere: the watchdog ends it)
        assert other["calls"][0]["raised_in"] == "finalize", other["calls"]
        assert other["calls"][0]["error"]["type"] == "RuntimeError", other["calls"]
    else:  # it stayed in that all-reduce: the watchdog ended it
        assert other["hang"]["waits_in"][-1] == "distributed_c10d.py:all_reduce", other


def test_every_rank_with_the_package_saves_and_the_check_costs_the_first_save_only(
        tmp_path, capsys):
    """No error; every save loads. Each rank said it runs the package as the first save's
    planning ended (``prepare_write_data``), so the check at its schedule only waits for
    the word of all; later saves make no store call; a new default group is checked afresh."""
    results = two_ranks(tmp_path, "save,peers#first,save,save,peers#later,regroup,save,"
                                  "peers#regrouped")
    for rc, report, err in results:
        assert rc == 0 and report["hang"] is None, err
        assert [s["stale"] for s in report["saves"]] == [0, 0, 0, 0]
        first, later, regrouped = (report["named"][n] for n in ("first", "later", "regrouped"))
        assert first["status"].startswith("every one of 2 ranks runs the package")
        assert first["last"]["announce_calls"] == 0  # said before the schedule
        assert first["counts"]["checks"] == 1 and first["last"]["store_calls"] >= 1
        assert later["counts"] == first["counts"]  # later saves: no store call
        assert regrouped["counts"]["checks"] == 2
        assert regrouped["counts"]["store_calls"] > later["counts"]["store_calls"]
    with capsys.disabled():  # the measure, for the record
        for rank, (_, report, _) in enumerate(results):
            first, regrouped = report["named"]["first"], report["named"]["regrouped"]
            print(f"\nNVRx {NVRX} rank {rank}: first save's check: {first['last']['store_calls']}"
                  f" store call(s), {first['last']['seconds'] * 1e3:.2f} ms; announce "
                  f"{first['counts']['store_calls'] - first['last']['store_calls']} call(s); "
                  f"after the new group: {regrouped['last']}")


def test_where_the_store_cannot_be_reached_the_check_cannot_tell_and_nvrx_goes_on(tmp_path):
    """The package's own defect: one warning, ``status()`` says why, every save loads."""
    prelude = """
        from torch.distributed import distributed_c10d
        del distributed_c10d._get_default_store  # a torch without it
    """
    for rc, report, err in two_ranks(tmp_path, "save,save,peers#peers", prelude=prelude):
        assert rc == 0 and report["hang"] is None, err
        assert [s["stale"] for s in report["saves"]] == [0, 0]
        assert report["named"]["peers"]["status"].startswith(
            "cannot tell whether every rank runs the package (AttributeError"), report["named"]
        assert err.count("hook on nvrx_ipc_fix.worker.peers:check failed") == 1, err
        assert report["fix"]["worker_watch"] == "active"


def test_one_rank_makes_no_check(tmp_path):
    rc, out, err = run_codes([textwrap.dedent(STEPS) + textwrap.dedent(f"""
        import sys
        sys.exit(scenario.main({["--steps", "save,save,peers#peers", "--dir", str(tmp_path),
                                 "--numel", "512", "--starts", "forkserver"]!r}))
    """)])[0]
    assert rc == 0, err
    report = last_json(out)
    assert [s["stale"] for s in report["saves"]] == [0, 0]
    assert report["named"]["peers"]["counts"] == {"store_calls": 0, "checks": 0}
