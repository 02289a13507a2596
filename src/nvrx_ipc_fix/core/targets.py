"""The one table of what the package intercepts, which activation, deactivation, status, the
tests and ``docs/architecture.md`` all read.

``CALLS`` names each NVRx (or megatron-core, Megatron, Bridge, NeMo RL, slime) function the
fixes need, the region its one wrapper holds around them (``core.dispatch``: a queue's lock;
a save planned to send only a cache key until its schedule), and the order of the fixes' steps
inside it, outermost first: the protocol of that call, written once. ``TARGETS`` gives each fix's
step in a call: the step (``module:function`` in this package, wrapt's signature, imported only when
it is installed), the leading parameters the original must have, and a probe that decides, once the
module is imported, whether the fix applies (``shapes``: what NVRx's and megatron-core's
code has). Only standard-library names are imported here.

Until the module is imported, a probe (given ``None``) decides only where the fix cannot
apply whatever the module will hold (an installed NVRx without the IPC cache, a setting);
else it returns ``None``. ``status()`` then says ``not_applicable`` where the distribution
that ships the module is not installed (``detect.distribution_of``), else ``pending``.
"""

from .detect import (
    BRIDGE,
    CORE,
    FS,
    MCORE_ASYNC,
    MCORE_FS,
    MEGATRON,
    NEMO_POLICY,
    NEMO_VALUE,
    SLIME_ACTOR,
)


def _probe(name):
    """``shapes.<name>``, imported when a module is decided or ``status()`` asks: ``shapes``
    stays off the activation path (importing it costs more than this table)."""

    def applies(module):
        from . import shapes

        return getattr(shapes, name)(module)

    applies.__name__ = applies.__qualname__ = name
    return applies


(
    caller_queues,
    cpu_snapshots,
    nvrx_worker_cache,
    persistent_queue,
    persistent_worker,
    shared_results,
    warm_up,
    worker_cache,
    worker_loop,
    writer_cache,
    writer_keys,
) = map(
    _probe,
    (
        "caller_queues",
        "cpu_snapshots",
        "nvrx_worker_cache",
        "persistent_queue",
        "persistent_worker",
        "shared_results",
        "warm_up",
        "worker_cache",
        "worker_loop",
        "writer_cache",
        "writer_keys",
    ),
)


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
#: in a child of ``os.fork()``, drops the parent's checkpoint workers.
ALWAYS = {CORE: ("worker.inherited",), MCORE_ASYNC: ("worker.inherited",)}


class Target:
    """One fix's step in one call (``CALLS``).

    A fix is installed in a module all or nothing: when one of its targets there that is not
    ``optional`` cannot be patched, none of them is. An optional target's loss leaves the rest.
    """

    __slots__ = ("fix", "module", "attr", "step", "params", "applies", "aliases", "optional")

    def __init__(self, fix, module, attr, step, params, applies, aliases=False, optional=False):
        self.fix = fix
        self.module = module
        self.attr = attr  # dotted path inside the module
        self.step = step  # "module:function" in this package, wrapt's signature
        self.params = params  # leading parameter names the original must have
        self.applies = applies  # module or None -> (state, reason), or None if it needs the module
        self.aliases = aliases  # module-level function: also redirect `from module import attr`
        self.optional = optional  # the fix works without it (it only adds to what it says)

    @property
    def name(self):
        return f"{self.module}:{self.attr}"

    def __repr__(self):
        return f"Target({self.fix} in {self.name})"


class Call:
    """One intercepted function: the region its wrapper holds around the steps (``QUEUE``,
    ``SCHEDULE``, ``CLOSE`` or None) and the fixes whose steps run in it, outermost first."""

    __slots__ = ("module", "attr", "region", "order")

    def __init__(self, module, attr, order, region=None):
        self.module, self.attr, self.order, self.region = module, attr, order, region

    @property
    def name(self):
        return f"{self.module}:{self.attr}"

    def __repr__(self):
        return f"Call({self.name})"


#: The call's ``self`` is an NVRx (or megatron-core) queue: its wrapper holds that queue's
#: lock around every step, so that a release, a schedule, a finalize and a close of one queue
#: never interleave (``core.dispatch.queue_lock``).
QUEUE = "queue"
#: ``QUEUE`` for a schedule, which also ends the oldest save this thread planned to send only a
#: cache key (``core.dispatch.planning``: a release in another thread waits for such a save).
SCHEDULE = "schedule"
#: ``QUEUE`` for a close; an abort (``abort=True``) takes no lock of the package's: a save of
#: another thread that holds the queue's lock may never end, and the abort is what ends it
#: (the worker watch ends that save as one on a dead worker).
CLOSE = "close"


def _watch_calls(module, fix):
    """The worker watch's calls in one implementation (NVRx core, megatron-core's copy)."""
    return (
        Call(module, "AsyncCallsQueue.schedule_async_request", ("cpu_snapshot", fix), SCHEDULE),
        Call(module, "AsyncCallsQueue.maybe_finalize_async_calls", (fix,), QUEUE),
        Call(module, "PersistentAsyncCaller.is_current_async_call_done", (fix,)),
        Call(module, "AsyncCaller.sync_all_async_calls", (fix,)),
        Call(module, "PersistentAsyncCaller.close", ("cpu_snapshot", fix)),
        Call(module, "AsyncCallsQueue.close", (fix,), CLOSE),
    )


_TERMINATE = ("worker_watch", "release_on_offload", "clear_on_close")
#: NeMo RL's and slime's points where storage leaves (offload) or the model comes back.
_OFFLOAD_POINTS = (
    (NEMO_POLICY, "MegatronPolicyWorkerImpl.offload_before_refit", "offload_wrapper"),
    (NEMO_POLICY, "MegatronPolicyWorkerImpl.offload_after_refit", "offload_wrapper"),
    (
        NEMO_POLICY,
        "MegatronPolicyWorkerImpl.prepare_for_lp_inference",  # NeMo RL #4183
        "reload_wrapper",
    ),
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

#: Every intercepted call, with its region and the order of the fixes' steps, outermost first.
CALLS = {
    call.name: call
    for call in (
        Call(CORE, "AsyncCallsQueue.__init__", ("prewarm",)),
        # the request queue says when it could not send a request (worker_watch)
        Call(CORE, "PersistentAsyncCaller.__init__", ("worker_watch",)),
        # the worker runs again (suspend) and a prewarmed one is ready (prewarm) before the save's
        # CPU tensors are copied (cpu_snapshot) and it is handed over, watched (worker_watch), all
        # under the queue's lock
        Call(
            CORE,
            "AsyncCallsQueue.schedule_async_request",
            ("suspend", "prewarm", "cpu_snapshot", "worker_watch"),
            SCHEDULE,
        ),
        Call(CORE, "AsyncCallsQueue.maybe_finalize_async_calls", ("worker_watch",), QUEUE),
        Call(CORE, "PersistentAsyncCaller.is_current_async_call_done", ("worker_watch",)),
        Call(CORE, "AsyncCaller.sync_all_async_calls", ("worker_watch",)),
        # resumed before it is told to stop; the trainer's caches cleared once NVRx's close and
        # the watch's are done
        Call(
            CORE,
            "PersistentAsyncCaller.close",
            ("suspend", "clear_on_close", "cpu_snapshot", "worker_watch"),
        ),
        Call(CORE, "AsyncCallsQueue.close", ("worker_watch",), CLOSE),
        Call(
            CORE, "PersistentAsyncCaller.async_process_target", ("worker_watch",)
        ),  # in the worker
        # the planned key stays valid until the schedule (clear_on_close), around the re-send of
        # moved storage (stale_guard); the save's own results queue replaces NVRx's shared one as
        # soon as NVRx's method has set it (own_results); the storage of each tensor the planner
        # gives is noted for the copy at the schedule (cpu_snapshot)
        Call(
            FS,
            "FileSystemWriterAsync.prepare_write_data",
            ("clear_on_close", "stale_guard", "own_results", "cpu_snapshot"),
        ),
        # a save on NVRx's shared queue that overlapped another fails here (own_results)
        Call(FS, "FileSystemWriterAsync.retrieve_write_results", ("own_results",)),
        *_watch_calls(MCORE_ASYNC, "mcore_worker_watch"),
        Call(MCORE_FS, "FileSystemWriterAsync.prepare_write_data", ("cpu_snapshot",)),
        # a terminate that meets a failed save still closes (worker_watch), after the release
        # that NVRX_IPC_FIX_RELEASE=finalize asks for, around the clearing after the close
        Call(MEGATRON, "maybe_finalize_async_save", _TERMINATE),
        Call(BRIDGE, "maybe_finalize_async_save", _TERMINATE),
        *(Call(module, attr, ("release_on_offload",)) for module, attr, _ in _OFFLOAD_POINTS),
    )
}


def _watch(fix, module, applies):
    """The worker-watch steps of one implementation (NVRx core or megatron-core's copy)."""
    step = "fixes.worker_watch:{}".format
    return (
        Target(
            fix,
            module,
            "AsyncCallsQueue.schedule_async_request",
            step("schedule_wrapper"),
            ("self", "async_request"),
            applies,
        ),
        Target(
            fix,
            module,
            "AsyncCallsQueue.maybe_finalize_async_calls",
            step("finalize_wrapper"),
            ("self", "blocking", "no_dist"),
            applies,
        ),
        Target(
            fix,
            module,
            "PersistentAsyncCaller.is_current_async_call_done",
            step("done_wrapper"),
            ("self", "blocking", "no_dist"),
            applies,
        ),
        Target(
            fix,
            module,
            "AsyncCaller.sync_all_async_calls",
            step("sync_wrapper"),
            ("self", "is_alive"),
            applies,
        ),
        Target(
            fix, module, "PersistentAsyncCaller.close", step("close_wrapper"), ("self",), applies
        ),
        Target(
            fix, module, "AsyncCallsQueue.close", step("queue_close_wrapper"), ("self",), applies
        ),  # NVRx 0.4.1's takes no abort
    )


_MEGATRON_PARAMS = (
    (MEGATRON, ("blocking", "terminate")),
    (BRIDGE, ("global_state", "ckpt_cfg", "blocking", "terminate")),
)

#: Each fix's step in each call (``CALLS`` orders them).
TARGETS = (
    _watch("worker_watch", CORE, persistent_worker)
    + (
        # Optional: it only forwards the traceback of an exception outside the request's functions.
        Target(
            "worker_watch",
            CORE,
            "PersistentAsyncCaller.async_process_target",
            "fixes.worker_watch:worker_loop_wrapper",
            ("rank", "queue", "preload_q", "comp_q"),
            worker_loop,
            optional=True,
        ),
        # Optional: without it, only a request that cannot be pickled waits for ever, as in NVRx.
        Target(
            "worker_watch",
            CORE,
            "PersistentAsyncCaller.__init__",
            "fixes.worker_watch:caller_init_wrapper",
            ("self",),
            caller_queues,
            optional=True,
        ),
    )
    + _watch("mcore_worker_watch", MCORE_ASYNC, persistent_worker)
    + (
        Target(
            "clear_on_close",
            CORE,
            "PersistentAsyncCaller.close",
            "fixes.clear_on_close:close_wrapper",
            ("self", "abort"),
            worker_cache,
        ),
        Target(
            "clear_on_close",
            FS,
            "FileSystemWriterAsync.prepare_write_data",
            "fixes.clear_on_close:planning_wrapper",
            ("self", "plan", "planner"),
            writer_keys,
        ),
        *(
            Target(
                "clear_on_close",
                module,
                "maybe_finalize_async_save",
                "fixes.clear_on_close:finalize_wrapper",
                params,
                nvrx_worker_cache,
                aliases=True,
            )
            for module, params in _MEGATRON_PARAMS
        ),
        Target(
            "stale_guard",
            FS,
            "FileSystemWriterAsync.prepare_write_data",
            "fixes.stale_guard:prepare_write_data_wrapper",
            ("self", "plan", "planner"),
            writer_cache,
        ),
        Target(
            "own_results",
            FS,
            "FileSystemWriterAsync.prepare_write_data",
            "fixes.own_results:prepare_write_data_wrapper",
            ("self", "plan", "planner"),
            shared_results,
        ),
        Target(
            "own_results",
            FS,
            "FileSystemWriterAsync.retrieve_write_results",
            "fixes.own_results:retrieve_write_results_wrapper",
            ("self",),
            shared_results,
        ),
        # NVRx's writer and megatron-core's copy of it (async_strategy="mcore")
        *(
            Target(
                "cpu_snapshot",
                module,
                "FileSystemWriterAsync.prepare_write_data",
                "fixes.cpu_snapshot:prepare_write_data_wrapper",
                ("self", "plan", "planner"),
                cpu_snapshots,
            )
            for module in (FS, MCORE_FS)
        ),
        # the copy itself, at a schedule on a persistent worker, and the copies kept for the
        # next save dropped at the worker's close; optional: the writer's target says whether
        # the fix applies (a save noted there is copied here)
        *(
            Target(
                "cpu_snapshot",
                module,
                attr,
                f"fixes.cpu_snapshot:{step}",
                params,
                persistent_queue,
                optional=True,
            )
            for module in (CORE, MCORE_ASYNC)
            for attr, step, params in (
                (
                    "AsyncCallsQueue.schedule_async_request",
                    "schedule_wrapper",
                    ("self", "async_request"),
                ),
                ("PersistentAsyncCaller.close", "close_wrapper", ("self",)),
            )
        ),
        Target(
            "prewarm",
            CORE,
            "AsyncCallsQueue.schedule_async_request",
            "fixes.prewarm:schedule_wrapper",
            ("self", "async_request"),
            warm_up,
        ),
        Target(
            "prewarm",
            CORE,
            "AsyncCallsQueue.__init__",
            "fixes.prewarm:init_wrapper",
            ("self", "persistent"),
            warm_up,
        ),
        Target(
            "suspend",
            CORE,
            "AsyncCallsQueue.schedule_async_request",
            "fixes.suspend:schedule_wrapper",
            ("self", "async_request"),
            worker_cache,
        ),
        Target(
            "suspend",
            CORE,
            "PersistentAsyncCaller.close",
            "fixes.suspend:close_wrapper",
            ("self",),
            worker_cache,
        ),
        # each point works alone: a framework release without one of them keeps the others
        *(
            Target(
                "release_on_offload",
                module,
                attr,
                f"fixes.release_on_offload:{step}",
                ("self",),
                release_policy,
                optional=True,
            )
            for module, attr, step in _OFFLOAD_POINTS
        ),
        # NVRX_IPC_FIX_RELEASE=finalize
        *(
            Target(
                "release_on_offload",
                module,
                "maybe_finalize_async_save",
                "fixes.release_on_offload:finalize_wrapper",
                params,
                release_policy,
                aliases=True,
            )
            for module, params in _MEGATRON_PARAMS
        ),
        # a terminate that meets a failed save still closes
        *(
            Target(
                "worker_watch",
                module,
                "maybe_finalize_async_save",
                "fixes.worker_watch:terminate_wrapper",
                params,
                framework_queue,
                aliases=True,
            )
            for module, params in _MEGATRON_PARAMS
        ),
    )
)
