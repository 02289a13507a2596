"""The package's per-process state, module by module. Each module that keeps records
registers here how to return them to their value at import, and ``reset_all`` does that for
every module imported so far (``lifecycle.reset``, for tests that run many cases in one
interpreter). It also holds what modules below the installer ask of it (``installed``,
``activated``), answered by ``lifecycle`` once imported, so that they need not import it.
Imports nothing."""

_resets = []


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


def reset_all():
    for reset in _resets:
        reset()
