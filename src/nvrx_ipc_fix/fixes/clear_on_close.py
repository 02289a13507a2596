"""Fix ``clear_on_close``: forget what the worker cached as soon as the worker is closed, and
keep what a save planned valid until it reaches the worker.

Without it the next save sends only a cache key to a fresh worker, which dies with
"Worker cache miss" while the trainer waits for ever in ``preload_q.join()``
(NVRx 0.6.0 and 0.7.0; NVRx's own restart callback runs after the payload was chosen).
The same miss follows a ``release()`` from another thread that lands between a save's
planning, which chose to send only the key, and its schedule: that release waits
(``core.dispatch.planning``).
"""

from __future__ import annotations

import sys

from ..core import dispatch as _dispatch
from ..core.arguments import flags
from ..core.cleanup import cached_key_count, clear_trainer_caches, device_free_bytes, forget_keys
from ..core.detect import CORE
from ..core.log import guard

CLOSE_TARGET = f"{CORE}:PersistentAsyncCaller.close"


def close_wrapper(wrapped, instance, args, kwargs):
    """Around ``PersistentAsyncCaller.close``: the root every close path goes through. An
    abort, which waits for nothing of the package's, only forgets the keys: no collection
    (``gc.collect()`` alone took 90 ms in the CPU benchmark's trainer; torch frees the blocks
    it sent over IPC when an allocation needs them, and the next close or release collects)."""
    with guard(CLOSE_TARGET, fix="clear_on_close") as it:
        had_worker = getattr(instance, "process", None) is not None
        aborts = had_worker and _dispatch.aborts(wrapped, args, kwargs)
        free_before = device_free_bytes() if had_worker and not aborts else None
    if it.failed:
        return wrapped(*args, **kwargs)
    result = wrapped(*args, **kwargs)
    if had_worker and not sys.is_finalizing():  # the close is done; the cleanup is ours alone
        with guard(CLOSE_TARGET, fix="clear_on_close", own=True):
            if aborts:
                forget_keys()
            else:
                clear_trainer_caches("the NVRx checkpoint worker was closed", free_before)
    return result


def planning_wrapper(wrapped, writer, args, kwargs):
    """Around ``FileSystemWriterAsync.prepare_write_data``: wait for a release in another
    thread to end; a save planned to send only a cache key is planned until its schedule."""
    with _dispatch.planning.planning(writer):
        return wrapped(*args, **kwargs)


def finalize_wrapper(wrapped, instance, args, kwargs):
    """Around Megatron's and Bridge's ``maybe_finalize_async_save``: after
    ``terminate=True`` the queue is closed but kept; clear what is still cached (normally the
    root wrapper already did, and this finds nothing to do)."""
    result = wrapped(*args, **kwargs)
    with guard(f"{wrapped.__module__}:{wrapped.__qualname__}"):  # NVRx's result stands
        (terminate,) = flags(wrapped, args, kwargs, "terminate")
        if terminate and cached_key_count():
            clear_trainer_caches("maybe_finalize_async_save(terminate=True)")
    return result
