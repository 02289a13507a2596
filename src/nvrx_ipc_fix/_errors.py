"""``CheckpointWorkerError``: what a rank raises instead of waiting for ever on a failed
checkpoint worker."""

from __future__ import annotations


class CheckpointWorkerError(RuntimeError):
    """The NVRx (or megatron-core) persistent checkpoint worker failed during a save.

    Raised on the rank whose worker died, as soon as its wait on the worker ends, and on
    every rank at the next finalize of that save (the failure travels with NVRx's finalize
    all-reduce), so no rank is left waiting. The failed save is never finalized; the next
    save starts a fresh worker and sends full tensors.
    """

    def __init__(self, message: str, *, rank: int | None = None, save: int | None = None,
                 worker_pid: int | None = None, exitcode: int | None = None,
                 worker_traceback: str | None = None, failed_ranks: tuple = ()):
        super().__init__(message)
        self.rank = rank  # the rank that raised
        self.save = save  # NVRx's call_idx of the failed save
        self.worker_pid = worker_pid  # this rank's worker, when this rank's worker failed
        self.exitcode = exitcode  # multiprocessing's: negative for a signal
        self.worker_traceback = worker_traceback
        self.failed_ranks = tuple(failed_ranks)  # every rank whose worker failed, when known

    def __reduce__(self):  # picklable with its attributes (Ray, multiprocessing)
        return (_rebuild, (type(self), str(self), vars(self)))


def _rebuild(cls, message, attributes):
    error = cls.__new__(cls)
    RuntimeError.__init__(error, message)
    error.__dict__.update(attributes)
    return error
