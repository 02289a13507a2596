"""Saves in flight at once in one process, on NVRx's real worker: each save's write results
reach its own finalize (``own_results``).

NVRx collects the write results of every save of a process through one queue, and a
finalize takes whatever result is first. Here two trainers (a model ``A`` of 8 tensors and
``B`` of 3 other tensors, as a model and its EMA) save at once, and files
(``harness.gates``) make ``B``'s write put its results before ``A``'s; then ``A`` is
finalized, then ``B``. Without the fix each finalize writes the other save's results into
its metadata: the checkpoint does not load (``KeyError: MetadataIndex(fqn='A0', ...)``) and
nothing is raised. A save counts only when it loads with every value current.
"""

import pytest

from conftest import NVRX, lacks, needs_nvrx, run_python, scenario

pytestmark = [needs_nvrx, pytest.mark.worker]

TRAINERS = """
    import json, os, tempfile, threading
    import nvrx_ipc_fix
    from harness import gates, scenario

    directory = tempfile.mkdtemp()
    # elements per tensor: 512, or as a run on a GPU asks (NVRX_TESTS_NUMEL; BENCHMARKS.md)
    NUMEL = int(os.environ.get("NVRX_TESTS_NUMEL", "512"))

    def trainer(name, count, **options):
        os.makedirs(os.path.join(directory, name))
        made = scenario.Trainer(os.path.join(directory, name), n_tensors=count, numel=NUMEL,
                                starts="forkserver", **options)
        made.names = [f"{name}{i}" for i in range(count)]  # what each loads back
        made.replace()
        return made

    def outcome(made, path, version):
        \"\"\"0: the checkpoint loads, every value current; else what is wrong.\"\"\"
        try:
            return made.stale_tensors(path, version)
        except BaseException as exc:  # torch's CheckpointException is a BaseException
            return "unloadable: " + str(exc).strip().splitlines()[-1][:200]

    def finalized(made, queue_of=None):
        \"\"\"Finalize ``made``'s pending saves; each one's outcome, or what was raised.\"\"\"
        try:
            made.finalize()
        except BaseException as exc:
            done = ["raised: " + " ".join(str(exc).split())[-400:] for _ in made.pending]
        else:
            done = [outcome(made, path, version) for path, version in made.pending]
        made.pending.clear()
        return done

    def b_first(a, b, tag):
        \"\"\"A's write waits until B's is done, so B's results are put first.\"\"\"
        gate, done = (os.path.join(directory, f"{name}-{tag}") for name in ("gate", "done"))
        a.gate, b.gate = (gate, None), (None, done)
        a.save(wait=False)
        b.save(wait=False)
        gates.wait_for(done)
        gates.open_gate(gate)
"""

#: Each call NVRx's ``prepare_write_data`` and ``retrieve_write_results`` get, counted beneath
#: where the package's wrappers go (it activates on top when ``TRAINERS`` imports it).
COUNTED = """
    import functools, importlib
    writers = importlib.import_module(
        "nvidia_resiliency_ext.checkpointing.async_ckpt.filesystem_async").FileSystemWriterAsync
    calls = {}

    def count(name):
        original = vars(writers)[name]

        @functools.wraps(original)
        def counted(*args, **kwargs):
            calls[name] = calls.get(name, 0) + 1
            return original(*args, **kwargs)
        setattr(writers, name, counted)

    for name in ("prepare_write_data", "retrieve_write_results"):
        count(name)
"""

ONE_THREAD = (
    COUNTED
    + TRAINERS
    + """
    a, b = trainer("A", 8), trainer("B", 3)
    out = []
    for turn in range(3):
        b_first(a, b, turn)
        out += finalized(a) + finalized(b)
    a.close(); b.close()
    fix = [str(f.state) for f in nvrx_ipc_fix.status().fixes if f.name == "own_results"]
    print(json.dumps({"out": out, "fix": fix, "calls": calls}))
"""
)


@pytest.mark.parametrize("fix", [False, True], ids=["without", "with"])
def test_two_persistent_queues_each_finalize_takes_its_own_results(fix):
    """Two persistent queues, one thread, both saves in flight, ``A`` finalized first, three
    rounds. Without the fix (named off) saves return normally and do not load. NVRx's
    methods beneath the fix's wrappers run once a save."""
    env = None if fix else {"NVRX_IPC_FIX_DISABLE": "own_results"}
    report = run_python(ONE_THREAD, env=env, timeout=240)
    assert report["calls"] == {"prepare_write_data": 6, "retrieve_write_results": 6}, report
    if fix:
        assert report["out"] == [0] * 6 and report["fix"] == ["active"], report
    else:
        assert report["fix"] == ["disabled"], report
        assert any(str(o).startswith("unloadable") for o in report["out"]), report
        assert not any(str(o).startswith("raised") for o in report["out"]), report  # silent


NOT_PERSISTENT = (
    TRAINERS
    + """
    a, b = trainer("A", 8, cached=False), trainer("B", 3, cached=False)
    queue = a.core.AsyncCallsQueue(persistent=False)  # a process forked for each save
    for made in (a, b):
        made.queue.close()
        made.queue = queue
    out = []
    for turn in range(2):
        b_first(a, b, turn)  # the later save finishes first
        out += finalized(a) + finalized(b)  # a's finalize finalizes both, in order
    queue.close()
    print(json.dumps({"out": out}))
"""
)


@pytest.mark.parametrize("fix", [False, True], ids=["without", "with"])
def test_a_queue_that_forks_a_process_per_save_with_two_saves_in_flight(fix):
    """``AsyncCallsQueue(persistent=False)``: two saves in flight, the later one finishing
    first. Without the fix they take each other's results as well."""
    env = None if fix else {"NVRX_IPC_FIX_DISABLE": "own_results"}
    report = run_python(NOT_PERSISTENT, env=env, timeout=240)
    if fix:
        assert report["out"] == [0] * 4, report
    else:
        assert any(str(o).startswith("unloadable") for o in report["out"]), report


THREADS = (
    TRAINERS
    + """
    trainers = {"A": trainer("A", 8), "B": trainer("B", 3)}
    saved, errors = {name: [] for name in trainers}, []

    def loop(name):
        made = trainers[name]
        try:
            for _ in range(4):
                _, _, path, version = made.save()
                saved[name].append((path, version))
        except BaseException as exc:
            errors.append(repr(exc))

    threads = [threading.Thread(target=loop, args=(name,)) for name in trainers]
    [t.start() for t in threads]
    [t.join(180) for t in threads]
    out = {name: [outcome(trainers[name], *save) for save in saves]
           for name, saves in saved.items()}
    [made.close() for made in trainers.values()]
    print(json.dumps({"out": out, "errors": errors, "alive": [t.is_alive() for t in threads]}))
"""
)


def test_two_threads_each_saving_on_its_own_queue():
    """Two threads, each with its own persistent queue, save and finalize in a loop. The
    order of their writes and finalizes is the threads' (without the fix, 1 run in 3 lost a
    save under load); every save loads."""
    report = run_python(THREADS, timeout=300)
    assert report == {"out": {"A": [0] * 4, "B": [0] * 4}, "errors": [], "alive": [False, False]}, (
        report
    )


NO_QUEUE = """
    from nvrx_ipc_fix.core import shapes

    def own_results_queue(writer, made=None):
        raise RuntimeError("no queue of its own (test)")

    shapes.own_results_queue = own_results_queue  # the package's own defect
    import warnings
    caught = []  # every RuntimeWarning of the fix, each time it is given
    warnings.simplefilter("always")
    warnings.showwarning = lambda message, category, *_: caught.append(
        str(message) if category is RuntimeWarning and "own_results" in str(message) else None)
"""
REPORT = """
    state = nvrx_ipc_fix.status().fix("own_results")
    print(json.dumps({"out": out, "warnings": [w for w in caught if w], "state": str(state.state),
                      "reason": state.reason}))
"""


def test_without_a_queue_of_its_own_a_save_is_nvrx_s_with_one_warning():
    """The fix cannot make a queue (forced): NVRx's shared queue stays, one RuntimeWarning,
    ``status()`` says why; saves one at a time load, as they do with NVRx alone."""
    report = run_python(
        NO_QUEUE
        + TRAINERS
        + """
    a = trainer("A", 8)
    out = [outcome(a, *a.save()[2:]) for _ in range(3)]
    a.close()
    """
        + REPORT,
        timeout=240,
    )
    assert report["out"] == [0] * 3, report
    assert len(report["warnings"]) == 1, report
    assert "no queue of its own (test)" in report["warnings"][0], report
    assert report["state"] == "error", report
    assert "no queue of its own (test)" in report["reason"], report


def test_without_queues_of_their_own_saves_in_flight_at_once_raise():
    """The same, with two saves in flight at once on the shared queue: the package cannot
    tell whose results are whose, so each finalize raises instead of writing the other's
    metadata; saves one at a time after that load."""
    report = run_python(
        NO_QUEUE
        + TRAINERS
        + """
    a, b = trainer("A", 8), trainer("B", 3)
    out = []
    b_first(a, b, 0)
    out += finalized(a) + finalized(b)
    for _ in range(2):  # one at a time
        for made in (a, b):
            made.save(wait=False)
            out += finalized(made)
    a.close(); b.close()
    """
        + REPORT,
        timeout=240,
    )
    raised = report["out"][:2]
    assert all(o.startswith("raised") and "cannot be told from another's" in o for o in raised), (
        report
    )
    assert report["out"][2:] == [0] * 4, report
    assert len(report["warnings"]) == 1 and report["state"] == "error", report


ABORTED = (
    TRAINERS
    + """
    import inspect
    a = trainer("A", 8)
    done = os.path.join(directory, "done")
    a.gate = (None, done)
    a.save(wait=False)
    gates.wait_for(done)  # its write is done and its results are in their queue
    a.queue.close(abort=True)  # an in-process restart aborts it, never finalized
    b = trainer("B", 3)  # the restarted job's queue and state
    out = [outcome(b, *b.save()[2:]) for _ in range(2)]
    b.close()
    print(json.dumps({"out": out}))
"""
)


@pytest.mark.skipif(NVRX == "0.4.1", reason=lacks("has no close(abort=True)"))
@pytest.mark.parametrize("fix", [False, True], ids=["without", "with"])
def test_a_save_after_an_aborted_one_takes_its_own_results(fix):
    """An in-process restart (Megatron-Bridge's) aborts a save whose write is done but not
    finalized; the next job's saves, on a new queue, load. Without ``own_results`` the next
    save's finalize takes the aborted save's results from NVRx's one queue and its checkpoint
    does not load, silently: what Megatron-Bridge PR #5842 fixes in Bridge by resetting
    NVRx's results queue after an abort."""
    env = None if fix else {"NVRX_IPC_FIX_DISABLE": "own_results"}
    report = run_python(ABORTED, env=env, timeout=240)
    if fix:
        assert report["out"] == [0, 0], report
    else:
        assert str(report["out"][0]).startswith("unloadable"), report


@pytest.mark.parametrize("fix", [False, True], ids=["without", "with"])
def test_the_save_in_flight_when_the_manager_dies_raises_once_and_the_next_saves_load(fix):
    """NVRx's results-queue manager SIGKILLed (the OOM killer) while a save is in flight:
    that save's finalize raises once (its results cannot come back), a second finalize raises
    nothing, and the saves after it start a new manager and load. Without the package NVRx
    waits for ever (0.4.1-0.7.0)."""
    report = scenario(
        ["save", "save-async", "kill-manager", "finalize", "save?", "save?"], fix=fix, timeout=60
    )
    assert report["saves"][0]["stale"] == 0, report
    if not fix:
        assert report["hang"] is not None and report["hang"]["step"] >= 3, report
        return
    assert report["hang"] is None, report
    fault = report["faults"][0]
    assert fault["error"] is not None and fault["again"] is None, fault
    assert [call["error"] for call in report["calls"]] == [None, None], report["calls"]
    assert [save["stale"] for save in report["saves"][2:]] == [0, 0], report["saves"]


AHEAD = """
    import collections, json, tempfile, threading
    from multiprocessing import managers
    import nvrx_ipc_fix
    from harness import scenario
    from nvidia_resiliency_ext.checkpointing.async_ckpt import filesystem_async as fs

    made = collections.Counter()  # queues made by NVRx's manager, by thread
    queue = managers.SyncManager.Queue

    def counted(self, *args, **kwargs):
        made[threading.current_thread().name] += 1
        return queue(self, *args, **kwargs)

    managers.SyncManager.Queue = counted
    trainer = scenario.Trainer(tempfile.mkdtemp(), n_tensors=4, numel=256, starts="forkserver")
    out = []
    for _ in range(5):
        _, _, path, version = trainer.save()
        out.append(trainer.stale_tensors(path, version))
    shared = (getattr(fs, "get_write_results_queue", None) or fs._get_write_results_queue)()
    held = shared._manager._number_of_objects()
    trainer.close()
    print(json.dumps({"out": out, "made": made, "held": held}))
"""


def test_the_next_save_s_queue_is_made_off_the_training_thread():
    """After the first save, no queue is made on the training thread: the fix's thread made
    it after the previous save, and lets each finalized save's queue go. The manager holds
    NVRx's queue and at most the next save's and the last save's (not yet let go)."""
    report = run_python(AHEAD, timeout=300)
    assert report["out"] == [0] * 5, report
    assert report["made"].get("MainThread", 0) <= 2, report  # NVRx's own; the first save's
    assert report["made"].get("nvrx_ipc_fix results queues", 0) >= 4, report
    assert report["held"] <= 3, report


def test_the_new_manager_becomes_nvrx_s_own():
    """After NVRx's manager died, the new one is NVRx's: ``get_write_results_queue()`` (or
    0.4.1's and 0.5.0's ``_get_write_results_queue()``) gives a queue of it, which works."""
    found = run_python(
        """
        import json, os, signal, tempfile
        from harness import scenario
        from nvrx_ipc_fix.core import shapes
        from nvidia_resiliency_ext.checkpointing.async_ckpt import filesystem_async as fs

        trainer = scenario.Trainer(tempfile.mkdtemp(), n_tensors=4, numel=256,
                                   starts="forkserver")
        trainer.save()
        first = shapes.results_manager_process(fs)
        os.kill(first.pid, signal.SIGKILL)
        first.join()
        _, _, path, version = trainer.save()
        queue = (getattr(fs, "get_write_results_queue", None) or fs._get_write_results_queue)()
        queue.put("ok")
        print(json.dumps({"stale": trainer.stale_tensors(path, version), "got": queue.get(),
                          "new": shapes.results_manager_process(fs).pid != first.pid}))
        trainer.close()
    """,
        timeout=300,
    )
    assert found == {"stale": 0, "got": "ok", "new": True}, found


def test_a_forked_child_makes_its_own_queues_and_leaves_the_parent_s():
    """After saves (the fix's thread has the next queue ready), a child of ``os.fork()``
    gives its own writer a queue of a manager of its own, through a thread of its own, and
    exits at once, though a thread of the parent's held ``multiprocessing``'s lock of
    proxies at the fork (as the fix's thread does while it makes a queue); the parent's
    next saves take theirs and load."""
    found = run_python(
        """
        import json, multiprocessing, os, tempfile, threading, time
        from multiprocessing import managers
        from harness import scenario
        from nvrx_ipc_fix.fixes import own_results

        trainer = scenario.Trainer(tempfile.mkdtemp(), n_tensors=4, numel=256,
                                   starts="forkserver")
        out = [trainer.stale_tensors(*trainer.save()[2:]) for _ in range(2)]
        answer, tell = os.pipe()
        held, done = threading.Event(), threading.Event()

        def hold():  # as the fix's thread may hold it, making a queue, at the fork
            with managers.BaseProxy._mutex:
                held.set()
                done.wait()

        threading.Thread(target=hold, daemon=True).start()
        held.wait()
        pid = os.fork()
        done.set()
        if pid == 0:
            manager = None
            try:
                manager = multiprocessing.get_context("fork").Manager()

                class Writer:
                    results_queue = manager.Queue()

                writer = Writer()
                own_results.prepare_write_data_wrapper(lambda: None, writer, (), {})
                writer.results_queue.put("mine")
                got = own_results.retrieve_write_results_wrapper(
                    writer.results_queue.get_nowait, writer, (), {})
                threads = [t.name for t in threading.enumerate()]
                os.write(tell, json.dumps([got, threads.count(
                    "nvrx_ipc_fix results queues")]).encode())
            except BaseException as exc:
                os.write(tell, json.dumps([repr(exc), None]).encode())
            finally:
                if manager is not None:  # the test's own: os._exit runs no exit handler
                    manager.shutdown()
                os._exit(0)
        deadline = time.monotonic() + 60
        while not os.waitpid(pid, os.WNOHANG)[0]:
            if time.monotonic() > deadline:
                os.kill(pid, 9)
                raise AssertionError("the child did not exit: it waits for a lock")
            time.sleep(0.05)
        child = json.loads(os.read(answer, 65536))
        out += [trainer.stale_tensors(*trainer.save()[2:]) for _ in range(2)]
        trainer.close()
        print(json.dumps({"child": child, "out": out}))
    """,
        timeout=300,
    )
    assert found == {"child": ["mine", 1], "out": [0] * 4}, found
