"""Check whether every rank runs the package. The check runs only where the host waits for
NVRx's finalize all-reduce, and it only warns: a job in which a rank lacks the package goes on
as it would with NVRx alone (docs/failures.md).

Where: at the finalize of a persistent worker where the worker watch adds its failure flag to
NVRx's all-reduce (``sync_all_async_calls`` inside ``is_current_async_call_done``,
``no_dist=False``). There the host reads the sum (``worker_watch._sync``), so every rank has
entered the all-reduce. The check never runs at a non-persistent queue's all-reduce (NCCL's
returns on the host before the other ranks have entered it), nor with ``no_dist=True`` (no
all-reduce).

How: before it enters such an all-reduce, a rank appends its rank number to the group's key in
the store (``before``), until this has succeeded once in the group. After the sum was read, the
rank reads that key once (``after``). By then every rank with the package has written its
number, unless its store failed. A rank missing from the key is reported only if it is still
missing at a finalize with the flag ``SETTLE_S`` or more later (a rank whose store was down
writes at its next finalize). While any rank is missing, this rank leaves its failure flag out
of the all-reduce (``flag_rides``), so that a rank without the package never reads the flag as
"not done". A missing rank is reported by one ``RuntimeWarning`` per group and in
``status()``; nothing is raised and nothing waits. If the store fails on this rank, the package
warns once that it cannot tell, and then only writes this rank's own number (it never reports
another rank).

The key is ``nvrx_ipc_fix/peers/<generation>``. The generation is the number of groups this
rank number has checked on this store (``store.add`` of ``nvrx_ipc_fix/peers/groups/<rank>``).
It is the same on every rank if each rank ran the package in every earlier group, so a group
created again on the same store (``destroy_process_group``, ``init_process_group``) gets a key
of its own; the module's state is reset for a new group. The ranks that report a missing rank
set that rank's count to the group's generation (``compare_set``), so that its count stays in
step. An old group's key stays in the store (a few bytes). If the process holding a rank number
made no finalize with the flag in an earlier group on the same store and was not reported there
(or its store was down for longer than ``SETTLE_S``), its count falls behind: in a later group
it is reported as missing though it runs the package. The only effects are a warning and the
flag left out of the all-reduce.
"""

from __future__ import annotations

import sys
import threading
import time
import weakref

from ..core import fork as _fork, state as _state
from ..core.status import PEERS_NOT_CHECKED as NOT_CHECKED

PREFIX = "nvrx_ipc_fix/peers/"
#: a rank missing at the first read is named only where still missing this much later
SETTLE_S = 60.0
TARGET = "peers"  # the key of its warnings
#: what a call on torch's store raises when the store fails or times out (DistStoreError and
#: DistNetworkError are RuntimeErrors)
STORE_ERRORS = (RuntimeError, OSError, ValueError, AttributeError)


class Group:
    """What this rank knows of one default process group's check."""

    __slots__ = ("group", "rank", "world", "key", "said", "saying", "first", "missing", "done")

    def __init__(self, group, rank, world):
        self.group, self.rank, self.world = group, rank, world  # group: a weak reference
        self.key = None  # the group's key, once this rank's generation is known
        self.said = False  # this rank's number is in the key
        self.saying = False  # a thread is writing it (another finalize's skips it)
        self.first = None  # when a rank was first found missing
        self.missing = ()  # the ranks missing at the last read
        self.done = False  # nothing more to read: all there, named, or cannot tell


_lock = _fork.renewed(threading.Lock())
_group: Group | None = None
_why = NOT_CHECKED  # what the check found, for status()


def _current():
    """This rank's ``Group`` of the default process group (a new one for a new group), or
    None where there is nothing to check (no group, one rank)."""
    global _group, _why
    dist = sys.modules.get("torch.distributed")
    if dist is None or not dist.is_available() or not dist.is_initialized():
        return None
    group = dist.group.WORLD
    with _lock:
        if _group is None or _group.group() is not group:  # a new group starts clean
            _group, _why = Group(weakref.ref(group), group.rank(), group.size()), NOT_CHECKED
        return _group if _group.world > 1 else None


def _store():
    from torch.distributed import distributed_c10d  # its one way to the store (torch 2.x)

    return distributed_c10d._get_default_store()


def before():
    """Before an all-reduce that carries the failure flag: write this rank's number to the
    group's key, unless it is already there."""
    mine = _current()
    if mine is None or mine.said:
        return
    with _lock:  # one thread writes it: the count of groups is added to once
        if mine.saying:
            return
        mine.saying = True
    try:
        say(mine, _store())
    except STORE_ERRORS as exc:  # written again before the next all-reduce
        _cannot_tell(mine, exc)
    finally:
        mine.saying = False


def after():
    """After that all-reduce's sum was read: read the other ranks' numbers from the key once,
    and once more ``SETTLE_S`` later if a rank was missing."""
    mine = _current()
    if mine is None or mine.done or not mine.said:
        return
    now = time.monotonic()
    if mine.first is not None and now - mine.first < SETTLE_S:
        return
    try:
        text, warned = hear(mine, _store(), now)
    except STORE_ERRORS as exc:
        _cannot_tell(mine, exc)
        return
    _said(mine, text, warned)


def flag_rides():
    """Whether this rank may add its failure flag to NVRx's all-reduce. It may not while a
    rank may lack the package (that rank would read the flag as "not done yet")."""
    mine = _group
    return mine is None or not mine.missing


def say(mine, store):
    """Append this rank's number to the group's key (counting its generation first)."""
    if mine.key is None:
        mine.key = f"{PREFIX}{int(store.add(f'{PREFIX}groups/{mine.rank}', 1))}"
    store.append(mine.key, f"{mine.rank},")
    mine.said = True


def hear(mine, store, now):
    """Read the ranks' numbers from the key. Returns the text for ``status()`` and whether
    to warn."""
    there = {int(rank) for rank in store.get(mine.key).decode().split(",") if rank}
    mine.missing = tuple(rank for rank in range(mine.world) if rank not in there)
    if not mine.missing:
        mine.done = True
        return (
            f"every one of {mine.world} ranks runs the package (checked at the finalize "
            "all-reduces of a persistent worker)",
            False,
        )
    if mine.first is None:
        mine.first = now
        return (
            f"no word yet from rank(s) {_ranks(mine.missing)} of {mine.world} (read again at "
            f"a finalize {SETTLE_S:g} s or more later; the failure flag stays out meanwhile)",
            False,
        )
    mine.done = True
    generation = int(mine.key[len(PREFIX) :])
    try:  # count each missing rank as if it had checked, so its key in a later group matches
        for rank in mine.missing:
            old = str(generation - 1) if generation > 1 else ""
            store.compare_set(f"{PREFIX}groups/{rank}", old, str(generation))
    except STORE_ERRORS:  # its count then falls behind: reported again in a later group
        pass
    return _named(mine, generation), True


def _ranks(ranks, shown=16):
    text = ", ".join(map(str, ranks[:shown]))
    return text + (f" and {len(ranks) - shown} more" if len(ranks) > shown else "")


def _named(mine, generation):
    many = len(mine.missing) > 1
    them, those = ("them", "those ranks") if many else ("it", "that rank")
    return (
        f"rank {mine.rank}: rank{'s' if many else ''} {_ranks(mine.missing)} of {mine.world} "
        f"{'do' if many else 'does'} not run nvrx-ipc-fix (no word from {them} in the store "
        f"of process group #{generation}, {SETTLE_S:g} s after the first finalize all-reduce "
        "that every rank entered). The job goes on as with NVRx alone, whose worker failure "
        "hangs it: the failure flag stays out of NVRx's all-reduce. Activate the package on "
        "every rank: run `python -m nvrx_ipc_fix doctor` with the interpreter, flags and "
        f"environment of {those} (docs/activation.md)"
    )


def _cannot_tell(mine, exc):
    _said(
        mine,
        f"cannot tell whether every rank runs the package ({type(exc).__name__}: {exc}); "
        "NVRx's behaviour stays",
        warned=True,
    )
    # reports no rank, and adds the flag to the all-reduce as if every rank ran the package;
    # this rank's number is still written (before)
    mine.done, mine.missing = True, ()


def _said(mine, text, warned=False):
    """Set ``text`` for ``status()``; if ``warned``, also warn once per group."""
    global _why
    from ..core.log import logger, warn

    _why = text
    if warned and warn(f"nvrx_ipc_fix: {text}", (TARGET, mine.key or id(mine))):
        logger.warning("nvrx_ipc_fix: %s", text)


@_state.on_status("peers")
def describe():
    """For ``status()``: what the check of every rank found."""
    return _why
