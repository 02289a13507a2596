"""Wrap, never re-implement: each wrapper calls NVRx's (or megatron-core's)
original exactly once, with every argument it was given, and adds only what its fix needs.

Counted on the real code: before activation, a function with the original's name and
signature (``functools.wraps``) is put beneath where the package's wrappers go and records
each call NVRx's original gets; after activation another, above them, records the calls
NVRx's own caller makes (the finalize loop's); ``torch.distributed``'s collectives are
counted the same way.
"""

import pytest

from conftest import MCORE, NVRX, needs_nvrx, scenario
from test_auto_release import DOUBLES

#: ``_count(owner, name, key)``: each call of ``owner.name`` from now on is recorded under
#: ``key`` (its flag and int arguments), then made.
COUNTING = """
    import functools, importlib
    _calls = {}

    def _plain(values):  # the flags and ints a call got, as JSON takes them
        if isinstance(values, dict):
            return {k: v for k, v in values.items() if type(v) in (bool, int)}
        return [v for v in values if type(v) in (bool, int)]

    def _count(owner, name, key, bind=False):
        original = vars(owner)[name]

        @functools.wraps(original)
        def counted(*args, **kwargs):
            _calls.setdefault(key, []).append([_plain(args[1:]), _plain(kwargs)])
            if bind:  # a wrapt wrapper taken from the class: bound as the class does
                return original.__get__(args[0], type(args[0]))(*args[1:], **kwargs)
            return original(*args, **kwargs)
        setattr(owner, name, counted)

    def _report(trainer):  # the calls so far (not those after: the report is printed last)
        return {"calls": {key: list(calls) for key, calls in _calls.items()}}
"""
COUNT = (
    COUNTING
    + """
    import torch.distributed as _dist
    _core = importlib.import_module(IMPL)
    _count(_core.PersistentAsyncCaller, "is_current_async_call_done", "original done")
    _count(_core.AsyncCaller, "sync_all_async_calls", "original sync")
    for _name in ("all_reduce", "all_gather_object", "broadcast_object_list", "barrier"):
        _count(_dist, _name, _name)
    from harness import scenario as _s  # activates: the wrappers go on top
    _count(_core.PersistentAsyncCaller, "is_current_async_call_done", "finalize's done", True)
    _s.EXTRA_STEPS["calls"] = _report
"""
)
IMPLS = {
    "nvrx": "nvidia_resiliency_ext.checkpointing.async_ckpt.core",
    "mcore": "megatron.core.dist_checkpointing.strategies.async_utils",
}


@pytest.mark.worker
@pytest.mark.parametrize(
    "impl",
    [
        pytest.param("nvrx", marks=pytest.mark.skipif(NVRX is None, reason="no NVRx here")),
        pytest.param(
            "mcore",
            marks=[
                pytest.mark.mcore,
                pytest.mark.skipif(
                    MCORE is None,
                    reason="megatron-core is not installed here (the py311-megatron env)",
                ),
            ],
        ),
    ],
)
@pytest.mark.parametrize(
    "finalize, no_dist", [("blocking", False), ("poll", False), ("poll", True)]
)
def test_the_finalize_calls_nvrx_s_check_and_its_collective_once_and_adds_none(
    impl, finalize, no_dist
):
    """``is_current_async_call_done``: NVRx's own, once per call, with the same arguments;
    with ``no_dist=False`` its own ``sync_all_async_calls``, once per call, carries the
    failure; no other collective, on a failed save's finalize either."""
    report = scenario(
        ["save", "fault-kill", "save", "calls#calls"],
        prelude=COUNT.replace("IMPL", repr(IMPLS[impl])),
        finalize=finalize,
        no_dist=no_dist,
        impl=impl,
    )
    assert report["hang"] is None, report["stderr"]
    assert [s["stale"] for s in report["saves"] if not s.get("lost")] == [0, 0]
    assert report["faults"][0]["error"]["type"] == "CheckpointWorkerError", report["faults"]
    calls = report["named"]["calls"]["calls"]
    done = calls["finalize's done"]
    assert calls.get("original done") == done, calls
    assert len(calls.get("original sync", [])) == (0 if no_dist else len(done)), calls
    # NVRx's own: one all-reduce per check, one per save finalized (its call_idx check, which
    # megatron-core makes with no_dist too)
    per_save = 0 if no_dist and impl == "nvrx" else 2
    assert len(calls.get("all_reduce", [])) == len(calls.get("original sync", [])) + per_save, calls
    assert not {"all_gather_object", "broadcast_object_list", "barrier"} & set(calls), calls


CLOSES = (
    COUNTING
    + f"""
    import sys, types
    sys.path.insert(0, {DOUBLES!r})
    from megatron.bridge.training import checkpointing as _bridge
    from nvidia_resiliency_ext.checkpointing.async_ckpt import core as _core
    _count(_core.AsyncCallsQueue, "close", "close")
    _count(_bridge, "maybe_finalize_async_save", "terminate")
    from harness import scenario as _s

    def _terminate(trainer):
        _bridge.maybe_finalize_async_save(
            types.SimpleNamespace(async_calls_queue=trainer.queue),
            types.SimpleNamespace(async_save=True), blocking=True, terminate=True)

    _s.EXTRA_STEPS.update(terminate=_terminate, calls=_report)
"""
)


@needs_nvrx
@pytest.mark.worker
def test_a_close_or_terminate_that_meets_a_failure_runs_once():
    """NVRx's ``close()`` and Bridge's ``maybe_finalize_async_save(terminate=True)`` (its test
    double; the real Megatron's: test_frameworks.py), each called once although the finalize
    they start with raises: the close is still done, then the failure raised."""
    report = scenario(
        [
            "save",
            "fault-kill-async",
            "close?#close",
            "save",
            "fault-raise-async",
            "terminate?#terminate",
            "save",
            "calls#calls",
        ],
        prelude=CLOSES,
    )
    assert report["hang"] is None, report["stderr"]
    for name in ("close", "terminate"):
        call = report["named"][name]
        assert call["error"]["type"] == "CheckpointWorkerError", call
        assert call["again"] is None and call["pending_after"] == 0, call
    assert [s["stale"] for s in report["saves"] if not s.get("lost")] == [0, 0, 0]
    calls = report["named"]["calls"]["calls"]
    assert len(calls["terminate"]) == 1, calls  # the user's call, once
    assert len(calls["close"]) == 2, calls  # the user's close, and the terminate's


@pytest.mark.parametrize("world", [1, 2, 3, 8, 1023, 1024, 5000, 65535])
def test_the_failure_flag_in_nvrx_s_one_int_names_a_lone_failed_rank(world):
    """Every rank learns how many ranks failed, and which one where one did (up to 1023
    ranks), from the one int32 NVRx sums (overflowing as int32 does: modulo 2**32)."""
    from nvrx_ipc_fix.fixes.worker_watch import _decode, _flagged

    def summed(failed, writing=()):
        values = [
            _flagged(r in writing, r, world) if r in failed else int(r in writing)
            for r in range(world)
        ]
        total = sum(values) % (1 << 32)
        return _decode(total - (1 << 32) if total >= 1 << 31 else total, world)

    named = world < 1024
    for rank in {0, world // 2, world - 1}:
        assert summed({rank}, writing=range(world)) == (1, rank if named else None)
    assert summed(set()) == (0, None) and summed(set(), writing=range(world)) == (0, None)
    many = set(range(0, world, 2)) if world > 1 else set()
    if len(many) > 1:
        assert summed(many, writing=range(world)) == (len(many), None)
    assert summed(set(range(world))) == (world, None if world > 1 else 0)
