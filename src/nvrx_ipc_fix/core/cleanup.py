"""Clear the trainer-side NVRx caches and hand freed CUDA memory back to the device.

The order is NeMo RL's (PR #3322): caches → ``gc.collect()`` → ``torch.cuda.ipc_collect()``
→ ``torch.cuda.empty_cache()``. The caches are class attributes shared by every
writer, so they are mutated in place (``.clear()``), never rebound.
"""

from __future__ import annotations

import gc
import sys
import threading
import time
from dataclasses import dataclass

from . import fork as _fork, shapes as _shapes
from .detect import writer_class
from .log import logger

TYPE_CHECKING = False  # typing.TYPE_CHECKING, without importing typing
if TYPE_CHECKING:
    from collections.abc import Callable

GIB = float(1 << 30)

_busy = threading.local()
#: Called whenever the caches are emptied: whoever keeps records of what was sent drops them.
on_forget: list[Callable[[], object]] = []


@dataclass(frozen=True)
class Cleanup:
    """What one cleanup did."""

    reason: str
    keys_cleared: int
    freed_bytes: int | None  # None: CUDA is not initialised in this process
    seconds: float


@dataclass
class Totals:
    """Running totals for ``status()``."""

    cleanups: int = 0
    keys_cleared: int = 0
    freed_bytes: int = 0
    releases: int = 0
    prewarms: int = 0  # workers started ahead of the save that needs them
    prewarm_failures: int = 0  # of those, workers that died or failed before their first save
    pinned_bytes: int = 0  # host memory the last prewarmed worker pinned ahead of its save


totals = Totals()
_totals_lock = _fork.renewed(threading.Lock())


def add(**deltas) -> None:
    """Add to ``totals`` (from any thread), e.g. ``add(releases=1)``."""
    with _totals_lock:
        for name, delta in deltas.items():
            setattr(totals, name, getattr(totals, name) + delta)


def put(**values) -> None:
    """Set ``totals`` (from any thread), e.g. ``put(pinned_bytes=n)``."""
    with _totals_lock:
        for name, value in values.items():
            setattr(totals, name, value)


def device_free_bytes() -> int | None:
    """Free bytes on the current CUDA device, or ``None`` when CUDA is not in use here."""
    torch = sys.modules.get("torch")
    if torch is None:
        return None
    try:
        if not torch.cuda.is_initialized():
            return None
        return int(torch.cuda.mem_get_info()[0])
    except (RuntimeError, AssertionError, ValueError):  # torch's CUDA query failed: no figure
        return None


def cached_key_count() -> int:
    """How many cache keys the trainer believes the worker holds."""
    writer = writer_class()
    return _shapes.cached_key_count(writer) if writer is not None else 0


def forget_keys() -> None:
    """Empty the writer's caches (in place): the next save sends full tensors."""
    writer = writer_class()
    if writer is not None:
        _shapes.forget_writer_keys(writer)
    for forget in on_forget:  # records kept of what was sent (stale_guard's)
        forget()


def clear_trainer_caches(
    reason: str, free_before: int | None = None, keys: int | None = None
) -> Cleanup | None:
    """Empty the writer's caches, collect garbage and release CUDA IPC blocks.

    ``free_before`` is the device's free memory measured before the worker was closed,
    so the log line counts what the close and the cleanup freed together.
    Returns ``None`` when re-entered (a ``__del__`` run by our own ``gc.collect()``).
    """
    if getattr(_busy, "active", False):
        return None
    _busy.active = True
    try:
        return _clear(reason, free_before, keys)
    finally:
        _busy.active = False


def _clear(reason: str, free_before: int | None, keys: int | None) -> Cleanup:
    start = time.perf_counter()
    if free_before is None:
        free_before = device_free_bytes()
    keys = cached_key_count() if keys is None else keys
    forget_keys()
    gc.collect()
    torch = sys.modules.get("torch")
    if torch is not None and free_before is not None:
        torch.cuda.ipc_collect()
        torch.cuda.empty_cache()
    free_after = device_free_bytes()
    freed = None if free_before is None or free_after is None else max(0, free_after - free_before)
    done = Cleanup(reason, keys, freed, time.perf_counter() - start)
    add(cleanups=1, keys_cleared=keys, freed_bytes=freed or 0)
    logger.info(
        "cleared %d cached checkpoint key(s) after %s%s (%.2f s)",
        keys,
        reason,
        "" if freed is None else f"; freed {freed / GIB:.2f} GiB on this device",
        done.seconds,
    )
    return done
