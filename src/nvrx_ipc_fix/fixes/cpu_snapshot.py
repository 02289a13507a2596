"""Fix ``cpu_snapshot``: the worker writes each CPU tensor of a save as it was when the save
was scheduled, not as the trainer changed it after.

NVRx before its CPU snapshots (0.4.1-0.6.0, git main to at least 2026-08-07) and
megatron-core's own writer hand a CPU tensor to the worker as it is: they copy only a view.
The persistent worker's queue moves that tensor's storage into shared memory, in place, and
sends a handle, so the worker writes the trainer's live tensor in its own time, after the
schedule returned. An optimizer step taken right after it (Adam's ``step``, a CPU-offloaded
optimizer state) goes into the checkpoint, which loads, silently torn.

As NVRx's ``prepare_write_data`` returns, the fix puts a copy in place of each CPU tensor that
NVRx sends afresh with the storage the planner gave it. What NVRx copied itself (a view; the
CPU shared-memory path's copies of device tensors), the worker's cache and tensors on a device
are left as they are. NVRx 0.7.0 clones every CPU tensor in that method itself (NVRx PR
#376): there the fix stands aside (``shapes.cpu_snapshots``).
"""

from __future__ import annotations

from ..core import shapes as _shapes
from ..core.log import guard
from ..core.resolved import recording


def prepare_write_data_wrapper(wrapped, instance, args, kwargs):
    """Around ``FileSystemWriterAsync.prepare_write_data(plan, planner)`` (NVRx's writer and
    megatron-core's)."""
    import torch

    target = f"{getattr(wrapped, '__module__', '?')}:FileSystemWriterAsync.prepare_write_data"
    given = {}  # id(item) -> the storage of the tensor the planner gave (kept alive meanwhile)

    def on_cpu(data):  # not a tensor on a device, nor one that says it is
        return isinstance(data, torch.Tensor) and data.device.type == "cpu"

    def seen(item, data):  # runs inside NVRx's call: never raises into it
        if isinstance(data, torch.Tensor):
            try:
                given[id(item)] = data.untyped_storage()
            except RuntimeError:  # a tensor without storage (sparse): not seen, copied
                pass

    with guard(target, fix="cpu_snapshot") as it:
        restore = recording(_planner(*args, **kwargs), seen)
    if it.failed:
        return wrapped(*args, **kwargs)
    try:
        result = wrapped(*args, **kwargs)
    finally:
        if restore is not None:
            restore()

    def copy(item, tensor):
        """A copy of ``tensor`` where it is a non-empty CPU tensor still in the storage the
        planner gave (or in a storage not seen)."""
        storage = given.get(id(item))
        if (
            not on_cpu(tensor)
            or not tensor.numel()
            or (storage is not None and storage.data_ptr() != tensor.untyped_storage().data_ptr())
        ):
            return tensor  # on a device, empty, or NVRx's own copy
        return tensor.clone()

    with guard(target, fix="cpu_snapshot"):
        _shapes.copy_fresh(instance, copy)
    return result


def _planner(plan, planner, *_args, **_kwargs):
    return planner
