"""Putting a call's one wrapper in place, adding and taking out the fixes' steps in it, and
taking it out (``lifecycle`` decides which, and when).

A target is found in its module (``Class.attr``) and checked: a plain function whose first
parameters are the ones its step expects. The call's wrapper is a ``wrapt.FunctionWrapper``
whose wrapper is the call's ``dispatch.Dispatch``, switched on while it holds a step; names
bound by ``from X import f`` before the patch are pointed at it (a target's ``aliases``).
With its last step out, the original goes back, or, where someone wrapped on top, the wrapper
stays in their chain, switched off, and takes steps again at the next activation. wrapt and
``inspect`` are imported when a target is checked or installed, never at activation.
"""

import importlib
import sys

from .dispatch import Dispatch
from .targets import CALLS


class Patch:
    """One call's installed wrapper and what it replaced."""

    __slots__ = ("owner", "name", "original", "wrapper", "dispatch", "aliases")

    def __init__(self, owner, name, original, call):
        self.owner = owner  # the class or module that holds the attribute
        self.name = name
        self.original = original  # the raw attribute from owner.__dict__
        self.dispatch = Dispatch(call)
        self.wrapper = None
        self.aliases = []  # [(module, name)] bound by `from X import f`, redirected by us

    @property
    def enabled(self):
        return self.dispatch.enabled()


def problem(target, module, original=None):
    """Why ``target`` cannot be wrapped in ``module`` as it is, or None. ``original``: what
    our wrapper replaced, where it is in place."""
    import inspect

    if original is None:
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


def step_of(target):
    """The target's step function (importing wrapt and its fix module), or the exception
    that raised: ``install`` raises it."""
    try:
        importlib.import_module("wrapt")  # install uses it under lifecycle's lock
        module_name, function = target.step.split(":")
        return getattr(importlib.import_module(f"nvrx_ipc_fix.{module_name}"), function)
    except (ImportError, AttributeError, ValueError) as exc:  # returned for status()
        return exc


def install(target, step, module, patch=None):
    """Add ``target``'s ``step`` (from ``step_of``) to its call's wrapper, ``patch``, or to a
    new one put in place in ``module``; returns the ``Patch``."""
    if isinstance(step, Exception):
        raise step
    if patch is None:
        patch = Patch(*_resolve(module, target.attr), CALLS[target.name])
        import wrapt  # imported by step_of

        patch.wrapper = wrapt.FunctionWrapper(patch.original, patch.dispatch, lambda: patch.enabled)
        setattr(patch.owner, patch.name, patch.wrapper)
        if target.aliases:
            patch.aliases = _redirect_aliases(patch.original, patch.wrapper, skip=patch.owner)
    patch.dispatch.add(target.fix, step)
    return patch


def remove(patch, target):
    """Take ``target``'s step out of ``patch``. With none left, put the original back (True),
    or, where someone wrapped on top, leave the wrapper in their chain, switched off (False).
    None while steps remain."""
    patch.dispatch.discard(target.fix)
    if patch.enabled:
        return None
    if vars(patch.owner).get(patch.name) is not patch.wrapper:
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
