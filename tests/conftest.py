"""Shared helpers: run code or a save scenario in a process of its own, with a hard timeout.

Everything that patches NVRx runs in a subprocess (hooks, patches and ``sys.modules``
would otherwise leak between tests): a child of the zygote (``tests/zygote.py``: torch
imported once) where that stands for a fresh interpreter, else a fresh interpreter.
Expectations per NVRx version live in ``EXPECT``.
The tox envs install the wheel, whose ``.pth`` activates the package at start-up; children
run with ``NVRX_IPC_FIX_AUTO=0`` unless a test passes ``auto=True``, so that most tests see
what ``import nvrx_ipc_fix`` does.
"""

import json
import os
import shlex
import signal
import subprocess
import sys
import sysconfig
import textwrap
from importlib import metadata
from pathlib import Path

import pytest

from nvrx_ipc_fix.core.detect import NVRX_RELEASES


try:
    NVRX = metadata.version("nvidia-resiliency-ext")
except metadata.PackageNotFoundError:
    NVRX = None

#: What each NVRx release does without the package (measured; README, "What it fixes"), beside
#: what its code has (the package's table, ``detect.NVRX_RELEASES``: cache, upstream_ptrs (PR
#: #314), snapshots (PR #376: the writer copies every CPU tensor of a save; else the worker
#: writes the trainer's own, changed after the schedule: torn), worker_loop (the worker calls
#: PersistentAsyncCaller.async_process_target by name), warmup
#: (AsyncCallsQueue.warmup_persistent_caller: a worker can start before a save)). Measured here:
#:   stale after replace; hang after close
#:   daemon: the persistent worker is daemonic by default (multiprocessing's exit handler
#:   SIGTERMs it)
#:   sigterm: close(abort=True) SIGTERMs the worker and waits sigterm_timeout for it
MEASURED = {
    "0.4.1": dict(stale=False, hang=False, daemon=False, sigterm=False),
    "0.5.0": dict(stale=False, hang=False, daemon=False, sigterm=False),
    "0.6.0": dict(stale=True, hang=True, daemon=True, sigterm=False),
    "0.7.0": dict(stale=False, hang=True, daemon=True, sigterm=True),
}
assert sorted(MEASURED) == sorted(NVRX_RELEASES), "a release measured is one the package knows"
EXPECT = {version: dict(NVRX_RELEASES[version], **found) for version, found in MEASURED.items()}
#: NVRx's main at d8686d9 (2026-08-07), built from its repository for one run of the NVRx
#: tests (docs/versions.md, "NVRx's main"): 0.7.0's code but for the CPU snapshots.
EXPECT["0.7.0.dev89+d8686d9"] = dict(EXPECT["0.7.0"], snapshots=False)
try:
    MCORE = metadata.version("megatron-core")
except metadata.PackageNotFoundError:
    MCORE = None

NO_NVRX = "nvidia-resiliency-ext is not installed in this tox env (the nonvrx env)"


def lacks(what, nvrx=NVRX):
    """A skip reason: ``NVRx <version> <what>``, or that NVRx is not installed at all."""
    return NO_NVRX if nvrx is None else f"NVRx {nvrx} {what}"


needs_nvrx = pytest.mark.skipif(NVRX is None, reason=NO_NVRX)
needs_cache = pytest.mark.skipif(
    not EXPECT.get(NVRX, {}).get("cache"), reason=lacks("has no IPC cache")
)
needs_warmup = pytest.mark.skipif(
    not EXPECT.get(NVRX, {}).get("warmup"), reason=lacks("starts its worker only inside a save")
)
#: Is the package installed here with its .pth (tox installs the wheel), so that every
#: process started from this interpreter, NVRx's spawned worker too, can activate it?
PTH = Path(sysconfig.get_paths()["purelib"], "nvrx_ipc_fix.pth").exists()
pth_installed = pytest.mark.skipif(
    not PTH,
    reason="nvrx-ipc-fix is not installed with its .pth in this interpreter (tox installs it)",
)


def uv(*args, timeout=600):
    """Run uv (requirements/uv.txt) with pip's find-links, never downloading a Python."""
    try:
        from uv import find_uv_bin
    except ImportError:
        pytest.skip("uv is not installed here (requirements/uv.txt)")
    env = dict(os.environ, UV_PYTHON_DOWNLOADS="never")
    if os.environ.get("PIP_FIND_LINKS"):  # where this machine keeps wheels (torch CPU)
        env.setdefault("UV_FIND_LINKS", os.environ["PIP_FIND_LINKS"])
    subprocess.run(
        [find_uv_bin(), *args], check=True, timeout=timeout, env=env, stdout=subprocess.DEVNULL
    )


def expect(key):
    return EXPECT[NVRX][key]


def _temp_directory(prefix):
    """A new directory as ``TMPDIR`` until the generator ends, then removed."""
    import shutil
    import tempfile

    path, before = tempfile.mkdtemp(prefix=prefix), os.environ.get("TMPDIR")
    os.environ["TMPDIR"] = path
    try:
        yield path
    finally:
        if before is None:
            del os.environ["TMPDIR"]
        else:
            os.environ["TMPDIR"] = before
        shutil.rmtree(path, ignore_errors=True)


@pytest.fixture(scope="session", autouse=True)
def _session_temp_directory():
    """The same for the children of module- and session-scoped fixtures, which are set up
    before a test's own directory exists: one directory, removed at the session's end."""
    yield from _temp_directory("nvrx-s-")


@pytest.fixture(autouse=True)
def _children_temp_directory():
    """Each test's children (and theirs: NVRx's workers, multiprocessing's ``pymp-*``) keep
    their temporary files (checkpoints, process-group files) in a directory of the test's
    own, short enough for a manager's socket below it, removed after the test."""
    yield from _temp_directory("nvrx-t-")


def _env(fix, auto, extra=None):
    """A child's environment: the package on (``fix``) or off, start-up activation on
    (``auto``) or off, ``extra``; and ``tests/`` last on its ``PYTHONPATH``, for the harness
    (``harness``), which NVRx's workers, started from the child, import too."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("NVRX_IPC_FIX_")}
    if not fix:
        env["NVRX_IPC_FIX_DISABLE"] = "1"
    if not auto:
        env["NVRX_IPC_FIX_AUTO"] = "0"
    env.update(extra or {})
    path = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    env["PYTHONPATH"] = os.pathsep.join(path + [TESTS] * (TESTS not in path))
    return env


def run_process(args, *, fix=True, auto=False, env=None, timeout=120, fresh=False):
    """Run ``args`` in a new session; kill the whole group (worker included) on timeout. A
    ``python -c``/``-m`` of this interpreter runs as a child of the zygote where that stands
    for a fresh interpreter (``run_codes``), unless ``fresh`` (the test is about start-up)."""
    code = None if fresh or not _forkable(fix, auto, env) else _as_code(args)
    if code is not None:
        return run_codes([code[0]], fix=fix, auto=auto, env=env, timeout=timeout, argv=code[1])[0]
    proc = subprocess.Popen(
        args,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=_env(fix, auto, env),
        start_new_session=True,
    )
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        pytest.fail(f"{args} still running after {timeout} s (backstop watchdog)\n{err[-3000:]}")
    return proc.returncode, out, err


def _as_code(args):
    """``(code, argv)`` of ``[sys.executable, "-c", code, *argv]`` or ``[sys.executable, "-m",
    module, *argv]`` (as ``runpy`` runs it); None for any other command."""
    if len(args) < 3 or args[0] != sys.executable or args[1] not in ("-c", "-m"):
        return None
    if args[1] == "-c":
        return args[2], list(args[3:])  # dedented where it runs (Zygote.start)
    code = f"import runpy; runpy.run_module({args[2]!r}, run_name='__main__', alter_sys=True)"
    return code, list(args[3:])


def last_json(out):
    """The last line of a child's stdout that is a JSON document, parsed: a log line NVRx
    writes as its worker's caller is collected at exit may follow the child's report (a
    logging set-up of megatron-core's writes INFO lines to stdout)."""
    for line in reversed(out.strip().splitlines()):
        try:
            return json.loads(line)
        except ValueError:
            continue
    raise AssertionError(f"no JSON line in the child's stdout:\n{out[-3000:]}")


def run_python(
    code,
    *,
    python=sys.executable,
    flags=(),
    fix=True,
    auto=False,
    env=None,
    timeout=120,
    fresh=False,
):
    """Run ``code`` in a fresh interpreter, or in what stands for one (``run_process``);
    return its last stdout line parsed as JSON."""
    rc, out, err = run_process(
        [python, *flags, "-c", textwrap.dedent(code)],
        fix=fix,
        auto=auto,
        env=env,
        timeout=timeout,
        fresh=fresh,
    )
    assert rc == 0, f"exit {rc}\nstdout:\n{out[-3000:]}\nstderr:\n{err[-3000:]}"
    return last_json(out)


class Zygote:
    """The session's ``tests/zygote.py``: forks children that have torch and NVRx imported."""

    def __init__(self):
        env = _env(True, False)  # start-up activation off: the zygote never imports the package
        self.proc = subprocess.Popen(
            [sys.executable, os.path.join(TESTS, "zygote.py")],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            env=env,
        )
        self.exited, self.lines, self.buffer, self.ready = {}, [], b"", False

    def wait_ready(self):
        """Until it has imported what it preloads (once)."""
        if not self.ready:
            self._read(lambda: "ready" in self.lines[-1] if self.lines else False, 300)
            self.lines.clear()
            self.ready = True

    def start(self, code, env, out, err, argv=()):
        self.wait_ready()
        request = {
            "code": textwrap.dedent(code),
            "argv": list(argv),
            "env": env,
            "cwd": os.getcwd(),
            "out": out,
            "err": err,
        }
        self.proc.stdin.write((json.dumps(request) + "\n").encode())
        self.proc.stdin.flush()
        self._read(lambda: any("rc" not in line for line in self.lines), 60)
        started = next(line for line in self.lines if "rc" not in line)
        self.lines.remove(started)
        return started["pid"]

    def wait(self, pid, timeout):
        """The child's exit status, or None after ``timeout`` seconds."""
        return self.exited.pop(pid) if self._read(lambda: pid in self.exited, timeout) else None

    def _read(self, done, timeout):
        """Read the zygote's replies until ``done()``; False after ``timeout`` seconds. Reads
        the pipe itself (``os.read``): a buffered reader would keep a second reply that came
        in the same chunk where ``select`` does not see it (two ranks exiting at once)."""
        import select
        import time

        deadline = time.monotonic() + timeout
        fd = self.proc.stdout.fileno()
        while not done():
            if b"\n" not in self.buffer:
                left = deadline - time.monotonic()
                if left <= 0 or not select.select([fd], [], [], left)[0]:
                    return False
                chunk = os.read(fd, 65536)
                if not chunk:
                    raise RuntimeError("the test zygote ended")
                self.buffer += chunk
                continue
            line, self.buffer = self.buffer.split(b"\n", 1)
            message = json.loads(line)
            if "rc" in message:
                self.exited[message["pid"]] = message["rc"]
            else:
                self.lines.append(message)
        return True


TESTS = os.path.dirname(os.path.abspath(__file__))
#: A GPU here: CUDA cannot be used in a process forked from one that initialized it, so
#: children are fresh interpreters and NVRx spawns its workers (no zygote, no forkserver).
#: Read from the device nodes, without importing torch.
GPU = any(
    name.startswith("nvidia") and name[6:].isdigit()
    for name in (os.listdir("/dev") if os.path.isdir("/dev") else ())
)
_zygote = []  # the session's Zygote (pytest_sessionstart), or started on first use


def _the_zygote():
    if not _zygote:
        _zygote.append(Zygote())
    return _zygote[0]


def run_code(code, *, fix=True, auto=False, env=None, timeout=120):
    """``run_process([python, "-c", code], ...)``'s result from a child of the zygote (which
    has torch imported), where it stands for a fresh interpreter (``_forkable``); else from
    a fresh interpreter."""
    return run_codes([code], fix=fix, auto=auto, env=env, timeout=timeout)[0]


def _forkable(fix, auto, env):
    """Does a child of the zygote stand for a fresh interpreter with this environment? Not on
    a GPU, not with start-up activation (``auto``), not with a ``PYTHON*`` variable of the
    child's own."""
    startup = {k: v for k, v in _env(fix, auto, env).items() if k.startswith("PYTHON")}
    return (
        not GPU
        and not auto
        and startup == {k: v for k, v in _env(fix, False).items() if k.startswith("PYTHON")}
    )


def run_codes(codes, *, fix=True, auto=False, env=None, timeout=120, argv=()):
    """``run_code`` for each of ``codes``, all running at once (ranks of one job), each with
    ``sys.argv[1:]`` ``argv``; their ``(returncode, stdout, stderr)``. One still running
    after ``timeout`` seconds is killed with its workers and fails the test."""
    child_env = _env(fix, auto, env)
    if not _forkable(fix, auto, env):
        return _run_fresh(codes, fix=fix, auto=auto, env=env, timeout=timeout, argv=argv)
    import tempfile
    import time

    zygote = _the_zygote()
    with tempfile.TemporaryDirectory(prefix="nvrx-ipc-fix-child-") as scratch:
        files = [
            (os.path.join(scratch, f"out{i}"), os.path.join(scratch, f"err{i}"))
            for i in range(len(codes))
        ]
        pids = [
            zygote.start(code, child_env, *paths, argv=argv) for code, paths in zip(codes, files)
        ]
        deadline, codes_out = time.monotonic() + timeout, []
        for pid in pids:
            rc = _zygote[0].wait(pid, max(0.0, deadline - time.monotonic()))
            if rc is None:
                for other in pids:
                    try:
                        os.killpg(other, signal.SIGKILL)
                    except ProcessLookupError:
                        pass
            codes_out.append(rc)
        for pid, rc in zip(pids, codes_out):
            if rc is None:
                _zygote[0].wait(pid, 60)
        results = []
        for rc, (out, err) in zip(codes_out, files):
            with open(out) as o, open(err) as e:
                results.append((rc, o.read(), e.read()))
    if any(rc is None for rc, _, _ in results):
        pytest.fail(
            f"a child still running after {timeout} s (backstop watchdog)\n"
            + "\n".join(err[-2000:] for _, _, err in results)
        )
    return results


class Child:
    """``code`` running in a fresh interpreter, not waited for, for a test that watches it and
    how it exits (its module teardown included). ``pid`` (it leads a session of its own),
    ``out`` and ``err`` (its stdout's and stderr's paths, in ``directory``); ``wait(timeout)``:
    its exit status, or None while it runs."""

    def __init__(self, code, directory, *, fix=True, env=None):
        self.out, self.err = (os.path.join(directory, name) for name in ("stdout", "stderr"))
        with open(self.out, "w") as out, open(self.err, "w") as err:
            self._proc = subprocess.Popen(
                [sys.executable, "-c", textwrap.dedent(code)],
                stdout=out,
                stderr=err,
                env=_env(fix, False, env),
                start_new_session=True,
            )
        self.pid = self._proc.pid

    def wait(self, timeout):
        try:
            return self._proc.wait(timeout)
        except subprocess.TimeoutExpired:
            return None


def _run_fresh(codes, *, fix, auto, env, timeout, argv=()):
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", textwrap.dedent(code), *argv],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=_env(fix, auto, env),
            start_new_session=True,
        )
        for code in codes
    ]
    results = []
    try:
        for proc in procs:
            out, err = proc.communicate(timeout=timeout)
            results.append((proc.returncode, out, err))
    except subprocess.TimeoutExpired:
        pytest.fail(f"a child still running after {timeout} s (backstop watchdog)")
    finally:
        for proc in procs:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
    return results


def scenario(
    steps,
    *,
    fix=True,
    auto=False,
    timeout=60,
    prelude="",
    tensors=8,
    numel=512,
    env=None,
    finalize="blocking",
    no_dist=False,
    starts=None,
    impl="nvrx",
    cached=True,
):
    """Run the real NVRx worker through ``steps`` (see harness.scenario).

    ``prelude`` runs first in the child (to alter NVRx for a test); ``finalize`` and
    ``no_dist`` choose how saves are finalized, ``starts`` how NVRx starts its workers
    (``scenario.Trainer``; default: ``forkserver``, but ``spawn``, NVRx's own way, with
    start-up activation, as users deploy it, and on a GPU), ``impl`` whose worker, ``cached``
    whether the writer caches. The child is one of the zygote's where it can be (``run_code``). The
    scenario's watchdog
    reports a hang as soon as the worker died, or after ``timeout`` s in one save; this
    process's backstop kills everything later. Returns the report, with ``cache_miss``
    (the worker printed "Worker cache miss") added.
    """
    starts = starts or ("spawn" if auto or GPU else "forkserver")
    code = f"""
        import json, os, shutil, tempfile
        {textwrap.dedent(prelude).strip().replace(chr(10), chr(10) + " " * 8)}
        from harness import scenario
        d, pid = tempfile.mkdtemp(), os.getpid()
        try:
            print(json.dumps(scenario.run({list(steps)!r}, d, timeout={timeout},
                                          n_tensors={tensors}, numel={numel},
                                          finalize={finalize!r}, no_dist={no_dist!r},
                                          starts={starts!r}, impl={impl!r},
                                          cached={cached!r})))
        finally:
            if os.getpid() == pid:  # not in fork-exit's child, which leaves through here
                shutil.rmtree(d, ignore_errors=True)
    """
    rc, out, err = run_code(
        code, fix=fix, auto=auto, env=env, timeout=timeout * 2 + 30 * len(steps)
    )
    assert rc == 0, f"exit {rc}\nstdout:\n{out[-3000:]}\nstderr:\n{err[-3000:]}"
    report = last_json(out)
    report["cache_miss"] = "Worker cache miss" in err
    report["stderr"] = err[-3000:]
    return report


def scenario_ranks(
    steps, directory, *, world_size=2, timeout=60, fix=True, env=None, flags=(), backstop=400
):
    """Run ``steps`` (a comma list; ``<step>@<rank>`` runs on that rank only) on
    ``world_size`` gloo ranks at once, meeting in ``directory``, with ``flags`` of ``python
    -m harness.scenario`` (default ``--starts forkserver``), as children of the
    zygote where they can be (``run_codes``); returns each rank's report. A rank still
    running after ``backstop`` seconds is killed with its workers and fails the test."""
    flags = (
        list(flags)
        if "--starts" in flags
        else ["--starts", "spawn" if GPU else "forkserver", *flags]
    )
    codes = []
    for rank in range(world_size):
        args = ["--steps", steps, "--rank", str(rank), "--world-size", str(world_size)]
        args += ["--dir", str(directory), "--timeout", str(timeout), "--numel", "512", *flags]
        codes.append(f"""
        import sys
        from harness.scenario import main
        sys.exit(main({args!r}))
    """)
    reports = []
    for rc, out, err in run_codes(codes, fix=fix, env=env, timeout=backstop):
        assert rc == 0, err[-3000:]
        report = last_json(out)
        report["stderr"] = err[-3000:]
        reports.append(report)
    return reports


# -- the session's summary ---------------------------------------------------------------------

_durations = {}  # test id -> seconds (setup, call and teardown); a module skipped or failed
# at collection counts as one, as pytest's counts do
SLOWEST = 20  # tests the summary lists


def pytest_sessionstart(session):
    """Start the zygote where tests run (not in xdist's controller, not on a GPU): its
    imports overlap the collection, and are waited for once it ends (the session's set-up,
    not the first test's that needs it)."""
    config = session.config
    if not GPU and (
        hasattr(config, "workerinput") or not getattr(config.option, "numprocesses", None)
    ):
        _zygote.append(Zygote())


def pytest_collection_finish(session):
    if _zygote:
        _zygote[0].wait_ready()


@pytest.hookimpl(tryfirst=True)  # before xdist's own, which reads the group
def pytest_collection_modifyitems(items):
    """Tests that share a module-scoped fixture (a scenario run once, asserted on by several
    tests) go to one xdist worker, which then runs it once (``--dist loadgroup``, tox.ini)."""
    for item in items:
        info = getattr(item, "_fixtureinfo", None)
        for name in info.names_closure if info else ():
            defs = info.name2fixturedefs.get(name)
            if defs and defs[-1].scope == "module":
                item.add_marker(pytest.mark.xdist_group(f"{item.module.__name__}.{name}"))
                break


def pytest_runtest_logreport(report):
    _durations[report.nodeid] = _durations.get(report.nodeid, 0.0) + report.duration


def pytest_collectreport(report):
    if not report.passed:  # xdist's controller sees only these, once each
        _durations.setdefault(report.nodeid, getattr(report, "duration", None) or 0.0)


def pytest_terminal_summary(terminalreporter):
    """The outcome counts and the slowest tests; also written to ``$NVRX_TESTS_SUMMARY``
    under a heading that names the run (tox: each env's, which ``toxfile.py`` shows after an
    env that passed in a parallel run). By the controlling process only, under xdist (a
    worker's own would count its share)."""
    if hasattr(terminalreporter.config, "workerinput"):
        return
    counts = ", ".join(
        f"{len(terminalreporter.stats.get(key, []))} {key}"
        for key in ("passed", "failed", "error", "skipped")
        if terminalreporter.stats.get(key)
    )
    total = sum(_durations.values())
    lines = [
        f"tests: {counts or 'none run'} in {total:.0f} s of test time",
        f"slowest {SLOWEST} (seconds, setup and teardown included):",
    ]
    lines += [
        f"{seconds:8.1f}  {test}"
        for test, seconds in sorted(_durations.items(), key=lambda item: -item[1])[:SLOWEST]
    ]
    lines.append(f"{total:8.1f}  all {len(_durations)} tests")
    terminalreporter.write_sep("=", "test times")
    for line in lines:
        terminalreporter.write_line(line)
    if os.environ.get("NVRX_TESTS_SUMMARY"):  # an env may run pytest twice: each its heading
        heading = f"pytest {shlex.join(terminalreporter.config.invocation_params.args)}"
        with open(os.environ["NVRX_TESTS_SUMMARY"], "a") as out:
            out.write("\n".join([heading, *lines]) + "\n")
