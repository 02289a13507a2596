"""``stale_guard`` on NVRx 0.6.0's real ``prepare_write_data``, call by call, without a worker:
what NVRx sends after each change of storage (the worker's cache, or the current tensors).

Saves through the real worker, loaded value by value, are in test_failures.py; these cover
the guard's own edges: a storage resized in place, a planner that takes no attribute, NVRx
raising inside the call, a planner's own ``resolve_data`` attribute, a late activation, and
a call from another thread.
"""

import pytest

from conftest import EXPECT, NVRX, needs_nvrx, run_python, scenario

pytestmark = [
    needs_nvrx,
    pytest.mark.skipif(
        not EXPECT.get(NVRX, {}).get("stale"),
        reason=f"NVRx {NVRX} needs no guard: the guard "
        "patches only releases that cache without checking storage (0.6.0)",
    ),
]

CALLS = """
    import functools, json, tempfile, threading, torch
    import nvrx_ipc_fix
    nvrx_ipc_fix.deactivate()  # the wrapper is called by hand below
    from nvrx_ipc_fix.fixes import stale_guard as guard
    from nvrx_ipc_fix.cli import fakecuda
    from nvidia_resiliency_ext.checkpointing.async_ckpt import filesystem_async as fs
    from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
    fakecuda.install()
    W = fs.FileSystemWriterAsync

    def setup(planner=None):
        state = {f"t{i}": fakecuda.on_fake_device(torch.full((256,), float(i)))
                 for i in range(4)}
        planner = planner or DefaultSavePlanner()
        planner.set_up_planner(state, is_coordinator=True)
        plans, _ = planner.create_global_plan([planner.create_local_plan()])
        W._cached_identifiers.clear()
        guard.forget_all()
        return state, planner.finish_plan(plans[0]), planner, W(tempfile.mkdtemp(),
                                                                use_cached_data_structure=True)

    calls = []  # how often each prepare called NVRx's prepare_write_data

    def prepare(writer, plan, planner):
        def nvrx(*args, **kwargs):
            calls[-1] += 1
            return W.prepare_write_data(writer, *args, **kwargs)

        calls.append(0)
        guard.prepare_write_data_wrapper(nvrx, writer, (plan, planner), {})
        sent = writer.cached_tensor_data
        return None if sent is None else [t.data_ptr() for t in sent[1]]

    def current(state):
        return [t.data_ptr() for t in state.values()]

    out = {}
    state, plan, planner, w = setup()
    out["first"] = prepare(w, plan, planner) == current(state)
    out["reused"] = prepare(w, plan, planner)
    state["t1"].set_(state["t1"].clone())  # new storage, as an offload and onload gives it
    state["t2"].set_(state["t2"].clone())  # the same; private memory, which (unlike the
    # stand-in's shared memory) grows back in place after a resize to 0, as a GPU's does
    out["replaced"] = prepare(w, plan, planner) == current(state)
    out["replaced_then"] = prepare(w, plan, planner)

    storage, old, keep = state["t2"].untyped_storage(), state["t2"].data_ptr(), []
    while state["t2"].data_ptr() == old and len(keep) < 20:  # in place, new memory
        storage.resize_(0)
        keep.append(torch.empty(256))  # takes the freed block, if the allocator would reuse it
        storage.resize_(256 * 4)
    out["resized_in_place"] = state["t2"].data_ptr() != old
    out["resized"] = prepare(w, plan, planner) == current(state)
    out["planner_untouched"] = "resolve_data" not in vars(planner)

    class Frozen:  # a planner that takes no attribute
        __slots__ = ("inner",)
        def __init__(self, inner): self.inner = inner
        def set_up_planner(self, *a, **k): return self.inner.set_up_planner(*a, **k)
        def create_local_plan(self): return self.inner.create_local_plan()
        def create_global_plan(self, plans): return self.inner.create_global_plan(plans)
        def finish_plan(self, plan): return self.inner.finish_plan(plan)
        def resolve_data(self, item): return self.inner.resolve_data(item)
    state, plan, planner, w = setup(Frozen(DefaultSavePlanner()))
    prepare(w, plan, planner)
    out["frozen_reused"] = prepare(w, plan, planner)
    state["t0"].set_(state["t0"].clone())
    out["frozen_replaced"] = prepare(w, plan, planner) == current(state)

    class Failing(DefaultSavePlanner):
        fail = False
        def resolve_data(self, item):
            if self.fail:
                raise RuntimeError("resolve failed")
            return super().resolve_data(item)
    state, plan, planner, w = setup(Failing())
    prepare(w, plan, planner)
    planner.fail = True
    try:
        prepare(w, plan, planner)
        out["raised"] = None
    except RuntimeError as exc:
        out["raised"] = str(exc)
    out["failing_untouched"] = "resolve_data" not in vars(planner)
    planner.fail = False
    out["after_failure"] = prepare(w, plan, planner)

    state, plan, planner, w = setup()
    own = planner.resolve_data
    planner.resolve_data = own  # the planner's own instance attribute
    prepare(w, plan, planner)
    out["own_kept"] = vars(planner)["resolve_data"] is own

    guard.forget_all()  # activated after the cache was primed: no record of what was sent
    out["late"] = prepare(w, plan, planner) == current(state)
    out["late_then"] = prepare(w, plan, planner)

    state["t3"].set_(state["t3"].clone())
    seen = []
    thread = threading.Thread(target=lambda: seen.append(prepare(w, plan, planner)))
    thread.start()
    thread.join()
    out["thread"] = seen == [current(state)]
    out["calls"] = sorted(set(calls))
    print(json.dumps(out))
"""


def test_what_nvrx_sends_after_each_change_of_storage():
    out = run_python(CALLS)
    assert out == {
        "first": True,
        "reused": None,  # an ordinary save: the worker's cache
        "replaced": True,
        "replaced_then": None,  # new storage: sent again, once
        "resized_in_place": True,
        "resized": True,
        "planner_untouched": True,
        "frozen_reused": None,
        "frozen_replaced": True,
        "raised": "resolve failed",
        "failing_untouched": True,
        "after_failure": None,
        "own_kept": True,
        "late": True,
        "late_then": None,
        "thread": True,
        "calls": [1],  # wrap, never re-implement: NVRx's prepare_write_data, once per call
    }


# The guard's check fails (the package's own defect, or a shape it does not know), save after
# save: the guard cannot tell whether the storage moved.
CHECK_FAILS = """
    from nvrx_ipc_fix.fixes import stale_guard as _guard

    def _moved(cached, tensors):
        raise TypeError("the check failed")

    _guard._moved = _moved
"""


@pytest.mark.worker
def test_a_check_that_fails_sends_the_tensors_again_and_every_save_is_current():
    """Not the guard off for that save (NVRx 0.6.0 then wrote the old values, with only the
    first failure's warning): the tensors are sent again, one RuntimeWarning for all."""
    report = scenario(
        ["save", "save", "replace", "save", "replace", "save", "save"], prelude=CHECK_FAILS
    )
    assert report["hang"] is None, report["stderr"]
    assert [s["stale"] for s in report["saves"]] == [0] * 5
    assert report["stderr"].count("RuntimeWarning: nvrx_ipc_fix: hook on") == 1, report["stderr"]
    assert "the check failed" in report["stderr"]
