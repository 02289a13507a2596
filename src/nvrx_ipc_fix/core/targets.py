"""The one table of patch targets that activation, deactivation, status and tests all read.

Each target names a module, a dotted attribute inside it, its wrapt-style wrapper
(``module:function`` in this package, imported only when the target is patched), the
leading parameters the original must have, and a probe that decides, once the module is
imported, whether the fix applies (``shapes``: what NVRx's and megatron-core's code has).
Only standard-library names are imported here.

Until the module is imported, a probe (given ``None``) decides only where the fix cannot
apply whatever the module will hold (an installed NVRx without the IPC cache, a setting);
else it returns ``None``. ``status()`` then says ``not_applicable`` where the distribution
that ships the module is not installed (``detect.distribution_of``), else ``pending``.
"""

from .detect import (BRIDGE, CORE, FS, MCORE_ASYNC, MEGATRON, NEMO_POLICY, NEMO_VALUE,
                     SLIME_ACTOR)


def _probe(name):
    """``shapes.<name>``, imported when a module is decided or ``status()`` asks: ``shapes``
    stays off the activation path (importing it costs more than this table)."""
    def applies(module):
        from . import shapes

        return getattr(shapes, name)(module)

    applies.__name__ = applies.__qualname__ = name
    return applies


(nvrx_worker_cache, persistent_worker, shared_results, warm_up, worker_cache, worker_loop,
 writer_cache) = map(_probe, ("nvrx_worker_cache", "persistent_worker", "shared_results",
                              "warm_up", "worker_cache", "worker_loop", "writer_cache"))


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


#: What activation imports as these modules are imported, whatever the fixes: the code that,
#: in a child of ``os.fork()``, lets go of the parent's checkpoint workers.
ALWAYS = {CORE: ("worker.inherited",), MCORE_ASYNC: ("worker.inherited",)}


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
        Target(fix, module, "AsyncCaller.sync_all_async_calls", wrapper("sync_wrapper"),
               ("self", "is_alive"), applies),
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
    Target("own_results", FS, "FileSystemWriterAsync.prepare_write_data",
           "fixes.own_results:prepare_write_data_wrapper", ("self", "plan", "planner"),
           shared_results),
    Target("own_results", FS, "FileSystemWriterAsync.retrieve_write_results",
           "fixes.own_results:retrieve_write_results_wrapper", ("self",), shared_results),
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
