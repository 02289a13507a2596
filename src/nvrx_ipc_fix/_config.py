"""Every ``NVRX_IPC_FIX_*`` environment variable: name, default, parser.

Values are read when they are needed, so a launcher or a test can change them between
activations. An invalid value gives one ``RuntimeWarning`` (shown on stderr by default,
unlike our logger) and falls back to the default.
"""

import os

#: ``1``/``true``/``yes``/``on`` turns the package off; a comma list of fix names
#: (``clear_on_close,stale_guard``) turns off only those fixes. Default: everything on.
DISABLE = "NVRX_IPC_FIX_DISABLE"
#: ``0``/``false``/``no``/``off`` turns start-up activation (the ``.pth`` file, the
#: sitecustomize fallback) off; ``import nvrx_ipc_fix``, ``activate()`` and the Ray hook still
#: activate. Default: on. Read before the package is imported, by ``_nvrx_ipc_fix_startup``.
AUTO = "NVRX_IPC_FIX_AUTO"
#: ``debug``/``info``/``warning``/``error``: attach a stderr handler to the
#: ``nvrx_ipc_fix`` logger at that level. Default: no handler (a ``NullHandler`` only).
LOG_LEVEL = "NVRX_IPC_FIX_LOG_LEVEL"

#: ``flush`` (default: keep the worker) or ``terminate``: what ``release()`` does by default.
STRATEGY = "NVRX_IPC_FIX_STRATEGY"
#: Seconds ``release()`` waits for the worker before terminating it. Default 60.
RELEASE_TIMEOUT = "NVRX_IPC_FIX_RELEASE_TIMEOUT"
#: When to release automatically: ``offload`` (default: before the frameworks move model or
#: optimizer storage), ``finalize`` (also after every blocking ``maybe_finalize_async_save``),
#: ``never``.
RELEASE = "NVRX_IPC_FIX_RELEASE"

_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"", "0", "false", "no", "off"}
_LEVELS = ("debug", "info", "warning", "error")
_handler = None
_warned = set()


def _invalid(name, raw, why):
    if (name, raw) not in _warned:
        _warned.add((name, raw))
        import warnings

        warnings.warn(f"nvrx_ipc_fix: {name}={raw!r} {why}", RuntimeWarning, stacklevel=3)


def disabled_fixes(known):
    """The fixes the environment turns off, as a frozenset; ``None`` when the package is off."""
    raw = os.environ.get(DISABLE, "").strip().lower()
    if raw in _FALSE:
        return frozenset()
    if raw in _TRUE:
        return None
    names = {part.strip() for part in raw.split(",") if part.strip()}
    unknown = names.difference(known)
    if unknown:
        _invalid(DISABLE, raw, f"names unknown fixes {sorted(unknown)} (known: "
                 f"{', '.join(known)}, or 1 for all); ignoring those")
    return frozenset(names.intersection(known))


def auto():
    """Whether start-up activation is on (``NVRX_IPC_FIX_AUTO``)."""
    raw = os.environ.get(AUTO, "").strip().lower()
    if raw and raw in _FALSE:
        return False
    if raw and raw not in _TRUE:
        _invalid(AUTO, raw, "is not 0 or 1; start-up activation stays on")
    return True


def configure_logging():
    """Honour ``NVRX_IPC_FIX_LOG_LEVEL`` with one stderr handler (idempotent)."""
    global _handler
    raw = os.environ.get(LOG_LEVEL, "").strip().lower()
    if not raw:
        return
    if raw not in _LEVELS:
        _invalid(LOG_LEVEL, raw, f"is not one of {', '.join(_LEVELS)}; ignoring it")
        return
    import logging

    from ._log import logger

    if _handler is None:
        _handler = logging.StreamHandler()
        _handler.setFormatter(logging.Formatter(
            "nvrx_ipc_fix[%(process)d] %(levelname)s: %(message)s"))
        logger.addHandler(_handler)
    logger.setLevel(raw.upper())


def _choice(name, allowed, default):
    raw = os.environ.get(name, "").strip().lower()
    if not raw:
        return default
    if raw not in allowed:
        _invalid(name, raw, f"is not one of {', '.join(allowed)}; using {default}")
        return default
    return raw


def strategy():
    """The default ``release()`` strategy."""
    return _choice(STRATEGY, ("flush", "terminate"), "flush")


def release_policy():
    """When the package releases on its own: ``offload``, ``finalize`` or ``never``."""
    return _choice(RELEASE, ("offload", "finalize", "never"), "offload")


def release_timeout():
    """Seconds to wait for the worker during ``release()``."""
    raw = os.environ.get(RELEASE_TIMEOUT, "").strip()
    try:
        value = float(raw) if raw else 60.0
        if value <= 0:
            raise ValueError
        return value
    except ValueError:
        _invalid(RELEASE_TIMEOUT, raw, "is not a positive number of seconds; using 60")
        return 60.0
