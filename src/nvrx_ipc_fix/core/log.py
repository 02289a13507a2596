"""The package logger (``nvrx_ipc_fix``, ``NullHandler`` by default, a stderr handler at
``NVRX_IPC_FIX_LOG_LEVEL``: ``configure``), warn-once, the ``RuntimeWarning`` that names the
user's line (``warn``), the warnings about settings (``setting_problem``: held back during
start-up until a patched module is imported), and the package's own defects (``hook_failed``;
``guard``, the one context manager around its own code).

Imported only when something is logged or warned, so that activation does not import
``logging``. Imports ``state`` and ``errors`` alone: every other module may deliver its
warnings here.
"""

from __future__ import annotations

import logging
import os
import threading

from .errors import CheckpointWorkerError

TYPE_CHECKING = False  # typing.TYPE_CHECKING, without importing typing
if TYPE_CHECKING:
    from collections.abc import Hashable

logger = logging.getLogger("nvrx_ipc_fix")
logger.addHandler(logging.NullHandler())

_seen: set[Hashable] = set()
_lock = threading.Lock()
# fresh in a child of os.fork() (not through ``fork.renewed``: fork reports its callbacks'
# failures here)
os.register_at_fork(after_in_child=_lock._at_fork_reinit)  # type: ignore[attr-defined]

#: Target name (or "fix target name", one fix's wrapper) -> one-line reason of the last
#: failure inside our hook code.
errors: dict[str, str] = {}


def warn_once(key: Hashable, msg: str, *args: object) -> bool:
    """Log ``msg`` at WARNING the first time ``key`` is seen in this process."""
    with _lock:
        if key in _seen:
            return False
        _seen.add(key)
    logger.warning(msg, *args)
    return True


def hook_failed(target, exc, fix=None):
    """Record a failure inside hook code; the user's call goes on untouched. Said once per
    target (``fix``: that fix's wrapper of it only) and exception type, as a
    ``RuntimeWarning`` (shown by default) and on the logger."""
    reason = f"{type(exc).__name__}: {exc}"
    errors[target if fix is None else f"{fix} {target}"] = reason
    key = ("hook", target, fix, type(exc).__name__)
    where = target if fix is None else f"{target} ({fix})"
    message = (
        f"nvrx_ipc_fix: hook on {where} failed and was skipped ({reason}); NVRx "
        f"behaves as without the fix for this call"
    )
    warn_once(key, "%s", message)
    warn(message, key)


class guard:
    """``with guard(target, fix=None) as it:`` around the package's own bookkeeping (modelled
    on sentry-python's ``capture_internal_exceptions``). An ``Exception`` raised in the block
    is a defect of the package: ``hook_failed`` says it once and records it for
    ``status()``, the block ends there and ``it.failed`` holds it, so that the caller falls
    back to NVRx's own behaviour. A checkpoint's failure is never caught: a
    ``BaseException`` that is no ``Exception`` (an interrupt, torch's
    ``CheckpointException``), the package's ``CheckpointWorkerError``, and whatever a frame
    of NVRx, megatron-core or torch raised pass through. ``own=True``: the block is the
    package's own work through and through (its cleanup after a close: ``gc.collect()``,
    ``torch.cuda.ipc_collect()``), so every ``Exception`` in it is the package's defect."""

    __slots__ = ("target", "fix", "failed", "own")

    def __init__(self, target, fix=None, own=False):
        self.target, self.fix, self.failed, self.own = target, fix, None, own

    def __enter__(self):
        return self

    def __exit__(self, kind, exc, traceback):
        if exc is None or not isinstance(exc, Exception):
            return False
        if not self.own and _checkpoint_failure(exc, traceback):
            return False
        self.failed = exc
        hook_failed(self.target, exc, self.fix)
        return True


#: modules whose exceptions are the checkpoint's, never the package's
_THEIRS = ("nvidia_resiliency_ext", "megatron", "torch")


def _checkpoint_failure(exc, traceback):
    if isinstance(exc, CheckpointWorkerError):
        return True
    while traceback is not None:
        if traceback.tb_frame.f_globals.get("__name__", "").partition(".")[0] in _THEIRS:
            return True
        traceback = traceback.tb_next
    return False


#: keys of the RuntimeWarnings given in this process (settings: (name, raw))
_warned: set[Hashable] = set()


def warned(key):
    """Has ``warn`` been given for ``key`` in this process?"""
    return key in _warned


def warn(message, *keys):
    """One ``RuntimeWarning`` per process for ``keys``, attributed to the user's line
    (``_caller_level``): given, and ``True`` returned, when any of ``keys`` is new (all are
    then recorded). It never raises: where a warnings filter makes it an exception (``-W
    error``), the message goes to stderr instead, so that no warning breaks the import or the
    call it is about."""
    with _lock:
        if _warned.issuperset(keys):
            return False
        _warned.update(keys)
    import warnings

    try:
        warnings.warn(message, RuntimeWarning, stacklevel=_caller_level())
    except Warning:  # -W error: printed instead, never raised
        import sys

        try:
            sys.stderr.write(
                f"RuntimeWarning (printed, not raised: nvrx_ipc_fix never "
                f"breaks the program it patches): {message}\n"
            )
        except (OSError, ValueError, AttributeError):  # no stderr
            pass
    return True


_handler = None  # the stderr handler of NVRX_IPC_FIX_LOG_LEVEL
#: (name, raw) -> the warning about a setting held back until a target is imported
_held: dict[Hashable, str] = {}
_quiet = False  # doctor: no warnings about settings


def configure(level):
    """One stderr handler at ``level`` (``config.log_level()``; idempotent)."""
    global _handler
    if _handler is None:
        _handler = logging.StreamHandler()
        _handler.setFormatter(
            logging.Formatter("nvrx_ipc_fix[%(process)d] %(levelname)s: %(message)s")
        )
        logger.addHandler(_handler)
    logger.setLevel(level.upper())


def setting_problem(key, message, name):
    """Warn once about a setting's value (``message``), or, where the warning must wait
    (``_holder``), keep it for ``show_held``: ``True`` when held."""
    if _quiet or warned(key):
        return False
    read = _holder()
    if read:
        _held[key] = (
            f"{message}. Read {read}, shown now that a module it patches is "
            f"imported; unset {name} or fix it to silence "
            f"this (`python -m nvrx_ipc_fix doctor` checks every setting)"
        )
        return True
    _held.pop(key, None)
    warn(message, key)
    return False


def show_held(_module=None):
    """Warn about the settings held back, once each: a target module was just imported."""
    for key in list(_held):
        message = _held.pop(key, None)
        if message is not None and not _quiet:
            warn(message, key)


def quiet():
    """No warnings about settings in this process, and none of those held back: for
    ``doctor``, which reports every setting itself."""
    global _quiet
    _quiet = True
    _held.clear()


def _holder():
    """Where a setting read now is read from, in words, when its warning must wait: during
    start-up activation, or while ``python -m nvrx_ipc_fix`` imports the package (``doctor``
    reports the settings itself); ``None`` otherwise."""
    import sys

    startup = sys.modules.get("_nvrx_ipc_fix_startup")
    how = getattr(startup, "running", None)
    if how == "pth":
        return (
            f"at start-up by nvrx-ipc-fix's start-up file nvrx_ipc_fix.pth (in "
            f"{os.path.dirname(os.path.abspath(startup.__file__))})"
        )
    if how:
        where = getattr(sys.modules.get("sitecustomize"), "__file__", None)
        return f"at start-up by nvrx-ipc-fix's sitecustomize ({where or how})"
    package = sys.modules.get(__name__.partition(".")[0])
    if getattr(getattr(package, "__spec__", None), "_initializing", False):
        frame = sys._getframe(1)
        while frame is not None and (_ours(frame.f_code.co_filename) or _internal(frame)):
            frame = frame.f_back
        if frame is not None and _runpy(frame):
            return "when `python -m` imported nvrx_ipc_fix"
    return None


#: Packages whose frames a warning looks past: wrapt calls our hooks, and the code we patch
#: calls them on the user's behalf (a queue's ``__init__`` through NVRx's metaclass);
#: ``importlib.import_module`` imports a target module on the user's behalf.
_PAST = ("wrapt", "nvidia_resiliency_ext", "megatron", "importlib")


def _ours(filename):
    """Is ``filename`` this package, its start-up module, or one of ``_PAST``?"""
    import sys

    roots = [os.path.dirname(os.path.dirname(__file__))]  # the package (core/..)
    for name in _PAST:
        roots += list(getattr(sys.modules.get(name), "__path__", None) or ())
    return os.path.basename(filename).startswith("_nvrx_ipc_fix_startup.") or any(
        isinstance(root, str) and filename.startswith(os.path.join(root, "")) for root in roots
    )


def _internal(frame):
    """A frame of importlib's bootstrap (``warnings`` neither shows nor counts them)."""
    name = frame.f_code.co_filename
    return "importlib" in name and "_bootstrap" in name


def _runpy(frame):
    """A frame of ``runpy``, which runs ``python -m``'s module (never the user's line)."""
    return os.path.basename(frame.f_code.co_filename) in ("<frozen runpy>", "runpy.py")


def _caller_level():
    """``warnings.warn``'s ``stacklevel`` for the first frame outside this package (and
    ``_PAST``) and ``runpy``, so that a warning names the user's line (``import
    nvrx_ipc_fix``, ``release()``, the call into NVRx), whichever of our functions read the
    setting. Where there is none (``python -m nvrx_ipc_fix``: runpy runs the package), the
    outermost frame of the package's, where the command entered it. Counted as ``warnings``
    counts: frames of importlib's bootstrap are skipped and not counted. 2 where the stack
    cannot be read."""
    import sys

    try:
        frame, level = sys._getframe(2), 2  # 1: warn, which calls warnings.warn
        entered = 2
        while frame is not None and (_ours(frame.f_code.co_filename) or _runpy(frame)):
            if not _runpy(frame):
                entered = level
            frame = frame.f_back
            while frame is not None and _internal(frame):
                frame = frame.f_back
            level += 1
        return level if frame is not None else entered
    except (AttributeError, ValueError):  # no frames (another Python): the caller of the reader
        return 2
