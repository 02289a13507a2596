"""``release()`` and ``offloading()``: free the GPU memory the NVRx checkpoint worker holds
through CUDA IPC (``core/release.py`` does it), before code moves model or optimizer storage.
"""

from contextlib import contextmanager

from ..core import config as _config
from ..core.errors import annotate, deliver
from ..core.release import ReleaseReport, check_strategy, onload, released


def release(queue=None, *, strategy=None, timeout=None) -> ReleaseReport:
    """Free the GPU memory the NVRx worker holds through CUDA IPC (``core/release.py``).

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
def offloading(queue=None, *, strategy=None, timeout=None):
    """``with offloading():`` releases first, for code that moves model or optimizer storage;
    the block's normal exit resumes a suspended worker, or with ``restart`` starts the next
    (``prewarm``). A failed checkpoint that the release finalized is raised when the block has
    run."""
    strategy, timeout = _arguments(queue, strategy, timeout)
    report, failure = released(queue, strategy, timeout)

    def after():
        onload(strategy, queue)

    try:
        yield report
    except BaseException as exc:
        if failure is not None:
            annotate(exc, failure)
        raise
    deliver(failure, after)


def _arguments(queue, strategy, timeout):
    """``(strategy, timeout)`` checked and defaulted; ``queue`` checked."""
    strategy = check_strategy(_config.strategy() if strategy is None else strategy)
    timeout = (_config.release_timeout() if timeout is None
               else _config.seconds(timeout, "timeout"))
    if queue is not None and not callable(getattr(queue, "maybe_finalize_async_calls", None)):
        raise TypeError(f"queue must be an NVRx AsyncCallsQueue or None, not "
                        f"{type(queue).__name__}")
    return strategy, timeout
