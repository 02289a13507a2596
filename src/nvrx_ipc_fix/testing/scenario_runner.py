"""Run ``nvrx_ipc_fix.testing.scenario`` in a fresh interpreter, with or without the package.

Imports only the standard library, so the demo and selftest parents stay light.
"""

import json
import os
import subprocess
import sys


def in_subprocess(steps, fix, timeout, tensors=8, numel=4096):
    """The scenario's report for ``steps`` (a comma list), plus ``cache_miss``.

    ``fix=False`` runs it with ``NVRX_IPC_FIX_DISABLE=1``, i.e. plain NVRx.
    """
    env = {k: v for k, v in os.environ.items() if not k.startswith("NVRX_IPC_FIX_")}
    if not fix:
        env["NVRX_IPC_FIX_DISABLE"] = "1"
    proc = subprocess.run([sys.executable, "-m", "nvrx_ipc_fix.testing.scenario", "--steps", steps,
                           "--timeout", str(timeout), "--tensors", str(tensors),
                           "--numel", str(numel)], env=env, capture_output=True, text=True,
                          timeout=timeout * 4 + 120, start_new_session=True)
    if proc.returncode != 0 or not proc.stdout.strip():
        raise RuntimeError(f"scenario failed (exit {proc.returncode}):\n{proc.stderr[-2000:]}")
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    report["cache_miss"] = "Worker cache miss" in proc.stderr
    return report
