"""Activation lifecycle: post-import hooks, patch, unpatch, and the status snapshot.

One lock guards the state. A hook is registered once per module per process and checks
``_active`` when it fires, so ``deactivate()`` before the import really stops the patch
and repeated cycles never stack wrappers. On ``deactivate()`` a wrapper that someone
else wrapped on top of is not torn out of their chain: it is switched off through
wrapt's ``enabled`` callable, and switched on again by the next ``activate()``.

Activation imports only ``os``, ``sys`` and ``_thread``; wrapt, ``inspect`` and
``logging`` are imported when a target module is imported (torch is loaded by then).
"""

import os
import sys
from _thread import RLock

from . import config as _config, hooks as _hooks
from .targets import FIXES, TARGETS

_lock = RLock()
_active = False
_source = None  # how the current activation happened: Status.source
_requested = []  # every source that asked for activation in this process: Status.requested_by
_hooked = set()  # modules with a registered hook
_verdicts = {}  # Target -> (state, reason), decided when its module was imported
_patches = {}  # Target -> _Patch


class _Patch:
    """One installed wrapper and what it replaced."""

    __slots__ = ("owner", "name", "original", "wrapper", "enabled", "aliases")

    def __init__(self, owner, name, original):
        self.owner = owner  # the class or module that holds the attribute
        self.name = name
        self.original = original  # the raw attribute from owner.__dict__
        self.wrapper = None
        self.enabled = True
        self.aliases = []  # [(module, name)] bound by `from X import f`, redirected by us

    def is_enabled(self):
        return self.enabled


def activate():
    """Patch every target already imported and hook the others. Idempotent.

    Returns ``status()``. Does nothing when ``NVRX_IPC_FIX_DISABLE=1``.
    """
    enable("explicit")
    return status()


def enable(source, claim=False):
    """``activate()`` without building a status (the import path stays cheap).

    The first source that finds the package off is the activation's ``source``; later ones
    are only recorded. ``claim``: the caller's own ``import nvrx_ipc_fix`` just ran, so the
    activation that import made is recorded as the caller's.
    """
    global _active, _source
    with _lock:
        if claim and _requested == ["import"]:  # that import was the caller's
            _requested.clear()
            if _source == "import":
                _source = source
        if source not in _requested:
            _requested.append(source)
        _config.configure_logging()
        if _config.disabled_fixes(tuple(FIXES)) is not None and not _active:
            _active, _source = True, source
            for module_name in dict.fromkeys(t.module for t in TARGETS):
                if module_name not in _hooked:
                    _hooked.add(module_name)
                    _hooks.when_imported(module_name, _on_import)  # runs now if imported
                elif module_name in sys.modules:
                    _hooks.now_or_when_ready(sys.modules[module_name], _on_import)


def deactivate():
    """Put back every original we wrapped and stop prewarmed workers no save has used.
    Idempotent. Returns ``status()``."""
    global _active
    prewarm = sys.modules.get("nvrx_ipc_fix.fixes.prewarm")
    if prewarm is not None:
        prewarm.stop_unused()
    with _lock:
        _active = False
        for target, patch in reversed(list(_patches.items())):  # the outermost first
            if vars(patch.owner).get(patch.name) is patch.wrapper:
                setattr(patch.owner, patch.name, patch.original)
                for module, alias in patch.aliases:
                    if vars(module).get(alias) is patch.wrapper:
                        setattr(module, alias, patch.original)
                del _patches[target]
            else:
                patch.enabled = False
        _verdicts.clear()
    return status()


def installed(fix, attr):
    """Is ``fix``'s wrapper of ``attr`` in place and switched on in this process?"""
    with _lock:
        return _active and any(t.fix == fix and t.attr == attr and p.enabled
                               for t, p in _patches.items())


def _on_import(module):
    with _lock:
        if _active:
            for target in TARGETS:
                if target.module == module.__name__:
                    _patch(target, module)


def _patch(target, module):
    """Decide and, if the fix applies, install. Any failure leaves the original in place."""
    if target.fix in (_config.disabled_fixes(tuple(FIXES)) or ()):
        _verdicts[target] = ("disabled", f"{_config.DISABLE} names {target.fix}")
        return
    inert = _patches.get(target)
    if inert is not None:
        inert.enabled = True
        _verdicts[target] = ("active", "patched (re-enabled under another wrapper)")
        return
    try:
        state, reason = target.applies(module)
        if state == "active":
            owner, name, original = _resolve(module, target.attr)
            problem = _shape_problem(original, target.params)
            if problem:
                state, reason = "unsupported", f"{target.attr}: {problem}"
            else:
                _install(target, owner, name, original)
                from .log import logger

                logger.info("patched %s: %s", target.name, reason)
        _verdicts[target] = (state, reason)
    except Exception as exc:
        from .log import warn_once

        _verdicts[target] = ("error", f"{type(exc).__name__}: {exc}")
        warn_once(("patch", target.name), "nvrx_ipc_fix: %s left unpatched: %s: %s",
                  target.name, type(exc).__name__, exc)


def _resolve(module, attr):
    owner = module
    *parents, name = attr.split(".")
    for part in parents:
        owner = getattr(owner, part, None)
    return owner, name, None if owner is None else vars(owner).get(name)


def _shape_problem(original, params):
    import inspect

    if original is None:
        return "not found"
    function = original.__func__ if isinstance(original, staticmethod) else original
    if not inspect.isfunction(function):
        return f"expected a plain function, found {type(original).__name__}"
    found = tuple(inspect.signature(function).parameters)[: len(params)]
    if found != params:
        return f"its parameters {found} are not the expected {params}"
    return None


def _install(target, owner, name, original):
    import importlib

    import wrapt

    module_name, function = target.wrapper.split(":")
    wrapper = getattr(importlib.import_module(f"nvrx_ipc_fix.{module_name}"), function)
    patch = _Patch(owner, name, original)
    patch.wrapper = wrapt.FunctionWrapper(original, wrapper, patch.is_enabled)
    setattr(owner, name, patch.wrapper)
    if target.aliases:
        patch.aliases = _redirect_aliases(original, patch.wrapper, skip=owner)
    _patches[target] = patch


def _redirect_aliases(original, wrapper, skip):
    """Point names bound by ``from X import f`` before the patch at the wrapper."""
    redirected = []
    for module in list(sys.modules.values()):
        try:
            names = [k for k, v in vars(module).items() if v is original]
        except TypeError:  # not a module (some packages put other objects in sys.modules)
            continue
        for alias in names:
            if module is not skip:
                setattr(module, alias, wrapper)
                redirected.append((module, alias))
    return redirected


def status():
    """A ``Status`` snapshot of this process. Imports nothing that is not imported yet."""
    from .. import __version__
    from . import cleanup as _cleanup, detect as _detect
    from .status import PRECEDENCE, FixStatus, State, Status, TargetStatus

    with _lock:
        targets = tuple(TargetStatus(t.fix, t.name, *_target_state(t, State)) for t in TARGETS)
        fixes = []
        for fix, summary in FIXES.items():
            mine = [t for t in targets if t.fix == fix]
            first = min(mine, key=lambda t: PRECEDENCE.index(t.state))
            fixes.append(FixStatus(fix, first.state, first.reason, summary))
        wrapt = sys.modules.get("wrapt")
        return Status(
            version=__version__,
            activated=_active,
            source=_source,
            requested_by=tuple(_requested),
            pid=os.getpid(),
            nvrx_version=_detect.distribution_version(_detect.NVRX_DIST),
            wrapt_version=getattr(wrapt, "__version__", None)
            or _detect.distribution_version("wrapt"),
            features=_detect.features(),
            fixes=tuple(fixes),
            targets=targets,
            cleanups=_cleanup.totals.cleanups,
            keys_cleared=_cleanup.totals.keys_cleared,
            freed_bytes=_cleanup.totals.freed_bytes,
            releases=_cleanup.totals.releases,
            prewarms=_cleanup.totals.prewarms,
            prewarm_failures=_cleanup.totals.prewarm_failures,
            pinned_bytes=_cleanup.totals.pinned_bytes,
        )


def _target_state(target, State):
    from . import detect as _detect
    from .log import errors

    if target.name in errors:
        return State.ERROR, f"hook failed: {errors[target.name]}"
    if not _active:
        if _config.disabled_fixes(tuple(FIXES)) is None:
            return State.DISABLED, _config.off_reason()
        if target in _patches:
            return State.DISABLED, "deactivated; wrapper left inert under another wrapper"
        return State.DISABLED, "deactivated" if _source else "not activated"
    if target in _verdicts:
        state, reason = _verdicts[target]
        return State(state), reason
    if target.fix in (_config.disabled_fixes(tuple(FIXES)) or ()):
        return State.DISABLED, f"{_config.DISABLE} names {target.fix}"
    known = target.applies(None)
    if known is not None and known[0] != "active":
        return State(known[0]), known[1]
    reason = f"waiting for `import {target.module}`"
    if target.module.startswith("nvidia_resiliency_ext.") and not _detect.distribution_version(
        _detect.NVRX_DIST
    ):
        reason += " (nvidia-resiliency-ext is not installed)"
    return State.PENDING, reason
