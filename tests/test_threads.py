"""The package's records written from several threads: the trainer's, the resume's and
prewarm's threads, a user's own (issue 36). Each registry is locked where a thread reads it
whole while another writes it."""

from conftest import run_python


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
