"""Fix ``release_on_offload``: release the worker's CUDA IPC mappings, without a code
change, right before a framework moves model or optimizer storage (NeMo RL's offload
points), and with ``NVRX_IPC_FIX_RELEASE=finalize`` after every blocking
``maybe_finalize_async_save``.

A release happens only when some queue can hold IPC handles, has a live worker and
scheduled a save since its last release. NeMo RL builds that carry PR #3322 terminate the
worker themselves in ``offload_before_refit``/``offload_after_refit`` when their config
asks for it; then the package stays out of the way (no second release).
"""

import sys

from . import _config
from ._detect import CORE
from ._log import hook_failed

#: NeMo RL methods that run ``finalize_async_save()`` first (PR #3322).
_SELF_RELEASING = ("offload_before_refit", "offload_after_refit")


def offload_wrapper(wrapped, instance, args, kwargs):
    """Around a NeMo RL method that moves storage off the GPU."""
    try:
        if _config.release_policy() != "never" and not _releases_itself(wrapped, instance):
            release_if_needed()
    except Exception as exc:
        hook_failed(f"{type(instance).__module__}:{wrapped.__qualname__}", exc)
    return wrapped(*args, **kwargs)


def after_finalize(blocking, terminate):
    """Called by the ``maybe_finalize_async_save`` wrapper after the original returned."""
    if blocking and not terminate and _config.release_policy() == "finalize":
        release_if_needed()


def release_if_needed():
    """``release()`` when a queue may hold IPC handles it took since its last release."""
    from ._release import has_live_worker, holds_ipc, release, saved_since_release

    queues = getattr(sys.modules.get(CORE), "AsyncCallsQueue", None)  # None while importing
    if queues is None:
        return None
    for queue in queues.get_instances():
        if has_live_worker(queue) and holds_ipc(queue) and saved_since_release(queue):
            return release()
    return None


def _releases_itself(wrapped, instance):
    if wrapped.__name__ not in _SELF_RELEASING:
        return False
    requires = getattr(instance, "_requires_nvrx_cuda_cache_release", None)
    return bool(requires is not None
                and getattr(instance, "_async_checkpoint_cuda_cache_active", False)
                and requires())
