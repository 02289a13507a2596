"""A process that has imported torch once, and forks a child for each test child that would
otherwise be a fresh interpreter importing it again (about 8 s of a 2-core VM's CPU each).
``conftest.py`` uses it where the child's start-up is not what the test is about: the same
Python, no interpreter flags, no start-up activation, and no ``PYTHON*`` variable of the
child's own (those act at an interpreter's start).

A forked child is a ``python -c`` as far as the code it runs can tell: ``__main__`` is a
fresh module without a file (so a spawned child imports no main module), ``sys.argv`` is
``["-c", ...]``, ``sys.path[0]`` is ``""``, the environment and working directory are the
test's, its output goes to the test's files, and it ends as the interpreter's exit does but for
the module teardown (``_exit``; the exit tests, whose subject that is, start fresh
interpreters). It leads a new session, so that a test's timeout kills its whole group. The zygote
imports neither NVRx (0.04 s after torch) nor ``nvrx_ipc_fix`` (it runs with start-up activation
off): each child imports them in the order its code does, as a fresh interpreter would. The
preloaded heap is frozen (``gc.freeze``): the children's collections do not walk, and so do not
copy, torch's objects.

Protocol, one JSON object per line: request ``{"code", "argv", "env", "cwd", "out",
"err"}`` on stdin (the child's ``sys.argv`` is ``["-c", *argv]``);
replies ``{"pid"}`` once the child runs and ``{"pid", "rc"}`` once it exited (``rc`` as
``subprocess``'s ``returncode``). Children run concurrently (two ranks of a test).
"""

import builtins
import json
import os
import select
import sys
import types

PRELOAD = ("torch", "torch.distributed", "torch.distributed.checkpoint", "torch.multiprocessing")


def main():
    import gc
    import importlib

    for name in PRELOAD:
        try:
            importlib.import_module(name)
        except ImportError:  # not in this env (no torch): the children import what they need
            pass
    gc.collect()
    gc.freeze()
    _reply({"ready": True})
    running, buffer = set(), b""
    while True:
        ready = select.select([0], [], [], 0.05 if running else None)[0]
        if ready:
            chunk = os.read(0, 65536)
            if not chunk:
                break  # the test session ended
            buffer += chunk
            while b"\n" in buffer:
                line, buffer = buffer.split(b"\n", 1)
                pid = _fork(json.loads(line))
                running.add(pid)
                _reply({"pid": pid})
        for pid in list(running):
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                running.discard(pid)
                _reply({"pid": pid, "rc": os.waitstatus_to_exitcode(status)})


def _reply(message):
    os.write(1, (json.dumps(message) + "\n").encode())


def _fork(request):
    os.environ["PYTEST_CURRENT_TEST"] = request["env"].get("PYTEST_CURRENT_TEST", "-")
    pid = os.fork()
    if pid == 0:
        _child(request)  # never returns
    return pid


def _child(request):
    os.setsid()
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    for fd, path in ((1, request["out"]), (2, request["err"])):
        out = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        os.dup2(out, fd)
        os.close(out)
    main_module = types.ModuleType("__main__")
    main_module.__builtins__ = builtins
    sys.modules["__main__"] = main_module
    sys.argv, sys.path[0] = ["-c", *request.get("argv", ())], ""
    import tempfile

    tempfile.tempdir = None  # read TMPDIR again
    code = 0
    try:
        exec(compile(request["code"], "<string>", "exec"), main_module.__dict__)
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) or exc.code is None else 1
        if exc.code is not None and not isinstance(exc.code, int):
            print(exc.code, file=sys.stderr)
    except BaseException:  # noqa: BLE001 the child's failure goes to its stderr, as Python's would
        import traceback

        traceback.print_exc()
        code = 1
    _exit(code or 0)


def _exit(code):
    """The interpreter's exit up to its module teardown: threads joined, ``atexit`` handlers
    run (multiprocessing's stops and joins its children), output flushed. The teardown of a
    process that imported torch (1.2 s of CPU here) is skipped."""
    import atexit
    import threading

    threading._shutdown()
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:  # noqa: BLE001 a closed stream: the child exits all the same
            pass
    os._exit(code)


if __name__ == "__main__":
    main()
