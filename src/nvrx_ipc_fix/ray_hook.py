"""Ray: a worker setup hook that never makes a worker fail, and the ``runtime_env`` that
carries it.

Ray runs a job's ``worker_process_setup_hook`` in every worker of the job, whatever
environment (``py_executable``) the worker runs from. The string form
``"nvrx_ipc_fix.ray_worker_setup"`` must be importable there: where it is not, the worker
dies before its first task ("Failed to execute the setup hook method"). The hook made here
is a closure, which Ray's cloudpickle sends by value, so unpickling it imports nothing; in a
worker without the package it does nothing, and says so on stderr when NVRx is importable
there (checkpoints saved in that worker run without the fix).
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping

TYPE_CHECKING = False  # typing.TYPE_CHECKING, without importing typing
if TYPE_CHECKING:
    from typing import Any

#: The string hook: it stops every worker whose environment cannot import this package.
STRING_HOOK = "nvrx_ipc_fix.ray_worker_setup"
_DOTTED = re.compile(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)+")


def ray_runtime_env(runtime_env: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """``runtime_env`` (a dict; a new one if ``None``) with this package's Ray setup hook and
    this process's ``NVRX_IPC_FIX_*`` variables; returns a new dict::

        ray.init(runtime_env=nvrx_ipc_fix.ray_runtime_env({"env_vars": {...}}))

    Variables already in ``env_vars`` are kept. A ``worker_process_setup_hook`` already there
    (a callable or a ``"module.function"`` string) still runs, after this package's, and its
    errors are Ray's as before; this package's own hook (``ray_runtime_env`` applied twice,
    or the string ``"nvrx_ipc_fix.ray_worker_setup"``) is not run twice. ``TypeError`` or
    ``ValueError`` for what Ray cannot take: a ``runtime_env`` that is not a dict or ``None``,
    ``env_vars`` that do not map ``str`` to ``str``, a hook string that is not dotted.
    Ray takes the hook from the job's ``runtime_env`` only (``ray.init``, job submission),
    not from an actor's or a task's options.
    """
    if runtime_env is not None and not isinstance(runtime_env, Mapping):
        raise TypeError(
            f"runtime_env must be a dict (Ray's runtime_env) or None, not "
            f"{type(runtime_env).__name__}: {runtime_env!r:.80}"
        )
    env = dict(runtime_env or {})
    given = env.get("env_vars")
    if given is not None and not isinstance(given, Mapping):
        raise TypeError(
            f"runtime_env['env_vars'] must be a dict of str to str or None, not "
            f"{type(given).__name__}"
        )
    env_vars = dict(given or {})
    bad = [(k, v) for k, v in env_vars.items() if not (isinstance(k, str) and isinstance(v, str))]
    if bad:
        raise TypeError(
            f"runtime_env['env_vars'] must map str to str (Ray's rule); "
            f"{bad[0][0]!r}: {bad[0][1]!r} is not"
        )
    for name, value in os.environ.items():
        if name.startswith("NVRX_IPC_FIX_"):
            env_vars.setdefault(name, value)
    if env_vars:
        env["env_vars"] = env_vars
    env["worker_process_setup_hook"] = _hook(env.get("worker_process_setup_hook"))
    return env


def _hook(then):
    if getattr(then, "__name__", None) == "nvrx_ipc_fix_setup" or then == STRING_HOOK:
        then = None  # ours already (ray_runtime_env applied twice, or the string form)
    if then is not None and not (callable(then) or isinstance(then, str)):
        raise TypeError(
            f"worker_process_setup_hook must be a callable or a string, got {type(then).__name__}"
        )
    if isinstance(then, str) and not _DOTTED.fullmatch(then):
        raise ValueError(
            f"worker_process_setup_hook must be a callable or a "
            f"'module.function' string, not {then!r}"
        )

    def nvrx_ipc_fix_setup():
        """Activate nvrx_ipc_fix in this Ray worker if it is importable (source ray-hook)."""
        try:
            import nvrx_ipc_fix
        except ImportError:
            nvrx_ipc_fix = None
            try:
                import importlib.util
                import sys

                if importlib.util.find_spec("nvidia_resiliency_ext") is not None:
                    sys.stderr.write(
                        f"nvrx_ipc_fix: not importable in this Ray worker ({sys.executable}, "
                        f"pid {os.getpid()}): NVRx checkpoints saved here run without the fix. "
                        f"Check with `python -m nvrx_ipc_fix doctor --python {sys.executable}`\n"
                    )
            except (OSError, ValueError, AttributeError):  # no stderr: the worker goes on
                pass
        except Exception:  # noqa: BLE001 a broken install: never stop the worker
            nvrx_ipc_fix = None
        if nvrx_ipc_fix is not None:
            nvrx_ipc_fix.ray_worker_setup()  # catches everything itself
        if isinstance(then, str):  # Ray's own form: "module.function"
            import importlib

            module, _, name = then.rpartition(".")
            getattr(importlib.import_module(module), name)()
        elif then is not None:
            then()

    return nvrx_ipc_fix_setup
