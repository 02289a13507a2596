"""Builds the ``Status`` that ``status()`` returns: each target's state and each fix's, from
the records ``lifecycle`` hands over under its lock, with the running totals (``cleanup``)
and what the worker and fixes packages report (``state.on_status``). The types are ``status``'."""

import os
import sys

from . import __version__
from . import cleanup as _cleanup, config as _config, detect as _detect, log as _log
from . import state as _state
from .fix_names import FIXES
from .losses import loss
from .status import LOST, PRECEDENCE, CallStatus, FixStatus, State, Status, TargetStatus
from .targets import CALLS, TARGETS


def build(active, source, requested, verdicts, patched, calls):
    """The snapshot, from ``lifecycle``'s records: whether it is active, the activation's
    source, every source that asked, each decided target's ``(state, reason, held)``, the
    targets whose step is in (``patched``) and the calls that have a wrapper of ours,
    switched on or off (``calls``)."""
    rows = [
        (
            t,
            *_target_state(t, active, source, verdicts, patched, calls),  # (target,
            verdicts[t][2] if t in verdicts else (),
        )
        for t in TARGETS
    ]  # state, reason, held)
    targets = tuple(TargetStatus(t.fix, t.name, state, reason) for t, state, reason, _ in rows)
    in_place = tuple(
        CallStatus(
            name,
            call.region,
            tuple(
                fix for fix in call.order if any(t.fix == fix and t.name == name for t in patched)
            ),
        )
        for name, call in CALLS.items()
        if name in calls
    )
    fixes = []
    for fix, summary in FIXES.items():
        mine = [r for r in rows if r[0].fix == fix]
        # an optional target adds only its loss: one still pending or patched beside required
        # targets that are decided otherwise (fixed upstream, say) does not hide their state
        required = [r for r in mine if not r[0].optional] or mine
        counted = required + [r for r in mine if r not in required and r[1] in LOST]
        _, state, reason, _ = min(counted, key=lambda r: PRECEDENCE.index(r[1]))
        fixes.append(FixStatus(fix, state, loss(mine) if state in LOST else reason, summary))
    wrapt = sys.modules.get("wrapt")
    return Status(
        version=__version__,
        activated=active,
        source=source,
        requested_by=tuple(requested),
        pid=os.getpid(),
        nvrx_version=_detect.distribution_version(_detect.NVRX_DIST),
        wrapt_version=getattr(wrapt, "__version__", None) or _detect.distribution_version("wrapt"),
        features=_detect.features(),
        fixes=tuple(fixes),
        targets=targets,
        calls=in_place,
        cleanups=_cleanup.totals.cleanups,
        keys_cleared=_cleanup.totals.keys_cleared,
        freed_bytes=_cleanup.totals.freed_bytes,
        releases=_cleanup.totals.releases,
        prewarms=_cleanup.totals.prewarms,
        prewarm_failures=_cleanup.totals.prewarm_failures,
        pinned_bytes=_cleanup.totals.pinned_bytes,
        **{field: describe() for field, describe in _state.reports.items()},
        untested=_detect.untested_versions(),
    )


def _target_state(target, active, source, verdicts, patched, calls):
    failed = _log.errors.get(f"{target.fix} {target.name}") or _log.errors.get(target.name)
    if failed and target in patched:  # only a step fails
        return State.ERROR, f"hook failed: {failed}"
    if not active:
        if _config.disabled_fixes(tuple(FIXES)) is None:
            return State.DISABLED, _config.off_reason()
        if target.name in calls:
            return State.DISABLED, "deactivated; wrapper left inert under another wrapper"
        return State.DISABLED, "deactivated" if source else "not activated"
    if target in verdicts:
        state, reason, _ = verdicts[target]
        return State(state), reason
    if target.fix in (_config.disabled_fixes(tuple(FIXES)) or ()):
        return State.DISABLED, f"{_config.DISABLE} names {target.fix}"
    known = target.applies(None)
    if known is not None and known[0] != "active":
        return State(known[0]), known[1]
    dist = _detect.distribution_of(target.module)
    if dist is not None and not _detect.distribution_version(dist):
        return State.NOT_APPLICABLE, f"{dist} is not installed"
    return State.PENDING, f"waiting for `import {target.module}`"
