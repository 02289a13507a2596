"""nvrx-ipc-fix: stop NVRx async checkpointing from holding GPU memory, writing stale
checkpoints and hanging.

``import nvrx_ipc_fix`` activates it (unless ``NVRX_IPC_FIX_DISABLE=1``). Activation only
registers post-import hooks: NVRx and Megatron are patched when they are imported, and
this import imports neither them nor torch.
"""

__version__ = "0.1.0"

from ._lifecycle import activate, deactivate, status  # noqa: E402
from ._lifecycle import enable as _enable  # noqa: E402

__all__ = ["activate", "deactivate", "status", "release", "offloading", "ReleaseReport",
           "State", "Status", "FixStatus", "TargetStatus"]

_LAZY = {"State": "_status", "Status": "_status", "FixStatus": "_status",
         "TargetStatus": "_status", "release": "_release", "offloading": "_release",
         "ReleaseReport": "_release"}


def __getattr__(name):  # these import dataclasses, enum, logging: load them on demand
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


try:
    _enable("import")
except Exception as _exc:  # never break the user's import
    from ._log import warn_once

    warn_once("activate", "nvrx_ipc_fix: activation failed, nothing patched: %s", _exc)
