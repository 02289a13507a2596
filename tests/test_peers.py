"""Every rank runs the package, or the ranks that do say which do not (``worker.peers``), on
gloo ranks and the real NVRx worker (``harness.ranks``); a rank without the package runs with
``NVRX_IPC_FIX_DISABLE=1``, and ``StoreView`` counts (or fails, or slows) the store calls the
package makes. The never-worse scenarios of the check: ``test_never_worse_ranks.py``.

Before the check, the package on rank 0 only and rank 0's worker killed during the second
save (``save,fault-kill@0,save``, NVRx 0.7.0): rank 0 raised ``CheckpointWorkerError`` from
that save's finalize; rank 1 returned from its blocking finalize with no error and the save
still pending, and at its next save waited in NVRx's finalize all-reduce
(``sync_all_async_calls``) that rank 0 never made, while rank 0 waited in the next collective
(the harness's barrier): a hang, ended by the watchdog after 10 s."""

import pytest

from conftest import NVRX, needs_nvrx
from test_never_worse_ranks import job, loaded

pytestmark = [needs_nvrx, pytest.mark.worker]

EVERY = "every one of 2 ranks runs the package"
UNSURE = "cannot tell whether every rank runs the package"


def test_a_rank_without_the_package_is_named_once_and_the_job_ends(tmp_path):
    """Rank 0 (the package) raises one ``RanksWithoutPackageError`` naming rank 1 and the
    doctor, from its first finalize, once NVRx's finalize of that save is done (it loads),
    and leaves, as a trainer that does not catch it. Rank 1 (without it) goes on to its next
    save, whose planning fails once rank 0's process is gone, as with NVRx alone."""
    first, other = job(
        tmp_path, [["save", "status", "save"], ["save", "save"]], without=(1,), stop_on_error=True
    )
    assert first["hang"] is None and other["hang"] is None, (first, other)
    (error,) = first["errors"]
    assert (error["type"], error["phase"], error["save"]) == (
        "RanksWithoutPackageError",
        "finalize",
        "save1",
    ), error
    assert error["message"].startswith("rank 0: rank 1 of 2 does not run nvrx-ipc-fix"), error
    assert "`python -m nvrx_ipc_fix doctor`" in error["text"], error
    assert error["ranks"] == [1] and len(error["finalized"]) == 1, error  # NVRx's index
    assert loaded(first) == loaded(other) >= {"save1"}
    assert [s["name"] for s in first["saves"]] == ["save1"]  # it left at the error
    if other["errors"]:  # its next save met rank 0's end
        assert [e["save"] for e in other["errors"]] == ["save2"], other["errors"]


def test_the_check_costs_the_first_finalize_only_and_a_new_group_starts_clean(tmp_path, capsys):
    """Every rank runs the package: no error, every save loads. The store calls are made in
    the first save's finalize only (``StoreView`` counts them), none after; a new default
    group on the same store is checked afresh."""
    steps = ["save", "status", "save", "regroup", "save", "status"]
    reports = job(tmp_path, [steps, steps], store="tcp", views={0: {}, 1: {}})
    for report in reports:
        assert report["hang"] is None and report["errors"] == [], report
        assert loaded(report) == {"save1", "save2", "save3"}
        first, _, later, regrouped, again, _ = report["views"]
        assert first > 0 and later == regrouped == first, report["views"]  # none after
        assert again > regrouped, report["views"]  # the new group's check
        assert all(p.startswith(EVERY) for p in report["peers"]), report["peers"]
    # the check of one group: 5 calls a rank, 2 more on the last one to read
    assert sorted(r["views"][0] for r in reports) == [5, 7], [r["views"] for r in reports]
    with capsys.disabled():  # the measure, for the record
        for report in reports:
            print(f"\nNVRx {NVRX} rank {report['rank']}: {report['peers'][0]}")


def test_a_new_group_where_a_rank_dropped_the_package_names_it(tmp_path):
    """``destroy_process_group()`` then ``init_process_group()`` on the same ``TCPStore``,
    and rank 1 turns the package off in between: the first group's keys are gone, so rank 0
    names rank 1 at the new group's first finalize (0008e45 found the first group's word
    and passed). Every save loads."""
    reports = job(
        tmp_path,
        [
            ["save", "regroup", "save", "save", "status"],
            ["save", "regroup", "deactivate", "save", "save"],
        ],
        store="tcp",
    )
    for report in reports:
        assert report["hang"] is None and loaded(report) == {"save1", "save2", "save3"}, report
    (error,) = reports[0]["errors"]
    assert (error["type"], error["save"], error["ranks"]) == (
        "RanksWithoutPackageError",
        "save2",
        [1],
    ), error
    assert reports[1]["errors"] == []


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
        assert report["peers"][0].startswith("not checked yet"), report["peers"]
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
        assert report["stderr"].count(f"RuntimeWarning: nvrx_ipc_fix: {UNSURE}") == 1, report


def test_a_rank_whose_word_could_not_be_stored_makes_every_rank_unsure(tmp_path):
    """Every try of rank 1's first store call fails; its next call works. Rank 1 marks that
    its word is missing, so both ranks cannot tell (one warning each), and neither accuses:
    no error, every save loads (0008e45: rank 1 went on unchecked, and rank 0 named it)."""
    for report in job(tmp_path, [["save", "save", "status"]] * 2, views={1: {"fail": 4}}):
        assert report["hang"] is None and report["errors"] == [], report
        assert loaded(report) == {"save1", "save2"}
        assert report["peers"][0].startswith(UNSURE), report["peers"]
        assert report["stderr"].count(f"RuntimeWarning: nvrx_ipc_fix: {UNSURE}") == 1, report


def test_one_rank_makes_no_check(tmp_path):
    (report,) = job(tmp_path, [["save", "save", "status"]], views={0: {}})
    assert report["hang"] is None and report["errors"] == [], report
    assert loaded(report) == {"save1", "save2"} and set(report["views"]) == {0}
    assert report["peers"][0].startswith("not checked yet"), report["peers"]
