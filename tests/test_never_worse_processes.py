"""Part of the never-worse matrix: the package's own processes and NVRx's results-queue
manager, each scenario run on the real NVRx worker twice, with the package and with
``NVRX_IPC_FIX_DISABLE=1``. With the package nothing hangs that did not without it, no error
is raised on a correct job, no save that NVRx alone saved is lost, and the save after the
fault loads.

* **A guardian that cannot start.** Its interpreter is ``multiprocessing``'s
  (``set_executable``, after the harness's forkserver is up: NVRx's own processes come from
  there), here a script that exits at once with a reason on its stderr, or a path with no
  program: nothing of the package's is changed for the test. It is started once; one
  ``RuntimeWarning`` and ``status()`` give the reason, and every save loads, as without the
  package. Before, a new guardian was started at every save, the reason never said.
* **A guardian killed in the middle of its walk.** The trainer is SIGKILLed with its worker
  inside a write, below it a chain of 300 shells (300 rounds of stops to walk); as soon as
  the guardian has stopped the worker, it is stopped too, seen in the middle of its walk
  (part of the chain still runs), and SIGKILLed. Nothing is left stopped (without
  the package the worker and its tree go on running), and nothing is left at all. Before,
  the processes the guardian had stopped stayed stopped.
* **NVRx's results-queue manager SIGKILLed between saves** (the OOM killer). Every save after
  it loads. Without the package the next save hangs (NVRx 0.5.0-0.7.0: the worker dies
  unpickling a queue of the dead manager); before, every later save failed.
"""

import os
import signal
import sys
import time

import pytest

from conftest import NVRX, needs_nvrx, run_python, scenario
from nvrx_ipc_fix.worker.guardian_process import stat_fields
from test_orphans import Trainer, session

pytestmark = [needs_nvrx, pytest.mark.worker]

REFUSES = "this Python cannot run the guardian here (test)"
CANNOT_START = """
    import json, multiprocessing, tempfile, warnings
    caught = []
    warnings.simplefilter("always")
    warnings.showwarning = lambda message, category, *_: caught.append(str(message)) if (
        category is RuntimeWarning and "nvrx_ipc_fix" in str(message)) else None
    import nvrx_ipc_fix
    from harness import scenario

    trainer = scenario.Trainer(tempfile.mkdtemp(), n_tensors=4, numel=256, starts="forkserver")
    multiprocessing.set_executable({executable!r})  # what the guardian is started with
    out = []
    for _ in range(4):
        _, _, path, version = trainer.save()
        out.append(trainer.stale_tensors(path, version))
    trainer.close()
    print(json.dumps({{"out": out, "warnings": caught,
                      "guardian": nvrx_ipc_fix.status().guardian}}))
"""


def _interpreter(directory, how):
    """The interpreter the guardian gets: a script that refuses the guardian's program
    (each start noted in ``starts``) and runs anything else with this Python; or none."""
    if how == "cannot-exec":
        return os.path.join(directory, "no-such-python")
    path = os.path.join(directory, "python")
    with open(path, "w") as script:
        script.write(f"""#!/bin/sh
case "$*" in
  *guardian_process.py*) echo start >> {directory}/starts; echo "{REFUSES}" >&2; exit 3;;
esac
exec {sys.executable} "$@"
""")
    os.chmod(path, 0o755)
    return path


def _starts(directory):
    try:
        with open(os.path.join(directory, "starts")) as starts:
            return len(starts.read().split())
    except FileNotFoundError:
        return 0


@pytest.mark.parametrize("fix", [False, True], ids=["without", "with"])
@pytest.mark.parametrize("how", ["exits", "cannot-exec"])
def test_a_guardian_that_cannot_start_is_started_once_and_said_once(tmp_path, how, fix):
    report = run_python(
        CANNOT_START.format(executable=_interpreter(str(tmp_path), how)), fix=fix, timeout=300
    )
    assert report["out"] == [0] * 4, report  # every save loads, both ways
    if not fix:
        assert report["warnings"] == [] and _starts(str(tmp_path)) == 0, report
        return
    reason = REFUSES if how == "exits" else "FileNotFoundError"
    assert len(report["warnings"]) == 1, report
    assert "guardian could not run" in report["warnings"][0], report
    assert reason in report["warnings"][0], report
    assert report["guardian"].startswith("cannot run:") and reason in report["guardian"], report
    if how == "exits":
        assert _starts(str(tmp_path)) == 1, report
        assert "exit status 3 before it watched" in report["guardian"], report


#: The first save's checkpoint, as the driver loads it back: ``loaded.json``.
LOADS = """
    _loaded, _stale = [], _s.Trainer.stale_tensors

    def _noted(self, path, version):
        found = _stale(self, path, version)
        _loaded.append([version, found])
        _write("loaded.json", _loaded)
        return found

    _s.Trainer.stale_tensors = _noted
"""


def _halted_or_gone(pid):
    try:
        return stat_fields(pid)[0] in (b"T", b"t", b"Z", b"X")
    except (OSError, IndexError):
        return True


def _stopped(pids):
    """Of ``pids``, those stopped by a signal."""
    found = []
    for pid in pids:
        try:
            if stat_fields(pid)[0] == b"T":
                found.append(pid)
        except (OSError, IndexError):
            continue
    return found


@pytest.mark.parametrize("fix", [False, True], ids=["without", "with"])
def test_a_guardian_killed_in_the_middle_of_its_walk_leaves_nothing_stopped(tmp_path, fix):
    one = Trainer(
        ["save", "fault-hold-tree-async", "writing", "hold"], str(tmp_path), fix=fix, prelude=LOADS
    )
    try:
        state = one.reached()
        assert one.reached("loaded.json") == [[1, 0]], state  # the save before loads
        tree = [pid for pid in session(one.pid) if pid != one.pid]
        assert len(tree) > 200, state
        one.kill()
        if fix:
            guardian = int(state["guardian"].split("pid ", 1)[1].split(")")[0])
            deadline = time.monotonic() + 60  # the walk has begun: the worker is stopped
            while not _halted_or_gone(state["worker"]):
                assert time.monotonic() < deadline, "the guardian never stopped the worker"
            os.kill(guardian, signal.SIGSTOP)  # held where it is, then read
            while not _halted_or_gone(guardian):
                assert time.monotonic() < deadline, "the guardian never stopped"
            running = [pid for pid in tree if not _halted_or_gone(pid)]
            assert running, "the guardian's walk was over: it was not killed in its middle"
            os.kill(guardian, signal.SIGKILL)
        # with the package: until nothing of the session is left (bounded); without it
        # nothing ends the tree, and what is there 10 s later stays
        left = one.left() if fix else one.left(bound=10)
        if fix:
            assert left == {}, f"{len(left)} left, {len(_stopped(left))} of them stopped"
        else:
            assert state["worker"] in left, (state, left)
        assert _stopped(left) == [], left
    finally:
        one.clean()


@pytest.mark.parametrize("fix", [False, True], ids=["without", "with"])
def test_the_results_manager_killed_between_saves(fix):
    report = scenario(["save", "kill-manager", "save?", "save?", "save?"], fix=fix, timeout=60)
    saved = [save["stale"] for save in report["saves"]]
    if not fix:  # NVRx alone: the save before it, then a hang (0.5.0-0.7.0)
        assert saved[0] == 0, report
        if NVRX != "0.4.1":
            assert report["hang"] is not None and report["hang"]["step"] == 2, report
        return
    assert report["hang"] is None, report
    assert [call["error"] for call in report["calls"]] == [None] * 3, report["calls"]
    assert saved == [0] * 4, report
    assert any(
        "results-queue manager" in line["message"] and "died" in line["message"]
        for line in report["log"]
    ), report["log"]
