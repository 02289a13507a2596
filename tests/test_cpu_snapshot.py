"""CPU tensors changed right after the schedule, on NVRx's real worker: each checkpoint holds
the values of the save's own step (``cpu_snapshot``).

NVRx before its CPU snapshots (0.6.0, git main up to 2026-08-07) hands a CPU tensor to the
persistent worker as it is; the worker's queue moves its storage into shared memory in place
and the worker writes the trainer's live tensor, after the schedule returned. A trainer
that steps right after the schedule (its optimizer adds to a CPU-offloaded state, and to
Adam's ``step``, a scalar CPU tensor) gets a checkpoint that loads with the later values,
silently. Here each save's write waits for a file (``harness.gates``), which the trainer
makes after its step, so that the worker always writes after the change.
"""

import json

import pytest

from conftest import EXPECT, MCORE, NVRX, needs_nvrx, run_python
from nvrx_ipc_fix.core.status import SNAPSHOT_NONE

pytestmark = [needs_nvrx, pytest.mark.worker]

#: Does this NVRx copy every CPU tensor of a save itself (NVRx PR #376)?
UPSTREAM = EXPECT.get(NVRX, {}).get("snapshots")

SAVES = """
    import importlib, inspect, json, os, sys, tempfile, warnings
    from functools import partial
    import torch
    import nvrx_ipc_fix
    from harness import gates, scenario
    from nvrx_ipc_fix.cli import fakecuda
    from torch.distributed.checkpoint import DefaultSavePlanner, FileSystemReader, load

    caught = []  # the package's RuntimeWarnings, each time one is given
    warnings.simplefilter("always")
    warnings.showwarning = lambda message, category, *_: caught.append(
        str(message) if category is RuntimeWarning and "nvrx_ipc_fix" in str(message) else None)
    options = json.loads(sys.argv[1])
    directory = tempfile.mkdtemp()
    made = scenario.Trainer(directory, 1, 1, cached=False, impl=options.get("impl", "nvrx"),
                            starts="forkserver")
    queue = made.queue
    if not options.get("persistent", True):  # a process forked for each save
        queue.close()
        queue = made.core.AsyncCallsQueue(persistent=False)
    package = "nvidia_resiliency_ext.checkpointing.async_ckpt"
    if options.get("writer") == "mcore":  # megatron-core's own writer (async_strategy="mcore")
        package = "megatron.core.dist_checkpointing.strategies"
    fs = importlib.import_module(package + ".filesystem_async")
    saver = importlib.import_module(package + ".state_dict_saver")

    def state_of(count, numel=4096):
        \"\"\"An optimizer's CPU state: ``count`` tensors and Adam's scalar ``step``; with
        ``count`` > 1 a parameter on the (stand-in) device, which the worker copies itself.\"\"\"
        state = {f"exp_avg{i}": torch.zeros(numel) for i in range(count - 1)}
        state["step"] = torch.zeros(())
        if options.get("shared"):  # in shared memory already (after a save on NVRx 0.6.0's
            for tensor in state.values():  # persistent worker, or the user's own)
                tensor.share_memory_()
        if count > 1 and not options.get("sync"):  # on a GPU a CUDA tensor, sent by CUDA IPC
            # (a save run in the trainer would copy the stand-in as a device tensor: not here)
            state["weight"] = (torch.zeros(numel, device="cuda") if torch.cuda.is_available()
                               else fakecuda.on_fake_device(torch.zeros(numel)))
        return state

    def writer_for(path):
        wanted = {"cached": {"use_cached_data_structure": True},
                  "shm": {"use_cpu_shm_for_gpu_tensors": True}}.get(options.get("mode"), {})
        params = inspect.signature(fs.FileSystemWriterAsync.__init__).parameters
        assert all(name in params for name in wanted), wanted
        return fs.FileSystemWriterAsync(path, **wanted)

    def value(version, i):
        return float(version * 1000 + i)

    copied, sent_at = [], []  # per save: CPU tensors sent that are not the trainer's; where

    def sent_cpu(writer):
        \"\"\"The CPU tensors a save hands the worker afresh (outside the worker's cache).\"\"\"
        if hasattr(writer, "uncached_tensor_data"):
            sent = (writer.uncached_tensor_data or ((), ()))[1]
        else:
            sent = [t for _, _, (_, tensors) in writer.write_buckets or () for _, t in tensors]
        return [t for t in sent if t.device.type == "cpu"]

    def save(state, version):
        \"\"\"Set every tensor to its values of ``version``, plan and schedule its save, whose
        write waits for the file ``gate`` (opened by ``step``).\"\"\"
        with torch.no_grad():
            for i, tensor in enumerate(state.values()):
                tensor.fill_(value(version, i))
        path = os.path.join(directory, f"ckpt{version}")
        planned = saver.save_state_dict_async_plan(dict(state), writer_for(path), None,
                                                   planner=DefaultSavePlanner())
        writer, metadata, dist_wrapper = planned[0] if isinstance(planned[0], tuple) else planned
        save_fn, preload_fn, args = writer.get_save_function_and_args()
        gate = path + ".gate"
        finalize = partial(saver.save_state_dict_async_finalize, writer, metadata, dist_wrapper)
        if options.get("sync"):  # written in the trainer before it returns: no gate
            made.core.AsyncRequest(save_fn, args, [finalize], preload_fn=preload_fn).execute_sync()
        else:
            queue.schedule_async_request(made.core.AsyncRequest(
                partial(gates.gated, gate, path + ".done", save_fn), args, [finalize],
                preload_fn=preload_fn))
        own = {t.untyped_storage().data_ptr() for t in state.values() if t.device.type == "cpu"}
        sent = [t.untyped_storage().data_ptr() for t in sent_cpu(writer)]
        copied.append(sum(ptr not in own for ptr in sent))
        sent_at.append(sorted(sent))
        return path, gate

    def step(state, gate):
        \"\"\"The trainer's next optimizer step, in place, right after the schedule; then the
        write may run.\"\"\"
        with torch.no_grad():
            for name, tensor in state.items():
                if tensor.device.type == "cpu":
                    tensor.add_(1000.0)
        gates.open_gate(gate)

    def wrong(state, path, version):
        \"\"\"The tensors of the checkpoint at ``path`` that do not hold ``version``'s values.\"\"\"
        loaded = {name: torch.empty_like(t.as_subclass(torch.Tensor)) for name, t in state.items()}
        load(loaded, storage_reader=FileSystemReader(path), process_group=None, no_dist=True)
        return [name for i, (name, t) in enumerate(loaded.items())
                if not torch.all(t == value(version, i)).item()]
"""

ONE_SAVE = (
    SAVES
    + """
    state = state_of(options["count"])
    out = []
    for version in (1, 2, 3):  # a fresh save each time, the step right after its schedule
        path, gate = save(state, version)
        step(state, gate)
        queue.maybe_finalize_async_calls(blocking=True, no_dist=True)
        out.append(wrong(state, path, version))
    kept = nvrx_ipc_fix.status().snapshot
    queue.close()
    fix = nvrx_ipc_fix.status().fix("cpu_snapshot")
    print(json.dumps({"wrong": out, "state": str(fix.state), "reason": fix.reason,
                      "warnings": [w for w in caught if w], "copied": copied,
                      "reused": sent_at[1] == sent_at[2] == sent_at[0], "kept": kept,
                      "closed": nvrx_ipc_fix.status().snapshot}))
"""
)

LOOP = (
    SAVES
    + """
    state = state_of(options["count"])
    saved = []
    for version in range(1, 6):  # save, step, save, step, ...; finalized at the end
        path, gate = save(state, version)
        step(state, gate)
        gates.wait_for(path + ".done")  # the stand-in device's tensor is no snapshot: its
        saved.append((path, version))   # next values wait for the write (a GPU's D2H does not)
    queue.maybe_finalize_async_calls(blocking=True, no_dist=True)
    print(json.dumps({"wrong": [wrong(state, path, version) for path, version in saved]}))
    queue.close()
"""
)


def saves(code, fix, env=None, **options):
    if not fix:
        env = {"NVRX_IPC_FIX_DISABLE": "1"}
    return run_python(
        code.replace("sys.argv[1]", repr(json.dumps(options))), fix=fix, env=env, timeout=240
    )


def torn(report):
    """How many checkpoints hold a later value."""
    return sum(bool(wrong) for wrong in report["wrong"])


MODES = ["plain", "cached", "shm"]


def _mode(mode):
    if mode != "plain" and not EXPECT.get(NVRX, {}).get("cache"):
        return pytest.param(
            mode, marks=pytest.mark.skip(reason=f"NVRx {NVRX}'s writer has no {mode} mode")
        )
    return mode


@pytest.mark.parametrize("mode", [_mode(m) for m in MODES])
@pytest.mark.parametrize("count", [1, 17], ids=["one", "many"])
@pytest.mark.parametrize("fix", [False, True], ids=["without", "with"])
def test_a_cpu_tensor_changed_right_after_the_schedule_is_saved_as_scheduled(fix, count, mode):
    """One CPU tensor (Adam's ``step``), or 16 and ``step`` beside a device parameter, set to
    a save's values, scheduled, then changed in place: three saves, each loaded."""
    report = saves(ONE_SAVE, fix, count=count, mode=mode)
    if fix or UPSTREAM:
        assert torn(report) == 0, report
    else:
        assert torn(report) == 3, report  # each of them, silently
        assert all("step" in wrong for wrong in report["wrong"]), report
    if fix:
        assert report["state"] == ("fixed_upstream" if UPSTREAM else "active"), report
        assert report["warnings"] == [], report


@pytest.mark.skipif(UPSTREAM, reason=f"NVRx {NVRX} copies CPU tensors itself: the fix is off")
@pytest.mark.parametrize("keep", ["on", "off"])
def test_a_worker_s_next_save_copies_into_the_memory_kept_for_it(keep):
    """Each save is finalized before the next: the second and third copy into the shared
    memory of the first (no new pages), which is let go at the close; with
    ``NVRX_IPC_FIX_SNAPSHOT_KEEP=off`` each save copies into new memory, none is kept."""
    report = saves(ONE_SAVE, True, {"NVRX_IPC_FIX_SNAPSHOT_KEEP": keep}, count=17)
    assert torn(report) == 0 and report["copied"] == [17, 17, 17], report
    assert report["closed"] == SNAPSHOT_NONE, report
    if keep == "on":
        assert report["reused"] and report["kept"].endswith("in 1 set(s) of copies"), report
        assert not report["kept"].startswith("0.0 MiB"), report
    else:
        assert report["kept"] == SNAPSHOT_NONE, report


def test_the_fix_named_off():
    """``NVRX_IPC_FIX_DISABLE=cpu_snapshot``: the rest of the package on, this fix off."""
    report = saves(ONE_SAVE, True, {"NVRX_IPC_FIX_DISABLE": "cpu_snapshot"}, count=17)
    assert report["state"] == "disabled", report
    assert torn(report) == (0 if UPSTREAM else 3), report


BROKEN = """
    from nvrx_ipc_fix.core import shapes

    def copy_fresh(writer, copy):
        raise RuntimeError("no copy (test)")

    shapes.copy_fresh = copy_fresh  # the package's own defect
"""


@pytest.mark.skipif(UPSTREAM, reason=f"NVRx {NVRX} copies CPU tensors itself: nothing to break")
def test_a_defect_of_the_fix_leaves_nvrx_s_save_with_one_warning():
    """The fix's copy fails (forced): the saves are NVRx's own (torn here, as without the
    package, and loadable), one RuntimeWarning, ``status()`` says why."""
    report = saves(BROKEN + ONE_SAVE, True, count=17)
    assert torn(report) == 3, report
    assert report["state"] == "error" and "no copy (test)" in report["reason"], report
    assert len(report["warnings"]) == 1 and "no copy (test)" in report["warnings"][0], report


@pytest.mark.parametrize("mode", [_mode(m) for m in ("plain", "cached")])
@pytest.mark.parametrize("fix", [False, True], ids=["without", "with"])
def test_a_save_then_step_loop_loads_each_step_s_values(fix, mode):
    """Five saves of a training loop, each followed at once by the optimizer's step in place,
    all finalized at the end: every checkpoint loads with the values of its own step."""
    report = saves(LOOP, fix, count=17, mode=mode)
    assert torn(report) == (0 if fix or UPSTREAM else 5), report


@pytest.mark.parametrize("shared", [False, True], ids=["private", "shared"])
@pytest.mark.parametrize("fix", [False, True], ids=["without", "with"])
def test_a_queue_that_forks_a_process_per_save(fix, shared):
    """``AsyncCallsQueue(persistent=False)``: the save's process is forked at the schedule and
    sees the trainer's memory as it was then, so private tensors need no copy: saved right
    with NVRx alone. Tensors in shared memory (moved there by an earlier save on a persistent
    worker, or by the user) are shared with that process too: torn without the copy."""
    report = saves(ONE_SAVE, fix, count=17, persistent=False, shared=shared)
    assert torn(report) == (3 if shared and not (fix or UPSTREAM) else 0), report
    # what is copied: by NVRx 0.7.0 every CPU tensor; by the fix only those it shares
    assert report["copied"] == [17 if UPSTREAM or (fix and shared) else 0] * 3, report


@pytest.mark.parametrize("fix", [False, True], ids=["without", "with"])
def test_a_synchronous_save_copies_nothing(fix):
    """The request run in the trainer (``AsyncRequest.execute_sync``) writes before it
    returns: nothing can tear, and the fix copies nothing (NVRx 0.7.0 still clones)."""
    report = saves(ONE_SAVE, fix, count=17, sync=True)
    assert torn(report) == 0, report
    assert report["copied"] == [17 if UPSTREAM else 0] * 3, report


needs_mcore = pytest.mark.skipif(
    MCORE is None, reason="megatron-core is not installed here (the py311-megatron env has it)"
)


@needs_mcore
@pytest.mark.mcore
@pytest.mark.parametrize("writer", ["mcore", "nvrx"])
@pytest.mark.parametrize("fix", [False, True], ids=["without", "with"])
def test_megatron_core_s_own_worker(fix, writer):
    """megatron-core's persistent worker (``async_strategy="mcore"``), with its own writer,
    which copies CPU tensors as NVRx 0.6.0 does (only views), and with NVRx's."""
    report = saves(ONE_SAVE, fix, count=17, impl="mcore", writer=writer)
    assert torn(report) == (0 if fix or (UPSTREAM and writer == "nvrx") else 3), report


CALLS = """
    import json, tempfile, threading, torch
    import nvrx_ipc_fix
    nvrx_ipc_fix.deactivate()  # the wrapper is called by hand below
    from nvrx_ipc_fix.fixes import cpu_snapshot
    from nvrx_ipc_fix.cli import fakecuda
    from nvidia_resiliency_ext.checkpointing.async_ckpt import core, filesystem_async as fs
    from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
    fakecuda.install()
    W = fs.FileSystemWriterAsync
    queue = core.AsyncCallsQueue(persistent=True)  # no worker: its schedule is not called

    base = torch.arange(8.0)
    state = {
        "cpu": torch.full((64,), 1.0), "step": torch.tensor(3.0),  # sent as they are
        "view": base[2:6],  # NVRx clones a view itself
        "device": fakecuda.on_fake_device(torch.full((64,), 2.0)),  # the worker copies it
        "transposed": torch.arange(12.0).reshape(3, 4).t(),  # its whole storage, strided
        "empty": torch.zeros(0), "param": torch.nn.Parameter(torch.ones(4)),
        "ints": torch.arange(5), "flags": torch.tensor([True, False]),
        "bytes": {"not": "a tensor"},  # written through torch.save (BYTE_IO)
    }
    tensors = {k: v for k, v in state.items() if isinstance(v, torch.Tensor)}

    def plan_for(planner, writer):
        planner.set_up_planner(state, is_coordinator=True)
        writer.set_up_storage_writer(True)
        plans, _ = planner.create_global_plan([writer.prepare_local_plan(
            planner.create_local_plan())])
        return planner.finish_plan(writer.prepare_global_plan(plans)[0])

    def outgoing(writer):
        \"\"\"fqn -> each tensor the save hands the worker (its cache's and the fresh ones).\"\"\"
        if hasattr(writer, "uncached_tensor_data"):
            pairs = [pair for sent in (writer.cached_tensor_data, writer.uncached_tensor_data)
                     if sent for pair in zip(*sent)]
        else:
            pairs = [pair for _, _, (_, sent) in writer.write_buckets for pair in sent]
        return {item.index.fqn: tensor for item, tensor in pairs}

    calls = []  # how often each call ran NVRx's prepare_write_data

    def prepare(planner=None, **options):
        planner = planner or DefaultSavePlanner()
        writer, nvrx_sent = W(tempfile.mkdtemp(), **options), {}
        plan = plan_for(planner, writer)

        def nvrx(*args, **kwargs):
            calls[-1] += 1
            W.prepare_write_data(writer, *args, **kwargs)
            nvrx_sent.update(outgoing(writer))

        calls.append(0)
        cpu_snapshot.prepare_write_data_wrapper(nvrx, writer, (plan, planner), {})
        cpu_snapshot.schedule_wrapper(lambda *args, **kwargs: None, queue, (), {})
        sent = outgoing(writer)
        plain = lambda t: t.detach().as_subclass(torch.Tensor)
        return {fqn: [sent[fqn] is not nvrx_sent[fqn],  # copied by the fix
                      plain(sent[fqn]).untyped_storage().data_ptr()
                      == plain(tensors[fqn]).untyped_storage().data_ptr(),  # the trainer's
                      torch.equal(plain(sent[fqn]), plain(tensors[fqn]))]  # its values
                for fqn in sorted(tensors)}, "resolve_data" not in getattr(planner, "__dict__", {})

    out = {"plain": prepare()}
    if "use_cached_data_structure" in W.__init__.__code__.co_varnames:
        out["cached"] = prepare(use_cached_data_structure=True)
        out["shm"] = prepare(use_cpu_shm_for_gpu_tensors=True)

    class Frozen:  # a planner that takes no attribute: every CPU tensor is copied
        __slots__ = ("inner",)
        def __init__(self, inner): self.inner = inner
        def set_up_planner(self, *a, **k): return self.inner.set_up_planner(*a, **k)
        def create_local_plan(self): return self.inner.create_local_plan()
        def create_global_plan(self, plans): return self.inner.create_global_plan(plans)
        def finish_plan(self, plan): return self.inner.finish_plan(plan)
        def resolve_data(self, item): return self.inner.resolve_data(item)
    out["frozen"] = prepare(Frozen(DefaultSavePlanner()))

    class Failing(DefaultSavePlanner):
        def resolve_data(self, item):
            raise RuntimeError("resolve failed")
    failing = Failing()
    try:
        prepare(failing)
    except RuntimeError as exc:  # NVRx's (the planner's) error reaches the caller
        out["raised"] = [str(exc), "resolve_data" not in vars(failing)]

    own = DefaultSavePlanner()
    own.resolve_data = own.resolve_data  # the planner's own instance attribute
    prepare(own)
    out["own_kept"] = "resolve_data" in vars(own)

    seen = []
    thread = threading.Thread(target=lambda: seen.append(prepare()))
    thread.start()
    thread.join()
    out["thread"] = seen == [out["plain"]]
    out["calls"] = sorted(set(calls))
    print(json.dumps(out))
"""

#: fqn -> [copied by the fix, the trainer's storage, its values]
COPIED, NVRX_COPY, DEVICE = [True, False, True], [False, False, True], [False, True, True]


def test_which_tensors_the_fix_copies():
    """Each CPU tensor NVRx sends as the planner gave it, and only those, is copied, with its
    values: not a view (NVRx cloned it), not a tensor on the device (the stand-in), nor
    anything of NVRx 0.7.0 (it copies them all itself); every dtype and shape; with a planner
    that takes no attribute, every CPU tensor (none is left the trainer's). NVRx's method
    runs once a call; a planner's error reaches the caller; from another thread the same. An
    empty tensor is left as it is: nothing in it can change."""
    out = run_python(CALLS, timeout=180)
    copied = NVRX_COPY if UPSTREAM else COPIED
    expected = {
        "cpu": copied,
        "device": DEVICE,
        "empty": DEVICE,
        "flags": copied,
        "ints": copied,
        "param": copied,
        "step": copied,
        "transposed": copied,
        "view": NVRX_COPY,
    }
    for mode in ("plain", "cached", "shm"):
        if mode in out:
            sent, planner_untouched = out.pop(mode)
            # the shared-memory path: NVRx copies the device's tensors into shared memory
            assert sent == dict(expected, **{"device": NVRX_COPY} if mode == "shm" else {})
            assert planner_untouched, mode
    sent, _ = out.pop("frozen")  # (0.7.0's copies too, called by hand: there the fix is off)
    assert sent == dict({fqn: COPIED for fqn in expected}, device=DEVICE, empty=DEVICE), sent
    assert out == {
        "raised": ["resolve failed", True],
        "own_kept": True,
        "thread": True,
        "calls": [1],
    }, out
