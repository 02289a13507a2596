"""``python -m nvrx_ipc_fix`` tells the truth for the NVRx of this environment, or for none."""

import json
import sys

from conftest import NVRX, EXPECT, run_process


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
        assert fixes == {"clear_on_close": "pending", "stale_guard": "pending"}
        assert all("not installed" in t["reason"] for t in status["targets"]
                   if t["target"].startswith("nvidia_resiliency_ext"))
    elif not EXPECT[NVRX]["cache"]:
        assert fixes == {"clear_on_close": "not_applicable", "stale_guard": "not_applicable"}
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
