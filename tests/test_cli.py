"""``python -m nvrx_ipc_fix`` tells the truth for the NVRx of this environment, or for none."""

import json
import os
import subprocess
import sys
import sysconfig
from importlib.util import find_spec

from conftest import NVRX, EXPECT, pth_installed, run_process


def cli(*args):
    rc, out, err = run_process([sys.executable, "-m", "nvrx_ipc_fix", *args])
    assert rc == 0, err
    return out


def test_json_status_matches_the_installed_nvrx():
    status = json.loads(cli("--json"))
    assert status["nvrx_version"] == NVRX
    assert status["activated"] and status["source"] == "import"
    fixes = {f["name"]: f["state"] for f in status["fixes"]}
    if NVRX is None:
        assert fixes == {"clear_on_close": "pending", "stale_guard": "pending",
                         "release_on_offload": "not_applicable"}
        assert all("not installed" in t["reason"] for t in status["targets"]
                   if t["target"].startswith("nvidia_resiliency_ext"))
    elif not EXPECT[NVRX]["cache"]:
        assert set(fixes.values()) == {"not_applicable"}
        megatron = [t for t in status["targets"] if t["target"].startswith("megatron")]
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
    core = status["targets"][0]
    assert core["state"] == "pending"


def test_disabled_says_so():
    rc, out, _ = run_process([sys.executable, "-m", "nvrx_ipc_fix", "--json"], fix=False)
    status = json.loads(out)
    assert not status["activated"]
    assert {f["state"] for f in status["fixes"]} == {"disabled"}


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
