"""Post-import hooks with the standard library alone.

wrapt's ``register_post_import_hook`` would do, but ``import wrapt`` 2.x imports asyncio
and costs more than a whole interpreter start-up on a small machine, so activation
registers hooks here and wrapt is imported only when a target module has been imported.
Semantics follow wrapt's: a hook runs once, right after its module executes, or at once
if the module is already imported; a failing hook never breaks the import. As in wrapt, the
registry is locked and no hook runs under that lock.
"""

from __future__ import annotations

import _thread
import sys

from . import fork as _fork

TYPE_CHECKING = False  # typing.TYPE_CHECKING, without importing typing
if TYPE_CHECKING:
    from collections.abc import Callable
    from types import ModuleType

_hooks: dict[str, list[Callable[[ModuleType], object]]] = {}  # module name -> [callable(module)]
#: _hooks: registered by activation, taken by the importer
_lock = _fork.renewed(_thread.allocate_lock())
_searching = _thread._local()  # .names: what this thread's finder is looking up (re-entry)


def when_imported(name, hook):
    """Run ``hook(module)`` after ``name`` is imported, or now if it already is."""
    with _lock:  # an import that ends meanwhile finds the hook, or we find its module
        module = sys.modules.get(name)
        if module is None:
            _hooks.setdefault(name, []).append(hook)
            if _FINDER not in sys.meta_path:
                sys.meta_path.insert(0, _FINDER)
            return
    now_or_when_ready(module, hook)


def now_or_when_ready(module, hook):
    """``hook(module)`` now, or, while the module is still executing (imported in another
    thread, or partway through a circular import), from a helper thread once it is done."""
    if not getattr(getattr(module, "__spec__", None), "_initializing", False):
        _call(hook, module)
        return
    import threading
    import time

    def wait():
        while getattr(module.__spec__, "_initializing", False):
            time.sleep(0.01)
        if sys.modules.get(module.__name__) is module:
            _call(hook, module)

    threading.Thread(
        target=wait, name=f"nvrx_ipc_fix: after import {module.__name__}", daemon=True
    ).start()


def _call(hook, module):
    try:
        hook(module)
    except Exception as exc:  # noqa: BLE001 the user's import must not fail because of us
        from .log import warn_once

        warn_once(
            ("import-hook", module.__name__),
            "nvrx_ipc_fix: hook for %s failed: %s",
            module.__name__,
            exc,
        )


class _Finder:
    """A meta-path finder that only decorates the loader of hooked modules."""

    def find_spec(self, fullname, path=None, target=None):
        searching = getattr(_searching, "names", None)
        if searching is None:
            searching = _searching.names = set()
        if fullname not in _hooks or fullname in searching:
            return None
        searching.add(fullname)
        try:
            for finder in sys.meta_path:
                find = getattr(finder, "find_spec", None)
                if finder is self or find is None:
                    continue
                spec = find(fullname, path, target)
                if spec is not None:
                    break
            else:
                return None
        finally:
            searching.discard(fullname)
        if spec.loader is not None and hasattr(spec.loader, "exec_module"):
            spec.loader = _Loader(spec.loader)
        return spec


class _Loader:
    """Runs the real loader, puts it back on the module, then fires the hooks."""

    def __init__(self, loader):
        self._loader = loader

    def __getattr__(self, name):
        return getattr(self._loader, name)

    def create_module(self, spec):
        create = getattr(self._loader, "create_module", None)
        return create(spec) if create is not None else None

    def exec_module(self, module):
        module.__loader__ = self._loader
        if getattr(module, "__spec__", None) is not None:
            module.__spec__.loader = self._loader
        self._loader.exec_module(module)
        name = module.__spec__.name if module.__spec__ is not None else module.__name__
        with _lock:
            hooks = _hooks.pop(name, ())
        for hook in hooks:
            _call(hook, sys.modules.get(name, module))


_FINDER = _Finder()
