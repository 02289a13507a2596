"""Megatron-Bridge's ``maybe_finalize_async_save(..., terminate=True)``: the real megatron-bridge
0.6.2 code (``megatron/bridge/training/checkpointing.py:401-427`` in the wheel) on the real
NVRx worker, called through the name ``mimo_model_io.py:23`` binds with
``from megatron.bridge.training.checkpointing import maybe_finalize_async_save``, with Bridge's
own ``GlobalState`` and ``CheckpointConfig``. The scenario's saves count only when they load
back with the values written. Runs in the tox env ``py311-bridge-nvrx060-wrapt2`` (Bridge needs
megatron-core 0.19.2; what its import needs that this machine cannot have:
``stand_ins.install_for_bridge``)."""

import os
from importlib import metadata

import pytest

from conftest import expect, needs_cache, run_python, scenario
from test_frameworks import ALIASES, FAILED_AT_CLOSE, STEPS
from test_never_silent import check, run

try:
    BRIDGE = metadata.version("megatron-bridge")
except metadata.PackageNotFoundError:
    BRIDGE = None

pytestmark = [
    needs_cache,
    pytest.mark.skipif(
        BRIDGE is None, reason="megatron-bridge is installed only in the bridge tox env (tox.ini)"
    ),
]

TESTS = os.path.dirname(os.path.abspath(__file__))
SETUP = f"""sys.path.insert(0, {TESTS!r}); import stand_ins; stand_ins.install_for_bridge()"""

# The scenario's "close" step, replaced by Bridge's terminate path (what mimo_model_io.py:127
# calls after its save: blocking=True, terminate=True).
VIA_BRIDGE = f"""
    import sys
    {SETUP}
    from megatron.bridge.models.megatron_mimo.conversion import mimo_model_io as _io
    from megatron.bridge.training.config import CheckpointConfig
    from megatron.bridge.training.state import GlobalState
    from harness import scenario as _s
    def _close(self):
        state = GlobalState()
        state._async_calls_queue = self.queue  # what initialize_async_checkpoint_worker sets
        _io.maybe_finalize_async_save(state, CheckpointConfig(async_save=True),
                                      blocking=True, terminate=True)
    _s.Trainer.close = _close
"""


@pytest.mark.worker
def test_terminate_then_save_hangs_without_the_package():
    report = scenario(STEPS, prelude=VIA_BRIDGE, fix=False)
    assert expect("hang")
    assert report["hang"]["step"] == 3 and report["cache_miss"], report


@pytest.mark.worker
def test_terminate_then_save_works_with_the_package():
    report = scenario(STEPS, prelude=VIA_BRIDGE)
    assert report["hang"] is None, report["stderr"]
    assert [s["stale"] for s in report["saves"]] == [0, 0, 0, 0]


@pytest.mark.worker
def test_a_terminate_that_finalizes_a_failed_save_raises_it_after_closing():
    check(run(FAILED_AT_CLOSE, no_dist=False, prelude=VIA_BRIDGE), FAILED_AT_CLOSE)


@pytest.mark.parametrize("late", [False, True], ids=["activated-first", "activated-late"])
def test_names_bound_by_from_import_see_the_wrapper(late):
    result = run_python(
        ALIASES.format(
            setup=SETUP,
            module="megatron.bridge.training.checkpointing",
            importer="megatron.bridge.models.megatron_mimo.conversion.mimo_model_io",
            late="nvrx_ipc_fix.deactivate()" if late else "",
        )
    )
    assert result == {"seen": [not late, True, False], "same_signature": True}
