"""Fix ``own_results``: each save's write results reach its own finalize.

NVRx collects the write results of every save of the process through one queue of a
``multiprocessing`` manager (``get_write_results_queue()``): the worker puts one save's
results there, and the finalize (``retrieve_write_results``) takes whatever is first. With
saves of two queues in flight at once (a model and its EMA), or two saves of a queue that
forks a process per save, a finalize takes the other save's results and writes them into its
metadata: the checkpoint does not load, and nothing is raised.

After NVRx's ``prepare_write_data`` the writer gets a queue of its own from NVRx's manager;
NVRx then hands that one to the worker (``get_save_function_and_args``) and reads it in the
finalize. The proxy goes with the writer.

Where the fix cannot make a queue (the package's defect, a shape it does not know), the save
keeps NVRx's shared queue, with one warning. Such saves cannot be told apart when their times
in flight overlap: each of them then fails in its finalize, as NVRx's finalize fails for lost
results (every rank raises), instead of writing another save's metadata.
"""

from __future__ import annotations

import sys
import threading
import weakref

from ..core import fork as _fork, shapes as _shapes, state as _state
from ..core.detect import FS
from ..core.log import hook_failed

TYPE_CHECKING = False  # typing.TYPE_CHECKING, without importing typing
if TYPE_CHECKING:
    from typing import Any

FIX = "own_results"
PREPARE_TARGET = f"{FS}:FileSystemWriterAsync.prepare_write_data"
RETRIEVE_TARGET = f"{FS}:FileSystemWriterAsync.retrieve_write_results"

_lock = threading.Lock()
#: writers on NVRx's shared queue whose results are not taken yet
_shared: weakref.WeakSet[Any] = weakref.WeakSet()
#: of those, the ones whose time in flight overlapped another's
_mixed: weakref.WeakSet[Any] = weakref.WeakSet()
_fell_back = [False]  # has any save of this process kept NVRx's shared queue?


def prepare_write_data_wrapper(wrapped, instance, args, kwargs):
    """Around ``FileSystemWriterAsync.prepare_write_data(plan, planner)``."""
    result = wrapped(*args, **kwargs)
    try:
        _shapes.own_results_queue(instance)
    except Exception as exc:  # noqa: BLE001 the package's defect: NVRx's shared queue stays
        hook_failed(PREPARE_TARGET, exc, fix=FIX)
        _share(instance)
    return result


def retrieve_write_results_wrapper(wrapped, instance, args, kwargs):
    """Around ``FileSystemWriterAsync.retrieve_write_results()``: NVRx's result, or, for a
    save on the shared queue that overlapped another, a failure."""
    result = wrapped(*args, **kwargs)
    try:
        with _lock:
            mixed = instance in _mixed
            _shared.discard(instance)
            _mixed.discard(instance)
    except Exception as exc:  # noqa: BLE001 the package's defect falls back to NVRx
        hook_failed(RETRIEVE_TARGET, exc, fix=FIX)
        mixed = _fell_back[0]  # unknown: only a save that had its own queue is sure
    if not mixed:
        return result
    return _shapes.failed_retrieval(sys.modules[FS], wrapped, RuntimeError(
        "nvrx_ipc_fix own_results: this save's write results cannot be told from another's: "
        "both took NVRx's one results queue while in flight (the fix could not give them "
        "queues of their own: see nvrx_ipc_fix.status()); not finalized"))


def _share(writer):
    """``writer`` keeps NVRx's shared queue: it and every other such save in flight are
    mixed."""
    _fell_back[0] = True
    try:
        if not _shapes.has_results_queue(writer):
            return  # nothing to write, no results
        with _lock:
            _shared.add(writer)
            if len(_shared) > 1:
                _mixed.update(_shared)
    except Exception as exc:  # noqa: BLE001 the package's defect falls back to NVRx
        hook_failed(PREPARE_TARGET, exc, fix=FIX)


def _forget():
    """No save of this process is in flight (a reset), or none is this process's (a child
    of ``os.fork()``: the parent's saves; its own get a manager of its own)."""
    global _lock
    _lock = threading.Lock()
    _shared.clear()
    _mixed.clear()
    _fell_back[0] = False


_state.on_reset(_forget)
_fork.in_child(_forget)
