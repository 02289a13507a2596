"""Start-up activation from a real install: the wheel is built once and installed into fresh
virtual environments (no pip, no torch), and every check runs in a new interpreter.

The scripts never import ``nvrx_ipc_fix``; they read ``sys.modules["nvrx_ipc_fix"]``.
Marked ``install``: tox runs these in the nonvrx env only, as nothing here depends on NVRx
(tests/test_failures.py checks start-up activation against the real NVRx).
"""

import json
import os
import subprocess
import sys
import textwrap
import zipfile
from importlib import metadata
from pathlib import Path

import pytest

from conftest import run_process, run_python

pytestmark = pytest.mark.install

ROOT = Path(__file__).resolve().parents[1]
STARTUP_FILES = ("nvrx_ipc_fix.pth", "nvrx_ipc_fix.start", "_nvrx_ipc_fix_startup.py")
HEAVY = ["torch", "nvidia_resiliency_ext", "wrapt", "logging", "inspect", "dataclasses"]
REPORT = """
    import json, os, sys
    def report():
        m = sys.modules.get("nvrx_ipc_fix")
        s = m and m.status()
        return {"imported": m is not None, "activated": bool(s and s.activated),
                "source": s and s.source, "requested_by": list(s.requested_by) if s else [],
                "pid": os.getpid()}
"""


def check(args, timeout=300):
    subprocess.run(args, check=True, timeout=timeout, stdout=subprocess.DEVNULL)


@pytest.fixture(scope="session")
def wheel(tmp_path_factory):
    out = tmp_path_factory.mktemp("wheel")
    check([sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "-w", str(out),
           str(ROOT)])
    return next(out.glob("nvrx_ipc_fix-*.whl"))


def make_venv(path, wheel=None):
    """A venv without pip; the wheel (and the wrapt and packaging of this env) installed."""
    check([sys.executable, "-m", "venv", "--without-pip", str(path)])
    python = str(path / "bin" / "python")
    if wheel:
        deps = [f"{d}=={metadata.version(d)}" for d in ("wrapt", "packaging")]
        check([sys.executable, "-m", "pip", "--python", python, "install", "--quiet",
               "--disable-pip-version-check", str(wheel), *deps])
    site = run_python("import json, sysconfig; print(json.dumps(sysconfig.get_paths()['purelib']))",
                      python=python)
    return python, Path(site)


@pytest.fixture(scope="session")
def venv(tmp_path_factory, wheel):
    return make_venv(tmp_path_factory.mktemp("venv") / "v", wheel)


def probe(python, code="print(json.dumps(report()))", flags=(), env=None, auto=True):
    return run_python(REPORT + textwrap.indent(textwrap.dedent(code), "    "), python=python,
                      flags=flags, env=env, auto=auto)


def test_the_wheel_puts_the_startup_files_at_its_root_and_in_record(wheel):
    with zipfile.ZipFile(wheel) as whl:
        record = whl.read(next(n for n in whl.namelist() if n.endswith("/RECORD"))).decode()
        pth = whl.read("nvrx_ipc_fix.pth").decode()
        start = whl.read("nvrx_ipc_fix.start").decode()
    assert {line.split(",")[0] for line in record.splitlines()} >= set(STARTUP_FILES)
    lines = [line for line in pth.splitlines() if line and not line.startswith("#")]
    assert len(lines) == 1 and lines[0].startswith("import sys; exec(")
    assert "except Exception" in lines[0]
    assert start.split() == ["_nvrx_ipc_fix_startup:run"]


def test_pth_activates_at_startup_and_imports_nothing_heavy(venv):
    python, _ = venv
    seen = probe(python, f"""
        heavy = [m for m in {HEAVY!r} if m in sys.modules]  # before status() loads its types
        print(json.dumps(dict(report(), heavy=heavy)))
    """)
    assert seen["activated"] and seen["source"] == "pth" and seen["requested_by"] == ["pth"]
    assert seen["heavy"] == []
    later = probe(python, "import nvrx_ipc_fix; print(json.dumps(report()))")
    assert later["source"] == "pth" and later["requested_by"] == ["pth"]  # import: no-op
    again = probe(python, "import nvrx_ipc_fix; nvrx_ipc_fix.activate()\n"
                          "print(json.dumps(report()))")
    assert again["source"] == "pth" and again["requested_by"] == ["pth", "explicit"]


def test_pth_runs_once_when_site_reads_it_again(venv):
    python, site = venv
    seen = probe(python, f"""
        import site
        site.addsitedir({str(site)!r})  # re-reads every .pth file there
        hooks = sys.modules["nvrx_ipc_fix._hooks"]
        print(json.dumps(dict(report(), finders=sys.meta_path.count(hooks._FINDER),
                              ran=sys.modules["_nvrx_ipc_fix_startup"].ran)))
    """)
    assert seen["requested_by"] == ["pth"] and seen["ran"] == ["pth"] and seen["finders"] == 1


@pytest.mark.parametrize("env, expect", [
    ({"NVRX_IPC_FIX_AUTO": "0"}, {"imported": False}),
    ({"NVRX_IPC_FIX_AUTO": "off"}, {"imported": False}),
    ({"NVRX_IPC_FIX_DISABLE": "1"}, {"imported": True, "activated": False}),
], ids=["auto-0", "auto-off", "disable"])
def test_switches_at_startup_and_import_afterwards(venv, env, expect):
    python, _ = venv
    seen = probe(python, """
        before = report()
        import nvrx_ipc_fix
        print(json.dumps({"before": before, "after": report()}))
    """, env=env)
    assert {k: seen["before"][k] for k in expect} == expect
    if "NVRX_IPC_FIX_AUTO" in env:  # start-up stayed away, so the import activates
        assert seen["after"]["activated"] and seen["after"]["source"] == "import"
    else:
        assert not seen["after"]["activated"] and seen["after"]["requested_by"] == ["pth"]


def test_auto_values_mean_the_same_before_and_after_import(venv):
    python, _ = venv
    values = ["", "0", "1", "off", "OFF ", "no", "false", "on", "yes", "true", "maybe"]
    seen = probe(python, f"""
        import os, warnings, _nvrx_ipc_fix_startup as startup
        from nvrx_ipc_fix import _config
        warnings.simplefilter("ignore")
        same = []
        for value in {values!r}:
            os.environ["NVRX_IPC_FIX_AUTO"] = value
            same.append((value.strip().lower() in startup.OFF) == (not _config.auto()))
        print(json.dumps(same))
    """)
    assert all(seen)


def test_start_file_entry_point_activates_like_the_pth(venv):
    """Python 3.15+ runs the .start entry point instead of the .pth line (PEP 829)."""
    python, site = venv
    seen = probe(python, f"""
        import pkgutil
        before = report()
        with open({str(site / "nvrx_ipc_fix.start")!r}) as start:
            for line in start:
                pkgutil.resolve_name(line.strip())()
        print(json.dumps({{"before": before, "after": report()}}))
    """, flags=["-S"], env={"PYTHONPATH": str(site)})
    assert not seen["before"]["imported"]
    assert seen["after"]["activated"] and seen["after"]["source"] == "pth"


def test_spawn_and_forkserver_children_are_active(venv, tmp_path):
    python, _ = venv
    script = tmp_path / "children.py"
    script.write_text(textwrap.dedent(REPORT) + textwrap.dedent("""
        import multiprocessing

        def child(queue):
            queue.put(report())

        if __name__ == "__main__":
            seen = {"parent": report()}
            for method in ("spawn", "forkserver"):
                ctx = multiprocessing.get_context(method)
                queue = ctx.Queue()
                proc = ctx.Process(target=child, args=(queue,))
                proc.start()
                seen[method] = queue.get(timeout=60)
                proc.join(60)
            print(json.dumps(seen))
    """))
    rc, out, err = run_process([python, str(script)], auto=True)
    assert rc == 0, err
    seen = json.loads(out.strip().splitlines()[-1])
    assert len({s["pid"] for s in seen.values()}) == 3
    for who in ("parent", "spawn", "forkserver"):
        assert seen[who]["activated"] and seen[who]["source"] == "pth", (who, seen)


def test_uninstall_removes_the_startup_files_and_leftovers_are_harmless(tmp_path, wheel):
    python, site = make_venv(tmp_path / "v", wheel)
    check([sys.executable, "-m", "pip", "--python", python, "uninstall", "--yes", "--quiet",
           "nvrx-ipc-fix"])
    assert [name for name in STARTUP_FILES if (site / name).exists()] == []
    with zipfile.ZipFile(wheel) as whl:  # a half uninstall leaves the start-up files behind
        whl.extract("nvrx_ipc_fix.pth", site)
        rc, out, err = run_process([python, "-c", "pass"], auto=True)
        assert (rc, out, err) == (0, "", "")
        whl.extract("_nvrx_ipc_fix_startup.py", site)
        rc, out, err = run_process([python, "-c", "pass"], auto=True)
        assert (rc, out, err) == (0, "", "")
    rc, _, err = run_process([python, "-c", "pass"], auto=True,
                             env={"NVRX_IPC_FIX_LOG_LEVEL": "debug"})
    assert rc == 0 and "start-up activation (pth) failed: ModuleNotFoundError" in err
