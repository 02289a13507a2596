"""What NVRx and megatron-core look like in this process: every difference between their
versions that the package relies on, and the one way the fixes, ``release()``, prewarm and
the after-fork code reach what differs.

* **Probes** (``worker_cache`` … ``collective_problem``): what a module's release has,
  decided when it is imported; the target table (``targets``) takes its verdicts from here.
  A release in ``detect.RELEASES`` is decided by that table; any other version (a git build,
  a newer release) by the names its classes have (``hasattr``, signatures), never by reading
  its code. One probe reads code whatever the version: ``collective_problem``, since the
  worker watch's failure flag must ride on no other collective than the one-int sum.
* **Callers and queues**: NVRx's persistent caller keeps its worker and queues on itself,
  per queue; megatron-core's copy keeps them on its classes, one per process. A class's
  shape (``Caller``) is read once, at its first use, and kept.
* **The writer**: NVRx 0.6.0's and 0.7.0's IPC cache (``_cached_identifiers``), with or
  without ``cleanup_tensor_caches``; the queue a save's results come back in
  (``results_queue``).
* **The results-queue manager**: a process of the rank's that the worker's writes wait on
  (the stall watch samples it); a child of ``os.fork()`` detaches from it and from
  megatron-core's class-level worker.
* **The finalize collective**: the one-int sum to which the worker watch adds its failure
  flag.

Importing this module imports ``detect`` only (activation reads the probes from here).
"""

from __future__ import annotations

import sys

from .detect import (
    CORE,
    FS,
    MCORE_FS,
    NVRX_DIST,
    RELEASES,
    distribution_of,
    distribution_version,
    release_has_cache,
)

# -- probes: which fix applies to the module's release ------------------------------------------

_versions: dict[str, str | None] = {}  # distribution -> its version, read once


def known_release(module):
    """The facts ``detect.RELEASES`` holds of the release that ships ``module`` (NVRx's or
    megatron-core's), or None: a version outside the table, read by its names."""
    dist = distribution_of(getattr(module, "__name__", None) or "")
    if dist not in RELEASES:
        return None
    if dist not in _versions:
        _versions[dist] = distribution_version(dist)
    return RELEASES[dist].get(_versions[dist])


def _fact(module, fact, found):
    """``fact`` of the release that ships ``module`` (``detect.RELEASES``), else ``found()``:
    what the names of its classes say."""
    known = known_release(module)
    return known[fact] if known is not None and fact in known else found()


def nvrx_worker_cache(_module):
    """Megatron/Bridge targets: does the installed NVRx cache IPC handles? Needs no Megatron
    module, so ``status()`` asks it for pending targets too."""
    core = sys.modules.get(CORE)
    if core is not None:
        return worker_cache(core)
    version = distribution_version(NVRX_DIST)
    if version is None:
        return "not_applicable", "nvidia-resiliency-ext is not installed"
    if release_has_cache(version) is False:
        return "not_applicable", f"NVRx {version} has no IPC tensor cache (added in 0.6.0)"
    return "active", f"NVRx {version} may cache IPC handles in its worker"


def worker_cache(core):
    """NVRx core: does the persistent worker keep a data cache?"""
    caller = getattr(core, "PersistentAsyncCaller", None)
    if caller is None:
        if core is None or initializing(core):
            return None  # decided once the module is imported
        return "not_applicable", "this NVRx has no persistent worker"
    if _fact(core, "cache", lambda: hasattr(caller, "_worker_data_cache")):
        return "active", "NVRx caches tensors in its persistent worker"
    return "not_applicable", (
        "this NVRx has no worker cache (no PersistentAsyncCaller._worker_data_cache)"
    )


def _cache_missing(fs):
    """Where ``fs`` (NVRx filesystem_async, or None) has no writer with the IPC cache, the
    verdict (None: decided once the module is imported); else False."""
    writer = getattr(fs, "FileSystemWriterAsync", None)
    if writer is None:
        if fs is None or initializing(fs):
            return None  # decided once the module is imported
        return "not_applicable", "this NVRx has no FileSystemWriterAsync"
    if not _fact(fs, "cache", lambda: "_cached_identifiers" in vars(writer)):
        return "not_applicable", (
            "this NVRx has no IPC tensor cache (no FileSystemWriterAsync._cached_identifiers)"
        )
    return False


def writer_cache(fs):
    """NVRx filesystem_async: is the IPC cache there, and does it check data pointers?"""
    missing = _cache_missing(fs)
    if missing is not False:
        return missing
    writer = fs.FileSystemWriterAsync
    if _fact(fs, "upstream_ptrs", lambda: hasattr(writer, "_cached_tensor_data_ptrs")):
        return "fixed_upstream", "NVRx re-sends when data pointers change (NVRx PR #314)"
    if not hasattr(fs, "_compute_data_structure_key_from_plan"):
        return "unsupported", "filesystem_async has no _compute_data_structure_key_from_plan"
    return "active", "NVRx caches IPC handles without checking the storage"


def writer_keys(fs):
    """NVRx filesystem_async: does the writer plan saves that send only a cache key (the IPC
    cache's ``_cached_identifiers``), which a release must not drop before they reach the
    worker?"""
    missing = _cache_missing(fs)
    if missing is not False:
        return missing
    return "active", (
        "a save planned to send only a cache key keeps a release in another "
        "thread waiting until it is scheduled"
    )


#: What NVRx's writer does with ``results_queue``: sets it (``prepare_write_data``), hands it
#: to the worker (``get_save_function_and_args``) and takes the save's results from it.
RESULTS_QUEUE_USERS = ("prepare_write_data", "get_save_function_and_args", "retrieve_write_results")


def shared_results(fs):
    """NVRx filesystem_async: does each save's writer take its results from the queue
    ``prepare_write_data`` gives it (NVRx's one per process, ``_results_queue``)? Every
    release in the table does; another version needs the methods that use it."""
    writer = getattr(fs, "FileSystemWriterAsync", None)
    if writer is None:
        if fs is None or initializing(fs):
            return None  # decided once the module is imported
        return "not_applicable", "this NVRx has no FileSystemWriterAsync"
    missing = (
        [] if known_release(fs) else [n for n in RESULTS_QUEUE_USERS if not hasattr(writer, n)]
    )
    if missing:
        return "unsupported", (
            f"FileSystemWriterAsync has no {', '.join(missing)}, which the fix expects to "
            "use results_queue"
        )
    return "active", (
        "each save takes its results from a queue of its own (NVRx shares one per process)"
    )


def cpu_snapshots(fs):
    """A writer module (NVRx's filesystem_async, megatron-core's copy): does its
    ``prepare_write_data`` hand the worker CPU tensors as they are, the trainer's own
    storage, which the worker reads after the schedule returned? Outside the table: NVRx
    0.7.0's refactor that copies them also added ``_wrap_exception_for_gather``. Where a
    writer keeps its tensors in no place the copy knows, the copy raises (``copy_fresh``)."""
    writer = getattr(fs, "FileSystemWriterAsync", None)
    if writer is None:
        if fs is None or initializing(fs):
            return None  # decided once the module is imported
        return "not_applicable", "this version has no FileSystemWriterAsync"
    if _fact(fs, "snapshots", lambda: hasattr(fs, "_wrap_exception_for_gather")):
        return "fixed_upstream", (
            "NVRx copies every CPU tensor of a save before its schedule returns (NVRx PR #376)"
        )
    return "active", (
        "a save's CPU tensors are copied at its schedule on a persistent worker (this "
        "version sends the trainer's own, which the worker writes later)"
    )


def persistent_queue(module):
    """NVRx core or megatron-core async_utils: can a queue have a persistent worker, which
    ``cpu_snapshot`` copies a save's CPU tensors for?"""
    if module is None:
        return None
    if not hasattr(module, "PersistentAsyncCaller") or not hasattr(module, "AsyncCallsQueue"):
        return "not_applicable", "this version has no persistent checkpoint worker"
    return "active", "a save's CPU tensors are copied at its schedule on a persistent worker"


def persistent_worker(module):
    """NVRx core or megatron-core async_utils: is there a persistent worker we can watch?"""
    if module is None:
        return None
    caller = getattr(module, "PersistentAsyncCaller", None)
    if caller is None or not hasattr(module, "AsyncCallsQueue"):
        return "not_applicable", "this version has no persistent checkpoint worker"
    if _upstream_error(module):  # Megatron-LM PR #6971
        return "fixed_upstream", (
            "this version raises its own PersistentAsyncWorkerError for "
            "a dead worker (Megatron-LM PR #6971)"
        )
    if caller_shape(caller).queues is None:
        return "unsupported", "PersistentAsyncCaller keeps its worker's queues under unknown names"
    if not hasattr(module, "_ActiveAsyncRequest"):
        return (
            "unsupported",
            "no _ActiveAsyncRequest: a failed save cannot be kept for its finalize",
        )
    problem = collective_problem(module)
    if problem is not None:
        return "unsupported", problem
    return "active", (
        "a dead persistent worker is one error per rank, raised by the finalize of "
        "the failed save; stalls are logged"
    )


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
    if (
        queue is None
        or caller is None
        or not _fact(
            module,
            "warmup",
            lambda: hasattr(queue, "warmup_persistent_caller") and "_start_worker" in vars(caller),
        )
    ):
        return "not_applicable", (
            "this NVRx starts its worker only inside a save (no "
            "AsyncCallsQueue.warmup_persistent_caller)"
        )
    if caller_shape(caller).queues != NVRX_QUEUES:
        return "unsupported", "PersistentAsyncCaller keeps its worker's queues under unknown names"
    return "active", "prewarm() can start the worker ahead of its save"


def worker_loop(module):
    """NVRx core: does the worker call ``async_process_target`` by name, never as the
    process target that NVRx pickles? Outside the table: where the daemon worker's loop
    (``async_loop_for_daemon_worker``) is there to call it, as in every release since 0.5.0."""
    watched = persistent_worker(module)
    if watched is None or watched[0] != "active":
        return watched  # the worker watch is not installed, so neither is this part
    names = vars(module.PersistentAsyncCaller)
    loop = ("async_process_target", "async_loop_for_daemon_worker")
    if not _fact(module, "worker_loop", lambda: all(name in names for name in loop)):
        return "not_applicable", (
            "no PersistentAsyncCaller.async_process_target: the worker's traceback stays on stderr"
        )
    return "active", "the worker leaves the traceback of an uncaught exception for the trainer"


def caller_queues(module):
    """NVRx core: does each persistent caller make its worker's queues in ``__init__``, so
    that what its request queue cannot send is known before the queue's first put?"""
    watched = persistent_worker(module)
    if watched is None or watched[0] != "active":
        return watched  # the worker watch is not installed, so neither is this part
    shape = caller_shape(module.PersistentAsyncCaller)
    if shape.on_class or shape.queues != NVRX_QUEUES:
        return "not_applicable", (
            "the worker's queues are made with the worker, in its first "
            "save: a request they cannot send waits for ever"
        )
    return "active", (
        "a save whose request cannot be pickled raises at once; the next save is saved"
    )


def initializing(module):
    """Is ``module`` still executing (imported in another thread, say)?"""
    return bool(getattr(getattr(module, "__spec__", None), "_initializing", False))


# -- callers and queues: NVRx's (per queue) and megatron-core's (on its classes) ------------------

NVRX_QUEUES = ("queue", "preload_q", "comp_q")
MCORE_QUEUES = ("_persistent_queue", "_persistent_preload_q", "_persistent_comp_q")


class Caller:
    """How a persistent caller class keeps its worker: ``queues``, the names of its request,
    preload and completion queues (None: unknown); ``on_class``, megatron-core's way (the
    worker and queues on the class, the queue's caller on the queue class); ``abort_waits``,
    whether ``close(abort=True)`` SIGTERMs the worker and waits ``sigterm_timeout`` for it
    (NVRx 0.6.0+). NVRx's caller makes its queues in ``__init__``, on itself: a version
    outside the table that renamed them fails where they are read (``worker_queues``)."""

    __slots__ = ("queues", "on_class", "abort_waits")

    def __init__(self, cls):
        module = sys.modules.get(cls.__module__)
        if all(hasattr(cls, name) for name in MCORE_QUEUES):
            self.queues, self.on_class = MCORE_QUEUES, True
        elif distribution_of(cls.__module__) == NVRX_DIST:
            self.queues, self.on_class = NVRX_QUEUES, False
        else:
            self.queues, self.on_class = None, False
        self.abort_waits = _fact(module, "sigterm_timeout", lambda: _takes(cls, "sigterm_timeout"))


def _takes(cls, name):
    """Does ``cls(...)`` take parameter ``name``?"""
    import inspect

    try:
        return name in inspect.signature(cls.__init__).parameters
    except (TypeError, ValueError):
        return False


_shapes: dict[type, Caller] = {}  # caller class -> Caller


def caller_shape(cls):
    """The ``Caller`` of ``cls``, read once."""
    shape = _shapes.get(cls)
    if shape is None:
        shape = _shapes[cls] = Caller(cls)
    return shape


def caller_of(queue):
    """The queue's persistent caller (NVRx: per queue; megatron-core: per process)."""
    return getattr(queue, "persistent_caller", None) or getattr(queue, "_persistent_caller", None)


def worker_queues(caller):
    """``(request queue, preload queue, completion queue)`` of the caller's worker, or Nones
    (megatron-core: its class's, while its worker is this caller's)."""
    shape = caller_shape(type(caller))
    if not shape.on_class:
        return tuple(getattr(caller, name) for name in shape.queues or NVRX_QUEUES)
    cls = type(caller)
    if caller.process is None or getattr(cls, "_persistent_process", None) is not caller.process:
        return None, None, None
    return tuple(getattr(cls, name) for name in MCORE_QUEUES)


def detach_worker(caller, process):
    """``caller`` no longer has a worker (its close does nothing); megatron-core's class
    forgets the worker and its queues too."""
    cls = type(caller)
    if process is not None and getattr(cls, "_persistent_process", None) is process:
        cls._persistent_process = None
        for name in MCORE_QUEUES:
            setattr(cls, name, None)
    try:
        caller.process = None
    except (AttributeError, TypeError):  # not settable: the registry forgets it anyway
        pass


def detach_caller(queue, caller):
    """The queue starts a fresh caller (and worker) at its next save."""
    if "persistent_caller" in vars(queue) and queue.persistent_caller is caller:
        queue.persistent_caller = None
    for cls in type(queue).__mro__:  # megatron-core: one caller per process, on the class
        if vars(cls).get("_persistent_caller") is caller:
            cls._persistent_caller = None


def save_processes(queue):
    """The processes of the save just scheduled on ``queue``: its persistent worker (NVRx's or
    megatron-core's), or NVRx's process of that save where the queue is not persistent; and
    the results-queue manager of each writer module imported (NVRx's, megatron-core's)."""
    if is_persistent(queue):
        caller = caller_of(queue)
    else:
        calls = getattr(queue, "async_calls", None)
        caller = calls[-1][1] if calls else None  # _ActiveAsyncRequest(idx, caller, request)
    found = [getattr(caller, "process", None)]
    for name in (FS, MCORE_FS):
        results = getattr(sys.modules.get(name), "_results_queue", None)
        found.append(getattr(getattr(results, "_manager", None), "_process", None))
    return [process for process in found if process is not None]


def check_queue(queue):
    """``TypeError`` unless ``queue`` is None or NVRx's ``AsyncCallsQueue`` (before NVRx is
    imported: an object with its methods): the argument of ``release()`` and ``prewarm()``."""
    cls = getattr(sys.modules.get(CORE), "AsyncCallsQueue", None)
    if queue is None or (
        isinstance(queue, cls)
        if cls is not None
        else all(
            callable(getattr(queue, name, None))
            for name in ("schedule_async_request", "maybe_finalize_async_calls")
        )
    ):
        return
    raise TypeError(f"queue must be an NVRx AsyncCallsQueue or None, not {type(queue).__name__}")


def is_persistent(queue):
    """Does ``queue`` keep one worker for its saves (not NVRx's process per save)?"""
    return getattr(queue, "persistent", True)


def holds_ipc(queue):
    """Can ``queue``'s worker hold CUDA IPC mappings (not CPU shared memory)?"""
    return not getattr(queue, "cpu_shm_mode", False)


def abort_waits(caller):
    """Does ``caller``'s ``close(abort=True)`` SIGTERM the worker and wait for it?"""
    return caller_shape(type(caller)).abort_waits


def request(module, function, args, call_idx):
    """An ``AsyncRequest`` of ``module`` (NVRx's core) that runs ``function(*args)`` in the
    worker and answers ``call_idx``, with no finalize step."""
    return module.AsyncRequest(function, tuple(args), [], call_idx=call_idx)


def call_index(request):
    """NVRx's ``call_idx`` of a request (None for what is not a request: ``DONE``)."""
    return getattr(request, "call_idx", None)


def preloads(request):
    """Does NVRx wait for the worker's preload of ``request`` in its schedule?"""
    return bool(getattr(request, "preload_fn", None))


def with_functions(request, **functions):
    """``request`` with ``functions`` (``async_fn``, ``preload_fn``) in place of its own."""
    return request._replace(**functions) if hasattr(request, "_replace") else request


def entry(module, save, caller, request):
    """A queue's record of a scheduled save (``_ActiveAsyncRequest``)."""
    return module._ActiveAsyncRequest(save, caller, request)


def worker_data_cache(core):
    """NVRx's worker data cache in this process (in the trainer: the copy a synchronous save
    fills), or None on an NVRx without one."""
    return getattr(getattr(core, "PersistentAsyncCaller", None), "_worker_data_cache", None)


# -- NVRx's warm-up slot --------------------------------------------------------------------------


def warm_slot(core):
    """The caller in NVRx's warm-up slot (one per process), or None."""
    return vars(core.AsyncCallsQueue).get("_warmup_persistent_caller")


def empty_slot(core, caller=None):
    """Empty NVRx's warm-up slot (where it holds ``caller``, if given)."""
    queues = core.AsyncCallsQueue
    if caller is None or getattr(queues, "_warmup_persistent_caller", None) is caller:
        queues._warmup_persistent_caller = None


#: A queue's settings that NVRx's warm-up may take too.
WARM_UP_SETTINGS = ("is_daemon", "cpu_priority", "io_priority", "sigterm_timeout", "cpu_shm_mode")


def warm_up_into_slot(core, queue, rank):
    """NVRx's own ``warmup_persistent_caller``, with the settings of ``queue`` it takes; the
    caller it put in its slot."""
    import inspect

    params = inspect.signature(core.AsyncCallsQueue.warmup_persistent_caller).parameters
    core.AsyncCallsQueue.warmup_persistent_caller(
        rank,
        **{
            name: getattr(queue, name)
            for name in WARM_UP_SETTINGS
            if name in params and hasattr(queue, name)
        },
    )
    return warm_slot(core)


def live_queues(core):
    """NVRx's queues alive in this process (none known on 0.4.1, which keeps no list)."""
    return getattr(core.AsyncCallsQueue, "get_instances", list)()


def caller_for(queue):
    """``queue``'s caller, made by NVRx as for a save where it has none yet."""
    return queue.persistent_caller or queue._get_async_caller()


def start_worker(caller, rank):
    """Start ``caller``'s worker by NVRx's own ``_start_worker``, as a save would."""
    caller._start_worker(rank)
    caller.rank = rank


# -- the writer's cache ---------------------------------------------------------------------------

#: The writer's class-level caches: emptied (in place) when the worker that holds the data goes.
WRITER_CACHES = ("_cached_identifiers", "_cached_tensor_data_ptrs")


def cached_key_count(writer):
    """How many cache keys ``writer`` (NVRx's writer class) believes the worker holds."""
    ids = getattr(writer, "_cached_identifiers", None)
    try:
        return len(ids) if ids is not None else 0
    except TypeError:
        return 0


def forget_writer_keys(writer):
    """Empty the writer class's caches in place: NVRx's ``cleanup_tensor_caches`` where it
    has one, else each cache (git builds before 0.6.0)."""
    cleanup = getattr(writer, "cleanup_tensor_caches", None)
    if callable(cleanup):
        cleanup()
    for name in WRITER_CACHES:
        cache = getattr(writer, name, None)
        if cache:
            cache.clear()


def caches_ipc(writer):
    """Does this writer cache what it sends over CUDA IPC (not CPU shared memory)?"""
    return bool(writer.use_cached_data_structure) and not getattr(
        writer, "use_cpu_shm_for_gpu_tensors", False
    )


def byte_io(fs):
    """NVRx's write-item type of what it never caches."""
    return fs.WriteItemType.BYTE_IO


def cache_key(writer):
    """The key this call of ``prepare_write_data`` cached under, or None."""
    identifier = getattr(writer, "consistent_data_identifier", None)
    return None if identifier is None else identifier.key


def sent(writer):
    """``(items, tensors)`` this call sends for the worker to cache, or None (it sends only
    the key: the worker reuses its entry)."""
    return getattr(writer, "cached_tensor_data", None)


def reused(writer):
    """Did this call send only the key (the worker reuses its cache)?"""
    return cache_key(writer) is not None and sent(writer) is None


def send(writer, items, tensors):
    """Make this call send ``tensors`` (of ``items``) under its key, as NVRx's first send of
    a key does; the worker replaces its entry."""
    writer.cached_tensor_data = (list(items), list(tensors))


def sent_uncached(writer):
    """The items this call sends fresh, outside the cache (CPU tensors, dequantized ones)."""
    return (getattr(writer, "uncached_tensor_data", None) or ((), ()))[0]


def copy_fresh(writer, copy):
    """Put ``copy(item, tensor)`` in place of each tensor this call of ``prepare_write_data``
    sends the worker afresh, outside its cache: NVRx 0.6.0's ``uncached_tensor_data`` (its CPU
    tensors go there), else the write buckets (NVRx 0.3.0-0.5.0, megatron-core's writer)."""
    if hasattr(writer, "uncached_tensor_data"):
        if writer.uncached_tensor_data:
            items, tensors = writer.uncached_tensor_data
            tensors[:] = [copy(item, tensor) for item, tensor in zip(items, tensors)]
        return
    if not hasattr(writer, "write_buckets"):
        raise RuntimeError(
            "FileSystemWriterAsync.prepare_write_data kept its tensors neither in "
            "uncached_tensor_data nor in write_buckets: this save's CPU tensors are not copied"
        )
    for _path, _name, (_bytes, tensors) in writer.write_buckets or ():
        tensors[:] = [(item, copy(item, tensor)) for item, tensor in tensors]


# -- the writer's results queue -------------------------------------------------------------------


def own_results_queue(writer, made=None):
    """Give ``writer`` (``prepare_write_data`` just ran) a results queue of its own, made by
    the manager of the queue NVRx gave it (none where NVRx gave it none: nothing to write):
    ``made(manager)``, a queue made ahead, else a new one. Where that manager's process has
    died, a new manager is started first, from the same ``multiprocessing`` context, and
    becomes NVRx's (its ``_results_queue``). Returns ``(the queue given, the process that
    died or None)``, or None; raises where it cannot."""
    shared = writer.results_queue
    if shared is None:
        return None
    manager, died = _manager_of(shared), None
    process = getattr(manager, "_process", None)
    if process is not None and process.exitcode is not None:  # gone: a new one, as NVRx's
        died, shared = process, manager._ctx.Manager().Queue()
        fs = sys.modules.get(FS)
        if getattr(fs, "_results_queue", None) is writer.results_queue:
            fs._results_queue = shared
        manager = _manager_of(shared)
    writer.results_queue = (made(manager) if made is not None else None) or manager.Queue()
    return writer.results_queue, died


def _manager_of(queue):
    manager = getattr(queue, "_manager", None)
    if manager is None:
        raise RuntimeError(
            f"NVRx's results queue ({type(queue).__name__}) has no manager "
            f"in this process to make another"
        )
    return manager


def let_go(queue):
    """Tell the manager of ``queue`` (a proxy of this process's) that this process no longer
    holds it, now rather than when the proxy is collected (a call to the manager process);
    the proxy must not be used after. Raises nothing where the manager is gone."""
    close = getattr(queue, "_close", None)  # multiprocessing's finalizer of the proxy
    if callable(close):
        close()


def renew_proxy_lock():
    """In a child of ``os.fork()``: a fresh lock for ``multiprocessing``'s proxies, which a
    thread the child does not have may have held at the fork (``multiprocessing`` renews it
    only in the children it starts itself)."""
    proxy = getattr(sys.modules.get("multiprocessing.managers"), "BaseProxy", None)
    renew = getattr(getattr(proxy, "_mutex", None), "_at_fork_reinit", None)
    if callable(renew):
        renew()


def results_queue_of(writer):
    """The queue ``writer``'s save puts its results in (None: it has nothing to write)."""
    return getattr(writer, "results_queue", None)


def failed_retrieval(fs, exc):
    """``exc`` as NVRx's ``retrieve_write_results`` reports a failure: returned wrapped for
    the finalize's gather where it wraps its own (0.5.0+: every rank then raises), else
    raised (0.4.1). Outside the table: the first of NVRx's wrappers that ``fs`` has."""
    known = known_release(fs)
    names = (
        [known["wrap_exception"]] if known else ["_wrap_exception_for_gather", "_wrap_exception"]
    )
    wrap = next(
        (getattr(fs, name) for name in names if name and callable(getattr(fs, name, None))), None
    )
    if wrap is None:
        raise exc
    try:
        raise exc  # a traceback for the wrapped form
    except type(exc) as raised:
        return wrap(raised)


# -- the results-queue manager; a child of os.fork(): what it detaches from -----------------


def detach_class_worker(module):
    """Remove megatron-core's worker of this process from its classes. Returns ``(its
    process, what the classes held, the queue class's caller)``, or Nones."""
    caller_class = getattr(module, "PersistentAsyncCaller", None)
    queue_class = getattr(module, "AsyncCallsQueue", None)
    if caller_class is None or queue_class is None:
        return None, [], None
    process, held = vars(caller_class).get("_persistent_process"), []
    for name in ("_persistent_process", *MCORE_QUEUES):
        if vars(caller_class).get(name) is not None:
            held.append(getattr(caller_class, name))
            setattr(caller_class, name, None)
    caller = vars(queue_class).get("_persistent_caller")
    if caller is not None:
        queue_class._persistent_caller = None
    return process, held, caller


def results_manager_process(fs):
    """The process of the writer module ``fs``'s results-queue manager (NVRx's, or megatron-
    core's copy), started by the first save that writes; None before, or without ``fs``."""
    results = getattr(fs, "_results_queue", None)
    return getattr(getattr(results, "_manager", None), "_process", None)


def results_manager(fs):
    """NVRx's results-queue manager process, detached from the writer's module (the child
    makes its own); ``(what to keep alive, the process)``, or ``(None, None)``."""
    results = getattr(fs, "_results_queue", None)
    if results is None:
        return None, None
    process = results_manager_process(fs)
    fs._results_queue = None
    return results, process


# -- the finalize collective ------------------------------------------------------------------

#: NVRx's finalize all-reduce, ``AsyncCaller.sync_all_async_calls`` (NVRx 0.4.1-0.7.0,
#: megatron-core 0.12-0.19 alike): one int per rank, summed. The worker watch adds its failure
#: flag to that int (``fixes/worker_watch.py``); only this shape carries it.
COLLECTIVE = """
def sync_all_async_calls(self, is_alive):
    ten = torch.tensor([is_alive], dtype=torch.int, device=torch.cuda.current_device())
    torch.distributed.all_reduce(ten)
    return ten[0] == 0
"""
#: What the watch relies on in ``PersistentAsyncCaller.is_current_async_call_done``: it
#: takes a completion into ``cur_item`` (``get_nowait``) only while that is empty, and all-
#: reduces through ``self.sync_all_async_calls``.
CHECK_NAMES = ("cur_item", "get_nowait", "sync_all_async_calls")


def collective_problem(module):
    """Why the finalize collective of ``module`` (NVRx's core, megatron-core's async_utils)
    cannot carry the watch's failure flag, or None."""
    import inspect

    caller = module.PersistentAsyncCaller
    check, sync = (
        getattr(caller, name, None)
        for name in ("is_current_async_call_done", "sync_all_async_calls")
    )
    if check is None or sync is None:
        return None  # the target of that name is "not found" (lifecycle)
    check = inspect.unwrap(check)
    names = getattr(getattr(check, "__code__", None), "co_names", ())
    missing = [name for name in CHECK_NAMES if name not in names]
    if missing:
        return (
            f"PersistentAsyncCaller.is_current_async_call_done does not use "
            f"{', '.join(missing)} as the watch expects"
        )
    found = _body(inspect.unwrap(sync))
    if found is None or found != _body(COLLECTIVE):
        return (
            "its finalize collective, AsyncCaller.sync_all_async_calls, is not the one-int "
            "sum over ranks that carries the failure flag (its code changed)"
        )
    return None


def _body(function):
    """The statements of ``function`` (or of the source text of one), docstring left out,
    with its parameter names, as comparable text; None if its source cannot be read."""
    import ast
    import inspect
    import textwrap

    try:
        source = function if isinstance(function, str) else inspect.getsource(function)
    except (OSError, TypeError):
        return None
    node = ast.parse(textwrap.dedent(source)).body[0]
    if not isinstance(node, ast.FunctionDef):
        return None
    body = node.body
    if (
        body
        and isinstance(body[0], ast.Expr)
        and isinstance(getattr(body[0], "value", None), ast.Constant)
    ):
        body = body[1:]
    return [arg.arg for arg in node.args.args], [ast.dump(statement) for statement in body]


def summed(call):
    """Run NVRx's ``sync_all_async_calls`` (``call()``, the shape ``COLLECTIVE``); return its
    result and the all-reduced sum, read from the tensor it made (``collective_problem``
    vouches that there is one, reduced in place)."""
    import torch
    from torch.overrides import TorchFunctionMode

    made = []

    class Tensors(TorchFunctionMode):  # this thread's calls into torch, within call() only
        def __torch_function__(self, func, types, args=(), kwargs=None):
            result = func(*args, **(kwargs or {}))
            if func is torch.tensor:
                made.append(result)
            return result

    with Tensors():
        result = call()
    return result, int(made[0][0])


def hold_reads(queue):
    """Hold ``queue``'s read lock (a multiprocessing queue's), so that a ``get_nowait`` in
    this thread finds it empty. Returns the function that releases the lock (a no-op where
    another reader holds it: that ``get_nowait`` finds the queue empty too)."""
    lock = queue._rlock
    if lock.acquire(False):
        return lock.release
    return lambda: None
