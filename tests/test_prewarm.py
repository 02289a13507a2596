"""Prewarm on the real NVRx worker: the worker is started before the save (its pid exists
before the save is scheduled) and the save uses it, nothing is started twice, nothing of it
is alive between a ``restart`` release and the onload, and a prewarmed worker that dies
before its first save is reported while the save falls back to a normal start. Then
``prewarm()``, ``NVRX_IPC_FIX_PREWARM`` and ``strategy="restart"`` at their edges.
NeMo RL's onload points: tests/test_auto_release.py."""

import pytest

from conftest import needs_warmup, run_python, scenario

pytestmark = [needs_warmup, pytest.mark.worker]  # every test here starts real workers

# One trainer through start-up prewarm, restart at an offload, prewarm at the onload,
# offloading(strategy="restart"), a prewarm stopped while it starts, and flush left alone.
STEPS = [
    "ready",
    "save",
    "save",
    "prewarm",  # start-up prewarm; a second start refused
    "restart",
    "measure",
    "offload",
    "onload",
    "prewarm",
    "prewarm",
    "ready",
    "save",
    "probe",
    "offloading-restart",
    "ready",
    "save",
    "terminate",
    "prewarm",
    "restart",
    "measure",  # stopped while it starts
    "prewarm",
    "flush",
    "save",
]  # flush: it has had no save, nothing to release


@pytest.fixture(scope="module")
def prewarmed():
    return scenario(STEPS, env={"NVRX_IPC_FIX_PREWARM": "start"})


@pytest.mark.smoke
def test_nothing_stale_and_no_hang_with_prewarmed_workers(prewarmed):
    assert prewarmed["hang"] is None, prewarmed["stderr"]
    assert [s["stale"] for s in prewarmed["saves"]] == [0] * 5
    assert prewarmed["fix"]["prewarm"] == "active"
    assert prewarmed["prewarms_total"] == 5 and prewarmed["prewarm_failures"] == 0
    assert prewarmed["log"] == []


def test_start_up_prewarm_starts_the_worker_that_takes_the_first_save(prewarmed):
    startup = prewarmed["ready"][0]
    assert startup["pid"] and startup["error"] is None and startup["ready_s"] > 0
    first, warm = prewarmed["saves"][:2]
    assert first["worker_before"] == first["worker"] == warm["worker"] == startup["pid"]


def test_the_prewarmed_worker_exists_before_the_save_and_takes_it(prewarmed):
    _, at_onload, _, block, _, before_flush = prewarmed["prewarms"]
    assert at_onload["started"] == [at_onload["pid"]] and at_onload["exists"]
    after_onload, after_block, after_flush = prewarmed["saves"][2:]
    assert after_onload["worker_before"] == after_onload["worker"] == at_onload["pid"]
    assert prewarmed["probes"][0]["pid"] == at_onload["pid"]  # it wrote the checkpoint
    assert after_flush["worker_before"] == after_flush["worker"] == before_flush["pid"]
    assert after_block["worker_before"] == after_block["worker"] == block["pid"]
    assert prewarmed["ready"][2]["pid"] == block["pid"]


def test_a_worker_is_never_started_twice(prewarmed):
    running, at_onload, again = prewarmed["prewarms"][:3]
    assert running["started"] == [] and "is running" in running["skipped"][0]
    assert again["started"] == [] and again["pid"] == at_onload["pid"]
    assert f"its prewarmed worker (pid {at_onload['pid']}) is " in again["skipped"][0]
    assert {p["workers"] for p in prewarmed["prewarms"]} == {1}  # one process, not two


def test_restart_leaves_no_worker_from_the_release_to_the_onload(prewarmed):
    assert [m["workers"] for m in prewarmed["measures"]] == [0, 0, 0]
    restart, block, _, stopped, _ = prewarmed["releases"]
    assert restart["strategy"] == block["strategy"] == "restart"
    assert restart["worker_terminated"] and block["worker_terminated"]
    assert stopped["worker_terminated"] and stopped["queues_released"] == 1
    assert stopped["seconds"] < 10  # aborted, not waited for while it started


SENT = 8 * 512 * 4  # bytes of the CUDA tensors a save sends: 8 float32 tensors of 512


def test_a_prewarmed_worker_pins_the_last_save_s_host_memory_before_it_is_ready(prewarmed):
    startup, at_onload, block = prewarmed["ready"]
    assert startup["pinning"] == 0  # the job's first worker: no save has sent anything yet
    for ready in (at_onload, block):  # reported pinned before the save was scheduled
        assert ready["pinning"] == ready["pinned_bytes"] == SENT and ready["pin_error"] is None
    assert prewarmed["releases"][0]["pin_bytes"] == SENT  # restart says what comes
    assert prewarmed["pinned_bytes"] == SENT


PIN_PRELUDE = """
    from nvrx_ipc_fix.worker import prewarm as _prewarm
    from harness import scenario as _scenario
    _scenario.EXTRA_STEPS["huge-pin"] = lambda t: _prewarm._sizes.__setitem__(t.queue,
                                                                              (1 << 62,))
"""


@pytest.fixture(scope="module", params=["on", "off", "fails"])
def pinning(request):
    """A save arrives right after the prewarm (it waits for the pinning); the setting off;
    a pinning that fails (more host memory than there is)."""
    steps = ["save", "save", "restart", "prewarm", "prewarm", "save", "probe"]
    if request.param == "fails":
        steps = ["save", "huge-pin", "restart", "prewarm", "ready", "save"]
    env = {"NVRX_IPC_FIX_PIN": "off"} if request.param == "off" else None
    return request.param, scenario(steps, env=env, prelude=PIN_PRELUDE)


def test_pinning_ahead_waits_switches_off_and_fails_softly(pinning):
    case, report = pinning
    assert report["hang"] is None, report["stderr"]
    assert [s["stale"] for s in report["saves"]] == [0] * (2 if case == "fails" else 3)
    after = report["saves"][-1]
    assert after["worker_before"] == after["worker"] == report["prewarms"][0]["pid"]
    assert report["prewarms_total"] == 1  # one worker, pinned once
    warnings = [e["message"] for e in report["log"] if e["level"] == "WARNING"]
    if case == "on":
        assert report["pinned_bytes"] == report["releases"][0]["pin_bytes"] == SENT
        assert warnings == [] and report["probes"][0]["pid"] == after["worker"]
    elif case == "off":
        assert report["pinned_bytes"] == report["releases"][0]["pin_bytes"] == 0
        assert warnings == []
    else:
        assert report["ready"][0]["pin_error"] and report["pinned_bytes"] == 0
        assert len(warnings) == 1 and "pinned 0.00 of" in warnings[0], warnings
        assert "that save pins the rest as usual (NVRX_IPC_FIX_PIN=off" in warnings[0]


def test_flush_leaves_a_worker_that_has_had_no_save_alone(prewarmed):
    flush = prewarmed["releases"][-1]
    assert flush["queues_released"] == 0 and not flush["worker_terminated"]
    assert flush["skipped"][0].endswith("its worker has had no save yet: nothing to release")


# A prewarmed worker killed while it starts, a used one killed while idle (the worker
# watch's error), a prewarmed one killed after it was ready, each followed by saves.
FALLBACK = [
    "prewarm",
    "kill-worker",
    "save",
    "fault-idle",
    "save",
    "restart",
    "prewarm",
    "ready",
    "kill-worker",
    "save",
    "save",
]


@pytest.fixture(scope="module")
def fell_back():
    return scenario(FALLBACK, starts="spawn")  # a start that takes time: killed while at it


def test_a_failed_prewarm_is_reported_and_the_save_starts_a_fresh_worker(fell_back):
    assert fell_back["hang"] is None, fell_back["stderr"]
    saved = [s for s in fell_back["saves"] if not s.get("lost")]  # not the fault's save
    assert [s["stale"] for s in saved] == [0] * 4
    starting, ready = fell_back["prewarms"]
    before, _, after, _ = saved
    assert before["worker_before"] == starting["pid"] != before["worker"]
    assert after["worker_before"] == ready["pid"] != after["worker"]
    messages = [entry["message"] for entry in fell_back["log"]]
    assert [entry["level"] for entry in fell_back["log"]] == ["WARNING", "WARNING"], messages
    assert (
        f"worker (pid {starting['pid']}) died before it was ready (killed by SIGKILL)"
        in messages[0]
    )
    assert f"(pid {ready['pid']}) died after it was ready, before its first save" in messages[1]
    assert all("the next save starts a fresh worker" in m for m in messages)
    assert fell_back["prewarm_failures"] == 2


def test_a_used_worker_that_dies_is_still_the_watch_s_error(fell_back):
    (fault,) = fell_back["faults"]
    assert fault["error"]["type"] == "CheckpointWorkerError"
    assert "while idle" in fault["error"]["message"] and fault["raised_in"] == "finalize"


EDGES = """
    import functools, json, os, tempfile, threading, warnings
    import nvrx_ipc_fix
    from nvrx_ipc_fix.core import config as _config
    out = {}

    def type_error(value):
        try:
            nvrx_ipc_fix.prewarm(value)
        except TypeError as exc:
            return str(exc)

    BAD = [0, -1, float("nan"), float("inf"), 10 ** 100, "", "queue", object()]
    out["no_nvrx"] = list(nvrx_ipc_fix.prewarm().skipped)
    out["bad_no_nvrx"] = [type_error(v) for v in BAD]
    values = ["", "0", "off", "Never", "START", " on ", "1", "sometimes", "sometimes"]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for value in values:
            os.environ["NVRX_IPC_FIX_PREWARM"] = value
            out.setdefault("env", []).append(_config.prewarm_at_start())
    out["env_warnings"] = [str(w.message) for w in caught]
    os.environ["NVRX_IPC_FIX_PREWARM"] = "start"
    import torch.distributed as dist
    from nvidia_resiliency_ext.checkpointing.async_ckpt import core
    out["bad_nvrx"] = [type_error(v) for v in BAD]
    out["no_queue"] = list(nvrx_ipc_fix.prewarm().skipped)
    from nvrx_ipc_fix.cli import fakecuda
    early = core.AsyncCallsQueue(persistent=True, cpu_shm_mode=True)  # start-up: too early
    fakecuda.mark_queue(early)  # it stands in for a GPU queue: a restart stops its worker
    out["no_dist"] = list(nvrx_ipc_fix.prewarm(early).skipped)
    out["early_slot"] = core.AsyncCallsQueue._warmup_persistent_caller is not None
    dist.init_process_group("gloo", rank=0, world_size=1,
                            init_method=f"file://{tempfile.mkdtemp()}/pg")
    out["temporal"] = list(nvrx_ipc_fix.prewarm(core.AsyncCallsQueue(persistent=False)).skipped)
    reports = []
    threads = [threading.Thread(target=lambda: reports.append(nvrx_ipc_fix.prewarm(early)))
               for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    out["threads_started"] = sorted(len(r.started) for r in reports)
    warm_up, warm_ups = core.AsyncCallsQueue.__dict__["warmup_persistent_caller"], []

    @functools.wraps(warm_up.__func__)
    def counted(cls, *args, **kwargs):  # NVRx's own warm-up, each call recorded
        warm_ups.append([list(args), {k: v for k, v in kwargs.items() if k != "rank"},
                         kwargs.get("rank")])
        return warm_up.__func__(cls, *args, **kwargs)

    core.AsyncCallsQueue.warmup_persistent_caller = classmethod(counted)
    late = core.AsyncCallsQueue(persistent=True, cpu_shm_mode=True)  # start-up: NVRx's slot
    out["warm_ups"] = list(warm_ups)
    slot = core.AsyncCallsQueue._warmup_persistent_caller
    out["late_slot"] = slot.process.pid
    out["late_again"] = list(nvrx_ipc_fix.prewarm(late).skipped)
    core.AsyncCallsQueue.warmup_persistent_caller(0, cpu_shm_mode=True)  # Megatron's, next
    out["warm_up_not_doubled"] = core.AsyncCallsQueue._warmup_persistent_caller is slot
    worker = early.persistent_caller.process
    out["restart_case"] = nvrx_ipc_fix.release(early, strategy=" RESTART ").strategy
    out["stopped_by_restart"] = worker.exitcode is not None
    try:
        with nvrx_ipc_fix.offloading(early, strategy="restart"):
            raise ValueError("inference failed")
    except ValueError:
        out["no_prewarm_after_a_failed_block"] = early.persistent_caller
    with nvrx_ipc_fix.offloading(early, strategy="restart"):
        pass
    worker = early.persistent_caller.process
    nvrx_ipc_fix.deactivate()
    out["stopped_by_deactivate"] = worker.exitcode is not None
    out["after_deactivate"] = list(nvrx_ipc_fix.prewarm(early).skipped)
    os.environ["NVRX_IPC_FIX_DISABLE"] = "prewarm"
    nvrx_ipc_fix.activate()
    out["disabled"] = list(nvrx_ipc_fix.prewarm(early).skipped)
    out["state"] = str(nvrx_ipc_fix.status().fix("prewarm").state)
    early.close()
    late.close()
    print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def edges():
    return run_python(EDGES, timeout=180)  # NVRx not imported at first (conftest.run_python)


def test_prewarm_refuses_what_is_not_a_queue(edges):
    message = "queue must be an NVRx AsyncCallsQueue or None, not "
    names = ["int", "int", "float", "float", "int", "str", "str", "object"]
    assert edges["bad_no_nvrx"] == edges["bad_nvrx"] == [message + n for n in names]


def test_prewarm_says_why_it_started_nothing(edges):
    assert edges["no_nvrx"] == ["all: NVRx is not imported"]
    assert edges["no_queue"] == ["queues: no live AsyncCallsQueue"]
    assert edges["no_dist"][0].endswith(
        "torch.distributed is not initialized: the worker's "
        "rank, hence its device, is not known yet"
    )
    assert not edges["early_slot"]  # NVRX_IPC_FIX_PREWARM=start waited for it too
    assert edges["temporal"][0].endswith("not persistent (NVRx starts a process for each save)")
    assert (
        edges["after_deactivate"]
        == edges["disabled"]
        == ["all: the prewarm fix is not active (see nvrx_ipc_fix.status())"]
    )
    assert edges["state"] == "disabled"


def test_prewarm_from_several_threads_starts_one_worker(edges):
    assert edges["threads_started"] == [0, 0, 0, 1]


def test_start_up_prewarm_fills_nvrx_s_warm_up_slot_once(edges):
    assert edges["late_slot"] and edges["warm_up_not_doubled"]
    assert edges["late_again"][0].endswith(
        f"the prewarmed worker in NVRx's warm-up slot (pid {edges['late_slot']}) is starting"
    )


def test_start_up_prewarm_is_nvrx_s_own_warm_up_called_once(edges):
    """Wrap, never re-implement: NVRx's ``warmup_persistent_caller``, with the queue's
    settings, not a copy of it."""
    ((args, kwargs, rank),) = edges["warm_ups"]
    assert (args[:1] or [rank]) == [0] and kwargs["cpu_shm_mode"] is True, edges["warm_ups"]


def test_restart_stops_the_unused_worker_and_prewarms_only_after_a_normal_block(edges):
    assert edges["restart_case"] == "restart" and edges["stopped_by_restart"]
    assert edges["no_prewarm_after_a_failed_block"] is None
    assert edges["stopped_by_deactivate"]


def test_prewarm_setting_values(edges):
    assert edges["env"] == [False, False, False, False, True, True, True, False, False]
    assert edges["env_warnings"] == [
        "nvrx_ipc_fix: NVRX_IPC_FIX_PREWARM='sometimes' is not start or off; using off"
    ]


INTERRUPTED = """
    import json, signal, tempfile, time
    import nvrx_ipc_fix
    from nvrx_ipc_fix.worker import prewarm as _prewarm
    from harness import scenario
    from nvidia_resiliency_ext.checkpointing.async_ckpt import core
    out = {}
    with tempfile.TemporaryDirectory() as d:
        t = scenario.Trainer(d, 4, 256)
        original = core.PersistentAsyncCaller._start_worker

        def interrupted(self, rank):  # Ctrl-C right after the spawn
            original(self, rank)
            raise KeyboardInterrupt

        core.PersistentAsyncCaller._start_worker = interrupted
        try:
            nvrx_ipc_fix.prewarm(t.queue)
        except KeyboardInterrupt:
            out["start"] = "interrupted"
        core.PersistentAsyncCaller._start_worker = original
        out["left_behind"] = scenario.checkpoint_workers()
        pid = nvrx_ipc_fix.prewarm(t.queue).started[0]

        def ctrl_c(*_):
            raise KeyboardInterrupt

        signal.signal(signal.SIGALRM, ctrl_c)
        take_over = _prewarm.take_over

        def armed(queue):  # Ctrl-C while the save waits for the worker to start
            signal.setitimer(signal.ITIMER_REAL, 0.2)
            return take_over(queue)

        _prewarm.take_over = armed
        try:
            t.save()
        except KeyboardInterrupt:
            out["save"] = "interrupted"
        _prewarm.take_over = take_over
        out["saves"] = []
        for _ in range(2):
            _, _, path, version = t.save()
            out["saves"].append([t.workers, t.stale_tensors(path, version)])
        out["pid"] = pid
        t.close()
    print(json.dumps(out))
"""


def test_interrupted_prewarm_and_interrupted_wait_leave_nvrx_usable():
    result = run_python(INTERRUPTED, timeout=180)
    assert result["start"] == "interrupted" and result["left_behind"] == []
    assert result["save"] == "interrupted"
    pid = result["pid"]
    assert result["saves"] == [[[pid, pid], 0], [[pid, pid], 0]]  # full tensors resent
