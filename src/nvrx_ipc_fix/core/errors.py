"""``CheckpointWorkerError``: what a rank raises instead of waiting for ever on a failed
checkpoint worker; ``PersistentAsyncWorkerError`` is the same class under the name of
Megatron-LM PR #6971, for handling written against that PR."""

from __future__ import annotations

TYPE_CHECKING = False  # typing.TYPE_CHECKING, without importing typing
if TYPE_CHECKING:
    from collections.abc import Iterable
    from typing import Any, TypeVar

    _E = TypeVar("_E", bound=RuntimeError)


class CheckpointWorkerError(RuntimeError):
    """The NVRx (or megatron-core) persistent checkpoint worker failed during a save.

    Raised once per rank, by the finalize (``maybe_finalize_async_calls``) that reaches the
    failed save: with ``no_dist=False`` on every rank at the same call (the failure travels
    with NVRx's finalize all-reduce), with ``no_dist=True`` on the rank whose worker failed.
    Scheduling a save raises it only where another thread aborted the worker
    (``close(abort=True)``) during that schedule; an abort during a finalize makes it raise on
    this rank alone. The failed save, and any save the dead worker had not completed, is
    never finalized (``lost_saves``); the saves behind them are finalized by the same call
    (``finalized``) or stay pending for the next one. The next save starts a fresh worker and
    sends full tensors.
    """

    def __init__(
        self,
        message: str,
        *,
        rank: int | None = None,
        save: int | None = None,
        worker_pid: int | None = None,
        exitcode: int | None = None,
        worker_traceback: str | None = None,
        failed_ranks: Iterable[int] = (),
    ) -> None:
        super().__init__(message)
        self.rank = rank  # the rank that raised
        self.save = save  # NVRx's call_idx of the (first) failed save
        self.worker_pid = worker_pid  # this rank's worker, when this rank's worker failed
        self.exitcode = exitcode  # multiprocessing's: negative for a signal
        self.worker_traceback = worker_traceback
        self.failed_ranks = tuple(failed_ranks)  # every rank whose worker failed, when known
        #: every save this finalize dropped, not saved
        self.lost_saves: tuple[int | None, ...] = (save,)
        self.finalized: tuple[int, ...] = ()  # the saves the same finalize finalized

    def __reduce__(self) -> tuple[Any, ...]:  # picklable with its attributes (Ray, multiprocessing)
        return (_rebuild, (type(self), str(self), vars(self)))


#: Megatron-LM PR #6971's name (not in released megatron-core): ``except
#: PersistentAsyncWorkerError`` catches this package's error.
PersistentAsyncWorkerError = CheckpointWorkerError


def _rebuild(cls: type[_E], message: str, attributes: dict[str, Any]) -> _E:
    error = cls.__new__(cls)
    RuntimeError.__init__(error, message)
    error.__dict__.update(attributes)
    return error


#: What stops a call at once (an interrupt, an exit): never held back to be raised later.
STOP = (KeyboardInterrupt, SystemExit, GeneratorExit)


def add_note(exc, text):
    """Add ``text`` to ``exc``'s traceback (a note; Python 3.10 has none: nothing)."""
    add = getattr(exc, "add_note", None)
    if add is not None:
        add(text)


def annotate(exc, failure):
    """``exc`` ends a call that had met ``failure`` (a failed checkpoint) first: show both."""
    add_note(
        exc,
        f"nvrx_ipc_fix: before this error, the same call had met a failed "
        f"checkpoint: {type(failure).__name__}: {str(failure).splitlines()[0]}",
    )
    if exc.__context__ is None:
        exc.__context__ = failure


class shown_with:
    """``with shown_with(failure):`` an exception that ends the block shows ``failure`` (a
    failed checkpoint the call met first; None: nothing to show) with it (``annotate``)."""

    __slots__ = ("failure",)

    def __init__(self, failure):
        self.failure = failure

    def __enter__(self):
        return self

    def __exit__(self, kind, exc, traceback):
        if exc is not None and self.failure is not None:
            annotate(exc, self.failure)


def deliver(failure, call):
    """Run ``call()`` (the work of the user's call that the package finalized in), then raise
    ``failure``, a failure of the checkpoint met on the way, if any. Where ``call()`` raises
    too, its exception propagates, ``failure`` shown with it (``annotate``)."""
    if failure is None:
        return call()
    with shown_with(failure):
        call()
    raise failure
