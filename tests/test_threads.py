"""The package's records written from several threads: the trainer's, the resume's and
prewarm's threads, a user's own (issue 36). Each registry is locked where a thread reads it
whole while another writes it."""

import pytest

from conftest import needs_nvrx, run_python


def test_the_exit_handler_reads_the_callers_while_another_thread_adds_one():
    """``workers.at_exit`` walks every caller the watch knows while a thread (a prewarm, a
    resume, a save of the user's) may register one: before the lock, the walk raised
    ``RuntimeError: dictionary changed size during iteration`` and the exit stopped no
    worker (NVRx 0.4.1/0.5.0's non-daemonic workers then hang the exit)."""
    errors = run_python("""
        import json, sys, threading
        from nvrx_ipc_fix.worker import registry as workers

        sys.setswitchinterval(1e-6)

        class Caller:  # the registry keys callers by weak reference only
            pass

        alive, stop, errors = [], threading.Event(), []

        def register():
            while not stop.is_set():
                caller = Caller()
                alive.append(caller)
                workers.state(caller)
                if len(alive) > 2000:
                    del alive[:1000]

        def walk():
            for _ in range(3000):
                try:
                    workers.at_exit()
                except Exception as exc:
                    errors.append(repr(exc))
                    return

        adder = threading.Thread(target=register)
        adder.start()
        walker = threading.Thread(target=walk)
        walker.start()
        walker.join()
        stop.set()
        adder.join()
        print(json.dumps(errors))
    """)
    assert errors == []


@needs_nvrx
@pytest.mark.worker
def test_a_release_from_another_thread_while_a_save_runs_waits_and_every_save_loads(tmp_path):
    """One thread saves (schedule, finalize), another releases (``flush``: its request to the
    one worker), at once, on NVRx's real worker. Before the queue's lock, the release's
    request and the save's met in the worker: the save failed ("the checkpoint worker died
    while writing it") and the release read the save's answer ("the worker answered 2
    instead of our request"). Now each waits for the other: no call raises, no release
    reports an error, and every save loads with current values. One race is left
    (docs/limitations.md): a release that lands between a save's planning (NVRx's
    ``prepare_write_data`` chose to send only the cache key) and its schedule drops the cache
    the key names; that save then fails loudly, one ``CheckpointWorkerError`` ("Worker cache
    miss"), and the saves after it load. Seen once in four clean-clone runs."""
    report = run_python(f"""
        import json, threading, time
        import nvrx_ipc_fix
        from harness import scenario

        trainer = scenario.Trainer({str(tmp_path)!r}, n_tensors=8)
        saves, errors, released = [], [], []

        def save():
            for _ in range(6):  # on after a failed save, as a training loop goes on
                try:
                    _, _, path, version = trainer.save()
                    saves.append((path, version))
                except BaseException as exc:
                    errors.append(repr(exc))

        def release():
            try:
                for _ in range(6):
                    released.append(nvrx_ipc_fix.release(strategy="flush").error)
                    time.sleep(0.05)
            except BaseException as exc:
                errors.append(repr(exc))

        threads = [threading.Thread(target=save), threading.Thread(target=release)]
        [t.start() for t in threads]
        [t.join(120) for t in threads]
        stale = [trainer.stale_tensors(path, version) for path, version in saves]
        print(json.dumps({{"errors": errors, "stale": stale, "released": released,
                          "alive": [t.is_alive() for t in threads]}}))
        trainer.close()
    """, fresh=True)
    assert report["alive"] == [False, False], report
    lost = [e for e in report["errors"] if e.startswith("CheckpointWorkerError(")
            and "Worker cache miss" in e]
    assert report["errors"] == lost and len(lost) <= 1, report  # the race above, loud
    assert report["released"] == [None] * 6, report
    assert len(report["stale"]) == 6 - len(lost) and set(report["stale"]) <= {0}, report
