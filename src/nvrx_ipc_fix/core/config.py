"""Every ``NVRX_IPC_FIX_*`` environment variable: name, default, parser.

Values are read when they are needed, so a launcher or a test can change them between
activations. Case and surrounding blanks do not matter, and an empty or blank value is the
same as unset: the default. An invalid value gives one ``RuntimeWarning`` (shown on stderr by
default, unlike our logger) and the default, except for the two switches, where a value that
is not understood turns the thing off.
A warning about a value read during start-up activation (which every process of the
environment runs) waits until a module the package patches is imported, and is dropped in
processes that never import one. ``SETTINGS`` lists every variable with its parser, which
reports a value it does not understand without warning: ``python -m nvrx_ipc_fix doctor``
checks each, and turns these warnings off (``log.quiet()``). Any other variable named
``NVRX_IPC_FIX_*`` (in any case) is warned about at activation, naming the nearest name
the package reads (``unknown``); one within a typo of the kill switch's turns the package off.
"""

import os

#: ``1``/``true``/``yes``/``on`` turns the package off; a comma list of fix names
#: (``clear_on_close,stale_guard``) turns off only those fixes. Any other value turns the
#: whole package off too (with a warning): a kill switch errs on the side of off. An empty
#: item (``,``, ``stale_guard,,``) names no fix, so is not understood either.
DISABLE = "NVRX_IPC_FIX_DISABLE"
#: ``0``/``false``/``no``/``off`` turns start-up activation (the ``.pth`` file, the
#: sitecustomize fallback) off; ``import nvrx_ipc_fix``, ``activate()`` and the Ray hook still
#: activate. Default: on. A value that is not understood turns it off as well. Read before
#: the package is imported, by ``_nvrx_ipc_fix_startup``.
AUTO = "NVRX_IPC_FIX_AUTO"
#: ``debug``/``info``/``warning``/``error``: attach a stderr handler to the
#: ``nvrx_ipc_fix`` logger at that level. Default: no handler (a ``NullHandler`` only).
LOG_LEVEL = "NVRX_IPC_FIX_LOG_LEVEL"

#: ``flush`` (keep the worker), ``terminate``, ``restart`` (terminate now, start the next
#: worker when the model is back) or ``suspend`` (keep the worker with nothing of it on the
#: device, resume it when the model is back): what ``release()`` and ``offloading()`` do by
#: default (unset: ``flush``) and what the automatic release does (unset: ``suspend`` where
#: the CUDA driver can, else ``restart``).
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
#: ``on`` (default; also ``1``, ``true``, ``yes``): the ``restart`` release starts the standby,
#: a process with torch and NVRx imported and no CUDA, from which the next worker is forked
#: at the onload (``worker.standby``). ``off`` (also ``0``, ``false``, ``no``, ``never``,
#: ``none``): NVRx spawns each worker, which imports torch and NVRx itself.
STANDBY = "NVRX_IPC_FIX_STANDBY"
#: ``on`` (default; also ``1``, ``true``, ``yes``): ``cpu_snapshot`` keeps the shared memory
#: it copied a save's CPU tensors into for the worker's next save of the same tensors.
#: ``off`` (also ``0``, ``false``, ``no``, ``never``, ``none``): each save copies into new
#: shared memory, freed once the worker is done with it.
SNAPSHOT_KEEP = "NVRX_IPC_FIX_SNAPSHOT_KEEP"

_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"", "0", "false", "no", "off"}
_LEVELS = ("debug", "info", "warning", "error", "critical")
_held_hooked = False  # log.show_held is registered on the target modules


def _invalid(name, raw, why):
    """Say that ``name``'s value is not understood (``log.setting_problem``: now, or held
    until a target module is imported, then ``log.show_held``)."""
    global _held_hooked
    from . import log

    if (
        log.setting_problem((name, raw), f"nvrx_ipc_fix: {name}={raw!r} {why}", name)
        and not _held_hooked
    ):
        _held_hooked = True
        from . import hooks
        from .detect import MODULES

        for module in MODULES:
            hooks.when_imported(module, log.show_held)


def _raw(name):
    """The variable as set (stripped, lower case); ``""`` when unset."""
    return os.environ.get(name, "").strip().lower()


def _read(name, parse, *args):
    """``parse(raw, *args)``'s value; its problem, if any, is warned about once."""
    raw = _raw(name)
    value, problem = parse(raw, *args)
    if problem:
        _invalid(name, raw, problem)
    return value


# Each parser takes the stripped, lower-case value ("" when unset) and returns
# ``(value, problem)``: the value the package uses, and why the one set is not understood
# (``None`` when it is), naming what the package does instead.


def _parse_disable(raw, known=None):
    if known is None:
        from .fix_names import FIXES

        known = tuple(FIXES)
    if raw in _FALSE:
        return frozenset(), None
    if raw in _TRUE:
        return None, None
    names = [part.strip() for part in raw.split(",")]
    unknown = sorted(set(names).difference(known))  # "": an empty item, as in ","
    if unknown:
        return None, (
            f"is not understood (unknown: "
            f"{', '.join(name or 'an empty item' for name in unknown)}; use 1, or a "
            f"comma list of {', '.join(known)}); the whole package is off"
        )
    return frozenset(names), None


def _parse_auto(raw):
    if raw in _TRUE or not raw:
        return True, None
    return False, (None if raw in _FALSE else "is not 0 or 1; start-up activation is off")


def _parse_log_level(raw):
    if raw and raw not in _LEVELS:
        return None, f"is not one of {', '.join(_LEVELS)}; ignoring it (no log handler)"
    return raw or None, None


def _parse_strategy(raw):
    """``None`` when unset or not understood: each reader has its own default."""
    if raw and raw not in STRATEGIES:
        return None, (
            f"is not one of {', '.join(STRATEGIES)}; using the default (flush for "
            f"release(), suspend for the automatic release)"
        )
    return raw or None, None


def _parse_release(raw):
    if raw in _FALSE - {""} | {"none"}:
        return "never", None
    if raw and raw not in ("offload", "finalize", "never"):
        return "offload", "is not one of offload, finalize, never; using offload"
    return raw or "offload", None


def _parse_seconds(raw, default, allow_zero=False):
    """Seconds, or infinity where the value says so (``inf``, ``infinity``): a number too
    large for a float (``1e400``) is not taken for it."""
    if not raw:
        return default, None
    try:
        value = seconds(float(raw), "", allow_zero)
    except ValueError:
        return default, (
            f"is not a number of seconds {'>= 0' if allow_zero else '> 0'} "
            f"(or inf); using {default:g}"
        )
    if value == float("inf") and "inf" not in raw:
        return default, f"is too large for a number of seconds (inf: no limit); using {default:g}"
    return value, None


def _parse_release_timeout(raw):
    return _parse_seconds(raw, 60.0)


def _parse_stall_timeout(raw):
    value, problem = _parse_seconds(raw, 300.0, allow_zero=True)
    return (float("inf") if value == 0 else value), problem


def _parse_on(raw):
    if raw in _TRUE or not raw:
        return True, None
    if raw in _FALSE | {"never", "none"}:
        return False, None
    return True, "is not on or off; using on"


def _parse_prewarm(raw):
    if raw in _TRUE or raw == "start":
        return True, None
    return False, (None if raw in _FALSE | {"never", "none"} else "is not start or off; using off")


def _show_seconds(value):
    return "no limit" if value == float("inf") else f"{value:g} s"


class Setting:
    """One ``NVRX_IPC_FIX_*`` variable: its name, its parser and how its value reads."""

    __slots__ = ("name", "parse", "show")

    def __init__(self, name, parse, show):
        self.name, self.parse, self.show = name, parse, show

    def check(self):
        """``(raw as set or None, value, problem or None)``; warns about nothing."""
        raw = os.environ.get(self.name)
        return (raw, *self.parse(_raw(self.name)))


STRATEGIES = ("flush", "terminate", "restart", "suspend")
#: Every variable the package reads (a test checks that none is missing); doctor checks each.
SETTINGS = (
    Setting(
        DISABLE,
        _parse_disable,
        lambda v: (
            "the package is off"
            if v is None
            else (f"{', '.join(sorted(v))} off" if v else "every fix on")
        ),
    ),
    Setting(AUTO, _parse_auto, lambda v: "start-up activation " + ("on" if v else "off")),
    Setting(
        LOG_LEVEL,
        _parse_log_level,
        lambda v: f"a stderr handler at {v}" if v else "no log handler (NullHandler)",
    ),
    Setting(
        STRATEGY,
        _parse_strategy,
        lambda v: (
            v
            or "flush for release(), suspend for "
            "the automatic release (restart where the CUDA driver cannot suspend)"
        ),
    ),
    Setting(RELEASE, _parse_release, lambda v: f"release automatically: {v}"),
    Setting(
        RELEASE_TIMEOUT,
        _parse_release_timeout,
        lambda v: f"release() waits for the worker: {_show_seconds(v)}",
    ),
    Setting(
        STALL_TIMEOUT,
        _parse_stall_timeout,
        lambda v: "stall report: " + ("never" if v == float("inf") else f"after {v:g} s"),
    ),
    Setting(
        PREWARM,
        _parse_prewarm,
        lambda v: (
            "a persistent queue starts its worker when created"
            if v
            else "off: the worker starts at the first save (or prewarm())"
        ),
    ),
    Setting(
        PIN,
        _parse_on,
        lambda v: (
            "on: a prewarmed worker pins the last save's host memory ahead"
            if v
            else "off: a prewarmed worker's first save pins host memory"
        ),
    ),
    Setting(
        STANDBY,
        _parse_on,
        lambda v: (
            "on: restart's next worker is forked from a standby with torch and NVRx imported"
            if v
            else "off: NVRx spawns each worker"
        ),
    ),
    Setting(
        SNAPSHOT_KEEP,
        _parse_on,
        lambda v: (
            "on: a save's CPU copies are kept for the next save"
            if v
            else "off: each save copies its CPU tensors into new shared memory"
        ),
    ),
)


PREFIX = "NVRX_IPC_FIX_"
_NAMES = frozenset(setting.name for setting in SETTINGS)


def unknown():
    """``(name, off, problem)`` of each variable set whose name starts with ``NVRX_IPC_FIX_``
    in any case but is none the package reads: ``problem`` names the nearest one it reads.
    ``off``: the name is within a typo of the kill switch's (``..._DISABLED``, a
    lower-case one) and its value is no false one, so the package is off: a kill switch
    errs on the side of off. ``difflib`` is imported only when there is such a name."""
    names = sorted(n for n in os.environ if n.upper().startswith(PREFIX) and n not in _NAMES)
    if not names:
        return []
    from difflib import get_close_matches

    tails = {name[len(PREFIX) :]: name for name in sorted(_NAMES)}
    found = []
    for name in names:
        tail = name[len(PREFIX) :].upper()
        near = [f"did you mean {tails[t]}?" for t in get_close_matches(tail, tails, 1)]
        off = _raw(name) not in _FALSE and get_close_matches(tail, [DISABLE[len(PREFIX) :]], 1, 0.8)
        why = "taken for the kill switch, the whole package is off" if off else "ignored"
        near = near[0] if near else f"it reads {', '.join(tails.values())}"
        found.append((name, bool(off), f"is not a variable nvrx_ipc_fix reads ({near}): {why}"))
    return found


def disabled_fixes(known):
    """The fixes the environment turns off, as a frozenset; ``None`` when the package is off.
    Warns about each variable of ``unknown()`` (once per value)."""
    fixes = _read(DISABLE, _parse_disable, known)
    for name, off, problem in unknown():
        _invalid(name, _raw(name), problem)
        fixes = None if off else fixes
    return fixes


def off_reason():
    """Why ``disabled_fixes()`` turned the whole package off, naming the value as it is set."""
    raw = os.environ.get(DISABLE, "")
    if raw.strip().lower() in _TRUE:
        return f"{DISABLE}={raw.strip()}"
    if _parse_disable(raw.strip().lower())[0] is not None:  # a near miss of its name did
        name, _, problem = next(found for found in unknown() if found[1])
        return f"{name}={os.environ[name]!r} {problem}"
    return f"{DISABLE}={raw!r}: not understood, so the whole package is off"


def auto():
    """Whether start-up activation is on (``NVRX_IPC_FIX_AUTO``)."""
    return _read(AUTO, _parse_auto)


def log_level():
    """``NVRX_IPC_FIX_LOG_LEVEL``: the level of the stderr handler, or ``None`` (no handler)."""
    return _read(LOG_LEVEL, _parse_log_level)


def strategy():
    """The default ``release()`` strategy."""
    return _read(STRATEGY, _parse_strategy) or "flush"


def auto_strategy():
    """The automatic release's strategy: ``NVRX_IPC_FIX_STRATEGY``, else ``suspend`` (which
    falls back to ``restart`` where the driver cannot: ``worker.suspend``)."""
    return _read(STRATEGY, _parse_strategy) or "suspend"


def release_policy():
    """When the package releases on its own: ``offload``, ``finalize`` or ``never``."""
    return _read(RELEASE, _parse_release)


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
    raise ValueError(f"{what} must be a number of seconds {bound} (inf: no limit), not {value!r}")


def release_timeout():
    """Seconds to wait for the worker during ``release()`` (infinity: no limit)."""
    return _read(RELEASE_TIMEOUT, _parse_release_timeout)


def stall_timeout():
    """Seconds of no progress before the stall ERROR; infinity when turned off."""
    return _read(STALL_TIMEOUT, _parse_stall_timeout)


def pin_ahead():
    """Does a prewarmed worker pin host memory for its first save (``NVRX_IPC_FIX_PIN``)?"""
    return _read(PIN, _parse_on)


def standby():
    """Is restart's next worker forked from the standby (``NVRX_IPC_FIX_STANDBY``)?"""
    return _read(STANDBY, _parse_on)


def snapshot_keep():
    """Does ``cpu_snapshot`` keep its copies for the next save (``NVRX_IPC_FIX_SNAPSHOT_KEEP``)?"""
    return _read(SNAPSHOT_KEEP, _parse_on)


def prewarm_at_start():
    """Does a persistent queue start its worker when it is created (``NVRX_IPC_FIX_PREWARM``)?"""
    return _read(PREWARM, _parse_prewarm)
