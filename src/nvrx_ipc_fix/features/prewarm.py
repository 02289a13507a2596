"""``prewarm()``: start the NVRx persistent checkpoint worker ahead of the save that needs it
(``core/prewarming.py`` does it)."""

import time

from ..core.prewarming import PrewarmReport, start
from ..core.suspend import resume


def prewarm(queue=None) -> PrewarmReport:
    """Start the checkpoint worker of ``queue`` (an NVRx ``AsyncCallsQueue``; ``None``: of each
    live one) now, so that its next save finds it ready; a suspended worker is resumed instead
    (in the background: the next save waits for it).

    Returns at once: the worker spawns, imports torch and creates its CUDA context in the
    background. Never starts a second worker: a queue whose worker runs or starts, or for
    which NVRx's warm-up worker waits, is skipped, as is a queue that is not persistent, and
    every queue while ``torch.distributed`` is not initialized (the worker's device follows
    the rank). Callable from any thread; the report says what was started and what skipped.
    """
    began = time.perf_counter()
    if queue is not None and not callable(getattr(queue, "schedule_async_request", None)):
        raise TypeError(f"queue must be an NVRx AsyncCallsQueue or None, not "
                        f"{type(queue).__name__}")
    resume(queue, wait=False)
    return start(queue, began)
