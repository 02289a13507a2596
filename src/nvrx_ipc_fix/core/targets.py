"""The one table of patch targets that activation, deactivation, status and tests all read.

Each target names a module, a dotted attribute inside it, its wrapt-style wrapper
(``module:function`` in this package, imported only when the target is patched), the
leading parameters the original must have, and a probe that decides, once the module is
imported, whether the fix applies. Only standard-library names are imported here.

Until the module is imported, a probe (given ``None``) decides only where the fix cannot
apply whatever the module will hold (an installed NVRx without the IPC cache, a setting);
else it returns ``None``. ``status()`` then says ``not_applicable`` where the distribution
that ships the module is not installed (``detect.distribution_of``), else ``pending``.
"""

import sys

from .detect import CORE, FS, NVRX_DIST, distribution_version, release_has_cache

#: Fix name -> what it does, in one line.
FIXES = {
    "clear_on_close": "clear the trainer-side cache when the checkpoint worker is closed "
                      "(no 'Worker cache miss' hang on the next save)",
    "stale_guard": "re-send tensors whose storage moved (no stale checkpoints on NVRx 0.6.0)",
    "release_on_offload": "release the worker's CUDA IPC mappings before NeMo RL or slime "
                          "moves model or optimizer storage, and with the restart strategy "
                          "start the next worker when the model is back (NVRX_IPC_FIX_RELEASE)",
    "worker_watch": "a dead NVRx checkpoint worker becomes a CheckpointWorkerError on every "
                    "rank, a stuck one an ERROR log line (NVRX_IPC_FIX_STALL_TIMEOUT)",
    "mcore_worker_watch": "the same for megatron-core's own persistent checkpoint worker "
                          "(async_strategy='mcore')",
    "prewarm": "start the NVRx checkpoint worker ahead of the save that needs it (prewarm(), "
               "strategy restart, NVRX_IPC_FIX_PREWARM=start); the save waits until it is ready",
    "suspend": "a worker the suspend strategy keeps with nothing on the device is resumed "
               "before it is given a save or closed (without it, the release restarts instead)",
}


def nvrx_worker_cache(_module):
    """Megatron/Bridge targets: does the installed NVRx cache IPC handles?

    Needs no Megatron module, so ``status()`` asks it for pending targets too.
    """
    core = sys.modules.get(CORE)
    if core is not None:
        return worker_cache(core)
    version = distribution_version(NVRX_DIST)
    if version is None:
        return "not_applicable", "nvidia-resiliency-ext is not installed"
    if release_has_cache(version) is False:
        return "not_applicable", f"NVRx {version} has no IPC tensor cache (added in 0.6.0)"
    return "active", f"NVRx {version} may cache IPC handles in its worker"


def framework_queue(module):
    """Megatron and Bridge: their ``maybe_finalize_async_save`` closes NVRx's or
    megatron-core's queue, whose worker the watch watches."""
    if module is None:
        return None  # decided once the module is imported
    return "active", "a terminate that meets a failed save still closes the queue, then raises"


def release_policy(module):
    """NeMo RL and slime targets: the release policy allows it and NVRx may cache."""
    from .config import RELEASE, release_policy

    if release_policy() == "never":
        return "disabled", f"{RELEASE}=never"
    return nvrx_worker_cache(module)


def worker_cache(core):
    """NVRx core: does the persistent worker keep a data cache?"""
    caller = getattr(core, "PersistentAsyncCaller", None)
    if caller is None:
        if core is None or _initializing(core):
            return None  # decided once the module is imported
        return "not_applicable", "this NVRx has no persistent worker"
    if hasattr(caller, "_worker_data_cache"):
        return "active", "NVRx caches tensors in its persistent worker"
    return "not_applicable", ("this NVRx has no worker cache "
                              "(no PersistentAsyncCaller._worker_data_cache)")


def writer_cache(fs):
    """NVRx filesystem_async: is the IPC cache there, and does it check data pointers?"""
    writer = getattr(fs, "FileSystemWriterAsync", None)
    if writer is None:
        if fs is None or _initializing(fs):
            return None  # decided once the module is imported
        return "not_applicable", "this NVRx has no FileSystemWriterAsync"
    if "_cached_identifiers" not in vars(writer):
        return "not_applicable", ("this NVRx has no IPC tensor cache "
                                  "(no FileSystemWriterAsync._cached_identifiers)")
    if hasattr(writer, "_cached_tensor_data_ptrs"):
        return "fixed_upstream", "NVRx re-sends when data pointers change (NVRx PR #314)"
    if not hasattr(fs, "_compute_data_structure_key_from_plan"):
        return "unsupported", "filesystem_async has no _compute_data_structure_key_from_plan"
    return "active", "NVRx caches IPC handles without checking the storage"


def persistent_worker(module):
    """NVRx core or megatron-core async_utils: is there a persistent worker we can watch?"""
    if module is None:
        return None
    caller = getattr(module, "PersistentAsyncCaller", None)
    if caller is None or not hasattr(module, "AsyncCallsQueue"):
        return "not_applicable", "this version has no persistent checkpoint worker"
    if _upstream_error(module):  # Megatron-LM PR #6971
        return "fixed_upstream", ("this version raises its own PersistentAsyncWorkerError for "
                                  "a dead worker (Megatron-LM PR #6971)")
    from .workers import queue_names

    if queue_names(caller) is None:
        return "unsupported", "PersistentAsyncCaller keeps its worker's queues under unknown names"
    if not hasattr(module, "_ActiveAsyncRequest"):
        return "unsupported", "no _ActiveAsyncRequest: a failed save cannot be kept for its finalize"
    return "active", ("a dead persistent worker is one error per rank, raised by the finalize of "
                      "the failed save; stalls are logged")


def _upstream_error(module):
    """Does ``module`` define its own ``PersistentAsyncWorkerError`` (not this package's)?"""
    found = vars(module).get("PersistentAsyncWorkerError")
    return found is not None and getattr(found, "__module__", "") != f"{__package__}.errors"


def warm_up(module):
    """NVRx core: can its worker be started ahead of a save, as NVRx's own warm-up does?"""
    if module is None:
        return None
    queue = getattr(module, "AsyncCallsQueue", None)
    caller = getattr(module, "PersistentAsyncCaller", None)
    if (queue is None or caller is None or not hasattr(queue, "warmup_persistent_caller")
            or "_start_worker" not in vars(caller)):
        return "not_applicable", ("this NVRx starts its worker only inside a save (no "
                                  "AsyncCallsQueue.warmup_persistent_caller)")
    from .workers import queue_names

    if queue_names(caller) != ("queue", "preload_q", "comp_q"):
        return "unsupported", "PersistentAsyncCaller keeps its worker's queues under unknown names"
    return "active", "prewarm() can start the worker ahead of its save"


def worker_loop(module):
    """NVRx core: does the worker call ``async_process_target`` by name, never as the
    process target that NVRx pickles (the code that starts the worker does not name it)?"""
    watched = persistent_worker(module)
    if watched is None or watched[0] != "active":
        return watched  # the rest of the watch stands aside: so does this part
    caller = module.PersistentAsyncCaller
    if "async_process_target" not in vars(caller):
        return "not_applicable", ("no PersistentAsyncCaller.async_process_target: the worker's "
                                  "traceback stays on stderr")
    starters = [vars(caller).get(name) for name in ("_start_worker", "schedule_async_call")]
    codes = [getattr(f, "__code__", None) for f in starters if f is not None]
    if not codes or any(code is None or "async_process_target" in code.co_names
                        for code in codes):
        return "unsupported", "async_process_target may be the worker's Process target (pickled)"
    return "active", "the worker leaves the traceback of an uncaught exception for the trainer"


def _initializing(module):
    """Is ``module`` still executing (imported in another thread, say)?"""
    return bool(getattr(getattr(module, "__spec__", None), "_initializing", False))


class Target:
    """One function or method to wrap.

    A fix is installed in a module all or nothing: when one of its targets there that is not
    ``optional`` cannot be patched, none of them is. An optional target's loss leaves the rest.
    """

    __slots__ = ("fix", "module", "attr", "wrapper", "params", "applies", "aliases", "optional")

    def __init__(self, fix, module, attr, wrapper, params, applies, aliases=False,
                 optional=False):
        self.fix = fix
        self.module = module
        self.attr = attr  # dotted path inside the module
        self.wrapper = wrapper  # "module:function" in this package, wrapt's signature
        self.params = params  # leading parameter names the original must have
        self.applies = applies  # module or None -> (state, reason), or None if it needs the module
        self.aliases = aliases  # module-level function: also redirect `from module import attr`
        self.optional = optional  # the fix works without it (it only adds to what it says)

    @property
    def name(self):
        return f"{self.module}:{self.attr}"

    def __repr__(self):
        return f"Target({self.name})"


MEGATRON = "megatron.training.async_utils"
BRIDGE = "megatron.bridge.training.checkpointing"
NEMO_POLICY = "nemo_rl.models.policy.workers.megatron_policy_worker"
NEMO_VALUE = "nemo_rl.models.value.workers.megatron_value_worker"
SLIME_ACTOR = "slime.backends.megatron_utils.actor"

MCORE_ASYNC = "megatron.core.dist_checkpointing.strategies.async_utils"


def _watch(fix, module, applies):
    """The worker-watch targets of one implementation (NVRx core or megatron-core's copy)."""
    wrapper = "fixes.worker_watch:{}".format
    return (
        Target(fix, module, "AsyncCallsQueue.schedule_async_request", wrapper("schedule_wrapper"),
               ("self", "async_request"), applies),
        Target(fix, module, "AsyncCallsQueue.maybe_finalize_async_calls",
               wrapper("finalize_wrapper"), ("self", "blocking", "no_dist"), applies),
        Target(fix, module, "PersistentAsyncCaller.is_current_async_call_done",
               wrapper("done_wrapper"), ("self", "blocking", "no_dist"), applies),
        Target(fix, module, "PersistentAsyncCaller.close", wrapper("close_wrapper"), ("self",),
               applies),
        Target(fix, module, "AsyncCallsQueue.close", wrapper("queue_close_wrapper"), ("self",),
               applies),  # NVRx 0.4.1's takes no abort
    )


# The watch's close wrapper comes first, so that it sits under clear_on_close's.
TARGETS = _watch("worker_watch", CORE, persistent_worker) + (
    # Optional: it only forwards the traceback of an exception outside the request's functions.
    Target("worker_watch", CORE, "PersistentAsyncCaller.async_process_target",
           "fixes.worker_watch:worker_loop_wrapper", ("rank", "queue", "preload_q", "comp_q"),
           worker_loop, optional=True),
) + _watch("mcore_worker_watch", MCORE_ASYNC, persistent_worker) + (
    Target("clear_on_close", CORE, "PersistentAsyncCaller.close",
           "fixes.clear_on_close:close_wrapper", ("self", "abort"), worker_cache),
    Target("clear_on_close", MEGATRON, "maybe_finalize_async_save",
           "fixes.clear_on_close:finalize_wrapper", ("blocking", "terminate"),
           nvrx_worker_cache, aliases=True),
    Target("clear_on_close", BRIDGE, "maybe_finalize_async_save",
           "fixes.clear_on_close:finalize_wrapper", ("global_state", "ckpt_cfg", "blocking",
                                                "terminate"), nvrx_worker_cache, aliases=True),
    Target("stale_guard", FS, "FileSystemWriterAsync.prepare_write_data",
           "fixes.stale_guard:prepare_write_data_wrapper", ("self", "plan", "planner"),
           writer_cache),
    # After the watch's schedule wrapper, so that it sits outside it: a prewarmed worker that
    # died unused is let go before the watch would call it "died while idle".
    Target("prewarm", CORE, "AsyncCallsQueue.schedule_async_request",
           "fixes.prewarm:schedule_wrapper", ("self", "async_request"), warm_up),
    Target("prewarm", CORE, "AsyncCallsQueue.__init__", "fixes.prewarm:init_wrapper",
           ("self", "persistent"), warm_up),
    # Outermost: the worker runs again before any other wrapper hands it a save or a close.
    Target("suspend", CORE, "AsyncCallsQueue.schedule_async_request",
           "fixes.suspend:schedule_wrapper", ("self", "async_request"), worker_cache),
    Target("suspend", CORE, "PersistentAsyncCaller.close", "fixes.suspend:close_wrapper",
           ("self",), worker_cache),
) + tuple(
    # each point works alone: a framework release without one of them keeps the others
    Target("release_on_offload", module, attr, f"fixes.release_on_offload:{wrapper}", ("self",),
           release_policy, optional=True)
    for module, attr, wrapper in (  # offload: storage leaves; onload: the model comes back
        (NEMO_POLICY, "MegatronPolicyWorkerImpl.offload_before_refit", "offload_wrapper"),
        (NEMO_POLICY, "MegatronPolicyWorkerImpl.offload_after_refit", "offload_wrapper"),
        (NEMO_POLICY, "MegatronPolicyWorkerImpl.prepare_for_lp_inference",  # NeMo RL #4183
         "reload_wrapper"),
        (NEMO_POLICY, "MegatronPolicyWorkerImpl.prepare_for_training", "onload_wrapper"),
        (NEMO_VALUE, "MegatronValueWorkerImpl.prepare_for_inference", "reload_wrapper"),
        (NEMO_VALUE, "MegatronValueWorkerImpl.finish_inference", "offload_wrapper"),
        (NEMO_VALUE, "MegatronValueWorkerImpl.finish_training", "offload_wrapper"),
        (NEMO_VALUE, "MegatronValueWorkerImpl.prepare_for_training", "onload_wrapper"),
        # slime's save_model calls sleep() right after scheduling its save (THUDM/slime
        # 624b824a898a actor.py:571-596): the release finalizes that save first
        (SLIME_ACTOR, "MegatronTrainRayActor.sleep", "offload_wrapper"),
        (SLIME_ACTOR, "MegatronTrainRayActor.wake_up", "onload_wrapper"),
    )
) + tuple(  # NVRX_IPC_FIX_RELEASE=finalize: outside clear_on_close's wrappers of the same
    Target("release_on_offload", module, "maybe_finalize_async_save",
           "fixes.release_on_offload:finalize_wrapper", params, release_policy, aliases=True)
    for module, params in ((MEGATRON, ("blocking", "terminate")),
                           (BRIDGE, ("global_state", "ckpt_cfg", "blocking", "terminate")))
) + tuple(  # a terminate that meets a failed save still closes: outside clear_on_close's
    Target("worker_watch", module, "maybe_finalize_async_save",
           "fixes.worker_watch:terminate_wrapper", params, framework_queue, aliases=True)
    for module, params in ((MEGATRON, ("blocking", "terminate")),
                           (BRIDGE, ("global_state", "ckpt_cfg", "blocking", "terminate")))
)
