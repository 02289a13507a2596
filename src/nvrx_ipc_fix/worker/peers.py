"""Does every rank run the package? Asked once per process group, at its first save, through
the group's key-value store: a rank without the package joins no collective of ours (it has
none), and it would read the worker watch's failure flag as "not done yet" and hang the job
later (docs/failures.md).

Each rank where the watch is installed says so (``announce``: its key, ``nvrx_ipc_fix/active/
<rank>``, holding the package's version, and a count; the rank that completes the count sets
``nvrx_ipc_fix/active/all``) as early as it can: at the start of NVRx's
``FileSystemWriterAsync.prepare_write_data``, which comes right after the save's planning
collectives, else at its first schedule. That first schedule (``check``, before NVRx's call)
waits for ``all``, up to ``NVRX_IPC_FIX_PEERS_TIMEOUT`` seconds (default 120: a rank with the
package says so within the save's planning, so only a rank that never will, or one held up
for minutes between the end of those collectives and its own word, is waited for so long).
Where not every rank said so, ``RanksWithoutPackageError`` names the ranks that did not, and
that save is not scheduled. After a check, the group's later saves pay one comparison; a new
default group (``destroy_process_group`` then ``init_process_group``, NVRx's in-process
restart) is checked afresh. Where the store cannot be reached, the check cannot tell: one
warning, ``status()`` says why, and NVRx's own behaviour stays.
"""

from __future__ import annotations

import sys
import threading
import time
import weakref
from datetime import timedelta

from ..core import __version__, config as _config, fork as _fork, state as _state
from ..core.errors import RanksWithoutPackageError
from ..core.status import PEERS_NOT_CHECKED as NOT_CHECKED

PREFIX = "nvrx_ipc_fix/active/"
COUNT, ALL = PREFIX + "count", PREFIX + "all"
SLICE = 5.0  # seconds of one wait on the store: an interrupt or the deadline is seen between
TARGET = f"{__name__}:check"  # what a failure of the check is said of (``log.hook_failed``)

_lock = threading.Lock()
_announced = _decided = None  # weak references to the default group announced in, decided
_why = NOT_CHECKED  # what the last check found, for status()
counts = {"store_calls": 0, "checks": 0}  # store calls made; checks that waited
last: dict[str, float] = {}  # the last check: its store calls and seconds


def _key(rank):
    return f"{PREFIX}{rank}"


def _group():
    """torch.distributed's default group, or None where it is not initialized."""
    dist = sys.modules.get("torch.distributed")
    if dist is None or not dist.is_available() or not dist.is_initialized():
        return None
    return dist.group.WORLD


def _store():
    """The default group's key-value store: the one place the package reaches it (a private
    name of torch's, present in torch 2.x)."""
    from torch.distributed import distributed_c10d

    return distributed_c10d._get_default_store()


def _call(store, name, *args):
    counts["store_calls"] += 1
    return getattr(store, name)(*args)


def _is(ref, group):
    return ref is not None and ref() is group


def announce(watched):
    """Say, once per default group, that this rank runs the package where ``watched()``
    (the worker watch is installed): from NVRx's ``prepare_write_data``, which this must
    never break (a failure is said, and the check then cannot tell)."""
    try:
        group = _group()
        if group is not None and not _is(_announced, group) and group.size() > 1 and watched():
            _announce(group)
    except Exception as exc:  # noqa: BLE001 no store: said once, NVRx's own
        _cannot_tell(exc)


def _announce(group):
    global _announced
    rank, world = group.rank(), group.size()
    with _lock:
        if _is(_announced, group):
            return
        _announced = weakref.ref(group)
    store = _store()
    _call(store, "set", _key(rank), __version__)
    if _call(store, "add", COUNT, 1) == world:
        _call(store, "set", ALL, str(world))


def check():
    """At each schedule, before NVRx's call: at the group's first, wait until every rank
    said it runs the package; raise ``RanksWithoutPackageError`` naming those that did not.
    The package's own failure here (the store cannot be reached) is said once, and the save
    goes on as NVRx's alone."""
    try:
        group = _group()
        if group is None or _is(_decided, group) or group.size() < 2:
            return  # one rank: nothing to check
        _check(group)
    except RanksWithoutPackageError:
        raise
    except Exception as exc:  # noqa: BLE001 no store: said once, NVRx's own
        _cannot_tell(exc)


def _check(group):
    global _decided, _why
    rank, world = group.rank(), group.size()
    calls, started = counts["store_calls"], time.monotonic()
    _announce(group)
    before = counts["store_calls"]
    missing = _wait(_store(), rank, world, _config.peers_timeout())
    waited = time.monotonic() - started
    last.update(store_calls=counts["store_calls"] - before, seconds=waited,
                announce_calls=before - calls)
    counts["checks"] += 1
    if missing:
        _why = (f"rank(s) {_ranks(missing)} of {world} did not say they run the package "
                "(RanksWithoutPackageError raised)")
        raise RanksWithoutPackageError(_message(rank, missing, world, waited), rank=rank,
                                       ranks=missing, world_size=world, waited_s=waited)
    _decided = weakref.ref(group)
    _why = (f"every one of {world} ranks runs the package (checked at the process group's "
            f"first save: {last['store_calls']} store call(s) in {waited * 1000:.2f} ms)")


def _wait(store, rank, world, bound):
    """The ranks that did not say they run the package within ``bound`` seconds (none: all
    did). Waits in slices of ``SLICE``. A store that fails otherwise than by the wait's
    timeout makes its ``check`` raise too: the check cannot tell."""
    from ..core.log import logger

    deadline, said = time.monotonic() + bound, False
    while True:
        begun = time.monotonic()
        left = deadline - begun
        try:
            _call(store, "wait", [ALL], timedelta(seconds=max(min(SLICE, left), 0.001)))
            return ()
        except Exception:  # noqa: BLE001 its timeout, else check() below raises what is wrong
            if _call(store, "check", [ALL]):
                return ()
        if time.monotonic() >= deadline:
            return tuple(_missing(store, list(range(world))))
        if not said and bound >= 2 * SLICE:
            said = True
            logger.warning("rank %s: waiting up to %g s for every rank of %d to say it runs "
                           "nvrx-ipc-fix (%d did so far); a rank without it never does",
                           rank, bound, world, _call(store, "add", COUNT, 0))
        time.sleep(max(0.0, begun + min(SLICE, left) - time.monotonic()))  # a wait cut short


def _missing(store, ranks):
    """Which of ``ranks`` have no key (few store calls where few are missing)."""
    if not ranks or _call(store, "check", [_key(r) for r in ranks]):
        return []
    if len(ranks) == 1:
        return ranks
    half = len(ranks) // 2
    return _missing(store, ranks[:half]) + _missing(store, ranks[half:])


def _ranks(ranks, shown=16):
    text = ", ".join(map(str, ranks[:shown]))
    return text + (f" and {len(ranks) - shown} more" if len(ranks) > shown else "")


def _message(rank, missing, world, waited):
    many = len(missing) > 1
    return (f"rank {rank}: rank{'s' if many else ''} {_ranks(missing)} of {world} "
            f"{'do' if many else 'does'} not run nvrx-ipc-fix (no word from "
            f"{'them' if many else 'it'} in the process group's store within {waited:.0f} s "
            f"of this rank's first save; {_config.PEERS_TIMEOUT} sets how long). Where a rank "
            "lacks it, a failed checkpoint worker hangs the job instead of raising "
            "CheckpointWorkerError on every rank. Activate it on every rank: run `python -m "
            "nvrx_ipc_fix doctor` with the interpreter, flags and environment of "
            f"{'those ranks' if many else 'that rank'} (docs/activation.md). This save was not "
            "scheduled: nothing was handed to the checkpoint worker.")


def _cannot_tell(exc):
    """The store could not be reached: said once, and the group counts as decided."""
    global _decided, _why
    from ..core.log import hook_failed

    _why = (f"cannot tell whether every rank runs the package ({type(exc).__name__}: {exc}); "
            "NVRx's behaviour stays")
    try:
        group = _group()
        _decided = None if group is None else weakref.ref(group)
    except Exception:  # noqa: BLE001 no group to note: the failure is said below
        pass
    hook_failed(TARGET, exc)


@_state.on_status("peers")
def describe():
    """For ``status()``: what the check of every rank found."""
    return _why


def _fresh_lock():
    """In a child of ``os.fork()``: the parent's lock may be held by a thread the child does
    not have (what was checked holds: the child has the parent's group)."""
    global _lock
    _lock = threading.Lock()


def _forget():
    """At ``reset()``: nothing announced or checked."""
    global _announced, _decided, _why
    _announced = _decided = None
    _why = NOT_CHECKED
    counts.update(store_calls=0, checks=0)
    last.clear()


_fork.in_child(_fresh_lock)
_state.on_reset(_forget)
