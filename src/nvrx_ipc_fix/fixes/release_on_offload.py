"""Fix ``release_on_offload``: release the worker's CUDA IPC mappings, without a code
change, right before a framework moves model or optimizer storage (NeMo RL's offload
points, slime's ``sleep()``), and with ``NVRX_IPC_FIX_RELEASE=finalize`` after every blocking
``maybe_finalize_async_save``.

A release happens only when some queue can hold IPC handles, has a live worker and
scheduled a save since its last release; with the ``restart`` strategy, whenever such a
queue has any worker (nothing of it may stay on the device for the inference that follows).
At the offload points the strategy is ``NVRX_IPC_FIX_STRATEGY``, else ``suspend``: the worker
is kept with nothing of it on the device and resumed at the onload (BENCHMARKS.md); where the
CUDA driver cannot suspend, ``restart``, whose next worker, started at the onload and pinned
ahead, takes the save after the onload as fast as a kept one. After a blocking finalize,
where no onload follows, it is ``release()``'s.
NeMo RL builds that carry PR #3322 terminate the worker themselves in
``offload_before_refit``/``offload_after_refit`` when their config asks for it; there the
package does not release a second time.

The points where the model comes back (``prepare_for_training``, slime's ``wake_up``, and
``prepare_for_lp_inference`` / the value worker's ``prepare_for_inference``, which also move
grads or optimizer off) resume a suspended worker, or with ``restart`` start the next one, in
the background once they return (``release.onload``). Those two release with ``flush`` first
under ``suspend`` and ``restart``: the GPU is not handed to inference there.
"""

import sys

from ..core import config as _config, shapes as _shapes
from ..core.arguments import flags
from ..core.detect import CORE
from ..core.errors import deliver
from ..core.log import guard

#: NeMo RL methods that run ``finalize_async_save()`` first (PR #3322).
_SELF_RELEASING = ("offload_before_refit", "offload_after_refit")


def offload_wrapper(wrapped, instance, args, kwargs):
    """Around a framework method that moves storage off the GPU."""
    failure = _before(wrapped, instance)
    return deliver(failure, lambda: wrapped(*args, **kwargs))


def onload_wrapper(wrapped, instance, args, kwargs):
    """Around a framework method that moves the model back for training."""
    result = wrapped(*args, **kwargs)
    _after(wrapped, instance)
    return result


def reload_wrapper(wrapped, instance, args, kwargs):
    """Around a NeMo RL method that brings the model back and moves grads or optimizer off."""
    failure = _before(wrapped, instance, reload=True)
    return deliver(failure, lambda: onload_wrapper(wrapped, instance, args, kwargs))


def finalize_wrapper(wrapped, instance, args, kwargs):
    """Around Megatron's and Bridge's ``maybe_finalize_async_save``: with
    ``NVRX_IPC_FIX_RELEASE=finalize``, release after a blocking finalize (no onload follows:
    ``release()``'s default strategy)."""
    result = wrapped(*args, **kwargs)
    failure = None
    with guard(f"{wrapped.__module__}:{wrapped.__qualname__}"):
        blocking, terminate = flags(wrapped, args, kwargs, "blocking", "terminate")
        if blocking and not terminate and _config.release_policy() == "finalize":
            failure = release_if_needed(_config.strategy())
    if failure is not None:
        raise failure
    return result


def _before(wrapped, instance, reload=False):
    """Release if needed; where the model comes back, ``suspend`` and ``restart`` release as
    ``flush``. Returns the failed checkpoint the release finalized, if any, for the method to
    raise."""
    with guard(f"{type(instance).__module__}:{wrapped.__qualname__}"):
        if _config.release_policy() != "never" and not _releases_itself(wrapped, instance):
            onloads = _config.auto_strategy() in ("restart", "suspend")
            return release_if_needed("flush" if reload and onloads else None)
    return None


def _after(wrapped, instance):
    """The model is back: resume the suspended worker, or start the next (``restart``)."""
    with guard(f"{type(instance).__module__}:{wrapped.__qualname__}"):
        if _config.release_policy() != "never":
            from ..worker.release import onload

            onload(_config.auto_strategy())


def release_if_needed(strategy=None):
    """Release when a queue may hold IPC handles it took since its last release, or has
    saves pending (they are finalized first, so that a failed one is the call's error while
    the call still does its work); with ``restart`` and ``suspend`` also when such a queue has
    a worker on the device, or one waits for its first save. Returns the failed checkpoint
    the release met, if any."""
    from ..worker.prewarm import idle
    from ..worker.release import has_live_worker, holds_ipc, released, saved_since_release
    from ..worker.suspend import suspended

    core = sys.modules.get(CORE)
    if getattr(core, "AsyncCallsQueue", None) is None:  # not imported, or being imported
        return None
    strategy = _config.auto_strategy() if strategy is None else strategy
    for queue in _shapes.live_queues(core):
        if not holds_ipc(queue):
            continue
        live = has_live_worker(queue) and not suspended(queue)
        if (
            (live and saved_since_release(queue))
            or queue.get_num_unfinalized_calls()
            or (strategy in ("restart", "suspend") and (live or idle(queue)))
        ):
            return released(None, strategy, _config.release_timeout())[1]
    return None


def _releases_itself(wrapped, instance):
    if wrapped.__name__ not in _SELF_RELEASING:
        return False
    requires = getattr(instance, "_requires_nvrx_cuda_cache_release", None)
    return bool(
        requires is not None
        and getattr(instance, "_async_checkpoint_cuda_cache_active", False)
        and requires()
    )
