"""``python -m nvrx_ipc_fix install-sitecustomize DIR``: the fallback where ``.pth`` files are
not read (an install reachable only through ``PYTHONPATH``, ``pip install --target``).

Python imports the first ``sitecustomize`` on ``sys.path`` and only that one, so the file
written here activates the package and then runs the ``sitecustomize`` it hides (the next
one on ``sys.path``), as ddtrace's bootstrap does; it still does that after the package is
uninstalled.
"""

import os

MARKER = "# nvrx-ipc-fix sitecustomize"

TEMPLATE = f"""{MARKER}: written by `python -m nvrx_ipc_fix install-sitecustomize`.
# Activates nvrx_ipc_fix at interpreter start-up (NVRX_IPC_FIX_AUTO=0 turns this off), then
# runs the sitecustomize that this file hides. Delete this file to undo.
import os
import sys

try:
    _deps = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_nvrx_ipc_fix_deps")
    if os.path.isdir(_deps) and _deps not in sys.path:  # a bundle's wrapt and packaging:
        sys.path.append(_deps)  # last, so that the environment's own copies win
    import _nvrx_ipc_fix_startup

    _nvrx_ipc_fix_startup.run("sitecustomize")
except Exception:  # noqa: BLE001 a broken install must not stop Python
    pass


def _run_hidden_sitecustomize():
    here = os.path.dirname(os.path.abspath(__file__))
    saved, this = sys.path[:], sys.modules.pop(__name__, None)
    sys.path[:] = [p for p in saved
                   if not (isinstance(p, str) and os.path.abspath(p or os.curdir) == here)]
    try:
        import sitecustomize  # noqa: F401  (the next one on sys.path, if any)
    except ImportError as exc:
        if exc.name != "sitecustomize":
            raise
    finally:
        sys.path[:] = saved
        if this is not None:  # site finds the hidden module, or this one if none
            sys.modules.setdefault(__name__, this)


_run_hidden_sitecustomize()
"""


def install(directory):
    """Write ``directory/sitecustomize.py``; return ``(exit code, message)``. Never raises
    for a bad path: a missing directory is made, anything else is reported."""
    if not str(directory).strip():  # it would mean the current directory: a usage error
        return 2, "DIR is empty: name the directory to write sitecustomize.py into."
    target = os.path.abspath(directory)
    if os.path.exists(target) and not os.path.isdir(target):
        return 1, f"{target} is not a directory; nothing changed."
    path = os.path.join(target, "sitecustomize.py")
    try:
        if os.path.lexists(path):
            with open(path, encoding="utf-8", errors="replace") as existing:
                if not existing.read().startswith(MARKER):
                    return 1, (
                        f"{path} exists and is not ours; not touched. Use a directory "
                        "earlier on sys.path: the file written there runs this one."
                    )
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "w", encoding="utf-8") as out:
            out.write(TEMPLATE)
    except OSError as exc:
        return 1, f"cannot write {path}: {exc.strerror or exc}; nothing changed."
    return 0, (
        f"wrote {path}: processes whose sys.path has {os.path.dirname(path)} ahead of "
        "any other sitecustomize activate nvrx_ipc_fix at start-up (source "
        "'sitecustomize') and still run the sitecustomize it hides."
    )
