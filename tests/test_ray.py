"""Ray actors on a real local cluster (CPU): activated by the worker setup hook, and by the
``.pth`` where the workers run from this environment. The py311-ray-wrapt2 tox env installs
Ray (requirements/ray.txt); elsewhere this module is skipped."""

from importlib import metadata

import pytest

from conftest import pth_installed, run_python

try:
    metadata.version("ray")  # not importorskip: a ray/ directory in the cwd would import
except metadata.PackageNotFoundError:
    pytest.skip("Ray is not installed here; the py311-ray-wrapt2 tox env installs it "
                "(requirements/ray.txt)", allow_module_level=True)

ACTORS = """
    import json, os, sys
    import ray

    ray.init(num_cpus=1, include_dashboard=False, runtime_env={
        "worker_process_setup_hook": "nvrx_ipc_fix.ray_worker_setup",
        # start-up activation off in the workers, as where .pth files are not read
        "env_vars": {"NVRX_IPC_FIX_AUTO": "0"}})

    @ray.remote(num_cpus=0)
    class Probe:
        def status(self):
            s = sys.modules["nvrx_ipc_fix"].status()
            return {"pid": os.getpid(), "activated": s.activated, "source": s.source,
                    "requested_by": list(s.requested_by)}

    try:
        hooked = Probe.remote()
        started = Probe.options(runtime_env={"env_vars": {"NVRX_IPC_FIX_AUTO": "1"}}).remote()
        print(json.dumps({"driver": os.getpid(),
                          "hook": ray.get(hooked.status.remote(), timeout=240),
                          "pth": ray.get(started.status.remote(), timeout=240)}))
    finally:
        ray.shutdown()
"""


@pth_installed
def test_ray_actors_are_active_through_the_hook_and_the_pth():
    seen = run_python(ACTORS, auto=True, timeout=540)
    hook, pth = seen["hook"], seen["pth"]
    assert len({seen["driver"], hook["pid"], pth["pid"]}) == 3
    assert hook["activated"] and hook["source"] == "ray-hook"
    assert hook["requested_by"] == ["ray-hook"]  # env_vars reached it: the .pth stayed off
    assert pth["activated"] and pth["source"] == "pth"
    assert pth["requested_by"] == ["pth", "ray-hook"]
