"""A wrapped call's arguments by name, bound as the original would bind them (wrappers
must not guess positions: Megatron's and Bridge's signatures differ)."""

import inspect

_signatures = {}


def flags(wrapped, args, kwargs, *names):
    """The boolean value of each of ``names`` in this call of ``wrapped``, defaults applied."""
    sig = _signatures.get(wrapped)
    if sig is None:
        sig = _signatures[wrapped] = inspect.signature(wrapped)
    bound = sig.bind(*args, **kwargs)
    bound.apply_defaults()
    return tuple(bool(bound.arguments.get(name)) for name in names)
