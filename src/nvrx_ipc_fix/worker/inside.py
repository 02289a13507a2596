"""Functions that run inside the NVRx (or megatron-core) checkpoint worker, and the files
through which the worker's last uncaught exception and its pinning report reach the trainer.

They travel in an ``AsyncRequest`` and are pickled by reference (module and name), so
the worker imports this module to run them. That import activates the package in the
worker too, which is harmless: nothing there closes workers or prepares writes.

The files are in a directory of the trainer's own (``directory``: ``mkdtemp``, mode 0700,
removed when the trainer exits), never under a name another user of the machine could plant
in the shared temporary directory. The worker gets its path from the requests that run these
functions (``reporting``, ``warm_up``), whatever started it (NVRx's spawn, a fork, the
standby), and writes there only if it is still a directory of its user that no one else may
write to, never through a symbolic link.
"""

from __future__ import annotations

import gc
import importlib
import json
import os
import stat
import sys
import threading
import time

from ..core import fork as _fork
from ..core.detect import CORE, FS
from ..core.shapes import worker_data_cache

TYPE_CHECKING = False  # typing.TYPE_CHECKING, without importing typing
if TYPE_CHECKING:
    from collections.abc import Callable
    from typing import Any

#: What a prewarmed worker imports before it says it is ready: what a save's request makes
#: it unpickle (NVRx's writer). A stand-in for the device (the demo's ``cli.fakecuda``) adds
#: its tensor class's module.
WORKER_IMPORTS = [FS]
#: Where there is no CUDA, what a stand-in for the device (the demo's ``cli.fakecuda``) gives
#: for pinned host memory (``size`` -> a tensor); ``None``: nothing can be pinned ahead.
pin_without_cuda: Callable[[int], Any] | None = None
#: What a worker leaves for the trainer: ``traceback`` (its last uncaught exception) and
#: ``pinned`` (what ``warm_up`` pinned ahead).
WORKER_FILE = "worker-{pid}.{kind}"

_lock = _fork.renewed(threading.Lock())
#: ``(the directory, the pid of the trainer that made it)``; in a worker, the directory its
#: last request named (or its trainer's, where it was forked from it) and that trainer's pid.
_private = (None, None)


def directory():
    """The trainer's private directory for what its workers leave (made at first need)."""
    global _private
    with _lock:
        path, owner = _private
        if owner != os.getpid():  # none yet, or a forked child's: a directory of its own
            import tempfile

            path = tempfile.mkdtemp(prefix="nvrx_ipc_fix-")
            _private = (path, os.getpid())
            _fork.at_exit(_remove, path)
        return path


def _remove(path):
    import shutil

    shutil.rmtree(path, ignore_errors=True)


def _told(path):
    """In the worker: the trainer's directory, as a request named it."""
    global _private
    if path is not None and path != _private[0]:
        _private = (path, None)


def reporting(path, function, *args, **kwargs):
    """Run a save request's ``async_fn`` or ``preload_fn``; if it raises, leave the
    traceback for the trainer in its directory ``path`` (the worker then dies of it, as
    without the package)."""
    _told(path)
    try:
        return function(*args, **kwargs)
    except Exception:  # noqa: BLE001 re-raised, its traceback left for the trainer first
        leave_traceback()
        raise


def leave_traceback():
    """Write the exception being handled to this worker's traceback file (never raises)."""
    import traceback

    _leave("traceback", traceback.format_exc()[-16000:])


def _leave(kind, text):
    """Write what this worker leaves of ``kind`` into its trainer's directory: only into a
    directory of this user's that no one else may write to, never through a symbolic link
    (never raises; False if nothing was written)."""
    path = _private[0]
    if path is None:
        return False
    try:
        folder = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    except OSError:
        return False
    try:
        info = os.fstat(folder)
        if info.st_uid != os.getuid() or stat.S_IMODE(info.st_mode) & 0o077:
            return False
        name = WORKER_FILE.format(pid=os.getpid(), kind=kind)
        out = os.open(
            name, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600, dir_fd=folder
        )
        with open(out, "w", encoding="utf-8") as file:
            file.write(text)
        return True
    except (OSError, ValueError):  # never raises in the worker: False, nothing written
        return False
    finally:
        os.close(folder)


def take_file(pid, kind):
    """The text the worker ``pid`` left of ``kind``, the file removed; None if there is none."""
    path = _private[0]
    if pid is None or path is None or _private[1] != os.getpid():
        return None  # no directory yet: no worker was given one
    name = os.path.join(path, WORKER_FILE.format(pid=pid, kind=kind))
    try:
        with open(os.open(name, os.O_RDONLY | os.O_NOFOLLOW), encoding="utf-8") as found:
            text = found.read()
        os.unlink(name)
        return text
    except OSError:
        return None


def read_traceback(pid):
    """The traceback the worker ``pid`` left, or None."""
    return (take_file(pid, "traceback") or "").strip() or None


def drop_cache():
    """Drop every cached tensor, so the worker releases its CUDA IPC mappings."""
    cache = worker_data_cache(sys.modules[CORE])
    cache.clear()
    gc.collect()
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized():
        torch.cuda.empty_cache()


def warm_up(modules, sizes=(), standby=None, path=None):
    """Import ``modules`` (what the saves will unpickle here), so that the first save to a
    prewarmed worker does not wait for them (a failure is left for that save to meet); then
    pin host memory of ``sizes`` bytes (``pin_host``) and report it (``pinned`` in the
    trainer's directory ``path``), with when this request began and how long the pinning took.
    ``standby``: the pid of the standby this worker was forked from (``worker.standby``),
    with which it dies."""
    entered = time.time()
    _told(path)
    if standby is not None:
        die_with(standby)
    for name in modules:
        try:
            importlib.import_module(name)
        except Exception:  # noqa: BLE001 a module's own import error: imported when needed
            pass
    if sizes:
        began = time.perf_counter()
        pinned, error = pin_host(sizes)
        _leave(
            "pinned",
            json.dumps(
                {
                    "pinned_bytes": pinned,
                    "error": error,
                    "entered": entered,
                    "pin_s": time.perf_counter() - began,
                }
            ),
        )


def die_with(parent):
    """Have the kernel kill this process when ``parent`` (its parent) exits; if it already
    has, exit now: the trainer reads this worker's exit from ``parent``, and takes it for
    dead once ``parent`` is gone."""
    import signal

    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGKILL))  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):  # not Linux: the check below still holds at the start
        pass
    if os.getppid() != parent:
        os.kill(os.getpid(), signal.SIGKILL)


def pin_host(sizes):
    """Pin host blocks of these byte sizes and free them into torch's caching host allocator,
    where the first save's ``.to("cpu", non_blocking=True)`` copies find them (it rounds
    each request as it rounded these). Returns ``(bytes pinned, error or None)``; never
    raises. Without CUDA, ``pin_without_cuda`` allocates, if a stand-in set it. One thread:
    more pinned no faster on an H200 host (``benchmarks/pin_speed.py``)."""
    import torch

    if torch.cuda.is_available():

        def allocate(size):
            return torch.empty(size, dtype=torch.uint8, pin_memory=True)
    elif pin_without_cuda is not None:
        allocate = pin_without_cuda
    else:
        return 0, "no CUDA device in the worker"
    blocks = []
    try:
        for size in sizes:
            blocks.append(allocate(int(size)))
        return sum(b.numel() for b in blocks), None
    except (RuntimeError, MemoryError, OSError, ValueError) as exc:  # reported with what was pinned
        return sum(b.numel() for b in blocks), f"{type(exc).__name__}: {exc}"[:500]
    finally:
        del blocks  # into the cache: pinned, and free for the save
