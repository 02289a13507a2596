"""What the worker watch adds to one save, measured without the noise of a whole save.

    PYTHONPATH=src:$NVRX python benchmarks/watch_cost.py [--calls 200000]

Times, with ``timeit``, the watch's own code on the paths every save takes: the wrapper of
``AsyncCallsQueue.schedule_async_request`` (the preload handshake's watch) and of a
rank-local ``is_current_async_call_done`` poll, each around a function that does nothing,
against that function called bare; and the same through the call's one wrapper
(``core.dispatch.Dispatch``: the queue's lock, the chain of steps), with the watch's step
alone and, for the schedule, with every step NVRx 0.6.0/0.7.0 get there (suspend, prewarm,
worker_watch). A real NVRx ``AsyncCallsQueue`` and ``PersistentAsyncCaller`` are used; no
worker is started, so the monitor thread only ticks. Prints microseconds per call.
"""

import argparse
import timeit


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=200_000)
    args = parser.parse_args()
    from nvidia_resiliency_ext.checkpointing.async_ckpt import core

    from nvrx_ipc_fix.core.dispatch import Dispatch
    from nvrx_ipc_fix.core.targets import CALLS, CORE
    from nvrx_ipc_fix.fixes import prewarm as _prewarm, suspend as _suspend
    from nvrx_ipc_fix.fixes import worker_watch as _worker_watch

    queue = core.AsyncCallsQueue(persistent=True)
    caller = queue._get_async_caller()
    caller.cur_item = None

    def schedule(async_request):  # stands in for NVRx's schedule_async_request
        queue.call_idx += 1
        return queue.call_idx

    def done(blocking=False, no_dist=False):  # stands in for is_current_async_call_done
        return True

    def dispatch(attr, steps):
        one = Dispatch(CALLS[f"{CORE}:{attr}"])
        for fix, step in steps.items():
            one.add(fix, step)
        return one

    watched_schedule = dispatch(
        "AsyncCallsQueue.schedule_async_request", {"worker_watch": _worker_watch.schedule_wrapper}
    )
    every_schedule = dispatch(
        "AsyncCallsQueue.schedule_async_request",
        {
            "suspend": _suspend.schedule_wrapper,
            "prewarm": _prewarm.schedule_wrapper,
            "worker_watch": _worker_watch.schedule_wrapper,
        },
    )
    watched_done = dispatch(
        "PersistentAsyncCaller.is_current_async_call_done",
        {"worker_watch": _worker_watch.done_wrapper},
    )
    cases = {
        "schedule: bare": lambda: schedule(None),
        "schedule: watched": lambda: _worker_watch.schedule_wrapper(schedule, queue, (None,), {}),
        "schedule: dispatched, the watch's step": lambda: watched_schedule(
            schedule, queue, (None,), {}
        ),
        "schedule: dispatched, every step": lambda: every_schedule(schedule, queue, (None,), {}),
        "finalize poll, rank-local: bare": lambda: done(False, True),
        "finalize poll, rank-local: watched": lambda: _worker_watch.done_wrapper(
            done, caller, (False, True), {}
        ),
        "finalize poll, rank-local: dispatched": lambda: watched_done(
            done, caller, (False, True), {}
        ),
    }
    for name, call in cases.items():
        best = min(timeit.repeat(call, number=args.calls, repeat=5)) / args.calls
        print(f"{name:<40} {best * 1e6:8.2f} us")
    return 0


if __name__ == "__main__":
    main()
