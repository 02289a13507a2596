"""``python -m nvrx_ipc_fix bundle DIR``: the package as a directory to put on ``PYTHONPATH``,
for processes that run from an environment it is not installed in (NeMo RL's per-actor uv
environments, an image you cannot change).

``DIR`` gets the package, its start-up module, the ``sitecustomize.py`` of
``install-sitecustomize`` and, in ``DIR/_nvrx_ipc_fix_deps``, copies of this environment's
wrapt and packaging. That sitecustomize appends the copies to the *end* of ``sys.path``,
so an environment's own wrapt and packaging win. Everything is copied from this
environment, offline; wrapt's C extension loads only on the same Python minor version,
elsewhere wrapt runs its pure-Python code.
"""

import importlib.util
import os
import shutil
from importlib import metadata

from .sitecustomize import MARKER, install

DEPS_DIR = "_nvrx_ipc_fix_deps"
#: Distributions copied into DEPS_DIR; wrapt is required (it does the patching).
DEPS = ("wrapt", "packaging")
STARTUP = "_nvrx_ipc_fix_startup"
_SKIP = shutil.ignore_patterns("__pycache__", "*.pyc")


def bundle(directory):
    """Write the bundle into ``directory``; return ``(exit code, message)``.

    ``directory`` must be absent, empty, or a bundle written before (then it is refreshed);
    an empty name is refused with exit code 2 (it would mean the current directory).
    """
    if not str(directory).strip():
        return 2, "DIR is empty: name the directory to write the bundle into; nothing written."
    target = os.path.abspath(directory)
    if os.path.exists(target) and not os.path.isdir(target):
        return 1, f"{target} exists and is not a directory; not touched."
    if os.path.isdir(target) and os.listdir(target) and not _is_bundle(target):
        return 1, (
            f"{target} is not empty and holds no bundle of nvrx-ipc-fix; not touched. "
            "Use a new directory."
        )
    package = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # cli/..
    startup = importlib.util.find_spec(STARTUP)
    if os.path.dirname(package) == target:
        return 1, f"{target} is where this copy of nvrx-ipc-fix runs from; not touched."
    if startup is None:
        return 1, f"{STARTUP}.py is not importable here; install nvrx-ipc-fix from its wheel."
    sources = _sources()
    missing = [name for name, source in sources if source is None]
    if "wrapt" in missing:
        return 1, (
            "wrapt is not installed in this environment; install nvrx-ipc-fix with "
            "its dependencies first."
        )
    try:
        os.makedirs(target, exist_ok=True)
        for name in ("nvrx_ipc_fix", DEPS_DIR):
            shutil.rmtree(os.path.join(target, name), ignore_errors=True)
        shutil.copytree(package, os.path.join(target, "nvrx_ipc_fix"), ignore=_SKIP)
        shutil.copy2(startup.origin, target)
        for _name, files in sources:
            for relative, source in files or ():
                path = os.path.join(target, DEPS_DIR, relative)
                os.makedirs(os.path.dirname(path), exist_ok=True)
                shutil.copy2(source, path)
        code, message = install(target)
    except OSError as exc:
        return 1, f"cannot write the bundle into {target}: {exc}"
    if code:
        return code, message
    skipped = f" ({', '.join(missing)} not installed here: not bundled)" if missing else ""
    return 0, (
        f"wrote a bundle of nvrx-ipc-fix into {target}{skipped}. Processes whose "
        f"PYTHONPATH starts with it activate the package at start-up (source "
        f"'sitecustomize'):\n  export PYTHONPATH={target}${{PYTHONPATH:+:$PYTHONPATH}}"
    )


def _is_bundle(target):
    try:
        with open(os.path.join(target, "sitecustomize.py"), encoding="utf-8") as ours:
            return ours.read(len(MARKER)) == MARKER and os.path.isdir(
                os.path.join(target, "nvrx_ipc_fix")
            )
    except OSError:
        return False


def _sources():
    """``[(distribution, [(relative path, absolute source)] or None)]`` for DEPS."""
    found = []
    for name in DEPS:
        try:
            files = metadata.distribution(name).files
        except metadata.PackageNotFoundError:
            files = None
        if files is not None:
            files = [
                (str(f), str(f.locate()))
                for f in files
                if not str(f).startswith("..")
                and "__pycache__" not in f.parts
                and os.path.isfile(f.locate())
            ]
        found.append((name, files))
    return found
