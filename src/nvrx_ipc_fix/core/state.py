"""The package's per-process state, module by module. Each module that keeps records
registers here how to return them to their value at import, and ``reset_all`` does that for
every module imported so far (``lifecycle.reset``, for tests that run many cases in one
interpreter). Imports nothing."""

_resets = []


def on_reset(reset):
    """Register ``reset()``, which empties the calling module's records; returns it."""
    _resets.append(reset)
    return reset


def reset_all():
    for reset in _resets:
        reset()
