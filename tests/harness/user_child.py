"""A child that the user's own code starts with ``multiprocessing``, and what it saw: the
package's forkservers must leave the user's (and the default context) as Python has them.
Standard library only.

The child's target is ``builtins.exec`` of a few lines (pickled by name), so that it imports
nothing of the package's or a test's: what it has imported came from where it was started.
It answers through a pipe of its context, which travels as a forkserver's children's
descriptors do."""

#: The modules whose presence in the child is reported.
WATCHED = ("torch", "nvidia_resiliency_ext", "nvrx_ipc_fix")

_REPORT = """
import os, sys
answer.send({"pid": os.getpid(), "parent": os.getppid(), "variable": os.environ.get(variable),
             "imported": [m for m in watched if m in sys.modules]})
answer.close()
"""


def start(context, variable, watched=WATCHED, timeout=60.0):
    """Start a child from ``context`` (``multiprocessing.get_context(...)``), wait for it, and
    return what it saw: its pid and parent, ``variable``'s value in its environment, which
    of ``watched`` it has imported, its start method and its exit code (one that does not
    answer within ``timeout`` s is killed: ``answered`` False)."""
    reader, writer = context.Pipe(duplex=False)
    child = context.Process(
        target=exec,
        name="user-child",
        daemon=True,
        args=(_REPORT, {"answer": writer, "variable": variable, "watched": list(watched)}),
    )
    child.start()
    writer.close()
    try:
        seen = reader.recv() if reader.poll(timeout) else {}
    except EOFError:
        seen = {}
    finally:
        reader.close()
    child.join(timeout)
    if child.exitcode is None:
        child.kill()
        child.join()
    return dict(
        seen, answered=bool(seen), method=context.get_start_method(), exitcode=child.exitcode
    )
