"""Fix ``stale_guard``: re-send tensors whose storage changed since the worker cached them.

NVRx 0.6.0 keys its worker cache on the plan's structure only. After the model's storage
is replaced (``model.to("cpu")`` and back, optimizer offload) the worker keeps reading the
old storage and every later checkpoint silently holds old values. This is a backport of
NVRx PR #314 (in 0.7.0): compare the storage of each cached GPU tensor with what was sent
and, if any differs, invalidate the key so that NVRx sends the tensors again. Storages are
compared by weak reference and data pointer, so a new allocation at a recycled address, and
a storage resized in place, are still seen as new.

The check costs next to nothing on an ordinary save: NVRx resolves every tensor of the plan
even when it reuses the cache, and the guard looks at the tensors as NVRx resolves them and
takes the key NVRx computed, instead of doing either again. Only the save after a move runs
``prepare_write_data`` twice (the first result is dropped).
"""

from __future__ import annotations

import sys
import weakref

from ..core.cleanup import forget_keys, on_forget
from ..core.detect import FS
from ..core.log import hook_failed

PREPARE_TARGET = f"{FS}:FileSystemWriterAsync.prepare_write_data"

#: cache key -> (number of tensor items in the plan,
#:               ((position among them, storage weakref, data_ptr), ...) of the cached ones)
_sent: dict[str, tuple] = {}


def forget_all() -> None:
    """Drop every record (the caches were cleared, the next save sends everything)."""
    _sent.clear()


on_forget.append(forget_all)


def prepare_write_data_wrapper(wrapped, instance, args, kwargs):
    """Around ``FileSystemWriterAsync.prepare_write_data(plan, planner)``."""
    try:
        plan, planner = _plan_and_planner(*args, **kwargs)
        guarded = instance.use_cached_data_structure and not getattr(
            instance, "use_cpu_shm_for_gpu_tensors", False)
        byte_io = sys.modules[FS].WriteItemType.BYTE_IO
    except Exception as exc:
        hook_failed(PREPARE_TARGET, exc)
        guarded = False
    if not guarded:
        return wrapped(*args, **kwargs)
    resolved: list = []
    restore = _record_resolved(planner, byte_io, resolved)
    try:
        result = wrapped(*args, **kwargs)
    finally:
        restore()
    try:
        again = _reused_but_moved(instance, plan, planner, resolved)
    except Exception as exc:  # unknown whether it moved: send again, never a stale save
        hook_failed(PREPARE_TARGET, exc)
        again = _resend_if_reused(instance)
    if again:  # the key is gone: NVRx now sends the tensors (its errors are its own)
        result = wrapped(*args, **kwargs)
    try:
        _record_sent(instance, plan)
    except Exception as exc:
        hook_failed(PREPARE_TARGET, exc)
    return result


def _plan_and_planner(plan, planner, *_args, **_kwargs):
    return plan, planner


def _tensor_items(plan) -> list:
    byte_io = sys.modules[FS].WriteItemType.BYTE_IO
    return [item for item in plan.items if item.type != byte_io]


def _record_resolved(planner, byte_io, out):
    """Shadow ``planner.resolve_data`` for one call so that ``out`` gets each tensor item's
    data, in NVRx's order; returns what undoes it. A planner that takes no attribute is left
    alone (``out`` stays empty and the check resolves the tensors itself)."""
    own = planner.__dict__.get("resolve_data") if hasattr(planner, "__dict__") else None
    resolve, append = planner.resolve_data, out.append

    def resolve_data(item):
        data = resolve(item)
        if item.type is not byte_io:
            append(data)
        return data

    try:
        planner.resolve_data = resolve_data
    except Exception:
        return lambda: None

    def restore():
        try:
            if own is None:
                del planner.resolve_data
            else:
                planner.resolve_data = own
        except AttributeError:  # already gone
            pass

    return restore


def _reused_but_moved(instance, plan, planner, resolved) -> bool:
    """NVRx reused the worker's cache: is it stale? If so, drop the key (True)."""
    identifier = getattr(instance, "consistent_data_identifier", None)
    if identifier is None or getattr(instance, "cached_tensor_data", None) is not None:
        return False  # NVRx sent the tensors, or cached nothing
    key = identifier.key
    record = _sent.get(key)
    if record is not None:
        count, cached = record
        if len(resolved) != count:  # not seen as NVRx resolved them: resolve them here
            resolved = [planner.resolve_data(item) for item in _tensor_items(plan)]
        if not _moved(cached, resolved):
            return False
    # Unknown (activated after the first save) or moved: make NVRx send the tensors again.
    _sent.pop(key, None)
    _discard(sys.modules[FS].FileSystemWriterAsync._cached_identifiers, key)
    return True


def _resend_if_reused(instance) -> bool:
    """After a failed check: if NVRx reused the worker's cache, forget every key, so that
    NVRx sends the tensors (True). Each save the check cannot decide is sent whole."""
    try:
        reused = (getattr(instance, "consistent_data_identifier", None) is not None
                  and getattr(instance, "cached_tensor_data", None) is None)
        if reused:
            forget_keys()
        return reused
    except Exception as exc:
        hook_failed(PREPARE_TARGET, exc)
        return False


def _moved(cached, tensors) -> bool:
    try:
        for position, storage_ref, data_ptr in cached:
            tensor = tensors[position]
            if tensor.data_ptr() != data_ptr or storage_ref() is not tensor.untyped_storage():
                return True
    except IndexError:  # fewer tensors than were cached
        return True
    return False


def _discard(ids, key) -> None:
    if isinstance(ids, dict):  # NVRx PR #395 maps key -> worker generation
        ids.pop(key, None)
    elif hasattr(ids, "discard"):
        ids.discard(key)
    else:
        ids.clear()


def _record_sent(instance, plan) -> None:
    identifier = getattr(instance, "consistent_data_identifier", None)
    sent = getattr(instance, "cached_tensor_data", None)
    if identifier is None or sent is None:
        return  # nothing cached, or NVRx reused what the worker holds
    items, tensors = sent
    tensor_items = _tensor_items(plan)
    position = {id(item): i for i, item in enumerate(tensor_items)}
    _sent[identifier.key] = (len(tensor_items), tuple(
        (position[id(item)], weakref.ref(tensor.untyped_storage()), tensor.data_ptr())
        for item, tensor in zip(items, tensors)
    ))
