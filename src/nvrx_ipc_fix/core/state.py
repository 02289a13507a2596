"""What ``core`` needs from the modules that import it, registered here so that ``core``
need not import them: what the modules below the installer ask of it (``installed``,
``activated``), answered by ``lifecycle`` once imported, and what the ``worker`` and ``fixes``
packages register: what ``deactivate()`` runs (``on_deactivate``) and what ``status()``
reports of them (``on_status``). Imports nothing."""

from __future__ import annotations

TYPE_CHECKING = False  # typing.TYPE_CHECKING, without importing typing
if TYPE_CHECKING:
    from collections.abc import Callable
    from typing import Any

deactivations: list[Callable[[], object]] = []  # run by lifecycle.deactivate, in this order
#: Status field -> the function that gives its value, once its module is imported
reports: dict[str, Callable[[], Any]] = {}


def installed(fix, attr):
    """Is ``fix``'s wrapper of ``attr`` in place and switched on? (``lifecycle.installed``.)"""
    return False


def activated():
    """Is the package active in this process? (``lifecycle``'s answer.)"""
    return False


def on_deactivate(stop, first=False):
    """Register ``stop()``, which ``deactivate()`` runs before it unpatches (``first``: before
    the callbacks already registered); returns it."""
    deactivations.insert(0, stop) if first else deactivations.append(stop)
    return stop


def on_status(field):
    """Register the decorated function as what ``status()`` reports as ``field``."""

    def register(describe):
        reports[field] = describe
        return describe

    return register
