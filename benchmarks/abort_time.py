"""What an abort costs with the package against NVRx alone: ``abort_nvrx_checkpoint()``'s own
time, side by side (BENCHMARKS.md, "What an abort costs").

    PYTHONPATH=src python benchmarks/abort_time.py [--rounds 10] [--sigterm 0.5] [--out FILE]

Run it with the Python of an environment that has NVRx and the package installed (its .pth
activates the package at start-up; ``NVRX_IPC_FIX_DISABLE=1`` turns it off). Each round is
one fresh process per case and mode, the modes in turn (package on, then
``NVRX_IPC_FIX_DISABLE=1``), so that the load of the machine falls on both alike. A process
makes one save (finalized) through NVRx's persistent worker with its cache, then:

Each abort is timed whole and without NVRx's own ``PersistentAsyncCaller.close(abort=True)``
(``outside``: what the package adds, and NVRx's few lines around it), since NVRx's close
takes either ``--sigterm`` or less, as its SIGTERM reaches the worker's main thread or not.

* ``idle``: calls ``abort_nvrx_checkpoint()`` with the worker idle;
* ``finalize``: schedules a save whose worker is then stopped (SIGSTOP), lets a second thread
  wait for it in a blocking finalize, and calls ``abort_nvrx_checkpoint()`` from the first;
  NVRx waits ``--sigterm`` seconds (its ``sigterm_timeout``) for the stopped worker, then
  SIGKILLs it. With the package, also how long after the abort returned the finalize raised.

Prints one JSON line per process and the medians (range) per case and mode. Without CUDA it
runs on the CPU stand-in (``nvrx_ipc_fix.cli.fakecuda``).
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import textwrap

CHILD = """
import json, os, signal, sys, threading, time
import torch  # noqa: F401
from nvidia_resiliency_ext.checkpointing.async_ckpt.core import abort_nvrx_checkpoint
from nvrx_ipc_fix.cli.driver import Trainer, Watchdog

case, sigterm, directory = sys.argv[1], float(sys.argv[2]), sys.argv[3]
closing = []  # seconds in NVRx's own PersistentAsyncCaller.close(abort=True)


def timed(close):
    def run(*args, **kwargs):
        began = time.perf_counter()
        try:
            return close(*args, **kwargs)
        finally:
            closing.append(time.perf_counter() - began)

    return run


if os.environ.get("NVRX_IPC_FIX_DISABLE") == "1":  # NVRx's close is the class's own
    from nvidia_resiliency_ext.checkpointing.async_ckpt import core

    core.PersistentAsyncCaller.close = timed(core.PersistentAsyncCaller.close)
else:  # the package calls NVRx's original from its abort step
    from nvrx_ipc_fix.fixes import worker_watch

    abort_step = worker_watch._abort
    worker_watch._abort = lambda wrapped, *rest: abort_step(timed(wrapped), *rest)
t = Trainer(directory, n_tensors=4, numel=512)
t.queue.sigterm_timeout = sigterm  # NVRx's own setting, read by its next caller
t.save()
report = {"case": case, "package": os.environ.get("NVRX_IPC_FIX_DISABLE") != "1"}
if case == "finalize":
    raised, waiting = [], threading.Event()
    path, _ = t.fill()
    t.queue.schedule_async_request(t.request(path))
    os.kill(t.worker().pid, signal.SIGSTOP)

    def finalize():
        waiting.set()
        try:
            t.finalize()
        except Exception as exc:
            raised.append(type(exc).__name__)
        report["finalize_ended"] = time.perf_counter()

    thread = threading.Thread(target=finalize, daemon=True)
    thread.start()
    waiting.wait()
    time.sleep(0.3)  # the finalize is in its wait for the stopped worker (nothing ends it)
start = time.perf_counter()
abort_nvrx_checkpoint()
end = time.perf_counter()
report["abort_s"] = end - start
report["outside_s"] = report["abort_s"] - sum(closing)  # all but NVRx's close of the worker
if case == "finalize":
    thread.join(5.0)
    report["raised"] = raised
    ended = report.pop("finalize_ended", None)
    report["finalize_after_abort_s"] = None if ended is None else ended - end
print(json.dumps(report), flush=True)
Watchdog.exit()  # a finalize NVRx alone leaves waiting must not hold up the exit
"""


def run(case, package, sigterm):
    env = {k: v for k, v in os.environ.items() if k != "NVRX_IPC_FIX_DISABLE"}
    if not package:
        env["NVRX_IPC_FIX_DISABLE"] = "1"
    with tempfile.TemporaryDirectory(prefix="abort-") as directory:
        out = subprocess.run(
            [sys.executable, "-c", textwrap.dedent(CHILD), case, str(sigterm), directory],
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
        )
    if out.returncode != 0:
        raise SystemExit(f"{case} package={package}: exit {out.returncode}\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def _ms(values):
    values = [v * 1000 for v in values if v is not None]
    if not values:
        return "-"
    return f"{statistics.median(values):.1f} ms ({min(values):.1f}-{max(values):.1f})"


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--sigterm", type=float, default=0.5)
    parser.add_argument("--cases", default="idle,finalize")
    parser.add_argument("--out", help="append the JSON lines to this file")
    args = parser.parse_args(argv)
    found = []
    for _ in range(args.rounds):
        for case in args.cases.split(","):
            for package in (True, False):
                report = run(case, package, args.sigterm)
                print(json.dumps(report), flush=True)
                found.append(report)
                if args.out:
                    with open(args.out, "a") as out:
                        out.write(json.dumps(report) + "\n")
    for case in args.cases.split(","):
        mine = [r for r in found if r["case"] == case]
        on = [r["abort_s"] for r in mine if r["package"]]
        off = [r["abort_s"] for r in mine if not r["package"]]
        more = 1000 * (statistics.median(on) - statistics.median(off))
        print(f"{case}: the abort, package on {_ms(on)}; NVRx alone {_ms(off)}; {more:+.1f} ms")
        on = [r["outside_s"] for r in mine if r["package"]]
        off = [r["outside_s"] for r in mine if not r["package"]]
        more = 1000 * (statistics.median(on) - statistics.median(off))
        print(
            f"  outside NVRx's close: package on {_ms(on)}; NVRx alone {_ms(off)}; {more:+.1f} ms"
        )
        if case == "finalize":
            after = _ms([r["finalize_after_abort_s"] for r in mine if r["package"]])
            raised = sorted({", ".join(r["raised"]) or "nothing" for r in mine})
            print(f"  the finalize ended {after} after the abort returned; raised: {raised}")


if __name__ == "__main__":
    main()
