"""Fix ``suspend``: a suspended NVRx checkpoint worker (``worker.suspend``) is resumed before it
is given anything: before a save is scheduled on its queue, and before it is closed (its exit
would wait for the device). Without this fix, ``suspend`` is not used: the release falls
back to ``restart``.
"""

import sys

from ..core.detect import CORE
from ..core.log import guard
from ..worker import suspend as _suspend

SCHEDULE_TARGET = f"{CORE}:AsyncCallsQueue.schedule_async_request"
CLOSE_TARGET = f"{CORE}:PersistentAsyncCaller.close"


def schedule_wrapper(wrapped, queue, args, kwargs, _finalizing=sys.is_finalizing):
    """Around ``AsyncCallsQueue.schedule_async_request``: the worker runs before the save
    goes to it."""
    if not _finalizing():
        _ready(SCHEDULE_TARGET, queue=queue)
    return wrapped(*args, **kwargs)


def close_wrapper(wrapped, caller, args, kwargs, _finalizing=sys.is_finalizing):
    """Around ``PersistentAsyncCaller.close``: the worker runs before it is told to stop."""
    if not _finalizing():
        _ready(CLOSE_TARGET, caller=caller)
    return wrapped(*args, **kwargs)


def _ready(target, **whose):
    """Resume ``whose`` worker if suspended. Not while the interpreter finalizes (checked by
    the wrappers before they look anything up: NVRx's ``__del__`` can close a queue in the
    module teardown, after this module's globals are gone); the exit handler resumed every
    worker already."""
    with guard(target, fix="suspend"):
        _suspend.ready(**whose)
