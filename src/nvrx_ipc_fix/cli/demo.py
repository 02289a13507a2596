"""``python -m nvrx_ipc_fix demo``: the two failures on the real NVRx worker, without and
with the fix. Each run is a fresh interpreter (``cli.driver``); "without" sets
``NVRX_IPC_FIX_DISABLE=1``. Uses CUDA when present, else the ``fakecuda`` CPU stand-in.
"""

from .runner import in_subprocess

CASES = (
    (
        "storage replaced between saves (model.to('cpu') and back, optimizer offload)",
        "save,save,replace,save",
    ),
    (
        "worker closed, then another save (maybe_finalize_async_save(terminate=True))",
        "save,save,close,save",
    ),
)


def _describe(report):
    saves = report["saves"]
    if report["hang"]:
        hang = report["hang"]
        why = (
            'the worker died with "Worker cache miss"'
            if report["cache_miss"]
            else "the save did not finish"
        )
        return False, (
            f"HANG at the save after the close: {why}; NVRx's trainer would wait "
            f"for ever (the watchdog stopped it after {hang['after_s']} s)"
        )
    last = saves[-1]
    if last["stale"]:
        return False, (
            f"STALE: the last checkpoint holds old values in {last['stale']} of "
            f"{last['tensors']} tensors, silently"
        )
    return True, (
        f"ok: {len(saves)} checkpoints, every tensor current; the last save "
        f"blocked {last['blocked_s']:.2f} s"
    )


def run(timeout=30):
    """Print both cases, without and with the fix; exit status 0 when the fix held."""
    from .. import status

    nvrx = status().nvrx_version
    if nvrx is None:
        print(
            "nvidia-resiliency-ext is not installed: nothing to demonstrate "
            "(scripts/demo installs it)."
        )
        return 2
    import torch

    device = "cuda" if torch.cuda.is_available() else "the CPU (fakecuda stand-in: no CUDA here)"
    print(f"nvrx-ipc-fix demo: NVRx {nvrx}, real persistent worker, tensors on {device}\n")
    fixed = True
    for number, (title, steps) in enumerate(CASES, 1):
        print(f"[{number}/{len(CASES)}] {title}")
        for fix in (False, True):
            report = in_subprocess(steps, fix, timeout)
            ok, text = _describe(report)
            label = "with nvrx-ipc-fix:   " if fix else "without nvrx-ipc-fix:"
            print(f"  {label} {text}")
            fixed = fixed and (ok or not fix)
        print()
    print("The fix held in every case." if fixed else "THE FIX DID NOT HOLD.")
    return 0 if fixed else 1
