"""What the check that every rank runs the package costs (``worker.peers``).

    PYTHONPATH=src python benchmarks/peers_cost.py [--ranks 2,64,1024] [--stores hash,tcp]

The check of one process group, at 2, 64 and 1024 ranks: one thread per rank runs the
package's own ``say`` (before the riding all-reduce) and ``hear`` (after its sum was read)
around a ``threading.Barrier`` that stands in for NVRx's finalize all-reduce, over one real
torch store (``HashStore``; ``TCPStore``: a server in this process, a client per rank), each
rank's calls counted by a wrapper. Twice: every rank runs the package, and the last rank
does not (it only meets the others at the barriers); there the ranks read again at a second
all-reduce, as at a finalize ``SETTLE_S`` later (the wait itself is not timed), and name it.
Then the cost of each later finalize all-reduce, the check done: two gloo ranks
(processes), rank 0 times ``before()``, ``flag_rides()`` and ``after()``, what ``_sync``
adds to each. Prints one JSON line per case. No NVRx is needed.
"""

import argparse
import json
import os
import statistics
import tempfile
import threading
import time
import timeit
from datetime import timedelta


class Counting:
    """A store's view that counts its calls."""

    def __init__(self, store):
        self.store, self.calls = store, 0

    def __getattr__(self, name):
        method = getattr(self.store, name)

        def call(*args):
            self.calls += 1
            return method(*args)

        return call


def check(ranks, kind, missing):
    """One group's check over ``ranks`` threads; ``missing``: ranks without the package."""
    import torch.distributed as dist

    from nvrx_ipc_fix.worker import peers

    server = None
    if kind == "tcp":
        server = dist.TCPStore(
            "127.0.0.1",
            0,
            ranks,
            True,
            timeout=timedelta(seconds=300),
            wait_for_workers=False,
            use_libuv=True,
        )
        stores = [
            Counting(
                dist.TCPStore(
                    "127.0.0.1", server.port, ranks, False, timeout=timedelta(seconds=300)
                )
            )
            for _ in range(ranks)
        ]
    else:
        shared = dist.HashStore()
        stores = [Counting(shared) for _ in range(ranks)]
    barrier, seconds, verdicts = threading.Barrier(ranks), [None] * ranks, [None] * ranks

    def rank(r):
        mine = peers.Group(None, r, ranks)
        barrier.wait()  # every rank ready: the clock starts together
        started = time.perf_counter()
        if r not in missing:
            peers.say(mine, stores[r])
        barrier.wait()  # NVRx's finalize all-reduce, its sum read
        if r not in missing:
            verdicts[r] = peers.hear(mine, stores[r], 0.0)[0]
        if missing:  # the read of a finalize SETTLE_S later
            barrier.wait()
            if r not in missing:
                verdicts[r] = peers.hear(mine, stores[r], peers.SETTLE_S)[0]
        seconds[r] = time.perf_counter() - started

    threading.stack_size(512 * 1024)
    threads = [threading.Thread(target=rank, args=(r,)) for r in range(ranks)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    calls = [store.calls for store in stores]
    told = {v.split(" (")[0].split(": ", 1)[-1] for r, v in enumerate(verdicts) if r not in missing}
    del server
    return {
        "case": "check",
        "store": kind,
        "ranks": ranks,
        "without": len(missing),
        "verdicts": sorted(told),
        "calls_total": sum(calls),
        "calls_per_rank": {
            "min": min(calls),
            "max": max(calls),
            "median": statistics.median(calls),
        },
        "seconds_max": round(max(seconds), 4),
        "seconds_median": round(statistics.median(seconds), 4),
    }


def later(path, rank, calls, out):
    """A gloo rank of two: the check once, then (rank 0) each later all-reduce's part."""
    import torch.distributed as dist

    from nvrx_ipc_fix.worker import peers

    dist.init_process_group("gloo", rank=rank, world_size=2, init_method=f"file://{path}")
    peers.before()
    dist.barrier()  # NVRx's all-reduce, its sum read
    peers.after()
    if rank == 0:

        def once():
            peers.before()
            peers.flag_rides()
            peers.after()

        best = min(timeit.repeat(once, number=calls, repeat=5)) / calls
        with open(out, "w") as result:
            json.dump(
                {
                    "case": "later finalize all-reduce",
                    "us_per_call": round(best * 1e6, 3),
                    "status": peers.describe(),
                },
                result,
            )
    dist.barrier()
    dist.destroy_process_group()


def later_cost(calls):
    import multiprocessing

    with tempfile.TemporaryDirectory() as scratch:
        out = os.path.join(scratch, "out.json")
        processes = [
            multiprocessing.get_context("spawn").Process(
                target=later, args=(os.path.join(scratch, "pg"), rank, calls, out)
            )
            for rank in range(2)
        ]
        for process in processes:
            process.start()
        for process in processes:
            process.join()
        with open(out) as result:
            return json.load(result)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", default="2,64,1024")
    parser.add_argument("--stores", default="hash,tcp")
    parser.add_argument("--calls", type=int, default=100_000)
    args = parser.parse_args()
    for kind in args.stores.split(","):
        for ranks in map(int, args.ranks.split(",")):
            for missing in ((), (ranks - 1,)):
                print(json.dumps(check(ranks, kind, set(missing))), flush=True)
    print(json.dumps(later_cost(args.calls)), flush=True)
    return 0


if __name__ == "__main__":
    main()
