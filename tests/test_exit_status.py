"""A dead worker's exit status, read by two threads at once: the monitor thread's read (after
the worker's sentinel fired) and the trainer's (the watch's ``dead()``, NVRx's ``is_alive()``,
the scenario's watchdog) meet on the same process, and multiprocessing's ``Popen.poll`` is not
safe for that. From a forkserver, the second reader read EOF and stored 255 (or found the pipe
empty: a dead worker alive); from fork and spawn, its ``waitpid`` failed with ECHILD and said
None, which the monitor reports as "exit status unknown". Seen in clean-clone CI runs as
"exit code 255" for a SIGKILLed worker and for one that called ``os._exit(3)``. Here a barrier
releases two readers at once, many times over, and every read names the signal; the processes
the package was not given keep Python's ``poll``. End to end, two readers of the real worker's
status are made to meet inside CPython's read (``harness.races``), and each error names what
the worker died of."""

import textwrap

import pytest

from conftest import needs_nvrx, run_python, scenario

CHILD = """
    import json, os, signal, threading, time
    from multiprocessing import connection, popen_fork, popen_forkserver
    from nvrx_ipc_fix.worker import monitor

    def killed(start):
        process = start()
        os.kill(process.pid, signal.SIGKILL)
        connection.wait([process.sentinel])  # dead, as the monitor thread first sees it
        return process

    def race(process, first, second):
        barrier, got = threading.Barrier(2), [None, None]

        def read(k, how):
            barrier.wait()  # both threads poll at once
            got[k] = how(process)

        threads = [threading.Thread(target=read, args=(k, how))
                   for k, how in enumerate((first, second))]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        return got, process.exitcode
"""


def _run(code):
    return run_python(textwrap.dedent(CHILD) + textwrap.dedent(code), timeout=300, fresh=True)


def test_two_threads_read_a_killed_forkserver_child_s_exit_code_at_once_and_both_get_sigkill():
    """A child of the package's forkserver (the standby's, the tests' harness's): both reads
    find the status pipe readable. Before: 134 of 200 rounds had a read of 255 or None. The
    forkserver processes the user starts keep Python's ``poll``."""
    found = _run("""
        import multiprocessing
        from nvrx_ipc_fix.worker.private_forkserver import Context

        def starter(context):
            def start():
                process = context.Process(target=time.sleep, args=(60,), daemon=True)
                process.start()
                return process
            return start
        started = starter(Context())
        seen = [race(killed(started), lambda p: p.exitcode, lambda p: p.exitcode)
                for _ in range(200)]
        other = killed(starter(multiprocessing.get_context("forkserver")))
        print(json.dumps({"seen": seen, "other_kept": "poll" not in vars(other._popen),
                          "class_kept": popen_forkserver.Popen.poll.__code__.co_filename ==
                                        popen_forkserver.__file__}))
    """)
    bad = [(reads, final) for reads, final in found["seen"] if reads != [-9, -9] or final != -9]
    assert bad == [], f"{len(bad)} of {len(found['seen'])} rounds: {bad[:5]}"
    assert found["other_kept"] and found["class_kept"]


@pytest.mark.parametrize("method, rounds", [("fork", 300), ("spawn", 200)])
def test_the_monitor_s_read_of_a_killed_child_gets_sigkill_while_another_thread_polls(
    method, rounds
):
    """NVRx's workers are spawned (megatron-core's forked): the monitor's read
    (``monitor.exitcode``: a join, then the code) beside another thread's non-blocking poll.
    That one may still find the child not reaped (None: Python's answer before the kernel's);
    the monitor's, which waits for the reap, never. Before: 43 of 300 fork rounds and 35 of 200
    spawn rounds gave the monitor None. A process the package was not given keeps Python's
    ``poll``."""
    found = _run(f"""
        import multiprocessing

        context = multiprocessing.get_context({method!r})
        def plain():
            process = context.Process(target=time.sleep, args=(60,), daemon=True)
            process.start()
            return process
        def started():
            return monitor.started_process(plain())  # how the package comes to a worker
        seen = []
        for _ in range({rounds}):
            seen.append(race(killed(started), monitor.exitcode, lambda p: p.exitcode))
        other = killed(plain)
        print(json.dumps({{"seen": seen, "other_kept": "poll" not in vars(other._popen),
                          "class_kept": popen_fork.Popen.poll.__code__.co_filename ==
                                        popen_fork.__file__}}))
    """)
    bad = [
        (reads, final)
        for reads, final in found["seen"]
        if reads[0] != -9 or reads[1] not in (None, -9) or final != -9
    ]
    assert bad == [], f"{len(bad)} of {len(found['seen'])} rounds: {bad[:5]}"
    assert found["other_kept"] and found["class_kept"]


@needs_nvrx
@pytest.mark.worker
def test_the_error_of_a_killed_worker_names_sigkill_while_two_threads_read_its_status(tmp_path):
    """The real worker, from the harness's forkserver, killed by SIGKILL and then ended by
    ``os._exit(3)`` while writing: the monitor thread and the trainer's finalize read its
    status, and are made to meet inside CPython's read (``harness.races``). Each error names
    what the worker died of, no two reads met, and the save after each loads. Before: both
    errors said "exit code 255"."""
    met = tmp_path / "met"
    report = scenario(
        ["save", "fault-kill", "save", "fault-exit", "save"],
        timeout=30,
        prelude=f"from harness import races; races.status_readers_meet({str(met)!r})",
    )
    assert report["hang"] is None, report["stderr"]
    words = {"kill": "(killed by SIGKILL)", "exit": "(exit code 3)"}
    for outcome in report["faults"]:
        error = outcome["error"]
        assert error["type"] == "CheckpointWorkerError" and outcome["raised_in"] == "finalize"
        assert words[outcome["fault"]] in error["message"], error
    assert [s["stale"] for s in report["saves"] if not s.get("lost")] == [0, 0, 0]
    assert not met.exists(), met.read_text()  # one reader at a time
