"""The package's per-process state, module by module. Each module that keeps records
registers here how to return them to their value at import, and ``reset_all`` does that for
every module imported so far (``lifecycle.reset``, for tests that run many cases in one
interpreter). It also holds what modules below the installer ask of it (``installed``,
``activated``), answered by ``lifecycle`` once imported, so that they need not import it, and
what the rooms above ``core`` register with it: what ``deactivate()`` runs
(``on_deactivate``) and what ``status()`` reports of them (``on_status``). Imports nothing."""

from __future__ import annotations

TYPE_CHECKING = False  # typing.TYPE_CHECKING, without importing typing
if TYPE_CHECKING:
    from collections.abc import Callable
    from typing import Any

_resets: list[Callable[[], object]] = []
deactivations: list[Callable[[], object]] = []  # run by lifecycle.deactivate, in this order
#: Status field -> the function that gives its value, once its module is imported
reports: dict[str, Callable[[], Any]] = {}


def installed(fix, attr):
    """Is ``fix``'s wrapper of ``attr`` in place and switched on? (``lifecycle.installed``.)"""
    return False


def activated():
    """Is the package active in this process? (``lifecycle``'s answer.)"""
    return False


def on_reset(reset):
    """Register ``reset()``, which empties the calling module's records; returns it."""
    _resets.append(reset)
    return reset


def on_deactivate(stop, first=False):
    """Register ``stop()``, which ``deactivate()`` runs before it unpatches (``first``: before
    the others registered); returns it."""
    deactivations.insert(0, stop) if first else deactivations.append(stop)
    return stop


def on_status(field):
    """Register the decorated function as what ``status()`` reports as ``field``."""
    def register(describe):
        reports[field] = describe
        return describe
    return register


def reset_all():
    for reset in _resets:
        reset()
