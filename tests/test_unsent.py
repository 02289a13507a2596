"""A save whose request cannot be pickled, on the real NVRx worker: NVRx's queue hands the
pickling error to its feeder thread's ``_on_queue_feeder_error``, which only prints it, and
drops the request; the worker never hears of it. Without the package the trainer then waits
for ever for the worker's answer to the preload handshake (the scenario's watchdog reports
the hang), or, for a request without a ``preload_fn``, in the finalize. With it the schedule
raises the pickling error at once, the save is kept as failed (its finalize raises
``CheckpointWorkerError``: every rank learns of it there), and the next save, on the same
worker, loads. The objects: a ``threading.Lock`` in the request, a lambda as ``async_fn``."""

import pytest

from conftest import needs_nvrx, scenario, scenario_ranks

pytestmark = [needs_nvrx, pytest.mark.worker]

BOUND = 15.0  # seconds within which the error must come (it comes as the feeder fails; the
#             step timed includes the save, seconds under CI's load)
#: what NVRx's queue's feeder thread raises, by Python version: TypeError (a lock),
#: AttributeError or PicklingError (a local lambda)
PICKLING = {"TypeError", "AttributeError", "PicklingError"}


@pytest.mark.parametrize(
    "kind, waits_in",
    [
        ("lock", "schedule_async_call"),
        ("lambda", "schedule_async_call"),
        ("lambda-nopreload", "is_current_async_call_done"),
    ],
)
def test_without_the_package_a_request_that_cannot_be_pickled_waits_for_ever(kind, waits_in):
    report = scenario(["save", f"fault-{kind}", "save"], fix=False, timeout=10)
    hang = report["hang"]
    assert hang is not None and hang["step"] == 1 and not hang["worker_died"], report
    assert f"core.py:{waits_in}" in hang["waits_in"], hang


def test_with_the_package_it_raises_at_once_and_the_next_save_loads():
    """A lock, then a lambda: each schedule raises the pickling error at once, with the
    package's note; the save's finalize raises once; the next save loads. A request without
    a ``preload_fn``: its finalize raises, once. The worker stays; the close at the end
    does not wait (NVRx's queues hold no task for the dropped requests)."""
    steps = ["save", "fault-lock", "save", "fault-lambda", "save", "fault-lambda-nopreload", "save"]
    report = scenario(steps, timeout=30)
    assert report["hang"] is None, report["stderr"]
    lock, lam, nopreload = report["faults"]
    for outcome in (lock, lam):
        error = outcome["error"]
        assert error["type"] in PICKLING and outcome["raised_in"] == "schedule", outcome
        assert outcome["after_s"] < BOUND
        assert any("could not pickle the request of save #" in n for n in error["notes"]), error
        assert outcome["pending_after"] == 1  # kept as failed, for its finalize
        again = outcome["again"]  # the next finalize: this save's, on every rank
        assert again["type"] == "CheckpointWorkerError", outcome
        assert "could not pickle its request" in again["message"], again
    assert "lock" in lock["error"]["message"] and "lambda" in lam["error"]["message"]
    error = nopreload["error"]
    assert error["type"] == "CheckpointWorkerError" and nopreload["raised_in"] == "finalize"
    assert "could not pickle its request" in error["message"] and "lambda" in error["message"]
    assert nopreload["again"] is None and nopreload["pending_after"] == 0
    assert nopreload["after_s"] < BOUND
    saved = [s for s in report["saves"] if not s.get("lost")]
    assert [s["step"] for s in saved] == [0, 2, 4, 6]
    assert [s["stale"] for s in saved] == [0, 0, 0, 0]  # loaded back, every value current


def test_two_ranks_one_request_that_cannot_be_pickled_every_rank_raises_then_saves(tmp_path):
    """Only rank 0's request cannot be pickled: rank 0's schedule raises at once, and the
    save's finalize, where every rank meets in NVRx's all-reduce, raises on both ranks
    (rank 1 learns of rank 0's failure there); then both save, and load."""
    reports = scenario_ranks(
        "save,fault-lock@0,save",
        tmp_path,
        timeout=20,
        backstop=200,
        flags=["--finalize", "blocking"],
    )
    for rank, report in enumerate(reports):
        assert report["hang"] is None, report["stderr"]
        (outcome,) = report["faults"]
        finalized = outcome["again"] if rank == 0 else outcome["error"]
        assert finalized["type"] == "CheckpointWorkerError", outcome
        assert finalized["failed_ranks"] == [0], outcome
        assert [s["stale"] for s in report["saves"] if not s.get("lost")] == [0, 0]
    first = reports[0]["faults"][0]
    assert first["error"]["type"] in PICKLING and first["raised_in"] == "schedule", first
    assert "failed on rank 0" in reports[1]["faults"][0]["error"]["message"]
