"""Ray: a worker setup hook that cannot stop a worker, and the ``runtime_env`` that carries it.

Ray runs a job's ``worker_process_setup_hook`` in every worker of the job, whatever
environment (``py_executable``) the worker runs from. The string form
``"nvrx_ipc_fix.ray_worker_setup"`` must be importable there: where it is not, the worker
dies before its first task ("Failed to execute the setup hook method"). The hook made here
is a closure, which Ray's cloudpickle sends by value, so unpickling it imports nothing; in a
worker without the package it does nothing, and says so on stderr when NVRx is importable
there (checkpoints saved in that worker run without the fix).
"""

import os


def ray_runtime_env(runtime_env=None):
    """``runtime_env`` (a dict; a new one if ``None``) with this package's Ray setup hook and
    this process's ``NVRX_IPC_FIX_*`` variables; returns a new dict::

        ray.init(runtime_env=nvrx_ipc_fix.ray_runtime_env({"env_vars": {...}}))

    Variables already in ``env_vars`` are kept. A ``worker_process_setup_hook`` already there
    (a callable or a ``"module.function"`` string) still runs, after this package's, and its
    errors are Ray's as before. Ray takes the hook from the job's ``runtime_env`` only
    (``ray.init``, job submission), not from an actor's or a task's options.
    """
    env = dict(runtime_env or {})
    env_vars = dict(env.get("env_vars") or {})
    for name, value in os.environ.items():
        if name.startswith("NVRX_IPC_FIX_"):
            env_vars.setdefault(name, value)
    if env_vars:
        env["env_vars"] = env_vars
    env["worker_process_setup_hook"] = _hook(env.get("worker_process_setup_hook"))
    return env


def _hook(then):
    if then is not None and not (callable(then) or isinstance(then, str)):
        raise TypeError(f"worker_process_setup_hook must be a callable or a string, got "
                        f"{type(then).__name__}")

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
                        f"Check with `python -m nvrx_ipc_fix doctor --python {sys.executable}`\n")
            except Exception:
                pass
        except Exception:  # a broken install: never stop the worker
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
