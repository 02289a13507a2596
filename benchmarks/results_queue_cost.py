"""What ``own_results`` adds to a save in the trainer: a results queue of the save's own,
from NVRx's results-queue manager, given to the writer after ``prepare_write_data`` and let
go after its finalize.

    PYTHONPATH=src:$NVRX python benchmarks/results_queue_cost.py [--saves 500] [--back-to-back]

Starts NVRx's manager as NVRx does (its ``get_write_results_queue()``), then, for each of
``--saves`` saves (a writer of its own each, as Megatron makes one), times the fix's two
wrappers around stand-ins for NVRx's methods: ``prepare`` (the wrapper of
``prepare_write_data``, whose NVRx part only sets NVRx's shared queue: what the save's
schedule blocks on), ``finalize`` (the wrapper of ``retrieve_write_results``, less NVRx's
``get_nowait``, timed apart as ``get_nowait``) and ``drop`` (the writer let go: the last
reference to its queue). Between them it puts one result into the queue, as the worker does
(not timed). Unless ``--back-to-back``, after its ``prepare`` and after its ``drop`` each save
waits, untimed, until the fix's thread has the next queue ready (``ahead``: how long that
took after ``prepare``) and nothing left to let go, and 5 ms more: a save's finalize comes
seconds after its schedule, and the next save seconds after that. The code before that
thread has none, and each save makes its queue in ``prepare``. Prints the median,
90th percentile and maximum in milliseconds, the first save apart, and the NVRx version.
"""

import argparse
import gc
import json
import statistics
import time


def shared_queue():
    """NVRx's one results queue of this process, made as NVRx makes it."""
    from nvidia_resiliency_ext.checkpointing.async_ckpt import filesystem_async as fs

    make = getattr(fs, "get_write_results_queue", None) or fs._get_write_results_queue
    return make()


def summary(samples):
    ordered = sorted(samples)
    return {
        "median_ms": round(statistics.median(ordered) * 1e3, 3),
        "p90_ms": round(ordered[int(len(ordered) * 0.9)] * 1e3, 3),
        "max_ms": round(ordered[-1] * 1e3, 3),
    }


class Writer:
    """A stand-in for NVRx's writer: what the fix reads and sets."""

    results_queue = None


def settle(own_results, timeout=10.0):
    """Seconds until the fix's thread has the next queue ready and nothing left to let go
    (0: it has no such thread); then 5 ms more for the manager to be idle, as it is between
    a save's schedule and its finalize, and between saves, seconds apart."""
    ahead = getattr(own_results, "_ahead", None)
    start = time.perf_counter()
    while (
        ahead is not None
        and (ahead.spare is None or ahead.done)
        and time.perf_counter() - start < timeout
    ):
        time.sleep(0.0002)
    took = time.perf_counter() - start
    time.sleep(0.005)
    return took


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--saves", type=int, default=500)
    parser.add_argument(
        "--back-to-back", action="store_true", help="no wait for the next queue between saves"
    )
    args = parser.parse_args()
    from importlib import metadata

    from nvrx_ipc_fix.fixes import own_results

    shared = shared_queue()
    times = {name: [] for name in ("prepare", "finalize", "get_nowait", "drop", "ahead")}

    for _ in range(args.saves + 1):
        writer, got = Writer(), []

        def prepare(writer=writer):
            writer.results_queue = shared  # as NVRx's prepare_write_data leaves it

        def retrieve(writer=writer, got=got):
            start = time.perf_counter()
            result = writer.results_queue.get_nowait()
            got.append(time.perf_counter() - start)
            return result

        start = time.perf_counter()
        own_results.prepare_write_data_wrapper(prepare, writer, (), {})
        prepared = time.perf_counter()
        ahead = 0.0 if args.back_to_back else settle(own_results)
        writer.results_queue.put({0: []})  # the worker's put (in the worker, not timed)
        before = time.perf_counter()
        own_results.retrieve_write_results_wrapper(retrieve, writer, (), {})
        finalized = time.perf_counter()
        del writer, prepare, retrieve  # the writer and its request are let go
        dropped = time.perf_counter()
        for name, value in (
            ("prepare", prepared - start),
            ("get_nowait", got[0]),
            ("finalize", finalized - before - got[0]),
            ("drop", dropped - finalized),
        ):
            times[name].append(value)
        times["ahead"].append(ahead)
        if not args.back_to_back:
            settle(own_results)
    first = {name: round(values.pop(0) * 1e3, 3) for name, values in times.items()}
    time.sleep(0.5)
    gc.collect()
    time.sleep(0.5)  # the thread has let go of the last save's queue
    added = [sum(values) for values in zip(times["prepare"], times["finalize"], times["drop"])]
    print(
        json.dumps(
            {
                "nvrx": metadata.version("nvidia-resiliency-ext"),
                "saves": args.saves,
                "back_to_back": args.back_to_back,
                "left_in_manager": shared._manager._number_of_objects() - 1,
                "first_save_ms": first,
                **{name: summary(values) for name, values in times.items()},
                "added": summary(added),
            }
        )
    )


if __name__ == "__main__":
    main()
