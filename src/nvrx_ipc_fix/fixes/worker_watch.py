"""Fixes ``worker_watch`` (NVRx) and ``mcore_worker_watch`` (megatron-core's copy): a dead
persistent checkpoint worker becomes one ``CheckpointWorkerError`` on every rank, raised by
the finalize that covers the failed save, instead of a wait for ever; a stuck one is
reported (``_monitor``).

NVRx's trainer waits on its worker in three places, none of them bounded: the preload
handshake of a save (``preload_q.join()``), a blocking finalize (polling ``comp_q`` for
ever) and ``close()`` (``queue.join()``). Wrapped here, on the classes (nothing NVRx pickles
into the worker is touched):

* ``AsyncCallsQueue.schedule_async_request``: the handshake is watched. A save whose worker
  is dead (before the save or during the handshake) is still scheduled, as NVRx counts it,
  but marked failed; the call returns, and the save's finalize raises. The request's
  functions run inside ``_worker.reporting``, which leaves the worker's traceback.
* ``PersistentAsyncCaller.is_current_async_call_done``: NVRx's own check, called once, but
  the local wait before it ends when the worker dies, and a completion is accepted only for
  the save being finalized (never an older one, nor ``release()``'s).
* ``AsyncCaller.sync_all_async_calls``, the all-reduce that check makes: a failed rank adds
  its failure flag to the value, so every rank learns of it in the collective NVRx makes
  anyway, and raises; no other collective is made. Its shape is probed first
  (``core.shapes``): where it is not the one-int sum, the watch is not installed. There,
  where the host reads the sum, a rank also learns whether every rank runs the package
  (``worker.peers``: warned, never raised; while a rank may lack it, the flag stays out).
* ``AsyncCallsQueue.maybe_finalize_async_calls``: a failed save is dropped (never
  finalized); the finalize goes on with the saves behind it as NVRx would (a blocking one
  waits for them all), then raises one error naming every save that was not saved.
* ``PersistentAsyncCaller.close``: a dead worker is detached (its queues closed) without
  waiting; a worker that dies during the close ends the wait.
* ``AsyncCallsQueue.close``: when the finalize it starts with ends in a failed checkpoint
  and leaves nothing pending, the failure is held while NVRx's close goes on (called once),
  then raised; the same for Megatron's and Bridge's ``maybe_finalize_async_save(terminate=
  True)`` (``_Held``).
* ``PersistentAsyncCaller.__init__`` (NVRx, whose caller makes its worker's queues there): a
  request the queue cannot pickle, which NVRx's queue only prints and drops, is kept for its
  save (``worker.unsent``, which answers the preload handshake NVRx waits for): the schedule
  raises that error at once and keeps the save as failed for its finalize (a request without
  a ``preload_fn``: its finalize raises).
* ``PersistentAsyncCaller.async_process_target`` (NVRx 0.5.0+, in the worker only, where it
  is called by name and never pickled): writes the traceback of an uncaught exception to a
  file the trainer reads for its error.

An abort (``close(abort=True)``, from any thread: it takes no lock of the package's,
``core.dispatch``) is NVRx's own, and the worker it ends is a dead worker to the save that
waits on it (``_abort``): once NVRx's abort is done, the save's handshake is answered and
its finalize's wait ends, with one ``CheckpointWorkerError`` that names the abort; a schedule
raises it at once and takes back NVRx's record of the save.

When a worker is found dead, it is detached (``worker.registry.abandon``: the completions it sent
are read, its queues closed, the trainer-side caches cleared, so the next save sends full
tensors) and the queue forgets the caller (the next save spawns a fresh worker;
megatron-core's class-level worker state is reset). Nothing here waits or talks to other
ranks while the interpreter shuts down.
"""

from __future__ import annotations

import sys
import threading
import time
from functools import partial
from queue import Empty

from ..core import cleanup as _cleanup, dispatch as _dispatch, shapes as _shapes
from ..core.arguments import flags, replaced, values
from ..core.errors import CheckpointWorkerError, STOP, add_note, annotate
from ..core.log import guard, logger
from ..worker import guardian as _guardian, inside as _worker, monitor as _monitor
from ..worker import peers as _peers, registry as _workers, unsent as _unsent

#: The likely cause of a long wait in the finalize all-reduce, in the stall ERROR.
FINALIZE_HINT = (
    "another rank has not reached it. A rank may have failed, or ranks finalize "
    "checkpoints in different orders (maybe_finalize_async_save must run on "
    "every rank)."
)
RELEASE_HINT = (
    "another rank has not reached it. This all-reduce runs inside "
    "nvrx_ipc_fix.release(), which finalizes pending saves: call release() on "
    "every rank, in the same order."
)


def schedule_wrapper(wrapped, queue, args, kwargs, _finalizing=sys.is_finalizing):
    """Around ``AsyncCallsQueue.schedule_async_request``: watch the preload handshake; a
    save that cannot reach a live worker is scheduled as failed, for its finalize. The
    package's own defect falls back to NVRx's call, all or nothing: before NVRx's call,
    nothing of the queue's count has changed; after it, NVRx's count stands. Then, however
    the call ended, the processes of the save are guarded (``worker.guardian``)."""
    if _finalizing():
        return wrapped(*args, **kwargs)
    try:
        if not _shapes.is_persistent(queue):  # NVRx's process per save: nothing to watch
            return wrapped(*args, **kwargs)
        return _schedule(wrapped, queue, args, kwargs)
    finally:
        _guardian.adopt(queue)


def _schedule(wrapped, queue, args, kwargs):
    target = _target(wrapped)
    with guard(target) as it:
        caller = _shapes.caller_of(queue)
        if _workers.abandoned(caller):  # NVRx 0.4.1 keeps a closed caller
            _workers.forget_caller(queue, caller)  # as 0.5.0+ does: the save makes a fresh one
            caller = _shapes.caller_of(queue)
        save, before = queue.call_idx + 1, len(queue.async_calls)
        request = args[0] if args else kwargs["async_request"]
        process = _workers.process_of(caller)
        entry = partial(_shapes.entry, sys.modules[wrapped.__module__])  # probed: it exists
        sent = _reporting(request)  # NVRx gets every argument it was given, this one replaced
        sent_args, sent_kwargs = (
            ((sent, *args[1:]), kwargs) if args else ((), {**kwargs, "async_request": sent})
        )
        dead = _workers.dead(process)
    if it.failed:
        return wrapped(*args, **kwargs)
    if dead:  # died while idle: sending would only pile up
        with guard(target):  # the count changes last: NVRx sends, watched below
            return _died_before(
                queue, entry(save, caller, request), process, "before the save, while idle"
            )

    def unblock():  # the worker died: answer the handshake NVRx waits for, on its behalf
        caller = _shapes.caller_of(queue)
        if _workers.aborted_by(caller) is None:  # an abort answers it once it is done
            _workers.release_join(_workers.queues_of(caller)[1])

    with _monitor.watching(
        f"the preload handshake of save #{save}",
        lambda: _workers.process_of(_shapes.caller_of(queue)),
        unblock,
    ) as wait:
        try:
            result = wrapped(*sent_args, **sent_kwargs)
        except BaseException as exc:  # noqa: BLE001 an interrupt, say: the others must learn
            caller = _shapes.caller_of(queue)
            if (
                queue.call_idx == save
                and not _appended(queue, save)
                and caller is not None
                and _workers.aborted_by(caller) is None
            ):
                error = CheckpointWorkerError(
                    f"rank {_monitor.rank()}: save #{save} failed while it was being "
                    f"scheduled ({type(exc).__name__}: {exc}). The save was not finalized.",
                    rank=_monitor.rank(),
                    save=save,
                )
                _scheduled_failed(queue, entry(save, caller, request), error)
            raise
    calls = queue.async_calls
    sent_to = calls[-1][1] if len(calls) > before else caller
    by = _workers.aborted_by(sent_to)
    if by is not None:  # aborted during the handshake: the save was not handed over
        if len(calls) > before:
            calls.pop()
        raise _aborted(save, by, "while it was being scheduled")
    unsent = None
    with guard(target):  # the finalize still meets a dead worker (done_wrapper)
        caller = queue.async_calls[-1][1] if _appended(queue, save) else _shapes.caller_of(queue)
        if wait.exitcode is not None:  # NVRx appended the save it thinks was handed over
            return _died_before(
                queue,
                entry(save, caller, request),
                _workers.process_of(caller),
                "during the preload handshake",
                wait.exitcode,
            )
        # NVRx waited for the handshake, answered in the worker's place if the request was
        # never sent; without a preload_fn, the finalize finds out (_completion)
        unsent = _unsent.take(caller, save) if _shapes.preloads(request) else None
        if unsent is None:
            _workers.state(caller).outstanding.append(save)
        else:
            _never_sent(queue, entry(save, caller, request), unsent)
    if unsent is not None:  # the checkpoint's failure, not the package's: raised at once
        raise unsent
    return result


def _aborted(save, by, when, death=None):
    """The error of ``save``, whose worker ``close(abort=True)`` from thread ``by`` ended."""
    return CheckpointWorkerError(
        f"rank {_monitor.rank()}: save #{save} was not saved: close(abort=True) (as "
        f"abort_nvrx_checkpoint() calls it) from thread {by!r} aborted the checkpoint worker "
        f"{when}. The next save starts a fresh worker and sends full tensors.",
        rank=_monitor.rank(),
        save=save,
        worker_pid=getattr(death, "pid", None),
        exitcode=getattr(death, "exitcode", None),
    )


def _never_sent(queue, entry, unsent):
    """``entry``'s request could not be pickled (``unsent``): the worker never got it. The
    save is kept as failed (its finalize tells the other ranks, and raises), the trainer
    forgets the cache keys its planning recorded, and ``unsent`` says so."""
    save = entry[0]
    _cleanup.forget_keys()
    _scheduled_failed(queue, entry, _unsent_error(save, unsent))
    add_note(
        unsent,
        f"nvrx_ipc_fix: NVRx's queue could not pickle the request of save #{save}, "
        "so it never reached the checkpoint worker. The package answered NVRx's "
        "preload handshake in the worker's place and raised this at once; the save "
        "is kept as failed, and its finalize raises CheckpointWorkerError on every "
        "rank. The next save sends full tensors to the same worker.",
    )


def _unsent_error(save, unsent):
    return CheckpointWorkerError(
        f"rank {_monitor.rank()}: save #{save} failed: NVRx's queue could not pickle its "
        f"request ({type(unsent).__name__}: {unsent}), so the checkpoint worker never got it. "
        "The save was not finalized; the next save sends full tensors.",
        rank=_monitor.rank(),
        save=save,
    )


def caller_init_wrapper(wrapped, caller, args, kwargs, _finalizing=sys.is_finalizing):
    """Around ``PersistentAsyncCaller.__init__``, which makes the worker's queues: what the
    request queue cannot send is kept for its save (``_unsent``), whose schedule then
    raises at once (``_schedule``), or, without a ``preload_fn``, its finalize."""
    result = wrapped(*args, **kwargs)
    if not _finalizing():
        with guard(_target(wrapped)):
            _unsent.watch(caller)
    return result


def _target(wrapped):
    """The patch target's name (``status()``'s) of the original ``wrapped``."""
    return f"{wrapped.__module__}:{wrapped.__qualname__}"


def _reporting(request):
    """``request`` with its functions run by ``_worker.reporting`` in the worker (their
    traceback reaches the trainer's error); unchanged where it has none."""
    changes = {
        name: partial(_worker.reporting, _worker.directory(), getattr(request, name))
        for name in ("async_fn", "preload_fn")
        if getattr(request, name, None)
    }
    return _shapes.with_functions(request, **changes) if changes else request


def _died_before(queue, entry, process, when, exitcode=None):
    """The worker died before it took ``entry``'s save: detach it, make the queue start a
    fresh one, and schedule the save as failed."""
    save, caller, _ = entry
    error = _own_failure(caller, save, process, when, exitcode)
    _workers.forget_caller(queue, caller)
    return _scheduled_failed(queue, entry, error)


def _scheduled_failed(queue, entry, error):
    """Count ``entry``'s save as scheduled (as the other ranks do) but failed: its finalize
    raises ``error``. The queue's count changes last (one entry, replaced or appended)."""
    save, caller, _ = entry
    state = _workers.state(caller)
    state.outstanding.append(save)
    state.failed[save] = error
    if _appended(queue, save):
        queue.async_calls[-1] = entry
    else:
        queue.call_idx = save
        queue.async_calls.append(entry)
    return save


def _appended(queue, save):
    calls = getattr(queue, "async_calls", None)
    return bool(calls) and calls[-1][0] == save


def finalize_wrapper(wrapped, queue, args, kwargs, _finalizing=sys.is_finalizing):
    """Around ``AsyncCallsQueue.maybe_finalize_async_calls``: a failed save is dropped, the
    saves behind it are finalized as NVRx would, then one error names what was not saved.
    A blocking finalize also goes on past NVRx's own failure of one save (its finalize
    functions raised; NVRx had taken it off the queue), so that nothing is left pending.
    Inside a close or a terminate (``_Held``) that error waits for the end of that call."""
    if _finalizing():  # bound early: module globals are gone by then
        return wrapped(*args, **kwargs)
    try:
        return _finalize(wrapped, queue, args, kwargs)
    except STOP:
        raise
    except BaseException as failure:  # noqa: BLE001 re-raised unless a close or terminate holds it
        if _Held.keeps(queue, failure):
            return list(getattr(failure, "finalized", ()))
        raise


def _finalize(wrapped, queue, args, kwargs):
    with guard(_target(wrapped)) as it:
        blocking, no_dist = flags(wrapped, args, kwargs, "blocking", "no_dist")
        _workers.finalized_with(queue, no_dist)
    if it.failed:
        blocking = False
    calls, finalized, failures = queue.async_calls, [], []
    while True:
        before = [entry[0] for entry in calls]
        try:
            finalized += wrapped(*args, **kwargs)
            break
        except CheckpointWorkerError as error:
            if not (calls and calls[0][0] == error.save):
                _note(error, failures)
                raise
            _, caller, _ = calls.popleft()  # never finalized
            failures.append((error.save, error))
            state = _workers.known(caller)
            if state is not None and state.death is not None:  # the next save starts afresh
                _workers.forget_caller(queue, caller)
        except STOP as stop:
            _note(stop, failures)
            raise
        except BaseException as other:  # noqa: BLE001 torch's CheckpointException too
            left = {entry[0] for entry in calls}
            taken = [save for save in before if save not in left]
            if not (blocking and taken):
                _note(other, failures)
                raise
            finalized += taken[:-1]  # NVRx finalized these, then the last one raised
            failures.append((taken[-1], other))
    if failures:
        raise _summary(failures, finalized)
    return finalized


class _Held:
    """The failed checkpoints the finalizes inside one close of ``queue`` (or, ``queue``
    None, one Megatron or Bridge terminate) ended in, held until that call is done: NVRx's
    own code then goes on (the saves behind are finalized by the close, the worker
    stopped), called once."""

    __slots__ = ("queue", "failures")

    def __init__(self, queue):
        self.queue, self.failures = queue, []

    def __enter__(self):
        _holding.__dict__.setdefault("calls", []).append(self)
        return self

    def __exit__(self, kind, exc, traceback):
        """An exception that ends the call shows the failure held first (``annotate``)."""
        _holding.calls.pop()
        if exc is not None and self.failures:
            annotate(exc, self.failures[0])

    @classmethod
    def keeps(cls, queue, failure):
        """Hold ``failure``, the end of a finalize of ``queue``, for the innermost close or
        terminate in this thread; False where there is none, or where that close could not
        go on (saves are left pending: NVRx's close stops there, as without the package)."""
        calls = getattr(_holding, "calls", None)
        held = calls[-1] if calls else None
        if held is None or (
            held.queue is not None
            and (held.queue is not queue or queue.get_num_unfinalized_calls())
        ):
            return False
        held.failures.append(failure)
        return True


_holding = threading.local()  # .calls: this thread's _Held, innermost last


def queue_close_wrapper(wrapped, queue, args, kwargs, _finalizing=sys.is_finalizing):
    """Around ``AsyncCallsQueue.close``: when the finalize it starts with ends in a failed
    checkpoint and leaves nothing pending, NVRx's close goes on (the worker is stopped), then
    that failure is raised."""
    if _finalizing():
        return wrapped(*args, **kwargs)
    with _Held(queue) as held:
        result = wrapped(*args, **kwargs)
    if held.failures:
        raise held.failures[0]
    return result


def terminate_wrapper(wrapped, instance, args, kwargs):
    """Around Megatron's and Bridge's ``maybe_finalize_async_save``: with ``terminate=True``,
    when the finalize it starts with ends in a failed checkpoint, the rest of the call (the
    saves behind, the close) still runs, then the failure is raised."""
    with guard(_target(wrapped)) as it:
        (terminate,) = flags(wrapped, args, kwargs, "terminate")
    if it.failed:
        terminate = False
    if not terminate:
        return wrapped(*args, **kwargs)
    with _Held(None) as held:
        try:
            result = wrapped(*args, **kwargs)
        except STOP:
            raise
        except BaseException as again:  # noqa: BLE001 the close's own: raised after what came first
            if not held.failures:
                raise
            add_note(
                held.failures[0],
                f"nvrx_ipc_fix: completing the terminate then raised "
                f"{type(again).__name__}: {again}",
            )
    if held.failures:
        raise held.failures[0]
    return result


def _summary(failures, finalized):
    """The first failure, naming every save this finalize did not save and those it did;
    ``failures``: ``[(save, exception)]``."""
    error = failures[0][1]
    error.lost_saves = tuple(save for save, _ in failures)
    error.finalized = tuple(finalized)
    if isinstance(error, CheckpointWorkerError):
        error.failed_ranks = tuple(
            sorted({rank for _, e in failures for rank in getattr(e, "failed_ranks", ())})
        )
    extra = [
        f"Not saved either: save #{save}: {type(e).__name__}: {str(e).splitlines()[0]}"
        for save, e in failures[1:]
    ]
    if finalized:
        extra.append("Finalized by the same call: " + ", ".join(f"save #{i}" for i in finalized))
    if extra and isinstance(error, CheckpointWorkerError):
        error.args = ("\n".join([str(error), *extra]),)
    elif extra:
        add_note(error, "\n".join(extra))
    return error


def _note(exc, failures):
    """Another exception ends a finalize that had dropped failed saves: say which."""
    if not failures:
        return
    lost = ", ".join(f"#{save}" for save, _ in failures)
    text = (
        f"nvrx_ipc_fix: before this error, the same finalize dropped save(s) {lost}: their "
        f"checkpoint failed and they were not saved ({failures[0][1]})"
    )
    logger.error(text.splitlines()[0])
    add_note(exc, text)


def done_wrapper(wrapped, caller, args, kwargs, _finalizing=sys.is_finalizing):
    """Around ``PersistentAsyncCaller.is_current_async_call_done(blocking, no_dist)``: NVRx's
    own check, called once with every argument, after the local wait it cannot end (a dead
    worker) is done here: the completion of this save (never an older one, nor
    ``release()``'s) is put in ``cur_item``, where NVRx takes it, or this rank's failure is
    known. NVRx's all-reduce then carries that failure (``sync_wrapper``); a failure of this
    rank or another raises."""
    if _finalizing():  # bound early: module globals are gone by then
        return wrapped(*args, **kwargs)
    blocking, no_dist = flags(wrapped, args, kwargs, "blocking", "no_dist")
    state = _workers.state(caller)
    save = state.outstanding[0] if state.outstanding else None
    error = state.failed.get(save)
    if error is None and caller.cur_item is None:
        if state.death is not None:  # the worker is gone: what it completed is all there is
            if save in state.completed:
                caller.cur_item = save
            else:
                error = _lost(save, state.death)
        elif _workers.process_of(caller) is not None:
            caller.cur_item, error = _completion(caller, save, blocking)
        elif save is not None and state.aborting is not None:  # NVRx's abort ended it
            error = _aborted(save, state.aborting, "before it completed this save")
    if error is not None:
        caller.cur_item = save  # NVRx waits for nothing more here: its count is done
        if _workers.aborted_by(caller) is not None:  # aborted: no collective any more (the
            _consume(caller, state, save)  # group may be going down with it)
            raise error
    completions = _workers.queues_of(caller)[2]
    pending = (
        caller.cur_item is None
        and completions is not None
        and _workers.process_of(caller) is not None
    )
    check = _checks.current = _Check(caller, error is not None)
    let_go = _shapes.hold_reads(completions) if pending else None
    try:  # pending: NVRx's own look at the completions finds none (this one found none)
        done = wrapped(*args, **kwargs)
    finally:
        _checks.current = None
        if let_go is not None:
            let_go()
    if not no_dist and check.total is not None:
        failed, failed_rank = _decode(check.total, check.world)
        if failed:
            _consume(caller, state, save)
            error = error or _peer_error(save, failed, failed_rank)
            error.failed_ranks = (
                (failed_rank,)
                if failed_rank is not None
                else (_monitor.rank(),)
                if check.failed
                else ()
            )
            raise error
    if error is not None:  # no_dist: there is no peer to tell
        _consume(caller, state, save)
        raise error
    if done:
        _consume(caller, state, save)
    return done


class _Check:
    """One ``is_current_async_call_done`` of ``caller`` in this thread: whether this rank
    failed, and the sum NVRx's all-reduce gave (None until it ran)."""

    __slots__ = ("caller", "failed", "total", "world")

    def __init__(self, caller, failed):
        self.caller, self.failed, self.total, self.world = caller, failed, None, 1


_checks = threading.local()


def sync_wrapper(wrapped, caller, args, kwargs, _finalizing=sys.is_finalizing):
    """Around ``AsyncCaller.sync_all_async_calls(is_alive)``, NVRx's finalize all-reduce
    (one int summed over ranks: ``shapes.COLLECTIVE``): inside ``done_wrapper`` this rank's
    failure flag is added to its value, and the sum is read; anywhere else (NVRx's temporal
    caller) it is NVRx's call alone."""
    check = getattr(_checks, "current", None)
    if not (check is not None and check.caller is caller and check.total is None):
        return wrapped(*args, **kwargs)
    return _sync(wrapped, caller, args, kwargs, check, peers=not _finalizing())


def _sync(wrapped, caller, args, kwargs, check, peers=True):
    """The riding all-reduce. Where the host reads its sum, every rank had entered it: this
    rank's word that it runs the package is written before, the others' read after
    (``worker.peers``); while a rank may lack the package, the flag stays out."""
    import torch

    check.world = torch.distributed.get_world_size()
    flag = check.failed
    with guard("peers"):
        if peers:
            _peers.before()
            flag = flag and _peers.flag_rides()
    if flag:
        (is_alive,) = values(wrapped, args, kwargs, "is_alive")
        args, kwargs = replaced(
            wrapped, args, kwargs, is_alive=_flagged(is_alive, _monitor.rank(), check.world)
        )
    release = sys.modules.get("nvrx_ipc_fix.worker.release")
    hint = RELEASE_HINT if release is not None and release.releasing() else FINALIZE_HINT
    with _monitor.watching(
        f"NVRx's finalize all-reduce (sync_all_async_calls) of save #{_front(caller)}", hint=hint
    ):
        result, check.total = _shapes.summed(lambda: wrapped(*args, **kwargs))
    with guard("peers"):
        if peers:
            _peers.after()
    return result


def _front(caller):
    outstanding = _workers.state(caller).outstanding
    return outstanding[0] if outstanding else None


def _fields(world):
    """How a failure is added to NVRx's one int32 summed over ``world`` ranks (each rank's
    value without it: 1 while still writing, else 0): ``(unit, named)``. A failed rank adds
    ``unit`` (a count of up to ``world`` ranks fits below it), and, where ``named``, ``unit``
    squared times its rank, so that a lone failed rank is known by every rank."""
    bits = max(world, 1).bit_length()
    return 1 << bits, 3 * bits <= 31


def _flagged(is_alive, rank, world):
    """This failed rank's value for the all-reduce."""
    unit, named = _fields(world)
    return int(is_alive) + unit + (unit * unit * (rank or 0) if named else 0)


def _decode(total, world):
    """``(ranks failed, the failed rank or None)`` from the sum (taken modulo 2**32: where
    several failed ranks overflow the int, their count still holds)."""
    unit, named = _fields(world)
    raw = total % (1 << 32)
    failed = (raw // unit) % unit if named else raw // unit
    return failed, (raw // (unit * unit) if named and failed == 1 else None)


def _consume(caller, state, save):
    """The front save is done with, one way or the other."""
    caller.cur_item = None
    if state.outstanding:
        state.outstanding.popleft()
    state.failed.pop(save, None)
    state.completed.discard(save)


def close_wrapper(wrapped, caller, args, kwargs, _finalizing=sys.is_finalizing):
    """Around ``PersistentAsyncCaller.close``: never wait on a dead worker; one that dies
    during the close is detached, its queues closed (NVRx 0.4.1 would start the next worker on
    them: a lock or a ``DONE`` the dead one left holds that worker up for ever). An abort
    wakes the worker first (``_wake``)."""
    if _finalizing():  # bound early: module globals are gone by then
        if getattr(caller, "process", None) is None:
            return None  # nothing to close (a dead worker detached)
        return wrapped(*args, **kwargs)
    process = _workers.process_of(caller)
    with guard(_target(wrapped), own=True) as it:
        aborts = _dispatch.aborts(wrapped, args, kwargs)
    if aborts and not it.failed and process is not None:
        return _abort(wrapped, caller, args, kwargs, process)
    if _workers.dead(process):
        if process.exitcode != 0:
            logger.error(
                "rank %s: the checkpoint worker (pid %s) had died (%s) before it was closed",
                _monitor.rank(),
                process.pid,
                _workers.describe_exit(process.exitcode),
            )
        _workers.abandon(caller)
        return None

    def unblock():
        _workers.release_join(_workers.queues_of(caller)[0])

    with _monitor.watching("closing the checkpoint worker", lambda: process, unblock) as wait:
        result = wrapped(*args, **kwargs)
    if wait.exitcode not in (None, 0):  # died in the close: its queues may hold what it left
        with guard(_target(wrapped)):  # the close itself is done
            _workers.abandon(caller)
    return result


def _abort(wrapped, caller, args, kwargs, process):
    """``close(abort=True)``: NVRx's abort, which waits for nothing of the package's. Once it
    is done, its worker is a dead worker to the save that waits on it (``_aborted_worker``);
    meanwhile that save's wait is not ended for the worker's death (``aborting``)."""
    state = handshake = None
    with guard(_target(wrapped), own=True):
        state = _workers.state(caller)
        state.aborting = threading.current_thread().name
        _cleanup.forget_keys()  # a save planned from now on sends full tensors
        handshake = _workers.queues_of(caller)[1]
        if _shapes.abort_waits(caller):
            _wake(caller)
    returned = False
    try:
        result = wrapped(*args, **kwargs)  # NVRx's abort and its errors are the caller's
        returned = True
        return result
    finally:
        if state is not None:
            _aborted_worker(_target(wrapped), caller, state, process, handshake, returned)


def _aborted_worker(target, caller, state, process, handshake, returned):
    """After NVRx's abort of ``caller``'s ``process``: where it returned (megatron-core's
    SIGKILLs the worker and does not wait) or the worker is gone, that worker is detached as a
    dead one (``Death`` naming the abort: the save waiting on it, or finalized later, raises;
    what it had completed is finalized) and a preload handshake waiting on it is answered.
    Nothing here raises: a failure is the package's, said once."""
    with guard(target, own=True):
        if returned or not _workers.alive(process):
            state.death = _workers.Death(
                _front(caller), process.pid, process.exitcode, None, state.aborting
            )
            _workers.abandon(caller)
            _workers.release_join(handshake)
    state.aborting = None


def _wake(caller):
    """Before NVRx 0.7.0's abort, which SIGTERMs the worker and waits ``sigterm_timeout``
    (30 s) for its handler: where the signal reaches the worker's queue feeder thread, only
    the main thread, blocked reading its next request, runs the handler, once it wakes. A
    ``DONE`` wakes it: it then ends through the handler or, having read ``DONE``, as a close
    ends it. The class's ``put``: the instance's may be the one that was interrupted."""
    requests = _workers.queues_of(caller)[0]
    if requests is not None:
        try:
            type(requests).put(requests, "DONE")
        except (OSError, ValueError):  # a closed queue: nothing to wake
            pass


def worker_loop_wrapper(wrapped, instance, args, kwargs):
    """Around the worker's loop, in the worker: leave the traceback for the trainer."""
    return _worker.reporting(None, wrapped, *args, **kwargs)


# -- failure handling -------------------------------------------------------------------------


def _peer_error(save, failed, failed_rank):
    who = (
        f"rank {failed_rank}"
        if failed_rank is not None
        else f"{failed} ranks"
        if failed > 1
        else "another rank"
    )
    return CheckpointWorkerError(
        f"rank {_monitor.rank()}: save #{save} failed on {who}: its checkpoint worker "
        "failed (see that rank's error). The save was not finalized on any rank.",
        rank=_monitor.rank(),
        save=save,
    )


def _lost(save, death):
    """The error of ``save``, which the worker that died (``death``) never completed."""
    if death.by is not None:
        return _aborted(save, death.by, "before it completed this save", death)
    return _worker_error(
        save, death.pid, death.exitcode, "before it completed this save", death.worker_traceback
    )


def _worker_error(save, pid, exitcode, when, worker_traceback):
    return CheckpointWorkerError(
        f"rank {_monitor.rank()}: save #{save} failed: the checkpoint worker (pid {pid}) died "
        f"{when} ({_workers.describe_exit(exitcode)}). The save was not finalized; the next save "
        "starts a fresh worker and sends full tensors."
        + (
            f"\nThe worker's traceback:\n{worker_traceback}"
            if worker_traceback
            else "\nThe worker's own output, if any, is on this rank's stderr."
        ),
        rank=_monitor.rank(),
        save=save,
        worker_pid=pid,
        exitcode=exitcode,
        worker_traceback=worker_traceback,
    )


def _completion(caller, save, blocking):
    """The completion of ``save`` from the worker, or ``(None, None)`` if not there yet, or
    ``(None, error)`` if the worker died without sending it or never got its request. Older
    completions and ``release()``'s answers are dropped."""
    comp_q = _workers.queues_of(caller)[2]
    process = _workers.process_of(caller)

    def take(timeout):
        while True:
            try:
                item = comp_q.get(timeout=timeout) if timeout else comp_q.get_nowait()
            except Empty:
                return None
            except (OSError, ValueError, EOFError):  # closed by an abort of another thread
                if timeout:
                    time.sleep(timeout)  # until the abort's death mark (``ended``)
                return None
            if item == _workers.SENTINEL or (
                save is not None and isinstance(item, int) and item < save
            ):
                continue  # not this save's
            return item

    def ended():
        """``(None, error)`` when the save can no longer complete, else None."""
        state = _workers.state(caller)
        if state.aborting is not None and state.death is None:
            return None  # NVRx's abort is under way: its end ends this wait (``_abort``)
        if state.death is not None:  # detached (aborted): it completed this save, or never will
            item = take(0)
            if item is None and save in state.completed:
                item = save
            return (item, None) if item is not None else (None, _lost(save, state.death))
        unsent = _unsent.take(caller, save)
        if unsent is not None:  # never sent (a request without a preload_fn)
            _cleanup.forget_keys()
            return None, _unsent_error(save, unsent)
        if _workers.dead(process):
            item = take(0)  # sent just before it died?
            return (item, None) if item is not None else (None, _own_failure(caller, save, process))
        return None

    item = take(0)
    if item is not None or not blocking:
        return (item, None) if item is not None else ended() or (None, None)
    with _monitor.watching(
        f"the finalize of save #{save} (waiting for the worker)", lambda: process
    ):
        while True:
            item = take(0.2)
            if item is not None:
                return item, None
            failed = ended()
            if failed is not None:
                return failed


def _own_failure(caller, save, process, when="while writing it", exitcode=None):
    """The error for this rank's dead worker, kept as its caller's ``death``; the worker is
    detached (``_workers.abandon``)."""
    pid = getattr(process, "pid", None)
    if exitcode is None and process is not None:
        exitcode = _monitor.exitcode(process, settle=0.5)
    death = _workers.Death(save, pid, exitcode, _worker.read_traceback(pid))
    _workers.state(caller).death = death
    _workers.abandon(caller)
    return _worker_error(save, pid, exitcode, when, death.worker_traceback)
