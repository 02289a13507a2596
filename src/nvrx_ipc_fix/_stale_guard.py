"""Fix ``stale_guard``: re-send tensors whose storage changed since the worker cached them.

NVRx 0.6.0 keys its worker cache on the plan's structure only. After the model's storage
is replaced (``model.to("cpu")`` and back, optimizer offload) the worker keeps reading the
old storage and every later checkpoint silently holds old values. This is a backport of
NVRx PR #314 (in 0.7.0): before ``prepare_write_data`` runs, compare the storage of each
cached GPU tensor with what was sent and, if any differs, invalidate the key so that NVRx
sends the tensors again. Storages are compared by weak reference and data pointer, so a
new allocation at a recycled address is still seen as new.
"""

from __future__ import annotations

import sys
import weakref

from ._detect import FS
from ._log import hook_failed

PREPARE_TARGET = f"{FS}:FileSystemWriterAsync.prepare_write_data"

#: cache key -> ((position in the plan's tensor items, storage weakref, data_ptr), ...)
_sent: dict[str, tuple] = {}


def forget_all() -> None:
    """Drop every record (the caches were cleared, the next save sends everything)."""
    _sent.clear()


def prepare_write_data_wrapper(wrapped, instance, args, kwargs):
    """Around ``FileSystemWriterAsync.prepare_write_data(plan, planner)``."""
    tensor_items = None
    try:
        plan, planner = _plan_and_planner(*args, **kwargs)
        if instance.use_cached_data_structure and not getattr(
            instance, "use_cpu_shm_for_gpu_tensors", False
        ):
            tensor_items = _tensor_items(plan)
            _invalidate_if_moved(instance, tensor_items, planner)
    except Exception as exc:
        tensor_items = None
        hook_failed(PREPARE_TARGET, exc)
    result = wrapped(*args, **kwargs)
    if tensor_items:
        try:
            _record_sent(instance, tensor_items)
        except Exception as exc:
            hook_failed(PREPARE_TARGET, exc)
    return result


def _plan_and_planner(plan, planner, *_args, **_kwargs):
    return plan, planner


def _tensor_items(plan) -> list:
    byte_io = sys.modules[FS].WriteItemType.BYTE_IO
    return [item for item in plan.items if item.type != byte_io]


def _invalidate_if_moved(instance, tensor_items, planner) -> None:
    if not tensor_items:
        return
    fs = sys.modules[FS]
    ids = fs.FileSystemWriterAsync._cached_identifiers
    key = fs._compute_data_structure_key_from_plan(tensor_items)
    if key not in ids:
        return
    record = _sent.get(key)
    if record is None or _moved(record, tensor_items, planner):
        # Unknown (activated after the first save) or moved: make NVRx send the tensors again.
        _sent.pop(key, None)
        _discard(ids, key)


def _moved(record, tensor_items, planner) -> bool:
    for position, storage_ref, data_ptr in record:
        if position >= len(tensor_items):
            return True
        data = planner.resolve_data(tensor_items[position])
        storage = data.untyped_storage()
        if storage_ref() is not storage or data.data_ptr() != data_ptr:
            return True
    return False


def _discard(ids, key) -> None:
    if isinstance(ids, dict):  # NVRx PR #395 maps key -> worker generation
        ids.pop(key, None)
    elif hasattr(ids, "discard"):
        ids.discard(key)
    else:
        ids.clear()


def _record_sent(instance, tensor_items) -> None:
    identifier = getattr(instance, "consistent_data_identifier", None)
    sent = getattr(instance, "cached_tensor_data", None)
    if identifier is None or sent is None:
        return  # nothing cached, or NVRx reused what the worker holds
    items, tensors = sent
    position = {id(item): i for i, item in enumerate(tensor_items)}
    _sent[identifier.key] = tuple(
        (position[id(item)], weakref.ref(tensor.untyped_storage()), tensor.data_ptr())
        for item, tensor in zip(items, tensors)
    )
