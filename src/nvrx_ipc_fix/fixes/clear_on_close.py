"""Fix ``clear_on_close``: forget what the worker cached as soon as the worker is closed.

Without it the next save sends only a cache key to a fresh worker, which dies with
"Worker cache miss" while the trainer waits for ever in ``preload_q.join()``
(NVRx 0.6.0 and 0.7.0; NVRx's own restart callback runs after the payload was chosen).
"""

from __future__ import annotations

import sys

from ..core.arguments import flags
from ..core.cleanup import cached_key_count, clear_trainer_caches, device_free_bytes
from ..core.detect import CORE
from ..core.errors import STOP, add_note
from ..core.log import hook_failed

CLOSE_TARGET = f"{CORE}:PersistentAsyncCaller.close"


def close_wrapper(wrapped, instance, args, kwargs):
    """Around ``PersistentAsyncCaller.close``: the root every close path goes through."""
    try:
        had_worker = getattr(instance, "process", None) is not None
        free_before = device_free_bytes() if had_worker else None
    except Exception as exc:
        hook_failed(CLOSE_TARGET, exc)
        return wrapped(*args, **kwargs)
    result = wrapped(*args, **kwargs)
    if had_worker and not sys.is_finalizing():
        try:
            clear_trainer_caches("the NVRx checkpoint worker was closed", free_before)
        except Exception as exc:
            hook_failed(CLOSE_TARGET, exc)
    return result


def finalize_wrapper(wrapped, instance, args, kwargs):
    """Around Megatron's and Bridge's ``maybe_finalize_async_save``.

    With ``terminate=True`` the queue is closed but kept; clear what is still cached
    (normally the root wrapper already did, and this finds nothing to do). When its finalize
    raises (a failed checkpoint), the terminate is still done, then the failure is raised.
    """
    target = f"{wrapped.__module__}:{wrapped.__qualname__}"
    try:
        terminate, = flags(wrapped, args, kwargs, "terminate")
    except Exception as exc:
        hook_failed(target, exc)
        return wrapped(*args, **kwargs)
    if not terminate:
        return wrapped(*args, **kwargs)
    failure = result = None
    try:
        result = wrapped(*args, **kwargs)
    except STOP:
        raise
    except BaseException as exc:  # the finalize before the close: the close did not run
        failure = exc
        try:
            wrapped(*args, **kwargs)  # what is left: the saves behind it, the close
        except STOP:
            raise
        except BaseException as again:
            add_note(failure, f"nvrx_ipc_fix: completing the terminate then raised "
                              f"{type(again).__name__}: {again}")
    try:
        if cached_key_count():
            clear_trainer_caches("maybe_finalize_async_save(terminate=True)")
    except Exception as exc:
        hook_failed(target, exc)
    if failure is not None:
        raise failure
    return result
