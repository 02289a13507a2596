"""The package's layers point one way: start-up and the public API, then the features users
call (``features/``), the fixes (``fixes/``, one module each), and ``core/`` at the bottom.
``core`` imports nothing above it and names no module above it; a fix imports no other fix
(what fixes share lives in ``core``). ``cli/`` and the harness (``testing/``) sit beside the
public API. Read from the sources, so that it holds for code no test runs."""

import ast
import pathlib

PACKAGE = pathlib.Path(__file__).resolve().parent.parent / "src" / "nvrx_ipc_fix"
LAYERS = {"core": {"core"}, "fixes": {"core"}, "features": {"core", "fixes"}}
ABOVE_CORE = tuple(f"nvrx_ipc_fix.{layer}" for layer in ("fixes", "features", "cli", "testing"))


def modules(layer):
    return sorted((PACKAGE / layer).glob("*.py"))


def imported(path):
    """The package's modules ``path`` imports (any depth: inside functions too), by their
    name below ``nvrx_ipc_fix``."""
    parts = path.relative_to(PACKAGE).with_suffix("").parts
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                module = list(parts[:len(parts) - node.level]) + (
                    node.module.split(".") if node.module else [])
            elif node.module == "nvrx_ipc_fix" or (node.module or "").startswith(
                    "nvrx_ipc_fix."):
                module = node.module.split(".")[1:]
            else:
                continue
            found.update(".".join(module + [alias.name]) for alias in node.names)  # x or .x
            if module:
                found.add(".".join(module))
        elif isinstance(node, ast.Import):
            found.update(alias.name[len("nvrx_ipc_fix."):] for alias in node.names
                         if alias.name.startswith("nvrx_ipc_fix."))
    return found


def test_core_and_the_fixes_import_only_what_is_below_them():
    wrong = []
    for layer, allowed in LAYERS.items():
        for path in modules(layer):
            for name in imported(path):
                if name.split(".")[0] not in allowed:
                    wrong.append(f"{layer}/{path.name} imports {name}")
    assert wrong == []


def test_no_fix_imports_another():
    wrong = [f"fixes/{path.name} imports {name}" for path in modules("fixes")
             for name in imported(path)
             if name.startswith("fixes.") and name != f"fixes.{path.stem}"]
    assert wrong == []


def test_core_names_no_module_above_it():
    """Not even to look one up in ``sys.modules``: what core needs from above registers
    with it (``cleanup.on_forget``, ``worker.WORKER_IMPORTS``, ``release.treat_as_ipc``)."""
    wrong = [f"core/{path.name}: {node.value!r}" for path in modules("core")
             for node in ast.walk(ast.parse(path.read_text()))
             if isinstance(node, ast.Constant) and isinstance(node.value, str)
             and node.value.startswith(ABOVE_CORE)]
    assert wrong == []


#: Names of NVRx's and megatron-core's code whose presence or meaning differs between their
#: versions (and between NVRx's caller and megatron-core's copy).
SHAPE_NAMES = {
    "_worker_data_cache", "_cached_identifiers", "_cached_tensor_data_ptrs",
    "cleanup_tensor_caches", "sigterm_timeout", "warmup_persistent_caller",
    "_warmup_persistent_caller", "get_instances", "persistent_caller", "_persistent_caller",
    "_persistent_process", "_persistent_queue", "_persistent_preload_q", "_persistent_comp_q",
    "preload_q", "comp_q", "cpu_shm_mode", "use_cached_data_structure",
    "use_cpu_shm_for_gpu_tensors", "cached_tensor_data", "uncached_tensor_data",
    "consistent_data_identifier", "_ActiveAsyncRequest", "AsyncRequest", "_get_async_caller",
    "_start_worker", "_results_queue", "WriteItemType", "_replace", "persistent",
}
#: The adapter (issue 36), the table (its targets' names and parameters), and what status()
#: and doctor list of the installed NVRx.
ADAPTER = {"core/shapes.py", "core/targets.py", "core/detect.py"}


def test_only_the_adapter_names_what_differs_between_nvrx_versions():
    """The fixes, release, prewarm and the after-fork code reach NVRx and megatron-core
    through ``core/shapes.py``: none of them names (or tests) such an attribute itself."""
    wrong = []
    for layer in ("core", "fixes", "features"):
        for path in modules(layer):
            if f"{layer}/{path.name}" in ADAPTER:
                continue
            for node in ast.walk(ast.parse(path.read_text())):
                name = (node.attr if isinstance(node, ast.Attribute) else node.value
                        if isinstance(node, ast.Constant) else None)
                if name in SHAPE_NAMES:
                    wrong.append(f"{layer}/{path.name}:{node.lineno}: {name}")
    assert wrong == []


def test_the_check_sees_imports():
    """The reader finds relative, absolute and nested imports (else the checks above pass
    on nothing)."""
    assert {"core.config", "core.release", "core.prewarming"} <= imported(
        PACKAGE / "fixes" / "release_on_offload.py")  # from ..core import x; nested imports
    assert {"core.config", "core.fork", "core.hooks", "core.status"} <= imported(
        PACKAGE / "core" / "lifecycle.py")  # from . import x, y; from .status import z
    assert "core.release" in imported(PACKAGE / "features" / "release.py")
