"""``python -m nvrx_ipc_fix`` tells the truth for the NVRx of this environment, or for none."""

import json
import os
import re
import subprocess
import sys
import sysconfig
import textwrap
from importlib import metadata
from importlib.util import find_spec
from pathlib import Path

import pytest

from conftest import GPU, MCORE, NVRX, EXPECT, needs_nvrx, pth_installed, run_process, run_python


def cli(*args):
    rc, out, err = run_process([sys.executable, "-m", "nvrx_ipc_fix", *args])
    assert rc == 0, err
    return out


def test_json_status_matches_the_installed_nvrx():
    status = json.loads(cli("--json"))
    assert status["nvrx_version"] == NVRX
    assert status["activated"] and status["source"] == "import"
    fixes = {f["name"]: f["state"] for f in status["fixes"]}
    watch = fixes.pop("worker_watch"), fixes.pop("mcore_worker_watch")
    assert watch == (
        "not_applicable" if NVRX is None else "active",
        "pending" if MCORE else "not_applicable",
    )
    assert fixes.pop("prewarm") == (
        "not_applicable"
        if NVRX is None
        else "active"
        if EXPECT[NVRX]["warmup"]
        else "not_applicable"
    )
    assert fixes.pop("own_results") == ("not_applicable" if NVRX is None else "active")
    # NVRx's writer, and megatron-core's (never imported here: pending where installed)
    assert fixes.pop("cpu_snapshot") == (
        "active"
        if NVRX and not EXPECT[NVRX]["snapshots"]
        else "pending"
        if MCORE
        else "not_applicable"
        if NVRX is None
        else "fixed_upstream"
    )
    if NVRX is None:  # nothing to wait for (test_a_target_waits_only_for_what_is_installed)
        assert fixes == {
            "clear_on_close": "not_applicable",
            "stale_guard": "not_applicable",
            "release_on_offload": "not_applicable",
            "suspend": "not_applicable",
        }
        assert all(
            "not installed" in t["reason"]
            for t in status["targets"]
            if t["target"].startswith("nvidia_resiliency_ext")
        )
    elif not EXPECT[NVRX]["cache"]:
        assert set(fixes.values()) == {"not_applicable"}
        megatron = [
            t
            for t in status["targets"]
            if t["target"].startswith("megatron") and t["fix"] == "clear_on_close"
        ]
        assert {t["state"] for t in megatron} == {"not_applicable"}
        assert all("has no worker cache" in t["reason"] for t in megatron)
    else:
        assert fixes["clear_on_close"] == fixes["suspend"] == "active"
        assert fixes["stale_guard"] == (
            "fixed_upstream" if EXPECT[NVRX]["upstream_ptrs"] else "active"
        )
        assert status["features"]["FileSystemWriterAsync._cached_identifiers"] == "set"


def test_table_and_no_import():
    table = cli()
    assert table.startswith("nvrx-ipc-fix ") and "clear_on_close" in table
    status = json.loads(cli("status", "--json", "--no-import"))
    core = [t for t in status["targets"] if t["target"].startswith("nvidia_resiliency_ext")]
    assert {t["state"] for t in core} == {"pending" if NVRX else "not_applicable"}
    table = cli("--no-import")
    # lines of at most 100 characters, but where one word (a module's name) is longer
    assert all(len(line) <= 100 or " " not in line.strip() for line in table.splitlines()), table
    rows, module = [], None
    for line in table.split("\ntargets, by module")[1].split("\n\n")[0].splitlines()[1:]:
        if not line.startswith("    "):
            module = line.strip()  # a module's heading
        elif not line.startswith("      "):  # a target's row (a reason is indented further)
            fix, state, attr = line.split()
            rows.append([fix, f"{module}:{attr}", state])
    assert sorted(rows) == sorted(
        [t["fix"], t["target"], t["state"]] for t in status["targets"]
    )  # a fix column


@pytest.mark.skipif(
    not (NVRX and EXPECT[NVRX]["cache"]),
    reason="doctor says it only where an NVRx with the IPC cache is installed",
)
def test_doctor_the_status_and_no_import_word_the_automatic_release_alike():
    """One wording of the automatic release's strategy, the driver probed alike: here, on a
    machine without the CUDA driver's process checkpoint API, ``restart`` and why (doctor said
    so while the status said ``suspend`` if the driver could, and ``--no-import`` a third
    thing)."""
    from nvrx_ipc_fix.core.status import SUSPEND_NOT_PROBED

    rc, out, err = run_process([sys.executable, "-m", "nvrx_ipc_fix", "doctor", "--json"])
    (line,) = [c["text"] for c in json.loads(out)["checks"] if c["label"] == "automatic release"]
    status = json.loads(cli("--json"))["suspend"]
    no_import = json.loads(cli("--json", "--no-import"))["suspend"]
    assert status == no_import == f"{line}; 0 suspend(s), 0 resume(s), 0 suspended now", out
    assert line != SUSPEND_NOT_PROBED
    if not GPU:
        assert line.startswith("restart: suspend is not used here ("), line


#: The distribution that ships each target module (NeMo RL's and slime's: none named).
SHIPPED_BY = (
    ("nvidia_resiliency_ext.", "nvidia-resiliency-ext"),
    ("megatron.bridge.", "megatron-bridge"),
    ("megatron.", "megatron-core"),
)


def _installed(dist):
    try:
        return metadata.version(dist) is not None
    except metadata.PackageNotFoundError:
        return False


def test_a_target_waits_only_for_what_is_installed():
    """One rule for every target before its module is imported (docs/verify.md, "The
    states"): ``not_applicable`` where the fix cannot apply (the distribution that ships the
    module is not installed, or NVRx has no IPC cache for the targets that need it), else
    ``pending``. With megatron-core absent, its targets were ``not_applicable`` for
    worker_watch and mcore_worker_watch but ``pending`` for clear_on_close and
    release_on_offload; with NVRx absent, NVRx's were ``pending``."""
    status = json.loads(cli("status", "--json", "--no-import"))
    for target in status["targets"]:
        module = target["target"].split(":")[0]
        dist = next((d for prefix, d in SHIPPED_BY if module.startswith(prefix)), None)
        if target["fix"] in ("clear_on_close", "release_on_offload") and not module.startswith(
            "nvidia_resiliency_ext."
        ):  # they need NVRx's cache
            if NVRX is None:
                dist = "nvidia-resiliency-ext"
            elif not EXPECT[NVRX]["cache"]:
                assert (target["state"], target["reason"]) == (
                    "not_applicable",
                    f"NVRx {NVRX} has no IPC tensor cache (added in 0.6.0)",
                )
                continue
        wanted = (
            ("not_applicable", f"{dist} is not installed")
            if dist and not _installed(dist)
            else ("pending", f"waiting for `import {module}`")
        )
        assert (target["state"], target["reason"]) == wanted, target


@pytest.mark.once  # the same with any NVRx and wrapt
def test_print_status_is_the_table_and_its_repr_one_short_line():
    seen = run_python("""
        import json, nvrx_ipc_fix
        s = nvrx_ipc_fix.status()
        print(json.dumps([str(s), s.table(), repr(s), [f.name for f in s.fixes]]))
    """)
    text, table, short, fixes = seen
    assert text == table and text.startswith("nvrx-ipc-fix ") and "\ntargets, by module" in text
    assert "\n" not in short and len(short) < 400, short
    assert short.startswith("<Status nvrx-ipc-fix ") and all(f in short for f in fixes), short


@needs_nvrx
@pytest.mark.worker
@pytest.mark.once  # the CLI's own output: the same with any NVRx and wrapt
def test_selftest_without_cuda_says_gpu_memory_was_not_checked():
    rc, out, err = run_process([sys.executable, "-m", "nvrx_ipc_fix", "selftest"], timeout=600)
    lines = out.splitlines()
    assert rc == 0 and len(lines) == 4, out + err
    if " on cuda" in lines[0]:
        assert lines[-1] == "PASS", out
    else:
        assert "held after offload: n/a (no CUDA)" in lines[2], out
        assert lines[-1] == (
            "PASS (no CUDA: GPU memory was not checked; stale tensors and "
            "hangs were, on the CPU stand-in)"
        ), out


def test_disabled_says_so():
    rc, out, _ = run_process([sys.executable, "-m", "nvrx_ipc_fix", "--json"], fix=False)
    status = json.loads(out)
    assert not status["activated"]
    assert {f["state"] for f in status["fixes"]} == {"disabled"}


def test_a_kill_switch_value_it_does_not_understand_is_named_as_set():
    """``NVRX_IPC_FIX_DISABLE=maybe`` turns the package off; status and doctor say 'maybe'."""
    seen = run_python(
        """
        import json, warnings
        warnings.simplefilter("ignore")
        import nvrx_ipc_fix
        from nvrx_ipc_fix.cli import doctor as _doctor
        lines = []
        _doctor.run(out=lines.append)
        print(json.dumps({"reasons": sorted({f.reason for f in nvrx_ipc_fix.status().fixes}),
                          "doctor": lines}))
    """,
        env={"NVRX_IPC_FIX_DISABLE": " Maybe"},
    )
    assert seen["reasons"] == [
        "NVRX_IPC_FIX_DISABLE=' Maybe': not understood, so the whole package is off"
    ]
    fixes = [line for line in seen["doctor"] if line[6:].startswith("fix ")]  # the fix rows
    assert fixes and all("' Maybe'" in line and "=1" not in line for line in fixes), fixes
    assert any(
        line.endswith(
            "NVRX_IPC_FIX_DISABLE: ' Maybe': the package is off (a value the "
            "kill switch does not understand turns it off)"
        )
        for line in seen["doctor"]
    ), seen["doctor"]


@pth_installed
def test_doctor_on_this_install():
    """This env's install: started normally the fix is active; with ``-S`` it cannot be,
    which fails only where the NVRx has the IPC cache."""
    rc, out, err = run_process([sys.executable, "-m", "nvrx_ipc_fix", "doctor"], auto=True)
    assert rc == 0, out + err
    assert "ok    activation: active, source pth" in out
    if NVRX and EXPECT[NVRX]["cache"]:
        assert "ok    fix clear_on_close: active: " in out
    package = os.path.dirname(os.path.dirname(find_spec("nvrx_ipc_fix").origin))
    path = os.pathsep.join([package, sysconfig.get_paths()["purelib"]])  # -S: no site-packages
    rc, out, err = run_process(
        [sys.executable, "-S", "-m", "nvrx_ipc_fix", "doctor"], auto=True, env={"PYTHONPATH": path}
    )
    assert rc == (1 if NVRX and EXPECT[NVRX]["cache"] else 0), out + err
    assert "python -S" in out


@pytest.mark.once  # the CLI's own handling: the same with any NVRx and wrapt
@pytest.mark.parametrize("auto", [False, pytest.param(True, marks=pth_installed)])
def test_doctor_reports_the_settings_it_does_not_understand_and_warns_about_none(auto):
    """Doctor has a line for each setting; the package's own RuntimeWarnings (at the
    ``-m`` import, at start-up, while doctor imports NVRx) would only repeat them."""
    for env in (
        {"NVRX_IPC_FIX_DISABLE": "maybe", "NVRX_IPC_FIX_LOG_LEVEL": "loud"},
        {"NVRX_IPC_FIX_RELEASE": "sometimes", "NVRX_IPC_FIX_LOG_LEVEL": "loud"},
    ):
        rc, out, err = run_process(
            [sys.executable, "-m", "nvrx_ipc_fix", "doctor"], env=env, auto=auto
        )
        assert out.splitlines()[-1].startswith("result: "), out + err
        assert "Warning" not in err, err
        for name, value in env.items():
            assert re.search(rf"^(FAIL|warn)  {name}: {value!r}", out, re.M), out


def test_a_fix_turned_off_by_name_is_disabled_before_and_after_import():
    for flags in (["--no-import"], []):
        rc, out, err = run_process(
            [sys.executable, "-m", "nvrx_ipc_fix", "--json", *flags],
            env={"NVRX_IPC_FIX_DISABLE": "Stale_Guard , worker_watch"},
        )
        assert rc == 0, err
        fixes = {f["name"]: f["state"] for f in json.loads(out)["fixes"]}
        assert fixes["stale_guard"] == fixes["worker_watch"] == "disabled"
        assert fixes["clear_on_close"] != "disabled"
    rc, out, err = run_process(
        [sys.executable, "-m", "nvrx_ipc_fix", "doctor"],
        env={"NVRX_IPC_FIX_DISABLE": "worker_watch"},
    )
    assert "warn  fix worker_watch: disabled: NVRX_IPC_FIX_DISABLE names worker_watch" in out
    assert "warn  NVRX_IPC_FIX_DISABLE: 'worker_watch': worker_watch off" in out


@pytest.mark.once  # the CLI's own handling: the same with any NVRx and wrapt
def test_version_is_the_installed_distribution_s():
    rc, out, err = run_process([sys.executable, "-m", "nvrx_ipc_fix", "--version"])
    assert (rc, out, err) == (0, f"nvrx-ipc-fix {metadata.version('nvrx-ipc-fix')}\n", ""), err


@pytest.mark.once  # the CLI's own handling: the same with any NVRx and wrapt
def test_a_reader_that_leaves_early_gets_no_traceback():
    """``python -m nvrx_ipc_fix | head``: stdout's reader is gone before the output."""
    read, write = os.pipe()
    os.close(read)
    try:
        proc = subprocess.run(
            [sys.executable, "-m", "nvrx_ipc_fix"],
            stdout=write,
            stderr=subprocess.PIPE,
            text=True,
            timeout=120,
        )
    finally:
        os.close(write)
    assert (proc.returncode, proc.stderr) == (141, "")


#: Stands in for ``python2.7``: runs ``-c CODE`` with Python 2.7's version and without the
#: ``importlib.util`` and ``importlib.metadata`` that Python 2 lacks.
PYTHON27 = """#!/bin/sh
exec {python} -c "import sys; sys.version_info = (2, 7, 18, 'final', 0); \\
sys.version = '2.7.18 (default, Apr 20 2020, 00:00:00)'; sys.executable = '$0'; \\
sys.modules['importlib.util'] = sys.modules['importlib.metadata'] = None; \\
exec(sys.argv[1])" "$2"
"""


@pytest.mark.once  # the CLI's own handling: the same with any NVRx and wrapt
def test_doctor_python_names_an_interpreter_too_old_for_the_package(tmp_path):
    fake = tmp_path / "python2.7"
    fake.write_text(PYTHON27.format(python=sys.executable))
    fake.chmod(0o755)
    rc, out, err = run_process(
        [sys.executable, "-m", "nvrx_ipc_fix", "doctor", "--python", str(fake)]
    )
    assert rc == 2, out + err
    assert out.splitlines() == [
        f"FAIL  python: {fake} is Python 2.7.18: nvrx-ipc-fix needs Python >= 3.10",
        "result: not checked: point --python at the interpreter your processes run",
    ]


DOCTOR = """
    import json, sys
    if sys.argv[1:] == ["start-up"]:  # as the .pth does
        import _nvrx_ipc_fix_startup
        _nvrx_ipc_fix_startup.run("pth")
    import nvrx_ipc_fix
    from nvrx_ipc_fix.core import config as _config
    from nvrx_ipc_fix.cli import doctor as _doctor
    lines = []
    code = _doctor.run(out=lines.append)
    print(json.dumps({"code": code, "lines": lines,
                      "settings": [s.name for s in _config.SETTINGS]}))
"""


def doctor_in(tmp_path, env, *args):
    """``doctor`` in a fresh interpreter that sees NVRx 0.6.0's metadata (it needs the fix),
    without start-up activation unless ``args`` is ``("start-up",)``."""
    info = tmp_path / "nvidia_resiliency_ext-0.6.0.dist-info"
    info.mkdir(exist_ok=True)
    (info / "METADATA").write_text(
        "Metadata-Version: 2.1\nName: nvidia-resiliency-ext\nVersion: 0.6.0\n"
    )
    path = os.pathsep.join(p for p in (str(tmp_path), os.environ.get("PYTHONPATH")) if p)
    rc, out, err = run_process(
        [sys.executable, "-c", textwrap.dedent(DOCTOR), *args],
        env={**env, "PYTHONPATH": path},
        auto=bool(args),
    )
    assert rc == 0, err
    return json.loads(out.strip().splitlines()[-1])


def test_doctor_checks_every_setting_the_package_reads(tmp_path):
    """Every NVRX_IPC_FIX_* name in the source is in _config.SETTINGS, and doctor has a
    line for each; a value it does not understand is a problem, with what it uses instead."""
    src = Path(find_spec("nvrx_ipc_fix").origin).parents[1]
    read = set()
    for path in [*src.glob("*.py"), *src.glob("*.pth"), *(src / "nvrx_ipc_fix").rglob("*.py")]:
        read |= set(re.findall(r"NVRX_IPC_FIX_[A-Z][A-Z_]*[A-Z]", path.read_text()))
    seen = doctor_in(tmp_path, {}, "start-up")
    assert read and read == set(seen["settings"]), read ^ set(seen["settings"])
    for name in read:
        assert sum(line.startswith(f"ok    {name}: not set") for line in seen["lines"]) == 1, name
    assert seen["code"] == 0 and seen["lines"][-1].startswith("result: ok: "), seen["lines"]
    bad = {
        "NVRX_IPC_FIX_STRATEGY": (
            "nuke",
            "is not one of flush, terminate, restart, suspend; "
            "using the default (flush for release(), suspend "
            "for the automatic release)",
        ),
        "NVRX_IPC_FIX_STALL_TIMEOUT": ("-3", "is not a number of seconds >= 0 (or inf); using 300"),
        "NVRX_IPC_FIX_RELEASE_TIMEOUT": ("0", "is not a number of seconds > 0 (or inf); using 60"),
        "NVRX_IPC_FIX_PREWARM": (" Maybe", "is not start or off; using off"),
        "NVRX_IPC_FIX_PIN": ("nan", "is not on or off; using on"),
        "NVRX_IPC_FIX_STANDBY": ("maybe", "is not on or off; using on"),
        "NVRX_IPC_FIX_RELEASE": ("", None),
        "NVRX_IPC_FIX_LOG_LEVEL": ("INFO", None),
    }
    env = {name: value for name, (value, _) in bad.items()}
    for how in ((), ("start-up",)):  # not covered, then covered at start-up
        seen = doctor_in(tmp_path, env, *how)
        assert seen["code"] == 1, seen["lines"]
        for name, (value, problem) in bad.items():
            if problem:
                assert f"FAIL  {name}: {value!r} {problem}" in seen["lines"], seen["lines"]
                assert f"{name}={value!r}" in seen["lines"][-1]
            else:
                assert any(
                    line.startswith(f"info  {name}: {value!r}: ") for line in seen["lines"]
                ), seen["lines"]
        assert seen["lines"][-1].endswith("and falls back as said above: fix or unset them.")
    assert seen["lines"][-1].startswith(
        "result: processes started like this one activate "
        "at start-up (pth), before NVRx is imported, but "
    )


def test_doctor_with_the_kill_switch_advises_unsetting_it(tmp_path):
    """Neither ``import nvrx_ipc_fix`` nor the Ray hook can work while it is set."""
    for value in ("1", "maybe"):
        seen = doctor_in(tmp_path, {"NVRX_IPC_FIX_DISABLE": value})
        result = seen["lines"][-1]
        assert seen["code"] == 1
        assert f"NVRX_IPC_FIX_DISABLE={value!r} turns the package off in every process" in result
        assert "unset it" in result and "Other ways" not in result
        assert "import nvrx_ipc_fix` first" not in result and "ray_runtime_env" not in result
    seen = doctor_in(tmp_path, {"NVRX_IPC_FIX_AUTO": "0"})  # there the other ways do work
    assert seen["code"] == 1 and "Other ways: `import nvrx_ipc_fix` first" in seen["lines"][-1]


@pytest.mark.parametrize(
    "name, value, near, off",
    [
        ("NVRX_IPC_FIX_DISABLED", "1", "NVRX_IPC_FIX_DISABLE", True),
        ("nvrx_ipc_fix_disable", "stale_guard", "NVRX_IPC_FIX_DISABLE", True),
        ("NVRX_IPC_FIX_DISABLED", " Off", "NVRX_IPC_FIX_DISABLE", False),
        ("NVRX_IPC_FIX_ENABLE", "1", "NVRX_IPC_FIX_DISABLE", False),  # near, not a typo of it
        ("nvrx_ipc_fix_relese", "never", "NVRX_IPC_FIX_RELEASE", False),
        ("NVRX_IPC_FIX_", "1", None, False),
        ("NVRX_IPC_FIX_QWERTYUIOP", "1", None, False),
    ],
)
def test_doctor_names_an_unknown_variable_and_the_nearest_it_reads(
    tmp_path, name, value, near, off
):
    """A variable the package does not read is a setting not understood (exit 1 where NVRx
    needs the fix); a typo of the kill switch's name set to a true value turns it off."""
    seen = doctor_in(tmp_path, {name: value}, "start-up")
    rows = [line for line in seen["lines"] if line.startswith(f"FAIL  {name}: {value!r} ")]
    assert len(rows) == 1, seen["lines"]
    assert rows[0].endswith(
        (f"did you mean {near}?" if near else "NVRX_IPC_FIX_STRATEGY")
        + ("): taken for the kill switch, the whole package is off" if off else "): ignored")
    ), rows
    result = seen["lines"][-1]
    assert seen["code"] == 1 and not result.startswith("result: ok"), result
    if off:
        assert f"{name}={value!r} turns the package off in every process" in result, result
        assert "fail  activation: not active" in [line.lower() for line in seen["lines"]]
    else:
        assert result.startswith("result: processes started like this one activate at start-up")
        assert result.endswith(
            f"does not understand {name}={value!r} and falls back as said above: fix or unset it."
        )


@pytest.mark.once  # the CLI's own handling: the same with any NVRx and wrapt
def test_json_before_or_after_the_sub_command(tmp_path):
    def run(*args):
        return run_process([sys.executable, "-m", "nvrx_ipc_fix", *args])

    code, text, err = run("doctor")
    *lines, result = text.strip().splitlines()
    rows = [(line[:4].strip().lower(), line[6:].split(": ", 1)[0]) for line in lines]
    assert ("ok", "NVRX_IPC_FIX_PIN") in rows, text
    for args in (["--json", "doctor"], ["doctor", "--json"]):  # the same report, as JSON
        rc, out, err = run(*args)
        report = json.loads(out)
        assert rc == report["exit"] == code and f"result: {report['result']}" == result, out
        assert [(c["level"], c["label"]) for c in report["checks"]] == rows
    for args in (
        ["--json", "status"],
        ["status", "--json"],
        ["--json", "status", "--json"],
        ["--no-import", "--json", "status"],
    ):
        rc, out, err = run(*args)
        assert rc == 0 and json.loads(out)["version"], (args, out, err)
    rc, out, err = run("--no-import", "status", "--json")
    assert {
        t["state"]
        for t in json.loads(out)["targets"]
        if t["target"].startswith("nvidia_resiliency_ext")
    } == {"pending" if NVRX else "not_applicable"}
    fake = tmp_path / "python2.7"
    fake.write_text(PYTHON27.format(python=sys.executable))
    fake.chmod(0o755)
    rc, out, err = run("--json", "doctor", "--python", str(fake))
    assert rc == json.loads(out)["exit"] == 2 and json.loads(out)["checks"][0]["level"] == "fail"
    for args in (
        ["--json", "bundle", str(tmp_path / "b")],
        ["--no-import", "doctor"],
        ["--json", "install-sitecustomize", str(tmp_path / "s")],
    ):
        rc, out, err = run(*args)
        assert rc == 2 and "error: " in err and out == "", (args, err)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["python2.7"]  # nothing written


@pytest.mark.once  # the CLI's own handling: the same with any NVRx and wrapt
@pytest.mark.parametrize(
    "args, usage",
    [
        (["doctor", "--bogus"], "python -m nvrx_ipc_fix doctor [-h]"),
        (["status", "--bogus"], "python -m nvrx_ipc_fix status [-h]"),
        (["bundle", "dir", "--bogus"], "python -m nvrx_ipc_fix bundle [-h]"),
        (["--bogus"], "python -m nvrx_ipc_fix [-h]"),
    ],
)
def test_an_unknown_argument_prints_its_sub_commands_usage(tmp_path, args, usage):
    """The usage of the sub-command the argument was given to (``doctor --bogus`` printed
    the top-level usage), exit 2, nothing written."""
    args = [str(tmp_path / a) if a == "dir" else a for a in args]
    rc, out, err = run_process([sys.executable, "-m", "nvrx_ipc_fix", *args])
    assert rc == 2 and out == "" and err.startswith(f"usage: {usage}"), err
    assert "unrecognized arguments: --bogus" in err and not list(tmp_path.iterdir()), err
