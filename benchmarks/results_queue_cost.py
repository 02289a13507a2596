"""What ``own_results`` adds to a save: a results queue of the save's own, made by NVRx's
results-queue manager after ``prepare_write_data``, and dropped with the writer.

    PYTHONPATH=src:$NVRX python benchmarks/results_queue_cost.py [--saves 500]

Starts NVRx's manager as NVRx does (its ``get_write_results_queue()``), then, for each of
``--saves`` saves, times in the trainer what the fix adds: making the queue
(``shapes.own_results_queue``: the manager creates it, the proxy increfs it) and dropping it
(the proxy's decref), each a call to the manager process. Between them it puts one result
into the queue, as the worker does (not timed), and times the ``get_nowait`` that NVRx's
finalize makes on either queue (this thread's connection to the manager serves every queue
of that manager: no extra cost). Prints the median,
90th percentile and maximum in milliseconds, and the NVRx version.
"""

import argparse
import gc
import json
import statistics
import time
import types


def shared_queue():
    """NVRx's one results queue of this process, made as NVRx makes it."""
    from nvidia_resiliency_ext.checkpointing.async_ckpt import filesystem_async as fs

    make = getattr(fs, "get_write_results_queue", None) or fs._get_write_results_queue
    return make()


def summary(samples):
    ordered = sorted(samples)
    return {"median_ms": round(statistics.median(ordered) * 1e3, 3),
            "p90_ms": round(ordered[int(len(ordered) * 0.9)] * 1e3, 3),
            "max_ms": round(ordered[-1] * 1e3, 3)}


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--saves", type=int, default=500)
    args = parser.parse_args()
    from importlib import metadata

    from nvrx_ipc_fix.core import shapes

    writer = types.SimpleNamespace(results_queue=shared_queue())
    shared = writer.results_queue
    make, get, drop = [], [], []
    for _ in range(args.saves):
        writer.results_queue = shared  # as NVRx's prepare_write_data leaves it
        start = time.perf_counter()
        shapes.own_results_queue(writer)
        made = time.perf_counter()
        writer.results_queue.put({0: []})  # the worker's put (in the worker, not timed)
        before_get = time.perf_counter()
        writer.results_queue.get_nowait()
        got = time.perf_counter()
        writer.results_queue = None  # the writer is dropped: the proxy's decref
        dropped = time.perf_counter()
        make.append(made - start)
        get.append(got - before_get)
        drop.append(dropped - got)
    gc.collect()
    print(json.dumps({"nvrx": metadata.version("nvidia-resiliency-ext"), "saves": args.saves,
                      "left_in_manager": shared._manager._number_of_objects() - 1,
                      "make": summary(make), "drop": summary(drop),
                      "added": summary([m + d for m, d in zip(make, drop)]),
                      "get_nowait": summary(get)}))


if __name__ == "__main__":
    main()
