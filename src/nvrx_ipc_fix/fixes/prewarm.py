"""Fix ``prewarm``: a persistent queue's worker started ahead of its first save
(``NVRX_IPC_FIX_PREWARM=start``, at the queue's creation), and a save handed to a prewarmed
worker only once it is ready (one that failed is first stopped and detached from its queue,
and NVRx starts a fresh one).
The starting itself is ``worker.prewarm``'s.
"""

import sys
import time

from ..core import cleanup as _cleanup, config as _config, shapes as _shapes
from ..core.detect import CORE
from ..core.log import guard, hook_failed, logger
from ..worker import prewarm as _prewarming

SCHEDULE_TARGET = f"{CORE}:AsyncCallsQueue.schedule_async_request"
INIT_TARGET = f"{CORE}:AsyncCallsQueue.__init__"


def init_wrapper(wrapped, queue, args, kwargs):
    """Around ``AsyncCallsQueue.__init__``: with ``NVRX_IPC_FIX_PREWARM=start`` a persistent
    queue starts its worker as soon as it exists, in NVRx's warm-up slot: a framework that
    calls ``warmup_persistent_caller`` next (Megatron does) then finds it there."""
    wrapped(*args, **kwargs)
    try:
        if _shapes.is_persistent(queue) and _config.prewarm_at_start():
            core = sys.modules[CORE]
            why = _prewarming.unavailable(core)
            report = (
                _prewarming.PrewarmReport((), (f"all: {why}",))
                if why is not None
                else _prewarming.start_for([queue], core, time.perf_counter(), slot=True)
            )
            if not report.started:
                logger.info("%s=start: %s", _config.PREWARM, report.summary())
    except Exception as exc:  # noqa: BLE001 NVRx's too: its own start comes at the first save
        hook_failed(INIT_TARGET, exc, fix="prewarm")


def schedule_wrapper(wrapped, queue, args, kwargs, _finalizing=sys.is_finalizing):
    """Around ``AsyncCallsQueue.schedule_async_request``: a prewarmed worker gets the save once
    it is ready; one that failed is first stopped and detached from its queue, and NVRx
    starts a fresh one."""
    if _finalizing():
        return wrapped(*args, **kwargs)
    with _prewarming.scheduling(queue):
        interrupted = True
        try:
            with guard(SCHEDULE_TARGET, fix="prewarm"):  # on failure NVRx starts its worker
                if _config.pin_ahead():
                    _prewarming.record_sizes(
                        queue, args[0] if args else kwargs.get("async_request")
                    )
                _prewarming.take_over(queue)
            interrupted = False
        finally:
            # Interrupted while it waited: this save's request, built for a worker that would
            # get it, never went, so the next save must send full tensors.
            if interrupted:
                _cleanup.forget_keys()
        return wrapped(*args, **kwargs)
