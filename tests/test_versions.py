"""The one table of known releases (``detect.RELEASES``) and the rule for any other version:
on the NVRx (and megatron-core) installed here, every probe's verdict read off the table is
the verdict that the names of its classes give (``hasattr``, signatures) when the version is
one the table does not hold, a git build; and ``EXPECT`` (conftest) is built from the table."""

import pytest

from conftest import EXPECT, MCORE, NVRX, needs_nvrx, run_python
from nvrx_ipc_fix.core.detect import MCORE_RELEASES, NVRX_RELEASES

PROBES = r"""
    import importlib, json
    from nvrx_ipc_fix.core import shapes

    MODULES = {MODULES!r}
    PROBES = ("worker_cache", "writer_cache", "writer_keys", "shared_results", "cpu_snapshots",
              "persistent_queue", "persistent_worker", "warm_up", "worker_loop", "caller_queues")

    def verdicts():
        shapes._shapes.clear()
        found = {{}}
        for name in MODULES:
            module = importlib.import_module(name)
            for probe in PROBES:
                try:
                    found[f"{{name}} {{probe}}"] = getattr(shapes, probe)(module)
                except AttributeError:  # a probe of the other module's kind
                    pass
            caller = getattr(module, "PersistentAsyncCaller", None)
            if caller is not None:
                shape = shapes.caller_shape(caller)
                found[f"{{name}} caller"] = [shape.queues, shape.on_class, shape.abort_waits]
        return found

    known = {{name: shapes.known_release(importlib.import_module(name)) for name in MODULES}}
    table = verdicts()
    for dist in list(shapes.RELEASES):  # a git build of each: outside the table
        shapes._versions[dist] = "9.9.9.dev1+g0000000"
    names = verdicts()
    print(json.dumps({{"known": {{k: v is not None for k, v in known.items()}},
                      "table": table, "names": names}}))
"""

NVRX_MODULES = (
    "nvidia_resiliency_ext.checkpointing.async_ckpt.core",
    "nvidia_resiliency_ext.checkpointing.async_ckpt.filesystem_async",
)
MCORE_MODULES = (
    "megatron.core.dist_checkpointing.strategies.async_utils",
    "megatron.core.dist_checkpointing.strategies.filesystem_async",
)


@needs_nvrx
@pytest.mark.parametrize(
    "modules, version, releases",
    [
        pytest.param(NVRX_MODULES, NVRX, NVRX_RELEASES, id="nvrx"),
        pytest.param(
            MCORE_MODULES,
            MCORE,
            MCORE_RELEASES,
            id="mcore",
            marks=[
                pytest.mark.mcore,
                pytest.mark.skipif(MCORE is None, reason="megatron-core is not installed here"),
            ],
        ),
    ],
)
def test_the_table_and_the_names_agree_on_the_installed_release(modules, version, releases):
    seen = run_python(
        PROBES.format(MODULES=list(modules)),
        env={"NVRX_IPC_FIX_DISABLE": "1"},
    )
    assert all(seen["known"].values()) == (version in releases), (version, seen["known"])
    assert seen["table"] == seen["names"], seen
    assert any(key.endswith(" cpu_snapshots") for key in seen["table"]), seen


def test_expect_is_the_table_beside_what_was_measured():
    """The tests' expectations cannot drift from the package's table: every release of the
    table is expected, with the table's facts."""
    for version, facts in NVRX_RELEASES.items():
        assert {key: EXPECT[version][key] for key in facts} == facts, version
    assert set(NVRX_RELEASES) <= set(EXPECT)
