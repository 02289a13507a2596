"""What ``import nvrx_ipc_fix`` adds to interpreter start-up, and what it imports.

    python benchmarks/import_time.py [--runs 40]

Runs ``python -c pass`` and ``python -c "import nvrx_ipc_fix"`` alternately in fresh
interpreters and prints the medians and their difference (wall clock; the package's
own import with activation, no NVRx imported).
"""

import argparse
import json
import platform
import statistics
import subprocess
import sys
import time

HEAVY = ("torch", "nvidia_resiliency_ext", "wrapt", "logging", "inspect", "dataclasses")


def wall(code):
    start = time.perf_counter()
    subprocess.run([sys.executable, "-c", code], check=True)
    return time.perf_counter() - start


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", type=int, default=40)
    args = parser.parse_args()
    wall("import nvrx_ipc_fix")  # warm the file cache and byte-code
    base, pkg = [], []
    for _ in range(args.runs):
        base.append(wall("pass"))
        pkg.append(wall("import nvrx_ipc_fix"))
    loaded = subprocess.run([sys.executable, "-c", "import sys, json, nvrx_ipc_fix; print(json."
                             f"dumps([m for m in {HEAVY!r} if m in sys.modules]))"],
                            check=True, capture_output=True, text=True).stdout.strip()
    result = {"python": platform.python_version(), "runs": args.runs,
              "pass_ms": round(statistics.median(base) * 1e3, 1),
              "import_ms": round(statistics.median(pkg) * 1e3, 1),
              "added_ms": round((statistics.median(pkg) - statistics.median(base)) * 1e3, 1),
              "heavy_modules_imported": json.loads(loaded)}
    print(json.dumps(result))


if __name__ == "__main__":
    main()
