"""Start-up activation of ``nvrx_ipc_fix``: what ``nvrx_ipc_fix.pth`` (``.start`` on Python
3.15+) and the sitecustomize written by ``python -m nvrx_ipc_fix install-sitecustomize`` run.

A top-level module, so that reading ``NVRX_IPC_FIX_AUTO`` happens before the package is
imported: importing ``nvrx_ipc_fix`` activates it, and a process with start-up activation
off must still be able to activate by ``import nvrx_ipc_fix`` later. Standard library only
(``os`` and ``sys``, which ``site`` has already imported); never raises.
"""

import os
import sys

#: Values of ``NVRX_IPC_FIX_AUTO`` (``nvrx_ipc_fix.core.config.AUTO``) that leave start-up
#: activation on; any other value turns it off. ``_config.auto()`` agrees (a test checks).
ON = ("", "1", "true", "yes", "on")

#: How start-up activation was attempted in this process (``pth``, ``sitecustomize``), in order.
ran = []
#: The exception that stopped the last attempt, as ``"Type: message"``; ``None`` if none did.
error = None
#: The start-up activation under way (``pth``, ``sitecustomize``), else ``None``. While it
#: runs, the package holds back its warnings about settings until a module it patches
#: (NVRx, Megatron, ...) is imported: every process of the environment runs this, most never
#: touch NVRx.
running = None


def run(how="pth"):
    """Activate ``nvrx_ipc_fix`` with source ``how``, once per ``how`` and process."""
    global error, running
    if how in ran:
        return
    ran.append(how)
    try:
        if os.environ.get("NVRX_IPC_FIX_AUTO", "").strip().lower() not in ON:
            return
        fresh = "nvrx_ipc_fix" not in sys.modules
        running = how
        try:
            import nvrx_ipc_fix.core.lifecycle

            nvrx_ipc_fix.core.lifecycle.enable(how, claim=fresh)
        finally:
            running = None
    except Exception as exc:  # noqa: BLE001 a broken or half-removed install must not stop Python
        error = f"{type(exc).__name__}: {exc}"
        if os.environ.get("NVRX_IPC_FIX_LOG_LEVEL", "").strip().lower() == "debug":
            try:
                sys.stderr.write(f"nvrx_ipc_fix: start-up activation ({how}) failed: {error}\n")
            except (OSError, ValueError, AttributeError):  # no stderr: start-up goes on
                pass
