"""The package logger (``nvrx_ipc_fix``, ``NullHandler`` by default), warn-once and hook errors.

Imported only when something is logged, so that activation does not import ``logging``.
"""

import logging
import threading

logger = logging.getLogger("nvrx_ipc_fix")
logger.addHandler(logging.NullHandler())

_seen = set()
_lock = threading.Lock()

#: Target name -> one-line reason of the last failure inside our hook code.
errors = {}


def warn_once(key, msg, *args):
    """Log ``msg`` at WARNING the first time ``key`` is seen in this process."""
    with _lock:
        if key in _seen:
            return False
        _seen.add(key)
    logger.warning(msg, *args)
    return True


def hook_failed(target, exc):
    """Record a failure inside hook code; the user's call goes on untouched."""
    reason = f"{type(exc).__name__}: {exc}"
    errors[target] = reason
    warn_once(("hook", target, type(exc).__name__),
              "nvrx_ipc_fix: hook on %s failed and was skipped (%s); NVRx behaves as without "
              "the fix for this call", target, reason)
