"""The package's records written from several threads: the trainer's, the resume's and
prewarm's threads, a user's own. Each registry is locked where a thread reads it whole while
another writes it. A release from another thread never lands inside a save: it waits for a
save's schedule (the queue's lock) and for a save planned to send only a cache key (until its
schedule), or raises before it touches anything; each race is driven with events."""

import pytest

from conftest import needs_cache, needs_nvrx, run_python


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
    instead of our request"). Before a release waited for a save planned to send only the
    cache key, one landing between that planning and its schedule dropped the cache the key
    names: that save failed ("Worker cache miss"; once in four clean-clone runs). Now no
    call raises, no release reports an error, and every save loads with current values."""
    report = run_python(
        f"""
        import json, threading, time
        import nvrx_ipc_fix
        from harness import scenario

        trainer = scenario.Trainer({str(tmp_path)!r}, n_tensors=8, starts="forkserver")
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
    """,
        fresh=True,
    )
    assert report["alive"] == [False, False], report
    assert report["errors"] == [], report
    assert report["released"] == [None] * 6, report
    assert report["stale"] == [0] * 6, report


# A trainer whose next save pauses (``planned`` set) until ``go``: at its schedule, after its
# planning (``AT_SCHEDULE``), or inside NVRx's ``prepare_write_data``, as torch's planner
# resolves the first item, once NVRx has looked up the cache key (``IN_PLANNING``);
# ``in_frame`` (``harness.stacks``): is a thread inside a function of that name now.
PAUSED = """
    import json, sys, threading, time
    import nvrx_ipc_fix
    from harness import scenario
    from harness.stacks import in_frame
    from torch.distributed.checkpoint import DefaultSavePlanner

    def until(predicate, what, bound=120.0):
        deadline = time.monotonic() + bound
        while not predicate():
            if time.monotonic() > deadline:
                raise AssertionError(f"not {{what}} after {{bound}} s")
            time.sleep(0.01)

    trainer = scenario.Trainer({path!r}, n_tensors=4, starts="forkserver")
    versions, errors = [], []
    for _ in range(2):  # the worker caches: the next save plans to send only the key
        versions.append(trainer.save()[2:])
    planned, go = threading.Event(), threading.Event()

    def pause(real):
        def paused(*args, **kwargs):
            if not planned.is_set():
                planned.set()
                go.wait(120)
            return real(*args, **kwargs)
        return paused

    def save():
        try:
            versions.append(trainer.save()[2:])
        except BaseException as exc:
            errors.append(repr(exc))

    {where}
    saver = threading.Thread(target=save, name="saver")
    saver.start()
    assert planned.wait(120)
"""
AT_SCHEDULE = "trainer.queue.schedule_async_request = pause(trainer.queue.schedule_async_request)"
IN_PLANNING = "DefaultSavePlanner.resolve_data = pause(DefaultSavePlanner.resolve_data)"


@needs_cache
@pytest.mark.worker
@pytest.mark.parametrize("where", [AT_SCHEDULE, IN_PLANNING], ids=["at-schedule", "in-planning"])
def test_a_release_from_another_thread_waits_for_a_save_planned_to_send_only_its_key(
    tmp_path, where
):
    """The race that the queue's lock alone did not cover: the save's planning chose to send
    only the cache key; a release from another thread now would drop the cache the key names
    (the worker then dies of "Worker cache miss"). Driven with events: the release, started
    while the save is paused between its planning and its schedule, or inside the planning
    once NVRx has looked up the key, does not end before the save is let go (on cb7b335 it
    did at the schedule, and before the plan was recorded ahead of NVRx's planning it did
    inside it; the save failed); then both end, the release reports no error and every save
    loads."""
    report = run_python(
        PAUSED.format(path=str(tmp_path), where=where)
        + """
    released = []
    releaser = threading.Thread(target=lambda: released.append(
        nvrx_ipc_fix.release(strategy="flush").error), name="releaser")
    releaser.start()
    until(lambda: in_frame(releaser, "releasing_region") or not releaser.is_alive(),
          "waiting or done")
    waited = releaser.is_alive()
    go.set()
    saver.join(120); releaser.join(120)
    versions.append(trainer.save()[2:])
    print(json.dumps({"waited": waited, "errors": errors, "released": released,
                      "stale": [trainer.stale_tensors(p, v) for p, v in versions]}))
    trainer.close()
    """,
        fresh=True,
    )
    assert report["waited"], report
    assert report["errors"] == [] and report["released"] == [None], report
    assert report["stale"] == [0, 0, 0, 0], report


@needs_cache
@pytest.mark.worker
def test_a_release_that_cannot_wait_for_a_planned_save_raises_and_touches_nothing(tmp_path):
    """A save planned to send only its key and not scheduled within the release's timeout:
    the release from another thread raises one clear error, naming the planned save's thread,
    before it touches anything: the worker keeps its cache, so that save, let go afterwards,
    is saved, and so are the ones after it."""
    report = run_python(
        PAUSED.format(path=str(tmp_path), where=AT_SCHEDULE)
        + """
    outcome = []
    def release():
        try:
            outcome.append(repr(nvrx_ipc_fix.release(strategy="flush", timeout=0.5)))
        except BaseException as exc:
            outcome.append(f"{type(exc).__name__}: {exc}")
    releaser = threading.Thread(target=release, name="releaser")
    releaser.start(); releaser.join(120)
    releases = nvrx_ipc_fix.status().releases
    go.set(); saver.join(120)
    versions.append(trainer.save()[2:])
    print(json.dumps({"outcome": outcome, "releases": releases, "errors": errors,
                      "saver": saver.ident,
                      "stale": [trainer.stale_tensors(p, v) for p, v in versions]}))
    trainer.close()
    """,
        fresh=True,
    )
    (outcome,) = report["outcome"]
    assert outcome.startswith("RuntimeError: nvrx_ipc_fix: release() waited 0.5 s"), outcome
    assert str(report["saver"]) in outcome and "nothing was released" in outcome, outcome
    assert report["releases"] == 0 and report["errors"] == [], report
    assert report["stale"] == [0, 0, 0, 0], report


@needs_cache
@pytest.mark.worker
def test_a_suspend_release_from_another_thread_waits_for_the_schedule_it_meets(tmp_path):
    """A ``suspend`` release from another thread that arrives while a save is inside its
    schedule (here: paused in prewarm's step, after the worker was resumed and before NVRx
    hands the save over) waits for that schedule: the queue's lock covers every step of it.
    Before, suspend's resume check ran outside the watch's lock, so the release could suspend
    the worker right before the save was handed to it. Then the release suspends the worker,
    the next save resumes it, and every save loads. The CUDA driver is the stand-in
    (``harness.fakedriver``: lock = SIGSTOP)."""
    report = run_python(
        f"""
    import json, sys, threading, time
    import nvrx_ipc_fix
    from harness import fakedriver, scenario
    from harness.stacks import in_frame
    from nvrx_ipc_fix.worker import prewarm

    driver = fakedriver.install()
    trainer = scenario.Trainer({str(tmp_path)!r}, n_tensors=4, starts="forkserver")
    versions, errors, released = [trainer.save()[2:]], [], []
    inside, go = threading.Event(), threading.Event()
    take_over = prewarm.take_over

    def paused(queue):
        inside.set()
        go.wait(120)
        return take_over(queue)

    def save():
        try:
            versions.append(trainer.save()[2:])
        except BaseException as exc:
            errors.append(repr(exc))

    prewarm.take_over = paused
    saver = threading.Thread(target=save)
    saver.start()
    assert inside.wait(120)
    releaser = threading.Thread(target=lambda: released.append(
        nvrx_ipc_fix.release(strategy="suspend")))
    releaser.start()
    deadline = time.monotonic() + 120
    while not (in_frame(releaser, "holding") or not releaser.is_alive()):
        assert time.monotonic() < deadline
        time.sleep(0.01)
    waited = releaser.is_alive()
    go.set()
    saver.join(120); releaser.join(120)
    prewarm.take_over = take_over
    suspended = released[0].worker_suspended
    versions.append(trainer.save()[2:])
    print(json.dumps({{"waited": waited, "errors": errors, "suspended": suspended,
                      "calls": [name for name, _ in driver.calls],
                      "stale": [trainer.stale_tensors(p, v) for p, v in versions]}}))
    trainer.close()
    """,
        fresh=True,
    )
    assert report["waited"], report
    assert report["errors"] == [] and report["suspended"], report
    assert report["calls"][:5] == ["state", "lock", "checkpoint", "restore", "unlock"], report
    assert report["stale"] == [0, 0, 0], report


@needs_cache
@pytest.mark.worker
def test_a_save_that_meets_a_failed_resume_waits_until_the_worker_is_ended(tmp_path):
    """The resume of a suspended worker fails (the stand-in's restore fails): the worker is
    killed and its queue's next save starts a fresh one. A save that arrives while that is
    under way (paused here inside ``suspend._end``) must wait for it; before, the resume
    forgot the suspension first, so such a save was handed to the worker about to be killed,
    and failed."""
    report = run_python(
        f"""
    import json, sys, threading, time
    import nvrx_ipc_fix
    from harness import fakedriver, scenario
    from harness.stacks import in_frame
    from nvrx_ipc_fix.worker import suspend

    fakedriver.install(["restore-fails"])
    trainer = scenario.Trainer({str(tmp_path)!r}, n_tensors=4, starts="forkserver")
    versions, errors = [trainer.save()[2:]], []
    assert nvrx_ipc_fix.release(strategy="suspend").worker_suspended
    ending, go = threading.Event(), threading.Event()
    end = suspend._end

    def paused(*args, **kwargs):
        ending.set()
        go.wait(120)
        return end(*args, **kwargs)

    suspend._end = paused
    suspend.resume(wait=False)  # the onload: restore fails, the worker is to be ended
    assert ending.wait(120)

    def save():
        try:
            versions.append(trainer.save()[2:])
        except BaseException as exc:
            errors.append(repr(exc))

    saver = threading.Thread(target=save)
    saver.start()
    deadline = time.monotonic() + 120
    while not (in_frame(saver, "ready") or in_frame(saver, "schedule_async_call")
               or not saver.is_alive()):
        assert time.monotonic() < deadline
        time.sleep(0.01)
    waited = in_frame(saver, "ready")
    go.set()
    saver.join(120)
    suspend._end = end
    versions.append(trainer.save()[2:])
    print(json.dumps({{"waited": waited, "errors": errors,
                      "stale": [trainer.stale_tensors(p, v) for p, v in versions]}}))
    trainer.close()
    """,
        fresh=True,
    )
    assert report["waited"], report
    assert report["errors"] == [], report
    assert report["stale"] == [0, 0, 0], report


@needs_cache
@pytest.mark.worker
def test_a_release_from_another_thread_finalizes_on_the_device_the_saves_were_made_on(tmp_path):
    """``release()`` from a thread of its own, with a save pending, runs NVRx's finalize
    all-reduce; NVRx builds its tensor on the current CUDA device, which in a new thread is
    device 0 whatever the rank's. The stand-in: each thread's current device (the training
    thread's is 1, as rank 1's of a node), faked in torch.cuda, and the device current at
    each all-reduce. Before, the release's all-reduce ran on device 0."""
    report = run_python(
        f"""
    import contextlib, json, threading
    import torch
    import nvrx_ipc_fix
    from harness import scenario

    trainer = scenario.Trainer({str(tmp_path)!r}, n_tensors=4, starts="forkserver")
    local, seen = threading.local(), []
    torch.cuda.is_initialized = lambda: True
    torch.cuda.current_device = lambda: torch.device("cpu", getattr(local, "device", 0))

    @contextlib.contextmanager
    def device(chosen):
        before, local.device = getattr(local, "device", 0), chosen.index
        try:
            yield
        finally:
            local.device = before

    torch.cuda.device = device
    reduce = torch.distributed.all_reduce

    def all_reduce(tensor, *args, **kwargs):
        seen.append([threading.current_thread().name, getattr(local, "device", 0)])
        return reduce(tensor, *args, **kwargs)

    torch.distributed.all_reduce = all_reduce
    local.device = 1
    versions = [trainer.save()[2:], trainer.save(wait=False)[2:]]
    del seen[:]
    out = []
    releaser = threading.Thread(target=lambda: out.append(
        nvrx_ipc_fix.release(strategy="flush").error), name="releaser")
    releaser.start(); releaser.join(120)
    versions.append(trainer.save()[2:])
    print(json.dumps({{"seen": seen, "out": out,
                      "stale": [trainer.stale_tensors(p, v) for p, v in versions]}}))
    trainer.close()
    """,
        fresh=True,
    )
    by_release = [device for thread, device in report["seen"] if thread == "releaser"]
    assert by_release and set(by_release) == {1}, report
    assert report["out"] == [None], report
    assert report["stale"] == [0, 0, 0], report
