"""slime (THUDM/slime; not on PyPI): its ``save_model`` schedules an async save with the
persistent worker and constant structure forced on, then offloads at once, and onloads
before the next save (test double: tests/doubles/slime, facts cited there). On the CPU the
offload moves the storage (``scenario``'s ``offload``/``onload``); Megatron's real
``maybe_finalize_async_save`` (megatron-core 0.17.1) finalizes. Every save is loaded back.
No code change: ``stale_guard`` and ``clear_on_close`` act on NVRx itself, and
``release_on_offload`` releases the worker at slime's ``sleep()`` (after finalizing the save
in flight) and starts the next one at ``wake_up()``. GPU memory after the offload:
tests/gpu/test_slime_gpu.py."""

import os

import pytest

from conftest import MCORE, expect, needs_cache, scenario

pytestmark = [
    needs_cache,
    pytest.mark.worker,
    pytest.mark.skipif(
        MCORE is None, reason="megatron-core is installed only in the megatron tox env"
    ),
]

DOUBLES = os.path.join(os.path.dirname(__file__), "doubles")
SLIME = f"""
    import argparse, sys, types
    sys.path.insert(0, {DOUBLES!r})
    import megatron.training.async_utils as _au
    from megatron.training.global_vars import set_args
    from slime.backends.megatron_utils.actor import MegatronTrainRayActor
    from harness import scenario as _s
    set_args(argparse.Namespace(async_save=True))

    def _save_model(trainer):
        _au._async_calls_queue = trainer.queue
        actor = MegatronTrainRayActor()
        actor.args = types.SimpleNamespace(offload_train=True, async_save=True)
        actor.pause, actor.resume = trainer.offload, trainer.onload
        actor.save = lambda rollout_id: _s._step(trainer, _REPORT, rollout_id, "save-async")
        actor.save_model(len(_REPORT["saves"]))

    _REPORT, _original_step = None, _s._step
    def _step(trainer, report, *rest):  # keeps the report, which save_model's save adds to
        global _REPORT
        _REPORT = report
        return _original_step(trainer, report, *rest)
    _s._step = _step  # the scenario's run() calls it
    _s.EXTRA_STEPS["save_model"] = _save_model
"""
# slime starts awake (the first wake_up finds nothing paused); each save_model ends asleep
STEPS = ["save_model", "save_model", "save_model", "onload", "finalize"]


def test_without_the_package_slime_s_saves_after_an_offload_are_stale():
    report = scenario(STEPS, prelude=SLIME, fix=False)
    stale = [s["stale"] for s in report["saves"]]
    assert stale == ([0, 0, 8] if expect("stale") else [0, 0, 0]), report["stderr"]
    assert expect("stale")  # NVRx 0.7.0 checks pointers itself: nothing to fail there


def test_with_the_package_every_save_of_slime_s_sequence_loads():
    report = scenario(STEPS, prelude=SLIME)
    assert report["hang"] is None, report["stderr"]
    assert [s["stale"] for s in report["saves"]] == [0, 0, 0]
    assert report["releases_total"] == 3  # at each sleep(), the save in flight finalized
