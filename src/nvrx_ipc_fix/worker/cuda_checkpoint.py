"""The CUDA driver's process checkpoint API (``libcuda.so.1``, CUDA 12.8+ drivers) through
``ctypes``: lock, checkpoint, restore and unlock another process's CUDA state, and read it.

``ctypes`` ties the package to no CUDA major and imports nothing heavy; the library is
opened by the first ``load()``, never at import. Each call may block in the driver (a lock
waits for the target's work in flight; a process that maps another's memory through CUDA IPC
may not come back at all), so every call runs in a thread of its own and returns by a
deadline: ``Timeout`` then says the call is still in the driver. Design notes §3.10 has the
measurements this rests on.
"""

import ctypes
import threading

#: ``CUprocessState``.
RUNNING, LOCKED, CHECKPOINTED, FAILED = 0, 1, 2, 3
STATES = {RUNNING: "running", LOCKED: "locked", CHECKPOINTED: "checkpointed", FAILED: "failed"}
#: The first driver API version (``cuDriverGetVersion``) with the process checkpoint calls.
FIRST_VERSION = 12080
#: Why ``load`` gives no driver in a process that has not initialized CUDA.
NO_CUDA = "this process has not initialized CUDA: its worker has nothing on a device"
SYMBOLS = (
    "cuCheckpointProcessLock",
    "cuCheckpointProcessCheckpoint",
    "cuCheckpointProcessRestore",
    "cuCheckpointProcessUnlock",
    "cuCheckpointProcessGetState",
)


class DriverError(RuntimeError):
    """A call returned a ``CUresult`` other than ``CUDA_SUCCESS``."""

    def __init__(self, call, code):
        super().__init__(f"{call} returned CUresult {code}")
        self.call, self.code = call, code


class Timeout(RuntimeError):
    """A call did not return by its deadline; it may still be running in the driver."""


class _LockArgs(ctypes.Structure):
    _fields_ = [
        ("timeoutMs", ctypes.c_uint),
        ("reserved0", ctypes.c_uint),
        ("reserved1", ctypes.c_uint64 * 7),
    ]


class Driver:
    """The calls on one open ``libcuda``. ``api`` maps each name of ``SYMBOLS`` (and
    ``cuDriverGetVersion``, ``cuInit``) to a callable taking the C arguments."""

    def __init__(self, api):
        self._api = api

    def version(self, timeout=30.0):
        """The driver's API version (12080 for CUDA 12.8)."""
        found = ctypes.c_int(0)
        bounded(
            lambda: self._check("cuDriverGetVersion", ctypes.byref(found)),
            timeout,
            "cuDriverGetVersion",
        )
        return found.value

    def init(self, timeout=30.0):
        """``cuInit(0)``: restore needs it in the calling process."""
        bounded(lambda: self._check("cuInit", 0), timeout, "cuInit")

    def state(self, pid, timeout):
        """The ``CUprocessState`` of ``pid``."""
        found = ctypes.c_int(-1)
        bounded(
            lambda: self._check("cuCheckpointProcessGetState", pid, ctypes.byref(found)),
            timeout,
            "cuCheckpointProcessGetState",
        )
        return found.value

    def lock(self, pid, timeout):
        """Lock ``pid``: its work in flight finishes, its later CUDA calls wait. The driver
        gives up after ``timeout`` seconds too."""
        args = _LockArgs(timeoutMs=max(1, min(int(timeout * 1000), 2**32 - 1)))
        bounded(
            lambda: self._check("cuCheckpointProcessLock", pid, ctypes.byref(args)),
            timeout + 1.0,
            "cuCheckpointProcessLock",
        )

    def checkpoint(self, pid, timeout):
        """Move the locked ``pid``'s device state to host memory; nothing stays on the device."""
        self._call("cuCheckpointProcessCheckpoint", pid, timeout)

    def restore(self, pid, timeout):
        """Bring the checkpointed ``pid``'s device state back; it stays locked."""
        self._call("cuCheckpointProcessRestore", pid, timeout)

    def unlock(self, pid, timeout):
        """Let the locked ``pid`` run its CUDA calls again."""
        self._call("cuCheckpointProcessUnlock", pid, timeout)

    def _call(self, name, pid, timeout):
        bounded(lambda: self._check(name, pid, None), timeout, name)

    def _check(self, name, *args):
        code = self._api[name](*args)
        if code != 0:
            raise DriverError(name, code)


def bounded(call, timeout, name):
    """Run ``call()`` in a daemon thread; its result or exception, or ``Timeout`` after
    ``timeout`` seconds (``inf``: none; the thread is left to finish in the driver)."""
    outcome = []

    def run():
        try:
            outcome.append((True, call()))
        except BaseException as exc:  # noqa: BLE001 carried to the caller
            outcome.append((False, exc))

    thread = threading.Thread(target=run, name=f"nvrx_ipc_fix-{name}", daemon=True)
    thread.start()
    thread.join(None if timeout == float("inf") else max(0.0, timeout))
    if not outcome:
        raise Timeout(f"{name} did not return within {timeout:g} s")
    ok, value = outcome[0]
    if not ok:
        raise value
    return value


def load(in_use=True):
    """``(Driver, None)`` when ``libcuda.so.1`` opens, has every symbol and reports a version
    that has them, else ``(None, why)``. ``in_use``: also ``(None, why)`` where this process
    has not initialized CUDA (through torch): its workers then have nothing on a device."""
    import sys

    torch = sys.modules.get("torch")
    if in_use and (torch is None or not torch.cuda.is_initialized()):
        return None, NO_CUDA
    try:
        lib = ctypes.CDLL("libcuda.so.1")
    except OSError as exc:
        return None, f"the CUDA driver library could not be opened ({exc})"
    missing = [name for name in SYMBOLS if not hasattr(lib, name)]
    if missing:
        return None, (
            f"this CUDA driver has no process checkpoint API ({', '.join(missing)} missing)"
        )
    api = {name: getattr(lib, name) for name in (*SYMBOLS, "cuDriverGetVersion", "cuInit")}
    for name in SYMBOLS:
        api[name].argtypes = [ctypes.c_int, ctypes.c_void_p]
    api["cuDriverGetVersion"].argtypes = [ctypes.c_void_p]
    api["cuInit"].argtypes = [ctypes.c_uint]
    driver = Driver(api)
    try:
        driver.init()
        version = driver.version()
    except (DriverError, Timeout) as exc:
        return None, f"the CUDA driver did not initialize ({exc})"
    if version < FIRST_VERSION:
        return None, (
            f"the CUDA driver's API version is {version}; the process checkpoint API "
            f"needs {FIRST_VERSION} (CUDA 12.8) or later"
        )
    return driver, None
