"""A worker's exit status, read by one thread at a time.

The monitor thread and the trainer's (the watch's ``dead()``, NVRx's ``is_alive()`` and
``join()``, multiprocessing's ``active_children()`` from any thread) read the status of the
same worker, and multiprocessing's ``Popen.poll`` is not safe for two threads at once. From
a forkserver (``popen_forkserver``), both find the status pipe readable: the first reads the
4-byte status, the second reads EOF and stores 255 (or finds the pipe empty and calls the
dead worker alive). From fork and spawn (``popen_fork``), the second ``waitpid`` fails with
ECHILD and the poll answers None. The same in CPython 3.10-3.13.

``one_reader(process)`` gives one started process's ``Popen`` an instance attribute ``poll``
that runs the class's ``poll`` one thread at a time, so each reader gets the status the
worker died with. The class, and every process the package was not given (the user's own),
keep Python's. A blocking poll waits for the death outside the lock, on the sentinel (so
``join()`` without a timeout, like ``join(timeout)`` always, also waits for any child of the
worker that inherited the sentinel's pipe: from fork or spawn, not from a forkserver).
"""

from __future__ import annotations

import os
import threading
import weakref
from multiprocessing import connection


class _OneAtATime:
    """A ``Popen``'s ``poll``, one thread at a time (in the process that made it: a child of
    ``os.fork()`` may have inherited the lock held, and polls as Python does)."""

    __slots__ = ("popen", "own", "lock", "pid")

    def __init__(self, popen):
        self.popen = weakref.ref(popen)  # no cycle: the Popen closes its pipes when it goes
        self.own = popen.__dict__.get("poll")  # a ``poll`` the instance had already, if any
        self.lock = threading.Lock()
        self.pid = os.getpid()

    def __call__(self, flag=os.WNOHANG):
        popen = self.popen()
        if os.getpid() != self.pid:
            return self._poll(popen, flag)
        if flag != os.WNOHANG and popen.returncode is None:
            connection.wait([popen.sentinel])  # another thread may read the status meanwhile
        with self.lock:
            return self._poll(popen, flag)

    def _poll(self, popen, flag):
        return self.own(flag) if self.own is not None else type(popen).poll(popen, flag)


def one_reader(process):
    """``process``, whose status every thread now reads one at a time (a process not yet
    started: unchanged). Idempotent."""
    popen = getattr(process, "_popen", None)
    if popen is not None:
        one_at_a_time(popen)
    return process


def one_at_a_time(popen):
    """``popen``, with the ``poll`` of ``one_reader`` (one of another shape, unchanged)."""
    own = getattr(popen, "__dict__", None)
    if (
        own is not None
        and hasattr(popen, "sentinel")
        and not isinstance(own.get("poll"), _OneAtATime)
    ):
        popen.poll = _OneAtATime(popen)
    return popen
