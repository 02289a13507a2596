"""Megatron-LM's ``maybe_finalize_async_save(terminate=True)``, called through the name
``training.py`` bound with ``from .async_utils import maybe_finalize_async_save``: the real
megatron-core 0.17.1 code (tox env ``py311-megatron-nvrx060-wrapt2``; importing
``megatron.training.async_utils`` also runs ``training.py``). Megatron-Bridge's, the real
megatron-bridge 0.6.2 code: tests/test_bridge.py (its own tox env), with ``STEPS`` and
``ALIASES`` from here.
"""

from importlib import metadata

import pytest

from conftest import expect, needs_cache, run_python, scenario
from test_never_silent import cells, check, run
from test_wrap_once import COUNTING

pytestmark = needs_cache

try:
    MEGATRON_CORE = metadata.version("megatron-core")
except metadata.PackageNotFoundError:
    MEGATRON_CORE = None
needs_megatron = pytest.mark.skipif(
    MEGATRON_CORE is None,
    reason="megatron-core is installed only in the megatron tox env "
    "(its cp312 wheel's pure-Python code runs on 3.11; see tox.ini)",
)

# The scenario's "close" step, replaced by the framework's terminate path.
VIA_MEGATRON = """
    import argparse
    import megatron.training.async_utils as _au
    # `from .async_utils import maybe_finalize_async_save`
    import megatron.training.training as _training
    from megatron.training.global_vars import set_args
    from harness import scenario as _s
    set_args(argparse.Namespace(async_save=True))
    def _close(self):
        _au._async_calls_queue = self.queue
        _training.maybe_finalize_async_save(True, terminate=True)  # blocking passed positionally
    _s.Trainer.close = _close
"""
STEPS = ["save", "save", "close", "save", "replace", "save"]


@pytest.mark.worker
@needs_megatron
def test_terminate_then_save_hangs_without_the_package():
    report = scenario(STEPS, prelude=VIA_MEGATRON, fix=False)
    assert expect("hang")
    assert report["hang"]["step"] == 3 and report["cache_miss"], report


@pytest.mark.worker
@needs_megatron
def test_terminate_then_save_works_with_the_package():
    report = scenario(STEPS, prelude=VIA_MEGATRON)
    assert report["hang"] is None, report["stderr"]
    assert [s["stale"] for s in report["saves"]] == [0, 0, 0, 0]


#: A failed save in flight at the terminate: a dead worker's, and NVRx's own error of a live
#: worker's (its write failed; the close then has a worker to stop).
FAILED_AT_CLOSE = cells(["close"], ("kill", "raise", "write"))


@pytest.mark.worker
@needs_megatron
def test_a_terminate_that_finalizes_a_failed_save_raises_it_after_closing():
    check(run(FAILED_AT_CLOSE, no_dist=False, prelude=VIA_MEGATRON), FAILED_AT_CLOSE)


#: Megatron's own function counted beneath the package's wrappers (``test_wrap_once.py``).
COUNTED = (
    COUNTING
    + """
    import megatron.training.async_utils as _au_counted
    import megatron.training.training as _training_counted
    _count(_au_counted, "maybe_finalize_async_save", "terminate")
    _training_counted.maybe_finalize_async_save = _au_counted.maybe_finalize_async_save
"""
    + VIA_MEGATRON
    + """
    _s.EXTRA_STEPS["calls"] = _report
"""
)


@pytest.mark.worker
@needs_megatron
def test_a_terminate_that_meets_a_failure_calls_megatron_once():
    """Wrap, never re-implement: the close after the failed finalize is Megatron's own, in
    the one call (before: the whole function ran twice)."""
    report = scenario(
        ["save", "fault-kill-async", "close?#close", "save", "calls#calls"], prelude=COUNTED
    )
    assert report["hang"] is None, report["stderr"]
    assert report["named"]["close"]["error"]["type"] == "CheckpointWorkerError"
    assert report["named"]["close"]["workers_after"] == 0
    assert len(report["named"]["calls"]["calls"]["terminate"]) == 1, report["named"]["calls"]


ALIASES = """
    import inspect, json, sys
    {setup}
    import nvrx_ipc_fix
    {late}
    import {module} as defining
    import {importer} as importer
    original = inspect.signature(defining.maybe_finalize_async_save)
    def wrapped():
        f = importer.maybe_finalize_async_save
        return hasattr(f, "__wrapped__") and f is defining.maybe_finalize_async_save
    seen = [wrapped()]
    nvrx_ipc_fix.activate()
    seen.append(wrapped())
    same_signature = inspect.signature(importer.maybe_finalize_async_save) == original
    nvrx_ipc_fix.deactivate()
    seen.append(wrapped())
    print(json.dumps({{"seen": seen, "same_signature": same_signature}}))
"""


@needs_megatron
@pytest.mark.parametrize("late", [False, True], ids=["activated-first", "activated-late"])
def test_names_bound_by_from_import_see_the_wrapper(late):
    result = run_python(
        ALIASES.format(
            setup="",
            module="megatron.training.async_utils",
            importer="megatron.training.training",
            late="nvrx_ipc_fix.deactivate()" if late else "",
        )
    )
    assert result == {"seen": [not late, True, False], "same_signature": True}
