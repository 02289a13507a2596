"""Fix ``release_on_offload``: release the worker's CUDA IPC mappings, without a code
change, right before a framework moves model or optimizer storage (NeMo RL's offload
points, slime's ``sleep()``), and with ``NVRX_IPC_FIX_RELEASE=finalize`` after every blocking
``maybe_finalize_async_save``.

A release happens only when some queue can hold IPC handles, has a live worker and
scheduled a save since its last release; with the ``restart`` strategy, whenever such a
queue has any worker (nothing of it may stay on the device for the inference that follows).
At the offload points the strategy is ``NVRX_IPC_FIX_STRATEGY``, else ``restart``: measured
on an H200, its next worker, started at the onload and pinned ahead, takes the save after
the onload as fast as a kept one, and nothing of it is on the GPU during inference
(BENCHMARKS.md). After a blocking finalize, where no onload follows, it is ``release()``'s.
NeMo RL builds that carry PR #3322 terminate the worker themselves in
``offload_before_refit``/``offload_after_refit`` when their config asks for it; then the
package stays out of the way (no second release).

With ``restart``, the points where the model comes back (``prepare_for_training``, slime's
``wake_up``, and
``prepare_for_lp_inference`` / the value worker's ``prepare_for_inference``, which also move
grads or optimizer off) start the next worker in the background once they return
(``prewarm``). Those two release with ``flush`` first: the GPU is not handed to inference there.
"""

import sys

from ..core import config as _config
from ..core.detect import CORE
from ..core.log import hook_failed

#: NeMo RL methods that run ``finalize_async_save()`` first (PR #3322).
_SELF_RELEASING = ("offload_before_refit", "offload_after_refit")


def offload_wrapper(wrapped, instance, args, kwargs):
    """Around a framework method that moves storage off the GPU."""
    _before(wrapped, instance)
    return wrapped(*args, **kwargs)


def onload_wrapper(wrapped, instance, args, kwargs):
    """Around a framework method that moves the model back for training."""
    result = wrapped(*args, **kwargs)
    _after(wrapped, instance)
    return result


def reload_wrapper(wrapped, instance, args, kwargs):
    """Around a NeMo RL method that brings the model back and moves grads or optimizer off."""
    _before(wrapped, instance, reload=True)
    result = wrapped(*args, **kwargs)
    _after(wrapped, instance)
    return result


def _before(wrapped, instance, reload=False):
    """Release if needed; where the model comes back, ``restart`` releases as ``flush``."""
    try:
        if _config.release_policy() != "never" and not _releases_itself(wrapped, instance):
            restart = _config.auto_strategy() == "restart"
            release_if_needed("flush" if reload and restart else None)
    except Exception as exc:
        hook_failed(f"{type(instance).__module__}:{wrapped.__qualname__}", exc)


def _after(wrapped, instance):
    """With ``restart``: the model is back, start the next worker (``prewarm``)."""
    try:
        if _config.release_policy() != "never" and _config.auto_strategy() == "restart":
            from .prewarm import prewarm

            prewarm()
    except Exception as exc:
        hook_failed(f"{type(instance).__module__}:{wrapped.__qualname__}", exc)


def after_finalize(blocking, terminate):
    """Called by the ``maybe_finalize_async_save`` wrapper after the original returned."""
    if blocking and not terminate and _config.release_policy() == "finalize":
        release_if_needed(_config.strategy())  # no onload follows: release()'s default


def release_if_needed(strategy=None):
    """``release()`` when a queue may hold IPC handles it took since its last release; with
    ``restart`` also when such a queue has any worker, or one waits for its first save."""
    from .prewarm import idle
    from ..core.release import has_live_worker, holds_ipc, release, saved_since_release

    queues = getattr(sys.modules.get(CORE), "AsyncCallsQueue", None)  # None while importing
    if queues is None:
        return None
    strategy = _config.auto_strategy() if strategy is None else strategy
    for queue in queues.get_instances():
        if not holds_ipc(queue):
            continue
        live = has_live_worker(queue)
        if (live and saved_since_release(queue)) or (
                strategy == "restart" and (live or idle(queue))):
            return release(strategy=strategy)
    return None


def _releases_itself(wrapped, instance):
    if wrapped.__name__ not in _SELF_RELEASING:
        return False
    requires = getattr(instance, "_requires_nvrx_cuda_cache_release", None)
    return bool(requires is not None
                and getattr(instance, "_async_checkpoint_cuda_cache_active", False)
                and requires())
