"""Starting the NVRx persistent checkpoint worker ahead of the save that needs it: what
``prewarm()``, the ``prewarm`` fix and ``release()``'s ``restart`` share.

NVRx starts its worker inside the first save, which then blocks while the worker spawns,
imports torch and NVRx and creates its CUDA context (11-16 s measured on an H200).
``prewarm`` starts it now: NVRx's ``_start_worker`` on the queue's caller, which NVRx makes as
for a save. At the queue's creation (``NVRX_IPC_FIX_PREWARM=start``) the worker goes to NVRx's
warm-up slot instead, as ``AsyncCallsQueue.warmup_persistent_caller`` does (one per process,
taken by the first queue that saves), so that a framework that warms up next (Megatron does)
finds it there and starts none; a worker waiting in that slot is never doubled either. Both
run NVRx's restart callbacks, and the trainer's caches are emptied as well, so the fresh
worker's first save sends full tensors. The spawn returns within milliseconds; the rest
happens in the worker. Where the standby serves (``worker.standby``: after a ``restart``
release), the worker is forked from it instead, with torch and NVRx already imported.

*Ready* means the worker answered a request (``call_idx`` = the watch's ``SENTINEL``) that
imports what a save's request needs there (``_worker.warm_up``: NVRx's writer module, 0.8 s
on a 2-core VM). A thread reads that one answer from the worker's completion queue, logs the
start-up time and reports a worker that dies first. ``schedule_wrapper`` waits for that thread
before a save goes to the worker (as long as the save would have waited for a worker it
started itself), so the answer never reaches a finalize and no save goes to a dead worker. A
prewarmed worker that died or failed before its first save is reported once (WARNING,
``status().prewarm_failures``), stopped and detached from its queue (``_let_go``), and NVRx
starts a fresh one for the save, as without prewarm. From its first save on it is an ordinary
worker (the worker watch turns its death into ``CheckpointWorkerError``). ``release()`` with
``terminate`` or ``restart`` stops a worker that waits for its first save, and so do
``deactivate()`` and the interpreter's exit: it holds nothing.

*Pinned ahead* (``NVRX_IPC_FIX_PIN``, on by default): a fresh worker's first save otherwise
pays for pinning host memory for its device-to-host copies, which a kept worker finds in
torch's caching host allocator (1.0 s of 1.05 s at 2 GiB on an H200). So the start-up
request also pins blocks of the byte sizes of the CUDA tensors the queue's last save sent
(read from its request in ``schedule_wrapper``; none is known before a queue's first save)
and frees them into that cache, before the worker reports ready. A failure to pin is one
WARNING; the save then pins as usual.
"""

from __future__ import annotations

import sys
import threading
import time
import weakref
from contextlib import contextmanager
from dataclasses import dataclass
from queue import Empty

from ..core import cleanup as _cleanup, config as _config, fork as _fork, shapes as _shapes
from ..core import state as _state
from ..core.detect import CORE
from ..core.log import guard, logger
from . import guardian as _guardian, monitor as _monitor, registry as _workers
from . import standby as _standby
from .inside import WORKER_IMPORTS, directory, take_file, warm_up
from .suspend import resume

TYPE_CHECKING = False  # typing.TYPE_CHECKING, without importing typing
if TYPE_CHECKING:
    from typing import Any


@dataclass(frozen=True)
class PrewarmReport:
    """What one ``prewarm()`` did."""

    started: tuple = ()  # pids of the workers started
    skipped: tuple = ()  # ("what: why", ...)
    seconds: float = 0.0
    forked: tuple = ()  # of ``started``, those forked from the standby (``worker.standby``)

    def summary(self) -> str:
        """The one log line."""
        if not self.started:
            return f"prewarm started no checkpoint worker: {'; '.join(self.skipped)}"
        pids = ", ".join(map(str, self.started))
        how = (
            "forked from the standby, it creates"
            if set(self.started) <= set(self.forked)
            else "it imports torch and creates"
        )
        return (
            f"started the NVRx checkpoint worker ahead of its next save (pid {pids}, "
            f"{self.seconds:.2f} s); {how} its CUDA context in the background"
        )


class _Start:
    """A worker started here that no save has used yet."""

    __slots__ = (
        "process",
        "began",
        "began_at",
        "ready_s",
        "error",
        "cancelled",
        "thread",
        "pinning",
        "pinned_bytes",
        "pin_error",
        "standby",
        "first_request_s",
        "pin_s",
    )

    def __init__(self, process, pinning=0, standby=None):
        self.process = _monitor.started_process(process)  # its status: one reader at a time
        self.standby = standby  # the pid of the standby it was forked from, or None
        self.pinning = pinning  # bytes it was asked to pin ahead
        self.pinned_bytes = 0  # what it pinned, once ready
        self.pin_error = None
        self.began = time.monotonic()
        self.began_at = time.time()  # the worker reports wall-clock times
        self.first_request_s = None  # from the start to the start-up request's beginning
        self.pin_s = None  # how long the pinning ahead took
        self.ready_s = None  # seconds from the spawn to its answer
        self.error = None  # why it cannot take a save
        self.cancelled = False
        self.thread = None


#: check-and-start, hand-over; never taken by the waiting thread
_lock = _fork.renewed(threading.RLock())
_reported = _fork.renewed(threading.Lock())  # a failure is counted and logged once
#: PersistentAsyncCaller -> _Start, until a save takes it
_starts: weakref.WeakKeyDictionary[Any, _Start] = weakref.WeakKeyDictionary()
_scheduling: weakref.WeakSet[Any] = weakref.WeakSet()  # queues inside schedule_async_request
#: queue -> byte sizes of the CUDA tensors it last sent
_sizes: weakref.WeakKeyDictionary[Any, tuple[int, ...]] = weakref.WeakKeyDictionary()


def _forget_the_parent():
    """In a child of ``os.fork()``: none of the parent's workers (the child never started
    them; ``worker.inherited`` detaches NVRx's objects from them)."""
    global _starts, _scheduling
    _starts, _scheduling = weakref.WeakKeyDictionary(), weakref.WeakSet()


_fork.in_child(_forget_the_parent)


def prewarm(queue: Any = None) -> PrewarmReport:
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
    _shapes.check_queue(queue)
    resume(queue, wait=False)
    return start(queue, began)


def start(queue=None, began=None):
    """``prewarm()``'s work, ``queue`` checked: start the worker of ``queue`` (``None``: of each
    live queue) ahead of its next save; the report says what was started and skipped."""
    began = time.perf_counter() if began is None else began
    core = sys.modules.get(CORE)
    why = unavailable(core)
    if why is not None:
        return PrewarmReport((), (f"all: {why}",), time.perf_counter() - began)
    queues = [queue] if queue is not None else _shapes.live_queues(core)
    return start_for(queues, core, began)


@contextmanager
def scheduling(queue):
    """While a save is scheduled on ``queue`` (which starts its worker): prewarm skips it."""
    with _lock:
        _scheduling.add(queue)
    try:
        yield
    finally:
        with _lock:
            _scheduling.discard(queue)


def start_for(queues, core, began, slot=False):
    """Prewarm ``queues``; ``slot``: into NVRx's warm-up slot (at the queue's creation)."""
    rank = _monitor.dist_rank()
    started, skipped = [], [] if queues else ["queues: no live AsyncCallsQueue"]
    forked = []
    for q in queues:
        with _lock:
            why = _blocked(q, core, rank)
            start = _start(q, core, rank, slot) if why is None else None
        if start is None:
            skipped.append(f"queue {id(q):#x}: {why}")
        else:
            started.append(start.process.pid)
            if start.standby is not None:
                forked.append(start.process.pid)
    report = PrewarmReport(
        tuple(started), tuple(skipped), time.perf_counter() - began, tuple(forked)
    )
    if started:
        logger.info("rank %s: %s", _monitor.rank(), report.summary())
    return report


def record_sizes(queue, request):
    """Keep the byte sizes of the CUDA tensors ``request`` hands the worker (what its
    preload copies into pinned host memory); a request that sends only a cache key has none
    and leaves the last record."""
    torch = sys.modules.get("torch")
    if torch is None:
        return
    sizes, todo, seen = [], [(getattr(request, "preload_fn", None), 0)], set()
    while todo:
        item, depth = todo.pop()
        if isinstance(item, torch.Tensor):
            if item.device.type == "cuda":
                sizes.append(item.numel() * item.element_size())
            continue
        if depth > 8 or id(item) in seen:
            continue
        seen.add(id(item))
        if isinstance(item, (tuple, list)):
            todo.extend((child, depth + 1) for child in item)
        elif isinstance(item, dict):
            todo.extend((child, depth + 1) for child in item.values())
        elif callable(getattr(item, "func", None)):  # functools.partial
            todo.extend((child, depth + 1) for child in (*item.args, *item.keywords.values()))
    if sizes:
        _sizes[queue] = tuple(sizes)


def planned_pin_bytes(queue) -> int:
    """Bytes of host memory the next worker prewarmed for ``queue`` will pin ahead."""
    return sum(_sizes.get(queue, ())) if _config.pin_ahead() else 0


def idle(queue) -> bool:
    """Does a started worker wait for ``queue``'s first save (prewarmed here, or NVRx's
    warm-up)? Such a worker has received nothing."""
    core = sys.modules.get(CORE)
    caller = _serving(queue, core) if core is not None else None
    if caller is None:
        return False
    return caller in _starts or (
        caller is not _shapes.caller_of(queue) and _workers.alive(caller.process)
    )


def stop(queue) -> bool:
    """For ``release()`` (terminate, restart): stop the worker that waits for ``queue``'s first
    save (SIGTERM; a worker still starting is not waited for). True if one was stopped."""
    if not idle(queue):
        return False
    with _lock:
        caller = _serving(queue, sys.modules[CORE])
        start = _starts.pop(caller, None)
    _let_go(queue, caller, start)
    return True


# -- starting ---------------------------------------------------------------------------------


def unavailable(core):
    """Why nothing can be prewarmed in this process, or None."""
    if core is None or not hasattr(core, "AsyncCallsQueue"):
        return "NVRx is not imported"
    state, reason = _shapes.warm_up(core)  # the target table's check of this NVRx
    if state != "active":
        return reason
    if not _state.installed("prewarm", "AsyncCallsQueue.schedule_async_request"):
        return "the prewarm fix is not active (see nvrx_ipc_fix.status())"
    return None


def _serving(queue, core):
    """The caller that will take ``queue``'s next save: its own, else NVRx's warm-up slot."""
    caller = _shapes.caller_of(queue)
    if caller is None and _shapes.is_persistent(queue):
        caller = _shapes.warm_slot(core)
    return caller


def _blocked(queue, core, rank):
    """Why ``queue`` gets no worker now, or None. A dead unused worker found on the way is
    detached from the queue (``_let_go``)."""
    if not _shapes.is_persistent(queue):
        return "not persistent (NVRx starts a process for each save)"
    if queue in _scheduling:
        return "a save is being scheduled on it (that starts the worker)"
    if rank is None:
        return (
            "torch.distributed is not initialized: the worker's rank, hence its device, is "
            "not known yet"
        )
    caller = _serving(queue, core)
    process = getattr(caller, "process", None)
    start = _starts.get(caller) if caller is not None else None
    own = caller is _shapes.caller_of(queue)
    if start is not None:
        if start.error is None and _workers.alive(process):
            state = "ready" if start.ready_s is not None else "starting"
            where = "its prewarmed worker" if own else "the prewarmed worker in NVRx's warm-up slot"
            return f"{where} (pid {process.pid}) is {state}"
        _unusable(caller, start)
    elif _workers.alive(process):
        if own:
            return f"its worker (pid {process.pid}) is running"
        return (
            f"NVRx's warm-up worker (pid {process.pid}) waits in its slot for the first queue "
            "that saves"
        )
    elif process is not None and own:
        return (
            f"its worker (pid {process.pid}) died: the next save reports it "
            "(CheckpointWorkerError) and starts a fresh one"
        )
    elif process is not None:
        logger.warning(
            "rank %s: NVRx's warm-up checkpoint worker (pid %s) had died unused "
            "(%s); prewarm starts a fresh one",
            _monitor.rank(),
            process.pid,
            _workers.describe_exit(_monitor.exitcode(process, settle=0.5)),
        )
    if process is not None:
        _let_go(queue, caller, start)
    return None


def _start(queue, core, rank, slot):
    """Start ``queue``'s worker and the thread that waits for its answer; its ``_Start``. The
    worker goes to the queue's caller (NVRx makes one as for a save), or with ``slot`` and
    no caller yet to NVRx's warm-up slot, by NVRx's own ``warmup_persistent_caller``."""
    caller = _shapes.caller_of(queue)
    slot = slot and caller is None
    started = False
    try:
        with _standby.starting(core) as standby:  # forked from the standby, if it serves
            if slot:  # interrupted, NVRx's own caller is collected, and closes its worker
                caller = _shapes.warm_up_into_slot(core, queue, rank)
            else:
                caller = _shapes.caller_for(queue)
                _shapes.start_worker(caller, rank)
        _guardian.guard(caller.process)
        _cleanup.forget_keys()  # NVRx's restart callbacks do it too, where it has them
        sizes = _sizes.get(queue, ()) if _config.pin_ahead() and not slot else ()
        _shapes.worker_queues(caller)[0].put(
            _shapes.request(
                core,
                warm_up,
                (list(WORKER_IMPORTS), sizes, standby, directory()),
                _workers.SENTINEL,
            )
        )
        start = _starts[caller] = _Start(caller.process, sum(sizes), standby)
        start.thread = threading.Thread(
            target=_await_ready, args=(caller, start), name="nvrx_ipc_fix-prewarm", daemon=True
        )
        start.thread.start()
        started = True
    finally:  # failed or interrupted: leave no worker behind
        if not started and caller is not None and caller.process is not None:
            _let_go(queue, caller, _starts.pop(caller, None))
    _cleanup.add(prewarms=1)
    _fork.at_exit(stop_unused)
    return start


def _await_ready(caller, start):
    """The thread: read the worker's answer, or see it die first."""
    process, completions = start.process, _shapes.worker_queues(caller)[2]
    try:
        with _monitor.watching(
            f"the start of the prewarmed checkpoint worker (pid {process.pid})", lambda: process
        ):
            while not start.cancelled:
                try:
                    item = completions.get(timeout=0.2)
                except Empty:
                    if process.exitcode is not None:
                        code = _monitor.exitcode(process, settle=0.5)
                        _failed(start, f"died before it was ready ({_workers.describe_exit(code)})")
                        return
                    continue
                if item != _workers.SENTINEL:
                    _failed(start, f"answered {item!r} instead of the start-up request")
                    return
                if start.pinning:
                    _pinned(start)
                start.ready_s = time.monotonic() - start.began
                logger.info(
                    "rank %s: the prewarmed NVRx checkpoint worker (pid %s%s) is "
                    "ready after %.2f s (%.2f GiB of host memory pinned ahead)",
                    _monitor.rank(),
                    process.pid,
                    "" if start.standby is None else ", forked from the standby",
                    start.ready_s,
                    start.pinned_bytes / _cleanup.GIB,
                )
                return
    except (OSError, ValueError, EOFError) as exc:  # its queues were closed under it
        if not start.cancelled:
            _failed(start, f"could not be watched ({type(exc).__name__}: {exc})")


def _pinned(start):
    """Read what the worker pinned ahead; a failure is one WARNING (the save pins as usual)."""
    import json

    try:
        report = json.loads(take_file(start.process.pid, "pinned") or "")
    except ValueError as exc:
        report = {"pinned_bytes": 0, "error": f"no report ({type(exc).__name__}: {exc})"}
    start.pinned_bytes = int(report.get("pinned_bytes") or 0)
    start.pin_error = report.get("error")
    if isinstance(report.get("entered"), (int, float)):
        start.first_request_s = report["entered"] - start.began_at
    start.pin_s = report.get("pin_s")
    _cleanup.put(pinned_bytes=start.pinned_bytes)
    if start.pin_error:
        logger.warning(
            "rank %s: the prewarmed NVRx checkpoint worker (pid %s) pinned %.2f of "
            "%.2f GiB of host memory ahead of its first save (%s); that save pins the "
            "rest as usual (%s=off turns this off)",
            _monitor.rank(),
            start.process.pid,
            start.pinned_bytes / _cleanup.GIB,
            start.pinning / _cleanup.GIB,
            start.pin_error,
            _config.PIN,
        )


def _failed(start, why):
    """Report a prewarmed worker that cannot take a save, once."""
    with _reported:
        if start.error is not None or start.cancelled:
            return
        start.error = why
        _cleanup.add(prewarm_failures=1)
    logger.warning(
        "rank %s: the prewarmed NVRx checkpoint worker (pid %s) %s; the next save "
        "starts a fresh worker, as without prewarm",
        _monitor.rank(),
        start.process.pid,
        why,
    )


# -- handing over, stopping and detaching -----------------------------------------------------


def take_over(queue):
    """Before a save: wait for the worker prewarmed for ``queue``; stop and detach it if it
    failed."""
    caller = _serving(queue, sys.modules[CORE])
    start = _starts.get(caller) if caller is not None else None
    if start is None:
        return
    start.thread.join()  # the save waits as long as it would for a worker it started
    with _lock:
        if _starts.get(caller) is not start:
            return  # stopped meanwhile
        del _starts[caller]
        if start.error is None and _workers.alive(start.process):
            return  # ready: this save takes it
        _unusable(caller, start)
    _let_go(queue, caller, start)


def _unusable(caller, start):
    """``start``'s worker cannot take a save: make sure that was reported."""
    if start.error is None:
        code = _monitor.exitcode(start.process, settle=0.5)
        _failed(
            start,
            f"died after it was ready, before its first save ({_workers.describe_exit(code)})",
        )


def _let_go(queue, caller, start):
    """Stop ``caller``'s unused worker (it holds nothing) and detach it: the next save (or
    ``prewarm``) starts afresh."""
    if start is not None:
        start.cancelled = True
    process = caller.process
    if _workers.alive(process):
        process.terminate()
        process.join(5.0)
        if process.exitcode is None:
            process.kill()
            process.join()
    thread = start.thread if start is not None else None
    if thread is not None and thread.ident and thread is not threading.current_thread():
        thread.join()  # it sees the cancel within 0.2 s
    _workers.abandon(caller)  # closes its queues, reaps it, empties the trainer's caches
    take_file(getattr(process, "pid", None), "pinned")  # if it pinned before it went
    core = sys.modules[CORE]
    for owner in [queue] if queue is not None else _shapes.live_queues(core):
        _shapes.detach_caller(owner, caller)  # its next save starts afresh
    _shapes.empty_slot(core, caller)


def stop_unused():
    """Stop the prewarmed workers no save has used: at exit (one still starting would hold up
    the exit, and NVRx joins a non-daemon worker for ever) and at ``deactivate()`` (without
    ``schedule_wrapper`` a save could reach one before it is ready)."""
    with _lock:
        unused = list(_starts.items())
        _starts.clear()
    for caller, start in unused:
        with guard(__name__):  # at exit or deactivate(): one failure does not stop the rest
            _let_go(None, caller, start)


_state.on_deactivate(stop_unused)
