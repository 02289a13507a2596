"""What ``cpu_snapshot`` costs a save of CPU tensors, against NVRx 0.7.0's own copy of them:
the time the save blocks and the trainer's peak host memory during it.

    python benchmarks/cpu_snapshot_cost.py --nvrx060 $ENV060/bin/python \\
        --nvrx070 $ENV070/bin/python [--sizes 16M,1G,8G] [--rounds 3] [--saves 2]

For each size, four cases, each in a fresh interpreter of the env named, with this
checkout's ``src`` first on its path: NVRx 0.6.0 without the package (the worker writes the
trainer's own tensors: torn, the baseline), with the package but ``cpu_snapshot`` named off
(what the other fixes cost), with the package (``cpu_snapshot`` copies them), and NVRx 0.7.0
without it (NVRx copies them itself; with the package the fix stands aside). A
case is one trainer rank (gloo), NVRx's persistent worker (``cpu_shm_mode``: no CUDA here),
a state of 16 CPU tensors of ``size / 16`` and Adam's scalar ``step``, one save to start the
worker, then ``--saves`` saves, each finalized before the next. The cases take turns, round
after round (``--rounds``), so that a change of the machine's load meets each alike; the
summary of a case is the median over all its saves. For each save it measures the
planning (``save_state_dict_async_plan``: ``prepare_write_data``, where the copy is made), the
schedule (``schedule_async_request``: NVRx's queue moves what it sends into shared memory, a
copy of a tensor that is not there yet, and the worker takes the request) and the growth of
the trainer's peak resident memory over the save (``VmHWM``, reset before each save through
``/proc/self/clear_refs``): its private copies and the shared-memory pages it writes. A size
that does not fit the memory available now (about three times the size, and 2 GiB more) is
skipped and said so. Prints a JSON line per case and round (``"round"``), then one per case
with the medians.
"""

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time

SRC = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "src")
#: (case, env, NVRX_IPC_FIX_DISABLE)
CASES = (
    ("0.6.0 without the package", "nvrx060", "1"),
    ("0.6.0, the package but cpu_snapshot", "nvrx060", "cpu_snapshot"),
    ("0.6.0 with the package", "nvrx060", ""),
    ("0.7.0 (its own copy)", "nvrx070", "1"),
)
UNITS = {"K": 2**10, "M": 2**20, "G": 2**30}


def size_of(text):
    return int(float(text[:-1]) * UNITS[text[-1].upper()]) if text[-1].isalpha() else int(text)


def memory_available():
    with open("/proc/meminfo") as info:
        return next(
            int(line.split()[1]) * 1024 for line in info if line.startswith("MemAvailable:")
        )


def status_kib(name):
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) for line in status if line.startswith(name + ":"))


def one_case(size, saves, tensors=16):
    """Run in the child: one trainer, its saves; the measures as a dict."""
    import tempfile
    from functools import partial

    import torch
    from torch.distributed.checkpoint import DefaultSavePlanner

    from nvrx_ipc_fix.cli import driver
    from nvidia_resiliency_ext.checkpointing.async_ckpt import filesystem_async as fs
    from nvidia_resiliency_ext.checkpointing.async_ckpt import state_dict_saver as saver

    directory = tempfile.mkdtemp(prefix="cpu-snapshot-cost-")
    trainer = driver.Trainer(directory, 1, 1, cached=False)  # its group, queue, CUDA stand-in
    numel = size // tensors // 4
    state = {f"exp_avg{i}": torch.full((numel,), float(i)) for i in range(tensors)}
    state["step"] = torch.tensor(1.0)

    def save(index):
        with open("/proc/self/clear_refs", "w") as refs:
            refs.write("5")  # the peak resident memory starts again from now
        before = status_kib("VmRSS")
        start = time.perf_counter()
        path = os.path.join(directory, f"ckpt{index}")
        writer, metadata, dist_wrapper = saver.save_state_dict_async_plan(
            dict(state), fs.FileSystemWriterAsync(path), None, planner=DefaultSavePlanner()
        )
        planned = time.perf_counter()
        save_fn, preload_fn, args = writer.get_save_function_and_args()
        finalize = partial(saver.save_state_dict_async_finalize, writer, metadata, dist_wrapper)
        trainer.queue.schedule_async_request(
            trainer.core.AsyncRequest(save_fn, args, [finalize], preload_fn=preload_fn)
        )
        scheduled = time.perf_counter()
        peak = status_kib("VmHWM")
        with torch.no_grad():
            for tensor in state.values():
                tensor.add_(1.0)  # the next step, as the loop this is for takes it
        trainer.queue.maybe_finalize_async_calls(blocking=True, no_dist=True)
        shutil.rmtree(path, ignore_errors=True)
        return {
            "plan_s": planned - start,
            "schedule_s": scheduled - planned,
            "blocked_s": scheduled - start,
            "peak_growth_mib": (peak - before) / 1024,
        }

    save(0)  # starts the worker
    measured = [save(i) for i in range(1, saves + 1)]
    trainer.close()
    from nvrx_ipc_fix import status

    return {"saves": measured, "fix": str(status().fix("cpu_snapshot").state)}


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--nvrx060", required=True, help="the python of an NVRx 0.6.0 env")
    parser.add_argument("--nvrx070", required=True, help="the python of an NVRx 0.7.0 env")
    parser.add_argument("--sizes", default="16M,1G,8G")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--saves", type=int, default=2)
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        size, saves = json.loads(args.child)
        print(json.dumps(one_case(size, saves)))
        return
    pythons = {"nvrx060": args.nvrx060, "nvrx070": args.nvrx070}
    for text in args.sizes.split(","):
        size = size_of(text)
        needed, available = 3 * size + 2 * 2**30, memory_available()
        if needed > available:
            print(
                json.dumps(
                    {
                        "size": text,
                        "skipped": (
                            f"needs about {needed / 2**30:.1f} GiB, {available / 2**30:.1f} GiB "
                            "available"
                        ),
                    }
                ),
                flush=True,
            )
            continue
        saves = {name: [] for name, _, _ in CASES}
        for turn in range(args.rounds):
            for name, env, disable in CASES:
                result = run_case(pythons[env], disable, size, args.saves)
                saves[name] += result["saves"]
                print(json.dumps({"size": text, "case": name, "round": turn, **result}), flush=True)
        for name, measured in saves.items():
            print(
                json.dumps(
                    {
                        "size": text,
                        "case": name,
                        "saves": len(measured),
                        **{
                            key: round(statistics.median(m[key] for m in measured), 3)
                            for key in measured[0]
                        },
                    }
                ),
                flush=True,
            )


def run_case(python, disable, size, saves):
    """One case in a fresh interpreter: ``NVRX_IPC_FIX_DISABLE=disable``, this checkout's
    ``src`` first on the path."""
    env = dict(
        os.environ,
        NVRX_IPC_FIX_DISABLE=disable,
        PYTHONPATH=os.pathsep.join(
            [SRC] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
        ),
    )
    done = subprocess.run(
        [
            python,
            os.path.abspath(__file__),
            "--nvrx060",
            "-",
            "--nvrx070",
            "-",
            "--child",
            json.dumps([size, saves]),
        ],
        env=env,
        check=True,
        capture_output=True,
        text=True,
    )
    return json.loads(done.stdout.strip().splitlines()[-1])


if __name__ == "__main__":
    sys.exit(main())
