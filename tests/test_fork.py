"""A child the trainer makes with ``os.fork()`` (not through multiprocessing): it gets fresh
locks and no record of the parent's workers, whatever thread held the locks at the fork."""

from conftest import run_python


LOCKS = """
    import json, os, threading
    import nvrx_ipc_fix
    from nvrx_ipc_fix.core import lifecycle, log, monitor
    from nvrx_ipc_fix.fixes import prewarm, worker_watch

    class Caller:  # an entry in the package's own records of callers
        pass

    caller = Caller()
    worker_watch._state(caller)
    prewarm._starts[caller] = "a worker started here"
    LOCKS = ["lifecycle._lock", "log._lock", "prewarm._lock", "prewarm._reported",
             "monitor._monitor.lock"]
    held, done = threading.Event(), threading.Event()

    def hold():  # another thread holds every lock when the main thread forks
        locks = [eval(name) for name in LOCKS]
        for lock in locks:
            lock.acquire()
        held.set()
        done.wait()

    threading.Thread(target=hold, daemon=True).start()
    held.wait()
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:
        found = {"free": [name for name in LOCKS if eval(name).acquire(timeout=1)],
                 "callers": len(worker_watch._callers), "starts": len(prewarm._starts)}
        os.write(write, json.dumps(found).encode())
        os._exit(0)
    os.close(write)
    done.set()
    with os.fdopen(read) as answer:
        found = json.loads(answer.read())
    os.waitpid(pid, 0)
    found["parent"] = {"callers": len(worker_watch._callers), "starts": len(prewarm._starts)}
    print(json.dumps(found))
"""


def test_the_child_gets_fresh_locks_and_no_record_of_the_parent_s_workers():
    found = run_python(LOCKS)
    assert found["free"] == ["lifecycle._lock", "log._lock", "prewarm._lock",
                             "prewarm._reported", "monitor._monitor.lock"], found
    assert found["callers"] == found["starts"] == 0, found
    assert found["parent"] == {"callers": 1, "starts": 1}, found  # the parent keeps its own
