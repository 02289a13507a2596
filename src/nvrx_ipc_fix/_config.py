"""Every ``NVRX_IPC_FIX_*`` environment variable: name, default, parser.

Values are read when they are needed, so a launcher or a test can change them between
activations. Case and surrounding blanks do not matter. An invalid value gives one
``RuntimeWarning`` (shown on stderr by default, unlike our logger) and the default, except
for the two switches, where a value that is not understood turns the thing off.
"""

import os

#: ``1``/``true``/``yes``/``on`` turns the package off; a comma list of fix names
#: (``clear_on_close,stale_guard``) turns off only those fixes. Any other value turns the
#: whole package off too (with a warning): a kill switch errs on the side of off.
DISABLE = "NVRX_IPC_FIX_DISABLE"
#: ``0``/``false``/``no``/``off`` turns start-up activation (the ``.pth`` file, the
#: sitecustomize fallback) off; ``import nvrx_ipc_fix``, ``activate()`` and the Ray hook still
#: activate. Default: on. A value that is not understood turns it off as well. Read before
#: the package is imported, by ``_nvrx_ipc_fix_startup``.
AUTO = "NVRX_IPC_FIX_AUTO"
#: ``debug``/``info``/``warning``/``error``: attach a stderr handler to the
#: ``nvrx_ipc_fix`` logger at that level. Default: no handler (a ``NullHandler`` only).
LOG_LEVEL = "NVRX_IPC_FIX_LOG_LEVEL"

#: ``flush`` (keep the worker), ``terminate`` or ``restart`` (terminate now, start the next
#: worker when the model is back): what ``release()`` and ``offloading()`` do by default
#: (unset: ``flush``) and what the automatic release does (unset: ``restart``, whose onload
#: points start the next worker).
STRATEGY = "NVRX_IPC_FIX_STRATEGY"
#: Seconds ``release()`` waits for the worker before terminating it. Default 60; ``inf``:
#: no limit (a worker that dies still ends the wait).
RELEASE_TIMEOUT = "NVRX_IPC_FIX_RELEASE_TIMEOUT"
#: When to release automatically: ``offload`` (default: before the frameworks move model or
#: optimizer storage), ``finalize`` (also after every blocking ``maybe_finalize_async_save``),
#: ``never`` (also ``off``, ``0``, ``false``, ``no``, ``none``).
RELEASE = "NVRX_IPC_FIX_RELEASE"
#: Seconds a rank may wait on a live worker that makes no progress, or in NVRx's finalize
#: all-reduce, before the package logs an ERROR (and a WARNING once the wait ends).
#: Default 300; ``0`` or ``inf``: never.
STALL_TIMEOUT = "NVRX_IPC_FIX_STALL_TIMEOUT"
#: ``start`` (also ``1``, ``true``, ``yes``, ``on``): start each persistent queue's checkpoint
#: worker when the queue is created, if ``torch.distributed`` is initialized by then, so that
#: the first save finds it ready. Default ``off`` (also ``0``, ``false``, ``no``, ``never``,
#: ``none``).
PREWARM = "NVRX_IPC_FIX_PREWARM"
#: ``on`` (default; also ``1``, ``true``, ``yes``): a prewarmed worker pins, before it
#: reports ready, host memory of the byte sizes of the tensors the queue's last save sent,
#: so that its first save copies into pinned blocks as a kept worker does. ``off`` (also
#: ``0``, ``false``, ``no``, ``never``, ``none``): it pins nothing ahead.
PIN = "NVRX_IPC_FIX_PIN"

_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"", "0", "false", "no", "off"}
_LEVELS = ("debug", "info", "warning", "error", "critical")
_handler = None
_warned = set()


def _invalid(name, raw, why):
    if (name, raw) not in _warned:
        _warned.add((name, raw))
        import warnings

        warnings.warn(f"nvrx_ipc_fix: {name}={raw!r} {why}", RuntimeWarning,
                      stacklevel=_caller_level())


#: Packages whose frames a warning looks past: wrapt calls our hooks, and the code we patch
#: calls them on the user's behalf (a queue's ``__init__`` through NVRx's metaclass).
_PAST = ("wrapt", "nvidia_resiliency_ext", "megatron")


def _ours(filename):
    """Is ``filename`` this package, its start-up module, or one of ``_PAST``?"""
    import sys

    roots = [os.path.dirname(__file__)]
    for name in _PAST:
        roots += list(getattr(sys.modules.get(name), "__path__", None) or ())
    return (os.path.basename(filename).startswith("_nvrx_ipc_fix_startup.")
            or any(isinstance(root, str) and filename.startswith(os.path.join(root, ""))
                   for root in roots))


def _caller_level():
    """``warnings.warn``'s ``stacklevel`` for the first frame outside this package (and
    ``_PAST``), so that a warning names the user's line (``import nvrx_ipc_fix``,
    ``release()``, the call into NVRx), whichever of our functions read the setting. Counted as ``warnings`` counts: frames of
    importlib's bootstrap are skipped and not counted. 2 where the stack cannot be read."""
    import sys

    def internal(frame):
        name = frame.f_code.co_filename
        return "importlib" in name and "_bootstrap" in name

    try:
        frame, level = sys._getframe(2), 2  # 1: _invalid, which calls warnings.warn
        while frame is not None and _ours(frame.f_code.co_filename):
            frame = frame.f_back
            while frame is not None and internal(frame):
                frame = frame.f_back
            level += 1
        return level
    except Exception:  # no frames (another Python): the caller of the reader
        return 2


def disabled_fixes(known):
    """The fixes the environment turns off, as a frozenset; ``None`` when the package is off."""
    raw = os.environ.get(DISABLE, "").strip().lower()
    if raw in _FALSE:
        return frozenset()
    if raw in _TRUE:
        return None
    names = {part.strip() for part in raw.split(",") if part.strip()}
    unknown = sorted(names.difference(known))
    if unknown or not names:
        _invalid(DISABLE, raw, f"is not understood (unknown: {', '.join(unknown) or repr(raw)}; "
                 f"use 1, or a comma list of {', '.join(known)}); the whole package is off")
        return None
    return frozenset(names)


def off_reason():
    """Why ``disabled_fixes()`` turned the whole package off, naming the value as it is set."""
    raw = os.environ.get(DISABLE, "")
    if raw.strip().lower() in _TRUE:
        return f"{DISABLE}={raw.strip()}"
    return f"{DISABLE}={raw!r}: not understood, so the whole package is off"


def auto():
    """Whether start-up activation is on (``NVRX_IPC_FIX_AUTO``)."""
    raw = os.environ.get(AUTO, "").strip().lower()
    if raw in _TRUE or not raw:
        return True
    if raw not in _FALSE:
        _invalid(AUTO, raw, "is not 0 or 1; start-up activation is off")
    return False


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
    return _choice(STRATEGY, ("flush", "terminate", "restart"), "flush")


def auto_strategy():
    """The automatic release's strategy: ``NVRX_IPC_FIX_STRATEGY``, else ``restart``."""
    return _choice(STRATEGY, ("flush", "terminate", "restart"), "restart")


def release_policy():
    """When the package releases on its own: ``offload``, ``finalize`` or ``never``."""
    if os.environ.get(RELEASE, "").strip().lower() in _FALSE - {""} | {"none"}:
        return "never"
    return _choice(RELEASE, ("offload", "finalize", "never"), "offload")


def seconds(value, what, allow_zero=False):
    """``value`` as a number of seconds: a real number > 0 (>= 0 with ``allow_zero``), or
    infinity (no limit); anything else raises ``ValueError`` naming the allowed range."""
    import numbers

    if isinstance(value, numbers.Real) and not isinstance(value, bool):
        try:
            number = float(value)
        except OverflowError:  # an int too large for a float: no limit
            number = float("inf")
        if number > 0 or (allow_zero and number == 0):  # NaN fails both
            return number
    bound = ">= 0" if allow_zero else "> 0"
    raise ValueError(f"{what} must be a number of seconds {bound} (inf: no limit), "
                     f"not {value!r}")


def _seconds_env(name, default, allow_zero=False):
    raw = os.environ.get(name, "").strip()
    if not raw:
        return default
    try:
        return seconds(float(raw), name, allow_zero)
    except ValueError:
        _invalid(name, raw, f"is not a number of seconds {'>= 0' if allow_zero else '> 0'} "
                 f"(or inf); using {default:g}")
        return default


def release_timeout():
    """Seconds to wait for the worker during ``release()`` (infinity: no limit)."""
    return _seconds_env(RELEASE_TIMEOUT, 60.0)


def stall_timeout():
    """Seconds of no progress before the stall ERROR; infinity when turned off."""
    value = _seconds_env(STALL_TIMEOUT, 300.0, allow_zero=True)
    return float("inf") if value == 0 else value


def pin_ahead():
    """Does a prewarmed worker pin host memory for its first save (``NVRX_IPC_FIX_PIN``)?"""
    raw = os.environ.get(PIN, "").strip().lower()
    if raw in _TRUE or not raw:
        return True
    if raw not in _FALSE | {"never", "none"}:
        _invalid(PIN, raw, "is not on or off; using on")
    return False


def prewarm_at_start():
    """Does a persistent queue start its worker when it is created (``NVRX_IPC_FIX_PREWARM``)?"""
    raw = os.environ.get(PREWARM, "").strip().lower()
    if raw in _TRUE or raw == "start":
        return True
    if raw not in _FALSE | {"never", "none"}:
        _invalid(PREWARM, raw, "is not start or off; using off")
    return False
