"""Every rank runs the package, or the ranks that do warn of those that do not
(``worker.peers``), on gloo ranks and the real NVRx worker (``harness.ranks``); a rank without
the package runs with ``NVRX_IPC_FIX_DISABLE=1``, and ``StoreView`` counts (or fails) the
store calls the package makes. Each job that may differ from NVRx's is run side by side with
the package off on every rank (``job(..., package=False)``) and compared. More scenarios:
``test_never_worse_ranks.py``.

Against the check before (it raised ``RanksWithoutPackageError``, waited on the store, and
ran at every finalize all-reduce), the first four tests failed: a rank without the package
stopped rank 0 with that error; a late rank at an all-reduce that returns on the host at once
was named, as was a rank whose store was down for 10 s (raised); and the re-init test found
no warning there to count."""

import re

import pytest

from conftest import NVRX, needs_nvrx
from test_never_worse_ranks import job, loaded

pytestmark = [needs_nvrx, pytest.mark.worker]

EVERY = "every one of 2 ranks runs the package"
UNSURE = "cannot tell whether every rank runs the package"
NOT_CHECKED = "not checked yet"
#: a warning or status line that names ranks as not running the package: (namer, named)
NAMED = re.compile(r"rank (\d+): ranks? ([\d, ]+) of \d+ does? not run nvrx-ipc-fix")


def named(lines):
    """The ranks each line names as not running the package."""
    found = set()
    for line in lines:
        for match in NAMED.finditer(line):
            found.update(int(rank) for rank in match.group(2).split(", "))
    return found


def side_by_side(tmp_path, steps, without=(), **spec):
    """``steps`` with the package off on every rank, then on (but ``without``): (on, off)
    reports, each run without a hang or an error where the package is off."""
    (tmp_path / "off").mkdir()
    (tmp_path / "on").mkdir()
    off = job(tmp_path / "off", steps, package=False, **spec)
    for report in off:
        assert report["hang"] is None and report["errors"] == [], report
    return job(tmp_path / "on", steps, without=without, **spec), off


def test_a_rank_without_the_package_is_warned_of_once_and_the_job_goes_on(tmp_path):
    """Ranks 0 and 1 run the package, rank 2 does not, through 5 saves on a persistent
    worker: nothing is raised on any rank, every save loads as with the package off, and
    ranks 0 and 1 each give exactly one warning naming rank 2 (and only rank 2) and the
    doctor; rank 2 gives none. ``settle=0``: named at the second riding finalize."""
    steps = [["save"] * 5 + ["status"]] * 3
    on, off = side_by_side(tmp_path, steps, without=(2,), settle=0.0)
    saves = {f"save{n}" for n in range(1, 6)}
    for mine, alone in zip(on, off):
        assert mine["hang"] is None and mine["errors"] == [], mine
        assert loaded(mine) == loaded(alone) == saves, (mine["saves"], alone["saves"])
    for report in on[:2]:
        (warning,) = report["warnings"]
        assert named([warning]) == {2}, warning
        assert "`python -m nvrx_ipc_fix doctor`" in warning, warning
        assert "docs/activation.md" in warning, warning
        assert named(report["peers"]) == {2}, report["peers"]
        assert report["flag_rides"] == [False], report  # rank 2 would read it as not done
    assert on[2]["warnings"] == [], on[2]


def test_a_late_rank_at_an_all_reduce_the_host_does_not_wait_for_is_not_named(tmp_path):
    """A non-persistent queue (NVRx's process per save) whose finalize all-reduce returns on
    the host before the other rank entered it, as NCCL's does (``reduce="async"``); rank 1
    reaches the finalize 10 s after rank 0. No rank is named, nothing is checked there, and
    rank 0's finalize takes what it takes with the package off (it waits in NVRx's own
    collectives of the finalize for rank 1), within a second."""
    steps = [["schedule", "finalize", "status"], ["schedule", "sleep-10", "finalize", "status"]]
    spec = {"persistent": False, "reduce": "async"}
    on, off = side_by_side(tmp_path, steps, **spec)
    for mine, alone in zip(on, off):
        assert mine["hang"] is None and mine["errors"] == [], mine
        # On 0.4.1, with this simulated early return, rank 0 at times reads the checkpoint
        # before it is whole, with the package or without (each way seen, at random; cause not
        # found): what loads there says nothing of the package
        if NVRX != "0.4.1":
            assert loaded(mine) == loaded(alone) == {"save1"}, (mine["saves"], alone["saves"])
        assert mine["warnings"] == [], mine["warnings"]
        assert mine["peers"][0].startswith(NOT_CHECKED), mine["peers"]
    mine, alone = on[0]["saves"][0]["finalize_s"], off[0]["saves"][0]["finalize_s"]
    assert alone > 8, alone  # rank 0 did wait for rank 1 there, with the package off too
    assert abs(mine - alone) < 1.0, (mine, alone)
    print(f"\nrank 0's finalize: {mine:.3f} s with the package, {alone:.3f} s without")


def test_a_store_down_for_10_s_on_one_rank_names_no_rank(tmp_path):
    """Every call rank 1's package makes on the store fails for 10 s from its first
    (``StoreView(down=10)``); both ranks run the package, saving every 3 s. Rank 1 warns once
    that it cannot tell; rank 0, which found rank 1's word missing at the first save, reads
    again ``settle`` (15 s) later, once rank 1 has written it, and names no one. Nothing is
    raised, every save loads as with the package off."""
    steps = [["save", "sleep-3"] * 7 + ["save", "status"]] * 2
    on, off = side_by_side(tmp_path, steps, views={1: {"down": 10.0}}, settle=15.0)
    for mine, alone in zip(on, off):
        assert mine["hang"] is None and mine["errors"] == [], mine
        assert loaded(mine) == loaded(alone) == {f"save{n}" for n in range(1, 9)}
        assert named(mine["warnings"] + mine["peers"]) == set(), mine
    assert on[0]["warnings"] == [] and on[0]["peers"][0].startswith(EVERY), on[0]
    assert on[0]["flag_rides"] == on[1]["flag_rides"] == [True], (on[0], on[1])
    (warning,) = on[1]["warnings"]
    assert UNSURE in warning and on[1]["peers"][0].startswith(UNSURE), on[1]


def test_a_new_group_on_the_same_store_starts_clean(tmp_path):
    """``destroy_process_group()`` then ``init_process_group()`` on the same ``TCPStore``.
    In the first group rank 1 runs without the package (turned off before its first save):
    rank 0 warns once naming it. Rank 1 turns it on again before the second group, and rank
    0 finds every rank running it there: nothing of the first group's finding (module state,
    keys) is left, and rank 1's count of groups was kept in step by rank 0. Then rank 1 turns
    it off again and a third group names it afresh. Nothing is raised, every save loads."""
    steps = [
        ["save", "save", "status", "regroup", "save", "save", "status"]
        + ["regroup", "save", "save", "status"],
        ["deactivate", "save", "save", "regroup", "activate", "save", "save"]
        + ["regroup", "deactivate", "save", "save"],
    ]
    on, off = side_by_side(tmp_path, steps, store="tcp", settle=0.0)
    for mine, alone in zip(on, off):
        assert mine["hang"] is None and mine["errors"] == [], mine
        assert loaded(mine) == loaded(alone) == {f"save{n}" for n in range(1, 7)}
    first, second, third = on[0]["peers"]
    assert named([first]) == {1} and second.startswith(EVERY), on[0]["peers"]
    assert on[0]["flag_rides"] == [False, True, False], on[0]["flag_rides"]
    assert named([third]) == {1}, third
    assert [named([w]) for w in on[0]["warnings"]] == [{1}, {1}], on[0]["warnings"]


def test_every_rank_runs_it_with_three_store_calls_a_rank(tmp_path):
    """Every rank runs the package: no warning, every save loads. The store calls are made
    in the first save's finalize only (``StoreView`` counts them: its count of groups, its
    word, one read), none after."""
    steps = ["save", "status", "save", "save", "status"]
    for report in job(tmp_path, [steps, steps], views={0: {}, 1: {}}):
        assert report["hang"] is None and report["errors"] == [], report
        assert loaded(report) == {"save1", "save2", "save3"}
        assert report["views"] == [3, 3, 3, 3, 3], report["views"]
        assert all(p.startswith(EVERY) for p in report["peers"]), report["peers"]
        assert report["warnings"] == [] and report["flag_rides"] == [True, True], report


def test_saves_of_a_rank_alone_make_no_store_call(tmp_path):
    """Rank 0 saves alone (planned in a group of its own, ``no_dist=True``), rank 1 saves
    nothing: no finalize makes NVRx's all-reduce, so no store call is made and nothing is
    checked."""
    reports = job(
        tmp_path,
        [["alone", "alone", "status", "signal-done"], ["wait-done", "status"]],
        views={0: {}, 1: {}},
    )
    for report in reports:
        assert report["hang"] is None and report["errors"] == [], report
        assert set(report["views"]) == {0}, report["views"]
        assert report["peers"][0].startswith(NOT_CHECKED), report["peers"]
    assert loaded(reports[0]) == {"alone1", "alone2"}


def test_where_the_store_cannot_be_reached_the_check_cannot_tell_and_nvrx_goes_on(tmp_path):
    """A torch without ``distributed_c10d._get_default_store``: one warning a rank,
    ``status()`` says why, every save loads."""
    for report in job(
        tmp_path, [["save", "save", "status"]] * 2, views={0: {"gone": True}, 1: {"gone": True}}
    ):
        assert report["hang"] is None and report["errors"] == [], report
        assert loaded(report) == {"save1", "save2"}
        assert report["peers"][0].startswith(f"{UNSURE} (AttributeError"), report["peers"]
        assert len(report["warnings"]) == 1 and UNSURE in report["warnings"][0], report


def test_one_rank_makes_no_check(tmp_path):
    (report,) = job(tmp_path, [["save", "save", "status"]], views={0: {}})
    assert report["hang"] is None and report["errors"] == [], report
    assert loaded(report) == {"save1", "save2"} and set(report["views"]) == {0}
    assert report["peers"][0].startswith(NOT_CHECKED), report["peers"]
