"""Ray actors on a real local cluster (CPU).

* Activated by the worker setup hook, and by the ``.pth`` where the workers run from this
  environment.
* Actors started with their own ``py_executable`` from a separate uv-built venv that does
  not have the package (as NeMo RL starts its Megatron workers): the string hook kills
  them, ``ray_runtime_env()``'s hook does not, and a bundle on ``PYTHONPATH`` passed on
  as NeMo RL passes the driver's environment puts both fixes into the real NVRx worker
  there.

The py311-ray-wrapt2 tox env installs Ray (requirements/ray.txt) and uv; elsewhere this
module is skipped.
"""

import json
import os
import sys
import textwrap
from importlib import metadata
from pathlib import Path

import pytest

from conftest import pth_installed, run_process, run_python, uv

try:
    metadata.version("ray")  # not importorskip: a ray/ directory in the cwd would import
except metadata.PackageNotFoundError:
    pytest.skip(
        "Ray is not installed here; the py311-ray-wrapt2 tox env installs it "
        "(requirements/ray.txt)",
        allow_module_level=True,
    )

ROOT = Path(__file__).resolve().parents[1]
REQUIREMENTS = ROOT / "requirements"
NVRX = "nvidia-resiliency-ext==0.6.0"

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


@pytest.fixture(scope="session")
def actor_python(tmp_path_factory):
    """A uv-built venv like NeMo RL's ``mcore`` one: Ray, torch (CPU), NVRx 0.6.0, no wrapt
    and no nvrx-ipc-fix. Returns its interpreter."""
    venv = tmp_path_factory.mktemp("actor") / "mcore"
    uv("venv", "--quiet", "--python", sys.executable, str(venv))
    python = str(venv / "bin" / "python")
    uv(
        "pip",
        "install",
        "--quiet",
        "--python",
        python,
        "-r",
        str(REQUIREMENTS / "ray.txt"),
        "-r",
        str(REQUIREMENTS / "torch-cpu.txt"),
        "-r",
        str(REQUIREMENTS / "nvrx-deps.txt"),
    )
    rc, out, err = run_process(
        [sys.executable, str(REQUIREMENTS / "install_wheel.py"), "--python", python, NVRX],
        timeout=300,
    )
    assert rc == 0, err
    rc, out, err = run_process([python, "-c", "import wrapt"])
    assert rc == 1 and "No module named 'wrapt'" in err  # only the bundle can bring it
    return python


# A job whose workers start from actor_python, as NeMo RL's RayWorkerGroup starts them:
# py_executable, the driver's whole environment in env_vars, VIRTUAL_ENV.
JOB = """
    import json, os, sys, tempfile
    import nvrx_ipc_fix, ray

    PYTHON = {python!r}
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False,
             runtime_env={runtime_env})

    @ray.remote(num_cpus=0)
    class Worker:
        def report(self, steps=None):
            seen = {{"pid": os.getpid(), "python": sys.executable,
                     "imported": "nvrx_ipc_fix" in sys.modules}}
            if steps:  # the real NVRx worker, spawned from this actor
                from multiprocessing import resource_tracker
                from harness import scenario
                named, register = [], resource_tracker.register

                def recording(name, rtype):  # each named semaphore the run makes
                    if rtype == "semaphore":
                        named.append(name)
                    return register(name, rtype)

                resource_tracker.register = recording  # SemLock looks it up at each call
                try:
                    with tempfile.TemporaryDirectory() as d:
                        seen["scenario"] = scenario.run(steps, d, timeout=60, n_tensors=8,
                                                        numel=512)
                finally:
                    resource_tracker.register = register
                seen["semaphores"] = sorted(set(named))
            if seen["imported"]:
                status = sys.modules["nvrx_ipc_fix"].status()
                seen.update(source=status.source, requested_by=list(status.requested_by),
                            wrapt=getattr(sys.modules.get("wrapt"), "__file__", None))
            seen["stderr"] = open("/proc/self/fd/2").read()
            return seen

        def exit(self):
            ray.actor.exit_actor()  # runs the actor's exit handlers; ray.shutdown() does not

    started = []

    def start(**env):
        venv = os.path.dirname(os.path.dirname(PYTHON))
        env_vars = {{**os.environ, "VIRTUAL_ENV": venv, "UV_PROJECT_ENVIRONMENT": venv, **env}}
        started.append(Worker.options(runtime_env={{"py_executable": PYTHON,
                                                    "env_vars": env_vars}}).remote())
        return started[-1]

    try:
        result = {{}}
{body}
        print("RESULT", json.dumps(result), flush=True)
    finally:
        # ray.shutdown() ends an actor with SIGTERM (no Python exit handlers) and kills its
        # children, multiprocessing's resource tracker among them: the named semaphores of
        # the NVRx queues made in the actor would stay in /dev/shm. Exit them first.
        for actor in started:
            try:
                ray.get(actor.exit.remote(), timeout=60)
            except Exception:  # RayActorError: it exited, as asked (or had died before)
                pass
        ray.shutdown()
"""


def job(python, body, runtime_env="{}", env=None, timeout=540):
    """Run JOB; its result (Ray also prints a dead worker's errors to the driver's stdout)."""
    code = JOB.format(
        python=python, runtime_env=runtime_env, body=textwrap.indent(textwrap.dedent(body), " " * 8)
    )
    rc, out, err = run_process(
        [sys.executable, "-c", textwrap.dedent(code)], auto=True, env=env, timeout=timeout
    )
    assert rc == 0, f"exit {rc}\nstdout:\n{out[-3000:]}\nstderr:\n{err[-3000:]}"
    return json.loads(next(line for line in out.splitlines() if line.startswith("RESULT "))[7:])


def test_the_string_hook_kills_an_actor_whose_environment_lacks_the_package(actor_python):
    """What the README's Ray recipe used to do to NeMo RL's Megatron workers."""
    seen = job(
        actor_python,
        """
        try:
            ray.get(start().report.remote(), timeout=240)
            result["died"] = None
        except ray.exceptions.ActorDiedError as exc:
            result["died"] = str(exc)
    """,
        runtime_env='{"worker_process_setup_hook": "nvrx_ipc_fix.ray_worker_setup"}',
    )
    assert seen["died"] and "Failed to execute the setup hook" in seen["died"]
    assert "No module named 'nvrx_ipc_fix'" in seen["died"]


def test_ray_runtime_env_hook_leaves_such_an_actor_running_and_says_why(actor_python):
    seen = job(
        actor_python,
        """
        result.update(ray.get(start().report.remote(), timeout=240))
    """,
        runtime_env="nvrx_ipc_fix.ray_runtime_env()",
    )
    assert seen["python"] == actor_python and not seen["imported"]
    assert "nvrx_ipc_fix: not importable in this Ray worker" in seen["stderr"]
    assert f"doctor --python {actor_python}" in seen["stderr"]


def test_ray_runtime_env_keeps_what_it_is_given_and_passes_settings_on(monkeypatch):
    import nvrx_ipc_fix

    monkeypatch.setenv("NVRX_IPC_FIX_RELEASE", "finalize")
    monkeypatch.setenv("NVRX_IPC_FIX_STRATEGY", "terminate")
    given = {"env_vars": {"NVRX_IPC_FIX_RELEASE": "never", "A": "1"}, "pip": ["x"]}
    env = nvrx_ipc_fix.ray_runtime_env(given)
    assert env["env_vars"] == {
        "NVRX_IPC_FIX_RELEASE": "never",
        "A": "1",
        "NVRX_IPC_FIX_STRATEGY": "terminate",
    }
    assert env["pip"] == ["x"] and callable(env["worker_process_setup_hook"])
    assert given == {"env_vars": {"NVRX_IPC_FIX_RELEASE": "never", "A": "1"}, "pip": ["x"]}
    for hook in (1, b"nvrx_ipc_fix.ray_worker_setup"):
        with pytest.raises(TypeError):
            nvrx_ipc_fix.ray_runtime_env({"worker_process_setup_hook": hook})


@pytest.mark.parametrize("theirs", ["lambda", "string"])
def test_ray_runtime_env_hook_activates_and_chains_an_existing_hook(tmp_path, theirs):
    mark = tmp_path / "mark"
    (tmp_path / "their_hook.py").write_text(
        f"def setup():\n    open({str(mark)!r}, 'a').write('theirs\\n')\n"
    )
    hook = (
        f"lambda: open({str(mark)!r}, 'a').write('theirs\\n')"
        if theirs == "lambda"
        else "'their_hook.setup'"
    )
    seen = run_python(
        f"""
        import json, sys, ray, nvrx_ipc_fix
        ray.init(num_cpus=1, include_dashboard=False, log_to_driver=False,
                 runtime_env=nvrx_ipc_fix.ray_runtime_env({{
                     "env_vars": {{"NVRX_IPC_FIX_AUTO": "0", "PYTHONPATH": {str(tmp_path)!r}}},
                     "worker_process_setup_hook": {hook}}}))

        @ray.remote(num_cpus=0)
        def probe():
            s = sys.modules["nvrx_ipc_fix"].status()
            return {{"source": s.source, "requested_by": list(s.requested_by)}}
        try:
            print(json.dumps(ray.get(probe.remote(), timeout=240)))
        finally:
            ray.shutdown()
    """,
        auto=True,
        timeout=540,
    )
    assert seen == {"source": "ray-hook", "requested_by": ["ray-hook"]}
    assert mark.read_text().splitlines()[:1] == ["theirs"]


@pytest.fixture(scope="session")
def bundle(tmp_path_factory):
    directory = tmp_path_factory.mktemp("bundle") / "nvrx-ipc-fix"
    rc, out, err = run_process([sys.executable, "-m", "nvrx_ipc_fix", "bundle", str(directory)])
    assert rc == 0, err
    return str(directory)


def test_nemo_rl_recipe_a_bundle_on_pythonpath_fixes_the_real_worker_in_a_uv_venv_actor(
    actor_python, bundle
):
    """The README's NeMo RL recipe: PYTHONPATH exported before the job starts reaches every
    actor through the driver environment NeMo RL passes on (virtual_cluster.init_ray,
    RayWorkerGroup). Both fixes hold on NVRx 0.6.0's real worker inside the actor; the same
    actor with the package off writes stale checkpoints."""
    seen = job(
        actor_python,
        """
        fixed = start()
        result["replace"] = ray.get(fixed.report.remote("save,save,replace,save".split(",")),
                                    timeout=300)
        result["close"] = ray.get(fixed.report.remote("save,save,close,save".split(",")),
                                  timeout=300)
        off = start(NVRX_IPC_FIX_DISABLE="1")
        result["off"] = ray.get(off.report.remote("save,save,replace,save".split(",")),
                                timeout=300)
    """,
        runtime_env="{'env_vars': dict(os.environ)}",  # NeMo RL's init_ray
        env={"PYTHONPATH": bundle},
    )
    for case in ("replace", "close"):
        seen_case = seen[case]
        assert seen_case["python"] == actor_python and seen_case["source"] == "sitecustomize"
        assert seen_case["wrapt"].startswith(os.path.join(bundle, "_nvrx_ipc_fix_deps"))
        report = seen_case["scenario"]
        assert report["nvrx"] == "0.6.0" and report["source"] == "sitecustomize"
        assert report["fix"]["clear_on_close"] == "active"
        assert report["fix"]["stale_guard"] == "active"
        assert report["hang"] is None
        assert [s["stale"] for s in report["saves"]] == [0, 0, 0], report
    assert seen["close"]["scenario"]["cleanups"] >= 1
    named = {name for case in ("replace", "close", "off") for name in seen[case]["semaphores"]}
    assert named  # the actors' NVRx queues had named semaphores; none is left in /dev/shm
    assert [n for n in named if os.path.exists(f"/dev/shm/sem.{n.lstrip('/')}")] == []
    off = seen["off"]["scenario"]
    assert off["fix"]["stale_guard"] == "disabled"
    assert off["saves"][-1]["stale"] == 8  # without the fix: every tensor stale


def test_doctor_python_checks_the_actor_interpreter_with_and_without_the_bundle(
    actor_python, bundle
):
    rc, out, err = run_process(
        [sys.executable, "-m", "nvrx_ipc_fix", "doctor", "--python", actor_python], auto=True
    )
    assert rc == 1, out + err
    assert f"FAIL  package: nvrx_ipc_fix is not importable by {actor_python}" in out
    assert "result: NVRx 0.6.0 needs the fix" in out and "bundle DIR" in out
    rc, out, err = run_process(
        [sys.executable, "-m", "nvrx_ipc_fix", "doctor", "--python", actor_python],
        auto=True,
        env={"PYTHONPATH": bundle},
    )
    assert rc == 0, out + err
    assert "ok    activation: active, source sitecustomize" in out
    assert "ok    fix clear_on_close: active" in out and "ok    fix stale_guard: active" in out
    assert f"ok    wrapt: {metadata.version('wrapt')}" in out
