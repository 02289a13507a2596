"""Part of the never-worse matrix: jobs of two gloo ranks on the real NVRx worker, each
scenario run twice, with the package and with ``NVRX_IPC_FIX_DISABLE=1`` on every rank, and
compared: with the package nothing hangs that did not, no error is raised where none was, and
every save that NVRx alone saved loads (``harness.ranks``). The scenarios are those of the
check that every rank runs the package (``worker.peers``): ranks that do not all save, a new
process group on the same store, a store that fails once or answers slowly, ranks whose first
saves are far apart, and a rank without the package (warned of once, and the job goes on as
NVRx's)."""

import os
import textwrap

import pytest

from conftest import last_json, needs_nvrx, run_codes

pytestmark = [needs_nvrx, pytest.mark.worker]

#: Seconds between rank 0's first save and rank 1's (``NEVER_WORSE_GAP_S=30``: the gap the
#: matrix names; the order is kept by events, so the old check fails at any gap).
GAP_S = float(os.environ.get("NEVER_WORSE_GAP_S", "1"))


def job(tmp_path, steps, package=True, without=(), timeout=60, env=None, views=None, **spec):
    """``steps`` (one list per rank) on gloo ranks at once (``harness.ranks``), with the
    package on every rank (``package``) but ``without``, or off on every rank; ``views``: a
    rank's ``StoreView``; each rank's report, with the end of its ``stderr``. A rank that did
    not report fails the test."""
    codes = []
    for rank, mine in enumerate(steps):
        view = (views or {}).get(rank)
        args = dict(spec, rank=rank, world=len(steps), dir=str(tmp_path), steps=mine)
        args.update(timeout=timeout, view=view)
        codes.append(
            textwrap.dedent(f"""
        import os, sys
        if {rank in without}:
            os.environ["NVRX_IPC_FIX_DISABLE"] = "1"  # read as the harness imports the package
        from harness import ranks
        sys.exit(ranks.main({args!r}))
    """)
        )
    reports = []
    for rc, out, err in run_codes(codes, fix=package, env=env, timeout=2 * timeout + 60):
        assert rc == 0, err[-3000:]
        warned = [line for line in err.splitlines() if "RuntimeWarning: nvrx_ipc_fix" in line]
        reports.append(dict(last_json(out), stderr=err[-3000:], warnings=warned))
    return reports


def never_worse(tmp_path, steps, **spec):
    """Run ``steps`` without the package, then with it; assert the matrix's rule. Both
    runs' reports (with, without)."""
    without = job(tmp_path / "off", steps, package=False, **spec)
    with_ = job(tmp_path / "on", steps, **spec)
    for mine, alone in zip(with_, without):
        assert alone["hang"] is None and alone["errors"] == [], alone  # a correct job
        assert mine["hang"] is None, mine
        assert mine["errors"] == [], mine
        assert loaded(mine) >= loaded(alone), (mine["saves"], alone["saves"])
    return with_, without


def loaded(report):
    return {save["name"] for save in report["saves"] if save["loads"] is True}


def run_dir(tmp_path, name):
    path = tmp_path / name
    (path / "off").mkdir(parents=True)
    (path / "on").mkdir()
    return path


def test_only_some_ranks_save(tmp_path):
    """Rank 0 alone saves a rank-local checkpoint (an EMA, RNG or data-loader state):
    planned in a group of its own, finalized with ``no_dist=True``; rank 1 saves nothing. No
    finalize makes NVRx's all-reduce, so nothing is checked and nothing waits."""
    with_, _ = never_worse(
        run_dir(tmp_path, "some"), [["alone", "alone", "signal-done"], ["wait-done"]]
    )
    assert loaded(with_[0]) == {"alone1", "alone2"}


def test_a_new_group_on_the_same_store(tmp_path):
    """``destroy_process_group()`` then ``init_process_group()`` on the same ``TCPStore``:
    the second group is checked afresh and passes."""
    steps = ["save", "status", "regroup", "save", "status"]
    with_, _ = never_worse(run_dir(tmp_path, "regroup"), [steps, steps], store="tcp")
    for report in with_:
        assert loaded(report) == {"save1", "save2"}
        assert all(
            p.startswith("every one of 2 ranks runs the package") for p in report["peers"]
        ), report["peers"]


@pytest.mark.parametrize("view", [{"fail": 1}, {"delay": 2.0}], ids=["fails-once", "slow"])
def test_a_store_that_fails_once_or_is_slow(tmp_path, view):
    """Rank 1's first store call for the check fails once, or each of its calls takes two
    seconds: every rank runs the package, and none is named. Slow: both say every rank runs
    it. Fails once: rank 1 cannot tell (its one warning) and writes its word at its next
    finalize; rank 0, which found no word at the first, waits for nothing and names no one
    (it would read again ``SETTLE_S`` later)."""
    with_, _ = never_worse(
        run_dir(tmp_path, "store"), [["save", "save", "status"]] * 2, views={1: view}
    )
    for report in with_:
        assert loaded(report) == {"save1", "save2"}
        assert "does not run" not in " ".join(report["warnings"] + report["peers"]), report
    if "delay" in view:
        for report in with_:
            assert report["peers"][0].startswith("every one of 2 ranks runs the package")
    else:
        assert with_[0]["peers"][0].startswith("no word yet from rank(s) 1 of 2"), with_[0]
        assert with_[1]["peers"][0].startswith("cannot tell"), with_[1]
        assert len(with_[1]["warnings"]) == 1, with_[1]["warnings"]


def test_ranks_whose_first_saves_are_far_apart(tmp_path):
    """Rank 0's first save is a rank-local one (planned alone, ``no_dist=True``); rank 1's
    first save is the next one of every rank, which rank 1 starts only once rank 0's first is
    finalized, and ``GAP_S`` seconds later. Rank 0's first save waits for nothing, as with
    NVRx alone (0008e45 waited at its schedule for rank 1's word: up to the bound, then
    named rank 1); in the save of every rank, rank 0 waits in NVRx's planning for rank 1, as
    NVRx does."""
    with_, _ = never_worse(
        run_dir(tmp_path, "apart"),
        [["alone", "signal-first", "save"], ["wait-first", f"sleep-{GAP_S}", "save"]],
    )
    assert loaded(with_[0]) == {"alone1", "save1"} and loaded(with_[1]) == {"save1"}


def test_a_rank_without_the_package_is_warned_of_and_every_save_loads(tmp_path):
    """Rank 1 runs without the package. Rank 0 warns once naming rank 1 (at its second
    finalize: ``settle=0``), raises nothing, and every save loads as with NVRx alone."""
    steps = [["save", "save", "save", "status"]] * 2
    base = run_dir(tmp_path, "without")
    alone = job(base / "off", steps, package=False, settle=0.0)
    mine = job(base / "on", steps, without=(1,), settle=0.0)
    for report, reference in zip(mine, alone):
        assert report["hang"] is None and report["errors"] == [], report
        assert loaded(report) == loaded(reference) == {"save1", "save2", "save3"}, report
    (warning,) = mine[0]["warnings"]
    assert "rank 0: rank 1 of 2 does not run nvrx-ipc-fix" in warning, warning
    assert mine[0]["peers"][0].startswith("rank 0: rank 1 of 2 does not run"), mine[0]
    assert mine[1]["warnings"] == []
