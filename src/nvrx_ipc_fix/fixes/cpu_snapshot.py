"""Fix ``cpu_snapshot``: a persistent worker writes each CPU tensor of a save as it was when
the save was scheduled, not as the trainer changed it after.

NVRx before its CPU snapshots (0.4.1-0.6.0, git main to at least 2026-08-07) and
megatron-core's own writer hand a CPU tensor to the worker as it is. A persistent worker's
queue moves that tensor's storage into shared memory, in place, and sends a handle, so the
worker writes the trainer's live tensor in its own time, after the schedule returned. An
optimizer step taken right after it (Adam's ``step``, a CPU-offloaded optimizer state) goes
into the checkpoint, which loads, silently torn.

A save's planning (``prepare_write_data``) notes which tensors are the planner's own; this
thread's next schedule on a queue with a persistent worker copies those on the CPU into
shared memory and sends the copies. Nothing else is copied: not what NVRx copied itself, not
the worker's cache, not a tensor on a device. Where the trainer's memory cannot change under
the writer, nothing is: a queue that forks a process per save (that process sees the
trainer's private memory as at the fork: only a tensor already in shared memory is copied)
and a save the trainer writes itself. The copies of a save are kept for the worker's next save
of the same tensors (shapes, strides, dtypes), once their own save was finalized, so that a
save copies into pages already in memory. They are dropped when the worker is closed or
released, or when the package stops tracking it (a dead worker), and
``NVRX_IPC_FIX_SNAPSHOT_KEEP=off`` keeps none. NVRx 0.7.0 clones every CPU tensor in
``prepare_write_data`` itself (NVRx PR #376): there the fix is not installed
(``shapes.cpu_snapshots``).
"""

from __future__ import annotations

import threading
import weakref

from ..core import cleanup as _cleanup, config as _config, fork as _fork, shapes as _shapes
from ..core import state as _state
from ..core.log import guard
from ..core.resolved import recording
from ..core.status import SNAPSHOT_NONE

_planned = threading.local()  # .save: (weakref to the writer, {id(item): the planner's storage})
_lock = _fork.renewed(threading.Lock())
#: caller (NVRx's persistent worker) -> {"free": copies or None, call_idx: copies in use}
_kept: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def prepare_write_data_wrapper(wrapped, instance, args, kwargs):
    """Around ``FileSystemWriterAsync.prepare_write_data(plan, planner)`` (NVRx's writer and
    megatron-core's): note the storage of each tensor the planner gives, for the schedule."""
    import torch

    given = {}  # id(item) -> the data pointer of the storage the planner gave

    def seen(item, data):  # runs inside NVRx's call: never raises into it
        if isinstance(data, torch.Tensor):
            try:
                given[id(item)] = data.untyped_storage().data_ptr()
            except RuntimeError:  # a tensor without storage (sparse): not seen, copied
                pass

    _planned.save = restore = None
    with guard(
        _target(wrapped, "FileSystemWriterAsync.prepare_write_data"), fix="cpu_snapshot"
    ) as it:
        restore = recording(_planner(*args, **kwargs), seen)
    if it.failed:
        return wrapped(*args, **kwargs)
    try:
        result = wrapped(*args, **kwargs)
    finally:
        if restore is not None:
            restore()
    _planned.save = (weakref.ref(instance), given)
    return result


def schedule_wrapper(wrapped, queue, args, kwargs):
    """Around ``AsyncCallsQueue.schedule_async_request`` (NVRx's and megatron-core's): the CPU
    tensors this thread's last planned save sends as the planner gave them are replaced by
    copies before NVRx sends them: on a persistent worker, into shared memory; on a queue that
    forks a process per save, only those already in shared memory, which that process shares
    (it sees every other tensor as it was at the fork)."""
    planned, _planned.save = getattr(_planned, "save", None), None
    writer = planned[0]() if planned is not None else None
    if writer is None:
        return wrapped(*args, **kwargs)
    persistent = _shapes.is_persistent(queue)
    target, copies = _target(wrapped, "AsyncCallsQueue.schedule_async_request"), None
    with guard(target, fix="cpu_snapshot"):
        free = _taken(queue, _shapes.caller_of(queue)) if persistent else None
        copies = _snapshot(writer, planned[1], free, persistent)
    result = wrapped(*args, **kwargs)
    calls = getattr(queue, "async_calls", None)
    if persistent and copies and calls and _config.snapshot_keep():
        with guard(target, fix="cpu_snapshot"):  # in use by the save NVRx just appended
            index, caller = calls[-1][0], calls[-1][1]
            with _lock:
                _kept.setdefault(caller, {"free": None})[index] = copies
    return result


def close_wrapper(wrapped, caller, args, kwargs):
    """Around ``PersistentAsyncCaller.close`` (NVRx's and megatron-core's): the worker's copies
    are dropped with it (NVRx 0.4.1 keeps the closed caller)."""
    try:
        return wrapped(*args, **kwargs)
    finally:
        with _lock:
            _kept.pop(caller, None)


def _taken(queue, caller):
    """The kept copies of ``caller`` whose save is finalized: the last of them stays
    ``free`` for the next save (``_snapshot`` takes it), and the rest are dropped."""
    with _lock:
        kept = _kept.get(caller) if caller is not None else None
        if kept is None:
            return None
        live = {entry[0] for entry in queue.async_calls if entry[1] is caller}
        for index in [i for i in kept if i != "free" and i not in live]:
            kept["free"] = kept.pop(index)
        free, kept["free"] = kept["free"], None
        return free


def _snapshot(writer, given, free, persistent):
    """Put a copy in place of each non-empty CPU tensor ``writer`` sends as the planner gave
    it (or in a storage not seen): in shared memory for a ``persistent`` worker (``free``:
    copies to reuse where the tensors are alike), else only of a tensor in shared memory, in
    private memory. Returns the copies, ``(layout, tensors)``, or None."""
    import torch

    sources = {}  # id(tensor) -> tensor, in NVRx's order; a tensor sent twice is copied once

    def pick(item, tensor):
        storage = given.get(id(item))
        if (
            isinstance(tensor, torch.Tensor)
            and tensor.device.type == "cpu"
            and tensor.numel()
            and (storage is None or storage == tensor.untyped_storage().data_ptr())
            and (persistent or tensor.untyped_storage().is_shared())
        ):
            sources[id(tensor)] = tensor
        return tensor

    _shapes.copy_fresh(writer, pick)
    if not sources:
        return None
    layout = tuple((t.shape, t.stride(), t.dtype) for t in sources.values())
    if free is not None and free[0] == layout:
        copies = free[1]
    else:
        copies = [torch.empty_like(t, requires_grad=False) for t in sources.values()]
        copies = [c.share_memory_() for c in copies] if persistent else copies
    with torch.no_grad():
        for copy, tensor in zip(copies, sources.values()):
            copy.copy_(tensor)
    by_id = dict(zip(sources, copies))
    _shapes.copy_fresh(writer, lambda item, tensor: by_id.get(id(tensor), tensor))
    return layout, copies


def _drop_all():
    """Drop every kept copy: the worker was closed or is no longer tracked, or the trainer's
    caches were cleared."""
    with _lock:
        _kept.clear()


_cleanup.on_forget.append(_drop_all)
_fork.in_child(_drop_all)


@_state.on_status("snapshot")
def describe():
    """For ``status()``: the shared memory the kept copies hold."""
    with _lock:
        sets = [c for kept in _kept.values() for c in kept.values() if c is not None]
    if not sets:
        return SNAPSHOT_NONE
    size = sum(t.untyped_storage().nbytes() for _, tensors in sets for t in tensors)
    return f"{size / 2**20:.1f} MiB of shared memory kept in {len(sets)} set(s) of copies"


def _target(wrapped, attr):
    return f"{getattr(wrapped, '__module__', '?')}:{attr}"


def _planner(plan, planner, *_args, **_kwargs):
    return planner
