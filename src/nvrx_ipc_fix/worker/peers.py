"""Does every rank run the package? Asked once per default process group, at this rank's first
of NVRx's finalize all-reduces (``sync_all_async_calls``), through the group's key-value
store: no collective is added, and a job where every rank runs the package waits for nothing.

The worker watch's failure flag rides that all-reduce; a rank without the package reads a
failed rank's flag as "not done yet" and hangs the job later (docs/failures.md). Only a
finalize with ``no_dist=False`` makes it: a save planned in a group of its own and finalized
with ``no_dist=True`` is never checked.

Right before this rank's first such all-reduce in a group, it writes that it runs the package
(``say``: its key, ``nvrx_ipc_fix/peers/<rank>``, and one more in a count). Once the all-reduce
returned, every rank of the group had entered it, so every rank with the package had written
its key: ``verdict`` reads the count. Where it is short, the first rank to claim the work finds
the ranks without a key (few calls where few are missing) and publishes them; a rank whose key
could not be written (each store call is tried 4 times: ``PAUSES``) marks that as soon as the
store answers it, and the ranks then cannot tell, never accuse. Each rank then takes its key
away and the last one sets the count back: a new default group on the same store
(``destroy_process_group`` then ``init_process_group``) starts clean. Where the flag rides the
all-reduce (a persistent worker's finalize), the finalize raises ``RanksWithoutPackageError``
once, after NVRx's own finalize of the save (``take``). Where it cannot be told (a store error
after every try; keys an earlier group left behind), one warning, ``status()`` says why, and
NVRx's behaviour stays.
"""

from __future__ import annotations

import sys
import threading
import time
import weakref
from datetime import timedelta

from ..core import __version__, fork as _fork, state as _state
from ..core.errors import RanksWithoutPackageError
from ..core.status import PEERS_NOT_CHECKED as NOT_CHECKED

PREFIX = "nvrx_ipc_fix/peers/"
COUNT, DONE, CLAIM, FOUND, UNSURE = (
    PREFIX + name for name in ("count", "done", "claim", "found", "unsure")
)
PAUSES = (0.1, 0.4, 1.6)  # seconds between the 4 tries of one store call
UNSURE_S = 5.0  # how long the naming rank waits for a rank's mark that its word is missing
FOUND_S = 60.0  # how long the other ranks wait for the names
TARGET = "peers: cannot tell"  # the key of its one warning
#: what a call on torch's store raises when the store fails or times out (DistStoreError and
#: DistNetworkError are RuntimeErrors)
STORE_ERRORS = (RuntimeError, OSError, ValueError)

_lock = _fork.renewed(threading.Lock())  # what was checked holds in a child: the parent's group
_checked = None  # weak reference to the default group this rank checked (or is checking)
_found: RanksWithoutPackageError | None = None  # in that group, until a finalize is due it
_due: RanksWithoutPackageError | None = None  # for the next finalize to raise
_why = NOT_CHECKED  # what the check found, for status()


class Turn:
    """One rank's part in the check of one group: the store, the rank and the group's size,
    whether its word is in the store, and its store calls."""

    __slots__ = ("store", "rank", "world", "said", "calls", "started")

    def __init__(self, store, rank, world):
        self.store, self.rank, self.world = store, rank, world
        self.said, self.calls, self.started = False, 0, time.monotonic()

    def call(self, name, *args):
        """``store.<name>(*args)``, tried again after each of ``PAUSES``."""
        for pause in PAUSES:
            self.calls += 1
            try:
                return getattr(self.store, name)(*args)
            except STORE_ERRORS:  # tried again
                time.sleep(pause)
        self.calls += 1
        return getattr(self.store, name)(*args)

    def waited(self, key, seconds):
        """Is ``key`` in the store within ``seconds``?"""
        self.calls += 1
        try:
            self.store.wait([key], timedelta(seconds=seconds))
            return True
        except STORE_ERRORS:  # its timeout, or the store failed: no
            return False


def say(turn):
    """Before the rank's first all-reduce in the group: its key, then one more in the count."""
    turn.call("set", f"{PREFIX}{turn.rank}", __version__)
    turn.call("add", COUNT, 1)
    turn.said = True


def verdict(turn):
    """After that all-reduce: the ranks that did not say they run the package (empty: every
    rank did), or None where that cannot be told. The rank's key is taken away; the last rank
    of the group sets the count back."""
    if not turn.said:  # its key may be missing: every rank is told it cannot tell
        turn.call("add", UNSURE, 1)
        turn.call("delete_key", f"{PREFIX}{turn.rank}")
        return None
    count = int(turn.call("add", COUNT, 0))
    missing = () if count == turn.world else None if count > turn.world else _named(turn, count)
    turn.call("delete_key", f"{PREFIX}{turn.rank}")
    if turn.call("add", DONE, 1) == count:  # every rank counted has read: start clean
        turn.call("add", COUNT, -count)
        turn.call("add", DONE, -count)
        if count < turn.world:
            for key in (CLAIM, FOUND, UNSURE):
                turn.call("delete_key", key)
    return missing


def _named(turn, count):
    """The ranks without a key, found by the first rank to claim it and published to the
    others; None where a rank marked its word missing or the keys do not add up."""
    if turn.call("add", CLAIM, 1) == 1:
        missing = _missing(turn, list(range(turn.world)))
        told = len(missing) == turn.world - count and not turn.waited(UNSURE, UNSURE_S)
        text = ",".join(map(str, missing)) if told else "?"
        turn.call("set", FOUND, text)
    elif turn.waited(FOUND, FOUND_S):
        text = turn.call("get", FOUND).decode()
    else:
        return None
    return None if text == "?" else tuple(int(rank) for rank in text.split(","))


def _missing(turn, ranks):
    """Which of ``ranks`` have no key (few store calls where few are missing)."""
    if not ranks or turn.call("check", [f"{PREFIX}{rank}" for rank in ranks]):
        return []
    if len(ranks) == 1:
        return ranks
    half = len(ranks) // 2
    return _missing(turn, ranks[:half]) + _missing(turn, ranks[half:])


def announce():
    """Before one of NVRx's finalize all-reduces: where it is this rank's first in the
    default group, this rank writes its key (``say``) and its ``Turn`` is returned (else
    None). A failure of the store gives one warning (the check then cannot tell); it never
    breaks NVRx's call."""
    global _checked, _found
    try:
        dist = sys.modules.get("torch.distributed")
        if dist is None or not dist.is_available() or not dist.is_initialized():
            return None
        group = dist.group.WORLD
        if group.size() < 2 or (_checked is not None and _checked() is group):
            return None  # one rank: nothing to check; or checked (again under the lock)
        with _lock:
            if _checked is not None and _checked() is group:
                return None
            _checked, _found = weakref.ref(group), None
        from torch.distributed import distributed_c10d  # its one way to the store (torch 2.x)

        turn = Turn(distributed_c10d._get_default_store(), group.rank(), group.size())
    except (AttributeError, *STORE_ERRORS) as exc:  # no store: said once, NVRx's own
        _cannot_tell(exc)
        return None
    try:
        say(turn)
    except STORE_ERRORS as exc:  # every rank learns it (verdict)
        _cannot_tell(exc)
    return turn


def check(turn, rides):
    """After that all-reduce returned: the verdict of this rank's ``turn`` (None: not its
    first). Where ranks are missing and the failure flag ``rides`` on the all-reduce, the
    error is due: the finalize that made it raises it (``take``)."""
    global _why, _found, _due
    if turn is not None:
        try:
            missing = verdict(turn)
            if missing is None and turn.said:  # else announce warned
                raise LookupError(
                    "the ranks' words in the store do not add up (a rank could "
                    "not say so, or an earlier group's are left)"
                )
        except (LookupError, *STORE_ERRORS) as exc:  # said once, NVRx's own
            _cannot_tell(exc)
            missing = None
        if missing:
            _found = RanksWithoutPackageError(
                _message(turn, missing), rank=turn.rank, ranks=missing, world_size=turn.world
            )
            _why = (
                f"rank(s) {_ranks(missing)} of {turn.world} do not run the package "
                "(RanksWithoutPackageError, raised once by the first finalize whose "
                "failure flag rides NVRx's all-reduce)"
            )
        elif missing is not None:
            _why = (
                f"every one of {turn.world} ranks runs the package (checked at this "
                f"rank's first finalize all-reduce of the process group: {turn.calls} "
                f"store call(s), {(time.monotonic() - turn.started) * 1000:.2f} ms)"
            )
    if rides and _found is not None:
        _due, _found = _found, None


def take():
    """The ``RanksWithoutPackageError`` a finalize raises after NVRx's own, once; None."""
    global _due
    error, _due = _due, None
    return error


def _ranks(ranks, shown=16):
    text = ", ".join(map(str, ranks[:shown]))
    return text + (f" and {len(ranks) - shown} more" if len(ranks) > shown else "")


def _message(turn, missing):
    many = len(missing) > 1
    return (
        f"rank {turn.rank}: rank{'s' if many else ''} {_ranks(missing)} of {turn.world} "
        f"{'do' if many else 'does'} not run nvrx-ipc-fix (no word from "
        f"{'them' if many else 'it'} in the process group's store, though every rank had "
        "entered NVRx's finalize all-reduce). Where a rank lacks it, a failed checkpoint "
        "worker hangs the job instead of raising CheckpointWorkerError on every rank. "
        "Activate it on every rank: run `python -m nvrx_ipc_fix doctor` with the "
        f"interpreter, flags and environment of {'those ranks' if many else 'that rank'} "
        "(docs/activation.md). Raised once, after NVRx's finalize: the saves it finalized "
        "are saved (err.finalized), and the job may go on as with NVRx alone."
    )


def _cannot_tell(exc):
    """Warn once per process, and tell ``status()`` why."""
    global _why
    from ..core.log import warn, warn_once

    _why = (
        f"cannot tell whether every rank runs the package ({type(exc).__name__}: {exc}); "
        "NVRx's behaviour stays"
    )
    warn_once(TARGET, "nvrx_ipc_fix: %s", _why)
    warn(f"nvrx_ipc_fix: {_why}", TARGET)


@_state.on_status("peers")
def describe():
    """For ``status()``: what the check of every rank found."""
    return _why
