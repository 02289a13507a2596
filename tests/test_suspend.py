"""Strategy ``suspend`` on the real NVRx worker, on the CPU: the CUDA driver's process
checkpoint API is the stand-in ``harness.fakedriver`` (lock = SIGSTOP, unlock =
SIGCONT, so a save handed to a worker still suspended really hangs). The suspend fix resumes
the worker before any save or close, which the stand-in's calls and the worker's /proc state
show; each driver fault ends the worker, warns once, the next save loads and the release
uses ``restart`` from then on; NeMo RL's offload and onload points (test doubles) suspend
and resume the same worker. Without CUDA and without the stand-in, the automatic release is
``restart``, silently (tests/test_auto_release.py has the rest of that)."""

import json
import os
import sys
import time

import pytest

from conftest import GPU, needs_cache, run_code, run_process, scenario, scenario_ranks
from test_auto_release import CLOSE_RAISES, NEMO

pytestmark = [needs_cache, pytest.mark.worker]

# Steps of this file's own (a step's entry is report["named"][<name>]):
#   worker#<name>  the pid of the worker that takes the next save, its /proc state ("T":
#                  stopped, as the stand-in's lock leaves it)
#   seen#<name>    the driver calls the stand-in saw so far, status().suspend, the prewarm and
#                  release counts, and for each worker suspended now whether its resume has
#                  started (a thread of its own)
#   spy            from now on, record each request put on the worker's queue: its call_idx,
#                  the driver calls made by then, the worker's pid and /proc state
#   puts#<name>    what spy recorded
PRELUDE = """
    import sys
    import nvrx_ipc_fix
    from nvrx_ipc_fix.worker.guardian_process import stat_fields
    from harness import scenario as _s

    def _proc_state(pid):
        try:
            return stat_fields(pid)[0].decode()
        except OSError:
            return None

    def _worker(trainer):
        pid = getattr(trainer.worker(), "pid", None)
        return {"pid": pid, "state": pid and _proc_state(pid)}

    def _calls(trainer):
        driver = getattr(trainer, "driver", None)
        return None if driver is None else [name for name, _ in driver.calls]

    def _seen(trainer):
        status = nvrx_ipc_fix.status()
        suspend = sys.modules.get("nvrx_ipc_fix.worker.suspend")
        now = {} if suspend is None else dict(suspend._suspended)
        return {"calls": _calls(trainer), "suspend": status.suspend,
                "prewarms": status.prewarms, "releases": status.releases,
                "resuming": {str(pid): s.thread is not None for pid, s in now.items()}}

    _puts = []

    def _spy(trainer):
        queue = trainer.queue.persistent_caller.queue
        put = queue.put

        def spied(item, *args, **kwargs):
            _puts.append({"call_idx": getattr(item, "call_idx", None),
                          "calls": _calls(trainer), **_worker(trainer)})
            return put(item, *args, **kwargs)

        queue.put = spied

    _s.EXTRA_STEPS.update({"worker": _worker, "seen": _seen, "spy": _spy,
                           "puts": lambda trainer: {"puts": list(_puts)}})
"""
SUSPEND_CALLS = ["state", "lock", "checkpoint"]
RESUME_CALLS = ["restore", "unlock"]
NO_CUDA = "this process has not initialized CUDA"
FAST = {"NVRX_IPC_FIX_RELEASE_TIMEOUT": "2"}


def stale(report):
    return [s["stale"] for s in report["saves"]]


def runtime_warnings(report):
    """The package's RuntimeWarnings on the child's stderr."""
    return [
        line for line in report["stderr"].splitlines() if "RuntimeWarning: nvrx_ipc_fix:" in line
    ]


def resume_started(seen):
    """At a ``seen`` step: is every suspended worker's resume under way or done?"""
    return all(seen["resuming"].values())


# -- the kept worker: call order, resumed before the save, killed while suspended, exit --------

KEPT = [
    "driver",
    "save",
    "save",
    "suspend",
    "worker#frozen",
    "seen#suspended",
    "spy",
    "save",
    "seen#saved",
    "puts#puts",
    "suspend",
    "kill-worker",
    "save?",
    "save",
    "seen#killed",
    "suspend",
]  # the last step: the scenario's close finds the worker suspended


@pytest.fixture(scope="module")
def kept():
    return scenario(KEPT, prelude=PRELUDE)


@pytest.mark.smoke
def test_suspend_keeps_the_worker_and_the_next_save_takes_it(kept):
    assert kept["hang"] is None, kept["stderr"]  # the close at the end too
    assert stale(kept) == [0, 0, 0, 0]
    assert kept["fix"]["suspend"] == "active"
    for release in kept["releases"]:
        assert release["strategy"] == "suspend" and release["worker_suspended"] is True
        assert release["worker_kept"] is True and release["worker_terminated"] is False
        assert release["error"] is None and release["skipped"] == []
        assert release["queues_released"] == 1
    assert len(kept["releases"]) == 3
    before, after = kept["saves"][1], kept["saves"][2]
    assert after["worker_before"] == after["worker"] == before["worker"] is not None
    assert runtime_warnings(kept) == []


def test_the_suspended_worker_is_stopped_and_resumed_in_order(kept):
    named = kept["named"]
    assert named["frozen"] == {"pid": kept["saves"][1]["worker"], "state": "T"}
    assert named["suspended"]["calls"] == SUSPEND_CALLS
    assert named["suspended"]["suspend"].endswith("1 suspend(s), 0 resume(s), 1 suspended now")
    assert named["saved"]["calls"] == SUSPEND_CALLS + RESUME_CALLS
    assert named["saved"]["suspend"].endswith("1 suspend(s), 1 resume(s), 0 suspended now")


def test_restore_and_unlock_come_before_the_save_is_handed_to_the_worker(kept):
    (put,) = kept["named"]["puts"]["puts"]  # the save's request: the only put after the spy
    assert put["call_idx"] == 2  # NVRx's index of the third save
    assert put["calls"] == SUSPEND_CALLS + RESUME_CALLS
    assert put["pid"] == kept["saves"][2]["worker"] and put["state"] not in ("T", None)


def test_a_worker_killed_while_suspended_fails_one_save_and_the_next_loads(kept):
    (call,) = kept["calls"]  # the save? step
    assert call["error"]["type"] == "CheckpointWorkerError"
    assert "died before the save, while idle (killed by SIGKILL)" in call["error"]["message"]
    assert call["raised_in"] == "finalize" and call["again"] is None
    killed = kept["saves"][2]["worker"]
    last = kept["saves"][3]
    assert last["stale"] == 0 and last["worker"] not in (None, killed)
    (line,) = kept["log"]
    assert line["level"] == "WARNING"
    assert f"worker (pid {killed}) died while suspended (killed by SIGKILL)" in line["message"]
    # the stand-in saw no call on the dead worker: its resume found it dead
    assert kept["named"]["killed"]["calls"] == (SUSPEND_CALLS + RESUME_CALLS) + SUSPEND_CALLS


# -- offloading(strategy="suspend"), and deactivate() while suspended ---------------------------

OFFLOADING = [
    "driver",
    "save",
    "save",
    "offloading-suspend",
    "seen#onloaded",
    "save",
    "seen#saved",
    "suspend",
    "deactivate",
    "worker#running",
    "seen#deactivated",
    "activate",
    "save",
]


@pytest.fixture(scope="module")
def offloading():
    return scenario(OFFLOADING, prelude=PRELUDE)


def test_offloading_suspends_resumes_at_the_exit_and_keeps_the_worker(offloading):
    assert offloading["hang"] is None, offloading["stderr"]
    assert stale(offloading) == [0, 0, 0, 0]
    release = offloading["releases"][0]
    assert release["strategy"] == "suspend" and release["worker_suspended"] is True
    kept = offloading["saves"][1]["worker"]
    (inside,) = offloading["measures"]
    assert inside["workers"] == 1  # kept through the block
    (after,) = offloading["prewarms"]
    assert after["pid"] == kept and after["exists"]
    onloaded = offloading["named"]["onloaded"]
    assert resume_started(onloaded)  # the block's exit started it, in the background
    assert onloaded["prewarms"] == 0  # no new worker
    third = offloading["saves"][2]
    assert third["worker_before"] == third["worker"] == kept
    assert offloading["named"]["saved"]["calls"] == SUSPEND_CALLS + RESUME_CALLS


def test_deactivate_resumes_a_suspended_worker_and_the_next_save_takes_it(offloading):
    kept = offloading["saves"][1]["worker"]
    assert offloading["releases"][1]["worker_suspended"] is True
    deactivated = offloading["named"]["deactivated"]
    assert deactivated["calls"] == (SUSPEND_CALLS + RESUME_CALLS) * 2
    assert deactivated["resuming"] == {}  # none suspended now
    assert offloading["named"]["running"]["pid"] == kept
    assert offloading["named"]["running"]["state"] not in ("T", None)  # not stopped
    last = offloading["saves"][3]
    assert last["stale"] == 0 and last["worker_before"] == last["worker"] == kept


# -- the hazard the suspend fix removes --------------------------------------------------------

# The fix stays installed (so release() does suspend), but its wrappers resume nothing.
NO_RESUME = """
    import nvrx_ipc_fix.fixes.suspend as _fix
    _fix._ready = lambda *args, **kwargs: None
"""


def test_without_the_resume_a_save_handed_to_the_suspended_worker_hangs():
    steps = ["driver", "save", "save", "suspend", "worker#frozen", "save"]
    report = scenario(steps, prelude=PRELUDE + NO_RESUME, timeout=4)
    assert report["releases"][0]["worker_suspended"] is True
    assert report["named"]["frozen"]["state"] == "T"
    assert report["hang"] is not None
    assert report["hang"]["step"] == 5 and report["hang"]["worker_died"] is False
    assert "schedule_async_request" in [f.split(":")[-1] for f in report["hang"]["waits_in"]]


def test_with_the_suspend_fix_disabled_the_release_restarts_instead():
    report = scenario(
        ["driver", "save", "save", "suspend", "seen#after", "save"],
        prelude=PRELUDE,
        env={"NVRX_IPC_FIX_DISABLE": "suspend"},
    )
    assert report["hang"] is None, report["stderr"]
    assert report["fix"]["suspend"] == "disabled"
    (release,) = report["releases"]
    assert release["strategy"] == "restart" and release["worker_suspended"] is False
    assert release["worker_terminated"] is True
    assert release["skipped"] == [
        "suspend: the suspend fix is not active (see nvrx_ipc_fix.status()); restart instead"
    ]
    assert report["named"]["after"]["calls"] == []  # the driver was never touched
    assert stale(report) == [0, 0, 0]
    assert report["saves"][2]["worker"] not in (None, report["saves"][1]["worker"])
    assert runtime_warnings(report) == []


def test_status_says_restart_while_the_suspend_fix_is_disabled():
    """status().suspend is "the automatic release's strategy in force and why": with the fix
    disabled, suspend is never used (release() says so), so it must not say suspend."""
    report = scenario(
        ["driver", "save", "suspend", "seen#after"],
        prelude=PRELUDE,
        env={"NVRX_IPC_FIX_DISABLE": "suspend"},
    )
    assert report["releases"][0]["strategy"] == "restart"
    said = report["named"]["after"]["suspend"]
    assert said.startswith("restart"), said


# -- driver faults: the worker ends, one RuntimeWarning, the next save loads, restart after ---

FAULT_STEPS = ["save", "save", "suspend", "seen#suspended", "save", "seen#saved", "suspend", "save"]
#: fault -> the stand-in's calls after the first suspend, after the save that follows it;
#: whether that suspend failed (else its resume did); how the worker was ended. A lock past
#: its deadline may still lock the worker later: it is killed, never closed.
FAULTS = {
    "lock-busy": (["state", "lock", "state", "state"], None, True, "closed"),
    "lock-hangs": (["state", "lock"], None, True, "killed"),
    "checkpoint-fails": (SUSPEND_CALLS + ["state", "unlock", "state"], None, True, "closed"),
    "restore-fails": (SUSPEND_CALLS, SUSPEND_CALLS + ["restore"], False, "killed"),
    "unlock-fails": (SUSPEND_CALLS, SUSPEND_CALLS + RESUME_CALLS, False, "killed"),
}


@pytest.mark.parametrize("fault", list(FAULTS))
def test_a_driver_fault_ends_the_worker_warns_once_and_the_next_saves_load(fault):
    after_suspend, after_save, suspend_fails, how = FAULTS[fault]
    report = scenario([f"driver-{fault}", *FAULT_STEPS], prelude=PRELUDE, env=FAST)
    assert report["hang"] is None, report["stderr"]
    assert stale(report) == [0, 0, 0, 0]
    first, second = report["releases"]
    old = report["saves"][1]["worker"]
    named = report["named"]
    assert named["suspended"]["calls"] == after_suspend
    assert named["saved"]["calls"] == (after_save or after_suspend)
    if suspend_fails:
        assert first["strategy"] == "suspend" and first["error"]
        assert f"the suspend of the checkpoint worker (pid {old}) failed" in first["error"]
        assert first["worker_terminated"] is True
        assert first["worker_suspended"] is False and first["worker_kept"] is False
        assert first["seconds"] < 9  # the release timeout (2 s), not the lock's 10 s
        what = "suspend"
    else:  # suspended; its resume, before the next save, failed: the worker was killed
        assert first["worker_suspended"] is True and first["error"] is None
        what = "resume"
    third = report["saves"][2]
    assert third["worker"] not in (None, old)  # a fresh worker took the save
    why = f"the {what} of the checkpoint worker (pid {old}) failed"
    assert named["saved"]["suspend"].startswith(f"restart: suspend is not used here ({why}")
    (warning,) = runtime_warnings(report)
    assert why in warning and f"the worker was {how}" in warning
    assert any(why in line["message"] and line["level"] == "WARNING" for line in report["log"])
    # from then on: restart
    assert second["strategy"] == "restart" and second["error"] is None
    (skipped,) = second["skipped"]
    assert skipped.startswith(f"suspend: {why} (")
    assert skipped.endswith(f"; the worker was {how}; restart instead")
    assert report["saves"][3]["worker"] not in (None, third["worker"])


def test_a_driver_without_the_api_falls_back_to_restart():
    report = scenario(
        ["driver-absent", "save", "save", "suspend", "seen#after", "save"], prelude=PRELUDE
    )
    assert report["hang"] is None, report["stderr"]
    (release,) = report["releases"]
    assert release["strategy"] == "restart" and release["worker_terminated"] is True
    assert release["skipped"] == [
        "suspend: this CUDA driver has no process checkpoint API (stand-in); restart instead"
    ]
    assert report["named"]["after"]["calls"] == []
    assert stale(report) == [0, 0, 0]
    assert report["saves"][2]["worker"] not in (None, report["saves"][1]["worker"])
    (warning,) = runtime_warnings(report)
    assert (
        "the release uses restart instead of suspend: this CUDA driver has no process "
        "checkpoint API" in warning
    )


# -- the automatic release at NeMo RL's offload and onload points ------------------------------


def test_nemo_rl_s_offload_suspends_and_the_onload_resumes_the_same_worker():
    steps = [
        "driver",
        "save",
        "save",
        "offload_before_refit",
        "worker#frozen",
        "seen#offloaded",
        "prepare_for_training",
        "seen#onloaded",
        "save",
        "seen#saved",
    ]
    report = scenario(steps, prelude=PRELUDE + NEMO)
    assert report["hang"] is None, report["stderr"]
    assert stale(report) == [0, 0, 0]
    kept = report["saves"][1]["worker"]
    named = report["named"]
    assert named["frozen"] == {"pid": kept, "state": "T"}
    assert named["offloaded"]["calls"] == SUSPEND_CALLS
    assert named["offloaded"]["suspend"].startswith("suspend: ")
    assert named["offloaded"]["suspend"].endswith("1 suspend(s), 0 resume(s), 1 suspended now")
    assert resume_started(named["onloaded"])  # prepare_for_training started it
    last = report["saves"][2]
    assert last["worker_before"] == last["worker"] == kept
    assert named["saved"]["calls"] == SUSPEND_CALLS + RESUME_CALLS
    assert named["saved"]["suspend"].endswith("1 suspend(s), 1 resume(s), 0 suspended now")
    assert report["releases_total"] == 1
    assert report["prewarms_total"] == 0 == named["saved"]["prewarms"]  # no worker started
    assert runtime_warnings(report) == [] and report["log"] == []


@pytest.mark.skipif(GPU, reason="CUDA is initialized on a GPU: the real driver is probed")
def test_without_cuda_the_automatic_release_restarts_silently():
    """No stand-in, no CUDA initialized: suspend is not used, with no RuntimeWarning; the
    offload leaves no worker, the onload starts the next."""
    steps = [
        "save",
        "save",
        "offload_before_refit",
        "measure",
        "seen#offloaded",
        "prepare_for_training",
        "ready",
        "save",
        "suspend",
        "save",
    ]
    report = scenario(steps, prelude=PRELUDE + NEMO)
    assert report["hang"] is None, report["stderr"]
    assert stale(report) == [0, 0, 0, 0]
    assert [m["workers"] for m in report["measures"]] == [0]
    assert report["named"]["offloaded"]["suspend"].startswith(
        f"restart: suspend is not used here ({NO_CUDA}"
    )
    (ready,) = report["ready"]
    after = report["saves"][2]
    assert after["worker_before"] == after["worker"] == ready["pid"] is not None
    assert report["prewarms_total"] == 1
    (release,) = report["releases"]
    assert release["strategy"] == "restart"
    assert release["skipped"][0].startswith(f"suspend: {NO_CUDA}")
    assert runtime_warnings(report) == []


# -- edges --------------------------------------------------------------------------------------

EDGES = """
    import json
    import nvrx_ipc_fix
    from nvrx_ipc_fix.core import config
    found = {"upper": nvrx_ipc_fix.release(strategy="SUSPEND").strategy}
    try:
        nvrx_ipc_fix.release(strategy="suspended")
    except ValueError as exc:
        found["error"] = str(exc)
    found["auto"], found["default"] = config.auto_strategy(), config.strategy()
    print(json.dumps(found))
"""


@pytest.mark.parametrize("env", [{}, {"NVRX_IPC_FIX_STRATEGY": "suspend"}])
def test_strategy_names(env):
    rc, out, err = run_process([sys.executable, "-c", EDGES], env=env)
    assert rc == 0, err
    found = json.loads(out.strip().splitlines()[-1])
    assert found["upper"] == "suspend"
    assert found["error"] == (
        "strategy must be one of flush, terminate, restart, suspend, not 'suspended'"
    )
    assert found["auto"] == "suspend"
    assert found["default"] == ("suspend" if env else "flush")
    assert "NVRX_IPC_FIX_STRATEGY" not in err


def test_exit_with_a_worker_still_suspended_does_not_hang():
    """No close: the exit handler resumes the worker before multiprocessing's stops it."""
    code = """
        import json, tempfile
        import nvrx_ipc_fix
        from harness import fakedriver, scenario
        trainer = scenario.Trainer(tempfile.mkdtemp(), 4, 256, starts="forkserver")
        trainer.driver = fakedriver.install()
        trainer.save()
        trainer.save()
        report = nvrx_ipc_fix.release(trainer.queue, strategy="suspend")
        pid = trainer.worker().pid
        with open(f"/proc/{pid}/stat") as stat:
            state = stat.read().rsplit(")", 1)[1].split()[0]
        print(json.dumps({"suspended": report.worker_suspended, "pid": pid, "state": state}))
    """
    rc, out, err = run_code(code, timeout=180)  # a hung exit never ends: the backstop fails
    assert rc == 0, err
    found = json.loads(out.strip().splitlines()[-1])
    assert found["suspended"] is True and found["state"] == "T"
    deadline = time.monotonic() + 60  # until it is gone (at once, unloaded)
    while os.path.exists(f"/proc/{found['pid']}") and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not os.path.exists(f"/proc/{found['pid']}")  # the worker is gone, not left stopped


# The resume cannot start a thread (the package's own defect, or a process out of threads).
NO_THREADS = """
    import threading, types
    import nvrx_ipc_fix.worker.suspend as _suspend

    class _Unstartable(threading.Thread):
        def start(self):
            raise RuntimeError("can't start new thread")

    _suspend.threading = types.SimpleNamespace(Thread=_Unstartable, Lock=threading.Lock,
                                               Event=threading.Event)
"""


def test_a_resume_that_cannot_run_ends_the_worker_and_the_save_loads():
    """Not a hang: the suspended worker is killed, one RuntimeWarning, a fresh worker takes
    the save, and the release uses restart from then on."""
    steps = ["driver", "save", "save", "suspend", "save", "suspend", "save"]
    report = scenario(steps, prelude=PRELUDE + NO_THREADS)
    assert report["hang"] is None, report["stderr"]
    assert stale(report) == [0, 0, 0, 0]
    old = report["saves"][1]["worker"]
    assert report["releases"][0]["worker_suspended"] is True
    assert report["saves"][2]["worker"] not in (None, old)
    (warning,) = runtime_warnings(report)
    assert (
        f"the resume of the checkpoint worker (pid {old}) could not run (RuntimeError: "
        "can't start new thread)"
        in warning
        and "the worker was killed" in warning
    )
    assert report["releases"][1]["strategy"] == "restart"


def test_two_ranks_each_suspend_their_own_worker_and_a_kill_on_one_is_one_error_each(tmp_path):
    """gloo on CPU: no collective is added; rank 1's worker is killed while suspended, the
    save after it raises one error on every rank (the finalize's all-reduce), and the next
    save loads on both."""
    steps = "driver,save,save,suspend,save,suspend,kill-worker@1,save?,save,suspend,resumed"
    reports = scenario_ranks(steps, tmp_path)
    for report in reports:
        assert report["hang"] is None, report["stderr"]
        releases = report["releases"]
        assert [r["worker_suspended"] for r in releases] == [True, True, True], releases
        (call,) = report["calls"]
        assert call["error"]["type"] == "CheckpointWorkerError", (report["rank"], call)
        saves = report["saves"]
        assert [s["stale"] for s in saves] == [0, 0, 0, 0]
        assert saves[2]["worker"] == saves[1]["worker"]  # kept through the first suspend
    killed = [r["saves"][3]["worker"] != r["saves"][2]["worker"] for r in reports]
    assert killed == [False, True]  # only rank 1 needed a fresh worker
    pids = [{s["worker"] for s in r["saves"]} for r in reports]
    assert not pids[0] & pids[1]  # each rank its own worker


def test_no_deadline_release_timeout_inf_suspends_and_resumes():
    """NVRX_IPC_FIX_RELEASE_TIMEOUT=inf: the driver calls wait as long as they take."""
    report = scenario(
        ["driver", "save", "save", "suspend", "save"], env={"NVRX_IPC_FIX_RELEASE_TIMEOUT": "inf"}
    )
    assert report["hang"] is None, report["stderr"]
    (release,) = report["releases"]
    assert release["worker_suspended"] is True and release["error"] is None, release
    assert stale(report) == [0, 0, 0]
    assert report["saves"][2]["worker"] == report["saves"][1]["worker"]


# Ctrl-C while the driver checkpoints the worker (the stand-in's call raises it, as the
# interrupted wait for it would).
INTERRUPTED = """
    import json, tempfile
    import nvrx_ipc_fix
    from nvrx_ipc_fix.worker import cuda_checkpoint, suspend
    from harness import fakedriver, scenario

    trainer = scenario.Trainer(tempfile.mkdtemp(), 4, 256, starts="forkserver")
    stand_in = fakedriver.install()
    trainer.save()
    trainer.save()
    old = trainer.worker().pid

    def interrupted(pid, args):
        raise KeyboardInterrupt

    def load(in_use=True):
        driver, why = stand_in.load()
        driver._api["cuCheckpointProcessCheckpoint"] = interrupted
        return driver, why

    cuda_checkpoint.load = load
"""


def test_a_suspend_interrupted_in_the_driver_ends_the_worker_and_the_next_save_loads():
    code = (
        INTERRUPTED
        + """
    try:
        nvrx_ipc_fix.release(trainer.queue, strategy="suspend")
        raised = None
    except KeyboardInterrupt:
        raised = "KeyboardInterrupt"
    path, version = trainer.save()[2:]
    print(json.dumps({"raised": raised, "old": old, "new": trainer.worker().pid,
                      "stale": trainer.stale_tensors(path, version),
                      "status": nvrx_ipc_fix.status().suspend}))
    """
    )
    rc, out, err = run_code(code, timeout=60)
    assert rc == 0, err
    found = json.loads(out.strip().splitlines()[-1])
    assert found["raised"] == "KeyboardInterrupt"  # the user's interrupt reaches the user
    assert found["new"] not in (None, found["old"]) and found["stale"] == 0
    assert found["status"].startswith("suspend: ")  # an interrupt is no defect: suspend stays
    assert "RuntimeWarning" not in err


def test_with_the_suspend_fix_disabled_nemo_rl_s_onload_starts_the_next_worker_as_restart():
    """The automatic release falls back to restart whole: its onload prewarms the next worker,
    and the save takes it."""
    steps = [
        "driver",
        "save",
        "save",
        "offload_before_refit",
        "measure",
        "prepare_for_training",
        "ready",
        "save",
    ]
    report = scenario(steps, prelude=PRELUDE + NEMO, env={"NVRX_IPC_FIX_DISABLE": "suspend"})
    assert report["hang"] is None, report["stderr"]
    assert [m["workers"] for m in report["measures"]] == [0]
    (ready,) = report["ready"]
    after = report["saves"][2]
    assert ready["pid"] is not None and after["worker_before"] == after["worker"] == ready["pid"]
    assert report["prewarms_total"] == 1
    assert stale(report) == [0, 0, 0]


def test_an_nvrx_error_in_the_close_after_a_failed_suspend_reaches_the_offload_s_caller():
    """A failed suspend (the checkpoint fails) closes the worker; NVRx's close raises once."""
    steps = [
        "driver-checkpoint-fails",
        "save",
        "save",
        "offload_before_refit?",
        "prepare_for_training",
        "save",
    ]
    report = scenario(steps, prelude=CLOSE_RAISES + PRELUDE + NEMO, env=FAST)
    assert report["hang"] is None, report["stderr"]
    (call,) = report["calls"]
    assert call["error"] is not None, report["stderr"]  # not the package's defect: raised
    assert call["error"]["type"] == "RuntimeError", call
    assert call["error"]["message"].startswith("NVRx's close failed"), call
    assert call["moved"] == 2  # the offload's own work was done
    assert "hook on" not in report["stderr"]
    assert stale(report) == [0, 0, 0]
