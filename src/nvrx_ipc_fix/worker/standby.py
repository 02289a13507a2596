"""The standby: a forkserver of the package's own (``worker.private_forkserver``) with torch,
NVRx and its writer imported and no CUDA, from which ``worker.prewarm`` forks the worker
that ``restart`` starts at the onload.

A worker NVRx spawns is a fresh interpreter that imports torch and NVRx before it creates
its CUDA context: most of the 6-10 s a ``restart`` worker took to get ready on an H200. The
standby pays the imports once. The ``restart`` release (the model is being offloaded;
inference follows) starts it, if none serves, with ``PRELOAD`` and ``WORKER_IMPORTS`` as its
preload and ``worker.standby_probe`` last. A probe process forked from it (the server forks
only once its preload is done) reports what the server held then; it is ready if that is
one Python thread, no CUDA and every preload imported, else it is stopped. It holds no
device memory and stays while the environment is the one it started with. At the onload
``prewarming`` starts the worker with NVRx's own ``_start_worker``; for that call NVRx's
module ``mp`` answers the starting thread's ``get_context("spawn")`` with the standby's
context (``starting``). The worker is forked from the standby; NVRx pickles what it sends
the same way for both, and the worker does only what needs the device: its CUDA context,
the pinning ahead.

It is never multiprocessing's forkserver: the user's ``get_context("forkserver")`` (the
default context on Python 3.14+) keeps its own server, its preloads and its environment.
The standby is used only when it is ready, still alive, and the environment is the one it
was started with; otherwise NVRx spawns the worker, as without it, and ``status().standby``
says why. One whose environment changed is replaced by the next ``restart`` release (its
workers would inherit the old environment): it exits once no worker of it runs. A worker
forked from it dies with it (``worker.inside.warm_up`` sets its parent-death signal), so a
dead standby never leaves a worker that looks dead and runs; its death is one WARNING, and
the next ``restart`` release starts a new one. ``NVRX_IPC_FIX_STANDBY=off`` turns it off.
"""

import os
import threading
from contextlib import contextmanager

from ..core import config as _config, fork as _fork, log as _log, state as _state
from ..core.detect import CORE
from ..core.log import guard, logger
from ..core.status import STANDBY_NOT_STARTED
from . import guardian as _guardian, private_forkserver
from .inside import WORKER_IMPORTS
from .guardian_process import alive

_ROOM = __name__.rsplit(".", 1)[0]
#: What the standby imports ahead (``__main__`` is not: each worker imports it, as spawned).
PRELOAD = ("torch", CORE, _ROOM + ".inside")
PROBE = _ROOM + ".standby_probe"  # imported last: what the server held then
PROBE_TIMEOUT = 120.0  # seconds the standby may take to import what it preloads


class _Standby:
    """A standby started here: its context (``private_forkserver.Context``), the
    environment it inherited, and its probe's outcome."""

    def __init__(self, context, environ):
        self.context = context
        self.pid = context.pid
        self.environ = environ
        self.ready = threading.Event()
        self.error = None  # why it never got ready


_lock = _fork.renewed(threading.Lock())
_standby = None  # the current _Standby (a failed one too, until the environment changes)
_why = STANDBY_NOT_STARTED  # why none serves, for status()
_forks = 0  # workers forked from a standby
_deaths = 0
_replaced = 0  # standbys replaced because the environment changed


def start():
    """At a ``restart`` release: start the standby in a thread if none serves, or replace one
    whose environment changed; never blocks, never raises (a defect here warns once, and
    NVRx spawns the workers)."""
    with guard(__name__):  # NVRx spawns, as without it
        _start()


def _start():
    global _standby, _why, _replaced
    if not _config.standby():
        _why = f"off ({_config.STANDBY}=off)"
        return
    with _lock:
        current = _standby
        if current is not None and current.error is None and not alive(current.pid):
            _died()
        elif current is not None and dict(os.environ) == current.environ:
            return  # serving, getting ready, or failed in this very environment
        elif current is not None and current.error is None:
            current.context.stop()
            _replaced += 1
            logger.info(
                "nvrx_ipc_fix: the standby for restart's workers (pid %s) is replaced: "
                "the environment changed since it started",
                current.pid,
            )
        unsupported = private_forkserver.unsupported()
        if unsupported is not None:
            _standby = None
            _why = f"this Python's multiprocessing has another shape ({unsupported})"
            _log.warn(
                f"nvrx_ipc_fix: no standby for restart's workers: {_why}; NVRx spawns them",
                ("standby", "shape"),
            )
            return
        preload = [*PRELOAD, *(m for m in WORKER_IMPORTS if m not in PRELOAD)]
        try:
            context = private_forkserver.Context([*preload, PROBE])
            context.start()
            _guardian.guard(context.pid)  # with it, whatever it forked
        except (OSError, EOFError, RuntimeError, ValueError) as exc:  # no forkserver: NVRx spawns
            _standby, _why = None, f"could not start ({type(exc).__name__}: {exc})"
            logger.warning(
                "nvrx_ipc_fix: the standby for restart's workers %s; NVRx spawns them", _why
            )
            return
        _standby = _Standby(context, dict(os.environ))
        _why = f"starting (pid {_standby.pid})"
        threading.Thread(
            target=_probe, args=(_standby, preload), daemon=True, name="nvrx_ipc_fix-standby"
        ).start()


def _probe(standby, preload):
    """The thread: the standby is ready if its probe finds it fit (``_check``); else it is
    stopped, with one warning, and NVRx spawns the workers. One replaced meanwhile is stopped again
    (the probe's fork starts a server that is not running)."""
    global _why
    try:
        fit, found = _check(standby.context, preload)
    except (OSError, EOFError, RuntimeError, ValueError) as exc:  # unfit: NVRx spawns
        fit, found = False, f"its probe failed: {type(exc).__name__}: {exc}"
    with _lock:
        current = _standby is standby
        if fit:
            standby.ready.set()
        else:
            standby.error = found
        if not (fit and current):
            standby.context.stop()
        if current:
            _why = f"{'ready' if fit else 'failed to start'} (pid {standby.pid}): {found}"
    if not current:  # replaced, or dead, meanwhile: logged where that happened
        return
    if fit:
        logger.info(
            "nvrx_ipc_fix: the standby for restart's workers (pid %s) is ready: %s",
            standby.pid,
            found,
        )
    else:
        logger.warning(
            "nvrx_ipc_fix: the standby for restart's workers (pid %s) failed to "
            "start (%s); NVRx spawns them",
            standby.pid,
            found,
        )


def _check(context, preload):
    """Fork the probe from ``context``'s server: ``(fit, what it found)``. Fit is one Python
    thread, no CUDA, and each of ``preload`` and ``PROBE`` imported (``worker.standby_probe``)."""
    from .standby_probe import report

    reader, writer = context.Pipe(duplex=False)
    probe = context.Process(
        target=report,
        args=(writer, [*preload, PROBE]),
        daemon=True,
        name="nvrx_ipc_fix-standby-probe",
    )
    probe.start()
    writer.close()
    try:
        found = reader.recv() if reader.poll(PROBE_TIMEOUT) else None
    finally:
        reader.close()
    probe.join(PROBE_TIMEOUT)
    if found is None:
        return False, f"its probe did not answer within {PROBE_TIMEOUT:g} s"
    if probe.exitcode != 0:
        return False, f"its probe process ended with {probe.exitcode}"
    threads, problems = found["threads"], []
    if threads != 1:
        problems.append(f"{threads} Python threads")
    if found["cuda"]:
        problems.append("CUDA initialized")
    if found["missing"]:
        problems.append(f"did not import {', '.join(found['missing'])}")
    if problems:
        return False, ", ".join(problems)
    return True, f"1 Python thread, no CUDA, imported {', '.join(preload)}"


def _died():
    """The current standby is gone: warn once."""
    global _standby, _why, _deaths
    _deaths += 1
    _why = f"the standby (pid {_standby.pid}) died; the next restart release starts another"
    logger.warning(
        "nvrx_ipc_fix: the standby for restart's workers (pid %s) died; NVRx spawns "
        "the next worker, and the next restart release starts another standby",
        _standby.pid,
    )
    _standby.context.stop()  # reaps it
    _standby = None


def _usable():
    """The standby that can fork a worker now, or None (``_why`` says why not)."""
    global _why
    standby = _standby
    if standby is None or not standby.ready.is_set():
        return None
    if not alive(standby.pid):
        _died()
        return None
    if dict(os.environ) != standby.environ:
        _why = (
            f"ready (pid {standby.pid}), but not used: the environment changed since it "
            "started, and its workers would inherit the old one; the next restart "
            "release replaces it"
        )
        return None
    return standby


@contextmanager
def starting(core):
    """Around NVRx's ``_start_worker`` in ``prewarming``: yields the standby's pid if the
    worker is forked from it, else None (NVRx spawns it)."""
    with _lock:
        with guard(__name__) as it:
            standby = _usable() if _config.standby() else None
        if it.failed:  # NVRx spawns, as without it
            standby = None
        real = getattr(core, "mp", None)
        if standby is None or not callable(getattr(real, "get_context", None)):
            yield None
            return
        mine = core.mp = private_forkserver.SpawnFrom(real, standby.context)
        global _forks
        _forks += 1
        try:
            yield standby.pid
        finally:
            if core.mp is mine:
                core.mp = real


@_state.on_status("standby")
def describe():
    """For ``status()``: the standby's state, its forks, deaths and replacements."""
    replaced = (
        f"; {_replaced} replaced (the environment changed since it started)" if _replaced else ""
    )
    return f"{_why}; {_forks} worker(s) forked from a standby; {_deaths} standby death(s){replaced}"


def _forget():
    """In a child of ``os.fork()``, or at ``reset()``: no standby is ours (a child cannot use
    its parent's server: it is not the child's child)."""
    global _standby, _why, _forks, _deaths, _replaced
    _standby, _forks, _deaths, _replaced = None, 0, 0, 0
    _why = STANDBY_NOT_STARTED


_fork.in_child(_forget)
