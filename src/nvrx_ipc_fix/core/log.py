"""The package logger (``nvrx_ipc_fix``, ``NullHandler`` by default), warn-once and hook errors.

Imported only when something is logged, so that activation does not import ``logging``.
"""

import logging
import threading

from . import fork as _fork, state as _state

logger = logging.getLogger("nvrx_ipc_fix")
logger.addHandler(logging.NullHandler())

_seen = set()
_lock = threading.Lock()


def _fresh_lock():
    global _lock
    _lock = threading.Lock()


_fork.in_child(_fresh_lock)

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
    """Record a failure inside hook code; the user's call goes on untouched. Said once per
    target and exception type, as a ``RuntimeWarning`` (shown by default) and on the logger."""
    from .config import warn

    reason = f"{type(exc).__name__}: {exc}"
    errors[target] = reason
    key = ("hook", target, type(exc).__name__)
    message = (f"nvrx_ipc_fix: hook on {target} failed and was skipped ({reason}); NVRx "
               f"behaves as without the fix for this call")
    warn_once(key, "%s", message)
    warn(message, key)


@_state.on_reset
def _reset():
    _seen.clear()
    errors.clear()
