"""GPU memory, save latency and correctness of the NVRx IPC cache, per way of releasing it.

    python benchmarks/gpu_lifecycle.py --out benchmarks/results/h200-nvrx070.jsonl \\
        [--sizes 2g16,2g4096,16g64] [--scenarios vanilla,nemo_rl,terminate,flush,auto,no_cache,
        restart,auto_restart] [--cycles 20] [--overhead 12] [--ranks 2 [--launcher torchrun]]

Each (size, scenario) runs in a fresh process per rank through ``harness.scenario``:
save, save (cache primed), then ``--cycles`` times (default 1): the scenario's release,
offload the model (``to("cpu")``, ``gc``, ``empty_cache``), measure, onload, save with new
values; every checkpoint is loaded back and compared value by value, and a watchdog turns
a hang into a reported failure.

Scenarios: ``vanilla`` (no package), ``nemo_rl`` (NeMo RL PR #3322's sequence by hand, no
package), ``terminate`` / ``flush`` (``nvrx_ipc_fix.release``), ``auto`` (NeMo RL's
``offload_before_refit``, modelled in tests/doubles, with the package releasing on its own,
``flush``), ``no_cache`` (``use_cached_data_structure=False``, no package: the reference);
``restart`` (``release(strategy="restart")``, ``prewarm()`` at the onload; ``restart_nopin``: the
same with ``NVRX_IPC_FIX_PIN=off``, nothing pinned ahead) and ``auto_restart`` (NeMo RL's
``offload_before_refit`` and ``prepare_for_training`` with ``NVRX_IPC_FIX_STRATEGY=restart``),
both with ``NVRX_IPC_FIX_PREWARM=start``: their ``ready`` steps wait for the prewarmed worker,
standing in for the training between the job's start (or the onload) and the save, and report
how long it took to start. The first save of the other scenarios starts the worker itself.
``--case LABEL=STEPS`` runs any scenario steps (worker faults, a rank that releases
alone: ``<step>@<rank>``), finalized as ``--finalize`` and ``--no-dist`` say. ``--overhead N`` times
N ordinary saves, 0.5 s apart as a training loop's would be, in each of ``OVERHEAD``'s variants
(each size, separate processes, ``--rounds`` times in turn). ``--ranks N`` runs N ranks (one GPU
each) per case, started by this script (``--launcher spawn``, a shared file for the rendezvous) or
by ``torchrun``. Without CUDA it runs on the CPU stand-in (no memory figures). Prints and appends
JSON lines, one per rank and case.
"""

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
TESTS = os.path.normpath(os.path.join(HERE, os.pardir, "tests"))
DOUBLES = os.path.join(TESTS, "doubles")
sys.path.insert(0, TESTS)  # the tests' harness (harness.scenario), here and in NVRx's workers
SIZES = {
    "2g16": (16, 2**31 // 4 // 16),
    "2g4096": (4096, 2**31 // 4 // 4096),
    "16g64": (64, 2**34 // 4 // 64),
    "16g128": (128, 2**34 // 4 // 128),
    "8g64": (64, 2**33 // 4 // 64),
    "32g256": (256, 2**35 // 4 // 256),
    "256m8": (8, 2**28 // 4 // 8),
    "4m8": (8, 2**22 // 4 // 8),
    "16m4096": (4096, 2**24 // 4 // 4096),
}
# 4m8, 16m4096: the CPU stand-in (a dry run; per-tensor costs at 4096 tensors)
SCENARIOS = {  # name -> (package on, use_cached_data_structure, the release step)
    "vanilla": (False, True, []),
    "nemo_rl": (False, True, ["nemo_rl_manual"]),
    "terminate": (True, True, ["terminate"]),
    "flush": (True, True, ["flush"]),
    "auto": (True, True, ["nemo_offload_before_refit"]),
    "no_cache": (False, False, []),
    "restart": (True, True, ["restart"]),
    "restart_nopin": (True, True, ["restart"]),
    "auto_restart": (True, True, ["nemo_offload_before_refit"]),
}
#: Scenarios that prewarm: their environment, and the steps after the onload.
PREWARMED = {
    "restart": ({"NVRX_IPC_FIX_PREWARM": "start"}, ["prewarm", "ready"]),
    "restart_nopin": (
        {"NVRX_IPC_FIX_PREWARM": "start", "NVRX_IPC_FIX_PIN": "off"},
        ["prewarm", "ready"],
    ),
    "auto_restart": (
        {"NVRX_IPC_FIX_PREWARM": "start", "NVRX_IPC_FIX_STRATEGY": "restart"},
        ["nemo_prepare_for_training", "ready"],
    ),
}


#: Other scenarios' environment: ``auto`` measures the automatic release with ``flush`` (the
#: rows recorded before ``restart`` became its default).
ENVIRONMENT = {"auto": {"NVRX_IPC_FIX_STRATEGY": "flush"}}


#: --overhead variants: label -> NVRX_IPC_FIX_DISABLE
OVERHEAD = (("vanilla", "1"), ("package", ""), ("no-watch", "worker_watch"))


def child(spec):
    """Runs in the case's own process: register the extra steps, run, print the report."""
    if "RANK" in os.environ:  # started by torchrun
        spec.update(rank=int(os.environ["RANK"]), ranks=int(os.environ["WORLD_SIZE"]))
    import gc
    import types

    from harness import scenario

    def nemo_rl_manual(trainer):  # NeMo RL PR #3322, finalize_async_save with release
        import torch
        from nvidia_resiliency_ext.checkpointing.async_ckpt.filesystem_async import (
            FileSystemWriterAsync,
        )

        trainer.queue.maybe_finalize_async_calls(blocking=True)
        trainer.queue.close()
        FileSystemWriterAsync.cleanup_tensor_caches()
        gc.collect()
        torch.cuda.ipc_collect()
        torch.cuda.empty_cache()

    # NeMo RL's policy worker (the test double), around the trainer's queue
    def nemo_worker(trainer):
        sys.path.insert(0, DOUBLES)
        from nemo_rl.models.policy.workers.megatron_policy_worker import (
            MegatronPolicyWorkerImpl,
        )

        worker = MegatronPolicyWorkerImpl.__new__(MegatronPolicyWorkerImpl)
        ckpt = types.SimpleNamespace(
            async_save=True,
            use_persistent_ckpt_worker=True,
            ckpt_assume_constant_structure=True,
            async_ckpt_use_cpu_shm=False,
        )
        worker.mcore_state = types.SimpleNamespace(
            cfg=types.SimpleNamespace(checkpoint=ckpt), async_calls_queue=trainer.queue
        )
        worker.cfg = {
            "generation": {"colocated": {"enabled": False}},
            "megatron_cfg": {"empty_unused_memory_level": 0},
        }
        worker.model = types.SimpleNamespace(eval=lambda: None, train=lambda: None)
        worker.move_model = lambda model, device, **kw: model
        worker.move_optimizer = lambda device: None
        worker.optimizer = None
        return worker

    def nemo_offload_before_refit(trainer):  # the real call shape; the package hooks it
        start = time.perf_counter()
        nemo_worker(trainer).offload_before_refit()  # releases, then would move the optimizer
        spec["auto_release_s"] = time.perf_counter() - start

    def nemo_prepare_for_training(trainer):  # the model is back: restart prewarms after it
        nemo_worker(trainer).prepare_for_training()

    scenario.EXTRA_STEPS.update(
        nemo_rl_manual=nemo_rl_manual,
        nemo_offload_before_refit=nemo_offload_before_refit,
        nemo_prepare_for_training=nemo_prepare_for_training,
    )
    with tempfile.TemporaryDirectory(prefix="nvrx-bench-", dir=spec.get("dir")) as directory:
        report = scenario.run(
            spec["steps"],
            spec.get("shared") or directory,
            spec["timeout"],
            spec["tensors"],
            spec["numel"],
            spec["cached"],
            spec["rank"],
            spec["ranks"],
            finalize=spec.get("finalize", "blocking"),
            no_dist=spec.get("no_dist", False),
        )
    report.update({k: spec[k] for k in ("case", "size", "scenario", "cycles") if k in spec})
    if "auto_release_s" in spec:
        report["auto_release_s"] = spec["auto_release_s"]
    print(json.dumps(report), flush=True)


def _baseline_bytes(settle=30.0):
    """Device memory used by a process that only initialised CUDA (None without CUDA).

    Processes of an earlier, interrupted run may still be freeing the device: take the
    lowest reading within ``settle`` seconds, stopping early once it is below 1 GiB."""
    code = (
        "import torch; torch.zeros(1, device='cuda'); f, t = torch.cuda.mem_get_info(); "
        "print(t - f)"
    )
    deadline, best = time.monotonic() + settle, None
    while True:
        done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
        if done.returncode != 0:
            return None
        best = min(int(done.stdout.strip()), best or 1 << 62)
        if best < 1 << 30 or time.monotonic() > deadline:
            return best
        time.sleep(2)


RUNNING = []  # the case's processes (each leads its own process group)


def _stop(signum, _frame):
    """SIGTERM/SIGINT (``timeout``, Ctrl-C): take the case's processes down too."""
    for proc in RUNNING:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except OSError:
            pass
    sys.exit(128 + signum)


def run_case(spec, disable, ranks, timeout, launcher="spawn"):
    """Run one case on ``ranks`` ranks with ``NVRX_IPC_FIX_DISABLE=disable`` ("": the whole
    package on) and the case's ``env``; return the rank reports (one per rank)."""
    env = dict(os.environ, NVRX_IPC_FIX_DISABLE=disable, **spec.get("env", {}))
    shared = tempfile.mkdtemp(prefix="nvrx-bench-shared-") if ranks > 1 else None
    if launcher == "torchrun":
        port = 29500 + os.getpid() % 1000
        commands = [
            [
                sys.executable,
                "-m",
                "torch.distributed.run",
                "--nproc_per_node",
                str(ranks),
                "--master_port",
                str(port),
                __file__,
                "--child",
                json.dumps(dict(spec, shared=shared)),
            ]
        ]
    else:
        commands = [
            [
                sys.executable,
                __file__,
                "--child",
                json.dumps(dict(spec, rank=rank, ranks=ranks, shared=shared)),
            ]
            for rank in range(ranks)
        ]
    start = time.perf_counter()
    procs = [
        subprocess.Popen(
            command,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,
        )
        for command in commands
    ]
    RUNNING[:] = procs
    reports, errors = {}, {}
    for index, proc in enumerate(procs):
        try:
            out, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, 9)
            out, err = proc.communicate()
        found = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
        reports.update((report["rank"], report) for report in found)
        if not found:
            errors[index] = {"error": err[-2000:], "exit": proc.returncode}
    for rank in range(ranks):  # a rank that printed nothing: its process's error
        if rank not in reports:
            reports[rank] = dict(errors.get(rank if launcher == "spawn" else 0, {}), rank=rank)
    wall = round(time.perf_counter() - start, 1)
    return [
        dict(reports[rank], wall_s=wall, ranks=ranks, launcher=launcher) for rank in sorted(reports)
    ]


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--out", required=False)
    parser.add_argument("--sizes", default="2g16,2g4096,16g64")
    parser.add_argument("--scenarios", default=",".join(SCENARIOS))
    parser.add_argument(
        "--cycles", type=int, default=1, help="release/offload/onload/save cycles per case"
    )
    parser.add_argument(
        "--overhead",
        type=int,
        default=0,
        help="ordinary saves per process, for each variant in OVERHEAD",
    )
    parser.add_argument("--rounds", type=int, default=1, help="of the --overhead variants")
    parser.add_argument("--ranks", type=int, default=1)
    parser.add_argument("--launcher", choices=("spawn", "torchrun"), default="spawn")
    parser.add_argument(
        "--case",
        action="append",
        default=[],
        metavar="LABEL=STEPS",
        help="also run these scenario steps (comma list; faults, <step>@<rank>), "
        "at the first size, with the package",
    )
    parser.add_argument(
        "--finalize",
        choices=("blocking", "poll"),
        default="blocking",
        help="the --case runs: one blocking finalize per save, or a training "
        "loop's non-blocking polls",
    )
    parser.add_argument("--no-dist", action="store_true", help="the --case runs: no_dist=True")
    parser.add_argument("--timeout", type=float, default=120.0, help="per save")
    args = parser.parse_args()
    if args.child:
        return child(json.loads(args.child))
    signal.signal(signal.SIGTERM, _stop)
    signal.signal(signal.SIGINT, _stop)
    meta = {
        "baseline_bytes": _baseline_bytes(),
        "date": time.strftime("%Y-%m-%d"),
        "command": " ".join(sys.argv),
    }

    def record(reports):  # as each case ends, so a cut-off run keeps what it measured
        for report in reports:
            report.update(meta)
            print(json.dumps(report), flush=True)
            if args.out:
                with open(args.out, "a") as out:
                    out.write(json.dumps(report) + "\n")

    cycles = max(1, args.cycles)
    for size in args.sizes.split(",") if args.scenarios else ():
        tensors, numel = SIZES[size]
        for name in args.scenarios.split(","):
            package, cached, release = SCENARIOS[name]
            env, onload = PREWARMED.get(name, (ENVIRONMENT.get(name, {}), []))
            steps = (
                (["ready"] if onload else [])
                + ["save", "save"]
                + [*release, "offload", "measure", "onload", *onload, "save"] * cycles
            )
            record(
                run_case(
                    {
                        "case": f"{size}/{name}",
                        "size": size,
                        "scenario": name,
                        "cycles": cycles,
                        "steps": steps,
                        "tensors": tensors,
                        "numel": numel,
                        "cached": cached,
                        "timeout": args.timeout,
                        "env": env,
                    },
                    "" if package else "1",
                    args.ranks,
                    args.timeout * (3 + cycles) + 300,
                    args.launcher,
                )
            )
    for case in args.case:
        label, _, steps = case.partition("=")
        size = args.sizes.split(",")[0]
        tensors, numel = SIZES[size]
        record(
            run_case(
                {
                    "case": f"{size}/{label}",
                    "size": size,
                    "scenario": label,
                    "steps": steps.split(","),
                    "tensors": tensors,
                    "numel": numel,
                    "cached": True,
                    "timeout": args.timeout,
                    "finalize": args.finalize,
                    "no_dist": args.no_dist,
                },
                "",
                args.ranks,
                args.timeout * 6 + 300,
                args.launcher,
            )
        )
    for size in args.sizes.split(",") if args.overhead else ():
        tensors, numel = SIZES[size]
        for _ in range(args.rounds):  # interleaved, so drift hits every variant alike
            for label, disable in OVERHEAD:
                record(
                    run_case(
                        {
                            "case": f"{size}/overhead-{label}",
                            "size": size,
                            "scenario": f"overhead-{label}",
                            "steps": ["save", "sleep0.5"] * args.overhead,
                            "tensors": tensors,
                            "numel": numel,
                            "cached": True,
                            "timeout": args.timeout,
                        },
                        disable,
                        args.ranks,
                        args.timeout * args.overhead + 300,
                        args.launcher,
                    )
                )
    return 0


if __name__ == "__main__":
    sys.exit(main())
