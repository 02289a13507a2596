"""nvrx-ipc-fix: stop NVRx async checkpointing from holding GPU memory, writing stale
checkpoints and hanging.

Installed from the wheel, it activates at interpreter start-up (``nvrx_ipc_fix.pth``);
``import nvrx_ipc_fix`` activates it too (unless ``NVRX_IPC_FIX_DISABLE=1``). Activation
only registers post-import hooks: NVRx and Megatron are patched when they are imported,
and activation imports neither them nor torch.
"""

from __future__ import annotations

from .core import __version__  # noqa: F401  (the package's version)
from .core.lifecycle import activate, deactivate, status
from .core.lifecycle import enable as _enable

TYPE_CHECKING = False  # typing.TYPE_CHECKING, without importing typing
if TYPE_CHECKING:  # what __getattr__ loads on demand, as type checkers should see it
    from typing import Any

    from .core.errors import CheckpointWorkerError, PersistentAsyncWorkerError
    from .core.status import FixStatus, State, Status, TargetStatus
    from .ray_hook import ray_runtime_env
    from .worker.prewarm import PrewarmReport, prewarm
    from .worker.release import ReleaseReport, offloading, release

__all__ = [
    "activate",
    "deactivate",
    "status",
    "release",
    "offloading",
    "ReleaseReport",
    "prewarm",
    "PrewarmReport",
    "CheckpointWorkerError",
    "PersistentAsyncWorkerError",
    "ray_runtime_env",
    "ray_worker_setup",
    "State",
    "Status",
    "FixStatus",
    "TargetStatus",
]

_LAZY = {
    "State": "core.status",
    "Status": "core.status",
    "FixStatus": "core.status",
    "TargetStatus": "core.status",
    "release": "worker.release",
    "offloading": "worker.release",
    "ReleaseReport": "worker.release",
    "prewarm": "worker.prewarm",
    "PrewarmReport": "worker.prewarm",
    "CheckpointWorkerError": "core.errors",
    "PersistentAsyncWorkerError": "core.errors",
    "ray_runtime_env": "ray_hook",
}


def ray_worker_setup() -> None:
    """Activate in a Ray worker (source ``ray-hook``); what ``ray_runtime_env()``'s hook calls.

    As a string hook, ``"nvrx_ipc_fix.ray_worker_setup"``, it stops every worker whose
    environment cannot import this package: use ``ray_runtime_env()``. Ray imports the
    package to find the hook and runs it before any task or actor code, so the activation
    that import made is recorded as the hook's. Not subject to ``NVRX_IPC_FIX_AUTO``;
    ``NVRX_IPC_FIX_DISABLE`` applies.
    """
    try:
        _enable("ray-hook", claim=True)
    except Exception as exc:  # noqa: BLE001 Ray stops a worker whose setup hook raises
        from .core.log import warn_once

        warn_once("activate", "nvrx_ipc_fix: activation failed, nothing patched: %s", exc)


def __getattr__(name: str) -> Any:  # these import dataclasses, enum, logging: load them on demand
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:  # dir() and help() list the lazy names too, without loading them
    return sorted({*globals(), *__all__})


try:
    _enable("import")
except Exception as _exc:  # noqa: BLE001 never break the user's import
    from .core.log import warn_once

    warn_once("activate", "nvrx_ipc_fix: activation failed, nothing patched: %s", _exc)
