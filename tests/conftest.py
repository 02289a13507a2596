"""Shared helpers: run code or a save scenario in a fresh interpreter, with a hard timeout.

Everything that patches NVRx runs in a subprocess (hooks, patches and ``sys.modules``
would otherwise leak between tests). Expectations per NVRx version live in ``EXPECT``.
The tox envs install the wheel, whose ``.pth`` activates the package at start-up; children
run with ``NVRX_IPC_FIX_AUTO=0`` unless a test passes ``auto=True``, so that most tests see
what ``import nvrx_ipc_fix`` does.
"""

import json
import os
import signal
import subprocess
import sys
import sysconfig
import textwrap
from importlib import metadata
from pathlib import Path

import pytest

try:
    NVRX = metadata.version("nvidia-resiliency-ext")
except metadata.PackageNotFoundError:
    NVRX = None

#: What each NVRx release does without the package (measured; README, "What it fixes").
EXPECT = {
    #        cache   stale after replace   hang after close   pointer check (PR #314)
    #        worker_loop: the worker calls PersistentAsyncCaller.async_process_target by name
    #        warmup: AsyncCallsQueue.warmup_persistent_caller (a worker can start before a save)
    "0.4.1": dict(cache=False, stale=False, hang=False, upstream_ptrs=False, worker_loop=False,
                  warmup=False),
    "0.5.0": dict(cache=False, stale=False, hang=False, upstream_ptrs=False, worker_loop=True,
                  warmup=False),
    "0.6.0": dict(cache=True, stale=True, hang=True, upstream_ptrs=False, worker_loop=True,
                  warmup=True),
    "0.7.0": dict(cache=True, stale=False, hang=True, upstream_ptrs=True, worker_loop=True,
                  warmup=True),
}
try:
    MCORE = metadata.version("megatron-core")
except metadata.PackageNotFoundError:
    MCORE = None

NO_NVRX = "nvidia-resiliency-ext is not installed in this tox env (the nonvrx env)"


def lacks(what, nvrx=NVRX):
    """A skip reason: ``NVRx <version> <what>``, or that NVRx is not installed at all."""
    return NO_NVRX if nvrx is None else f"NVRx {nvrx} {what}"


needs_nvrx = pytest.mark.skipif(NVRX is None, reason=NO_NVRX)
needs_cache = pytest.mark.skipif(not EXPECT.get(NVRX, {}).get("cache"),
                                 reason=lacks("has no IPC cache"))
needs_warmup = pytest.mark.skipif(not EXPECT.get(NVRX, {}).get("warmup"),
                                  reason=lacks("starts its worker only inside a save"))
#: Is the package installed here with its .pth (tox installs the wheel), so that every
#: process started from this interpreter, NVRx's spawned worker too, can activate it?
PTH = Path(sysconfig.get_paths()["purelib"], "nvrx_ipc_fix.pth").exists()
pth_installed = pytest.mark.skipif(
    not PTH, reason="nvrx-ipc-fix is not installed with its .pth in this interpreter "
    "(tox installs it)")


def uv(*args, timeout=600):
    """Run uv (requirements/uv.txt) with pip's find-links, never downloading a Python."""
    try:
        from uv import find_uv_bin
    except ImportError:
        pytest.skip("uv is not installed here (requirements/uv.txt)")
    env = dict(os.environ, UV_PYTHON_DOWNLOADS="never")
    if os.environ.get("PIP_FIND_LINKS"):  # where this machine keeps wheels (torch CPU)
        env.setdefault("UV_FIND_LINKS", os.environ["PIP_FIND_LINKS"])
    subprocess.run([find_uv_bin(), *args], check=True, timeout=timeout, env=env,
                   stdout=subprocess.DEVNULL)


def expect(key):
    return EXPECT[NVRX][key]


def _env(fix, auto, extra=None):
    env = {k: v for k, v in os.environ.items() if not k.startswith("NVRX_IPC_FIX_")}
    if not fix:
        env["NVRX_IPC_FIX_DISABLE"] = "1"
    if not auto:
        env["NVRX_IPC_FIX_AUTO"] = "0"
    env.update(extra or {})
    return env


def run_process(args, *, fix=True, auto=False, env=None, timeout=120):
    """Run ``args`` in a new session; kill the whole group (worker included) on timeout."""
    proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=_env(fix, auto, env), start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        pytest.fail(f"{args} still running after {timeout} s (backstop watchdog)\n{err[-3000:]}")
    return proc.returncode, out, err


def run_python(code, *, python=sys.executable, flags=(), fix=True, auto=False, env=None,
               timeout=120):
    """Run ``code`` in a fresh interpreter; return its last stdout line parsed as JSON."""
    rc, out, err = run_process([python, *flags, "-c", textwrap.dedent(code)], fix=fix,
                               auto=auto, env=env, timeout=timeout)
    assert rc == 0, f"exit {rc}\nstdout:\n{out[-3000:]}\nstderr:\n{err[-3000:]}"
    return json.loads(out.strip().splitlines()[-1])


def scenario(steps, *, fix=True, auto=False, timeout=60, prelude="", tensors=8, numel=512,
             env=None, finalize="blocking", no_dist=False, starts="spawn"):
    """Run the real NVRx worker through ``steps`` (see nvrx_ipc_fix.testing.scenario).

    ``prelude`` runs first in the child (to alter NVRx for a test); ``finalize`` and
    ``no_dist`` choose how saves are finalized, ``starts`` how NVRx starts its workers
    (``scenario.Trainer``: ``forkserver`` where a cold start is not the subject). The scenario's watchdog
    reports a hang as soon as the worker died, or after ``timeout`` s in one save; this
    process's backstop kills everything later. Returns the report, with ``cache_miss``
    (the worker printed "Worker cache miss") added.
    """
    code = f"""
        import json, tempfile
        {textwrap.dedent(prelude).strip().replace(chr(10), chr(10) + ' ' * 8)}
        from nvrx_ipc_fix.testing import scenario
        with tempfile.TemporaryDirectory() as d:
            print(json.dumps(scenario.run({list(steps)!r}, d, timeout={timeout},
                                          n_tensors={tensors}, numel={numel},
                                          finalize={finalize!r}, no_dist={no_dist!r},
                                          starts={starts!r})))
    """
    rc, out, err = run_process([sys.executable, "-c", textwrap.dedent(code)], fix=fix,
                               auto=auto, env=env, timeout=timeout * 2 + 30 * len(steps))
    assert rc == 0, f"exit {rc}\nstdout:\n{out[-3000:]}\nstderr:\n{err[-3000:]}"
    report = json.loads(out.strip().splitlines()[-1])
    report["cache_miss"] = "Worker cache miss" in err
    report["stderr"] = err[-3000:]
    return report


def scenario_ranks(steps, directory, *, world_size=2, timeout=60, env=None, flags=(),
                   backstop=400):
    """Run ``steps`` (a comma list; ``<step>@<rank>`` runs on that rank only) on
    ``world_size`` gloo ranks, one process each, meeting in ``directory``, with ``flags`` of
    ``python -m nvrx_ipc_fix.testing.scenario``; returns each rank's report. A rank still
    running after ``backstop`` seconds is killed with its workers and fails the test."""
    procs = [subprocess.Popen(
        [sys.executable, "-m", "nvrx_ipc_fix.testing.scenario", "--steps", steps,
         "--rank", str(rank), "--world-size", str(world_size), "--dir", str(directory),
         "--timeout", str(timeout), "--numel", "512", *flags],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
        env=_env(True, False, env)) for rank in range(world_size)]
    reports = []
    try:
        for proc in procs:
            out, err = proc.communicate(timeout=backstop)
            assert proc.returncode == 0, err[-3000:]
            report = json.loads(out.strip().splitlines()[-1])
            report["stderr"] = err[-3000:]
            reports.append(report)
    except subprocess.TimeoutExpired:
        pytest.fail(f"a rank still running after {backstop} s (backstop watchdog)")
    finally:
        for proc in procs:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
    return reports

