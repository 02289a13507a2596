"""SkyRL 0.4.0's real ``MegatronStrategy.save_checkpoint``/``load_checkpoint`` on the real
NVRx worker (tests/skyrl_driver.py; stand-ins for the imports this machine cannot do:
tests/stand_ins.py). SkyRL keeps one ``AsyncCallsQueue(persistent=True)`` and closes and
remakes it after every sync save; its PR #1960 saw the worker die and every rank hang.
A save counts only when SkyRL's own ``load_checkpoint`` gives back every value saved.
Runs in the megatron tox env (skyrl is installed there)."""

import sys
from importlib import metadata
from pathlib import Path

import pytest

from conftest import run_process

try:
    SKYRL = metadata.version("skyrl")
except metadata.PackageNotFoundError:
    SKYRL = None

pytestmark = [pytest.mark.worker, pytest.mark.skipif(
    SKYRL is None or metadata.version("megatron-core") is None,
    reason="skyrl and megatron-core are installed only in the megatron tox env")]

DRIVER = str(Path(__file__).with_name("skyrl_driver.py"))
# an async save; the idle worker killed (OOM killer), then a sync save (close and remake);
# an async save whose worker is killed while writing, then the next save, then one more
WITH = ["async", "load", "kill-idle", "sync", "load", "async-kill", "async", "async", "load"]


def drive(steps, fix=True):
    import json

    rc, out, err = run_process([sys.executable, DRIVER, *steps], fix=fix, timeout=240)
    assert rc == 0, f"exit {rc}\n{err[-3000:]}"
    return json.loads(out.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def with_the_package():
    return drive(WITH)


def test_sync_save_after_a_dead_worker_hangs_in_close_without_the_package():
    report = drive(WITH[:4], fix=False)  # NVRx's close() waits for the dead worker
    assert report["hang"] == {"step": 3, "after_s": report["hang"]["after_s"],
                              "worker_died": True}, report


def test_sync_save_closes_and_remakes_the_queue_and_every_save_loads(with_the_package):
    report = with_the_package
    assert report["hang"] is None
    first, sync, *_ = report["saves"]
    assert (first["stale"], sync["mode"], sync["stale"]) == (0, "sync", 0)
    assert report["queues"] == 2  # SkyRL's close-and-remake after the sync save


def test_worker_killed_during_an_async_save_hangs_without_the_package():
    report = drive(["async", "load", "async-kill", "async"], fix=False)
    assert report["hang"]["step"] == 3 and report["hang"]["worker_died"], report


def test_worker_killed_during_an_async_save_is_one_error_and_the_next_save_loads(
        with_the_package):
    report = with_the_package
    assert report["hang"] is None
    [error] = report["errors"]  # raised by the next save_checkpoint's finalize
    assert error["step"] == WITH.index("async-kill") + 1, error
    assert error["type"] == "CheckpointWorkerError" and "died while writing" in error["message"]
    killed, raised, last = report["saves"][2:]
    assert killed["lost"] and raised["lost"]  # neither is on disk; the error says why
    assert (last["mode"], last["stale"], last["lost"]) == ("async", 0, False)
