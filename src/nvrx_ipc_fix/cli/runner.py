"""Run the driver (``cli.driver``) in a fresh interpreter, with or without the package, for
the demo and ``selftest``. Imports only the standard library, so that they stay light.
"""

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile

from .scratch import fits


def in_subprocess(steps, fix, timeout, tensors=8, numel=4096):
    """The driver's report for ``steps`` (a comma list), plus ``cache_miss``.

    ``fix=False`` runs it with ``NVRX_IPC_FIX_DISABLE=1``, i.e. plain NVRx.
    """
    env = {k: v for k, v in os.environ.items() if not k.startswith("NVRX_IPC_FIX_")}
    if not fix:
        env["NVRX_IPC_FIX_DISABLE"] = "1"
    code, out, err = run_child(
        [
            sys.executable,
            "-m",
            "nvrx_ipc_fix.cli.driver",
            "--steps",
            steps,
            "--timeout",
            str(timeout),
            "--tensors",
            str(tensors),
            "--numel",
            str(numel),
        ],
        env,
        timeout * 4 + 120,
    )
    if code != 0 or not out.strip():
        raise RuntimeError(f"the driver failed (exit {code}):\n{err[-2000:]}")
    report = json.loads(out.strip().splitlines()[-1])
    report["cache_miss"] = "Worker cache miss" in err
    return report


def run_child(argv, env, backstop):
    """Run ``argv`` in a new session with a temp directory of its own (``TMPDIR``, where
    the path is short enough: ``fits``);
    ``(exit code, stdout, stderr)``. That directory is removed however the child ends: on
    its own, killed with everything it started once ``backstop`` seconds have passed
    (``RuntimeError``), or left when this process is interrupted."""
    root = tempfile.mkdtemp(prefix="nvrx-ipc-fix-run-")
    if fits(root):  # else the child keeps this TMPDIR (and a kill can leave files in it)
        env = dict(env, TMPDIR=root)
    try:
        proc = subprocess.Popen(
            argv,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,
        )
        try:
            out, err = proc.communicate(timeout=backstop)
        except subprocess.TimeoutExpired:
            raise RuntimeError(
                f"the driver was still running after {backstop:g} s: stopped it "
                f"and the processes it started"
            ) from None
        finally:
            if proc.poll() is None:  # timed out or interrupted: stop the whole group
                try:
                    os.killpg(proc.pid, signal.SIGKILL)
                except OSError:
                    pass
                proc.communicate()
        return proc.returncode, out, err
    finally:
        shutil.rmtree(root, ignore_errors=True)
