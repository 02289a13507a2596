"""The standby: multiprocessing's forkserver with torch, NVRx and its writer imported and no
CUDA, from which ``core.prewarming`` forks the worker that ``restart`` starts at the onload.

A worker NVRx spawns is a fresh interpreter that imports torch and NVRx before it creates
its CUDA context: most of the 6-10 s a ``restart`` worker took to get ready on an H200. The
standby pays the imports once. The ``restart`` release (the model is being offloaded;
inference follows) starts it, if none runs, in a thread: ``ensure_running`` spawns it with
``PRELOAD`` as its preload, and a probe process forked from it marks it ready (the server
forks only once its preload is done). It holds no device memory (it never initializes
CUDA) and stays for the life of the process. At the onload ``prewarming`` starts the worker
with NVRx's own ``_start_worker``; for that call NVRx's module ``mp`` answers the starting
thread's ``get_context("spawn")`` with the forkserver's context (``starting``). The worker is
forked from the standby; NVRx pickles what it sends the same way for both, and the worker
does only what needs the device: its CUDA context, the pinning ahead.

The standby is used only when it is ready, still alive, multiprocessing's forkserver was
started here for it (a forkserver other code started may have imported ``__main__``, which
can initialize CUDA), and the environment is the one it was started with; otherwise NVRx
spawns the worker, as without it, and ``status().standby`` says why. A worker forked from it
dies with it (``core.worker.warm_up`` sets its parent-death signal), so a dead standby never
leaves a worker that looks dead and runs; its death is one WARNING, and the next ``restart``
release starts a new one. ``NVRX_IPC_FIX_STANDBY=off`` turns it off.
"""

import os
import threading
from contextlib import contextmanager

from . import config as _config, fork as _fork, state as _state
from .detect import CORE
from .log import hook_failed, logger
from .monitor import stat_fields
from .status import STANDBY_NOT_STARTED
from .worker import WORKER_IMPORTS

#: What the standby imports ahead (``__main__`` is not: each worker imports it, as spawned).
PRELOAD = ("torch", CORE, __name__.rsplit(".", 1)[0] + ".worker")
PROBE_TIMEOUT = 120.0  # seconds the standby may take to import what it preloads


class _Standby:
    """The forkserver started here, while it serves."""

    def __init__(self, pid, environ):
        self.pid = pid
        self.environ = environ  # what it inherited
        self.ready = threading.Event()
        self.error = None  # why it never got ready


_lock = threading.Lock()
_standby = None  # the current _Standby, or None
_why = STANDBY_NOT_STARTED  # why none serves, for status()
_forks = 0  # workers forked from a standby
_deaths = 0


def _server():
    """multiprocessing's forkserver object, or None (a Python whose forkserver has another
    shape: the standby is off, once said)."""
    try:
        from multiprocessing import forkserver

        server = forkserver._forkserver
        getattr(server, "_forkserver_pid")
        getattr(server, "_preload_modules")
        return server
    except (ImportError, AttributeError) as exc:
        _config.warn(f"nvrx_ipc_fix: no standby for restart's workers: this Python's "
                     f"multiprocessing.forkserver has another shape ({exc}); NVRx spawns them",
                     ("standby", "shape"))
        return None


def _alive(pid):
    """Is ``pid`` a process that has not exited (a zombie has)?"""
    try:
        return stat_fields(pid)[0] not in (b"Z", b"X")
    except (OSError, IndexError):
        try:
            os.kill(pid, 0)
            return True
        except OSError:
            return False


def start():
    """At a ``restart`` release: start the standby in a thread if none serves; never blocks,
    never raises (a defect here warns once, and NVRx spawns the workers)."""
    try:
        _start()
    except Exception as exc:
        hook_failed(__name__, exc)


def _start():
    global _standby, _why
    if not _config.standby():
        _why = f"off ({_config.STANDBY}=off)"
        return
    with _lock:
        if _standby is not None and _alive(_standby.pid):
            return
        server = _server()
        if server is None:
            _why = "this Python's multiprocessing.forkserver has another shape"
            return
        pid = server._forkserver_pid
        if pid is not None and (_standby is None or pid != _standby.pid):
            if _alive(pid):
                _why = (f"multiprocessing's forkserver (pid {pid}) was started by other code: "
                        "NVRx spawns the workers")
                return
        if _standby is not None:
            _died()
        try:
            import multiprocessing

            context = multiprocessing.get_context("forkserver")
            context.set_forkserver_preload([*PRELOAD, *(m for m in WORKER_IMPORTS
                                                        if m not in PRELOAD)])
            server.ensure_running()
        except Exception as exc:  # no forkserver here: NVRx spawns, as without the package
            _standby, _why = None, f"could not start ({type(exc).__name__}: {exc})"
            logger.warning("nvrx_ipc_fix: the standby for restart's workers %s; NVRx spawns "
                           "them", _why)
            return
        _standby = _Standby(server._forkserver_pid, dict(os.environ))
        _why = f"starting (pid {_standby.pid})"
        threading.Thread(target=_probe, args=(context, _standby), daemon=True,
                         name="nvrx_ipc_fix-standby").start()


def _probe(context, standby):
    """The thread: fork a process that does nothing from the standby; once it is forked,
    the standby has imported what it preloads."""
    global _why
    try:
        probe = context.Process(name="nvrx_ipc_fix-standby-probe", daemon=True)
        probe.start()
        probe.join(PROBE_TIMEOUT)
        if probe.exitcode != 0:
            raise RuntimeError(f"its probe process ended with {probe.exitcode}")
    except Exception as exc:
        standby.error = f"{type(exc).__name__}: {exc}"
        with _lock:
            if _standby is standby:
                _why = f"failed to start ({standby.error})"
        logger.warning("nvrx_ipc_fix: the standby for restart's workers (pid %s) failed to "
                       "start (%s); NVRx spawns them", standby.pid, standby.error)
        return
    standby.ready.set()
    with _lock:
        if _standby is standby:
            _why = f"ready (pid {standby.pid})"
    logger.info("nvrx_ipc_fix: the standby for restart's workers (pid %s) is ready: it "
                "imported %s", standby.pid, ", ".join(PRELOAD))


def _died():
    """The current standby is gone: said once."""
    global _standby, _why, _deaths
    _deaths += 1
    _why = f"the standby (pid {_standby.pid}) died; the next restart release starts another"
    logger.warning("nvrx_ipc_fix: the standby for restart's workers (pid %s) died; NVRx spawns "
                   "the next worker, and the next restart release starts another standby",
                   _standby.pid)
    _standby = None


def _usable():
    """The standby that can fork a worker now, or None (``_why`` says why not)."""
    global _why
    standby = _standby
    if standby is None or not standby.ready.is_set():
        return None
    if not _alive(standby.pid):
        _died()
        return None
    if dict(os.environ) != standby.environ:
        _why = (f"ready (pid {standby.pid}), but not used: the environment changed since it "
                "started, and its workers would inherit the old one")
        return None
    return standby


@contextmanager
def starting(core):
    """Around NVRx's ``_start_worker`` in ``prewarming``: yields the standby's pid if the
    worker is forked from it, else None (NVRx spawns it)."""
    with _lock:
        try:
            standby = _usable() if _config.standby() else None
        except Exception as exc:  # the package's defect: NVRx spawns, as without it
            hook_failed(__name__, exc)
            standby = None
        real = getattr(core, "mp", None)
        if standby is None or not callable(getattr(real, "get_context", None)):
            yield None
            return
        import multiprocessing

        core.mp = _Contexts(real, multiprocessing.get_context("forkserver"))
        global _forks
        _forks += 1
        try:
            yield standby.pid
        finally:
            if core.mp.__class__ is _Contexts:
                core.mp = real


class _Contexts:
    """NVRx's ``mp`` while one thread starts a worker: that thread's ``get_context("spawn")``
    is the forkserver's context; everything else is ``mp``'s."""

    def __init__(self, real, forkserver):
        self._real, self._forkserver = real, forkserver
        self._thread = threading.get_ident()

    def __getattr__(self, name):
        return getattr(self._real, name)

    def get_context(self, method=None):
        if method == "spawn" and threading.get_ident() == self._thread:
            return self._forkserver
        return self._real.get_context(method)


def describe():
    """For ``status()``: the standby's state, its forks and deaths."""
    return f"{_why}; {_forks} worker(s) forked from a standby; {_deaths} standby death(s)"


def _forget():
    """In a child of ``os.fork()``, or at ``reset()``: no standby is ours (a child cannot use
    its parent's forkserver: it is not the child's child)."""
    global _lock, _standby, _why, _forks, _deaths
    _lock, _standby, _forks, _deaths = threading.Lock(), None, 0, 0
    _why = STANDBY_NOT_STARTED


_fork.in_child(_forget)
_state.on_reset(_forget)
