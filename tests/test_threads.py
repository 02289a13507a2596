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
        from nvrx_ipc_fix.core import workers

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
def test_two_threads_save_and_release_at_once_and_every_save_loads(tmp_path):
    """Two queues of one process (NVRx's real workers): one thread saves, the other saves and
    releases its queue, at once. Every save loads with current values, no call raises, and
    the totals count every release."""
    for name in ("a", "b"):
        (tmp_path / name).mkdir()
    report = run_python(f"""
        import json, threading
        import nvrx_ipc_fix
        from nvrx_ipc_fix.testing import scenario

        # tensor counts differ: NVRx keys its cache by the state dict's structure, in a
        # class attribute that every queue of the process shares
        saving = scenario.Trainer({str(tmp_path / "a")!r}, n_tensors=8)
        releasing = scenario.Trainer({str(tmp_path / "b")!r}, n_tensors=9)
        saves, errors = [], []

        def run(trainer, release):
            try:
                for _ in range(4):
                    _, _, path, version = trainer.save()
                    saves.append((trainer, path, version))
                    if release:
                        nvrx_ipc_fix.release(trainer.queue, strategy=release)
            except BaseException as exc:
                errors.append(repr(exc))

        threads = [threading.Thread(target=run, args=(saving, None)),
                   threading.Thread(target=run, args=(releasing, "flush"))]
        [t.start() for t in threads]
        [t.join(120) for t in threads]
        stale = [trainer.stale_tensors(path, version) for trainer, path, version in saves]
        print(json.dumps({{"errors": errors, "stale": stale, "alive": [t.is_alive() for t in threads],
                          "releases": nvrx_ipc_fix.status().releases}}))
        saving.close(); releasing.close()
    """, fresh=True)
    assert report["alive"] == [False, False] and report["errors"] == [], report
    assert report["stale"] == [0] * 8, report
    assert report["releases"] == 4
