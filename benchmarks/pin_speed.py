"""How fast a fresh process pins host memory, in 1 to N threads: what a prewarmed worker
does before it reports ready (``worker.inside.pin_host``, one thread).

    python benchmarks/pin_speed.py --gib 8 --blocks 64 --threads 1,8,1,8

One process per thread count: its CUDA context first (not timed), then ``--blocks`` blocks
of ``--gib`` GiB in all, ``torch.empty(..., pin_memory=True)``, spread over the threads.
Prints one JSON line each.
"""

import argparse
import json
import subprocess
import sys
import threading
import time


def child(gib, blocks, threads):
    import torch

    torch.empty(1, device="cuda")  # the context, as the worker has it
    size, pinned = gib * 2**30 // blocks, []

    def pin(count):
        for _ in range(count):
            pinned.append(torch.empty(size, dtype=torch.uint8, pin_memory=True))

    began = time.perf_counter()
    workers = [
        threading.Thread(target=pin, args=(blocks // threads + (i < blocks % threads),))
        for i in range(threads)
    ]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join()
    print(
        json.dumps(
            {
                "gib": gib,
                "blocks": blocks,
                "threads": threads,
                "pinned_gib": sum(p.numel() for p in pinned) / 2**30,
                "seconds": round(time.perf_counter() - began, 3),
            }
        )
    )


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gib", type=int, default=8)
    parser.add_argument("--blocks", type=int, default=64)
    parser.add_argument("--threads", default="1,8")
    parser.add_argument("--child", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        return child(args.gib, args.blocks, args.child)
    for threads in map(int, args.threads.split(",")):
        subprocess.run(
            [
                sys.executable,
                __file__,
                "--gib",
                str(args.gib),
                "--blocks",
                str(args.blocks),
                "--child",
                str(threads),
            ],
            check=False,
        )


if __name__ == "__main__":
    sys.exit(main())
