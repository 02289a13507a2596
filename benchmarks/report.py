"""Tables (Markdown) and a chart (PNG) from ``benchmarks/results/*.jsonl``.

    python benchmarks/report.py [--chart benchmarks/results/h200-2g16.png]   # needs matplotlib

Held memory is ``torch.cuda.memory_allocated()`` in the trainer after the offload (the
model's blocks that the worker's IPC mappings keep alive), and the device's used memory
over an empty CUDA process (the trainer's and the worker's contexts included; shown only
when nothing else was on the device at the baseline).
"""

import argparse
import glob
import json
import os
import statistics

GIB = float(1 << 30)
HERE = os.path.dirname(os.path.abspath(__file__))
ORDER = ("vanilla", "nemo_rl", "terminate", "flush", "auto", "no_cache", "restart", "auto_restart")
#: The scenarios compared for prewarm: the two releases it replaces, and itself.
PREWARM = ("flush", "terminate", "restart", "restart_nopin", "auto_restart")
CLEAN_BASELINE = 1 << 30  # a baseline above this means another process was on the device


RESULTS = os.path.join(HERE, "results", "*.jsonl")


def load(pattern=RESULTS):
    rows = []
    for path in sorted(glob.glob(pattern)):
        with open(path) as lines:
            rows += [
                dict(json.loads(line), file=os.path.basename(path))
                for line in lines
                if line.strip()
            ]
    return rows


def _device_used(r):
    """The most device memory used at a ``measure``, over an empty CUDA process; "n/a" without
    a figure or where another process was on the device at the baseline."""
    used = [m["device_used"] for m in r.get("measures") or [] if m.get("device_used") is not None]
    if not used or r["baseline_bytes"] > CLEAN_BASELINE:
        return "n/a"
    return f"{(max(used) - r['baseline_bytes']) / GIB:.3f} GiB"


def _release_s(r):
    """Seconds of the release: NeMo RL's whole offload call where it released, else the
    median of the ``release()`` calls; None without one."""
    if r.get("auto_release_s") is not None:
        return r["auto_release_s"]
    releases = [x["seconds"] for x in r.get("releases") or []]
    return statistics.median(releases) if releases else None


def lifecycle_table(rows, size, ranks=1):
    """One row per (NVRx, scenario[, rank]); with ``--cycles`` the worst cycle's memory, the
    median next-save blocking time and release over the cycles, and the stale tensors of
    every save."""
    rank_col = ranks > 1
    out = [
        "| NVRx | scenario |" + (" rank |" if rank_col else "") + " cycles | held after "
        "offload (allocated) | device used over an empty process | warm save blocks | "
        "next save blocks | next save total | release | stale tensors | hang |",
        "|---|---|" + ("---|" if rank_col else "") + "---|---|---|---|---|---|---|---|---|",
    ]
    found = [
        r
        for r in rows
        if r.get("size") == size
        and r.get("scenario") in ORDER
        and r.get("ranks", 1) == ranks
        and r.get("saves")
    ]
    for r in sorted(found, key=lambda r: (r["nvrx"], ORDER.index(r["scenario"]), r["rank"])):
        measures = r.get("measures") or [{}]
        held = max(m.get("allocated") or 0 for m in measures)
        used = _device_used(r)
        after = r["saves"][2:] or r["saves"][-1:]
        blocks = statistics.median(s["blocked_s"] for s in after)
        total = statistics.median(s["total_s"] or float("nan") for s in after)
        seconds = _release_s(r)
        stale = sum(s["stale"] or 0 for s in r["saves"])
        out.append(
            f"| {r['nvrx']} | {r['scenario']} |"
            + (f" {r['rank']} |" if rank_col else "")
            + f" {len(after)} | {held / GIB:.3f} GiB | {used} | "
            f"{r['saves'][1]['blocked_s']:.3f} s | {blocks:.3f} s | {total:.2f} s | "
            f"{'' if seconds is None else f'{seconds:.3f} s'} | {stale} | "
            f"{'**yes**' if r.get('hang') else 'no'} |"
        )
    return "\n".join(out)


def faults_table(rows):
    """Cases with worker faults or a rank that releases alone: what each rank saw."""
    out = [
        "| NVRx | case | rank | error | raised in | after | failed ranks | saves after, "
        "stale | log | hang |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in sorted(
        (
            r
            for r in rows
            if r.get("device") == "cuda"
            and r.get("log") is not None
            and (r.get("faults") or r.get("log"))
        ),
        key=lambda r: (r["nvrx"], r.get("case", ""), r["rank"]),
    ):
        fault = (r.get("faults") or [{}])[0]
        error = fault.get("finalize_error") or fault.get("error") or {}
        log = "; ".join(f"{e['level']} at {e['t']:.0f} s" for e in r["log"]) or "none"
        after = fault.get("after_s")
        out.append(
            f"| {r['nvrx']} | {r.get('case')} | {r['rank']} | "
            f"{error.get('type', 'none')} | {fault.get('raised_in') or ''} | "
            f"{'' if after is None else f'{after:.2f} s'} | "
            f"{','.join(map(str, error.get('failed_ranks', []))) or ''} | "
            f"{sum(s['stale'] or 0 for s in r['saves'])} | {log} | "
            f"{'**yes**' if r.get('hang') else 'no'} |"
        )
    return "\n".join(out)


def recovery_table(rows):
    """Worker faults under the recovery protocol (reports that name their finalize mode):
    per fault, what the rank raised and when, whether the next finalize raised it again, the
    saves the error named, and the next save (blocked, total, stale tensors on load)."""
    out = [
        "| NVRx | case | finalize | fault | error | raised in | after | raised again | "
        "saves named not saved | next save blocks / total | next save stale | hang |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in sorted(
        (r for r in rows if r.get("device") == "cuda" and "finalize" in r and r.get("faults")),
        key=lambda r: (r["nvrx"], r.get("case", ""), r["finalize"], r["rank"]),
    ):
        for fault in r["faults"]:
            error = fault.get("error") or {}
            after = next(
                (s for s in r["saves"] if s["step"] > fault["step"] and not s.get("lost")), {}
            )
            times = (
                f"{after['blocked_s']:.3f} / {after['total_s']:.3f} s"
                if after.get("total_s") is not None
                else ""
            )
            took = "" if fault.get("after_s") is None else f"{fault['after_s']:.2f} s"
            out.append(
                f"| {r['nvrx']} | {r.get('case')} | {r['finalize']}"
                f"{', no_dist' if r.get('no_dist') else ''} | {fault['fault']} | "
                f"{error.get('type', 'none')} | {fault.get('raised_in') or ''} | "
                f"{took} | "
                f"{(fault.get('again') or {}).get('type', 'no')} | "
                f"{len(fault.get('lost') or [])} | {times} | {after.get('stale', '')} | "
                f"{'**yes**' if r.get('hang') else 'no'} |"
            )
    return "\n".join(out)


def prewarm_table(rows, size):
    """Per case, over all its cycles: worker processes and device memory during the inference
    phase (the ``measure`` after each offload), a warm save, the saves after the onloads, the
    first save of the job, the release, and how long the next worker took to start."""
    out = [
        "| NVRx | scenario | cycles | worker processes during inference | device used "
        "during inference over an empty process (max) | warm save blocks | save after "
        "onload blocks (median / max) | max / warm | first save blocks | first / warm | "
        "release (median) | next worker ready after (median / max) | host memory pinned ahead "
        "| stale tensors | hang |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    found = [
        r
        for r in rows
        if r.get("size") == size
        and r.get("scenario") in PREWARM
        and r.get("saves")
        and r.get("ranks", 1) == 1
        and any("workers" in m for m in r.get("measures") or [])
    ]  # this benchmark's
    for r in sorted(found, key=lambda r: (r["nvrx"], PREWARM.index(r["scenario"]))):
        measures, saves = r.get("measures") or [], r["saves"]
        workers = sorted({m.get("workers") for m in measures}, key=str)
        used = _device_used(r)
        warm, first = saves[1]["blocked_s"], saves[0]["blocked_s"]
        after = [s["blocked_s"] for s in saves[2:]] or [float("nan")]
        release = _release_s(r)
        ready = [x["ready_s"] for x in (r.get("ready") or [])[1:] if x.get("ready_s")]
        pinned = {x.get("pinned_bytes") for x in (r.get("ready") or [])[1:]} - {None}
        out.append(
            f"| {r['nvrx']} | {r['scenario']} | {r.get('cycles')} | "
            f"{', '.join(map(str, workers))} | {used} | {warm:.3f} s | "
            f"{statistics.median(after):.3f} / {max(after):.3f} s | {max(after) / warm:.2f} | "
            f"{first:.3f} s | {first / warm:.2f} | "
            f"{'' if release is None else f'{release:.3f} s'} | "
            f"{f'{statistics.median(ready):.2f} / {max(ready):.2f} s' if ready else ''} | "
            f"{', '.join(f'{b / GIB:.2f} GiB' for b in sorted(pinned)) or 'not recorded'} | "
            f"{sum(s.get('stale') or 0 for s in saves)} | "
            f"{'**yes**' if r.get('hang') else 'no'} |"
        )
    return "\n".join(out)


def overhead_table(rows):
    """Median blocking time (and save + finalize) of ordinary cached saves per variant, one
    row per run (the first two saves of each process, which start the worker and prime the
    cache, are left out)."""
    out = [
        "| run (results file) | NVRx | device | size | saves per variant | vanilla | package | "
        "package without worker_watch | package / vanilla | worker_watch's cost | "
        "save + blocking finalize: vanilla, package |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    by = {}
    for r in rows:
        if str(r.get("scenario", "")).startswith("overhead-") and r.get("saves"):
            run = r["file"]
            key = (run, r["nvrx"], r["device"].split()[0], r["size"])
            by.setdefault(key, {}).setdefault(r["scenario"][len("overhead-") :], []).extend(
                (s["blocked_s"], s["total_s"]) for s in r["saves"][2:]
            )
    for (run, nvrx, device, size), runs in sorted(by.items()):
        if {"vanilla", "package"} <= set(runs):
            med = {name: statistics.median(b for b, _ in saves) for name, saves in runs.items()}
            tot = {name: statistics.median(t for _, t in saves) for name, saves in runs.items()}
            watch = med.get("no-watch")
            cost = "" if watch is None else f"{(med['package'] / watch - 1) * 100:+.1f} %"
            out.append(
                f"| {run} | {nvrx} | {device} | {size} | {len(runs['package'])} | "
                f"{med['vanilla']:.4f} s | {med['package']:.4f} s | "
                f"{'not run' if watch is None else f'{watch:.4f} s'} | "
                f"{med['package'] / med['vanilla']:.3f} | "
                f"{cost} | "
                f"{tot['vanilla']:.3f} s, {tot['package']:.3f} s |"
            )
    return "\n".join(out)


def chart(rows, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    found = [r for r in rows if r.get("size") == "2g16" and r.get("scenario") in ORDER]
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for nvrx, offset in (("0.6.0", -0.2), ("0.7.0", 0.2)):
        mine = {r["scenario"]: r for r in found if r["nvrx"] == nvrx}
        xs = [i + offset for i, name in enumerate(ORDER) if name in mine]
        held = [mine[n]["measures"][0]["allocated"] / GIB for n in ORDER if n in mine]
        blocks = [mine[n]["saves"][-1]["blocked_s"] for n in ORDER if n in mine]
        axes[0].bar(xs, held, width=0.4, label=f"NVRx {nvrx}")
        axes[1].bar(xs, blocks, width=0.4, label=f"NVRx {nvrx}")
    axes[0].set_title("model memory held after offload (GiB)")
    axes[1].set_title("next save: blocking time (s)")
    for ax in axes:
        ax.set_xticks(range(len(ORDER)), ORDER, rotation=20)
        ax.legend()
    fig.suptitle("2 GiB model, 16 tensors, one H200 (torch 2.11)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--chart")
    parser.add_argument(
        "--results",
        default=os.path.join(HERE, "results", "*.jsonl"),
        help="JSON-lines files to read (a glob)",
    )
    args = parser.parse_args()
    rows = load(args.results)
    for ranks in (1, 2):
        for size in ("2g16", "2g4096", "16g64"):
            print(f"### {size}, {ranks} rank(s)\n\n{lifecycle_table(rows, size, ranks)}\n")
    for size in sorted({r.get("size") for r in rows if r.get("scenario") in PREWARM} - {None}):
        print(f"### prewarm, {size}\n\n{prewarm_table(rows, size)}\n")
    print(f"### faults and collective misuse\n\n{faults_table(rows)}\n")
    print(f"### recovery after a worker failure\n\n{recovery_table(rows)}\n")
    print(f"### overhead\n\n{overhead_table(rows)}\n")
    if args.chart:
        chart(rows, args.chart)


if __name__ == "__main__":
    main()
