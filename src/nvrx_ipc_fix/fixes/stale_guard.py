"""Fix ``stale_guard``: re-send tensors whose storage changed since the worker cached them.

NVRx 0.6.0 keys its worker cache on the plan's structure only. After the model's storage
is replaced (``model.to("cpu")`` and back, optimizer offload) the worker keeps reading the
old storage and every later checkpoint silently holds old values. This is a backport of
NVRx PR #314 (in 0.7.0): compare the storage of each cached GPU tensor with what was sent
and, if any differs, send the tensors again. Storages are compared by weak reference and
data pointer, so a new allocation at a recycled address, and a storage resized in place, are
still seen as new.

The check costs next to nothing on an ordinary save: NVRx resolves every tensor of the plan
even when it reuses the cache, and the guard looks at the tensors as NVRx resolves them and
takes the key NVRx computed, instead of doing either again. NVRx's ``prepare_write_data`` is
called once: where it chose to reuse the worker's cache and the storage moved, the guard
completes the send NVRx would have made (``_send``: the tensors NVRx resolved and did not
send uncached), as PR #314 does inside NVRx; the worker replaces its entry for the key.
"""

from __future__ import annotations

import sys
import threading
import weakref

from ..core import fork as _fork, shapes as _shapes
from ..core.cleanup import forget_keys, on_forget
from ..core.detect import FS
from ..core.log import guard
from ..core.resolved import recording

PREPARE_TARGET = f"{FS}:FileSystemWriterAsync.prepare_write_data"

#: cache key -> (number of tensor items in the plan,
#:               ((position among them, storage weakref, data_ptr), ...) of the cached ones)
_sent: dict[str, tuple] = {}
_lock = _fork.renewed(threading.Lock())  # _sent: written by the saving thread, emptied by any


def forget_all() -> None:
    """Drop every record (the caches were cleared, the next save sends everything)."""
    with _lock:
        _sent.clear()


on_forget.append(forget_all)


def prepare_write_data_wrapper(wrapped, instance, args, kwargs):
    """Around ``FileSystemWriterAsync.prepare_write_data(plan, planner)``."""
    with guard(PREPARE_TARGET, fix="stale_guard") as it:
        plan, planner = _plan_and_planner(*args, **kwargs)
        guarded = _shapes.caches_ipc(instance)
        byte_io = _shapes.byte_io(sys.modules[FS])
    if it.failed or not guarded:
        return wrapped(*args, **kwargs)
    resolved: list = []  # each tensor item's data, as NVRx resolves it (else: resolved here)
    restore = recording(planner, lambda item, data: item.type is byte_io or resolved.append(data))
    try:
        result = wrapped(*args, **kwargs)
    finally:
        if restore is not None:
            restore()
    with guard(PREPARE_TARGET, fix="stale_guard") as it:
        if _reused_but_moved(instance, plan, planner, resolved):
            _send(instance, plan, planner, resolved)
    if it.failed:  # unknown whether it moved: send, never a stale save
        _send_if_reused(instance, plan, planner, resolved)
    with guard(PREPARE_TARGET, fix="stale_guard"):
        _record_sent(instance, plan)
    return result


def _plan_and_planner(plan, planner, *_args, **_kwargs):
    return plan, planner


def _tensor_items(plan) -> list:
    byte_io = _shapes.byte_io(sys.modules[FS])
    return [item for item in plan.items if item.type != byte_io]


def _reused_but_moved(instance, plan, planner, resolved) -> bool:
    """NVRx reused the worker's cache: is it stale (or unknown: activated after the first
    save)?"""
    if not _shapes.reused(instance):
        return False  # NVRx sent the tensors, or cached nothing
    with _lock:
        record = _sent.get(_shapes.cache_key(instance))
    if record is None:
        return True
    count, cached = record
    return _moved(cached, _resolved(plan, planner, resolved, count))


def _resolved(plan, planner, resolved, count=None):
    """The plan's tensors as NVRx resolved them; resolved here if they were not seen so
    (a planner that takes no attribute)."""
    if len(resolved) != (len(_tensor_items(plan)) if count is None else count):
        return [planner.resolve_data(item) for item in _tensor_items(plan)]
    return resolved


def _send(instance, plan, planner, resolved) -> None:
    """Complete the send NVRx makes when the worker caches nothing under the key: the
    tensors it resolved for this save and did not send uncached (its own partition)."""
    items = _tensor_items(plan)
    uncached = {id(item) for item in _shapes.sent_uncached(instance)}
    kept = [
        (item, data.detach())
        for item, data in zip(items, _resolved(plan, planner, resolved))
        if id(item) not in uncached
    ]
    _shapes.send(instance, [item for item, _ in kept], [data for _, data in kept])


def _send_if_reused(instance, plan, planner, resolved) -> None:
    """After a failed check: if NVRx reused the worker's cache, send the tensors (each save
    the check cannot decide is sent whole). Where that fails too, the save is NVRx's own
    and the keys are forgotten, so that the next one sends everything."""
    with guard(PREPARE_TARGET, fix="stale_guard") as it:
        if _shapes.reused(instance):
            _send(instance, plan, planner, resolved)
    if it.failed:
        forget_keys()


def _moved(cached, tensors) -> bool:
    try:
        for position, storage_ref, data_ptr in cached:
            tensor = tensors[position]
            if tensor.data_ptr() != data_ptr or storage_ref() is not tensor.untyped_storage():
                return True
    except IndexError:  # fewer tensors than were cached
        return True
    return False


def _record_sent(instance, plan) -> None:
    key, sent = _shapes.cache_key(instance), _shapes.sent(instance)
    if key is None or sent is None:
        return  # nothing cached, or NVRx reused what the worker holds
    items, tensors = sent
    tensor_items = _tensor_items(plan)
    position = {id(item): i for i, item in enumerate(tensor_items)}
    record = (
        len(tensor_items),
        tuple(
            (position[id(item)], weakref.ref(tensor.untyped_storage()), tensor.data_ptr())
            for item, tensor in zip(items, tensors)
        ),
    )
    with _lock:
        _sent[key] = record
