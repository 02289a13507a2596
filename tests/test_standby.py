"""The standby (``core.standby``, issue 27): ``restart``'s next worker is forked at the onload
from a process that imported torch and NVRx during the inference phase, instead of a fresh
interpreter that imports them then. NVRx's own spawn (``starts="spawn"``), as users run it.

Every save here is loaded back value by value (``stale``); a hang is the scenario's
watchdog's report."""

import pytest

from conftest import needs_warmup, run_python, scenario

pytestmark = [needs_warmup, pytest.mark.worker]

# The first restart release starts the standby; its onload spawns the worker (the standby is
# not ready yet). Then: workers forked at each onload, a save before the forked worker is
# ready, a step without a save, and last a changed environment (the standby is not used).
CYCLES = ["save", "offloading-restart", "standby", "ready", "save",
          "offloading-restart", "ready", "save",
          "offloading-restart", "save",  # at once: it waits for the worker
          "offloading-restart",  # a step without a save
          "offloading-restart", "ready", "save", "standby",
          "env-change", "offloading-restart", "ready", "save", "standby"]


@pytest.fixture(scope="module")
def cycles():
    return scenario(CYCLES, starts="spawn")


def test_restart_forks_the_next_worker_from_the_standby_and_every_save_loads(cycles):
    assert cycles["hang"] is None, cycles["stderr"]
    assert [s["stale"] for s in cycles["saves"]] == [0] * 6
    standby = cycles["standby"][0]
    assert standby["ready"] and standby["pid"], standby
    spawned, forked, forked_later, changed = cycles["ready"]
    assert spawned["standby"] is None and spawned["parent"] != standby["pid"]
    for ready in (forked, forked_later):
        assert ready["standby"] == ready["parent"] == standby["pid"], ready
        assert ready["error"] is None and ready["ready_s"] < spawned["ready_s"], ready
    saves = cycles["saves"]
    assert saves[2]["worker"] == forked["pid"] and saves[4]["worker"] == forked_later["pid"]
    assert cycles["prewarm_failures"] == 0 and cycles["log"] == [], cycles["stderr"]


def test_a_save_before_the_forked_worker_is_ready_waits_for_it(cycles):
    at_once = cycles["saves"][3]
    assert at_once["worker_before"] == at_once["worker"] == cycles["prewarms"][2]["pid"]
    assert at_once["stale"] == 0


def test_one_standby_serves_every_onload_also_after_a_step_without_a_save(cycles):
    first, later, last = cycles["standby"]
    assert first["pid"] == later["pid"] == last["pid"]
    assert "4 worker(s) forked from a standby; 0 standby death(s)" in later["status"], later
    workers = [p["pid"] for p in cycles["prewarms"]]
    assert None not in workers and len(set(workers)) == 6  # one worker per onload


def test_a_changed_environment_is_not_inherited_from_the_standby(cycles):
    changed = cycles["ready"][3]
    assert changed["standby"] is None and changed["parent"] != cycles["standby"][0]["pid"]
    assert "the environment changed since it started" in cycles["standby"][2]["status"]
    assert cycles["saves"][5]["stale"] == 0


# The standby dies: once while a worker forked from it waits for its save (the worker dies
# with it, is reported, and the save starts a fresh one), then the next restart release
# starts another standby, whose workers take the saves.
DEATH = ["save", "offloading-restart", "standby",
         "offloading-restart", "ready", "kill-standby", "save",
         "offloading-restart", "standby", "offloading-restart", "ready", "save", "standby"]


@pytest.fixture(scope="module")
def death():
    return scenario(DEATH, starts="spawn")


def test_a_worker_forked_from_a_standby_that_died_is_gone_reported_and_replaced(death):
    assert death["hang"] is None, death["stderr"]
    assert [s["stale"] for s in death["saves"]] == [0] * 3
    killed = death["standby_kills"][0]
    waiting = death["ready"][0]
    assert waiting["parent"] == killed["pid"] and killed["orphans"] == [], killed
    after = death["saves"][1]
    assert after["worker_before"] == waiting["pid"] != after["worker"]
    assert death["prewarm_failures"] == 1
    said = [line["message"] for line in death["log"]]
    assert said[0].startswith(f"rank 0: the prewarmed NVRx checkpoint worker (pid "
                              f"{waiting['pid']}) died after it was ready"), said


def test_the_next_restart_release_starts_another_standby(death):
    first, second, last = death["standby"]
    assert first["pid"] != second["pid"] == last["pid"] and second["ready"]
    assert death["ready"][1]["parent"] == second["pid"]
    assert "1 standby death(s)" in last["status"]
    assert death["log"][1]["message"] == (
        f"nvrx_ipc_fix: the standby for restart's workers (pid {first['pid']}) died; NVRx "
        "spawns the next worker, and the next restart release starts another standby")
    assert len(death["log"]) == 2


@pytest.mark.parametrize("value", ["off", " 0 "])
def test_the_setting_off_starts_no_standby(value):
    pid, status = run_python("""
        import json, nvrx_ipc_fix
        from multiprocessing import forkserver
        from nvrx_ipc_fix.core import standby
        standby.start()
        print(json.dumps([forkserver._forkserver._forkserver_pid, nvrx_ipc_fix.status().standby]))
    """, env={"NVRX_IPC_FIX_STANDBY": value})
    assert pid is None and status.startswith("off (NVRX_IPC_FIX_STANDBY=off)"), status


def test_a_forkserver_started_by_other_code_is_not_used():
    status = run_python("""
        import json, multiprocessing, nvrx_ipc_fix
        from nvrx_ipc_fix.core import standby
        multiprocessing.get_context("forkserver").Process().start()
        standby.start()
        print(json.dumps(nvrx_ipc_fix.status().standby))
    """)
    assert "was started by other code: NVRx spawns the workers" in status, status
