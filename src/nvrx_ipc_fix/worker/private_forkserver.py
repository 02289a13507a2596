"""Forkservers of the package's own: ``multiprocessing.forkserver.ForkServer`` instances
beside multiprocessing's process-wide one, which stays the user's.

multiprocessing keeps one server per process, ``forkserver._forkserver``: the forkserver
context's ``Process`` starts through ``popen_forkserver.Popen._launch``, which calls the
module-level ``forkserver.connect_to_new_process`` (that instance's method), and
``set_forkserver_preload`` sets that instance's preloads. A server started there for the
package would serve the user's ``get_context("forkserver")``, and on Python 3.14+ every
default child, with the package's preloads and the environment of the moment it started.

``Context`` is multiprocessing's forkserver context with a ``ForkServer()`` of its own. Its
``Process`` is ``ForkServerProcess`` but for the ``Popen``: ``popen_forkserver.Popen`` whose
``_launch`` is CPython's own function, unchanged, run with one global replaced: the name
``forkserver``, the module there, is here a copy of the module's namespace in which the
instance's four functions (``forkserver.__all__``) are this server's. So the launch is
CPython's on each version (3.10-3.14 have the same), and nothing process-wide is touched.
The server runs ``forkserver.main`` in a process of its own, and its children are
forkserver children as any other (multiprocessing's module state there is theirs).

``SpawnFrom`` points NVRx at such a server: NVRx asks its module's ``mp`` for
``get_context("spawn")`` for each worker, and the standby puts a ``SpawnFrom`` there.
"""

import threading
import types
from multiprocessing import context as _context, forkserver as _forkserver, popen_forkserver

from .exit_status import one_at_a_time


def unsupported():
    """Why this Python's multiprocessing cannot give a server of the package's own (its
    forkserver has another shape), or None."""
    launch = getattr(popen_forkserver.Popen, "_launch", None)
    code = getattr(launch, "__code__", None)
    if code is None or code.co_freevars or "forkserver" not in code.co_names:
        return "popen_forkserver.Popen._launch has another shape"
    missing = [
        name
        for name in (*_forkserver.__all__, "_stop")
        if not callable(getattr(_forkserver.ForkServer, name, None))
    ]
    if missing:
        return f"multiprocessing.forkserver.ForkServer has no {', '.join(missing)}"
    return None


class Context(_context.ForkServerContext):
    """multiprocessing's forkserver context, with a server of its own that imports
    ``preload`` before it forks. ``pid``: the server's, once started (``start``, or the
    first ``Process`` started)."""

    def __init__(self, preload=()):
        self._server = _forkserver.ForkServer()
        self._server.set_forkserver_preload(list(preload))
        launch = popen_forkserver.Popen._launch
        module = types.SimpleNamespace(**vars(_forkserver))
        for name in _forkserver.__all__:
            setattr(module, name, getattr(self._server, name))
        self._launch = types.FunctionType(
            launch.__code__, {**launch.__globals__, "forkserver": module}, launch.__name__
        )

    @property
    def pid(self):
        return self._server._forkserver_pid

    def start(self):
        """Start the server if it does not run. It imports its preloads in the background and
        accepts the first fork once they are done."""
        self._server.ensure_running()

    def stop(self):
        """Let the server go, without waiting: it exits once no process holds it (its
        children that still run do), and a thread reaps it."""
        threading.Thread(
            target=_stop, args=(self._server,), daemon=True, name="nvrx_ipc_fix-forkserver-stop"
        ).start()

    def set_forkserver_preload(self, module_names):
        self._server.set_forkserver_preload(module_names)

    def Process(self, *args, **kwargs):
        process = _Process(*args, **kwargs)
        process._launcher = self._launch
        return process


def _stop(server):
    try:
        server._stop()
    except OSError:  # reaped already
        pass


class _Process(_context.ForkServerProcess):
    """``ForkServerProcess`` launched by the server of the ``Context`` that made it."""

    _launcher = None

    @staticmethod
    def _Popen(process_obj):
        return one_at_a_time(_Popen(process_obj))  # the status: read by one thread at a time

    def __getstate__(self):
        """What the child gets: all but the launch (the child needs none)."""
        state = dict(self.__dict__)
        state.pop("_launcher", None)
        return state


class _Popen(popen_forkserver.Popen):
    def __init__(self, process_obj):
        self._launch = types.MethodType(process_obj._launcher, self)
        super().__init__(process_obj)


class SpawnFrom:
    """A module's ``mp`` whose ``get_context("spawn")`` is ``context``: in the thread that
    made it (``every_thread``: in every thread); everything else is ``real``'s."""

    def __init__(self, real, context, every_thread=False):
        self._real, self._context = real, context
        self._thread = None if every_thread else threading.get_ident()

    def __getattr__(self, name):
        return getattr(self._real, name)

    def get_context(self, method=None):
        if method == "spawn" and self._thread in (None, threading.get_ident()):
            return self._context
        return self._real.get_context(method)
