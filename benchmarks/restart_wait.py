"""``suspend``, ``restart`` and ``flush`` around offload, inference and onload: how soon the
worker is ready after the onload, what the save after the onload blocks, and what an RL step
costs (BENCHMARKS.md, "Suspend" and "Restart with the standby").

    python benchmarks/restart_wait.py --out benchmarks/results/h200-standby-nvrx070.jsonl \\
        [--sizes 2g16,8g64,2g4096] [--strategies flush,restart,suspend,suspend-inline] \\
        [--cycles 5] [--inference 5] [--step 3] [--matmuls N] [--save-every 1] [--label NAME]

One process per (size, strategy), run in turn: two saves (the cache primed), then
``--cycles`` times: ``offloading(strategy=...)`` around offload, ``--inference`` seconds of
inference and onload, a training step of ``--step`` seconds, a save every ``--save-every``
steps. Per cycle: the release, the device use and the processes on the device during the
inference (``nvidia-smi``: a worker or the standby there is a failure), when the next worker
was ready after the onload and what took the time (up to the worker's start-up request: the
start and its CUDA context; the pinning ahead; the rest), what the save after the onload
blocked (waiting for the worker included), the CPU seconds of every process below the
trainer (workers, the standby) over the cycle, the workers started and the host memory
pinned. ``suspend``: how long the suspend (lock, checkpoint) and the resume (restore, unlock)
took, and when the resumed worker was ready after the onload; ``suspend-inline`` waits for
the resume at the onload instead of running it beside the step. With
``RESTART_WAIT_PARTIAL=FILE`` in the environment, each cycle also appends a line to ``FILE``
as it ends (a run that a bound cuts short keeps those). ``--matmuls N``: the
training step is N bf16 8192x8192 products on the GPU (its time is reported) instead of a
sleep of ``--step`` seconds. Every checkpoint is loaded back and compared value by value
(``stale``); a watchdog reports a hang. Prints and appends one JSON line per case. Without CUDA it
runs on the CPU stand-in (no device figures).
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from gpu_lifecycle import SIZES  # noqa: E402  (the model sizes the other benchmarks use)


def _descendants_cpu(pid):
    """CPU seconds (user + system) of each process below ``pid``: {pid: seconds}."""
    from nvrx_ipc_fix.worker.guardian_process import children, stat_fields

    ticks = os.sysconf("SC_CLK_TCK")
    seen, todo = {}, children(pid)
    while todo:
        child = todo.pop()
        try:
            fields = stat_fields(child)
            seen[child] = (int(fields[11]) + int(fields[12])) / ticks
            todo.extend(children(child))
        except (OSError, IndexError, ValueError):
            pass
    return seen


def child(spec):
    import nvrx_ipc_fix
    from nvrx_ipc_fix.worker import standby, suspend
    from harness import scenario

    cycles = []
    last_cpu = {}
    blocked = []  # what each save blocked, for the cycles' lines
    partial = os.environ.get("RESTART_WAIT_PARTIAL")  # a file: a line per cycle as it ends
    save = scenario.Trainer.save

    def timed_save(self, *args, **kwargs):
        result = save(self, *args, **kwargs)
        blocked.append(round(result[0], 4))
        return result

    scenario.Trainer.save = timed_save

    def cpu_since_last():
        now = _descendants_cpu(os.getpid())
        spent = sum(max(0.0, t - last_cpu.get(p, 0.0)) for p, t in now.items())
        last_cpu.clear()
        last_cpu.update(now)
        return round(spent, 3)

    def offloading(trainer):
        before = nvrx_ipc_fix.status()
        began = time.perf_counter()
        with nvrx_ipc_fix.offloading(trainer.queue, strategy=spec["strategy"]) as released:
            trainer.offload()
            time.sleep(spec["inference"] / 2)
            measure = trainer.measure()
            apps = scenario.on_device()
            workers = scenario.checkpoint_workers()
            sb = standby._standby.pid if standby._standby is not None else None
            time.sleep(spec["inference"] / 2)
            trainer.onload()
            onloaded = time.perf_counter()
        if spec.get("resume") == "inline":
            suspend.ready(trainer.queue)
        back = time.perf_counter()
        after = nvrx_ipc_fix.status()
        cycles.append(
            {
                "release_s": round(released.seconds, 4),
                "measure": measure,
                "onload_blocked_s": round(back - onloaded, 4),
                "suspended": released.worker_suspended,
                "checkpoint_s": suspend.last.get("checkpoint_s")
                if released.worker_suspended
                else None,
                "on_device": sorted(apps or ()),
                "worker_on_device": bool(apps and set(apps) & set(workers)),
                "standby": sb,
                "standby_on_device": bool(apps and sb in apps),
                "prewarm_s": round(time.perf_counter() - onloaded, 4),
                "onloaded_at": onloaded,
                "cycle_began": began,
                "workers_started": after.prewarms - before.prewarms,
                "standby_status": after.standby,
            }
        )

    def step_done(trainer):  # after the training step (and the save, if any)
        spent = cpu_since_last()
        if cycles:  # else: the baseline, after the first saves
            cycles[-1].update(cpu_s=spent, save_blocked_s=blocked[-1] if blocked else None)
            if partial:  # a run cut short by a bound still leaves its cycles
                with open(partial, "a") as out:
                    out.write(json.dumps({"spec": spec, "cycle": len(cycles), **cycles[-1]}) + "\n")

    def training_step(trainer):  # from the onload to the save
        import torch

        began = time.perf_counter()
        if spec.get("matmuls") and torch.cuda.is_available():
            a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
            for _ in range(spec["matmuls"]):
                a = (a @ a).clamp_(-1, 1)
            torch.cuda.synchronize()
            del a
        else:
            time.sleep(spec["step"])
        cycles[-1]["step_s"] = round(time.perf_counter() - began, 4)
        if cycles[-1]["suspended"]:  # the resume ran beside the step, or in line
            suspend.ready(trainer.queue)
            cycles[-1]["restore_s"] = suspend.last.get("restore_s")
            cycles[-1]["ready_after_onload_s"] = (
                round(suspend.last["resumed_at"] - cycles[-1]["onloaded_at"], 4)
                if "resumed_at" in suspend.last
                else None
            )

    scenario.EXTRA_STEPS.update(
        {"offloading-bench": offloading, "cpu": step_done, "step": training_step}
    )
    steps = ["save", "save", "cpu"]
    for i in range(spec["cycles"]):
        steps += ["offloading-bench", "step", "ready"]
        if (i + 1) % spec["save_every"] == 0:
            steps.append("save")
        steps.append("cpu")
    tensors, numel = SIZES[spec["size"]]
    with tempfile.TemporaryDirectory(dir=spec.get("dir")) as directory:
        report = scenario.run(
            steps, directory, timeout=spec["timeout"], n_tensors=tensors, numel=numel
        )
    report["cycles"] = cycles
    print("REPORT " + json.dumps(report))


def run_case(spec):
    env = dict(os.environ)
    if spec["strategy"] == "restart" and not spec.get("standby", True):
        env["NVRX_IPC_FIX_STANDBY"] = "off"
    began = time.time()
    proc = subprocess.run(
        [sys.executable, __file__, "--child", json.dumps(spec)],
        env=env,
        capture_output=True,
        text=True,
        timeout=spec["timeout"] * 40,
    )
    lines = [line for line in proc.stdout.splitlines() if line.startswith("REPORT ")]
    if not lines:
        return {"spec": spec, "error": f"exit {proc.returncode}", "stderr": proc.stderr[-4000:]}
    report = json.loads(lines[-1][len("REPORT ") :])
    return {
        "spec": spec,
        "wall_s": round(time.time() - began, 1),
        "nvrx": report["nvrx"],
        "device": report["device"],
        "hang": report["hang"],
        "stale": [s["stale"] for s in report["saves"]],
        "saves": [
            {k: s[k] for k in ("step", "blocked_s", "worker_before", "worker")}
            for s in report["saves"]
        ],
        "ready": report.get("ready", []),
        "cycles": report["cycles"],
        "log": report["log"],
        "prewarm_failures": report["prewarm_failures"],
    }


def _worker_mib(measures):
    """The most device memory the worker processes held in one of ``measures``."""
    known = [m.get("workers_on_device") for m in measures]
    if any(k is None for k in known):
        return "not measured"
    return f"{max(sum(k.values()) for k in known)} MiB"


def table(paths):
    """A Markdown table of the cases in these JSON-lines files. The first cycle is its own
    row where the standby was not ready at its onload (its worker was spawned)."""
    import statistics

    def spread(values, unit=" s"):
        values = [v for v in values if v is not None]
        if not values:
            return ""
        return f"{statistics.median(values):.3f} / {max(values):.3f}{unit}"

    rows = [
        "| case | cycles | ready after onload (median / max) | of it: to the start-up "
        "request / pinning (restart); suspend / resume (suspend) | the onload blocks | "
        "save after onload blocks (median / max) | worker processes during inference / "
        "their device memory (nvidia-smi, max) | standby on the device | "
        "CPU s per cycle (median) | "
        "workers started per cycle | stale | hang |",
        "|" + "---|" * 12,
    ]
    for path in paths:
        for line in open(path):
            case = json.loads(line)
            if "error" in case:
                continue
            spec, cycles, ready = case["spec"], case["cycles"], case["ready"]
            saves = {s["step"]: s for s in case["saves"]}
            saved = [i for i in range(len(cycles)) if (i + 1) % spec["save_every"] == 0]
            after = {
                i: saves[step]["blocked_s"] + ready[i]["waited_s"]  # waited: for the worker
                for i, step in zip(saved, sorted(saves)[2:])
            }  # the saves after an onload
            name = (
                spec["strategy"]
                + ("-inline" if spec.get("resume") == "inline" else "")
                + (f" ({spec['label']})" if spec["label"] != spec["strategy"] else "")
            )
            groups = [("", list(range(len(cycles))))]
            if ready and ready[0].get("standby") is None and spec["strategy"] == "restart":
                groups = [(" (1st: spawned)", [0]), ("", list(range(1, len(cycles))))]
            for note, index in groups:
                if not index:
                    continue
                picked = [ready[i] for i in index]
                kept = [cycles[i] for i in index if cycles[i].get("suspended")]
                parts = (
                    [[c.get("checkpoint_s") for c in kept], [c.get("restore_s") for c in kept]]
                    if kept
                    else [
                        [r.get("first_request_s") for r in picked],
                        [r.get("pin_s") for r in picked],
                    ]
                )
                ready = (
                    [c.get("ready_after_onload_s") for c in kept]
                    if kept
                    else [r["ready_s"] for r in picked]
                )
                rows.append(
                    f"| {spec['size']} {name}{note} | {len(index)} | "
                    f"{spread(ready)} | "
                    f"{spread(parts[0])}; {spread(parts[1])} | "
                    f"{spread([cycles[i].get('onload_blocked_s') for i in index])} | "
                    f"{spread([after[i] for i in index if i in after])} | "
                    f"{max(c['measure']['workers'] for c in (cycles[i] for i in index))} / "
                    f"{_worker_mib([cycles[i]['measure'] for i in index])} | "
                    f"{'yes' if any(cycles[i]['standby_on_device'] for i in index) else 'no'} | "
                    f"{statistics.median(cycles[i].get('cpu_s', 0) for i in index):.2f} | "
                    f"{statistics.median(cycles[i]['workers_started'] for i in index):g} | "
                    f"{sum(s for s in case['stale'] if isinstance(s, int))} | "
                    f"{'yes' if case['hang'] else 'no'} |"
                )
    return "\n".join(rows)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--report", nargs="+", metavar="JSONL", help="print the table of these")
    parser.add_argument("--out")
    parser.add_argument("--sizes", default="2g16,8g64,2g4096")
    parser.add_argument(
        "--strategies",
        default="flush,restart,suspend",
        help="flush, restart, restart-nostandby (NVRX_IPC_FIX_STANDBY=off), "
        "suspend, suspend-inline (the resume waited for at the onload)",
    )
    parser.add_argument("--cycles", type=int, default=5)
    parser.add_argument("--inference", type=float, default=5.0, help="seconds offloaded")
    parser.add_argument("--step", type=float, default=3.0, help="seconds from onload to save")
    parser.add_argument(
        "--matmuls",
        type=int,
        default=0,
        help="the step is this many bf16 8192x8192 products on the GPU instead",
    )
    parser.add_argument("--save-every", type=int, default=1)
    parser.add_argument("--timeout", type=float, default=120.0, help="per save")
    parser.add_argument("--label", default="")
    args = parser.parse_args()
    if args.child:
        return child(json.loads(args.child))
    if args.report:
        return print(table(args.report))
    for size in args.sizes.split(","):
        for strategy in args.strategies.split(","):
            spec = {
                "size": size,
                "strategy": strategy.split("-")[0],
                "standby": strategy != "restart-nostandby",
                "cycles": args.cycles,
                "resume": "inline" if strategy == "suspend-inline" else "background",
                "matmuls": args.matmuls,
                "inference": args.inference,
                "step": args.step,
                "save_every": args.save_every,
                "timeout": args.timeout,
                "label": args.label or strategy,
            }
            result = run_case(spec)
            line = json.dumps(result)
            print(line, flush=True)
            if args.out:
                with open(args.out, "a") as out:
                    out.write(line + "\n")


if __name__ == "__main__":
    sys.exit(main())
