"""Every ``NVRX_IPC_FIX_*`` environment variable: name, default, parser.

Values are read when they are needed, so a launcher or a test can change them between
activations. An invalid value logs one WARNING and falls back to the default.
"""

import os

#: ``1``/``true``/``yes``/``on`` turns the package off; a comma list of fix names
#: (``clear_on_close,stale_guard``) turns off only those fixes. Default: everything on.
DISABLE = "NVRX_IPC_FIX_DISABLE"
#: ``debug``/``info``/``warning``/``error``: attach a stderr handler to the
#: ``nvrx_ipc_fix`` logger at that level. Default: no handler (a ``NullHandler`` only).
LOG_LEVEL = "NVRX_IPC_FIX_LOG_LEVEL"

_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"", "0", "false", "no", "off"}
_LEVELS = ("debug", "info", "warning", "error")
_handler = None


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
        from ._log import warn_once

        warn_once(("env", DISABLE, raw), "%s=%r names unknown fixes %s (known: %s, or 1 for "
                  "all); ignoring those", DISABLE, raw, sorted(unknown), ", ".join(known))
    return frozenset(names.intersection(known))


def configure_logging():
    """Honour ``NVRX_IPC_FIX_LOG_LEVEL`` with one stderr handler (idempotent)."""
    global _handler
    raw = os.environ.get(LOG_LEVEL, "").strip().lower()
    if not raw:
        return
    import logging

    from ._log import logger, warn_once

    if raw not in _LEVELS:
        warn_once(("env", LOG_LEVEL, raw), "%s=%r is not one of %s; ignoring it",
                  LOG_LEVEL, raw, ", ".join(_LEVELS))
        return
    if _handler is None:
        _handler = logging.StreamHandler()
        _handler.setFormatter(logging.Formatter(
            "nvrx_ipc_fix[%(process)d] %(levelname)s: %(message)s"))
        logger.addHandler(_handler)
    logger.setLevel(raw.upper())
