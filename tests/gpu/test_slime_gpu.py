"""slime's save-then-offload on a GPU (marked ``gpu``; skipped without CUDA): is the
model's memory still allocated after ``save_model``'s offload (``sleep()``)? The sequence
is tests/test_slime.py's (test double: tests/doubles/slime). Without the package the
worker still maps the storage of the save in flight; with it, ``release_on_offload``
releases the worker at ``sleep()``, with no code change. Run with megatron-core installed
(the megatron env)::

    PYTHONPATH=src:tests python -m pytest -q -m gpu tests/gpu/test_slime_gpu.py
"""

import pytest

from conftest import MCORE, needs_cache, scenario
from gpu.test_gpu import MODEL, NUMEL, TENSORS, _cuda
from test_slime import SLIME

pytestmark = [
    pytest.mark.gpu,
    needs_cache,
    pytest.mark.skipif(not _cuda(), reason="no CUDA device"),
    pytest.mark.skipif(MCORE is None, reason="needs megatron-core"),
]

STEPS = ["save_model", "save_model", "measure", "save_model", "measure", "onload", "finalize"]


def run(prelude, **kwargs):
    return scenario(STEPS, prelude=prelude, tensors=TENSORS, numel=NUMEL, **kwargs)


def test_without_the_package_slime_s_offload_leaves_the_model_allocated():
    report = run(SLIME, fix=False)
    assert all(m["allocated"] >= MODEL for m in report["measures"]), report["measures"]


def test_with_the_package_slime_s_offload_frees_the_model():
    report = run(SLIME)
    assert report["hang"] is None and [s["stale"] for s in report["saves"]] == [0, 0, 0]
    assert all(m["allocated"] < MODEL // 20 and m["workers"] == 0 for m in report["measures"]), (
        report["measures"]
    )
