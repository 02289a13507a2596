"""One wrapper per intercepted call, its steps in the order ``targets.CALLS`` writes, run
inside the call's region: the table read by the lifecycle, ``status()``, these tests and
docs/architecture.md (``test_docs.py``)."""

import pytest

from conftest import needs_nvrx, run_python


def test_every_step_has_its_place_in_its_call_and_every_place_a_step():
    from nvrx_ipc_fix.core.fix_names import FIXES
    from nvrx_ipc_fix.core.targets import CALLS, CLOSE, QUEUE, SCHEDULE, TARGETS

    for target in TARGETS:
        assert target.fix in CALLS[target.name].order, target
    for call in CALLS.values():
        assert len(set(call.order)) == len(call.order) and set(call.order) <= set(FIXES), call
        for fix in call.order:
            assert any(t.fix == fix and t.name == call.name for t in TARGETS), (call, fix)
        assert call.region in (None, QUEUE, SCHEDULE, CLOSE), call
        if call.region in (QUEUE, SCHEDULE, CLOSE):  # its self is the queue whose lock it holds
            assert call.attr.startswith("AsyncCallsQueue."), call
        if call.region == CLOSE:  # an abort never waits for a save: the close alone may
            assert call.attr == "AsyncCallsQueue.close", call


RUN = """
    import importlib, json, tempfile, threading
    import nvrx_ipc_fix
    from nvrx_ipc_fix.core import dispatch
    from nvrx_ipc_fix.core.targets import CALLS, TARGETS

    ran = []  # (fix, the call's function, the queue's lock held by this thread)
    for target in TARGETS:  # before NVRx is imported: the installer takes these steps
        module_name, name = target.step.split(":")
        module = importlib.import_module("nvrx_ipc_fix." + module_name)
        step = getattr(module, name)
        if getattr(step, "recorded", False):
            continue

        def record(wrapped, instance, args, kwargs, _step=step, _fix=target.fix):
            held = (type(instance).__name__ == "AsyncCallsQueue"
                    and dispatch.queue_lock(instance)._is_owned())
            ran.append([_fix, wrapped.__qualname__, held])
            return _step(wrapped, instance, args, kwargs)

        record.recorded = True
        setattr(module, name, record)

    from harness import scenario
    with tempfile.TemporaryDirectory() as d:
        trainer = scenario.Trainer(d, 4)
        saved = []
        for _ in range(2):
            _, _, path, version = trainer.save()
            saved.append(trainer.stale_tensors(path, version))
        trainer.close()
    status = nvrx_ipc_fix.status()
    print(json.dumps({"ran": ran, "saved": saved,
                      "calls": {c.call: [c.region, list(c.steps)] for c in status.calls},
                      "table": {name: [c.region, list(c.order)] for name, c in CALLS.items()}}))
"""


@needs_nvrx
@pytest.mark.worker
def test_each_call_runs_its_steps_in_the_table_s_order_inside_its_region():
    seen = run_python(RUN)
    assert seen["saved"] == [0, 0]
    assert seen["calls"], seen
    for name, (region, steps) in seen["calls"].items():
        table_region, order = seen["table"][name]
        assert region == table_region
        assert steps == [fix for fix in order if fix in steps], name  # the table's order
        function = name.split(":")[1]
        runs = [fix for fix, called, _ in seen["ran"] if called == function]
        if runs:
            # each call ran every step in place, outermost first, as often as it was called
            assert runs == steps * (len(runs) // len(steps)), (name, runs)
        if region in ("queue", "schedule", "close"):
            assert all(held for _, called, held in seen["ran"] if called == function), name
    schedule = [
        fix for fix, called, _ in seen["ran"] if called == "AsyncCallsQueue.schedule_async_request"
    ]
    assert len(schedule) >= 2 and schedule[-1] == "worker_watch"
