"""The one wrapper of each intercepted call (``targets.CALLS``): it holds the call's region and
runs the fixes' steps in the call's order around NVRx's original, which the innermost step
calls once.

A step is a wrapt-style function ``step(wrapped, instance, args, kwargs)``; its ``wrapped``
is the rest of the call (``Rest``): called as NVRx's original is, and named as it (module,
qualified name, signature), so that a step reads the call's arguments as it would read the
original's. Which steps are in is ``lifecycle``'s business (``Dispatch.add``, ``discard``);
the order is the table's.

The regions (``targets``):

* ``QUEUE``: the queue's lock (``queue_lock``), an ``RLock`` per queue, held around every
  step of a schedule, a finalize, a close of that queue and around ``release()``'s work on it.
* ``SCHEDULE``: ``QUEUE``, and the save's planning ends (``planning.scheduled``) once the
  schedule returned or raised; the rank's CUDA device is noted for the queue (``device_of``),
  for a finalize that ``release()`` runs from another thread.
* ``CLOSE``: ``QUEUE``, but a close with ``abort=True`` takes no lock of the package's, and
  neither do the calls on the queue made inside it: another thread's save may hold the
  queue's lock, stuck on a hung worker or in a collective, and the abort is what ends it. The
  worker watch ends that save as one on a dead worker (``fixes.worker_watch``).

A save's planning (``prepare_write_data``, fix ``clear_on_close``: ``planning``) waits for a
release in another thread to end; then the save is *planned* from before NVRx looks up its
cache key until the planning ends, and where it plans to send only that key (the worker's
cache must stay as it is until the save reaches the worker), until its schedule. A release in
another thread waits for the planned saves (bounded) before it touches anything.
"""

from __future__ import annotations

import sys
import threading
import time
import weakref
from contextlib import ExitStack, contextmanager
from functools import partial

from . import fork as _fork
from .arguments import flags

TYPE_CHECKING = False  # typing.TYPE_CHECKING, without importing typing
if TYPE_CHECKING:
    from typing import Any


class Rest:
    """The steps after one step of a call, then NVRx's original: what that step calls."""

    def __init__(self, steps, index, original, instance, names):
        self.__dict__.update(names)  # __module__, __qualname__, __name__ of the original
        self.__wrapped__ = original  # inspect.signature follows it
        if hasattr(original, "__self__"):  # a bound method: arguments.py keys on these
            self.__func__, self.__self__ = original.__func__, original.__self__
        self._steps, self._index, self._instance, self._names = steps, index, instance, names

    def __call__(self, *args, **kwargs):
        steps, index = self._steps, self._index
        wrapped = (
            self.__wrapped__
            if index + 1 == len(steps)
            else Rest(steps, index + 1, self.__wrapped__, self._instance, self._names)
        )
        return steps[index](wrapped, self._instance, args, kwargs)


def _names(function):
    return {
        name: getattr(function, name)
        for name in ("__module__", "__qualname__", "__name__")
        if hasattr(function, name)
    }


class Dispatch:
    """The wrapper of one call: its region and its steps, in the call's order."""

    def __init__(self, call):
        self.call = call
        self.steps = {}  # fix -> step function
        self.chain = ()  # the steps in the call's order, outermost first
        self.names = None  # the original's __module__, __qualname__, __name__

    def add(self, fix, step):
        self.steps[fix] = step
        self._order()

    def discard(self, fix):
        self.steps.pop(fix, None)
        self._order()

    def _order(self):
        self.chain = tuple(self.steps[fix] for fix in self.call.order if fix in self.steps)

    def enabled(self):
        return bool(self.chain)

    def __call__(self, wrapped, instance, args, kwargs, _finalizing=sys.is_finalizing):
        chain = self.chain
        if not chain:  # its last step was taken out meanwhile
            return wrapped(*args, **kwargs)
        if len(chain) == 1:
            run = partial(chain[0], wrapped, instance)
        else:
            names = self.names
            if names is None:
                names = self.names = _names(wrapped)
            rest = Rest(chain, 0, wrapped, instance, names)
            run = lambda args, kwargs: rest(*args, **kwargs)  # noqa: E731
        region = self.call.region
        if region is None or _finalizing():  # module globals are gone in the teardown
            return run(args, kwargs)
        if getattr(_aborting, "depth", 0):  # inside an abort: its calls take no lock either
            return run(args, kwargs)
        if region == "close" and aborts(wrapped, args, kwargs):
            _aborting.depth = 1
            try:
                return run(args, kwargs)
            finally:
                _aborting.depth = 0
        with queue_lock(instance):
            if region != "schedule":
                return run(args, kwargs)
            try:
                _note_device(instance)
                return run(args, kwargs)
            finally:
                planning.scheduled()


def aborts(wrapped, args, kwargs):
    """Is this call of a close an abort (``abort=True``; NVRx 0.4.1's has no such argument)?"""
    try:
        return flags(wrapped, args, kwargs, "abort")[0]
    except TypeError:  # arguments NVRx's close refuses: it raises that itself
        return False


# -- the queue's lock ---------------------------------------------------------------------------

_locks_lock = threading.Lock()
#: queue -> RLock
_queue_locks: weakref.WeakKeyDictionary[Any, threading.RLock] = weakref.WeakKeyDictionary()
#: queue -> the CUDA device index its saves run on
_devices: weakref.WeakKeyDictionary[Any, int] = weakref.WeakKeyDictionary()


def queue_lock(queue):
    """The lock a thread holds while it schedules, finalizes, closes or releases ``queue``'s
    saves: each talks to the one worker, whose answers would otherwise reach the other."""
    lock = _queue_locks.get(queue)  # a read needs no lock; only the first one makes it
    if lock is None:
        with _locks_lock:
            lock = _queue_locks.get(queue)
            if lock is None:
                lock = _queue_locks[queue] = threading.RLock()
    return lock


@contextmanager
def holding(queues, timeout, why):
    """Hold the locks of every queue of ``queues`` (in one order, so two holders never wait
    on each other), waiting at most ``timeout`` seconds in all; where one is not free by then,
    none is held and ``RuntimeError`` says which (``why``: what waited)."""
    deadline = time.monotonic() + timeout
    with ExitStack() as stack:
        for queue in sorted(queues, key=id):
            lock = queue_lock(queue)
            if not lock.acquire(
                timeout=max(0.0, min(deadline - time.monotonic(), threading.TIMEOUT_MAX))
            ):
                raise RuntimeError(
                    f"nvrx_ipc_fix: {why} waited {timeout:g} s for queue {id(queue):#x}, which "
                    "another thread is scheduling, finalizing or closing a save on; nothing was "
                    "done. Call it from the thread that saves, or when no save is in progress"
                )
            stack.callback(lock.release)
        yield


#: ``.depth``: 1 in a thread inside a close with ``abort=True``, whose calls take no lock.
_aborting = threading.local()


def _note_device(queue):
    """Note the CUDA device the thread that schedules on ``queue`` uses (once CUDA is up)."""
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized():
        _devices[queue] = torch.cuda.current_device()


@contextmanager
def device_of(queue):
    """Run the block on the CUDA device ``queue``'s saves were scheduled on, where this thread
    uses another (a release from a thread of its own finalizes the saves: NVRx's all-reduce
    builds its tensor on the current device)."""
    device = _devices.get(queue)
    torch = sys.modules.get("torch")
    if device is None or torch is None or torch.cuda.current_device() == device:
        yield
        return
    with torch.cuda.device(device):
        yield


# -- a save's planning -----------------------------------------------------------------------------


class Planning:
    """The saves planned to send only a cache key and not yet scheduled, per thread, and the
    release that waits for them; see the module doc."""

    def __init__(self):
        self.cond = threading.Condition(threading.Lock())
        self.planned = {}  # thread ident -> [weakref to the writer of each planned save]
        self.releasing = None  # ident of the thread inside release(), or None
        self.depth = 0  # its nesting

    def _foreign(self):
        """Is a thread other than this one inside a release?"""
        return self.releasing not in (None, threading.get_ident())

    @contextmanager
    def planning(self, writer):
        """Around one ``prepare_write_data``: wait for a release in another thread (unless this
        thread has planned saves a release already waits for); then the save is planned, from
        before NVRx looks up its cache key (a release that begins meanwhile waits), until
        this thread's next schedule where it sends only that key, else until the planning
        ends."""
        from .shapes import reused

        me, plan = threading.get_ident(), weakref.ref(writer)
        with self.cond:
            while self._foreign() and not self._live(me):
                self.cond.wait()
            self.planned.setdefault(me, []).append(plan)
        kept = False
        try:
            yield
            kept = reused(writer)
        finally:
            if not kept:
                with self.cond:
                    self.planned[me].remove(plan)
                    self._live(me)
                    self.cond.notify_all()

    def _live(self, ident):
        refs = [ref for ref in self.planned.get(ident, ()) if ref() is not None]
        if refs:
            self.planned[ident] = refs
        else:
            self.planned.pop(ident, None)
        return bool(refs)

    def scheduled(self):
        """This thread's oldest planned save reached its schedule."""
        me = threading.get_ident()
        if me not in self.planned:  # only this thread adds its own plans: no lock to know
            return
        with self.cond:
            if self._live(me):
                del self.planned[me][0]
                self.cond.notify_all()

    @contextmanager
    def releasing_region(self, timeout):
        """Around a release: wait for the saves other threads planned (each until it is
        scheduled, all within ``timeout`` seconds; else ``RuntimeError``, and nothing was
        done), and keep new plans waiting until the release ends. Nested in one thread, the
        outer one waits."""
        me = threading.get_ident()
        with self.cond:
            if self.releasing != me:
                deadline = time.monotonic() + timeout
                while self.releasing is not None or self._waits_for(me):
                    left = deadline - time.monotonic()
                    if left <= 0:
                        raise RuntimeError(self._refusal(timeout, me))
                    self.cond.wait(min(left, threading.TIMEOUT_MAX))
                self.releasing = me
            self.depth += 1
        try:
            yield
        finally:
            with self.cond:
                self.depth -= 1
                if not self.depth:
                    self.releasing = None
                    self.cond.notify_all()

    def _waits_for(self, me):
        return any(self._live(ident) for ident in list(self.planned) if ident != me)

    def _refusal(self, timeout, me):
        if self.releasing is not None and self.releasing != me:
            what = f"another release (thread {self.releasing}) to end"
        else:
            threads = sorted(ident for ident in self.planned if ident != me)
            what = (
                f"the save(s) planned on thread(s) {', '.join(map(str, threads))} to be "
                "scheduled (a save that sends only a cache key: releasing now would drop "
                "the cache it names)"
            )
        return (
            f"nvrx_ipc_fix: release() waited {timeout:g} s for {what}; nothing was "
            "released. Call it from the thread that saves, or between saves"
        )


planning = Planning()


def _forget():
    """In a child of ``os.fork()`` and at ``reset()``: fresh locks, no record of the parent's."""
    global _locks_lock, _queue_locks, _devices, planning
    _locks_lock = threading.Lock()
    _queue_locks, _devices = weakref.WeakKeyDictionary(), weakref.WeakKeyDictionary()
    planning = Planning()


_fork.in_child(_forget)
