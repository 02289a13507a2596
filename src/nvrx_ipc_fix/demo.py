"""``python -m nvrx_ipc_fix demo``: the two failures on the real NVRx worker, without and
with the fix. Each run is a fresh interpreter (``nvrx_ipc_fix.scenario``); "without" sets
``NVRX_IPC_FIX_DISABLE=1``. Uses CUDA when present, else the ``fakecuda`` CPU stand-in.
"""

import json
import os
import subprocess
import sys

CASES = (
    ("storage replaced between saves (model.to('cpu') and back, optimizer offload)",
     "save,save,replace,save"),
    ("worker closed, then another save (maybe_finalize_async_save(terminate=True))",
     "save,save,close,save"),
)


def _scenario(steps, fix, timeout):
    env = {k: v for k, v in os.environ.items() if not k.startswith("NVRX_IPC_FIX_")}
    if not fix:
        env["NVRX_IPC_FIX_DISABLE"] = "1"
    proc = subprocess.run([sys.executable, "-m", "nvrx_ipc_fix.scenario", "--steps", steps,
                           "--timeout", str(timeout)], env=env, capture_output=True,
                          text=True, timeout=timeout * 4 + 120, start_new_session=True)
    if proc.returncode != 0 or not proc.stdout.strip():
        raise RuntimeError(f"scenario failed (exit {proc.returncode}):\n{proc.stderr[-2000:]}")
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    report["cache_miss"] = "Worker cache miss" in proc.stderr
    return report


def _describe(report):
    saves = report["saves"]
    if report["hang"]:
        hang = report["hang"]
        why = ('the worker died with "Worker cache miss"' if report["cache_miss"]
               else "the save did not finish")
        return False, (f"HANG at the save after the close: {why}; NVRx's trainer would wait "
                       f"for ever (the watchdog stopped it after {hang['after_s']} s)")
    last = saves[-1]
    if last["stale"]:
        return False, (f"STALE: the last checkpoint holds old values in {last['stale']} of "
                       f"{last['tensors']} tensors, silently")
    return True, (f"ok: {len(saves)} checkpoints, every tensor current; the last save "
                  f"blocked {last['blocked_s']:.2f} s")


def run(timeout=30):
    """Print both cases, without and with the fix; exit status 0 when the fix held."""
    from . import status

    nvrx = status().nvrx_version
    if nvrx is None:
        print("nvidia-resiliency-ext is not installed: nothing to demonstrate "
              "(scripts/demo installs it).")
        return 2
    import torch

    device = "cuda" if torch.cuda.is_available() else "the CPU (fakecuda stand-in: no CUDA here)"
    print(f"nvrx-ipc-fix demo: NVRx {nvrx}, real persistent worker, tensors on {device}\n")
    fixed = True
    for number, (title, steps) in enumerate(CASES, 1):
        print(f"[{number}/{len(CASES)}] {title}")
        for fix in (False, True):
            report = _scenario(steps, fix, timeout)
            ok, text = _describe(report)
            label = "with nvrx-ipc-fix:   " if fix else "without nvrx-ipc-fix:"
            print(f"  {label} {text}")
            fixed = fixed and (ok or not fix)
        print()
    print("The fix held in every case." if fixed else "THE FIX DID NOT HOLD.")
    return 0 if fixed else 1
