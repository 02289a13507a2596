"""Dropping the CUDA IPC mappings the NVRx checkpoint worker holds: ``release()`` and
``offloading()``, and the release the automatic points (fix ``release_on_offload``) call.

``flush`` keeps the worker: it finalizes pending saves, runs ``_worker.drop_cache`` inside
the worker through the worker's own request queue, then clears the trainer's caches and
returns the freed blocks to the device. ``terminate`` closes the worker instead (NeMo RL's
fix); the next save pays for a new worker. ``restart`` terminates too, and the next worker is
started ahead of the next save when the model is back (``prewarm``: at the exit of
``offloading()``, at NeMo RL's onload points, or called by the user). All three make the next
save send full tensors; ``restart`` also starts the standby the next worker is forked from
(``worker.standby``). ``suspend`` flushes, then suspends the kept worker through the CUDA
driver (``worker.suspend``): nothing of it stays on the device, and the onload resumes it;
where the driver cannot, it falls back to ``restart``. ``terminate``, ``restart`` and
``suspend`` also stop a worker that waits for the queue's first save (prewarmed, or NVRx's
warm-up): it holds nothing, but it is on the device.
A queue in CPU-shared-memory mode holds no IPC handles and is left alone (closing one
in NVRx 0.6.0 drops its drain-before-overwrite callback for good).

Collective rule: finalizing pending saves all-reduces across ranks, so when saves may be
pending every rank must call ``release`` in the same order. The request to the worker
itself is rank-local: it does not go through ``AsyncCallsQueue`` bookkeeping.
"""

from __future__ import annotations

import sys
import threading
import time
import weakref
from contextlib import contextmanager
from dataclasses import dataclass, field
from queue import Empty

from ..core import cleanup as _cleanup, config as _config, dispatch as _dispatch
from ..core import shapes as _shapes
from ..core.detect import CORE
from ..core.errors import STOP, add_note, deliver, shown_with
from ..core.log import logger
from . import prewarm as _prewarm, registry as _workers, standby as _standby, suspend as _suspend

TYPE_CHECKING = False  # typing.TYPE_CHECKING, without importing typing
if TYPE_CHECKING:
    from collections.abc import Iterator
    from typing import Any

STRATEGIES = _config.STRATEGIES


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
    pin_bytes: int = 0  # restart: host memory the next worker pins ahead of its first save
    worker_suspended: bool = False  # suspend: kept, with nothing of it on the device

    def summary(self) -> str:
        """The one INFO line, in the units users think in."""
        worker = (
            "worker suspended"
            if self.worker_suspended
            else "worker kept"
            if self.worker_kept
            else "worker terminated"
            if self.worker_terminated
            else "no worker"
        )
        freed = (
            f"freed {self.freed_bytes / _cleanup.GIB:.2f} GiB on this device"
            if self.freed_bytes >= 1 << 20
            else "the model's blocks are freed as the trainer drops its tensors"
        )
        after = {
            "restart": "; prewarm() starts the next",
            "suspend": "; prewarm() or the next save resumes it",
        }.get(self.strategy, "")
        if self.pin_bytes:
            after += f", which pins {self.pin_bytes / _cleanup.GIB:.2f} GiB of host memory ahead"
        return (
            f"released the NVRx checkpoint worker's IPC mappings ({self.strategy}, "
            f"{self.seconds:.2f} s, {worker}{after}); {freed}"
        )


def check_strategy(strategy):
    """``strategy`` (any case) as one of ``STRATEGIES``, or ``ValueError``."""
    name = strategy.strip().lower() if isinstance(strategy, str) else strategy
    if name not in STRATEGIES:
        raise ValueError(f"strategy must be one of {', '.join(STRATEGIES)}, not {strategy!r}")
    return name


def release(
    queue: Any = None, *, strategy: str | None = None, timeout: float | None = None
) -> ReleaseReport:
    """Free the GPU memory the NVRx worker holds through CUDA IPC (docs/release.md).

    ``queue``: an NVRx ``AsyncCallsQueue``; ``None`` finds the live ones (weakly).
    ``strategy``: ``"flush"`` (default, or ``NVRX_IPC_FIX_STRATEGY``), ``"terminate"``,
    ``"restart"`` (terminate; call ``prewarm()`` when the model is back, or use ``offloading``)
    or ``"suspend"`` (keep the worker with nothing of it on the device; ``prewarm()`` or the
    next save resumes it; ``restart`` where the CUDA driver cannot).
    ``timeout``: seconds > 0 to wait for the worker (default
    ``NVRX_IPC_FIX_RELEASE_TIMEOUT`` or 60; ``math.inf``: until it answers or dies); a
    worker that does not answer is terminated and the report says so.
    Arguments are checked before anything is touched. Interrupted at any step, it leaves
    NVRx as usable as before: the next save succeeds (with a fresh worker, if needed). A save
    that fails as it finalizes the pending ones is raised once the release is done.
    """
    report, failure = released(queue, *_arguments(queue, strategy, timeout))
    if failure is not None:
        raise failure
    return report


@contextmanager
def offloading(
    queue: Any = None, *, strategy: str | None = None, timeout: float | None = None
) -> Iterator[ReleaseReport]:
    """``with offloading():`` releases first, for code that moves model or optimizer storage;
    the block's normal exit resumes a suspended worker, or with ``restart`` starts the next
    (``prewarm``). A failed checkpoint that the release finalized is raised when the block has
    run."""
    strategy, timeout = _arguments(queue, strategy, timeout)
    report, failure = released(queue, strategy, timeout)

    def after():
        onload(strategy, queue)

    with shown_with(failure):
        yield report
    deliver(failure, after)


def _arguments(queue, strategy, timeout):
    """``(strategy, timeout)`` checked and defaulted; ``queue`` checked."""
    strategy = check_strategy(_config.strategy() if strategy is None else strategy)
    timeout = _config.release_timeout() if timeout is None else _config.seconds(timeout, "timeout")
    _shapes.check_queue(queue)
    return strategy, timeout


#: queue -> its call_idx at the last release
_released_at: weakref.WeakKeyDictionary[Any, int] = weakref.WeakKeyDictionary()
#: The queues of the demo's CPU stand-in for the device (``cli.fakecuda``): in CPU-shm mode
#: only to keep CUDA out of their worker, their writers send tensors as GPU ones, which the
#: worker caches: released as queues that hold IPC handles.
fake_device_queues: weakref.WeakSet[Any] = weakref.WeakSet()
_local = threading.local()


def releasing() -> bool:
    """Is this thread inside ``release()`` (named by the collective-wait report)?"""
    return getattr(_local, "depth", 0) > 0


def holds_ipc(queue) -> bool:
    """Can this queue's worker hold CUDA IPC mappings (not CPU shared memory)?"""
    return _shapes.holds_ipc(queue) or queue in fake_device_queues


def has_live_worker(queue) -> bool:
    """Is this queue's persistent worker running?"""
    return _workers.alive(_workers.process_of(_shapes.caller_of(queue)))


def saved_since_release(queue) -> bool:
    """Has this queue scheduled a request since its last release (or ever)?"""
    return getattr(queue, "call_idx", -1) > _released_at.get(queue, -1)


def released(queue, strategy, timeout):
    """``release()``'s work, arguments checked: ``(report, failure)``. ``failure`` is what
    NVRx raised in it (finalizing the pending saves: a dead worker, NVRx's or torch's error;
    closing or aborting the worker), held back until the release is done, for the caller to
    raise. The package's own defect raises, unless a failure is held: then the report is
    None and the failure names the defect."""
    held = []  # what NVRx raised in the release: the first is raised, the rest noted
    _local.depth = getattr(_local, "depth", 0) + 1
    try:
        with _dispatch.planning.releasing_region(timeout):  # else RuntimeError, nothing released
            report = _release(queue, strategy, timeout, held)
    except Exception as defect:  # noqa: BLE001 re-raised, unless NVRx's failure is held
        if not held:
            raise
        from ..core.log import hook_failed

        add_note(
            held[0],
            f"nvrx_ipc_fix: the release that finalized this save then failed "
            f"itself ({type(defect).__name__}: {defect})",
        )
        hook_failed(f"{__name__}:release", defect)
        report = None
    finally:
        _local.depth -= 1
    for other in held[1:]:
        add_note(
            held[0],
            f"nvrx_ipc_fix: NVRx raised again in the same release: {type(other).__name__}: {other}",
        )
    return report, (held[0] if held else None)


def _upstream(call):
    """Run NVRx's ``call()``: ``(its result, None)``, or ``(None, its failure)`` (a dead
    worker, NVRx's or torch's error), held for the caller to raise once the release is done.
    An interrupt is not held."""
    try:
        return call(), None
    except STOP:
        raise
    except BaseException as failure:  # noqa: BLE001 torch's CheckpointException is a BaseException
        return None, failure


def _finalize(queue):
    """Finalize ``queue``'s pending saves as its own finalize does (``no_dist`` as the last
    ``maybe_finalize_async_calls`` call on it, NVRx's default before any): no rank enters a
    collective here that its peers' own finalize would not. From a thread other than the one
    that saves, NVRx's all-reduce runs on that thread's device (``dispatch.device_of``)."""
    with _dispatch.device_of(queue):
        return queue.maybe_finalize_async_calls(
            blocking=True, no_dist=_workers.finalize_no_dist(queue)
        )


@dataclass
class _Tally:
    """What one release did so far, queue by queue."""

    held: list  # what NVRx raised: released() raises the first
    skipped: list = field(default_factory=list)  # "what: why"
    errors: list = field(default_factory=list)  # "queue: what went wrong" (the package's)
    released: int = 0
    kept: bool = False
    terminated: bool = False
    suspended: bool = False

    def upstream(self, call):
        """``call()``'s result; what NVRx raised in it is held (``_upstream``)."""
        result, failure = _upstream(call)
        if failure is not None:
            self.held.append(failure)
        return result, failure


def _release(queue, strategy, timeout, held):
    start = time.perf_counter()
    free_before = _cleanup.device_free_bytes()
    core = sys.modules.get(CORE)
    trainer_cache = _shapes.worker_data_cache(core)  # the sync path's
    if trainer_cache is None:
        why = (
            "NVRx is not imported"
            if _shapes.worker_cache(core) is None
            else "this NVRx has no worker cache"
        )
        return ReleaseReport(
            strategy, 0, time.perf_counter() - start, 0, False, False, 0, (f"all: {why}",)
        )
    queues = [queue] if queue is not None else _shapes.live_queues(core)
    keys = _cleanup.cached_key_count() + len(trainer_cache)
    tally = _Tally(held)
    why = _suspend.unavailable() if strategy == "suspend" else None
    if why is not None:
        tally.skipped.append(f"suspend: {why}; restart instead")
        strategy = "restart"
    if not queues:
        tally.skipped.append("queues: no live AsyncCallsQueue")
    with _dispatch.holding(queues, timeout, "release()"):  # else RuntimeError, nothing released
        for q in queues:
            _release_queue(q, strategy, timeout, tally)
    trainer_cache.clear()
    cleaned = None
    if tally.released or keys:
        cleaned = _cleanup.clear_trainer_caches(f"release ({strategy})", free_before, keys)
    else:  # nothing was held: no cleanup to run (or count), only the guard's records to drop
        _cleanup.forget_keys()
    freed = (cleaned.freed_bytes or 0) if cleaned is not None else 0
    pin = sum(_prewarm.planned_pin_bytes(q) for q in queues) if strategy == "restart" else 0
    if strategy == "restart" and _prewarm.unavailable(core) is None:
        _standby.start()  # inference follows: the next worker's imports happen meanwhile
    report = ReleaseReport(
        strategy,
        freed,
        time.perf_counter() - start,
        tally.released,
        tally.kept,
        tally.terminated,
        keys,
        tuple(tally.skipped),
        "; ".join(tally.errors) or None,
        pin,
        tally.suspended,
    )
    if report.error:
        from ..core.log import warn_once

        warn_once(("release", report.error), "nvrx_ipc_fix: release: %s", report.error)
    if tally.released:
        _cleanup.add(releases=1)
        logger.info(report.summary())
    return report


def _release_queue(q, strategy, timeout, tally):
    """Release one queue (its lock held): finalize its pending saves, let a worker that has
    had no save go, then the strategy's own step (``_STEPS``) on its live worker."""
    label = f"queue {id(q):#x}"
    if not holds_ipc(q):
        tally.skipped.append(f"{label}: cpu_shm_mode holds no IPC handles")
        return
    if _suspend.suspended(q):
        if strategy in ("flush", "suspend"):
            tally.skipped.append(
                f"{label}: its worker is suspended: nothing of it is on the device"
            )
            return
        _suspend.ready(q)  # terminate, restart: back to running, then closed
    if q.get_num_unfinalized_calls():
        tally.upstream(lambda: _finalize(q))
        if q.get_num_unfinalized_calls():  # a failure that finalized nothing
            tally.skipped.append(f"{label}: saves still pending after a failed finalize")
            return
    stopped = False
    if _prewarm.idle(q):  # a worker waits for q's first save: it holds no IPC mappings
        if strategy == "flush":
            tally.skipped.append(f"{label}: its worker has had no save yet: nothing to release")
            return
        stopped = _prewarm.stop(q)
        tally.terminated = tally.terminated or stopped
        if stopped and strategy == "suspend":  # it has had no save: started again at onload
            _suspend.mark_ended(q)
    if has_live_worker(q):
        _cleanup.forget_keys()  # first: whatever happens next, the next save sends tensors
        error = _STEPS[strategy](q, timeout, tally)
        if error:
            tally.errors.append(f"{label}: {error}")
            tally.terminated = True
        elif strategy in ("flush", "suspend"):
            tally.kept = True
    elif not stopped:
        tally.skipped.append(f"{label}: no live worker")
        _released_at[q] = q.call_idx
        return
    _released_at[q] = q.call_idx
    tally.released += 1


def _close(q, timeout, tally):
    """``terminate``, ``restart``: close the worker (NVRx's close; the next save, or
    ``prewarm``, starts another)."""
    tally.upstream(q.close)
    tally.terminated = True


def _flush(q, timeout, tally):
    """``flush``: the worker drops its cache (``inside.drop_cache``) and stays; the error, if
    it did not answer (it was then aborted, or, dead, detached)."""
    from .inside import drop_cache

    # NVRx's queues, or its abort of a worker that did not answer, may raise
    error, failure = tally.upstream(lambda: run_in_worker(q, drop_cache, (), timeout))
    return f"the request to the worker failed ({type(failure).__name__})" if failure else error


def _flush_and_suspend(q, timeout, tally):
    """``suspend``: flush, then suspend the worker through the CUDA driver; one that could
    not be suspended was ended, and the onload starts the next."""
    error = _flush(q, timeout, tally) or _suspend.suspend(
        q, _shapes.caller_of(q), timeout, tally.held
    )
    if error:
        _suspend.mark_ended(q)
    else:
        tally.suspended = True
    return error


#: Each strategy's step on a live worker (``release()``'s docs: ``docs/release.md``).
_STEPS = {"flush": _flush, "terminate": _close, "restart": _close, "suspend": _flush_and_suspend}


def onload(strategy, queue=None):
    """The model is back: resume the suspended workers of ``queue`` (None: every one) in the
    background, and start the next worker where ``strategy``'s release ended one (``restart``;
    ``suspend`` where a worker could not be suspended)."""
    _suspend.resume(queue, wait=False)
    strategy = _suspend.in_force(strategy)
    if strategy == "restart":
        _prewarm.start(queue)
    elif strategy == "suspend":
        core = sys.modules.get(CORE)
        queues = (
            [queue] if queue is not None else _shapes.live_queues(core) if core is not None else []
        )
        for q in queues:
            if _suspend.ended(q):
                _prewarm.start(q)


def run_in_worker(queue, function, args, timeout):
    """Run ``function(*args)`` in ``queue``'s idle worker; return an error or ``None``.

    The request goes straight onto the worker's queue and its answer is read from the
    worker's completion queue, so ``AsyncCallsQueue`` bookkeeping (and its collectives) is
    untouched. Unless the answer was read (a timeout, the worker's death, an exception or
    an interrupt here), the worker's state is unknown and a late answer could be taken for
    a save's: the worker is aborted (or, if dead, detached) and the next save starts a fresh one.
    """
    caller = _shapes.caller_of(queue)
    requests, _, completions = _shapes.worker_queues(caller)
    answered = False
    try:
        requests.put(
            _shapes.request(sys.modules[type(caller).__module__], function, args, _workers.SENTINEL)
        )
        error, answered = _answer(completions, _workers.process_of(caller), timeout)
        return error
    finally:
        if not answered and _workers.aborted_by(caller) is None:  # else that abort ended it
            if _workers.alive(_workers.process_of(caller)):
                queue.close(abort=True)  # the worker watch wakes it for NVRx 0.7.0's
            else:
                _workers.abandon(caller)
                _workers.forget_caller(queue, caller)


def _answer(completions, process, timeout):
    """Wait for the worker's answer to our request on its ``completions`` queue: ``(error or
    None, answered)``."""
    deadline = time.monotonic() + timeout
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            return f"the worker did not answer within {timeout:g} s and was terminated", False
        try:
            done = completions.get(timeout=min(left, 0.2))
        except Empty:
            if _workers.dead(process):
                return f"the worker died ({_workers.describe_exit(process.exitcode)})", False
            continue
        if done == _workers.SENTINEL:
            return None, True
        return f"the worker answered {done!r} instead of our request", False
