"""``python -m nvrx_ipc_fix`` tells the truth for the NVRx of this environment, or for none."""

import json
import os
import subprocess
import sys
import sysconfig
from importlib.util import find_spec

from conftest import MCORE, NVRX, EXPECT, pth_installed, run_process, run_python


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
    assert watch == ("pending" if NVRX is None else "active",
                     "pending" if MCORE else "not_applicable")
    assert fixes.pop("prewarm") == ("pending" if NVRX is None else
                                    "active" if EXPECT[NVRX]["warmup"] else "not_applicable")
    if NVRX is None:
        assert fixes == {"clear_on_close": "pending", "stale_guard": "pending",
                         "release_on_offload": "not_applicable"}
        assert all("not installed" in t["reason"] for t in status["targets"]
                   if t["target"].startswith("nvidia_resiliency_ext"))
    elif not EXPECT[NVRX]["cache"]:
        assert set(fixes.values()) == {"not_applicable"}
        megatron = [t for t in status["targets"]
                    if t["target"].startswith("megatron") and t["fix"] == "clear_on_close"]
        assert {t["state"] for t in megatron} == {"not_applicable"}
        assert all("has no worker cache" in t["reason"] for t in megatron)
    else:
        assert fixes["clear_on_close"] == "active"
        assert fixes["stale_guard"] == ("fixed_upstream" if EXPECT[NVRX]["upstream_ptrs"]
                                        else "active")
        assert status["features"]["FileSystemWriterAsync._cached_identifiers"] == "set"


def test_table_and_no_import():
    table = cli()
    assert table.startswith("nvrx-ipc-fix ") and "clear_on_close" in table
    status = json.loads(cli("status", "--json", "--no-import"))
    core = [t for t in status["targets"] if t["target"].startswith("nvidia_resiliency_ext")]
    assert {t["state"] for t in core} == {"pending"}


def test_disabled_says_so():
    rc, out, _ = run_process([sys.executable, "-m", "nvrx_ipc_fix", "--json"], fix=False)
    status = json.loads(out)
    assert not status["activated"]
    assert {f["state"] for f in status["fixes"]} == {"disabled"}


def test_a_kill_switch_value_it_does_not_understand_is_named_as_set():
    """``NVRX_IPC_FIX_DISABLE=maybe`` turns the package off; status and doctor say 'maybe'."""
    seen = run_python("""
        import json, warnings
        warnings.simplefilter("ignore")
        import nvrx_ipc_fix
        from nvrx_ipc_fix import _doctor
        lines = []
        _doctor.run(out=lines.append)
        print(json.dumps({"reasons": sorted({f.reason for f in nvrx_ipc_fix.status().fixes}),
                          "doctor": lines}))
    """, env={"NVRX_IPC_FIX_DISABLE": " Maybe"})
    assert seen["reasons"] == ["NVRX_IPC_FIX_DISABLE=' Maybe': not understood, so the whole "
                               "package is off"]
    fixes = [line for line in seen["doctor"] if " fix " in line]
    assert fixes and all("' Maybe'" in line and "=1" not in line for line in fixes), fixes
    assert any(line.endswith("NVRX_IPC_FIX_DISABLE: ' Maybe': the package is off (a value the "
                             "kill switch does not understand turns it off)")
               for line in seen["doctor"]), seen["doctor"]


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
    rc, out, err = run_process([sys.executable, "-S", "-m", "nvrx_ipc_fix", "doctor"], auto=True,
                               env={"PYTHONPATH": path})
    assert rc == (1 if NVRX and EXPECT[NVRX]["cache"] else 0), out + err
    assert "python -S" in out


def test_a_fix_turned_off_by_name_is_disabled_before_and_after_import():
    for flags in (["--no-import"], []):
        rc, out, err = run_process([sys.executable, "-m", "nvrx_ipc_fix", "--json", *flags],
                                   env={"NVRX_IPC_FIX_DISABLE": "Stale_Guard , worker_watch"})
        assert rc == 0, err
        fixes = {f["name"]: f["state"] for f in json.loads(out)["fixes"]}
        assert fixes["stale_guard"] == fixes["worker_watch"] == "disabled"
        assert fixes["clear_on_close"] != "disabled"
    rc, out, err = run_process([sys.executable, "-m", "nvrx_ipc_fix", "doctor"],
                               env={"NVRX_IPC_FIX_DISABLE": "worker_watch"})
    assert "warn  fix worker_watch: disabled: NVRX_IPC_FIX_DISABLE names worker_watch" in out
    assert "warn  NVRX_IPC_FIX_DISABLE: 'worker_watch': worker_watch off" in out


def test_a_reader_that_leaves_early_gets_no_traceback():
    """``python -m nvrx_ipc_fix | head``: stdout's reader is gone before the output."""
    read, write = os.pipe()
    os.close(read)
    try:
        proc = subprocess.run([sys.executable, "-m", "nvrx_ipc_fix"], stdout=write,
                              stderr=subprocess.PIPE, text=True, timeout=120)
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


def test_doctor_python_names_an_interpreter_too_old_for_the_package(tmp_path):
    fake = tmp_path / "python2.7"
    fake.write_text(PYTHON27.format(python=sys.executable))
    fake.chmod(0o755)
    rc, out, err = run_process([sys.executable, "-m", "nvrx_ipc_fix", "doctor", "--python",
                                str(fake)])
    assert rc == 2, out + err
    assert out.splitlines() == [
        f"FAIL  python: {fake} is Python 2.7.18: nvrx-ipc-fix needs Python >= 3.10",
        "result: not checked: point --python at the interpreter your processes run"]
