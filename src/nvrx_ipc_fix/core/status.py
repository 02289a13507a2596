"""The frozen ``Status`` that ``status()`` returns, and its table form (built by ``snapshot``)."""

from __future__ import annotations

import dataclasses
import enum


#: ``Status.standby`` before any ``restart`` release (``worker.standby``).
STANDBY_NOT_STARTED = "not started: no restart release yet"
#: ``Status.snapshot`` before ``cpu_snapshot`` kept any copies (``fixes.cpu_snapshot``).
SNAPSHOT_NONE = "0.0 MiB of shared memory kept in 0 set(s) of copies"
#: ``Status.guardian`` before the first process to guard (``worker.guardian``).
GUARDIAN_NOT_STARTED = "not started: no process to guard yet"
#: The automatic release's strategy before the CUDA driver is probed (``worker.suspend``'s
#: ``automatic_release``), and ``Status.suspend`` before that module is imported.
SUSPEND_NOT_PROBED = (
    "suspend where the CUDA driver's process checkpoint API works, else "
    "restart (the driver is probed at the first suspend)"
)
#: ``Status.peers`` before the check (``worker.peers``).
PEERS_NOT_CHECKED = (
    "not checked yet: at a persistent worker's finalize all-reduce in a job of several ranks"
)


class State(str, enum.Enum):
    """The state of one fix or one patch target."""

    ACTIVE = "active"  # patched; the fix runs
    PENDING = "pending"  # waiting for the target module to be imported
    FIXED_UPSTREAM = "fixed_upstream"  # this NVRx already does it; nothing installed
    NOT_APPLICABLE = "not_applicable"  # this version cannot have the bug, or is not installed
    UNSUPPORTED = "unsupported"  # the code differs from what the fix expects; not patched
    DISABLED = "disabled"  # turned off (environment or deactivate())
    ERROR = "error"  # patching or a hook failed; the original runs

    def __str__(self) -> str:
        return self.value


#: Which state a fix shows when its targets differ (first match wins). A lost target
#: (``error``, ``unsupported``) comes before ``active``: a fix that is not all patched where
#: it applies is never shown as active.
PRECEDENCE = (
    State.ERROR,
    State.UNSUPPORTED,
    State.ACTIVE,
    State.PENDING,
    State.FIXED_UPSTREAM,
    State.NOT_APPLICABLE,
    State.DISABLED,
)
#: The states of a target that does not apply although it should: each is warned about.
LOST = (State.ERROR, State.UNSUPPORTED)


@dataclasses.dataclass(frozen=True)
class TargetStatus:
    fix: str
    target: str  # "module:Qualified.name"
    state: State
    reason: str


@dataclasses.dataclass(frozen=True)
class CallStatus:
    """One intercepted call with a wrapper of ours in place: the region it holds and the
    fixes whose steps run in it now, outermost first (``targets.CALLS``)."""

    call: str  # "module:Qualified.name"
    region: str | None
    steps: tuple[str, ...]


@dataclasses.dataclass(frozen=True)
class FixStatus:
    name: str
    state: State
    reason: str
    summary: str


@dataclasses.dataclass(frozen=True, repr=False)
class Status:
    """A snapshot of what the package did in this process. ``print()`` shows it as the
    table (``table()``); its ``repr`` is one line: the activation and each fix's state."""

    version: str
    activated: bool
    #: What activated the package: "pth" (the start-up file), "sitecustomize", "import",
    #: "ray-hook", "explicit" (activate()); None when never activated.
    source: str | None
    requested_by: tuple[str, ...]  # every source that asked for activation, in order
    pid: int
    nvrx_version: str | None
    wrapt_version: str | None
    features: dict
    fixes: tuple[FixStatus, ...]
    targets: tuple[TargetStatus, ...]
    cleanups: int
    keys_cleared: int
    freed_bytes: int
    releases: int
    prewarms: int  # checkpoint workers started ahead of the save that needs them
    prewarm_failures: int  # of those, workers that died or failed before their first save
    pinned_bytes: int = 0  # host memory the last prewarmed worker pinned ahead of its save
    #: The standby restart's workers are forked from (``worker.standby``): its state, why it is
    #: not used, how many workers it forked and how often it died.
    standby: str = STANDBY_NOT_STARTED
    #: The automatic release's strategy in force and why (``worker.suspend``), with the counts
    #: of suspends and resumes.
    suspend: str = SUSPEND_NOT_PROBED
    #: Each call with a wrapper of ours: its region and its steps in order.
    calls: tuple[CallStatus, ...] = ()
    #: Whether every rank of the job runs the package, checked at a persistent worker's
    #: finalize all-reduce (``worker.peers``): the ranks without it, or why it cannot be checked.
    peers: str = PEERS_NOT_CHECKED
    #: The guardian (``worker.guardian``): its pid and how many live processes it guards, which
    #: it kills with their descendants if this process dies first; or why none runs.
    guardian: str = GUARDIAN_NOT_STARTED
    #: The shared memory ``cpu_snapshot`` keeps for the next save (``fixes.cpu_snapshot``).
    snapshot: str = SNAPSHOT_NONE
    #: Distribution -> installed version, for each one newer than the newest version the
    #: package was tested with (``nvidia-resiliency-ext`` 0.7.0, ``megatron-core`` 0.19.2).
    untested: dict = dataclasses.field(default_factory=dict)

    def fix(self, name: str) -> FixStatus:
        """The status of fix ``name``."""
        return next(f for f in self.fixes if f.name == name)

    def to_dict(self) -> dict:
        """A JSON-ready dict (states as strings)."""
        return dataclasses.asdict(
            self,
            dict_factory=lambda pairs: {k: str(v) if isinstance(v, State) else v for k, v in pairs},
        )

    def __str__(self) -> str:
        return self.table()

    def __repr__(self) -> str:
        fixes = ", ".join(f"{f.name}={f.state.value}" for f in self.fixes)
        return (
            f"<Status nvrx-ipc-fix {self.version}: {self._how()}, pid {self.pid}; NVRx "
            f"{self.nvrx_version or 'not installed'}; {fixes}>"
        )

    def _how(self) -> str:
        if self.activated:
            how = f"activated ({self.source})"
            also = [s for s in self.requested_by if s != self.source]
            return how + (f" (also requested by {', '.join(also)})" if also else "")
        how = "not active"
        return how + (
            f" (requested by {', '.join(self.requested_by)})" if self.requested_by else ""
        )

    def table(self) -> str:
        """A short human-readable report (what ``print()`` shows), in lines of at most
        ``WIDTH`` characters but where one name is longer: the targets and calls under their
        module, a target's reason only where it is not its fix's."""
        nvrx = self.nvrx_version or "not installed"
        lines = [
            f"nvrx-ipc-fix {self.version}: {self._how()}, pid {self.pid}",
            f"NVRx {nvrx}, wrapt {self.wrapt_version or 'not installed'}",
            "",
            "fixes:",
        ]
        width = max(len(f.name) for f in self.fixes)
        for f in self.fixes:
            lines += _wrapped(f"  {f.name:<{width}}  {f.state.value:<14}  ", f.reason)
        lines += ["", "targets, by module (a reason where it is not the fix's):"]
        reasons = {f.name: f.reason for f in self.fixes}
        width = max(len(t.fix) for t in self.targets)
        for module, targets in _by_module(self.targets, lambda t: t.target):
            lines.append(f"  {module}")
            for t, attr in targets:
                lines.append(f"    {t.fix:<{width}}  {t.state.value:<14}  {attr}")
                if t.reason != reasons.get(t.fix):
                    lines += _wrapped(" " * 6, t.reason)
        if self.calls:
            lines += ["", "calls, by module (the steps in each, outermost first):"]
            for module, calls in _by_module(self.calls, lambda c: c.call):
                lines.append(f"  {module}")
                width = max(len(attr) for _, attr in calls)
                for c, attr in calls:
                    region = f" [{c.region}]" if c.region else ""
                    lines += _wrapped(
                        f"    {attr:<{width}}  ",
                        f"{' > '.join(c.steps) or '(switched off)'}{region}",
                    )
        lines += ["", "NVRx features:"]
        lines += [f"  {name}: {value}" for name, value in self.features.items()]
        lines += [""]
        lines += _wrapped(
            "",
            f"cleanups: {self.cleanups} ({self.keys_cleared} cache keys, "
            f"{self.freed_bytes / (1 << 30):.2f} GiB freed); releases: "
            f"{self.releases}; prewarms: {self.prewarms} "
            f"({self.prewarm_failures} failed; "
            f"{self.pinned_bytes / (1 << 30):.2f} GiB of host memory pinned "
            "ahead by the last)",
        )
        for name, value in (
            ("standby", self.standby),
            ("automatic release", self.suspend),
            ("peers", self.peers),
            ("guardian", self.guardian),
            ("cpu snapshot", self.snapshot),
        ):
            lines += _wrapped("", f"{name}: {value}")
        return "\n".join(lines)


#: The width ``Status.table()`` wraps its text to.
WIDTH = 100


def _wrapped(head, text):
    """``head`` then ``text``, wrapped to ``WIDTH``, its later lines indented as far as
    ``text`` starts (4 spaces where ``head`` is empty)."""
    import textwrap

    return textwrap.wrap(
        text,
        WIDTH,
        initial_indent=head,
        subsequent_indent=" " * (len(head) or 4),
        break_long_words=False,
        break_on_hyphens=False,
    ) or [head.rstrip()]


def _by_module(items, name):
    """``items`` grouped by the module of ``name(item)`` ("module:attr"), modules in their
    first item's order: ``[(module, [(item, attr), ...]), ...]``."""
    groups: dict[str, list] = {}
    for item in items:
        module, _, attr = name(item).partition(":")
        groups.setdefault(module, []).append((item, attr))
    return list(groups.items())
