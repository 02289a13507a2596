"""A fix that stops applying says so: on a copy of the installed NVRx that claims a newer
version, or whose code moved on (a method renamed, as a future NVRx might), the package
warns once, shows it in ``status()`` and ``doctor``, installs no half of a fix, and the
fixes whose checks pass still work on the real worker.

Each copy is the installed ``nvidia_resiliency_ext`` package and its dist-info, first on the
child's ``PYTHONPATH``.
"""

import os
import shutil
import sys
from importlib import metadata
from importlib.util import find_spec
from pathlib import Path

import pytest

from conftest import last_json, needs_cache, run_process, run_python, scenario, scenario_ranks

pytestmark = needs_cache

CORE = "nvidia_resiliency_ext.checkpointing.async_ckpt.core"
DONE = "PersistentAsyncCaller.is_current_async_call_done"
SYNC = "AsyncCaller.sync_all_async_calls"
WATCHED = (
    "AsyncCallsQueue.schedule_async_request",
    "AsyncCallsQueue.maybe_finalize_async_calls",
    DONE,
    SYNC,
    "PersistentAsyncCaller.close",
    "PersistentAsyncCaller.async_process_target",
)


def nvrx_copy(root, version=None, rename=False, replace=None):
    """A copy of the installed NVRx under ``root``; ``version``: what its metadata says;
    ``rename``: ``is_current_async_call_done`` is ``is_current_async_call_finished``
    everywhere (its definitions and every call), so that NVRx itself still works;
    ``replace``: ``(old, new)``, a text of its ``core.py`` (found once) changed."""
    package = Path(find_spec("nvidia_resiliency_ext").submodule_search_locations[0])
    info = (
        next(
            f for f in metadata.distribution("nvidia-resiliency-ext").files if f.name == "METADATA"
        )
        .locate()
        .parent
    )
    shutil.copytree(package, root / package.name)  # with its byte code: it stays valid
    shutil.copytree(info, root / info.name)
    if version:
        meta = root / info.name / "METADATA"
        meta.write_text(
            "".join(
                f"Version: {version}\n" if line.startswith("Version:") else line
                for line in meta.read_text().splitlines(keepends=True)
            )
        )
    if rename:
        for path in (root / package.name).rglob("*.py"):
            text = path.read_text()
            if "is_current_async_call_done" in text:
                path.write_text(
                    text.replace("is_current_async_call_done", "is_current_async_call_finished")
                )
    if replace:
        core = root / package.name / "checkpointing" / "async_ckpt" / "core.py"
        text = core.read_text()
        assert text.count(replace[0]) == 1, replace[0]
        core.write_text(text.replace(*replace))
    return {
        "PYTHONPATH": os.pathsep.join(p for p in (str(root), os.environ.get("PYTHONPATH")) if p)
    }


@pytest.fixture(scope="module")
def newer(tmp_path_factory):
    return nvrx_copy(tmp_path_factory.mktemp("nvrx-newer"), version="0.9.0")


@pytest.fixture(scope="module")
def renamed(tmp_path_factory):
    return nvrx_copy(tmp_path_factory.mktemp("nvrx-renamed"), rename=True)


#: NVRx's finalize collective (``sync_all_async_calls``) in another shape than the one the
#: watch's failure flag rides on: the maximum over ranks, not the sum.
SUM = "torch.distributed.all_reduce(ten)\n        return ten[0] == 0"
MAX = (
    "torch.distributed.all_reduce(ten, op=torch.distributed.ReduceOp.MAX)\n"
    "        return ten[0] == 0"
)


@pytest.fixture(scope="module")
def other_collective(tmp_path_factory):
    return nvrx_copy(tmp_path_factory.mktemp("nvrx-max"), replace=(SUM, MAX))


# What a user's `python -c` does, then what status() and doctor say in that process.
CHILD = f"""\
import json, sys
import nvrx_ipc_fix
import {CORE}
from nvidia_resiliency_ext.checkpointing.async_ckpt import filesystem_async
from nvrx_ipc_fix.cli import doctor
from nvrx_ipc_fix.core import lifecycle
core = sys.modules["{CORE}"]

from harness.wrapping import chain

def steps(cls, name):  # the steps in our one wrapper of it
    return chain(cls, name)["steps"]

lines = []
doctor.run(out=lines.append)
status = nvrx_ipc_fix.status()
print(json.dumps({{
    "status": status.to_dict(), "doctor": lines,
    "watch_installed": [a for a in {WATCHED!r} if lifecycle.installed("worker_watch", a)],
    "steps": {{a: steps(getattr(core, a.split(".")[0]), a.split(".")[1])
              for a in {WATCHED!r} if a != "{DONE}"}}}}))
"""
IMPORT_LINE = 3  # CHILD's line that imports NVRx: where the warnings must point


def child(env, flags=()):
    rc, out, err = run_process([sys.executable, *flags, "-c", CHILD], env=env)
    assert rc == 0, f"exit {rc}\n{out[-3000:]}\n{err[-3000:]}"
    return last_json(out), err


def fixes(seen):
    return {f["name"]: (f["state"], f["reason"]) for f in seen["status"]["fixes"]}


def test_a_newer_nvrx_is_untested_once_and_in_status_and_doctor(newer):
    seen, err = child(newer)
    nvrx = metadata.version("nvidia-resiliency-ext")
    warning = (
        f"<string>:{IMPORT_LINE}: RuntimeWarning: nvrx_ipc_fix: nvidia-resiliency-ext "
        f"0.9.0 is untested"
    )
    assert err.count(warning) == 1 and err.count("is untested") == 1, err
    assert "newest tested: 0.7.0" in err and "python -m nvrx_ipc_fix" in err, err
    assert "active so far: worker_watch, clear_on_close, cpu_snapshot, prewarm" in err, err
    assert seen["status"]["nvrx_version"] == "0.9.0"
    assert seen["status"]["untested"] == {"nvidia-resiliency-ext": "0.9.0"}
    # the fixes still apply where their checks pass: as on the NVRx copied
    assert fixes(seen)["worker_watch"][0] == fixes(seen)["clear_on_close"][0] == "active"
    assert seen["watch_installed"] == list(WATCHED)
    assert seen["steps"] == {
        "AsyncCallsQueue.schedule_async_request": [
            "suspend",
            "prewarm",
            "cpu_snapshot",
            "worker_watch",
        ],
        "AsyncCallsQueue.maybe_finalize_async_calls": ["worker_watch"],
        SYNC: ["worker_watch"],
        "PersistentAsyncCaller.close": [
            "suspend",
            "clear_on_close",
            "cpu_snapshot",
            "worker_watch",
        ],
        "PersistentAsyncCaller.async_process_target": ["worker_watch"],
    }, seen["steps"]
    assert fixes(seen)["stale_guard"][0] == ("fixed_upstream" if nvrx == "0.7.0" else "active")
    nvrx_lines = [line for line in seen["doctor"] if line[6:].startswith("NVRx: ")]
    assert len(nvrx_lines) == 1 and nvrx_lines[0].startswith("warn  NVRx: 0.9.0: untested"), seen[
        "doctor"
    ]
    assert "has the IPC tensor cache" not in nvrx_lines[0]


@pytest.mark.worker
def test_a_newer_nvrx_still_saves_and_loads(newer):
    report = scenario(["save", "close", "save"], env=newer)
    assert report["nvrx"] == "0.9.0" and "0.9.0 is untested" in report["stderr"]
    assert report["hang"] is None and not report["cache_miss"], report["stderr"]
    assert [s["stale"] for s in report["saves"]] == [0, 0]
    assert report["fix"]["clear_on_close"] == "active"


def test_a_renamed_method_drops_the_whole_watch_and_says_so(renamed):
    seen, err = child(renamed)
    warning = f"<string>:{IMPORT_LINE}: RuntimeWarning: nvrx_ipc_fix: worker_watch"
    assert err.count(warning) == 1 and err.count("RuntimeWarning: nvrx_ipc_fix") == 1, err
    assert f"{CORE}:{DONE}" in err or DONE in err, err
    state, reason = fixes(seen)["worker_watch"]
    assert state == "unsupported" and DONE in reason and "not found" in reason, reason
    targets = {
        t["target"]: t["state"] for t in seen["status"]["targets"] if t["fix"] == "worker_watch"
    }
    assert {targets[f"{CORE}:{a}"] for a in WATCHED} == {"unsupported"}, targets
    assert seen["watch_installed"] == []
    # only the other fixes' wrappers: clear_on_close's and suspend's close, prewarm's and
    # suspend's schedule
    assert seen["steps"] == {
        "AsyncCallsQueue.schedule_async_request": ["suspend", "prewarm", "cpu_snapshot"],
        "AsyncCallsQueue.maybe_finalize_async_calls": [],
        SYNC: [],
        "PersistentAsyncCaller.close": ["suspend", "clear_on_close", "cpu_snapshot"],
        "PersistentAsyncCaller.async_process_target": [],
    }, seen["steps"]
    assert fixes(seen)["clear_on_close"][0] == fixes(seen)["prewarm"][0] == "active"
    assert any(
        line.startswith("warn  fix worker_watch: unsupported: ") and DONE in line
        for line in seen["doctor"]
    ), seen["doctor"]


@pytest.mark.worker
def test_a_renamed_method_leaves_the_other_fixes_working(renamed):
    """Without the watch, clear_on_close still prevents the cache-miss hang after a close."""
    report = scenario(["save", "close", "save"], env=renamed)
    assert report["hang"] is None and not report["cache_miss"], report["stderr"]
    assert [s["stale"] for s in report["saves"]] == [0, 0]
    assert report["fix"]["worker_watch"] == "unsupported"
    assert report["fix"]["clear_on_close"] == "active"


def test_a_lost_optional_target_keeps_the_rest_of_the_fix():
    """``async_process_target`` only forwards the worker's traceback: without it the rest of
    the watch is installed, and the fix says what it lost."""
    seen = run_python(f"""
        import json, os, warnings
        os.environ["NVRX_IPC_FIX_DISABLE"] = "1"
        import nvrx_ipc_fix
        from nvrx_ipc_fix.core import lifecycle
        from nvidia_resiliency_ext.checkpointing.async_ckpt import core
        core.PersistentAsyncCaller.async_process_target = staticmethod(lambda rank: None)
        os.environ["NVRX_IPC_FIX_DISABLE"] = ""
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            nvrx_ipc_fix.activate()
        fix = nvrx_ipc_fix.status().fix("worker_watch")
        print(json.dumps({{"state": str(fix.state), "reason": fix.reason,
                          "warnings": [str(w.message) for w in caught],
                          "installed": [a for a in {WATCHED!r}
                                        if lifecycle.installed("worker_watch", a)]}}))
    """)
    assert seen["installed"] == list(WATCHED[:5]), seen
    assert seen["state"] == "unsupported", seen
    assert "async_process_target" in seen["reason"] and "still active" in seen["reason"], seen
    assert len(seen["warnings"]) == 1 and "async_process_target" in seen["warnings"][0], seen


def test_warnings_made_errors_break_nothing(renamed):
    """``-W error::RuntimeWarning``: the warning of a post-import hook and of a wrapper's
    failure is written to stderr instead of raised; NVRx's import and call go on, and the
    fixes that apply are installed."""
    code = CHILD.replace(
        "lines = []",
        """
from nvrx_ipc_fix.fixes import clear_on_close
def boom(*a, **k):
    raise RuntimeError("boom")
clear_on_close.clear_trainer_caches = boom
class Proc:  # a worker handle that is already gone
    def join(self, timeout=None): pass
    def is_alive(self): return False
caller = core.PersistentAsyncCaller()
caller.process = Proc()
caller.queue.put = lambda item: None
caller.queue.join = lambda: None
caller.close()  # the wrapper's hook fails; the close goes on
assert caller.process is None
lines = []""",
    )
    rc, out, err = run_process(
        [sys.executable, "-W", "error::RuntimeWarning", "-c", code], env=renamed
    )
    assert rc == 0, err[-3000:]
    seen = last_json(out)
    assert "Traceback" not in err, err
    assert err.count("nvrx_ipc_fix: worker_watch") == 1, err
    assert err.count("boom") == 1, err
    assert fixes(seen)["worker_watch"][0] == "unsupported"
    assert fixes(seen)["clear_on_close"][0] == "error"  # its hook failed; its wrapper stays
    assert seen["steps"]["PersistentAsyncCaller.close"] == [
        "suspend",
        "clear_on_close",
        "cpu_snapshot",
    ]
    assert seen["watch_installed"] == []


def test_a_changed_collective_drops_the_whole_watch_and_says_so(other_collective):
    """The watch's failure flag rides on NVRx's finalize all-reduce: where that has another
    shape, the probe turns the watch off (not a flag that the ranks would read apart)."""
    seen, err = child(other_collective)
    assert err.count("RuntimeWarning: nvrx_ipc_fix: worker_watch") == 1, err
    state, reason = fixes(seen)["worker_watch"]
    assert state == "unsupported" and "sync_all_async_calls" in reason, reason
    assert seen["watch_installed"] == []
    assert fixes(seen)["clear_on_close"][0] == "active"


@pytest.mark.worker
def test_a_changed_collective_is_seen_alike_on_every_rank_which_still_save(
    other_collective, tmp_path
):
    reports = scenario_ranks("save,save", tmp_path, env=other_collective)
    for report in reports:
        assert report["hang"] is None, report["stderr"]
        assert report["fix"]["worker_watch"] == "unsupported", report["fix"]
        assert "sync_all_async_calls" in report["stderr"], report["stderr"]
        assert [s["stale"] for s in report["saves"]] == [0, 0]
