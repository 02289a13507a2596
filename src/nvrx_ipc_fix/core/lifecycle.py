"""Activation lifecycle: post-import hooks, which targets to patch, and the records of what
was done, which ``status()`` hands to ``snapshot``. A call's one wrapper and the steps in it
are ``patching``'s; the warnings given for a lost fix or an untested version are ``losses``'.

One lock guards the state. A hook is registered once per module per process and checks
``_active`` when it fires, so ``deactivate()`` before the import really stops the patch
and repeated cycles never stack wrappers. When a module is imported, every target of a fix
there is decided before any is installed: a fix goes in all or nothing per module (a
target marked ``optional`` excepted), and a fix that does not apply although it should gets
one ``RuntimeWarning``, as is an NVRx or megatron-core newer than tested. On
``deactivate()`` a call's wrapper that someone else wrapped on top of stays in their chain,
switched off and recorded, and takes the steps again at the next ``activate()``.

Activation imports only ``os``, ``sys`` and ``_thread``; ``patching``, ``losses``, wrapt,
``inspect`` and ``logging`` are imported when a target module is imported (torch is loaded
by then). A child made by ``os.fork()`` gets a fresh lock; once NVRx's or megatron-core's
checkpoint module is imported, it also detaches from the parent's workers (``inherited``).
"""

from __future__ import annotations

import importlib
import sys
from _thread import RLock

from . import config as _config, fork as _fork, hooks as _hooks, state as _state
from .fix_names import FIXES
from .targets import ALWAYS, TARGETS

TYPE_CHECKING = False  # typing.TYPE_CHECKING, without importing typing
if TYPE_CHECKING:
    from .patching import Patch
    from .status import Status
    from .targets import Target

_lock = _fork.renewed(RLock())
_active = False
_source = None  # how the current activation happened: Status.source
#: every source that asked for activation in this process: Status.requested_by
_requested: list[str] = []
_hooked: set[str] = set()  # modules with a registered hook
#: Target -> (state, reason, held), decided when its module was imported; ``held``: the
#: targets of its fix whose loss left this one unpatched (all or nothing), else ()
_verdicts: dict[Target, tuple[str, str, tuple[Target, ...]]] = {}
#: distributions (detect.TESTED) one of whose target modules was imported
_seen_dists: set[str] = set()
_patches: dict[Target, Patch] = {}  # Target -> the patching.Patch of its call, while its step is in
#: call name -> patching.Patch: every wrapper of ours in place, switched on or off
_calls: dict[str, Patch] = {}


def activate() -> Status:
    """Patch every target already imported; patch the rest when they are imported.
    Idempotent.

    Returns ``status()``. Does nothing when ``NVRX_IPC_FIX_DISABLE=1``.
    """
    enable("explicit")
    return status()


def enable(source: str, claim: bool = False) -> None:
    """``activate()`` without building a status (the import path stays cheap).

    The first source that finds the package off is the activation's ``source``; later ones
    are only recorded. ``claim``: the caller's own ``import nvrx_ipc_fix`` just ran, so the
    activation that import made is recorded as the caller's.
    """
    global _active, _source
    level = _config.log_level()
    if level is not None:  # imported before the lock: nothing is imported under it
        from .log import configure

        configure(level)
    off = _config.disabled_fixes(tuple(FIXES)) is None  # may warn: before the lock too
    with _lock:
        if claim and _requested == ["import"]:  # that import was the caller's
            _requested.clear()
            if _source == "import":
                _source = source
        if source not in _requested:
            _requested.append(source)
        if off or _active:
            return
        _active, _source = True, source
        hook, now = [], []
        for module_name in dict.fromkeys(t.module for t in TARGETS):
            if module_name not in _hooked:
                _hooked.add(module_name)
                hook.append(module_name)
            elif module_name in sys.modules:
                now.append(sys.modules[module_name])
    # outside the lock, as wrapt's hooks: each may import (and run now if imported)
    for module_name in hook:
        _hooks.when_imported(module_name, _on_import)
    for module in now:
        _hooks.now_or_when_ready(module, _on_import)


def deactivate() -> Status:
    """Resume suspended workers, put back every original we wrapped and stop prewarmed workers
    no save has used. Idempotent. Returns ``status()``."""
    global _active
    for stop in list(_state.deactivations):  # registered by the worker's modules
        stop()
    with _lock:
        _active = False
        for target in list(_patches):
            _remove(target)
        _verdicts.clear()
    return status()


def _remove(target):
    """Take ``target``'s step out; a call's wrapper with no step left goes, or, left under
    another wrapper, switched off, stays recorded."""
    from .patching import remove

    if remove(_patches.pop(target), target):
        del _calls[target.name]


def installed(fix, attr):
    """Is ``fix``'s wrapper of ``attr`` in place and switched on in this process?"""
    with _lock:
        return _active and any(t.fix == fix and t.attr == attr for t in _patches)


def _activated():
    return _active


_state.installed, _state.activated = installed, _activated  # asked by modules below


def _on_import(module):
    """Decide every target in ``module``, install what applies, then warn. What may import
    (the checks, wrapt, the fix modules, the distribution's version) runs before ``_lock``
    is taken: an import under it could wait on another thread's import whose hook waits on
    the lock (wrapt runs its hooks outside its lock for the same reason)."""
    if not _active:
        return
    for name in ALWAYS.get(module.__name__, ()):
        importlib.import_module(f"nvrx_ipc_fix.{name}")
    from . import log as _log, losses as _losses  # before the lock: used under it
    from .patching import step_of

    mine = [t for t in TARGETS if t.module == module.__name__]
    decided = _all_or_nothing({t: _decide(t, module) for t in mine})
    steps = {
        t: step_of(t)
        for t, (state, *_) in decided.items()
        if state == "active" and t not in _patches
    }
    found = _losses.distribution(module.__name__, _seen_dists)
    with _lock:
        if not _active:  # deactivated meanwhile
            return
        _install_decided(decided, module, steps)
        notices = _losses.lost(mine, _verdicts)
        if found and found[0] not in _seen_dists:  # warned about at its first target module
            _seen_dists.add(found[0])
            notices += _losses.untested(found, _verdicts)
    if notices:
        from .log import logger

        for message, keys in notices:
            if _log.warn(message, *keys):
                logger.warning("%s", message)


def _decide(target, module):
    """``(state, reason, held)`` of one target, as in ``_verdicts``; never raises."""
    if target.fix in (_config.disabled_fixes(tuple(FIXES)) or ()):
        return "disabled", f"{_config.DISABLE} names {target.fix}", ()
    if target in _patches:
        return "active", "patched", ()
    from .patching import problem as shape_problem

    try:
        state, reason = target.applies(module)
        if state == "active":
            patch = _calls.get(target.name)  # our wrapper is there: check what it replaced
            problem = shape_problem(target, module, patch and patch.original)
            if problem:
                return "unsupported", problem, ()
        return state, reason, ()
    except Exception as exc:  # noqa: BLE001 a probe's failure is the target's state: error
        return "error", f"{type(exc).__name__}: {exc}", ()


def _all_or_nothing(decided):
    """Hold back every target of a fix in this module when one it requires is lost."""
    from .losses import held_reason
    from .status import LOST

    lost = {}
    for target, (state, *_) in decided.items():
        if state in LOST and not target.optional:
            lost.setdefault(target.fix, []).append(target)
    for target, (state, *_) in decided.items():
        causes = lost.get(target.fix)
        if causes and state == "active":
            decided[target] = (decided[causes[0]][0], held_reason(target, causes), tuple(causes))
    return decided


def _install_decided(decided, module, steps):
    """Add each step that applies to its call's wrapper (the call's order is the table's,
    whatever the order they come in), and record each verdict. ``steps``: target -> its step
    function, or the exception that getting it raised. A required target whose install
    raises takes its fix's others here out again."""
    from .losses import held_reason
    from .patching import install

    failed, done = {}, []
    for target, (state, reason, held) in decided.items():
        if state == "active" and target.fix in failed:
            causes = (failed[target.fix],)
            state, reason, held = "error", held_reason(target, causes), causes
        elif state == "active":
            try:
                if target not in _patches:
                    patch = _calls[target.name] = install(
                        target, steps[target], module, _calls.get(target.name)
                    )
                    _patches[target] = patch
                    if vars(patch.owner).get(patch.name) is not patch.wrapper:
                        reason = f"{reason} (re-enabled under another wrapper)"
                done.append(target)
                from .log import logger

                logger.info("patched %s (%s): %s", target.name, target.fix, reason)
            except Exception as exc:  # noqa: BLE001 the package's defect: NVRx's own
                state, reason = "error", f"{type(exc).__name__}: {exc}"
                if not target.optional:
                    failed[target.fix] = target
                    for other in reversed([t for t in done if t.fix == target.fix]):
                        _remove(other)
                        _verdicts[other] = ("error", held_reason(other, (target,)), (target,))
        _verdicts[target] = (state, reason, held)


def status() -> Status:
    """A ``Status`` snapshot of this process (``snapshot``). Imports nothing that is not
    imported yet."""
    from .snapshot import build

    with _lock:
        return build(_active, _source, _requested, _verdicts, _patches, _calls)
