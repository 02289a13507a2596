"""On a GPU: a trainer SIGKILLed in each state gives its device back (``worker/guardian.py``),
with a 2 GiB model of 16 tensors: 10 s later no process of its session is left and
``nvidia-smi`` lists none of them, the device's memory is as before the trainer, and a new
trainer on the same device saves and loads. States: the worker idle after a save, writing,
forked from the standby after a ``restart`` release and onload, and suspended by the CUDA
driver inside a ``suspend`` release (during "inference"). Marked ``gpu``; skipped without
CUDA."""

import os
import subprocess

import pytest

from conftest import needs_cache, scenario
from test_orphans import killed, trainer  # noqa: F401 (the fixture)

from gpu.test_gpu import _cuda

pytestmark = [
    pytest.mark.gpu,
    needs_cache,
    pytest.mark.skipif(not _cuda(), reason="no CUDA device"),
]

#: a 2 GiB model; NVRX_TESTS_MODEL_BYTES another size (a short device call)
TENSORS, NUMEL = 16, int(os.environ.get("NVRX_TESTS_MODEL_BYTES", 2 << 30)) // 4 // 16
STATES = {
    "idle": ["save", "hold"],
    "writing": ["save", "fault-hold-async", "writing", "hold"],
    "restart": [
        "save",
        "offloading-restart",
        "standby",
        "ready",
        "save",
        "offloading-restart",
        "ready",
        "hold",
    ],
    "suspended": ["save", "suspend", "hold"],
}


def smi(query):
    out = subprocess.run(
        ["nvidia-smi", f"--query-{query}", "--format=csv,noheader,nounits"],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    ).stdout
    return [line.strip() for line in out.splitlines() if line.strip()]


def used_mib():
    return int(smi("gpu=memory.used")[0])


def compute_pids():
    return {int(line.split(",")[0]) for line in smi("compute-apps=pid")}


@pytest.mark.parametrize("state", list(STATES))
def test_a_killed_trainer_gives_its_gpu_back(trainer, state):  # noqa: F811
    before = used_mib()
    one = trainer(
        STATES[state],
        tensors=TENSORS,
        numel=NUMEL,
        env={"NVRX_IPC_FIX_STANDBY": "on"} if state == "restart" else None,
    )
    reached = one.reached()
    ours = {
        pid
        for pid in (reached["trainer"], reached["worker"], reached["standby"], reached["writer"])
        if pid
    }
    on_device = compute_pids() & ours
    assert reached["trainer"] in on_device, (reached, on_device)
    if state == "suspended":  # nothing of the suspended worker is on the device
        assert reached["worker"] not in compute_pids(), reached
    elif state != "restart":
        assert reached["worker"] in on_device, (reached, on_device)
    assert killed(one) == {}
    assert not compute_pids() & ours
    after = used_mib()
    assert after <= before + 64, (before, after)  # MiB: the device is as before
    report = scenario(["save", "replace", "save"], tensors=TENSORS, numel=NUMEL, timeout=300)
    assert report["hang"] is None, report["stderr"][-3000:]
    assert [s["stale"] for s in report["saves"]] == [0, 0]
