"""What NVRx and megatron-core look like in this process: every difference between their
versions that the package relies on, decided by probes of their code (never by a version
number), and the one way each fix reaches what differs.

A probe runs when its module is imported, on the classes as they are then. Importing this
module imports nothing (activation reads the targets' probes from here).
"""

# -- the finalize collective -----------------------------------------------------------------

#: NVRx's finalize all-reduce, ``AsyncCaller.sync_all_async_calls`` (NVRx 0.4.1-0.7.0,
#: megatron-core 0.12-0.19 alike): one int per rank, summed. The worker watch's failure flag
#: rides on it (``fixes/worker_watch.py``); only this shape carries it.
COLLECTIVE = """
def sync_all_async_calls(self, is_alive):
    ten = torch.tensor([is_alive], dtype=torch.int, device=torch.cuda.current_device())
    torch.distributed.all_reduce(ten)
    return ten[0] == 0
"""
#: What the watch relies on in ``PersistentAsyncCaller.is_current_async_call_done``: it
#: takes a completion into ``cur_item`` (``get_nowait``) only while that is empty, and all-
#: reduces through ``self.sync_all_async_calls``.
CHECK_NAMES = ("cur_item", "get_nowait", "sync_all_async_calls")


def collective_problem(module):
    """Why the finalize collective of ``module`` (NVRx's core, megatron-core's async_utils)
    cannot carry the watch's failure flag, or None."""
    import inspect

    caller = module.PersistentAsyncCaller
    check, sync = (getattr(caller, name, None)
                   for name in ("is_current_async_call_done", "sync_all_async_calls"))
    if check is None or sync is None:
        return None  # the target of that name is "not found" (lifecycle)
    check = inspect.unwrap(check)
    names = getattr(getattr(check, "__code__", None), "co_names", ())
    missing = [name for name in CHECK_NAMES if name not in names]
    if missing:
        return (f"PersistentAsyncCaller.is_current_async_call_done does not use "
                f"{', '.join(missing)} as the watch expects")
    found = _body(inspect.unwrap(sync))
    if found is None or found != _body(COLLECTIVE):
        return ("its finalize collective, AsyncCaller.sync_all_async_calls, is not the one-int "
                "sum over ranks that carries the failure flag (its code changed)")
    return None


def _body(function):
    """The statements of ``function`` (or of the source text of one), docstring left out,
    with its parameter names, as comparable text; None if its source cannot be read."""
    import ast
    import inspect
    import textwrap

    try:
        source = function if isinstance(function, str) else inspect.getsource(function)
    except (OSError, TypeError):
        return None
    node = ast.parse(textwrap.dedent(source)).body[0]
    if not isinstance(node, ast.FunctionDef):
        return None
    body = node.body
    if body and isinstance(body[0], ast.Expr) and isinstance(getattr(body[0], "value", None),
                                                             ast.Constant):
        body = body[1:]
    return [arg.arg for arg in node.args.args], [ast.dump(statement) for statement in body]


def summed(call):
    """Run NVRx's ``sync_all_async_calls`` (``call()``, the shape ``COLLECTIVE``); return its
    result and the all-reduced sum, read from the tensor it made (``collective_problem``
    vouches that there is one, reduced in place)."""
    import torch
    from torch.overrides import TorchFunctionMode

    made = []

    class Tensors(TorchFunctionMode):  # this thread's calls into torch, within call() only
        def __torch_function__(self, func, types, args=(), kwargs=None):
            result = func(*args, **(kwargs or {}))
            if func is torch.tensor:
                made.append(result)
            return result

    with Tensors():
        result = call()
    return result, int(made[0][0])


def hold_reads(queue):
    """Hold ``queue``'s read lock (a multiprocessing queue's), so that a ``get_nowait`` in
    this thread finds it empty; returns what lets it go (nothing to let go where another
    reader holds it: that ``get_nowait`` finds it empty too)."""
    lock = queue._rlock
    if lock.acquire(False):
        return lock.release
    return lambda: None

