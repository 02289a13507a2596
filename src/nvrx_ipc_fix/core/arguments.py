"""A wrapped call's arguments by name, bound as the original would bind them (wrappers
must not guess positions: Megatron's and Bridge's signatures differ)."""

from __future__ import annotations

import inspect

TYPE_CHECKING = False  # typing.TYPE_CHECKING, without importing typing
if TYPE_CHECKING:
    from collections.abc import Callable
    from typing import Any

#: (function, bound?) -> signature: never a bound method, which holds its object
_signatures: dict[tuple[Callable[..., Any], bool], inspect.Signature] = {}


def flags(wrapped, args, kwargs, *names):
    """The boolean value of each of ``names`` in this call of ``wrapped``, defaults applied."""
    bound = _signature(wrapped).bind(*args, **kwargs)
    bound.apply_defaults()
    return tuple(bool(bound.arguments.get(name)) for name in names)


def values(wrapped, args, kwargs, *names):
    """The value of each of ``names`` in this call of ``wrapped`` (passed, not defaulted)."""
    bound = _signature(wrapped).bind(*args, **kwargs)
    return tuple(bound.arguments[name] for name in names)


def replaced(wrapped, args, kwargs, **values):
    """``(args, kwargs)`` of this call of ``wrapped`` with ``values`` in place of the arguments
    of those names, every other argument as it was passed."""
    bound = _signature(wrapped).bind(*args, **kwargs)
    bound.arguments.update(values)
    return bound.args, bound.kwargs


def _signature(wrapped):
    key = (getattr(wrapped, "__func__", wrapped), hasattr(wrapped, "__self__"))
    sig = _signatures.get(key)
    if sig is None:
        sig = _signatures[key] = inspect.signature(wrapped)
    return sig
