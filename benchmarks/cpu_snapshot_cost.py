"""What ``cpu_snapshot`` costs a save of CPU tensors, side by side with NVRx alone, with NVRx
0.7.0's own copy and with a plain copy of the same tensors: the time the save blocks and the
growth of the trainer's peak host memory during it.

    python benchmarks/cpu_snapshot_cost.py --nvrx060 $ENV060/bin/python \\
        --nvrx070 $ENV070/bin/python [--sizes 256M,1G,4G] [--rounds 3] [--saves 3] \\
        [--cases persistent,plain]

Each case runs in a fresh interpreter of the env named, with this checkout's ``src`` first on
its path. A case is one trainer rank (gloo), a state of 16 CPU tensors of ``size / 16`` and
Adam's scalar ``step``, one save to start things, then ``--saves`` saves, each finalized
before the next, the state changed in place after each schedule. The cases:

* ``persistent``: NVRx's persistent worker (``cpu_shm_mode``: no CUDA here), where a save
  can tear: NVRx 0.6.0 without the package (the worker writes the trainer's own tensors:
  torn, the baseline), with it (``cpu_snapshot`` copies them into shared memory it keeps
  for the next save), and NVRx 0.7.0 alone (it clones them in its planning) and with the
  package (which stands aside there);
* ``forked``: ``AsyncCallsQueue(persistent=False)``, a process forked per save, which sees
  the trainer's memory as at the fork: NVRx 0.6.0 without and with the package;
* ``sync``: the same request run in the trainer (``AsyncRequest.execute_sync``): NVRx 0.6.0
  without and with the package;
* ``plain copy``: no NVRx: the same tensors copied into shared memory allocated once and
  reused, the least a snapshot can cost; and the same where a second process maps that
  memory too, as a worker that was sent it does.

The cases take turns, round after round (``--rounds``), so that a change of the machine's
load meets each alike; the summary of a case is the median over all its saves. For each save
it measures the time blocked (planning and schedule, or the whole synchronous save), of it the
planning (``plan_s``: NVRx 0.7.0 clones there) and the fix's own copy (``copy_s``), and the
growth of the trainer's peak resident memory over the save (``VmHWM``, reset before each save
through ``/proc/self/clear_refs``). A size that does not fit the memory available now (about
three times the size, and 2 GiB more) is skipped and said so. Prints a JSON line per case and
round (``"round"``), then one per case with the medians.
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
#: (case, env, NVRX_IPC_FIX_DISABLE, how the save runs)
CASES = (
    ("persistent, 0.6.0 without the package", "nvrx060", "1", "persistent"),
    ("persistent, 0.6.0 with the package", "nvrx060", "", "persistent"),
    ("persistent, 0.7.0 (its own copy)", "nvrx070", "1", "persistent"),
    ("persistent, 0.7.0 with the package", "nvrx070", "", "persistent"),
    ("forked, 0.6.0 without the package", "nvrx060", "1", "forked"),
    ("forked, 0.6.0 with the package", "nvrx060", "", "forked"),
    ("sync, 0.6.0 without the package", "nvrx060", "1", "sync"),
    ("sync, 0.6.0 with the package", "nvrx060", "", "sync"),
    ("plain copy into kept shared memory", "nvrx060", "1", "plain"),
    ("plain copy, the memory mapped by a second process", "nvrx060", "1", "mapped"),
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


def one_case(size, saves, how, tensors=16):
    """Run in the child: one trainer, its saves (``how``: ``CASES``); the measures as a dict."""
    import tempfile
    from functools import partial

    import torch
    from torch.distributed.checkpoint import DefaultSavePlanner

    numel = size // tensors // 4
    state = {f"exp_avg{i}": torch.full((numel,), float(i)) for i in range(tensors)}
    state["step"] = torch.tensor(1.0)

    spent = {"plan_s": 0.0, "copy_s": 0.0}  # of the save being measured

    def measured(run):
        with open("/proc/self/clear_refs", "w") as refs:
            refs.write("5")  # the peak resident memory starts again from now
        spent.update(plan_s=0.0, copy_s=0.0)
        before, start = status_kib("VmRSS"), time.perf_counter()
        run()
        blocked, peak = time.perf_counter() - start, status_kib("VmHWM")
        with torch.no_grad():
            for tensor in state.values():
                tensor.add_(1.0)  # the next step, as the loop this is for takes it
        return {"blocked_s": blocked, **spent, "peak_growth_mib": (peak - before) / 1024}

    def timed(key, function):
        def run(*args, **kwargs):
            start = time.perf_counter()
            try:
                return function(*args, **kwargs)
            finally:
                spent[key] += time.perf_counter() - start

        return run

    if how in ("plain", "mapped"):
        kept = [torch.empty_like(t).share_memory_() for t in state.values()]
        if how == "mapped":  # a process that maps the memory (as the worker does) and waits
            import torch.multiprocessing as mp

            context = mp.get_context("spawn")
            sent, done = context.Queue(), context.Event()
            holder = context.Process(target=_hold, args=(sent, done), daemon=True)
            holder.start()
            sent.put(kept)
            done.wait()

        def copy():
            with torch.no_grad():
                for target, tensor in zip(kept, state.values()):
                    target.copy_(tensor)

        copy = timed("copy_s", copy)
        return {"saves": [measured(copy) for _ in range(saves + 1)][1:], "fix": "-"}

    from nvrx_ipc_fix.cli import driver
    from nvrx_ipc_fix.fixes import cpu_snapshot

    cpu_snapshot._snapshot = timed("copy_s", cpu_snapshot._snapshot)  # the fix's own copy
    from nvidia_resiliency_ext.checkpointing.async_ckpt import filesystem_async as fs
    from nvidia_resiliency_ext.checkpointing.async_ckpt import state_dict_saver as saver

    directory = tempfile.mkdtemp(prefix="cpu-snapshot-cost-")
    trainer = driver.Trainer(directory, 1, 1, cached=False)  # its group, queue, CUDA stand-in
    queue = trainer.queue
    if how != "persistent":
        queue.close()
        queue = trainer.core.AsyncCallsQueue(persistent=False)

    def save(index):
        path = os.path.join(directory, f"ckpt{index}")

        def run():
            writer, metadata, dist_wrapper = timed("plan_s", saver.save_state_dict_async_plan)(
                dict(state), fs.FileSystemWriterAsync(path), None, planner=DefaultSavePlanner()
            )
            save_fn, preload_fn, args = writer.get_save_function_and_args()
            finalize = partial(saver.save_state_dict_async_finalize, writer, metadata, dist_wrapper)
            request = trainer.core.AsyncRequest(save_fn, args, [finalize], preload_fn=preload_fn)
            if how == "sync":
                request.execute_sync()
            else:
                queue.schedule_async_request(request)

        result = measured(run)
        queue.maybe_finalize_async_calls(blocking=True, no_dist=True)
        shutil.rmtree(path, ignore_errors=True)
        return result

    save(0)  # starts the worker
    results = [save(i) for i in range(1, saves + 1)]
    queue.close()
    trainer.close()
    from nvrx_ipc_fix import status

    return {"saves": results, "fix": str(status().fix("cpu_snapshot").state)}


def _hold(sent, done):
    """The second process of the ``mapped`` case: it maps the tensors, reads them, waits."""
    kept = sent.get()
    sum(float(t.sum()) for t in kept)
    done.set()
    time.sleep(3600)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--nvrx060", required=True, help="the python of an NVRx 0.6.0 env")
    parser.add_argument("--nvrx070", required=True, help="the python of an NVRx 0.7.0 env")
    parser.add_argument("--sizes", default="256M,1G,4G")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--saves", type=int, default=3)
    parser.add_argument("--cases", default="", help="only the cases whose name has one of these")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(one_case(*json.loads(args.child))))
        return
    pythons = {"nvrx060": args.nvrx060, "nvrx070": args.nvrx070}
    wanted = [part for part in args.cases.split(",") if part]
    cases = [case for case in CASES if not wanted or any(part in case[0] for part in wanted)]
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
        saves = {name: [] for name, *_ in cases}
        for turn in range(args.rounds):
            for name, env, disable, how in cases:
                result = run_case(pythons[env], disable, [size, args.saves, how])
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


def run_case(python, disable, child):
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
            json.dumps(child),
        ],
        env=env,
        check=True,
        capture_output=True,
        text=True,
    )
    return json.loads(done.stdout.strip().splitlines()[-1])


if __name__ == "__main__":
    sys.exit(main())
