"""What runs in a child made by ``os.fork()``, right after the fork, and at the exit of the
process that asked.

Such a child (not one multiprocessing starts afresh) inherits the parent's memory: the
package's locks, held perhaps by a thread the child does not have, its records of the
parent's checkpoint workers, and NVRx's objects that name those workers. Each lock is made
with ``renewed`` (released in the child, before anything else runs there); each module that
owns other such state registers a callback with ``in_child``; the callbacks run in the child
in the order they were registered. One that raises is a defect of the package: one
``RuntimeWarning`` in the child (``status()`` there names it, where the callback serves a
target), and the remaining callbacks still run. A child also inherits the parent's ``atexit``
handlers: ``at_exit`` runs one only in the process that registered it. Imports only ``os`` and
``atexit``.
"""

from __future__ import annotations

import atexit
import os

TYPE_CHECKING = False  # typing.TYPE_CHECKING, without importing typing
if TYPE_CHECKING:
    from collections.abc import Callable
    from typing import Any, TypeVar

    Lock = TypeVar("Lock")

_callbacks: list[tuple[Callable[[], object], str | None]] = []  # (callback, target name or None)
_locks: list[Any] = []  # released in the child first
_exits: dict[tuple, int] = {}  # (function, args) -> the pid whose atexit runs it


def _register():
    if not _callbacks and not _locks:
        os.register_at_fork(after_in_child=_run)


def renewed(lock: Lock) -> Lock:
    """``lock`` (a ``threading`` lock or ``RLock``), released in every child of ``os.fork()``:
    the parent's may be held by a thread the child does not have."""
    _register()
    _locks.append(lock)
    return lock


def in_child(callback, target=None):
    """Run ``callback()`` in every child ``os.fork()`` makes from now on. ``target``: the
    target name whose ``status()`` shows a failure of it."""
    _register()
    _callbacks.append((callback, target))


def at_exit(function, *args):
    """Run ``function(*args)`` once at the exit of this process, however often asked; never
    in a child of ``os.fork()``, which inherits the handler (it asks anew for its own)."""
    pid = os.getpid()
    if _exits.get((function, args)) != pid:
        _exits[function, args] = pid
        atexit.register(_in, pid, function, *args)


def _in(pid, function, *args):
    if os.getpid() == pid:
        function(*args)


def _run():
    for lock in _locks:
        lock._at_fork_reinit()
    for callback, target in _callbacks:
        try:
            callback()
        except Exception as exc:  # noqa: BLE001 warned; the child continues
            _failed(callback, target, exc)


def _failed(callback, target, exc):
    from .log import errors, warn

    reason = (
        f"after os.fork(), in the child: {callback.__qualname__} failed: "
        f"{type(exc).__name__}: {exc}"
    )
    if target is not None:
        errors[target] = reason
    warn(f"nvrx_ipc_fix: {reason} (pid {os.getpid()})", ("fork", callback.__qualname__))
