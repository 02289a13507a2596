"""A wrapped call's arguments by name, bound as the original would bind them (wrappers
must not guess positions: Megatron's and Bridge's signatures differ)."""

import inspect

from . import state as _state

_signatures = {}  # (function, bound?) -> signature: never a bound method, which holds its object


def flags(wrapped, args, kwargs, *names):
    """The boolean value of each of ``names`` in this call of ``wrapped``, defaults applied."""
    key = (getattr(wrapped, "__func__", wrapped), hasattr(wrapped, "__self__"))
    sig = _signatures.get(key)
    if sig is None:
        sig = _signatures[key] = inspect.signature(wrapped)
    bound = sig.bind(*args, **kwargs)
    bound.apply_defaults()
    return tuple(bool(bound.arguments.get(name)) for name in names)


_state.on_reset(_signatures.clear)
