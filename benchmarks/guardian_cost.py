"""What the guardian (``worker/guardian.py``) costs, and how fast it acts.

    PYTHONPATH=src:$NVRX python benchmarks/guardian_cost.py [--runs 20] [--calls 200000]

Each run is a "trainer" forked from this process (torch and NVRx imported here first, so it
is the size of a small trainer) that starts three sleeping "workers", guards them (the first
``guard`` starts the guardian) and waits to be killed. Per run: how long that first
``guard`` blocked the trainer; how long until the guardian watches (it has read its pipe);
the guardian's CPU time by then, and its memory (RSS, PSS and private memory from
``/proc/<pid>/smaps_rollup``); and, after the trainer's SIGKILL, how long until every
guarded process is gone (``/proc`` polled every millisecond). Then, with ``timeit``, what the
guardian adds to every save: ``adopt`` (a real ``AsyncCallsQueue`` whose caller's worker is
guarded already, and NVRx's results-queue manager) and ``guard`` of a process already
guarded. Prints one JSON line per run, then the medians and ranges.
"""

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import time
import timeit

WORKERS = 3


def _alive(pid):
    try:
        with open(f"/proc/{pid}/stat", "rb") as stat:
            return stat.read().rpartition(b")")[2].split()[0] not in (b"Z", b"X")
    except OSError:
        return False


def _memory(pid):
    """``(rss, pss, private)`` in KiB, from ``smaps_rollup``."""
    fields = {}
    with open(f"/proc/{pid}/smaps_rollup") as rollup:
        for line in rollup:
            parts = line.split()
            if len(parts) == 3 and parts[2] == "kB":
                fields[parts[0].rstrip(":")] = int(parts[1])
    return (
        fields["Rss"],
        fields["Pss"],
        fields.get("Private_Clean", 0) + fields.get("Private_Dirty", 0),
    )


def _cpu_ms(pid):
    with open(f"/proc/{pid}/stat", "rb") as stat:
        fields = stat.read().rpartition(b")")[2].split()
    return (int(fields[11]) + int(fields[12])) * 1000 / os.sysconf("SC_CLK_TCK")


def _trainer(tell):
    """The forked trainer: start the workers, guard them, say so, wait to be killed."""
    import fcntl
    import termios

    from nvrx_ipc_fix.worker import guardian

    workers = [
        subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
        for _ in range(WORKERS)
    ]
    began = time.perf_counter()
    guardian.guard(workers[0])
    first = time.perf_counter() - began
    for worker in workers[1:]:
        guardian.guard(worker)
    while fcntl.ioctl(guardian._pipe, termios.FIONREAD, b"\0" * 4) != b"\0" * 4:
        time.sleep(0.0005)
    watching = time.perf_counter() - began
    os.write(
        tell,
        json.dumps(
            {
                "guardian": guardian._process.pid,
                "first_guard_ms": first * 1e3,
                "watching_ms": watching * 1e3,
                "workers": [w.pid for w in workers],
            }
        ).encode(),
    )
    while True:
        signal.pause()


def run_once():
    answer, tell = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(answer)
        try:
            _trainer(tell)
        finally:
            os._exit(1)
    os.close(tell)
    found = json.loads(os.read(answer, 65536))
    os.close(answer)
    guardian = found["guardian"]
    found["guardian_cpu_ms"] = _cpu_ms(guardian)
    found["rss_kib"], found["pss_kib"], found["private_kib"] = _memory(guardian)
    killed = time.perf_counter()
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
    deadline = killed + 30
    while any(map(_alive, found["workers"])) and time.perf_counter() < deadline:
        time.sleep(0.001)
    found["all_gone_ms"] = (time.perf_counter() - killed) * 1e3
    found["left"] = [w for w in found.pop("workers") if _alive(w)]
    return found


def per_save(calls):
    """Microseconds per call: ``adopt`` of a queue whose processes are guarded already, and
    ``guard`` of a guarded process; the bare call beside each."""
    from nvidia_resiliency_ext.checkpointing.async_ckpt import core, filesystem_async

    from nvrx_ipc_fix.worker import guardian

    worker = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    queue = core.AsyncCallsQueue(persistent=True)
    caller = queue._get_async_caller()
    caller.process = worker  # stands in for its worker process
    filesystem_async.get_write_results_queue()  # NVRx's results-queue manager, as a save makes
    try:
        guardian.adopt(queue)
        cases = {
            "adopt(queue), already guarded": lambda: guardian.adopt(queue),
            "guard(process), already guarded": lambda: guardian.guard(worker),
            "a bare call": lambda: None,
        }
        return {
            name: min(timeit.repeat(call, number=calls, repeat=5)) / calls * 1e6
            for name, call in cases.items()
        }
    finally:
        caller.process = None
        worker.kill()
        worker.wait()


def _summary(rows, key):
    values = [row[key] for row in rows]
    return f"{key}: median {statistics.median(values):.2f}, {min(values):.2f}-{max(values):.2f}"


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=20)
    parser.add_argument("--calls", type=int, default=200_000)
    args = parser.parse_args()
    import torch  # noqa: F401  (the trainer's size)
    from nvidia_resiliency_ext.checkpointing.async_ckpt import core  # noqa: F401

    import nvrx_ipc_fix  # noqa: F401  (activates)

    rows = []
    for _ in range(args.runs):
        rows.append(run_once())
        print(json.dumps(rows[-1]), flush=True)
    for key in (
        "first_guard_ms",
        "watching_ms",
        "guardian_cpu_ms",
        "rss_kib",
        "pss_kib",
        "private_kib",
        "all_gone_ms",
    ):
        print(_summary(rows, key))
    print(f"runs with a process left after 30 s: {sum(bool(r['left']) for r in rows)}")
    for name, us in per_save(args.calls).items():
        print(f"{name:<36} {us:8.2f} us")
    return 0


if __name__ == "__main__":
    sys.exit(main())
