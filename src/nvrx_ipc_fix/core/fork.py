"""What runs in a child made by ``os.fork()``, right after the fork.

Such a child (not one multiprocessing starts afresh) inherits the parent's memory: the
package's locks, held perhaps by a thread the child does not have, its records of the
parent's checkpoint workers, and NVRx's objects that name those workers. Each module that
owns such state registers a callback with ``in_child``; the callbacks run in the child in
the order they were registered. One that raises is a defect of the package: one
``RuntimeWarning`` in the child (``status()`` there names it, where the callback serves a
target), and the others still run. Imports only ``os``.
"""

from __future__ import annotations

import os

TYPE_CHECKING = False  # typing.TYPE_CHECKING, without importing typing
if TYPE_CHECKING:
    from collections.abc import Callable

_callbacks: list[tuple[Callable[[], object], str | None]] = []  # (callback, target name or None)


def in_child(callback, target=None):
    """Run ``callback()`` in every child ``os.fork()`` makes from now on. ``target``: the
    target name whose ``status()`` shows a failure of it."""
    if not _callbacks and hasattr(os, "register_at_fork"):
        os.register_at_fork(after_in_child=_run)
    _callbacks.append((callback, target))


def _run():
    for callback, target in _callbacks:
        try:
            callback()
        except Exception as exc:  # noqa: BLE001 said; the child goes on
            _failed(callback, target, exc)


def _failed(callback, target, exc):
    from .log import errors, warn

    reason = f"after os.fork(), in the child: {callback.__qualname__} failed: " \
             f"{type(exc).__name__}: {exc}"
    if target is not None:
        errors[target] = reason
    warn(f"nvrx_ipc_fix: {reason} (pid {os.getpid()})", ("fork", callback.__qualname__))
