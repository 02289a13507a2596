"""Putting one wrapper in place and taking it out (``lifecycle`` decides which, and when).

A target is found in its module (``Class.attr``) and checked: a plain function whose first
parameters are the ones its wrapper expects. The wrapper is a ``wrapt.FunctionWrapper``
switched by ``Patch.enabled``; names bound by ``from X import f`` before the patch are pointed
at it (a target's ``aliases``). Taken out, the original goes back, or, where someone wrapped
on top, the wrapper is only switched off. wrapt and ``inspect`` are imported when a target is
checked or installed, never at activation.
"""

import importlib
import sys


class Patch:
    """One installed wrapper and what it replaced."""

    __slots__ = ("owner", "name", "original", "wrapper", "enabled", "aliases")

    def __init__(self, owner, name, original):
        self.owner = owner  # the class or module that holds the attribute
        self.name = name
        self.original = original  # the raw attribute from owner.__dict__
        self.wrapper = None
        self.enabled = True
        self.aliases = []  # [(module, name)] bound by `from X import f`, redirected by us

    def is_enabled(self):
        return self.enabled


def problem(target, module):
    """Why ``target`` cannot be wrapped in ``module`` as it is, or None."""
    import inspect

    original = _resolve(module, target.attr)[2]
    if original is None:
        return "not found"
    function = original.__func__ if isinstance(original, staticmethod) else original
    if not inspect.isfunction(function):
        return f"expected a plain function, found {type(original).__name__}"
    found = tuple(inspect.signature(function).parameters)[: len(target.params)]
    if found != target.params:
        return f"its parameters {found} are not the expected {target.params}"
    return None


def wrapper_of(target):
    """The target's wrapper function (importing wrapt and its fix module), or the exception
    that raised: ``install`` raises it."""
    try:
        importlib.import_module("wrapt")  # install uses it under lifecycle's lock
        module_name, function = target.wrapper.split(":")
        return getattr(importlib.import_module(f"nvrx_ipc_fix.{module_name}"), function)
    except Exception as exc:
        return exc


def install(target, wrapper, module):
    """Wrap ``target`` in ``module`` with ``wrapper`` (from ``wrapper_of``); returns the
    ``Patch``."""
    patch = Patch(*_resolve(module, target.attr))
    if isinstance(wrapper, Exception):
        raise wrapper
    import wrapt  # imported by wrapper_of

    patch.wrapper = wrapt.FunctionWrapper(patch.original, wrapper, patch.is_enabled)
    setattr(patch.owner, patch.name, patch.wrapper)
    if target.aliases:
        patch.aliases = _redirect_aliases(patch.original, patch.wrapper, skip=patch.owner)
    return patch


def remove(patch):
    """Put the original back (True), or, where someone wrapped on top, switch the wrapper
    off (False: it stays in their chain)."""
    if vars(patch.owner).get(patch.name) is not patch.wrapper:
        patch.enabled = False
        return False
    setattr(patch.owner, patch.name, patch.original)
    for module, alias in patch.aliases:
        if vars(module).get(alias) is patch.wrapper:
            setattr(module, alias, patch.original)
    return True


def _resolve(module, attr):
    owner = module
    *parents, name = attr.split(".")
    for part in parents:
        owner = getattr(owner, part, None)
    return owner, name, None if owner is None else vars(owner).get(name)


def _redirect_aliases(original, wrapper, skip):
    """Point names bound by ``from X import f`` before the patch at the wrapper."""
    redirected = []
    for module in list(sys.modules.values()):
        try:
            names = [k for k, v in vars(module).items() if v is original]
        except TypeError:  # not a module (some packages put other objects in sys.modules)
            continue
        for alias in names:
            if module is not skip:
                setattr(module, alias, wrapper)
                redirected.append((module, alias))
    return redirected
