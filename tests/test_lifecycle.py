"""Every order of import / activate / deactivate, each in a process of its own that has
imported neither NVRx nor the package (``conftest.run_python``), against the real NVRx
classes: patched exactly once, restored exactly, ``status()`` true in each state.

Each run checks the state after every step, so the maximal sequences cover their prefixes.
"""

import itertools
from importlib import metadata

import pytest

from conftest import MCORE, NVRX, expect, lacks, needs_nvrx, run_python

pytestmark = needs_nvrx

CORE = "nvidia_resiliency_ext.checkpointing.async_ckpt.core"
FS = "nvidia_resiliency_ext.checkpointing.async_ckpt.filesystem_async"
MEGATRON, BRIDGE = "megatron.training.async_utils", "megatron.bridge.training.checkpointing"
MCORE_FS = "megatron.core.dist_checkpointing.strategies.filesystem_async"
MCORE_ASYNC = "megatron.core.dist_checkpointing.strategies.async_utils"
try:
    BRIDGE_DIST = metadata.version("megatron-bridge")
except metadata.PackageNotFoundError:
    BRIDGE_DIST = None

CHECKER = """
import importlib, json, sys
from harness.wrapping import chain
STEPS = {steps!r}
SITES = {{"close": ("{core}", "PersistentAsyncCaller"),
          "is_current_async_call_done": ("{core}", "PersistentAsyncCaller"),
          "schedule_async_request": ("{core}", "AsyncCallsQueue"),
          "prepare_write_data": ("{fs}", "FileSystemWriterAsync"),
          "retrieve_write_results": ("{fs}", "FileSystemWriterAsync")}}
innermost, log = {{}}, []

def observe():
    seen = {{}}
    for name, (module, cls) in SITES.items():
        if module not in sys.modules:
            continue
        f = vars(getattr(sys.modules[module], cls))[name]
        while hasattr(f, "__wrapped__"):
            f = f.__wrapped__
        first = innermost.setdefault(name, f)
        seen[name] = {{**chain(getattr(sys.modules[module], cls), name),
                      "same_original": f is first, "qualname": f.__qualname__}}
    if "nvrx_ipc_fix" in sys.modules:
        status = sys.modules["nvrx_ipc_fix"].status()
        seen["activated"] = status.activated
        seen["targets"] = {{f"{{t.fix}} {{t.target}}": str(t.state) for t in status.targets}}
    return seen

for step in STEPS:
    if step == "pkg":
        import nvrx_ipc_fix
    elif step == "nvrx":
        importlib.import_module("{core}"); importlib.import_module("{fs}")
    elif step == "foreign":  # another library wraps on top of us (wrapt, like most do)
        import wrapt
        wrapt.wrap_function_wrapper("{core}", "PersistentAsyncCaller.close",
                                    lambda w, i, a, k: w(*a, **k))
    else:
        getattr(sys.modules["nvrx_ipc_fix"], step)()
    log.append([step, observe()])
print(json.dumps(log))
"""


def run_steps(steps, env=None):
    return run_python(CHECKER.format(steps=list(steps), core=CORE, fs=FS), env=env)


def expected_steps(active, imported):
    """The fixes' steps in our one wrapper of each NVRx method in that state, in order."""
    on = active and imported
    cache, warmup = on and expect("cache"), on and expect("warmup")
    return {
        "close": ["suspend", "clear_on_close"] * cache + ["cpu_snapshot", "worker_watch"] * on,
        "is_current_async_call_done": ["worker_watch"] * on,
        "schedule_async_request": (
            ["suspend"] * cache + ["prewarm"] * warmup + ["cpu_snapshot", "worker_watch"] * on
        ),
        # a planned key stays valid (clear_on_close), stale storage is re-sent
        # (stale_guard), the save gets a results queue of its own (own_results: every
        # NVRx's writer shares one), the CPU tensors are copied (cpu_snapshot: where NVRx
        # sends the trainer's own)
        "prepare_write_data": (
            ["clear_on_close"] * cache
            + ["stale_guard"] * (cache and not expect("upstream_ptrs"))
            + ["own_results"] * on
            + ["cpu_snapshot"] * (on and not expect("snapshots"))
        ),
        "retrieve_write_results": ["own_results"] * on,
    }


def expected_state(active, imported, key):
    """The state of target ``key`` ("fix module:attr") in that state, read off the table."""
    fix, target = key.split(" ")
    module, attr = target.split(":")
    if not active:
        return "disabled"
    if (
        fix == "mcore_worker_watch"
        or module in (MCORE_FS, MCORE_ASYNC)
        or (fix == "worker_watch" and module == MEGATRON)
    ):
        return "pending" if MCORE else "not_applicable"  # megatron-core: never imported here
    if fix == "worker_watch" and module == BRIDGE:
        return "pending" if BRIDGE_DIST else "not_applicable"
    if module not in (CORE, FS):  # Megatron, Bridge and NeMo RL targets: never imported here
        installed = {MEGATRON: MCORE, BRIDGE: BRIDGE_DIST}.get(module, True)  # NeMo RL: no dist
        return "pending" if expect("cache") and installed else "not_applicable"
    if not imported:
        return "pending"
    if fix == "worker_watch":
        if attr == "PersistentAsyncCaller.async_process_target":
            return "active" if expect("worker_loop") else "not_applicable"
        return "active"  # every NVRx with a persistent worker
    if fix == "prewarm":
        return "active" if expect("warmup") else "not_applicable"
    if fix == "own_results":
        return "active"  # every NVRx's writer shares one results queue
    if fix == "cpu_snapshot":  # the copy at a schedule, the drop at a close: every NVRx
        if module == CORE:  # (a no-op where the writer's step is not installed)
            return "active"
        return "fixed_upstream" if expect("snapshots") else "active"
    if not expect("cache"):
        return "not_applicable"
    if fix == "stale_guard" and expect("upstream_ptrs"):
        return "fixed_upstream"
    return "active"


def sequences():
    """pkg first (it activates) with nvrx imported at every point of two toggles; and nvrx
    imported before the package (late activation)."""
    for toggles in itertools.product(["activate", "deactivate"], repeat=2):
        for at in range(3):
            rest = list(toggles)
            rest.insert(at, "nvrx")
            yield ["pkg", *rest]
        yield ["nvrx", "pkg", *toggles]


@pytest.mark.parametrize("steps", list(sequences()), ids="-".join)
def test_lifecycle_order(steps):
    active = imported = False
    for (step, seen), wanted in zip(run_steps(steps), steps):
        assert step == wanted
        active = {"pkg": True, "activate": True, "deactivate": False}.get(step, active)
        imported = imported or step == "nvrx"
        for name, wanted in expected_steps(active, imported).items():
            if imported:  # one wrapper of ours where a fix has a step, never stacked
                assert seen[name]["steps"] == wanted, (steps, step, name, seen)
                assert seen[name]["depth"] == seen[name]["ours"] == int(bool(wanted)), (
                    steps,
                    step,
                    name,
                    seen,
                )
                assert seen[name]["same_original"], (steps, step, name)
        if "targets" in seen:
            assert seen["activated"] is active
            for target, state in seen["targets"].items():
                assert state == expected_state(active, imported, target), (steps, step, target)


def test_kill_switch_patches_nothing():
    log = run_steps(["pkg", "nvrx", "activate"], env={"NVRX_IPC_FIX_DISABLE": "1"})
    for _, seen in log[1:]:
        assert seen["close"]["depth"] == seen["close"]["ours"] == 0
        assert set(seen["targets"].values()) == {"disabled"}
        assert seen["activated"] is False


@pytest.mark.skipif(
    NVRX not in ("0.6.0", "0.7.0"),
    reason=lacks("has no two fixes on close() (0.6.0 and 0.7.0 have)"),
)
def test_foreign_wrapper_on_top_is_kept_and_we_go_inert():
    log = dict(
        (s, o)
        for s, o in run_steps(["pkg", "nvrx", "foreign", "deactivate", "activate", "deactivate"])
    )
    close = f"{CORE}:PersistentAsyncCaller.close"
    three = ["suspend", "clear_on_close", "cpu_snapshot", "worker_watch"]
    assert log["foreign"]["close"] == {
        **log["foreign"]["close"],
        "depth": 2,
        "ours": 1,
        "steps": three,
    }  # ours (its three steps), theirs
    # left in their chain, switched off: no step
    assert log["deactivate"]["close"] == {
        **log["deactivate"]["close"],
        "depth": 2,
        "ours": 1,
        "steps": [],
    }
    assert log["deactivate"]["targets"][f"clear_on_close {close}"] == "disabled"
    assert log["deactivate"]["targets"][f"worker_watch {close}"] == "disabled"
    assert log["deactivate"]["targets"][f"suspend {close}"] == "disabled"
    # re-enabled, never stacked
    assert log["activate"]["close"] == {
        **log["activate"]["close"],
        "depth": 2,
        "ours": 1,
        "steps": three,
    }


@pytest.mark.parametrize("fix", ["stale_guard", "worker_watch", "STALE_GUARD , clear_on_close"])
def test_fix_disabled_by_name_shows_disabled_before_and_after_import(fix):
    log = run_steps(["pkg", "nvrx"], env={"NVRX_IPC_FIX_DISABLE": fix})
    names = {name.strip().lower() for name in fix.split(",")}
    for step, seen in log:
        for key, state in seen["targets"].items():
            if key.split(" ")[0] in names:
                assert state == "disabled", (step, key)
            else:
                assert state != "disabled", (step, key)
    seen = log[-1][1]
    assert seen["prepare_write_data"]["steps"] == (
        ["clear_on_close"] * ("clear_on_close" not in names and expect("cache"))
        + ["stale_guard"]
        * ("stale_guard" not in names and expect("cache") and not expect("upstream_ptrs"))
        + ["own_results"]
        + ["cpu_snapshot"] * (not expect("snapshots"))
    )
    assert seen["close"]["steps"] == (
        ["suspend"] * expect("cache")
        + ["clear_on_close"] * ("clear_on_close" not in names and expect("cache"))
        + ["cpu_snapshot"]
        + ["worker_watch"] * ("worker_watch" not in names)
    )


def test_activation_and_patching_import_nothing_of_the_cli():
    """``import nvrx_ipc_fix`` and NVRx's import (every fix patched) load ``core``, ``worker``
    and ``fixes`` only: never ``nvrx_ipc_fix.cli`` (the demo's driver has torch at its top)."""
    loaded = run_python("""
        import json, sys
        import nvrx_ipc_fix
        import nvidia_resiliency_ext.checkpointing.async_ckpt.core
        import nvidia_resiliency_ext.checkpointing.async_ckpt.filesystem_async
        nvrx_ipc_fix.status()
        print(json.dumps(sorted(m for m in sys.modules if m.startswith("nvrx_ipc_fix"))))
    """)
    rooms = {name.split(".")[1] for name in loaded if name.count(".")}
    assert "nvrx_ipc_fix.core.lifecycle" in loaded
    assert rooms <= {"core", "worker", "fixes"}, loaded


def test_dir_and_help_list_the_public_api_and_the_lazy_names_stay_lazy():
    seen = run_python("""
        import json, pydoc, sys
        import nvrx_ipc_fix
        names = dir(nvrx_ipc_fix)
        lazy = sorted(m for m in sys.modules if m.startswith("nvrx_ipc_fix.")
                      and m.split(".")[-1] in ("status", "release", "prewarm", "errors", "ray"))
        text = pydoc.render_doc(nvrx_ipc_fix, renderer=pydoc.plaintext)
        print(json.dumps([names, nvrx_ipc_fix.__all__, lazy, text]))
    """)
    names, public, lazy, text = seen
    assert set(public) <= set(names) and names == sorted(names), names
    assert lazy == []  # dir() named them without importing them
    for name in public:  # a function, a class, or an alias of one (name = class ...)
        assert any(f"\n    {name}{how}" in text for how in ("(", " = class ")) or (
            f"class {name}(" in text
        ), name


@needs_nvrx
@pytest.mark.parametrize("first", ["package", "nvrx"])
def test_nothing_is_imported_under_the_lifecycle_lock(first):
    """The hooks decide and import (the checks, wrapt, the fix modules, the distribution's
    version) before they take ``lifecycle._lock``, and activation registers its hooks after
    it lets go: an import under the lock could wait on another thread's import whose hook
    waits on the lock, a deadlock Python does not detect."""
    under_lock = run_python(
        f"""
        import json, sys
        from nvrx_ipc_fix.core import lifecycle

        class Recorder:  # sees every import not already done
            seen = []
            def find_spec(self, name, path=None, target=None):
                if lifecycle._lock._is_owned():
                    self.seen.append(name)
                return None

        sys.meta_path.insert(0, Recorder())
        if {first!r} == "nvrx":
            import nvidia_resiliency_ext.checkpointing.async_ckpt.core
            import nvidia_resiliency_ext.checkpointing.async_ckpt.filesystem_async
        import nvrx_ipc_fix
        import nvidia_resiliency_ext.checkpointing.async_ckpt.core
        import nvidia_resiliency_ext.checkpointing.async_ckpt.filesystem_async
        status = nvrx_ipc_fix.status()
        print(json.dumps([Recorder.seen, [f.state for f in status.fixes]]))
    """,
        fresh=True,
    )
    seen, states = under_lock
    assert "active" in states, states
    assert seen == [], seen
