"""Start-up activation from a real install: the wheel is built once and installed into fresh
virtual environments (no pip, no torch), by pip and by uv, and every check runs in a new
interpreter.

The scripts never import ``nvrx_ipc_fix``; they read ``sys.modules["nvrx_ipc_fix"]``. Where
``doctor`` needs an NVRx with the IPC cache, its metadata alone stands in (``nvrx_meta``):
``doctor`` decides from the installed version. Marked ``install``: tox runs these in the
nonvrx env only, as nothing here depends on NVRx (tests/test_failures.py and test_cli.py
check start-up activation against the real NVRx).
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

from conftest import run_process, run_python, uv

pytestmark = pytest.mark.install

ROOT = Path(__file__).resolve().parents[1]
STARTUP_FILES = ("nvrx_ipc_fix.pth", "nvrx_ipc_fix.start", "_nvrx_ipc_fix_startup.py")
HEAVY = ["torch", "nvidia_resiliency_ext", "wrapt", "logging", "inspect", "dataclasses", "difflib"]
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
    check([sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "-w", str(out), str(ROOT)])
    return next(out.glob("nvrx_ipc_fix-*.whl"))


def make_venv(path, wheel=None, target=None):
    """A venv without pip; the wheel (and the wrapt and packaging of this env) installed into
    its site-packages, or into ``target`` (a directory for PYTHONPATH)."""
    check([sys.executable, "-m", "venv", "--without-pip", str(path)])
    python = str(path / "bin" / "python")
    if wheel:
        deps = [f"{d}=={metadata.version(d)}" for d in ("wrapt", "packaging")]
        where = ["--target", str(target)] if target else []
        check(
            [
                sys.executable,
                "-m",
                "pip",
                "--python",
                python,
                "install",
                "--quiet",
                "--disable-pip-version-check",
                *where,
                str(wheel),
                *deps,
            ]
        )
    site = run_python(
        "import json, sysconfig; print(json.dumps(sysconfig.get_paths()['purelib']))", python=python
    )
    return python, Path(site)


@pytest.fixture(scope="session")
def venv(tmp_path_factory, wheel):
    return make_venv(tmp_path_factory.mktemp("venv") / "v", wheel)


@pytest.fixture(scope="session")
def nvrx_meta(tmp_path_factory):
    """A directory whose only content is the metadata of nvidia-resiliency-ext 0.6.0."""
    root = tmp_path_factory.mktemp("nvrx-meta")
    info = root / "nvidia_resiliency_ext-0.6.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(
        "Metadata-Version: 2.1\nName: nvidia-resiliency-ext\nVersion: 0.6.0\n"
    )
    return root


def probe(python, code="print(json.dumps(report()))", flags=(), env=None):
    return run_python(
        REPORT + textwrap.indent(textwrap.dedent(code), "    "),
        python=python,
        flags=flags,
        env=env,
        auto=True,
    )


def doctor(python, flags=(), env=None):
    rc, out, err = run_process([python, *flags, "-m", "nvrx_ipc_fix", "doctor"], env=env, auto=True)
    assert out.rstrip().splitlines()[-1].startswith("result: "), out + err
    return rc, out


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


def test_the_wheel_ships_what_users_run_and_no_test_harness(wheel):
    """The demo's and ``selftest``'s driver and CUDA stand-in, the ``py.typed`` marker (users'
    type checkers read the package's annotations, PEP 561), and nothing of the tests' harness
    (``tests/harness``: faults, the driver's stand-in, the scenario's extra steps), nor a
    module that names it (a hook for it to set)."""
    with zipfile.ZipFile(wheel) as whl:
        names = whl.namelist()
        modules = sorted(n for n in names if n.endswith(".py"))
        naming = [n for n in modules if "harness" in whl.read(n).decode()]
    assert naming == []
    assert {
        "nvrx_ipc_fix/cli/driver.py",
        "nvrx_ipc_fix/cli/fakecuda.py",
        "nvrx_ipc_fix/cli/runner.py",
    } <= set(modules)
    assert "nvrx_ipc_fix/py.typed" in names, names
    harness = {p.name for p in (ROOT / "tests" / "harness").glob("*.py")} - {"__init__.py"}
    assert (
        harness
        and [
            n
            for n in modules
            if n.rpartition("/")[2] in harness or "/testing/" in n or n.startswith("harness/")
        ]
        == []
    )


def test_the_wheel_carries_the_licence_it_declares(wheel):
    with zipfile.ZipFile(wheel) as whl:
        names = whl.namelist()
        found = [n for n in names if n.endswith(".dist-info/licenses/LICENSE")]
        text = whl.read(found[0]).decode() if found else ""
        meta = whl.read(next(n for n in names if n.endswith(".dist-info/METADATA"))).decode()
    assert "License-Expression: Apache-2.0" in meta.splitlines()
    assert "License-File: LICENSE" in meta.splitlines(), meta[:600]
    assert text == (ROOT / "LICENSE").read_text(), found
    assert "Apache License\n                           Version 2.0, January 2004" in text
    assert "END OF TERMS AND CONDITIONS" in text


def test_pth_activates_at_startup_and_imports_nothing_heavy(venv):
    python, _ = venv
    seen = probe(
        python,
        f"""
        heavy = [m for m in {HEAVY!r} if m in sys.modules]  # before status() loads its types
        print(json.dumps(dict(report(), heavy=heavy)))
    """,
    )
    assert seen["activated"] and seen["source"] == "pth" and seen["requested_by"] == ["pth"]
    assert seen["heavy"] == []
    later = probe(python, "import nvrx_ipc_fix; print(json.dumps(report()))")
    assert later["source"] == "pth" and later["requested_by"] == ["pth"]  # import: no-op
    again = probe(
        python, "import nvrx_ipc_fix; nvrx_ipc_fix.activate()\nprint(json.dumps(report()))"
    )
    assert again["source"] == "pth" and again["requested_by"] == ["pth", "explicit"]


def test_pth_runs_once_when_site_reads_it_again(venv):
    python, site = venv
    seen = probe(
        python,
        f"""
        import site
        site.addsitedir({str(site)!r})  # re-reads every .pth file there
        hooks = sys.modules["nvrx_ipc_fix.core.hooks"]
        print(json.dumps(dict(report(), finders=sys.meta_path.count(hooks._FINDER),
                              ran=sys.modules["_nvrx_ipc_fix_startup"].ran)))
    """,
    )
    assert seen["requested_by"] == ["pth"] and seen["ran"] == ["pth"] and seen["finders"] == 1


@pytest.mark.parametrize(
    "env, expect",
    [
        ({"NVRX_IPC_FIX_AUTO": "0"}, {"imported": False}),
        ({"NVRX_IPC_FIX_AUTO": "off"}, {"imported": False}),
        ({"NVRX_IPC_FIX_DISABLE": "1"}, {"imported": True, "activated": False}),
    ],
    ids=["auto-0", "auto-off", "disable"],
)
def test_switches_at_startup_and_import_afterwards(venv, env, expect):
    python, _ = venv
    seen = probe(
        python,
        """
        before = report()
        import nvrx_ipc_fix
        print(json.dumps({"before": before, "after": report()}))
    """,
        env=env,
    )
    assert {k: seen["before"][k] for k in expect} == expect
    if "NVRX_IPC_FIX_AUTO" in env:  # start-up stayed away, so the import activates
        assert seen["after"]["activated"] and seen["after"]["source"] == "import"
    else:
        assert not seen["after"]["activated"] and seen["after"]["requested_by"] == ["pth"]


def test_auto_values_mean_the_same_before_and_after_import(venv):
    python, _ = venv
    values = ["", "0", "1", "off", "OFF ", "no", "false", "on", "yes", "true", "maybe"]
    seen = probe(
        python,
        f"""
        import os, warnings, _nvrx_ipc_fix_startup as startup
        from nvrx_ipc_fix.core import config as _config
        warnings.simplefilter("ignore")
        same = []
        for value in {values!r}:
            os.environ["NVRX_IPC_FIX_AUTO"] = value
            same.append((value.strip().lower() in startup.ON) == _config.auto())
        print(json.dumps(same))
    """,
    )
    assert all(seen)


def test_start_file_entry_point_activates_like_the_pth(venv):
    """Python 3.15+ runs the .start entry point instead of the .pth line (PEP 829)."""
    python, site = venv
    seen = probe(
        python,
        f"""
        import pkgutil
        before = report()
        with open({str(site / "nvrx_ipc_fix.start")!r}) as start:
            for line in start:
                pkgutil.resolve_name(line.strip())()
        print(json.dumps({{"before": before, "after": report()}}))
    """,
        flags=["-S"],
        env={"PYTHONPATH": str(site)},
    )
    assert not seen["before"]["imported"]
    assert seen["after"]["activated"] and seen["after"]["source"] == "pth"


def test_python_S_is_not_active_and_doctor_says_why(venv, nvrx_meta):
    python, site = venv
    env = {"PYTHONPATH": f"{site}{os.pathsep}{nvrx_meta}"}
    assert not probe(python, flags=["-S"], env=env)["imported"]
    rc, out = doctor(python, flags=["-S"], env=env)
    assert rc == 1
    assert "FAIL  nvrx_ipc_fix.pth:" in out and "python -S" in out
    assert "FAIL  activation: active, source import" in out
    rc, out = doctor(python, env={"PYTHONPATH": str(nvrx_meta)})  # the same, without -S
    assert rc == 0 and "ok    nvrx_ipc_fix.pth:" in out and "source pth" in out


def test_doctor_fails_on_switches_only_when_nvrx_needs_the_fix(venv, nvrx_meta):
    python, _ = venv
    for switch in ({"NVRX_IPC_FIX_AUTO": "0"}, {"NVRX_IPC_FIX_DISABLE": "1"}):
        name = next(iter(switch))
        rc, out = doctor(python, env={**switch, "PYTHONPATH": str(nvrx_meta)})
        assert rc == 1 and f"FAIL  {name}: " in out, out
        rc, out = doctor(python, env=switch)  # no NVRx installed: nothing to fix
        assert rc == 0 and f"warn  {name}: " in out, out


@pytest.fixture
def target_install(tmp_path, wheel):
    """A bare venv, and the wheel installed with ``pip --target`` into a PYTHONPATH directory."""
    python, _ = make_venv(tmp_path / "bare", wheel, target=tmp_path / "lib")
    return python, tmp_path / "lib"


def test_pythonpath_install_doctor_names_the_fallback_and_sitecustomize_activates(
    target_install, nvrx_meta
):
    python, lib = target_install
    env = {"PYTHONPATH": os.pathsep.join([str(lib), str(nvrx_meta)])}
    assert not probe(python, env=env)["imported"]
    rc, out = doctor(python, env=env)
    assert rc == 1 and "reached through PYTHONPATH" in out
    assert f"python -m nvrx_ipc_fix install-sitecustomize {lib}" in out

    rc, out, err = run_process(
        [python, "-m", "nvrx_ipc_fix", "install-sitecustomize", str(lib)], env=env
    )
    assert rc == 0, err
    seen = probe(python, env=env)
    assert seen["activated"] and seen["source"] == "sitecustomize"
    rc, out = doctor(python, env=env)
    assert rc == 0 and "ok    sitecustomize: the fallback ran at start-up" in out, out


def test_sitecustomize_runs_the_one_it_hides_even_after_uninstall(target_install, tmp_path):
    python, lib = target_install
    ours, theirs, mark = tmp_path / "ours", tmp_path / "theirs", tmp_path / "mark"
    theirs.mkdir()
    (theirs / "sitecustomize.py").write_text(
        "import os\nopen(os.environ['MARK'], 'a').write(__file__ + '\\n')\n"
    )
    cli = [python, "-m", "nvrx_ipc_fix", "install-sitecustomize"]
    env = {"PYTHONPATH": str(lib), "MARK": str(mark)}
    for directory, code in ((ours, 0), (ours, 0), (theirs, 1)):  # rewrites ours, never theirs
        rc, _, _ = run_process([*cli, str(directory)], env=env)
        assert rc == code
    assert "MARK" in (theirs / "sitecustomize.py").read_text()

    env["PYTHONPATH"] = os.pathsep.join([str(ours), str(lib), str(theirs)])
    seen = probe(
        python,
        """
        print(json.dumps(dict(report(), module=sys.modules["sitecustomize"].__file__)))
    """,
        env=env,
    )
    assert seen["source"] == "sitecustomize"
    assert seen["module"] == str(theirs / "sitecustomize.py")
    assert mark.read_text().splitlines() == [str(theirs / "sitecustomize.py")]

    env["PYTHONPATH"] = os.pathsep.join([str(ours), str(theirs)])  # the package is gone
    rc, out, err = run_process(
        [python, "-c", "import sys; print('sitecustomize' in sys.modules)"], env=env
    )
    assert (rc, out.strip(), err) == (0, "True", "")
    assert len(mark.read_text().splitlines()) == 2


def test_spawn_and_forkserver_children_are_active(venv, tmp_path):
    python, _ = venv
    script = tmp_path / "children.py"
    script.write_text(
        textwrap.dedent(REPORT)
        + textwrap.dedent("""
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
    """)
    )
    rc, out, err = run_process([python, str(script)], auto=True)
    assert rc == 0, err
    seen = json.loads(out.strip().splitlines()[-1])
    assert len({s["pid"] for s in seen.values()}) == 3
    for who in ("parent", "spawn", "forkserver"):
        assert seen[who]["activated"] and seen[who]["source"] == "pth", (who, seen)


def test_uninstall_removes_the_startup_files_and_leftovers_are_harmless(tmp_path, wheel):
    python, site = make_venv(tmp_path / "v", wheel)
    check(
        [
            sys.executable,
            "-m",
            "pip",
            "--python",
            python,
            "uninstall",
            "--yes",
            "--quiet",
            "nvrx-ipc-fix",
        ]
    )
    assert [name for name in STARTUP_FILES if (site / name).exists()] == []
    with zipfile.ZipFile(wheel) as whl:  # a half uninstall leaves the start-up files behind
        whl.extract("nvrx_ipc_fix.pth", site)
        rc, out, err = run_process([python, "-c", "pass"], auto=True)
        assert (rc, out, err) == (0, "", "")
        whl.extract("_nvrx_ipc_fix_startup.py", site)
        rc, out, err = run_process([python, "-c", "pass"], auto=True)
        assert (rc, out, err) == (0, "", "")
    rc, _, err = run_process(
        [python, "-c", "pass"], auto=True, env={"NVRX_IPC_FIX_LOG_LEVEL": "debug"}
    )
    assert rc == 0 and "start-up activation (pth) failed: ModuleNotFoundError" in err


def test_uv_venv_and_uv_pip_install_activate_at_startup_and_uninstall_cleanly(
    tmp_path, wheel, nvrx_meta
):
    venv = tmp_path / "uv-venv"
    uv("venv", "--quiet", "--python", sys.executable, str(venv))
    python = str(venv / "bin" / "python")
    deps = [f"{d}=={metadata.version(d)}" for d in ("wrapt", "packaging")]
    uv("pip", "install", "--quiet", "--python", python, str(wheel), *deps)
    seen = probe(python)
    assert seen["activated"] and seen["source"] == "pth" and seen["requested_by"] == ["pth"]
    rc, out = doctor(python, env={"PYTHONPATH": str(nvrx_meta)})
    assert rc == 0 and "ok    activation: active, source pth" in out, out
    site = Path(
        run_python(
            "import json, sysconfig; print(json.dumps(sysconfig.get_paths()['purelib']))",
            python=python,
        )
    )
    uv("pip", "uninstall", "--quiet", "--python", python, "nvrx-ipc-fix")
    assert [name for name in STARTUP_FILES if (site / name).exists()] == []
    assert not probe(python)["imported"]


def test_uv_run_with_the_wheel_activates_at_startup(tmp_path, wheel):
    deps = [f"--with={d}=={metadata.version(d)}" for d in ("wrapt", "packaging")]
    script = tmp_path / "probe.py"
    script.write_text(textwrap.dedent(REPORT) + "print(json.dumps(report()))\n")
    from uv import find_uv_bin

    rc, out, err = run_process(
        [
            find_uv_bin(),
            "run",
            "--quiet",
            "--no-project",
            "--python",
            sys.executable,
            f"--with={wheel}",
            *deps,
            str(script),
        ],
        auto=True,
        env={"UV_PYTHON_DOWNLOADS": "never"},
        timeout=300,
    )
    assert rc == 0, err
    seen = json.loads(out.strip().splitlines()[-1])
    assert seen["activated"] and seen["source"] == "pth" and seen["requested_by"] == ["pth"]


def test_bundle_on_pythonpath_activates_a_bare_venv(tmp_path, venv):
    """``bundle DIR``: a venv with neither the package nor wrapt, and DIR on PYTHONPATH."""
    python, _ = venv
    bundle = tmp_path / "bundle"
    rc, out, err = run_process([python, "-m", "nvrx_ipc_fix", "bundle", str(bundle)], auto=True)
    assert rc == 0 and f"export PYTHONPATH={bundle}" in out, err
    bare = tmp_path / "bare"
    check([sys.executable, "-m", "venv", "--without-pip", str(bare)])
    bare_python = str(bare / "bin" / "python")
    seen = probe(
        bare_python,
        """
        before = report()
        import wrapt
        print(json.dumps(dict(before, wrapt=wrapt.__file__, path_end=sys.path[-1])))
    """,
        env={"PYTHONPATH": str(bundle)},
    )
    assert seen["activated"] and seen["source"] == "sitecustomize"
    assert seen["wrapt"].startswith(str(bundle / "_nvrx_ipc_fix_deps"))
    assert seen["path_end"] == str(bundle / "_nvrx_ipc_fix_deps")  # the venv's own wrapt wins
    assert not probe(bare_python)["imported"]  # nothing was written into the venv


def test_bundle_refuses_what_it_did_not_write_and_refreshes_its_own(tmp_path, venv):
    python, _ = venv
    cli = [python, "-m", "nvrx_ipc_fix", "bundle"]
    bundle = tmp_path / "bundle"
    assert run_process([*cli, str(bundle)])[0] == 0
    (bundle / "nvrx_ipc_fix" / "stale.py").write_text("")
    assert run_process([*cli, str(bundle)])[0] == 0  # refreshed: our own files replaced
    assert not (bundle / "nvrx_ipc_fix" / "stale.py").exists()
    busy = tmp_path / "busy"
    busy.mkdir()
    (busy / "keep.txt").write_text("x")
    afile = tmp_path / "afile"
    afile.write_text("x")
    for target, why in (
        (busy, "is not empty and holds no bundle"),
        (afile, "is not a directory"),
        (afile / "sub", "cannot write the bundle"),
    ):  # unwritable, even as root
        rc, out, err = run_process([*cli, str(target)])
        assert rc == 1 and why in err, (target, out, err)
    assert sorted(p.name for p in busy.iterdir()) == ["keep.txt"]
    assert afile.read_text() == "x"


def test_doctor_python_checks_another_interpreter_and_says_when_it_cannot(
    tmp_path, venv, nvrx_meta
):
    python, _ = venv
    bare = tmp_path / "bare"
    check([sys.executable, "-m", "venv", "--without-pip", str(bare)])
    env = {"PYTHONPATH": str(nvrx_meta)}  # NVRx 0.6.0's metadata, in both interpreters

    def doctor_for(target):
        rc, out, err = run_process(
            [python, "-m", "nvrx_ipc_fix", "doctor", "--python", str(target)], auto=True, env=env
        )
        assert out.rstrip().splitlines()[-1].startswith("result: "), out + err
        return rc, out

    rc, out = doctor_for(bare / "bin" / "python")
    assert rc == 1 and "FAIL  package: nvrx_ipc_fix is not importable by " in out
    assert "info  NVRx: 0.6.0: has the IPC tensor cache" in out
    rc, out = doctor_for(python)  # there the package is installed: its own doctor runs
    assert rc == 0 and f"({python})" in out and "ok    activation: active, source pth" in out
    for target in (tmp_path / "missing", "/bin/true", tmp_path):
        rc, out = doctor_for(target)
        assert rc == 2 and "FAIL  python: cannot run" in out and "result: not checked" in out
    env = {}  # no NVRx there: nothing needs the fix
    rc, out = doctor_for(bare / "bin" / "python")
    assert rc == 0 and "warn  package: nvrx_ipc_fix is not importable" in out


@pytest.mark.skipif(
    sys.version_info >= (3, 13),
    reason="pip finds no NVRx 0.6.0 wheel for "
    "Python 3.13 (install_wheel.py serves the py311 envs and scripts/demo)",
)
def test_install_wheel_keeps_one_version_and_names_the_ones_it_knows(tmp_path):
    """scripts/demo 0.7.0 and then scripts/demo used to leave two NVRx dist-infos."""
    python, site = make_venv(tmp_path / "v")
    script = [sys.executable, str(ROOT / "requirements" / "install_wheel.py"), "--python", python]
    for version in ("0.7.0", "0.6.0"):
        rc, out, err = run_process([*script, f"nvidia-resiliency-ext=={version}"], timeout=300)
        assert rc == 0, err
    assert [p.name for p in site.glob("nvidia_resiliency_ext-*")] == [
        "nvidia_resiliency_ext-0.6.0.dist-info"
    ]
    rc, out, err = run_process([*script, "nvidia-resiliency-ext==0.8.0"])
    assert rc == 2 and "no wheel known for nvidia-resiliency-ext==0.8.0" in err
    assert "nvidia-resiliency-ext==0.7.0" in err and "Traceback" not in err


#: Stands for Python in the demo's venv: records its arguments and the index settings pip sees.
RECORDING_PYTHON = """#!/bin/sh
{ echo "ARGS $*"; env | grep -E '^PIP_(INDEX_URL|EXTRA_INDEX_URL|FIND_LINKS)=' | sort; } \\
    >> "$DEMO_LOG"
"""


@pytest.mark.parametrize(
    "given, pip_sees",
    [
        (
            {
                "UV_EXTRA_INDEX_URL": "https://download.pytorch.org/whl/cpu",
                "UV_INDEX_URL": "https://mirror.example/simple",
                "UV_FIND_LINKS": "/srv/wheels",
            },
            {
                "PIP_EXTRA_INDEX_URL": "https://download.pytorch.org/whl/cpu",
                "PIP_INDEX_URL": "https://mirror.example/simple",
                "PIP_FIND_LINKS": "/srv/wheels",
            },
        ),
        (
            {
                "UV_DEFAULT_INDEX": "https://mirror.example/simple",
                "UV_INDEX": "pytorch=https://download.pytorch.org/whl/cpu https://other.example/simple",
            },
            {
                "PIP_INDEX_URL": "https://mirror.example/simple",
                "PIP_EXTRA_INDEX_URL": "https://download.pytorch.org/whl/cpu https://other.example/simple",
            },
        ),
        (
            {
                "PIP_EXTRA_INDEX_URL": "https://pip.example/simple",
                "UV_EXTRA_INDEX_URL": "https://download.pytorch.org/whl/cpu",
            },  # pip's own comes first
            {"PIP_EXTRA_INDEX_URL": "https://pip.example/simple"},
        ),
    ],
    ids=["uv", "uv-index", "pip-first"],
)
def test_the_demo_installs_with_pip_where_pip_or_uv_is_told_to_look(tmp_path, given, pip_sees):
    """scripts/demo installs torch's CPU build with pip: it honours pip's PIP_INDEX_URL,
    PIP_EXTRA_INDEX_URL and PIP_FIND_LINKS, and where they are unset uv's (the variables
    docs/testing.md gives for scripts/test)."""
    root = tmp_path / "clone"
    (root / "scripts").mkdir(parents=True)
    (root / "scripts" / "demo").write_text((ROOT / "scripts" / "demo").read_text())
    (root / "scripts" / "demo").chmod(0o755)
    bin_dir = tmp_path / "bin"  # python3.11 -m venv .venv-demo: the recording Python
    bin_dir.mkdir()
    (bin_dir / "python3.11").write_text(
        '#!/bin/sh\nmkdir -p "$3/bin"\ncat > "$3/bin/python" <<"END"\n'
        + RECORDING_PYTHON
        + 'END\nchmod +x "$3/bin/python"\n'
    )
    (bin_dir / "python3.11").chmod(0o755)
    log = tmp_path / "log"
    env = {
        "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}",
        "DEMO_LOG": str(log),
        "PIP_INDEX_URL": "",
        "PIP_EXTRA_INDEX_URL": "",
        "PIP_FIND_LINKS": "",
        **given,
    }
    env.update(
        {
            k: ""
            for k in (
                "UV_INDEX_URL",
                "UV_DEFAULT_INDEX",
                "UV_EXTRA_INDEX_URL",
                "UV_INDEX",
                "UV_FIND_LINKS",
            )
            if k not in given
        }
    )
    rc, out, err = run_process([str(root / "scripts" / "demo")], env=env)
    assert rc == 0, out + err
    runs = log.read_text().split("ARGS ")[1:]
    torch = next(run for run in runs if "requirements/torch-cpu.txt" in run)
    seen = dict(line.split("=", 1) for line in torch.splitlines()[1:])
    assert {k: v for k, v in seen.items() if v} == pip_sees
