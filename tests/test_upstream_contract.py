"""Megatron-LM PR #6971's contract for a failed persistent worker (the tests it adds,
``tests/unit_tests/dist_checkpointing/test_async_worker_failure.py`` at ``1156462cdb``),
checked here in this project's words on released code, NVRx's caller and megatron-core's:
the worker raises in ``async_fn`` (with a request behind it), exits with 17 in ``async_fn``,
raises in ``preload_fn``, exits with 17 in ``preload_fn``. Each time scheduling returns,
``maybe_finalize_async_calls(blocking=True)`` raises ``PersistentAsyncWorkerError`` with the
worker's own message or "exit code 17", no call is left unfinalized, the caller's
persistent state is reset, and a new queue's no-op request is finalized (``[0]``).

On the CPU megatron-core's worker is forked after its CUDA device calls were made harmless
(``fakecuda``), NVRx's from a forkserver (``scenario.start_workers_from_forkserver``); the
GPU run (BENCHMARKS.md) runs PR #6971's own file with spawn."""

import pytest

from conftest import MCORE, NVRX, run_python

pytestmark = pytest.mark.worker

CONTRACT = r"""
    import importlib, json, os, sys, tempfile
    from functools import partial

    import torch.distributed as dist

    from nvrx_ipc_fix import PersistentAsyncWorkerError
    from harness import faults, scenario
    from nvrx_ipc_fix.cli import driver, fakecuda

    impl = sys.argv[1]
    core = importlib.import_module(scenario.IMPLS[impl])
    if impl == "nvrx":  # the subject is the failure, not the worker's cold start
        scenario.start_workers_from_forkserver(core)
    fakecuda.install(forked_worker=impl == "mcore")
    dist.init_process_group("gloo", rank=0, world_size=1,
                            init_method=f"file://{tempfile.mkdtemp()}/pg")

    def new_queue():
        if impl == "mcore":  # on the CPU its worker must be forked (module doc)
            core.AsyncCallsQueue.warmup_persistent_caller(0, "fork")
            return core.AsyncCallsQueue(persistent=True)
        return core.AsyncCallsQueue(**driver.kwargs_accepted(
            core.AsyncCallsQueue.__init__, persistent=True, cpu_shm_mode=True))

    def reset(queue):
        if impl == "mcore":
            return (core.AsyncCallsQueue._persistent_caller is None
                    and core.PersistentAsyncCaller._persistent_process is None)
        return queue.persistent_caller is None

    def request(async_fn, args=(), preload_fn=None):
        return core.AsyncRequest(async_fn=async_fn, async_fn_args=args, finalize_fns=[],
                                 preload_fn=preload_fn)

    preloaded = (None, None, None)
    cases = {
        "async_fn raises": [request(partial(faults.fail, "async_fn")), request(faults.nothing)],
        "async_fn exits": [request(partial(faults.exit_now, 17))],
        "preload_fn raises": [request(faults.nothing, preloaded,
                                      partial(faults.fail, "preload_fn"))],
        "preload_fn exits": [request(faults.nothing, preloaded, partial(faults.exit_now, 17))],
    }
    out = {}
    for name, requests in cases.items():
        queue, got = new_queue(), {"scheduled": 0, "raised": None}
        try:
            for each in requests:
                queue.schedule_async_request(each)
                got["scheduled"] += 1
            queue.maybe_finalize_async_calls(blocking=True)
        except PersistentAsyncWorkerError as exc:
            got["raised"] = str(exc)
        except Exception as exc:
            got["other"] = f"{type(exc).__name__}: {exc}"
        finally:
            queue.close()
        got["unfinalized"] = queue.get_num_unfinalized_calls()
        got["reset"] = reset(queue)
        replacement = new_queue()
        try:
            replacement.schedule_async_request(request(faults.nothing))
            got["replacement"] = replacement.maybe_finalize_async_calls(blocking=True)
        finally:
            replacement.close()
        out[name] = got
    print(json.dumps(out))
"""

WORDS = {
    "async_fn raises": "injected fault in the worker's async_fn",
    "async_fn exits": "exit code 17",
    "preload_fn raises": "injected fault in the worker's preload_fn",
    "preload_fn exits": "exit code 17",
}


def contract(impl, fix=True):
    code = CONTRACT + "\n"
    return run_python(code.replace("sys.argv[1]", repr(impl)), fix=fix, timeout=240)


@pytest.mark.parametrize(
    "impl",
    [
        pytest.param("nvrx", marks=pytest.mark.skipif(NVRX is None, reason="no NVRx here")),
        pytest.param(
            "mcore",
            marks=[
                pytest.mark.mcore,
                pytest.mark.skipif(
                    MCORE is None,
                    reason="megatron-core is not installed here (the py311-megatron env)",
                ),
            ],
        ),
    ],
)
def test_a_failed_worker_meets_megatron_lm_pr_6971_s_contract(impl):
    result = contract(impl)
    for name, got in result.items():
        assert got.get("other") is None, (name, got)
        assert got["scheduled"] == (2 if name == "async_fn raises" else 1), (name, got)
        assert got["raised"] is not None and WORDS[name] in got["raised"], (name, got)
        assert got["unfinalized"] == 0 and got["reset"], (name, got)
        assert got["replacement"] == [0], (name, got)
