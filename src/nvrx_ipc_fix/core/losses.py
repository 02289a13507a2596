"""The warnings given when a fix does not apply where it should, and when NVRx or megatron-core is
newer than tested. A fix goes in all or nothing per module: a target not installed because
another target of its fix does not apply gives that reason (``held_reason``). ``lifecycle``
warns with these texts once each; the status shows a lost fix's text as its reason
(``loss``)."""

from . import detect as _detect
from .status import LOST
from .targets import TARGETS


def held_reason(target, causes):
    """Why ``target`` is not patched: ``causes``, targets of its fix, are lost here."""
    return (
        f"not patched: {target.fix} goes in all or nothing, and "
        f"{', '.join(c.attr for c in causes)} cannot be patched here"
    )


def lost(mine, verdicts):
    """``(message, keys)`` of the warning for each fix that lost a target of ``mine``.
    ``verdicts``: target -> ``(state, reason, held)``, as ``lifecycle`` records them."""
    notices = []
    for fix in dict.fromkeys(t.fix for t in mine):
        rows = [(t, *verdicts[t]) for t in mine if t.fix == fix]
        keys = [("target", fix, t.name) for t, state, *_ in rows if state in LOST]
        if keys:
            how = (
                "applies only in part"
                if any(state == "active" for _, state, *_ in rows)
                else "does not apply"
            )
            notices.append(
                (
                    f"nvrx_ipc_fix: {fix} {how}: {loss(rows)}. NVRx runs as without "
                    f"it where it is not patched; `python -m nvrx_ipc_fix` shows the "
                    f"full state",
                    keys,
                )
            )
    return notices


def loss(rows):
    """What a fix lost, by module, and what of it still runs. ``rows``: ``(target, state,
    reason, held)``, ``held``: the targets whose loss held this one back, else ()."""
    lost, parts = [r for r in rows if r[1] in LOST], []
    for module in dict.fromkeys(t.module for t, *_ in lost):
        why, held = {}, []
        for target, state, reason, by in (r for r in lost if r[0].module == module):
            if by:
                held.append(target.attr)
            else:
                why.setdefault((state, reason), []).append(target.attr)
        text = "; ".join(_said(attrs, *verdict) for verdict, attrs in why.items())
        parts.append(
            f"in {module}, {text}" + (f", so not patched either: {', '.join(held)}" if held else "")
        )
    active = [t.name for t, state, *_ in rows if state == "active"]
    return "; ".join(parts + ([f"still active: {', '.join(active)}"] if active else []))


def _said(attrs, state, reason):
    verb = "failed" if state == "error" else ("is " if len(attrs) == 1 else "are ") + state
    return f"{', '.join(attrs)} {verb} ({reason})"


def distribution(module_name, seen):
    """``(distribution, version, untested)`` of what ships ``module_name`` (its metadata and
    ``packaging`` are imported to tell), or None for a module of no tested distribution or
    of one in ``seen``."""
    dist = _detect.shipped_by(module_name)
    if dist is None or dist in seen:
        return None
    version = _detect.distribution_version(dist)
    return dist, version, _detect.untested(dist, version)


def untested(found, verdicts):
    """The notice for a distribution newer than tested (``found``: from ``distribution``),
    naming the fixes active in it so far; [] for a tested one."""
    dist, version, newer = found
    if not newer:
        return []
    active = dict.fromkeys(
        t.fix
        for t in TARGETS
        if _detect.shipped_by(t.module) == dist and verdicts.get(t, ("",))[0] == "active"
    )
    return [
        (
            f"nvrx_ipc_fix: {dist} {version} is untested (newest tested: "
            f"{_detect.TESTED[dist]}); the fixes apply where their checks of its code pass "
            f"(active so far: {', '.join(active) or 'none'}); `python -m nvrx_ipc_fix` shows "
            f"the full state",
            [("untested", dist)],
        )
    ]
