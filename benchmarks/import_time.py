"""What nvrx-ipc-fix adds to interpreter start-up.

    python benchmarks/import_time.py [--runs 40]          # `import nvrx_ipc_fix`
    python benchmarks/import_time.py --pth [--runs 200]   # the installed .pth, on `python -c pass`

The default mode runs ``python -c pass`` and ``python -c "import nvrx_ipc_fix"`` alternately
in fresh interpreters of the running environment, with start-up activation off (the
package's import with activation, no NVRx imported). ``--pth`` builds the wheel, makes two
fresh venvs that differ only by it (both have wrapt and packaging), and runs ``python -c
pass`` in each alternately: the difference is what start-up activation costs every Python
process of an environment where the wheel is installed. Medians of wall-clock and CPU
(user + system) time, in ms; the machine's other load shows in both columns alike.
"""

import argparse
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from importlib import metadata

HEAVY = ("torch", "nvidia_resiliency_ext", "wrapt", "logging", "inspect", "dataclasses")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def timed(args, env=None):
    """Wall-clock and CPU seconds of one run of ``args``."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    subprocess.run(args, check=True, env=env)
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return wall, (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def compare(base, other, runs, env=None):
    """Run both commands alternately; medians and differences in ms."""
    timed(base, env), timed(other, env)  # warm the file cache and byte-code
    samples = [(timed(base, env), timed(other, env)) for _ in range(runs)]
    result = {}
    for i, kind in enumerate(("wall", "cpu")):
        a = statistics.median(s[0][i] for s in samples) * 1e3
        b = statistics.median(s[1][i] for s in samples) * 1e3
        result[kind] = {"base_ms": round(a, 1), "with_ms": round(b, 1), "added_ms": round(b - a, 1)}
    return result


def import_mode(runs):
    env = dict(os.environ, NVRX_IPC_FIX_AUTO="0")  # else the .pth has imported it already
    result = compare(
        [sys.executable, "-c", "pass"], [sys.executable, "-c", "import nvrx_ipc_fix"], runs, env
    )
    loaded = subprocess.run(
        [
            sys.executable,
            "-c",
            "import sys, json, nvrx_ipc_fix; print(json."
            f"dumps([m for m in {HEAVY!r} if m in sys.modules]))",
        ],
        check=True,
        capture_output=True,
        text=True,
        env=env,
    ).stdout.strip()
    result["heavy_modules_imported"] = json.loads(loaded)
    return result


def venv(path, *packages):
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", path], check=True)
    python = os.path.join(path, "bin", "python")
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "--python",
            python,
            "install",
            "--quiet",
            "--disable-pip-version-check",
            *packages,
        ],
        check=True,
    )
    return python


def pth_mode(runs):
    deps = [f"{name}=={metadata.version(name)}" for name in ("wrapt", "packaging")]
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run(
            [sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "-w", tmp, ROOT],
            check=True,
        )
        wheel = next(os.path.join(tmp, n) for n in os.listdir(tmp) if n.endswith(".whl"))
        base = venv(os.path.join(tmp, "base"), *deps)
        with_pth = venv(os.path.join(tmp, "with"), wheel, *deps)
        env = {k: v for k, v in os.environ.items() if not k.startswith("NVRX_IPC_FIX_")}
        result = compare([base, "-c", "pass"], [with_pth, "-c", "pass"], runs, env)
        probe = (
            "import sys, json; m = sys.modules.get('nvrx_ipc_fix'); print(json.dumps("
            f"[[h for h in {HEAVY!r} if h in sys.modules], m and m.status().source]))"
        )
        heavy, source = json.loads(
            subprocess.run(
                [with_pth, "-c", probe], check=True, capture_output=True, text=True
            ).stdout
        )
    result.update(source=source, heavy_modules_imported=heavy, deps=deps)
    return result


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument(
        "--pth",
        action="store_true",
        help="measure the installed .pth on `python -c pass` (two fresh venvs)",
    )
    parser.add_argument("--runs", type=int)
    args = parser.parse_args()
    runs = args.runs or (200 if args.pth else 40)
    result = pth_mode(runs) if args.pth else import_mode(runs)
    print(json.dumps({"python": platform.python_version(), "runs": runs, **result}))


if __name__ == "__main__":
    main()
