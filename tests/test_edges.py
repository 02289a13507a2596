"""Every switch, argument and sub-command at its edges (infinite, NaN, huge, zero,
negative, empty, wrong case, unknown), ``release()`` interrupted at each of its steps and
called from another thread, and the public functions while another thread imports NVRx:
each with its expected outcome, and what it leaves behind lets the next save succeed."""

import json
import os
import shutil
import subprocess
import sys
import tempfile
from importlib.util import find_spec

import pytest

from conftest import (
    EXPECT,
    NVRX,
    expect,
    lacks,
    last_json,
    needs_cache,
    needs_nvrx,
    needs_warmup,
    pth_installed,
    run_process,
    run_python,
)

NAN, INF = "nan", "inf"

# (variable, value) -> what the package makes of it, and whether it warns (once)
ENV_CASES = [
    # the kill switch: understood values, else the whole package is off
    ("NVRX_IPC_FIX_DISABLE", "", "on", False),
    ("NVRX_IPC_FIX_DISABLE", " \t ", "on", False),  # blank: as unset, as for every variable
    ("NVRX_IPC_FIX_DISABLE", " No ", "on", False),
    ("NVRX_IPC_FIX_DISABLE", "OFF", "on", False),
    ("NVRX_IPC_FIX_DISABLE", "1", "off", False),
    ("NVRX_IPC_FIX_DISABLE", " TRUE", "off", False),
    ("NVRX_IPC_FIX_DISABLE", "stale_guard", "on: stale_guard", False),
    ("NVRX_IPC_FIX_DISABLE", "WORKER_WATCH , Stale_Guard", "on: stale_guard,worker_watch", False),
    ("NVRX_IPC_FIX_DISABLE", "stale_gaurd", "off", True),
    ("NVRX_IPC_FIX_DISABLE", "stale_guard,bogus", "off", True),
    ("NVRX_IPC_FIX_DISABLE", "STALE_GUARD", "on: stale_guard", False),
    ("NVRX_IPC_FIX_DISABLE", ",", "off", True),
    # an empty item is not a fix name, wherever it is: one rule with ","
    ("NVRX_IPC_FIX_DISABLE", "stale_guard,,", "off", True),
    ("NVRX_IPC_FIX_DISABLE", "stale_guard, ", "off", True),
    ("NVRX_IPC_FIX_DISABLE", ",stale_guard", "off", True),
    ("NVRX_IPC_FIX_DISABLE", "clear_on_close,,stale_guard", "off", True),
    ("NVRX_IPC_FIX_DISABLE", " , ,", "off", True),
    ("NVRX_IPC_FIX_DISABLE", ",,", "off", True),
    ("NVRX_IPC_FIX_DISABLE", "1,stale_guard", "off", True),
    ("NVRX_IPC_FIX_DISABLE", "2", "off", True),
    ("NVRX_IPC_FIX_DISABLE", "-1", "off", True),
    ("NVRX_IPC_FIX_DISABLE", INF, "off", True),
    ("NVRX_IPC_FIX_DISABLE", "ja", "off", True),
    # start-up activation: a value that is not understood turns it off too
    ("NVRX_IPC_FIX_AUTO", "", True, False),
    ("NVRX_IPC_FIX_AUTO", "  ", True, False),
    ("NVRX_IPC_FIX_AUTO", "ON", True, False),
    ("NVRX_IPC_FIX_AUTO", " 0 ", False, False),
    ("NVRX_IPC_FIX_AUTO", "maybe", False, True),
    ("NVRX_IPC_FIX_AUTO", "-1", False, True),
    # everything else: one warning and the default
    ("NVRX_IPC_FIX_STRATEGY", "TERMINATE", "terminate", False),
    ("NVRX_IPC_FIX_STRATEGY", " Restart ", "restart", False),
    ("NVRX_IPC_FIX_STRATEGY", "", "flush", False),
    ("NVRX_IPC_FIX_STRATEGY", " ", "flush", False),
    ("NVRX_IPC_FIX_STRATEGY", "nuke", "flush", True),
    ("NVRX_IPC_FIX_RELEASE", "Finalize", "finalize", False),
    ("NVRX_IPC_FIX_RELEASE", "OFF", "never", False),
    ("NVRX_IPC_FIX_RELEASE", "none", "never", False),
    ("NVRX_IPC_FIX_RELEASE", "sometimes", "offload", True),
    ("NVRX_IPC_FIX_RELEASE", "", "offload", False),
    ("NVRX_IPC_FIX_RELEASE", " \t", "offload", False),
    ("NVRX_IPC_FIX_RELEASE_TIMEOUT", "", 60.0, False),
    ("NVRX_IPC_FIX_RELEASE_TIMEOUT", "  ", 60.0, False),
    ("NVRX_IPC_FIX_RELEASE_TIMEOUT", "INF", INF, False),
    ("NVRX_IPC_FIX_RELEASE_TIMEOUT", "0.5", 0.5, False),
    ("NVRX_IPC_FIX_RELEASE_TIMEOUT", INF, INF, False),
    ("NVRX_IPC_FIX_RELEASE_TIMEOUT", " Infinity ", INF, False),
    ("NVRX_IPC_FIX_RELEASE_TIMEOUT", "+inf", INF, False),
    # a number too large for a float is not "no limit" unless it says inf
    ("NVRX_IPC_FIX_RELEASE_TIMEOUT", "1e400", 60.0, True),
    ("NVRX_IPC_FIX_RELEASE_TIMEOUT", "1E999", 60.0, True),
    ("NVRX_IPC_FIX_RELEASE_TIMEOUT", "1e300", 1e300, False),
    ("NVRX_IPC_FIX_RELEASE_TIMEOUT", NAN, 60.0, True),
    ("NVRX_IPC_FIX_RELEASE_TIMEOUT", "0", 60.0, True),
    ("NVRX_IPC_FIX_RELEASE_TIMEOUT", "-5", 60.0, True),
    ("NVRX_IPC_FIX_RELEASE_TIMEOUT", "-inf", 60.0, True),
    ("NVRX_IPC_FIX_RELEASE_TIMEOUT", "soon", 60.0, True),
    ("NVRX_IPC_FIX_STALL_TIMEOUT", "", 300.0, False),
    ("NVRX_IPC_FIX_STALL_TIMEOUT", " ", 300.0, False),
    ("NVRX_IPC_FIX_STALL_TIMEOUT", "0", INF, False),  # off
    ("NVRX_IPC_FIX_STALL_TIMEOUT", INF, INF, False),
    ("NVRX_IPC_FIX_STALL_TIMEOUT", "2.5", 2.5, False),
    ("NVRX_IPC_FIX_STALL_TIMEOUT", " INF", INF, False),
    ("NVRX_IPC_FIX_STALL_TIMEOUT", "0.0", INF, False),  # off
    ("NVRX_IPC_FIX_STALL_TIMEOUT", "1e300", 1e300, False),
    ("NVRX_IPC_FIX_STALL_TIMEOUT", NAN, 300.0, True),
    ("NVRX_IPC_FIX_STALL_TIMEOUT", "-1", 300.0, True),
    ("NVRX_IPC_FIX_STALL_TIMEOUT", "-inf", 300.0, True),
    ("NVRX_IPC_FIX_STALL_TIMEOUT", "soon", 300.0, True),
    ("NVRX_IPC_FIX_STALL_TIMEOUT", "1e400", 300.0, True),
    ("NVRX_IPC_FIX_PIN", "", True, False),
    ("NVRX_IPC_FIX_PIN", "  ", True, False),
    ("NVRX_IPC_FIX_PIN", " OFF ", False, False),
    ("NVRX_IPC_FIX_PIN", "never", False, False),
    ("NVRX_IPC_FIX_PIN", "maybe", True, True),  # "using on", and on it is
    ("NVRX_IPC_FIX_PIN", NAN, True, True),
    ("NVRX_IPC_FIX_STANDBY", "", True, False),
    ("NVRX_IPC_FIX_STANDBY", " ", True, False),
    ("NVRX_IPC_FIX_STANDBY", " Off", False, False),
    ("NVRX_IPC_FIX_STANDBY", "0", False, False),
    ("NVRX_IPC_FIX_STANDBY", "-1", True, True),
    ("NVRX_IPC_FIX_STANDBY", INF, True, True),
    ("NVRX_IPC_FIX_PREWARM", "Start", True, False),
    ("NVRX_IPC_FIX_PREWARM", "", False, False),
    ("NVRX_IPC_FIX_PREWARM", "  ", False, False),
    ("NVRX_IPC_FIX_PREWARM", "maybe", False, True),
    ("NVRX_IPC_FIX_LOG_LEVEL", "DEBUG", "debug", False),
    ("NVRX_IPC_FIX_LOG_LEVEL", "", None, False),
    ("NVRX_IPC_FIX_LOG_LEVEL", " ", None, False),
    ("NVRX_IPC_FIX_LOG_LEVEL", "loud", None, True),
]

READ_ENV = """
    import json, os, warnings
    from nvrx_ipc_fix.core import config as _config
    from nvrx_ipc_fix.core.fix_names import FIXES
    def read(name):
        if name == _config.DISABLE:
            off = _config.disabled_fixes(tuple(FIXES))
            return "off" if off is None else ("on: " + ",".join(sorted(off)) if off else "on")
        if name == _config.LOG_LEVEL:
            from nvrx_ipc_fix.core.log import logger
            logger.setLevel(logging.NOTSET)
            level = _config.log_level()
            if level:
                from nvrx_ipc_fix.core.log import configure

                configure(level)
            return logging.getLevelName(logger.level).lower() if logger.level else None
        value = {_config.AUTO: _config.auto, _config.STRATEGY: _config.strategy,
                 _config.RELEASE: _config.release_policy,
                 _config.RELEASE_TIMEOUT: _config.release_timeout,
                 _config.STALL_TIMEOUT: _config.stall_timeout, _config.PIN: _config.pin_ahead,
                 _config.STANDBY: _config.standby,
                 _config.PREWARM: _config.prewarm_at_start}[name]()
        return "inf" if value == float("inf") else value
    import logging
    out = []
    for name, value in CASES:
        os.environ[name] = value
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            first, second = read(name), read(name)  # warned once, however often it is read
        out.append([first, second, len(caught)])
        del os.environ[name]
    print(json.dumps(out))
"""


def test_every_environment_variable_at_its_edges():
    cases = [(name, value) for name, value, _, _ in ENV_CASES]
    seen = run_python(f"CASES = {cases!r}\n" + READ_ENV.replace("\n    ", "\n"))
    for (name, value, wanted, warns), (first, second, warnings) in zip(ENV_CASES, seen):
        assert first == second == wanted, (name, value, first)
        assert warnings == int(warns), (name, value, warnings)


@pytest.mark.parametrize("value", ["stale_gaurd", "2", ",", "stale_guard,,"])
def test_a_kill_switch_it_does_not_understand_turns_the_package_off(value):
    rc, out, err = run_process(
        [
            sys.executable,
            "-c",
            (
                "import json, nvrx_ipc_fix; s = nvrx_ipc_fix.activate();"
                "print(json.dumps([s.activated, sorted({str(f.state) for f in s.fixes})]))"
            ),
        ],
        env={"NVRX_IPC_FIX_DISABLE": value},
    )
    assert rc == 0, err
    assert json.loads(out) == [False, ["disabled"]]
    assert err.count("the whole package is off") == 1


BAD_ARGUMENTS = """
    import json, math
    import nvrx_ipc_fix
    out = {}
    for label, kwargs in [("timeout=0", dict(timeout=0)), ("timeout=-1", dict(timeout=-1)),
                          ("timeout=nan", dict(timeout=math.nan)),
                          ("timeout=-inf", dict(timeout=-math.inf)),
                          ("timeout='5'", dict(timeout="5")), ("timeout=True", dict(timeout=True)),
                          ("strategy=''", dict(strategy="")),
                          ("strategy='kill'", dict(strategy="kill")),
                          ("strategy=3", dict(strategy=3)),
                          ("queue=object()", dict(queue=object()))]:
        try:
            nvrx_ipc_fix.release(**kwargs)
            out[label] = "accepted"
        except (ValueError, TypeError) as exc:
            out[label] = f"{type(exc).__name__}: {exc}"
    for label, kwargs in [("timeout=inf", dict(timeout=math.inf)),
                          ("timeout=1e308", dict(timeout=1e308)),
                          ("timeout=10**400", dict(timeout=10 ** 400)),
                          ("strategy=' FLUSH '", dict(strategy=" FLUSH "))]:
        out[label] = nvrx_ipc_fix.release(**kwargs).strategy
    print(json.dumps(out))
"""


def test_release_rejects_bad_arguments_naming_what_is_allowed():
    seen = run_python(BAD_ARGUMENTS)
    for label in (
        "timeout=0",
        "timeout=-1",
        "timeout=nan",
        "timeout=-inf",
        "timeout='5'",
        "timeout=True",
    ):
        assert seen[label].startswith(
            "ValueError: timeout must be a number of seconds > 0 (inf: no limit)"
        ), seen[label]
    for label in ("strategy=''", "strategy='kill'", "strategy=3"):
        assert seen[label].startswith(
            "ValueError: strategy must be one of flush, terminate, restart"
        )
    assert seen["queue=object()"] == (
        "TypeError: queue must be an NVRx AsyncCallsQueue or None, not object"
    )
    assert seen["timeout=inf"] == seen["timeout=1e308"] == seen["timeout=10**400"] == "flush"
    assert seen["strategy=' FLUSH '"] == "flush"


# A trainer through release() interrupted at each of its steps (and called from another
# thread, and with no time limit): after each, a save must be correct and nothing hang.
INTERRUPTED = """
    import json, math, tempfile, threading
    import nvrx_ipc_fix
    from nvrx_ipc_fix.core import cleanup as _cleanup
    from nvrx_ipc_fix.worker import release as _release
    from harness import scenario
    results = {}
    with tempfile.TemporaryDirectory() as d:
        t = scenario.Trainer(d, 4, 256, starts="forkserver")
        t.save(); t.save()

        def checked_save(label):
            _, _, path, version = t.save()
            results[label] = {"stale": t.stale_tensors(path, version),
                              "pending": t.queue.get_num_unfinalized_calls()}

        def interrupt(owner, name, exc=KeyboardInterrupt):
            original = getattr(owner, name)
            def boom(*a, **k):
                raise exc(f"injected into {name}")
            setattr(owner, name, boom)
            return lambda: setattr(owner, name, original)

        for label, owner, name in [
                ("finalizing pending saves", t.queue, "maybe_finalize_async_calls"),
                ("forgetting the keys", _cleanup, "forget_keys"),
                ("sending the request", None, "put"),
                ("waiting for the answer", _release, "_answer"),
                ("cleaning up after it", _cleanup, "clear_trainer_caches")]:
            t.save(wait=False)  # a pending save for release() to finalize
            owner = owner or t.queue.persistent_caller.queue
            restore = interrupt(owner, name)
            try:
                nvrx_ipc_fix.release(t.queue)
                results[label] = "not interrupted"
            except KeyboardInterrupt:
                pass
            finally:
                restore()
                if name == "put":
                    del owner.put  # the instance attribute: back to the class's method
            t.queue.maybe_finalize_async_calls(blocking=True)
            checked_save(label)

        report = nvrx_ipc_fix.release(t.queue, timeout=math.inf)
        results["timeout=inf"] = {"error": report.error, "kept": report.worker_kept}
        checked_save("after timeout=inf")

        box = {}
        worker = threading.Thread(target=lambda: box.update(r=nvrx_ipc_fix.release(t.queue)))
        worker.start(); worker.join(120)
        results["from another thread"] = {"kept": box["r"].worker_kept, "error": box["r"].error}
        checked_save("after another thread's release")
        t.close()
    print(json.dumps(results))
"""


@needs_cache
@pytest.mark.worker
def test_release_interrupted_at_each_step_leaves_the_next_save_correct():
    seen = run_python(INTERRUPTED, timeout=400)
    for label in (
        "finalizing pending saves",
        "forgetting the keys",
        "sending the request",
        "waiting for the answer",
        "cleaning up after it",
        "after timeout=inf",
        "after another thread's release",
    ):
        assert seen[label] == {"stale": 0, "pending": 0}, (label, seen[label])
    assert seen["timeout=inf"] == {"error": None, "kept": True}
    assert seen["from another thread"] == {"kept": True, "error": None}


# A worker whose main thread blocks SIGTERM, so that the signal reaches its other thread (the
# queue's feeder), as the kernel may choose at any time; then {abort}, timed, and a save.
SIGTERM_ELSEWHERE = """
    import json, os, tempfile, time
    import nvrx_ipc_fix
    from nvrx_ipc_fix.worker import release as _release
    from harness import faults, scenario
    if os.environ.get("WITHOUT_THE_WAKE"):
        from nvrx_ipc_fix.fixes import worker_watch
        worker_watch._wake = lambda caller: None
    with tempfile.TemporaryDirectory() as d:
        t = scenario.Trainer(d, 4, 256, starts="forkserver")
        t.save()
        assert _release.run_in_worker(t.queue, faults.sigterm_to_other_threads, (), 30) is None
        worker, requests = t.worker(), t.queue.persistent_caller.queue
        began = time.monotonic()
{abort}
        aborted_s = time.monotonic() - began
        _, _, path, version = t.save()
        print(json.dumps({{"aborted_s": aborted_s, "exitcode": worker.exitcode,
                          "new_worker": t.worker().pid != worker.pid,
                          "stale": t.stale_tensors(path, version)}}))
        t.close()
"""
# release() interrupted before its request reached the worker: the worker is aborted.
ABORTED = SIGTERM_ELSEWHERE.format(
    abort="""
        def interrupted(*args, **kwargs):
            raise KeyboardInterrupt("injected into put")

        requests.put = interrupted
        try:
            nvrx_ipc_fix.release(t.queue)
        except KeyboardInterrupt:
            pass
        finally:
            del requests.put"""
)


@needs_cache
@pytest.mark.worker
def test_an_aborted_worker_whose_sigterm_reached_another_thread_ends_at_once():
    """NVRx 0.7.0's abort waits ``sigterm_timeout`` (30 s) for the SIGTERM handler, which
    the main thread runs only once it wakes: the package's abort wakes it. NVRx 0.6.0's
    abort is a SIGKILL."""
    seen = run_python(ABORTED, timeout=240)
    assert seen["aborted_s"] < 15, seen  # 30.4 s before (NVRx's wait: 30 s)
    assert seen["exitcode"] is not None and seen["new_worker"] and seen["stale"] == 0, seen


# The user's own abort (NeMo RL's and Megatron's abort_nvrx_checkpoint(), close(abort=True)).
USER_ABORT = SIGTERM_ELSEWHERE.format(
    abort="""
        t.queue.persistent_caller.sigterm_timeout = 12.0  # NVRx's default: 30 s
        t.queue.close(abort=True)"""
)


@needs_cache
@pytest.mark.worker
@pytest.mark.skipif(
    not EXPECT.get(NVRX, {}).get("sigterm"),
    reason=lacks("aborts with a SIGKILL (no sigterm_timeout)"),
)
@pytest.mark.parametrize("wake", [True, False], ids=["with-the-wake", "without"])
def test_the_users_abort_of_a_worker_whose_sigterm_reached_another_thread(wake):
    """NVRx 0.7.0's close(abort=True) waits sigterm_timeout (30 s; 12 s here) for a handler
    only the worker's main thread runs, blocked reading its next request: the watch wakes it."""
    seen = run_python(USER_ABORT, timeout=240, env=None if wake else {"WITHOUT_THE_WAKE": "1"})
    if wake:
        assert seen["aborted_s"] < 6, seen  # half NVRx's wait, whatever the load
    else:  # NVRx's own wait, to its sigterm_timeout: the reproduction
        assert seen["aborted_s"] > 11.5, seen
    assert seen["exitcode"] is not None and seen["new_worker"] and seen["stale"] == 0, seen


@needs_cache
@pytest.mark.worker
def test_release_timeout_inf_from_the_environment_then_ordinary_saves():
    from conftest import scenario

    report = scenario(
        ["save", "save", "flush", "save", "replace", "save"],
        env={"NVRX_IPC_FIX_RELEASE_TIMEOUT": "inf"},
    )
    assert report["hang"] is None, report["stderr"]
    assert report["releases"][0]["error"] is None and report["releases"][0]["worker_kept"]
    assert [s["stale"] for s in report["saves"]] == [0, 0, 0, 0]


DURING_IMPORT = """
    import json, sys, threading, importlib
    import nvrx_ipc_fix
    CORE = "nvidia_resiliency_ext.checkpointing.async_ckpt.core"
    FS = "nvidia_resiliency_ext.checkpointing.async_ckpt.filesystem_async"
    errors, calls, done, started = [], 0, threading.Event(), threading.Event()

    def hammer():
        global calls
        while not done.is_set() or not started.is_set():
            for call in (nvrx_ipc_fix.status, nvrx_ipc_fix.activate, nvrx_ipc_fix.deactivate,
                         nvrx_ipc_fix.activate, nvrx_ipc_fix.release,
                         lambda: nvrx_ipc_fix.offloading().__enter__(),
                         nvrx_ipc_fix.ray_worker_setup, lambda: nvrx_ipc_fix.CheckpointWorkerError):
                try:
                    call()
                    calls += 1
                except Exception as exc:
                    errors.append(f"{type(exc).__name__}: {exc}")
            started.set()

    thread = threading.Thread(target=hammer)
    thread.start()
    started.wait()  # every function has run once; now import NVRx while they keep running
    importlib.import_module(CORE); importlib.import_module(FS)
    done.set(); thread.join()
    nvrx_ipc_fix.activate()
    core = sys.modules[CORE]
    from harness.wrapping import chain
    status = nvrx_ipc_fix.status()
    print(json.dumps({"errors": errors[:5], "calls": calls,
                      "close": chain(core.PersistentAsyncCaller, "close"),
                      "states": {t.fix + " " + t.target: str(t.state) for t in status.targets}}))
"""


@needs_nvrx
def test_public_functions_while_another_thread_imports_nvrx():
    seen = run_python(DURING_IMPORT, timeout=240)
    assert seen["errors"] == [] and seen["calls"] > 0
    # one wrapper, never stacked: the watch, and where NVRx caches clear_on_close and suspend
    assert seen["close"]["depth"] == 1
    assert seen["close"]["steps"] == ["suspend", "clear_on_close"] * expect("cache") + [
        "cpu_snapshot",
        "worker_watch",
    ]
    core = "nvidia_resiliency_ext.checkpointing.async_ckpt.core"
    assert seen["states"][f"worker_watch {core}:PersistentAsyncCaller.close"] == "active"


@pytest.mark.parametrize(
    "directory, code, words",
    [
        ("/proc/nvrx-ipc-fix-test", 1, "cannot write"),
        ("/etc/hostname", 1, "is not a directory"),
        ("/dev/null", 1, "is not a directory"),
        ("", 2, "DIR is empty"),
        ("   ", 2, "DIR is empty"),
        ("{tmp}/odd dir é\tx", 0, "wrote"),
        ("{tmp}/a/b/c", 0, "wrote"),  # made
        ("{tmp}/dir-named-sitecustomize", 1, "Is a directory"),
    ],
)
def test_install_sitecustomize_at_odd_paths(tmp_path, directory, code, words):
    (tmp_path / "dir-named-sitecustomize" / "sitecustomize.py").mkdir(parents=True)
    directory = directory.format(tmp=tmp_path)
    rc, out, err = run_process(
        [sys.executable, "-m", "nvrx_ipc_fix", "install-sitecustomize", directory]
    )
    assert rc == code, out + err
    assert words in out + err and "Traceback" not in err


def test_skip_reasons_say_when_nvrx_is_not_installed():
    """Not "NVRx None has no IPC cache" in the nonvrx env."""
    assert lacks("has no IPC cache", nvrx="0.4.1") == "NVRx 0.4.1 has no IPC cache"
    assert "nvidia-resiliency-ext is not installed" in lacks("has no IPC cache", nvrx=None)
    for mark in (needs_cache, needs_warmup, needs_nvrx):
        reason = mark.kwargs["reason"]
        assert "None" not in reason, reason
        if NVRX is None:
            assert "nvidia-resiliency-ext is not installed" in reason, reason


WARNS_AT = """
import json, os, sys, warnings
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    import nvrx_ipc_fix  # LINE import
    os.environ.update(NVRX_IPC_FIX_STRATEGY="nuke", NVRX_IPC_FIX_RELEASE_TIMEOUT="0")
    nvrx_ipc_fix.release()  # LINE release
    if sys.argv[1] == "queue":
        os.environ["NVRX_IPC_FIX_PREWARM"] = "maybe"
        from nvidia_resiliency_ext.checkpointing.async_ckpt import core
        queue = core.AsyncCallsQueue(persistent=True)  # LINE queue
        queue.close()
print(json.dumps([[w.filename, w.lineno, str(w.message)] for w in caught]))
"""


def test_a_warning_names_the_callers_line_not_ours(tmp_path):
    """The RuntimeWarning for a setting is attributed to the user's line that read it:
    ``import nvrx_ipc_fix``, ``release()``, and a queue whose patched ``__init__`` reads one."""
    script = tmp_path / "train.py"
    script.write_text(WARNS_AT)
    lines = {
        line.rsplit("# LINE ", 1)[1]: number
        for number, line in enumerate(WARNS_AT.splitlines(), 1)
        if "# LINE " in line
    }
    queue = NVRX is not None and expect("warmup")
    rc, out, err = run_process(
        [sys.executable, str(script), "queue" if queue else "-"],
        env={"NVRX_IPC_FIX_LOG_LEVEL": "loud"},
    )
    assert rc == 0, err
    caught = last_json(out)
    wanted = {
        "NVRX_IPC_FIX_LOG_LEVEL": "import",
        "NVRX_IPC_FIX_STRATEGY": "release",
        "NVRX_IPC_FIX_RELEASE_TIMEOUT": "release",
    }
    if queue:
        wanted["NVRX_IPC_FIX_PREWARM"] = "queue"
    seen = {
        message.split()[1].split("=")[0]: (filename, number) for filename, number, message in caught
    }
    assert seen == {name: (str(script), lines[where]) for name, where in wanted.items()}


@needs_nvrx
def test_a_warning_under_python_m_nvrx_ipc_fix_names_no_line_of_runpy():
    """``python -m nvrx_ipc_fix`` runs no code of the user's: a setting's warning names the
    package's ``__main__.py``, where the command entered it, not ``<frozen runpy>:88``."""
    rc, out, err = run_process(
        [sys.executable, "-m", "nvrx_ipc_fix", "status", "--json"],
        env={"NVRX_IPC_FIX_LOG_LEVEL": "loud", "NVRX_IPC_FIX_STRATEGY": "nuke"},
        fresh=True,
    )
    assert rc == 0, err
    main = os.path.join(os.path.dirname(find_spec("nvrx_ipc_fix").origin), "__main__.py")
    warned = [line for line in err.splitlines() if ": RuntimeWarning: " in line]
    # the strategy is read only where NVRx has the cache (the automatic release's state)
    assert len(warned) == (2 if expect("cache") else 1), err
    for line in warned:
        assert line.startswith(f"{main}:") and "runpy" not in line, line


#: Each line imports a module that the package patches (the second must not warn again).
IMPORTS_NVRX = """import sys
import nvidia_resiliency_ext.checkpointing.async_ckpt.core  # LINE 2
import nvidia_resiliency_ext.checkpointing.async_ckpt.filesystem_async
"""


@needs_nvrx
@pth_installed
@pytest.mark.parametrize(
    "name, value", [("NVRX_IPC_FIX_DISABLE", "maybe"), ("NVRX_IPC_FIX_LOG_LEVEL", "loud")]
)
def test_start_up_warns_about_a_setting_only_in_a_process_that_imports_nvrx(tmp_path, name, value):
    """Start-up activation reads the setting in every process of the environment: one that
    never imports NVRx (``pip --version``) prints nothing; one that does prints one warning,
    at its import line, saying where it comes from. ``activate()`` still warns at once."""
    env = {name: value}
    rc, out, err = run_process([sys.executable, "-c", "pass"], auto=True, env=env)
    assert (rc, err) == (0, ""), err
    script = tmp_path / "train.py"
    script.write_text(IMPORTS_NVRX)
    rc, out, err = run_process([sys.executable, str(script)], auto=True, env=env)
    assert rc == 0 and err.count("Warning") == 1, err
    assert err.startswith(f"{script}:2: RuntimeWarning: nvrx_ipc_fix: {name}={value!r} "), err
    assert "start-up file nvrx_ipc_fix.pth" in err and f"unset {name}" in err, err
    assert "doctor" in err and "<string>" not in err, err
    script.write_text("import nvrx_ipc_fix\nnvrx_ipc_fix.activate()\n" + IMPORTS_NVRX)
    rc, out, err = run_process([sys.executable, str(script)], auto=True, env=env)
    assert rc == 0 and err.count("Warning") == 1, err
    assert err.startswith(f"{script}:2: RuntimeWarning: nvrx_ipc_fix: {name}={value!r} "), err


@needs_nvrx
@pth_installed
@pytest.mark.parametrize(
    "name, value, words, active",
    [
        (
            "NVRX_IPC_FIX_DISABLED",
            "1",
            "(did you mean NVRX_IPC_FIX_DISABLE?): taken for the kill "
            "switch, the whole package is off",
            False,
        ),
        ("nvrx_ipc_fix_disabled", "no", "(did you mean NVRX_IPC_FIX_DISABLE?): ignored", True),
        (
            "nvrx_ipc_fix_stall_timeout",
            "5",
            "(did you mean NVRX_IPC_FIX_STALL_TIMEOUT?): ignored",
            True,
        ),
        ("NVRX_IPC_FIX_", "1", "(it reads NVRX_IPC_FIX_AUTO, ", True),
        ("NVRX_IPC_FIX_QWERTYUIOP", "on", "(it reads NVRX_IPC_FIX_AUTO, ", True),
    ],
)
def test_start_up_names_an_unknown_variable_and_the_nearest_it_reads(
    tmp_path, name, value, words, active
):
    """As a setting not understood: nothing in a process that never imports NVRx, one warning
    at the import in one that does; a typo of the kill switch's name turns the package off."""
    rc, out, err = run_process([sys.executable, "-c", "pass"], auto=True, env={name: value})
    assert (rc, err) == (0, ""), err
    script = tmp_path / "train.py"
    script.write_text(
        IMPORTS_NVRX + "import nvrx_ipc_fix\nprint(nvrx_ipc_fix.status().activated)\n"
    )
    rc, out, err = run_process([sys.executable, str(script)], auto=True, env={name: value})
    assert rc == 0 and err.count("Warning") == 1, err
    assert err.startswith(
        f"{script}:2: RuntimeWarning: nvrx_ipc_fix: {name}={value!r} is not a variable "
        f"nvrx_ipc_fix reads {words}"
    ), err
    assert out.split() == [str(active)], out


RAY_ENVS = """
    import json, nvrx_ipc_fix
    out = {}
    for label, given in [("'bad'", "'bad'"), ("123", "123"), ("[]", "[]"), ("b'x'", "b'x'"),
                         ("env_vars list", "{'env_vars': ['A=1']}"),
                         ("env_vars str", "{'env_vars': 'A=1'}"),
                         ("env_vars int value", "{'env_vars': {'A': 1}}"),
                         ("env_vars int key", "{'env_vars': {1: 'a'}}"),
                         ("hook ''", "{'worker_process_setup_hook': ''}"),
                         ("hook ' '", "{'worker_process_setup_hook': ' '}"),
                         ("hook 'setup'", "{'worker_process_setup_hook': 'setup'}"),
                         ("hook 'a..b'", "{'worker_process_setup_hook': 'a..b'}"),
                         ("hook 1", "{'worker_process_setup_hook': 1}")]:
        try:
            nvrx_ipc_fix.ray_runtime_env(eval(given))
            out[label] = "accepted"
        except Exception as exc:
            out[label] = f"{type(exc).__name__}: {exc}"
    twice = nvrx_ipc_fix.ray_runtime_env(nvrx_ipc_fix.ray_runtime_env())
    string = nvrx_ipc_fix.ray_runtime_env(
        {"worker_process_setup_hook": "nvrx_ipc_fix.ray_worker_setup"})
    kept = [sorted(nvrx_ipc_fix.ray_runtime_env(given)) for given in (
        None, {}, {"env_vars": None}, {"worker_process_setup_hook": None},
        {"worker_process_setup_hook": "their_module.setup"})]
    out["ours once"] = [env["worker_process_setup_hook"].__closure__[0].cell_contents
                        for env in (twice, string)]
    out["kept"] = kept
    print(json.dumps(out))
"""


def test_ray_runtime_env_rejects_what_ray_cannot_take_naming_the_argument():
    seen = run_python(RAY_ENVS, env={"NVRX_IPC_FIX_STRATEGY": "flush"})
    for label in ("'bad'", "123", "[]", "b'x'"):
        assert seen.pop(label).startswith(
            "TypeError: runtime_env must be a dict (Ray's runtime_env) or None, not "
        ), label
    for label in ("env_vars list", "env_vars str"):
        assert seen.pop(label).startswith(
            "TypeError: runtime_env['env_vars'] must be a dict of str to str or None"
        ), label
    assert seen.pop("env_vars int value") == (
        "TypeError: runtime_env['env_vars'] must map str to str (Ray's rule); 'A': 1 is not"
    )
    assert seen.pop("env_vars int key").startswith("TypeError: runtime_env['env_vars'] must map")
    for label, value in (
        ("hook ''", "''"),
        ("hook ' '", "' '"),
        ("hook 'setup'", "'setup'"),
        ("hook 'a..b'", "'a..b'"),
    ):
        assert seen.pop(label) == (
            "ValueError: worker_process_setup_hook must be a callable or "
            f"a 'module.function' string, not {value}"
        ), label
    assert seen.pop("hook 1").startswith("TypeError: worker_process_setup_hook must be")
    assert seen.pop("ours once") == [None, None]  # not chained to itself
    assert seen.pop("kept") == [["env_vars", "worker_process_setup_hook"]] * 5
    assert seen == {}


@pytest.mark.parametrize("command", ["bundle", "install-sitecustomize"])
def test_an_empty_dir_is_a_usage_error_and_writes_nothing(tmp_path, command):
    """``bundle ""`` used to write the bundle into the current directory."""
    for directory in ("", " \t"):
        proc = subprocess.run(
            [sys.executable, "-m", "nvrx_ipc_fix", command, directory],
            cwd=tmp_path,
            capture_output=True,
            text=True,
            timeout=120,
            env={k: v for k, v in os.environ.items() if not k.startswith("NVRX_IPC_FIX_")},
        )
        assert proc.returncode == 2 and "DIR is empty" in proc.stderr, proc
        assert list(tmp_path.iterdir()) == []


KILLED_CHILD = """
    import json, os, sys, tempfile
    from nvrx_ipc_fix.cli.runner import run_child
    child = ("import multiprocessing.util, tempfile, time; tempfile.mkdtemp(prefix='x-'); "
             "multiprocessing.util.get_temp_dir(); print('made', flush=True); time.sleep(60)")
    out = {}
    for name, code, backstop in (("killed", child, 8), ("ends", child.replace("60", "0"), 60)):
        try:
            out[name] = run_child([sys.executable, "-c", code], dict(os.environ), backstop)[1]
        except RuntimeError as exc:
            out[name] = str(exc)
    print(json.dumps(out))
"""


def test_the_demo_runner_removes_its_childs_temp_directory_however_it_ends():
    """The demo's and selftest's runner gives each driver run a TMPDIR of its own and removes
    it after, also when the child is killed at the backstop with what it started."""
    tmp = tempfile.mkdtemp(prefix="nvrx-test-")  # short enough for a TMPDIR below it (fits)
    try:
        seen = run_python(KILLED_CHILD, env={"TMPDIR": tmp}, timeout=120)
        assert seen == {
            "killed": "the driver was still running after 8 s: stopped it and the "
            "processes it started",
            "ends": "made\n",
        }
        assert os.listdir(tmp) == []
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
