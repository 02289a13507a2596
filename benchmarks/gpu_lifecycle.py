"""GPU memory, save latency and correctness of the NVRx IPC cache, per way of releasing it.

    python benchmarks/gpu_lifecycle.py --out benchmarks/results/h200-nvrx070.jsonl \\
        [--sizes 2g16,2g4096,16g64] [--scenarios vanilla,nemo_rl,terminate,flush,auto,no_cache] \\
        [--cycles 20] [--overhead 12] [--ranks 1]

Each (size, scenario) runs in a fresh process through ``nvrx_ipc_fix.scenario``: save, save
(cache primed), the scenario's release, offload the model (``to("cpu")``, ``gc``,
``empty_cache``), measure, onload, save with new values; every checkpoint is loaded back
and compared value by value, and a watchdog turns a hang into a reported failure.

Scenarios: ``vanilla`` (no package), ``nemo_rl`` (NeMo RL PR #3322's sequence by hand, no
package), ``terminate`` / ``flush`` (``nvrx_ipc_fix.release``), ``auto`` (NeMo RL's
``offload_before_refit``, copied in tests/faithful, with the package releasing on its own),
``no_cache`` (``use_cached_data_structure=False``, no package: the reference).
``--cycles N`` adds N save/release/offload/onload cycles with ``flush``; ``--overhead N``
times N ordinary saves without and with the package (same sizes, separate processes).
``--ranks N`` runs N ranks (one GPU each) per case. Prints and appends JSON lines.
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
FAITHFUL = os.path.join(HERE, os.pardir, "tests", "faithful")
SIZES = {"2g16": (16, 2 ** 31 // 4 // 16), "2g4096": (4096, 2 ** 31 // 4 // 4096),
         "16g64": (64, 2 ** 34 // 4 // 64), "256m8": (8, 2 ** 28 // 4 // 8)}
SCENARIOS = {  # name -> (package on, use_cached_data_structure, the release step)
    "vanilla": (False, True, []),
    "nemo_rl": (False, True, ["nemo_rl_manual"]),
    "terminate": (True, True, ["terminate"]),
    "flush": (True, True, ["flush"]),
    "auto": (True, True, ["nemo_offload_before_refit"]),
    "no_cache": (False, False, []),
}


def child(spec):
    """Runs in the case's own process: register the extra steps, run, print the report."""
    import gc
    import types

    from nvrx_ipc_fix import scenario

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

    def nemo_offload_before_refit(trainer):  # the real call shape; the package hooks it
        sys.path.insert(0, FAITHFUL)
        from nemo_rl.models.policy.workers.megatron_policy_worker import (
            MegatronPolicyWorkerImpl,
        )

        worker = MegatronPolicyWorkerImpl.__new__(MegatronPolicyWorkerImpl)
        ckpt = types.SimpleNamespace(async_save=True, use_persistent_ckpt_worker=True,
                                     ckpt_assume_constant_structure=True,
                                     async_ckpt_use_cpu_shm=False)
        worker.mcore_state = types.SimpleNamespace(
            cfg=types.SimpleNamespace(checkpoint=ckpt), async_calls_queue=trainer.queue)
        worker.cfg = {"generation": {"colocated": {"enabled": False}}}
        worker.model = types.SimpleNamespace(eval=lambda: None)
        worker.move_model = lambda model, device, **kw: model
        worker.move_optimizer = lambda device: None
        worker.optimizer = None
        start = time.perf_counter()
        worker.offload_before_refit()  # releases (package), then would move the optimizer
        spec["auto_release_s"] = time.perf_counter() - start

    scenario.EXTRA_STEPS.update(nemo_rl_manual=nemo_rl_manual,
                                nemo_offload_before_refit=nemo_offload_before_refit)
    with tempfile.TemporaryDirectory(prefix="nvrx-bench-", dir=spec.get("dir")) as directory:
        report = scenario.run(spec["steps"], spec.get("shared") or directory, spec["timeout"],
                              spec["tensors"], spec["numel"], spec["cached"], spec["rank"],
                              spec["ranks"])
    report.update({k: spec[k] for k in ("case", "size", "scenario") if k in spec})
    if "auto_release_s" in spec:
        report["auto_release_s"] = spec["auto_release_s"]
    print(json.dumps(report), flush=True)


def _baseline_bytes():
    """Device memory used by a process that only initialised CUDA."""
    code = ("import torch; torch.zeros(1, device='cuda'); f, t = torch.cuda.mem_get_info(); "
            "print(t - f)")
    return int(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                              check=True).stdout.strip())


def run_case(spec, package, ranks, timeout):
    """Run one case on ``ranks`` ranks; return the rank reports."""
    env = dict(os.environ)
    if not package:
        env["NVRX_IPC_FIX_DISABLE"] = "1"
    shared = tempfile.mkdtemp(prefix="nvrx-bench-shared-") if ranks > 1 else None
    procs = []
    for rank in range(ranks):
        rank_spec = dict(spec, rank=rank, ranks=ranks, shared=shared)
        procs.append(subprocess.Popen([sys.executable, __file__, "--child", json.dumps(rank_spec)],
                                      env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                      text=True, start_new_session=True))
    reports = []
    for rank, proc in enumerate(procs):
        try:
            out, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, 9)
            out, err = proc.communicate()
        lines = [line for line in out.splitlines() if line.startswith("{")]
        if lines:
            reports.append(json.loads(lines[-1]))
        else:
            reports.append({"rank": rank, "error": err[-2000:], "exit": proc.returncode})
    return reports


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--out", required=False)
    parser.add_argument("--sizes", default="2g16,2g4096,16g64")
    parser.add_argument("--scenarios", default=",".join(SCENARIOS))
    parser.add_argument("--cycles", type=int, default=0)
    parser.add_argument("--overhead", type=int, default=0)
    parser.add_argument("--ranks", type=int, default=1)
    parser.add_argument("--timeout", type=float, default=120.0, help="per save")
    args = parser.parse_args()
    if args.child:
        return child(json.loads(args.child))
    meta = {"baseline_bytes": _baseline_bytes(), "date": time.strftime("%Y-%m-%d"),
            "command": " ".join(sys.argv)}

    def record(reports):  # as each case ends, so a cut-off run keeps what it measured
        for report in reports:
            report.update(meta)
            print(json.dumps(report), flush=True)
            if args.out:
                with open(args.out, "a") as out:
                    out.write(json.dumps(report) + "\n")

    for size in args.sizes.split(","):
        tensors, numel = SIZES[size]
        for name in args.scenarios.split(","):
            package, cached, release = SCENARIOS[name]
            steps = ["save", "save", *release, "offload", "measure", "onload", "save"]
            record(run_case({"case": f"{size}/{name}", "size": size, "scenario": name,
                             "steps": steps, "tensors": tensors, "numel": numel,
                             "cached": cached, "timeout": args.timeout},
                            package, args.ranks, args.timeout * 4 + 300))
    if args.cycles:
        tensors, numel = SIZES["256m8"]
        steps = ["save", "save"] + ["flush", "offload", "onload", "save"] * args.cycles
        record(run_case({"case": f"256m8/flush-cycles-{args.cycles}", "size": "256m8",
                         "scenario": "flush-cycles", "steps": steps, "tensors": tensors,
                         "numel": numel, "cached": True, "timeout": args.timeout},
                        True, args.ranks, args.timeout * 2 + 60 * args.cycles))
    if args.overhead:
        size = args.sizes.split(",")[0]
        tensors, numel = SIZES[size]
        for package in (False, True):
            label = "package" if package else "vanilla"
            record(run_case({"case": f"{size}/overhead-{label}", "size": size,
                             "scenario": f"overhead-{label}", "steps": ["save"] * args.overhead,
                             "tensors": tensors, "numel": numel, "cached": True,
                             "timeout": args.timeout},
                            package, args.ranks, args.timeout * args.overhead + 300))
    return 0


if __name__ == "__main__":
    sys.exit(main())
