"""slime's save-then-offload on a GPU (marked ``gpu``; skipped without CUDA): is the
model's memory still allocated after ``save_model``'s offload (``sleep()``)? The sequence
is tests/test_slime.py's (test double: tests/doubles/slime). The package has no slime
target: the first test measures what it does alone (the worker still maps the storage
of the save in flight), the second the explicit activation, ``nvrx_ipc_fix.release()``
before slime pauses its memory. Run with megatron-core installed (the megatron env)::

    PYTHONPATH=src:tests python -m pytest -q -m gpu tests/gpu/test_slime_gpu.py
"""

import pytest

from conftest import MCORE, needs_cache, scenario
from gpu.test_gpu import MODEL, NUMEL, TENSORS, _cuda
from test_slime import SLIME

pytestmark = [pytest.mark.gpu, needs_cache,
              pytest.mark.skipif(not _cuda(), reason="no CUDA device"),
              pytest.mark.skipif(MCORE is None, reason="needs megatron-core")]

RELEASE_FIRST = SLIME + """
    import nvrx_ipc_fix
    _pause = MegatronTrainRayActor.sleep
    def _sleep(self):
        nvrx_ipc_fix.release()  # what a slime user adds before torch_memory_saver.pause()
        _pause(self)
    MegatronTrainRayActor.sleep = _sleep
"""
STEPS = ["save_model", "save_model", "measure", "save_model", "measure", "onload", "finalize"]


def run(prelude, **kwargs):
    return scenario(STEPS, prelude=prelude, tensors=TENSORS, numel=NUMEL, **kwargs)


def test_the_package_alone_after_slime_s_offload():
    report = run(SLIME)
    assert report["hang"] is None and [s["stale"] for s in report["saves"]] == [0, 0, 0]
    held = [m["allocated"] for m in report["measures"]]
    print(f"allocated after the offload (package alone): {held} (model: {MODEL})")


def test_release_before_slime_s_offload_frees_the_model():
    report = run(RELEASE_FIRST)
    assert report["hang"] is None and [s["stale"] for s in report["saves"]] == [0, 0, 0]
    assert all(m["allocated"] < MODEL // 20 for m in report["measures"]), report["measures"]
