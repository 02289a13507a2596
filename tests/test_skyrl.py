"""SkyRL 0.4.0's real ``MegatronStrategy.save_checkpoint``/``load_checkpoint`` on the real
NVRx worker, at world size 2 (tests/skyrl_driver.py, one process per rank, gloo on the CPU;
stand-ins for the imports this machine cannot do: tests/stand_ins.py). SkyRL keeps one
``AsyncCallsQueue(persistent=True)`` per rank and closes and remakes it after every sync
save; its PR #1960 saw the worker die and every rank hang. Here one rank's worker dies
(rank 0's while idle, before a sync save; rank 1's while it writes an async save), and the
other rank must not be stranded. A save counts only when SkyRL's own ``load_checkpoint``
gives back every value saved, on every rank. Runs in the megatron tox env (skyrl is
installed there)."""

import importlib.util
import os
from importlib import metadata
from pathlib import Path

import pytest

from conftest import last_json, run_codes

try:
    SKYRL = metadata.version("skyrl")
except metadata.PackageNotFoundError:
    SKYRL = None

pytestmark = [
    pytest.mark.worker,
    pytest.mark.skipif(
        SKYRL is None or metadata.version("megatron-core") is None,
        reason="skyrl and megatron-core are installed only in the megatron tox env",
    ),
]

DRIVER = str(Path(__file__).with_name("skyrl_driver.py"))
PACKAGE = importlib.util.find_spec("nvrx_ipc_fix").origin
RANKS = 2
# an async save; rank 0's idle worker killed (OOM killer), then a sync save (close and
# remake) and an async save on the new queues; rank 1's worker killed while it writes an
# async save, then the next save (every rank's finalize raises), then one more
WITH = [
    "async",
    "load",
    "kill-idle@0",
    "sync",
    "workers",
    "async",
    "load",
    "async-kill@1",
    "async",
    "async",
    "load",
]
SYNC_HANG = ["async", "load", "kill-idle@0", "sync", "load"]
ASYNC_HANG = ["async", "load", "async-kill@1", "async"]
BOUND = 10.0  # seconds: the save whose finalize raises (detection takes about one)


def drive(steps, directory, fix=True, timeout=240):
    """Run the driver on ``RANKS`` ranks meeting in ``directory``, as children of the zygote
    where they can be (``conftest.run_codes``: torch imported once; the driver's NVRx
    workers start from a forkserver); their reports, by rank. The driver's watchdog reports
    a hang; this backstop kills every rank's process group (workers included) if that fails
    too."""
    codes = []
    for rank in range(RANKS):
        argv = ["--rank", str(rank), "--world-size", str(RANKS), "--dir", str(directory), *steps]
        codes.append(f"""
        import runpy, sys
        sys.argv[1:] = {argv!r}
        sys.path[0] = {os.path.dirname(DRIVER)!r}  # as for a script: the tests' directory
        runpy.run_path({DRIVER!r}, run_name="__main__")
    """)
    results = run_codes(codes, fix=fix, timeout=timeout)
    reports = []
    for rank, (rc, text, errors) in enumerate(results):
        assert rc == 0, f"rank {rank}: exit {rc}\n{errors[-3000:]}"
        report = last_json(text)
        # the children import the package these tests import (tox: the installed wheel)
        assert report["package"] == PACKAGE, (report["package"], PACKAGE)
        assert report["fix"]["worker_watch"] == ("active" if fix else "disabled")
        reports.append(report)
    return reports


@pytest.fixture(scope="module")
def with_the_package(tmp_path_factory):
    return drive(WITH, tmp_path_factory.mktemp("skyrl"))


def test_sync_save_after_a_dead_idle_worker_hangs_and_strands_the_other_rank_without_it(tmp_path):
    rank0, rank1 = drive(SYNC_HANG, tmp_path, fix=False)
    sync = SYNC_HANG.index("sync")
    # rank 0's close() waits for its dead worker; rank 1 waits for rank 0 in the next load
    assert rank0["hang"] == {
        "step": sync,
        "after_s": rank0["hang"]["after_s"],
        "worker_died": True,
        "stranded": False,
        "waiting_in": None,
    }, rank0
    assert rank1["hang"]["stranded"] and rank1["hang"]["step"] == sync + 1, rank1
    assert rank1["hang"]["waiting_in"] is not None, rank1
    assert rank1["saves"][-1]["stale"] != 0  # the sync save never loads


def test_sync_save_after_a_dead_idle_worker_closes_remakes_and_every_save_loads_on_both_ranks(
    with_the_package,
):
    for report in with_the_package:
        assert report["hang"] is None, report
        first, sync, after = report["saves"][:3]
        assert (first["stale"], sync["mode"], sync["stale"]) == (0, "sync", 0), report
        assert (after["mode"], after["stale"], after["lost"]) == ("async", 0, False), report
        assert report["queues"] == 2  # SkyRL's close-and-remake after the sync save
        [children] = report["workers"]  # right after the sync save
        assert sync["worker_before"] and sync["worker_before"] not in [
            pid for pid, _ in children
        ], report  # the old worker is gone, dead or alive
        assert all(e["step"] > WITH.index("load", WITH.index("sync")) for e in report["errors"])


def test_worker_killed_during_an_async_save_hangs_both_ranks_without_the_package(tmp_path):
    rank0, rank1 = drive(ASYNC_HANG, tmp_path, fix=False)
    step = ASYNC_HANG.index("async-kill@1") + 1  # the next save's finalize
    assert rank1["hang"] == {
        "step": step,
        "after_s": rank1["hang"]["after_s"],
        "worker_died": True,
        "stranded": False,
        "waiting_in": None,
    }, rank1
    # rank 0's worker is alive: it waits in the finalize's all-reduce for rank 1
    assert rank0["hang"] == {
        "step": step,
        "after_s": rank0["hang"]["after_s"],
        "worker_died": False,
        "stranded": True,
        "waiting_in": "all_reduce",
    }, rank0
    assert rank0["errors"] == rank1["errors"] == []


def test_worker_killed_during_an_async_save_is_one_error_on_every_rank_and_the_next_save_loads(
    with_the_package,
):
    step = WITH.index("async-kill@1") + 1  # raised by the next save_checkpoint's finalize
    for rank, report in enumerate(with_the_package):
        assert report["hang"] is None, report
        [error] = report["errors"]
        assert (error["step"], error["type"]) == (step, "CheckpointWorkerError"), error
        assert report["step_s"][step] < BOUND, report["step_s"]  # not a wait
        if rank == 1:  # its own worker died
            assert error["message"].startswith("rank 1: save #") and (
                "died while writing it (killed by SIGKILL)" in error["message"]
            ), error
        else:  # its worker lived; told by the finalize's all-reduce
            assert error["message"].startswith("rank 0: save #") and (
                "failed on rank 1: its checkpoint worker failed" in error["message"]
            ), error
        killed, raised, last = report["saves"][-3:]
        assert killed["mode"] == ("async-kill" if rank == 1 else "async")
        assert killed["lost"] and raised["lost"], report  # named by the error / never made
        assert (last["mode"], last["stale"], last["lost"]) == ("async", 0, False), report
