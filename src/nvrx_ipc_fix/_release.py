"""``release()``: drop the CUDA IPC mappings the NVRx checkpoint worker holds.

``flush`` keeps the worker: it finalizes pending saves, runs ``_worker.drop_cache`` inside
the worker through the worker's own request queue, then clears the trainer's caches and
returns the freed blocks to the device. ``terminate`` closes the worker instead (NeMo RL's
fix); the next save pays for a new worker. Both make the next save send full tensors.
A queue in CPU-shared-memory mode holds no IPC handles and is left alone (closing one
in NVRx 0.6.0 drops its drain-before-overwrite callback for good).

Collective rule: finalizing pending saves all-reduces across ranks, so when saves may be
pending every rank must call ``release`` in the same order. The request to the worker
itself is rank-local: it does not go through ``AsyncCallsQueue`` bookkeeping.
"""

import sys
import time
import weakref
from contextlib import contextmanager
from dataclasses import dataclass, field
from queue import Empty

from . import _cleanup, _config
from ._detect import CORE
from ._log import logger

STRATEGIES = ("flush", "terminate")
_SENTINEL = -7331  # call_idx of our request; NVRx's own requests count up from 0


@dataclass(frozen=True)
class ReleaseReport:
    """What one ``release()`` did."""

    strategy: str
    freed_bytes: int  # on this device, from torch.cuda.mem_get_info; 0 without CUDA
    seconds: float
    queues_released: int
    worker_kept: bool  # flush: the worker stays warm for the next save
    worker_terminated: bool
    keys_cleared: int
    skipped: tuple = field(default_factory=tuple)  # ("what: why", ...)
    error: str | None = None

    def summary(self) -> str:
        """The one INFO line, in the units users think in."""
        worker = "worker kept" if self.worker_kept else (
            "worker terminated" if self.worker_terminated else "no worker")
        freed = (f"freed {self.freed_bytes / _cleanup.GIB:.2f} GiB on this device"
                 if self.freed_bytes >= 1 << 20 else
                 "the model's blocks are freed as the trainer drops its tensors")
        return (f"released the NVRx checkpoint worker's IPC mappings ({self.strategy}, "
                f"{self.seconds:.2f} s, {worker}); {freed}")


def check_strategy(strategy):
    if strategy not in STRATEGIES:
        raise ValueError(f"strategy must be one of {', '.join(STRATEGIES)}, not {strategy!r}")
    return strategy


#: Set on a queue by ``fakecuda``: its worker runs in CPU-shm mode only to stay off CUDA,
#: while its writers take the IPC path (shared memory standing in for CUDA IPC).
STAND_IN = "_nvrx_ipc_fix_stand_in"
_released_at = weakref.WeakKeyDictionary()  # queue -> its call_idx at the last release


def holds_ipc(queue) -> bool:
    """Can this queue's worker hold CUDA IPC mappings (not CPU shared memory)?"""
    return not getattr(queue, "cpu_shm_mode", False) or getattr(queue, STAND_IN, False)


def has_live_worker(queue) -> bool:
    """Is this queue's persistent worker running?"""
    worker = getattr(getattr(queue, "persistent_caller", None), "process", None)
    return worker is not None and worker.is_alive()


def saved_since_release(queue) -> bool:
    """Has this queue scheduled a request since its last release (or ever)?"""
    return getattr(queue, "call_idx", -1) > _released_at.get(queue, -1)


def release(queue=None, *, strategy=None, timeout=None) -> ReleaseReport:
    """Free the GPU memory the NVRx worker holds through CUDA IPC; see the module doc.

    ``queue``: an NVRx ``AsyncCallsQueue``; ``None`` finds the live ones (weakly).
    ``strategy``: ``"flush"`` (default, or ``NVRX_IPC_FIX_STRATEGY``) or ``"terminate"``.
    ``timeout``: seconds to wait for the worker (default ``NVRX_IPC_FIX_RELEASE_TIMEOUT``
    or 60); a worker that does not answer is terminated and the report says so.
    """
    strategy = check_strategy(strategy or _config.strategy())
    timeout = _config.release_timeout() if timeout is None else float(timeout)
    start = time.perf_counter()
    free_before = _cleanup.device_free_bytes()
    core = sys.modules.get(CORE)
    if core is None or not hasattr(core.PersistentAsyncCaller, "_worker_data_cache"):
        why = "NVRx is not imported" if core is None else "this NVRx has no worker cache"
        return ReleaseReport(strategy, 0, time.perf_counter() - start, 0, False, False, 0,
                             (f"all: {why}",))
    queues = [queue] if queue is not None else core.AsyncCallsQueue.get_instances()
    trainer_cache = core.PersistentAsyncCaller._worker_data_cache  # the sync path's
    keys = _cleanup.cached_key_count() + len(trainer_cache)
    skipped, errors, released, kept, terminated = [], [], 0, False, False
    if not queues:
        skipped.append("queues: no live AsyncCallsQueue")
    for q in queues:
        label = f"queue {id(q):#x}"
        if not holds_ipc(q):
            skipped.append(f"{label}: cpu_shm_mode holds no IPC handles")
            continue
        if q.get_num_unfinalized_calls():
            q.maybe_finalize_async_calls(blocking=True)  # collective: all ranks, same order
        _released_at[q] = q.call_idx
        if not has_live_worker(q):
            skipped.append(f"{label}: no live worker")
            continue
        if strategy == "terminate":
            q.close()
            terminated = True
        else:
            from ._worker import drop_cache

            error = run_in_worker(core, q, drop_cache, (), timeout)
            if error:
                errors.append(f"{label}: {error}")
                terminated = True
            else:
                kept = True
        released += 1
    trainer_cache.clear()
    cleaned = _cleanup.clear_trainer_caches(f"release ({strategy})", free_before)
    freed = (cleaned.freed_bytes or 0) if cleaned is not None else 0
    report = ReleaseReport(strategy, freed, time.perf_counter() - start, released, kept,
                           terminated, keys, tuple(skipped), "; ".join(errors) or None)
    if report.error:
        from ._log import warn_once

        warn_once(("release", report.error), "nvrx_ipc_fix: release: %s", report.error)
    if released:
        _cleanup.totals.releases += 1
        logger.info(report.summary())
    return report


def run_in_worker(core, queue, function, args, timeout):
    """Run ``function(*args)`` in ``queue``'s idle worker; return an error or ``None``.

    The request goes straight onto the worker's queue and its completion is read from
    the worker's completion queue, so ``AsyncCallsQueue`` bookkeeping (and its
    collectives) is untouched. A worker that does not answer within ``timeout`` is
    aborted with its queues (``close(abort=True)``), so that neither our request nor a
    late answer can be taken for a later save's.
    """
    caller = queue.persistent_caller
    caller.queue.put(core.AsyncRequest(function, tuple(args), [], call_idx=_SENTINEL))
    try:
        done = caller.comp_q.get(timeout=timeout)
    except Empty:
        queue.close(abort=True)
        return f"the worker did not answer within {timeout:g} s and was terminated"
    if done != _SENTINEL:
        return f"the worker answered {done!r} instead of our request"
    return None


@contextmanager
def offloading(queue=None, *, strategy=None, timeout=None):
    """``with offloading():`` releases first, for code that moves model or optimizer storage."""
    yield release(queue, strategy=strategy, timeout=timeout)
