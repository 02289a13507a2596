"""The package's layers and the way their imports point (docs/architecture.md): start-up and
the public API at the top, then the fixes (``fixes/``, one module each), the worker's life
(``worker/``: start, watch, standby, prewarm, suspend, release) and ``core/`` at the bottom,
the machinery every fix shares. ``core`` imports nothing above it and names no module above
it (the one exception: the target table names each row's wrapper, ``fixes.x:function``, and
what activation imports with NVRx, ``worker.inherited``); ``worker`` imports only ``core``; a
fix imports no other fix. ``cli/`` and the demo's driver sit beside the public API. No module
imports itself back through others. Read from the sources (imports at any depth,
modules named in strings, imports of the root package), so that it holds for code no test
runs."""

import ast
import pathlib
import re

PACKAGE = pathlib.Path(__file__).resolve().parent.parent / "src" / "nvrx_ipc_fix"
LAYERS = {"core": {"core"}, "worker": {"core", "worker"}, "fixes": {"core", "worker", "fixes"}}
ABOVE_CORE = tuple(f"nvrx_ipc_fix.{layer}" for layer in ("fixes", "worker", "cli"))
#: A module of the package named in a string: ``fixes.x:function`` (the target table's
#: wrappers) or ``nvrx_ipc_fix.x.y``.
NAMED = re.compile(r"(?:nvrx_ipc_fix\.)?((?:core|fixes|worker|cli)\.[a-z_]+)(?::\w+)?")
TABLE = "core/targets.py"  # the one module of core that names modules above it
TABLE_NAMES = ("fixes.", "worker.inherited")  # what it names: each row's wrapper; ALWAYS


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
                module = list(parts[: len(parts) - node.level]) + (
                    node.module.split(".") if node.module else []
                )
            elif node.module == "nvrx_ipc_fix" or (node.module or "").startswith("nvrx_ipc_fix."):
                module = node.module.split(".")[1:]
            else:
                continue
            found.update(".".join(module + [alias.name]) for alias in node.names)  # x or .x
            if module:
                found.add(".".join(module))
        elif isinstance(node, ast.Import):
            found.update(
                alias.name[len("nvrx_ipc_fix.") :]
                for alias in node.names
                if alias.name.startswith("nvrx_ipc_fix.")
            )
            if any(alias.name == "nvrx_ipc_fix" for alias in node.names):
                found.add("")  # the root package
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            named = NAMED.fullmatch(node.value)
            if named:
                found.add(named.group(1))
    return found


def graph():
    """Each module of the package (below the root) -> the modules of the package it imports
    or names, by their name below ``nvrx_ipc_fix`` (``""``: the root)."""
    paths = {
        ".".join(p.relative_to(PACKAGE).with_suffix("").parts): p for p in PACKAGE.rglob("*.py")
    }
    names = {name.removesuffix(".__init__") for name in paths}
    edges = {}
    for name, path in paths.items():
        me = name.removesuffix(".__init__")
        targets = set()
        for found in imported(path):
            while found and found not in names:  # x.attribute -> x
                found = found.rpartition(".")[0]
            if found != me:
                targets.add(found)
        edges[me] = targets
    return edges


def test_core_and_the_fixes_import_only_what_is_below_them():
    wrong = []
    for layer, allowed in LAYERS.items():
        for path in modules(layer):
            for name in imported(path):
                table = f"{layer}/{path.name}" == TABLE and name.startswith(TABLE_NAMES)
                if name.split(".")[0] not in allowed and not table:
                    wrong.append(f"{layer}/{path.name} imports {name or 'the root package'}")
    assert wrong == []


def test_no_module_imports_itself_back():
    """No circle in the drawing of the imports (module level or inside functions, modules
    named in strings included), below the root package, which imports its modules lazily
    and which the Ray hook imports in another process."""
    edges = {name: {t for t in targets if t} for name, targets in graph().items() if name}
    index, low, stack, on, circles = {}, {}, [], set(), []

    def visit(node):  # Tarjan's strongly connected components
        index[node] = low[node] = len(index)
        stack.append(node)
        on.add(node)
        for other in edges.get(node, ()):
            if other not in index:
                visit(other)
                low[node] = min(low[node], low[other])
            elif other in on:
                low[node] = min(low[node], index[other])
        if low[node] == index[node]:
            circle = []
            while not circle or circle[-1] != node:
                circle.append(stack.pop())
                on.discard(circle[-1])
            if len(circle) > 1:
                circles.append(sorted(circle))

    for node in sorted(edges):
        if node not in index:
            visit(node)
    assert circles == []


def test_no_fix_imports_another():
    wrong = [
        f"fixes/{path.name} imports {name}"
        for path in modules("fixes")
        for name in imported(path)
        if name.startswith("fixes.") and name != f"fixes.{path.stem}"
    ]
    assert wrong == []


def test_core_names_no_module_above_it():
    """Not even to look one up in ``sys.modules``: what core needs from above registers
    with it (``cleanup.on_forget``, ``state.on_deactivate``, ``state.on_status``)."""
    wrong = [
        f"core/{path.name}: {node.value!r}"
        for path in modules("core")
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.Constant)
        and isinstance(node.value, str)
        and node.value.startswith(ABOVE_CORE)
    ]
    assert wrong == []


#: Names of NVRx's and megatron-core's code whose presence or meaning differs between their
#: versions (and between NVRx's caller and megatron-core's copy).
SHAPE_NAMES = {
    "_worker_data_cache",
    "_cached_identifiers",
    "_cached_tensor_data_ptrs",
    "cleanup_tensor_caches",
    "sigterm_timeout",
    "warmup_persistent_caller",
    "_warmup_persistent_caller",
    "get_instances",
    "persistent_caller",
    "_persistent_caller",
    "_persistent_process",
    "_persistent_queue",
    "_persistent_preload_q",
    "_persistent_comp_q",
    "preload_q",
    "comp_q",
    "cpu_shm_mode",
    "use_cached_data_structure",
    "use_cpu_shm_for_gpu_tensors",
    "cached_tensor_data",
    "uncached_tensor_data",
    "consistent_data_identifier",
    "_ActiveAsyncRequest",
    "AsyncRequest",
    "_get_async_caller",
    "_start_worker",
    "_results_queue",
    "WriteItemType",
    "_replace",
    "persistent",
    "results_queue",
    "_manager",
    "_wrap_exception",
    "_wrap_exception_for_gather",
}
#: The adapter (what differs between NVRx versions), the table (its targets' names and
#: parameters), and what status() and doctor list of the installed NVRx.
ADAPTER = {"core/shapes.py", "core/targets.py", "core/detect.py"}


def test_only_the_adapter_names_what_differs_between_nvrx_versions():
    """The fixes, release, prewarm and the after-fork code reach NVRx and megatron-core
    through ``core/shapes.py``: none of them names (or tests) such an attribute itself."""
    wrong = []
    for layer in ("core", "worker", "fixes"):
        for path in modules(layer):
            if f"{layer}/{path.name}" in ADAPTER:
                continue
            for node in ast.walk(ast.parse(path.read_text())):
                name = (
                    node.attr
                    if isinstance(node, ast.Attribute)
                    else node.value
                    if isinstance(node, ast.Constant)
                    else None
                )
                if name in SHAPE_NAMES:
                    wrong.append(f"{layer}/{path.name}:{node.lineno}: {name}")
    assert wrong == []


def test_the_check_sees_imports():
    """The reader finds relative, absolute and nested imports (else the checks above pass
    on nothing)."""
    assert {"core.config", "worker.release", "worker.prewarm"} <= imported(
        PACKAGE / "fixes" / "release_on_offload.py"
    )  # from ..core import x; nested imports
    assert {"core.config", "core.fork", "core.hooks", "core.status"} <= imported(
        PACKAGE / "core" / "lifecycle.py"
    )  # from . import x, y; from .status import z
    assert "worker.inherited" in imported(PACKAGE / "core" / "targets.py")  # the table's ALWAYS
    assert "fixes.worker_watch" in imported(PACKAGE / "core" / "targets.py")  # named in strings
    assert "" in imported(PACKAGE / "ray_hook.py")  # import nvrx_ipc_fix


def test_detect_names_every_module_the_table_patches():
    """``detect.MODULES`` (what the warnings held back about settings wait for) is the target
    table's modules, no more and no fewer."""
    from nvrx_ipc_fix.core.detect import MODULES
    from nvrx_ipc_fix.core.targets import TARGETS

    assert sorted(MODULES) == sorted({t.module for t in TARGETS})
