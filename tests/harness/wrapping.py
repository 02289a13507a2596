"""What wraps an attribute: every wrapt wrapper in its chain, and the steps of the package's
one wrapper among them (``core.dispatch.Dispatch``), outermost first. Imports nothing of the
package (importing it would activate it)."""

DISPATCH = ("nvrx_ipc_fix.core.dispatch", "Dispatch")


def chain(owner, name, stop=None):
    """``{"depth": wrappers above the original (or above ``stop``), "ours": how many of them
    are the package's, "steps": the fixes in the package's, in the call's order}``."""
    f, depth, ours, steps = vars(owner).get(name), 0, 0, []
    while hasattr(f, "__wrapped__") and f is not stop:
        wrapper = getattr(f, "_self_wrapper", None)
        if (type(wrapper).__module__, type(wrapper).__name__) == DISPATCH:
            ours += 1
            steps = [fix for fix in wrapper.call.order if fix in wrapper.steps]
        f, depth = f.__wrapped__, depth + 1
    return {"depth": depth, "ours": ours, "steps": steps}
