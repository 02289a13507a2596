"""The standby (``worker.standby``): ``restart``'s next worker is forked at the onload
from a process that imported torch and NVRx during the inference phase, instead of a fresh
interpreter that imports them then. NVRx's own spawn (``starts="spawn"``), as users run it.
The standby is a forkserver of the package's own: the user's stays the user's (the same
without NVRx, on every Python: ``test_private_forkserver.py``).

Every save here is loaded back value by value (``stale``); a hang is the scenario's
watchdog's report."""

import pytest

from conftest import needs_warmup, run_python, scenario
from test_auto_release import NEMO

pytestmark = [needs_warmup, pytest.mark.worker]

# The first restart release starts the standby; its onload spawns the worker (the standby is
# not ready yet). Then: workers forked at each onload, a save before the forked worker is
# ready, a step without a save, and last a changed environment (the standby is not used: its
# restart release replaces it, and the next onload's worker is forked from the new one).
CYCLES = [
    "save",
    "offloading-restart",
    "standby",
    "ready",
    "save",
    "offloading-restart",
    "ready",
    "save",
    "offloading-restart",
    "save",  # at once: it waits for the worker
    "offloading-restart",  # a step without a save
    "offloading-restart",
    "ready",
    "save",
    "standby",
    "env-change",
    "offloading-restart",
    "ready",
    "save",
    "standby",
    "offloading-restart",
    "ready",
    "save",
]


@pytest.fixture(scope="module")
def cycles():
    return scenario(CYCLES, starts="spawn")


def test_restart_forks_the_next_worker_from_the_standby_and_every_save_loads(cycles):
    assert cycles["hang"] is None, cycles["stderr"]
    assert [s["stale"] for s in cycles["saves"]] == [0] * 7
    standby = cycles["standby"][0]
    assert standby["ready"] and standby["pid"], standby
    spawned, forked, forked_later, changed = cycles["ready"][:4]
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
    first, later, _ = cycles["standby"]  # the last one is the changed environment's
    assert first["pid"] == later["pid"]
    assert "4 worker(s) forked from a standby; 0 standby death(s)" in later["status"], later
    workers = [p["pid"] for p in cycles["prewarms"]]
    assert None not in workers and len(set(workers)) == 7  # one worker per onload


def test_a_changed_environment_is_not_inherited_from_the_standby(cycles):
    changed = cycles["ready"][3]
    assert changed["standby"] is None and changed["parent"] != cycles["standby"][0]["pid"]
    assert "the environment changed since it started" in cycles["standby"][2]["status"]
    assert cycles["saves"][5]["stale"] == 0


def test_a_standby_whose_environment_changed_is_replaced_not_kept(cycles):
    """The restart release after the change stops the old standby and starts another, whose
    workers inherit the environment as it is now."""
    first, _, replacement = cycles["standby"]
    assert replacement["ready"] and replacement["pid"] != first["pid"], replacement
    assert replacement["earlier_alive"] == [], replacement  # the old one is gone
    assert "1 replaced (the environment changed since it started)" in replacement["status"]
    old, new = cycles["ready"][1], cycles["ready"][4]
    assert old["env_changed"] is None  # the old standby's environment
    assert new["standby"] == new["parent"] == replacement["pid"], new
    assert new["env_changed"] == str(CYCLES.index("env-change")), new
    assert cycles["saves"][6]["worker"] == new["pid"] and cycles["saves"][6]["stale"] == 0


def test_the_readiness_probe_reports_what_it_found(cycles):
    """Ready means checked in the standby: one Python thread (a fork cannot inherit a lock
    another one held), no CUDA, and each module it was to import imported."""
    standby = cycles["standby"][0]
    status = standby["status"]
    assert status.startswith(
        f"ready (pid {standby['pid']}): 1 Python thread, no CUDA, "
        "imported torch, "
        "nvidia_resiliency_ext.checkpointing.async_ckpt.core, "
        "nvrx_ipc_fix.worker.inside, "
    ), status
    assert "async_ckpt.filesystem_async" in status and "cli.fakecuda" in status, status


# The standby dies: once while a worker forked from it waits for its save (the worker dies
# with it, is reported, and the save starts a fresh one), then the next restart release
# starts another standby, whose workers take the saves.
DEATH = [
    "save",
    "offloading-restart",
    "standby",
    "offloading-restart",
    "ready",
    "kill-standby",
    "save",
    "offloading-restart",
    "standby",
    "offloading-restart",
    "ready",
    "save",
    "standby",
]


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
    assert said[0].startswith(
        f"rank 0: the prewarmed NVRx checkpoint worker (pid "
        f"{waiting['pid']}) died after it was ready"
    ), said


def test_the_next_restart_release_starts_another_standby(death):
    first, second, last = death["standby"]
    assert first["pid"] != second["pid"] == last["pid"] and second["ready"]
    assert death["ready"][1]["parent"] == second["pid"]
    assert "1 standby death(s)" in last["status"]
    assert death["log"][1]["message"] == (
        f"nvrx_ipc_fix: the standby for restart's workers (pid {first['pid']}) died; NVRx "
        "spawns the next worker, and the next restart release starts another standby"
    )
    assert len(death["log"]) == 2


# Two automatic restart releases at NeMo RL's offload point (its test double), each worker
# forked from the standby at the onload; then the user's own code starts a forkserver child.
USER = [
    "save",
    "offload_before_refit",
    "standby",
    "prepare_for_training",
    "ready",
    "save",
    "offload_before_refit",
    "prepare_for_training",
    "ready",
    "save",
    "env-change",
    "user-forkserver",
]


def test_the_user_s_forkserver_child_after_the_standby_served_is_the_user_s():
    """Not the standby's child: it sees the environment as it is now, and arrives without
    torch, NVRx or the package imported (before: the standby was multiprocessing's
    forkserver, so the user's child came from it)."""
    report = scenario(USER, starts="spawn", prelude=NEMO, env={"NVRX_IPC_FIX_STRATEGY": "restart"})
    assert report["hang"] is None, report["stderr"]
    assert [s["stale"] for s in report["saves"]] == [0] * 3
    (standby,) = report["standby"]
    assert [r["parent"] for r in report["ready"]] == [standby["pid"]] * 2, report["ready"]
    (child,) = report["user_children"]
    assert child["answered"] and child["exitcode"] == 0, child
    assert child["variable"] == str(USER.index("env-change")), child
    assert child["imported"] == [] and child["parent"] != standby["pid"], child


def test_the_readiness_probe_fails_a_standby_that_is_not_what_it_claims(tmp_path):
    """A preload that starts a thread, one that initializes CUDA (``torch.cuda``'s flag set, a
    stand-in for the device), one that cannot be imported (``forkserver.main`` passes over
    the ImportError): the standby is not used, and ``status()`` says why."""
    (tmp_path / "starts_a_thread.py").write_text(
        "import threading, time\n"
        "threading.Thread(target=time.sleep, args=(600,), daemon=True).start()\n"
    )
    (tmp_path / "initializes_cuda.py").write_text("import torch\ntorch.cuda._initialized = True\n")
    pid, status = run_python(
        f"""
        import json, os, threading, nvrx_ipc_fix
        from nvrx_ipc_fix.worker import standby, inside as worker
        os.environ["PYTHONPATH"] = os.pathsep.join([{str(tmp_path)!r},
                                                    os.environ.get("PYTHONPATH", "")])
        worker.WORKER_IMPORTS.extend(["starts_a_thread", "initializes_cuda", "not_a_module_here"])
        standby.start()
        pid = standby._standby.pid
        for thread in threading.enumerate():
            if thread.name == "nvrx_ipc_fix-standby":
                thread.join(150)  # its probe
        print(json.dumps([pid, nvrx_ipc_fix.status().standby]))
    """,
        timeout=200,
    )
    assert status.startswith(
        f"failed to start (pid {pid}): 2 Python threads, CUDA initialized, "
        "did not import not_a_module_here;"
    ), status


@pytest.mark.parametrize("value", ["off", " 0 "])
def test_the_setting_off_starts_no_standby(value):
    pid, status = run_python(
        """
        import json, nvrx_ipc_fix
        from multiprocessing import forkserver
        from nvrx_ipc_fix.worker import standby
        standby.start()
        print(json.dumps([forkserver._forkserver._forkserver_pid, nvrx_ipc_fix.status().standby]))
    """,
        env={"NVRX_IPC_FIX_STANDBY": value},
    )
    assert pid is None and status.startswith("off (NVRX_IPC_FIX_STANDBY=off)"), status


def test_a_forkserver_started_by_other_code_is_not_used():
    """The standby starts a server of its own beside it (before: it declined, since
    multiprocessing's one server was taken)."""
    other, ours, status = run_python("""
        import json, multiprocessing, nvrx_ipc_fix
        from multiprocessing import forkserver
        from nvrx_ipc_fix.worker import standby
        multiprocessing.get_context("forkserver").Process().start()
        other = forkserver._forkserver._forkserver_pid
        standby.start()
        print(json.dumps([other, getattr(standby._standby, "pid", None),
                          nvrx_ipc_fix.status().standby]))
    """)
    assert other is not None and ours not in (None, other), status
    assert status.startswith(f"starting (pid {ours})"), status
