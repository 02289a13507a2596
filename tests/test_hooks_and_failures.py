"""The standard-library post-import hook, import cost, and the never-break-the-user rules.

Hook tests use a throw-away module on ``sys.path``; failure tests break our own hook code
(never NVRx) and check that the user's call still does what NVRx does.
"""

import json
import sys

import pytest

from conftest import expect, needs_cache, needs_nvrx, run_process, run_python, scenario


def test_import_imports_neither_torch_nor_nvrx_nor_wrapt(tmp_path):
    heavy = [
        "torch",
        "nvidia_resiliency_ext",
        "wrapt",
        "logging",
        "inspect",
        "dataclasses",
        "megatron",
    ]
    loaded = run_python(
        f"""
        import sys, json, nvrx_ipc_fix
        print(json.dumps([m for m in {heavy!r} if m in sys.modules]))
    """,
        fresh=True,
    )  # what a fresh interpreter imports: not a child of the zygote
    assert loaded == []


def test_hook_runs_after_import_restores_loader_and_survives_a_failing_hook(tmp_path):
    (tmp_path / "hooked_mod.py").write_text("VALUE = 41\n")
    result = run_python(f"""
        import json, sys
        sys.path.insert(0, {str(tmp_path)!r})
        from nvrx_ipc_fix.core import hooks as _hooks
        calls = []
        _hooks.when_imported("hooked_mod", lambda m: calls.append(m.VALUE + 1))
        _hooks.when_imported("hooked_mod", lambda m: 1 / 0)  # must not break the import
        import hooked_mod
        late = []
        _hooks.when_imported("hooked_mod", lambda m: late.append(m.VALUE))  # already imported
        print(json.dumps({{"calls": calls, "late": late,
                          "loader": type(hooked_mod.__loader__).__name__,
                          "spec_loader": type(hooked_mod.__spec__.loader).__name__}}))
    """)
    assert result == {
        "calls": [42],
        "late": [41],
        "loader": "SourceFileLoader",
        "spec_loader": "SourceFileLoader",
    }


def test_invalid_env_values_warn_once(tmp_path):
    """A kill switch it does not understand turns the package off; another variable falls
    back to its default. One warning each, however often they are read."""
    rc, out, err = run_process(
        [
            sys.executable,
            "-c",
            (
                "import nvrx_ipc_fix, json;"
                "nvrx_ipc_fix.activate(); nvrx_ipc_fix.activate();"
                "s = nvrx_ipc_fix.status();"
                "print(json.dumps([s.activated, [str(f.state) for f in s.fixes]]))"
            ),
        ],
        env={"NVRX_IPC_FIX_DISABLE": "stale_gaurd", "NVRX_IPC_FIX_LOG_LEVEL": "loud"},
    )
    assert rc == 0, err
    activated, states = json.loads(out.splitlines()[-1])
    assert not activated and set(states) == {"disabled"}
    assert err.count("unknown: stale_gaurd") == 1, err
    assert err.count("the whole package is off") == 1, err
    assert err.count("NVRX_IPC_FIX_LOG_LEVEL='loud' is not one of") == 1, err


@needs_cache
def test_the_guard_warns_once_records_the_reason_and_lets_a_checkpoint_failure_through():
    """``core.log.guard``, around the package's own bookkeeping: a defect there (a KeyError,
    three times) is one RuntimeWarning and one WARNING, ``status()`` names it for its target,
    and the block's caller can fall back (``failed``); a checkpoint's failure is never caught:
    the package's ``CheckpointWorkerError``, torch's ``CheckpointException``, an interrupt,
    and an exception raised inside NVRx each reach the caller as raised."""
    result = run_python("""
        import json, logging, warnings
        import nvrx_ipc_fix
        from nvidia_resiliency_ext.checkpointing.async_ckpt.filesystem_async import (
            FileSystemWriterAsync)
        from torch.distributed.checkpoint.api import CheckpointException
        from nvrx_ipc_fix.core.errors import CheckpointWorkerError
        from nvrx_ipc_fix.core.log import guard
        from nvrx_ipc_fix.fixes.clear_on_close import CLOSE_TARGET

        records = []
        handler = logging.Handler(); handler.emit = records.append
        logging.getLogger("nvrx_ipc_fix").addHandler(handler)
        failed = []
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for _ in range(3):
                with guard(CLOSE_TARGET, fix="clear_on_close") as it:
                    {}["the package's own record"]
                    failed.append("not reached")
                failed.append(type(it.failed).__name__)

        def nvrx():
            FileSystemWriterAsync.get_save_function_and_args(object())

        def raises(failure):
            raise failure

        through = []
        for call in (lambda: raises(CheckpointWorkerError("the worker died")),
                     lambda: raises(CheckpointException("save failed", {})),
                     lambda: raises(KeyboardInterrupt()), nvrx):
            try:
                with guard(CLOSE_TARGET, fix="clear_on_close") as it:
                    call()
                through.append(None)
            except BaseException as exc:
                through.append(type(exc).__name__)
        target = [t for t in nvrx_ipc_fix.status().targets
                  if t.fix == "clear_on_close" and t.target == CLOSE_TARGET][0]
        print(json.dumps({"failed": failed, "through": through, "state": str(target.state),
                          "reason": target.reason,
                          "logged": [r.getMessage() for r in records
                                     if r.levelno == logging.WARNING],
                          "shown": [[w.category.__name__, str(w.message)] for w in caught]}))
    """)
    assert result["failed"] == ["KeyError"] * 3, result
    assert len(result["shown"]) == 1 and result["shown"][0][0] == "RuntimeWarning", result
    assert "the package's own record" in result["shown"][0][1], result
    assert len(result["logged"]) == 1, result
    assert result["state"] == "error" and "KeyError" in result["reason"], result
    assert result["through"][:3] == [
        "CheckpointWorkerError",
        "CheckpointException",
        "KeyboardInterrupt",
    ], result
    assert result["through"][3] not in (None, "KeyError"), result  # NVRx's own, as raised


@needs_cache
def test_failing_cleanup_leaves_close_working_and_reports_error():
    """One WARNING on the package logger and one RuntimeWarning (shown by default),
    attributed to the user's call, however often the hook fails."""
    result = run_python("""
        import json, logging, sys, warnings
        import nvrx_ipc_fix
        from nvrx_ipc_fix.core import cleanup as _cleanup
        from nvrx_ipc_fix.fixes import clear_on_close as _clear_on_close
        from nvidia_resiliency_ext.checkpointing.async_ckpt import core
        def boom(*a, **k):
            raise RuntimeError("boom")
        _clear_on_close.clear_trainer_caches = boom
        records = []
        handler = logging.Handler(); handler.emit = records.append
        logging.getLogger("nvrx_ipc_fix").addHandler(handler)
        class Proc:  # a worker handle that is already gone
            def join(self, timeout=None): pass
            def is_alive(self): return False
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for _ in range(2):
                caller = core.PersistentAsyncCaller()
                caller.process = Proc()
                caller.queue.put = lambda item: None
                caller.queue.join = lambda: None
                line = sys._getframe().f_lineno + 1
                caller.close()
                closed = caller.process is None
        target = [t for t in nvrx_ipc_fix.status().targets
                  if t.fix == "clear_on_close" and t.target.endswith(".close")][0]
        print(json.dumps({"closed": closed, "state": str(target.state), "reason": target.reason,
                          "warnings": [r.getMessage() for r in records
                                       if r.levelno == logging.WARNING],
                          "shown": [[w.category.__name__, str(w.message), w.lineno == line]
                                    for w in caught]}))
    """)
    assert result["closed"]
    assert result["state"] == "error" and "boom" in result["reason"]
    assert len(result["warnings"]) == 1 and "boom" in result["warnings"][0]
    assert len(result["shown"]) == 1, result["shown"]
    category, message, at_close = result["shown"][0]
    assert category == "RuntimeWarning" and "boom" in message
    assert at_close  # the user's caller.close(), not our wrapper


@needs_cache
def test_unknown_shape_is_left_unpatched_with_the_reason():
    result = run_python("""
        import json, os
        os.environ["NVRX_IPC_FIX_DISABLE"] = "1"
        import nvrx_ipc_fix
        from nvidia_resiliency_ext.checkpointing.async_ckpt import core
        def close(self, force, abort=False):  # an NVRx whose close() looks different
            pass
        core.PersistentAsyncCaller.close = close
        # their close wrappers take any shape
        os.environ["NVRX_IPC_FIX_DISABLE"] = "worker_watch,suspend,cpu_snapshot"
        nvrx_ipc_fix.activate()
        target = [t for t in nvrx_ipc_fix.status().targets
                  if t.fix == "clear_on_close" and t.target.endswith(".close")][0]
        print(json.dumps({"state": str(target.state), "reason": target.reason,
                          "untouched": core.PersistentAsyncCaller.__dict__["close"] is close}))
    """)
    assert result["state"] == "unsupported" and result["untouched"]
    assert "('self', 'force')" in result["reason"]


@needs_nvrx
@pytest.mark.parametrize(
    "change, state",
    [
        (  # Megatron-LM PR #6971's error, in a release that has it
            "core.PersistentAsyncWorkerError = "
            "type('PersistentAsyncWorkerError', (RuntimeError,), {})",
            "fixed_upstream",
        ),
        ("del core._ActiveAsyncRequest", "unsupported"),  # nowhere to keep a failed save
    ],
)
def test_the_watch_stands_aside_for_an_upstream_fix_and_an_unknown_queue(change, state):
    result = run_python(f"""
        import json, os
        os.environ["NVRX_IPC_FIX_DISABLE"] = "1"
        import nvrx_ipc_fix
        from nvidia_resiliency_ext.checkpointing.async_ckpt import core
        schedule = core.AsyncCallsQueue.__dict__["schedule_async_request"]
        {change}
        # they wrap schedule_async_request too
        os.environ["NVRX_IPC_FIX_DISABLE"] = "prewarm,suspend,cpu_snapshot"
        nvrx_ipc_fix.activate()
        fix = {{f.name: f for f in nvrx_ipc_fix.status().fixes}}["worker_watch"]
        print(json.dumps({{"state": str(fix.state), "reason": fix.reason,
                          "untouched": core.AsyncCallsQueue.__dict__["schedule_async_request"]
                                       is schedule}}))
    """)
    assert result["state"] == state and result["untouched"], result
    assert ("PR #6971" if state == "fixed_upstream" else "_ActiveAsyncRequest") in result["reason"]


# A defect of the watch's own bookkeeping around schedule_async_request, injected where it
# counts the save (the worker died while idle: the save is scheduled as failed) or right
# after NVRx's call: the call falls back, all or nothing. The save is counted once (the saves'
# call_idx run 0, 1, 2, ...), NVRx's own call still reaches a live worker, the user's call
# does not raise, and every save loads.
DEFECT = """
    import sys
    from nvrx_ipc_fix.worker import registry as _w
    _state, _broken = _w.state, []
    def _breaks_once_in(caller):
        if sys._getframe(1).f_code.co_name == {where!r} and not _broken:
            _broken.append(True)
            raise RuntimeError("an injected defect of the watch")
        return _state(caller)
    _w.state = _breaks_once_in
"""


@needs_nvrx
@pytest.mark.worker
@pytest.mark.parametrize("where", ["_scheduled_failed", "_schedule"])  # schedule_wrapper's body
def test_a_defect_in_the_schedule_bookkeeping_falls_back_whole(where):
    steps = ["save", "fault-idle" if where == "_scheduled_failed" else "save", "save"]
    report = scenario(steps, prelude=DEFECT.format(where=where), timeout=30)
    assert report["hang"] is None, report["stderr"]
    assert not report.get("faults") or all(f["error"] is None for f in report["faults"])
    assert [s["stale"] for s in report["saves"]] == [0, 0, 0]
    assert report["call_idx"] == [0, 1, 2]
    assert any("injected defect" in line["message"] for line in report["log"])


# An NVRx whose schedule_async_request takes one more argument than the request: each save
# passes it, and records what NVRx's call received.
EXTRA_ARGUMENT = """
    from nvidia_resiliency_ext.checkpointing.async_ckpt import core as _core
    _schedule, _received = _core.AsyncCallsQueue.schedule_async_request, []

    def schedule_async_request(self, async_request, *rest, priority=None):
        _received.append({"rest": list(rest), "priority": priority})
        return _schedule(self, async_request)

    schedule_async_request.__module__ = _core.__name__  # as NVRx's own
    _core.AsyncCallsQueue.schedule_async_request = schedule_async_request
    from harness import scenario as _s  # activates: the wrappers go on top
    _save = _s.Trainer.save

    def save(self, wait=True, fault=None):
        sched = self.queue.schedule_async_request
        self.queue.schedule_async_request = lambda request: sched(request, "extra", priority=3)
        try:
            return _save(self, wait, fault)
        finally:
            del self.queue.schedule_async_request

    _s.Trainer.save = save
    _s.EXTRA_STEPS["received"] = lambda trainer: {"received": list(_received)}

    def _depth(trainer):  # the package's wrapper on NVRx's method, ours beneath it
        from harness.wrapping import chain
        return chain(_core.AsyncCallsQueue, "schedule_async_request", schedule_async_request)

    _s.EXTRA_STEPS["depth"] = _depth
"""


@needs_nvrx
@pytest.mark.worker
def test_the_watch_passes_every_argument_of_a_save_to_nvrx():
    """Wrap, never re-implement: NVRx's own call gets every argument, not the request alone."""
    report = scenario(["save", "save", "received#received", "depth#depth"], prelude=EXTRA_ARGUMENT)
    assert report["hang"] is None, report["stderr"]
    assert report["fix"]["worker_watch"] == "active"
    # one wrapper: worker_watch, and prewarm and suspend where they apply
    assert report["named"]["depth"]["depth"] == 1
    assert report["named"]["depth"]["steps"] == (
        ["suspend"] * expect("cache")
        + ["prewarm"] * expect("warmup")
        + ["cpu_snapshot", "worker_watch"]
    )
    assert report["named"]["received"]["received"] == [{"rest": ["extra"], "priority": 3}] * 2
    assert [s["stale"] for s in report["saves"]] == [0, 0]
    assert report["log"] == [], report["log"]  # no hook fell back
