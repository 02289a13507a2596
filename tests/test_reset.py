"""``core.lifecycle.reset()`` (for tests that run many cases in one interpreter): after real
saves, a release, a prewarm, a warning and a failed hook, every record of the package is back
to its value at import, nothing of NVRx is wrapped, and a new ``activate()`` is a first one:
the fixes hold again (a replaced storage is saved current, and loads)."""

import pytest

from conftest import needs_cache, run_python

RESET = """
    import dataclasses, json, os, sys, tempfile
    import nvrx_ipc_fix
    from nvrx_ipc_fix.core import cleanup, config, dispatch, hooks, lifecycle, log
    from nvrx_ipc_fix.worker import inside, prewarm, registry, release
    from nvrx_ipc_fix.fixes import stale_guard
    from harness import scenario
    from nvidia_resiliency_ext.checkpointing.async_ckpt import core, filesystem_async

    def wrapped():
        return sorted(f"{cls.__name__}.{name}" for cls in (core.AsyncCallsQueue,
                      core.PersistentAsyncCaller, filesystem_async.FileSystemWriterAsync)
                      for name, value in vars(cls).items() if hasattr(value, "_self_wrapper"))

    def records():
        return {"active": lifecycle._active, "source": lifecycle._source,
                "requested": list(lifecycle._requested), "hooked": sorted(lifecycle._hooked),
                "verdicts": len(lifecycle._verdicts), "patches": len(lifecycle._patches),
                "calls": len(lifecycle._calls), "queue locks": len(dispatch._queue_locks),
                "hooks": sorted(hooks._hooks), "finder": hooks._FINDER in sys.meta_path,
                "warned": len(log._warned), "errors": sorted(log.errors),
                "totals": dataclasses.asdict(cleanup.totals), "callers": len(registry._callers),
                "finalize modes": len(registry._no_dist), "starts": len(prewarm._starts),
                "sizes": len(prewarm._sizes), "released": len(release._released_at),
                "sent": len(stale_guard._sent), "worker imports": list(inside.WORKER_IMPORTS),
                "wrapped": wrapped()}

    def saves(trainer, n):
        stale = []
        for _ in range(n):
            trainer.replace()
            _, _, path, version = trainer.save()
            stale.append(trainer.stale_tensors(path, version))
        return stale

    out = {}
    with tempfile.TemporaryDirectory() as d:
        t = scenario.Trainer(d, 4, 256, starts="forkserver")
        out["before"] = saves(t, 2)
        nvrx_ipc_fix.release(t.queue, strategy="restart")
        nvrx_ipc_fix.prewarm(t.queue)  # reset() stops it: the next save starts afresh
        os.environ["NVRX_IPC_FIX_STRATEGY"] = "nuke"  # a setting's warning
        nvrx_ipc_fix.release(t.queue)  # finds the prewarmed worker unused: nothing released
        del os.environ["NVRX_IPC_FIX_STRATEGY"]
        log.hook_failed(f"{filesystem_async.__name__}:FileSystemWriterAsync.prepare_write_data",
                        RuntimeError("a failed hook"))
        stale_guard._sent["a record"] = ()  # (the restart release emptied the guard's)
        class Caller:  # (the restart closed the caller the watch saw: collected since)
            pass
        kept = Caller()
        registry.state(kept)
        out["used"] = records()
        lifecycle.reset()
        out["reset"] = records()
        nvrx_ipc_fix.activate()
        out["again"] = {"source": lifecycle._source, "wrapped": wrapped(),
                        "stale": saves(t, 2)}
        t.close()
    print(json.dumps(out))
"""


@needs_cache
@pytest.mark.worker
def test_reset_returns_every_record_to_its_value_at_import():
    seen = run_python(RESET, timeout=240)
    used, reset, again = seen["used"], seen["reset"], seen["again"]
    assert seen["before"] == [0, 0]
    assert used["active"] and used["wrapped"] and used["totals"]["releases"] == 1
    assert used["calls"] and used["queue locks"], used
    assert used["callers"] and used["warned"] and used["errors"] and used["verdicts"], used
    assert used["starts"] and used["sizes"] and used["sent"] and len(used["worker imports"]) == 2
    assert reset == {"active": False, "source": None, "requested": [], "hooked": [],
                     "verdicts": 0, "patches": 0, "calls": 0, "queue locks": 0, "hooks": [],
                     "finder": False, "warned": 0,
                     "errors": [], "totals": {key: 0 for key in used["totals"]},
                     "callers": 0, "finalize modes": 0, "starts": 0, "sizes": 0,
                     "released": 0, "sent": 0,
                     "worker imports": ["nvidia_resiliency_ext.checkpointing.async_ckpt."
                                        "filesystem_async"], "wrapped": []}
    assert again["source"] == "explicit" and again["wrapped"] == used["wrapped"]
    assert again["stale"] == [0, 0]
