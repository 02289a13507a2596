"""Does every rank run the package? Told only where the host waits for NVRx's finalize
all-reduce, and only warned: a job with a rank without the package goes on as NVRx alone
would (docs/failures.md).

Where: a persistent worker's finalize whose failure flag rides NVRx's all-reduce
(``sync_all_async_calls`` inside ``is_current_async_call_done``, ``no_dist=False``): there the
host reads the sum (``worker_watch._sync``), so every rank had entered the all-reduce. Never at
a non-persistent queue's all-reduce (NCCL's returns on the host before the others entered it),
nor with ``no_dist=True`` (no all-reduce).

How: before entering such an all-reduce, until it worked once in the group, a rank appends its
rank to the group's key (``before``); after the sum was read, it reads that key once
(``after``): every rank with the package had written by then, unless its store failed. A rank
missing there is named only if it is still missing at a riding finalize ``SETTLE_S`` or more
later (a rank whose store was down writes at its next one). While a rank is missing, this
rank's failure flag stays out of the all-reduce (``flag_rides``), so that a rank without the
package never reads it as "not done". Named: one ``RuntimeWarning`` per group, and
``status()``; nothing raised, nothing waited for. A store error on this rank: one warning
that it cannot tell, then only its own word is written again (never a rank named).

The key, ``nvrx_ipc_fix/peers/<generation>``: the generation is this rank number's count of
groups checked on this store (``store.add`` of ``nvrx_ipc_fix/peers/groups/<rank>``), the same
on every rank where each ran the package in every earlier group, so that a group made again
on the same store (``destroy_process_group``, ``init_process_group``) has a key of its own;
the module's state is reset at a new group. A named rank's count is set to the group's
generation by the ranks that named it (``compare_set``), so that it stays in step. A key of
an old group stays (a few bytes). Where a rank number's holder made no riding finalize in an
earlier group on the same store and was not named there (or its store was down past
``SETTLE_S``), its count lags: in a later group it is named though it runs the package (a
warning; nothing else changes but the flag staying out).
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
        self.said = False  # this rank's word is in it
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
    """Before a riding all-reduce: this rank's word, until it is in the store."""
    mine = _current()
    if mine is None or mine.said:
        return
    with _lock:  # one thread writes it: the count of groups is added to once
        if mine.saying:
            return
        mine.saying = True
    try:
        say(mine, _store())
    except STORE_ERRORS as exc:  # written again before the next one
        _cannot_tell(mine, exc)
    finally:
        mine.saying = False


def after():
    """After that all-reduce's sum was read: the other ranks' words, read once, and once more
    ``SETTLE_S`` later where one was missing."""
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
    """May this rank's failure flag ride the all-reduce? Not while a rank may lack the
    package (it would read the flag as "not done yet")."""
    mine = _group
    return mine is None or not mine.missing


def say(mine, store):
    """This rank's word in the group's key (its generation counted first)."""
    if mine.key is None:
        mine.key = f"{PREFIX}{int(store.add(f'{PREFIX}groups/{mine.rank}', 1))}"
    store.append(mine.key, f"{mine.rank},")
    mine.said = True


def hear(mine, store, now):
    """The ranks' words read: what ``status()`` says, and whether it is warned of."""
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
    try:  # each named rank counted as if it had checked: its key in a later group is the same
        for rank in mine.missing:
            old = str(generation - 1) if generation > 1 else ""
            store.compare_set(f"{PREFIX}groups/{rank}", old, str(generation))
    except STORE_ERRORS:  # it then lags: named again in a later group, a warning
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
    # names no one, and the flag rides as where every rank runs it; its own word is still
    # written (before)
    mine.done, mine.missing = True, ()


def _said(mine, text, warned=False):
    """``status()`` says ``text``; once per group, a warning."""
    global _why
    from ..core.log import logger, warn

    _why = text
    if warned and warn(f"nvrx_ipc_fix: {text}", (TARGET, mine.key or id(mine))):
        logger.warning("nvrx_ipc_fix: %s", text)


@_state.on_status("peers")
def describe():
    """For ``status()``: what the check of every rank found."""
    return _why
