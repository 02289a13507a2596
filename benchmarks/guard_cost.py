"""What ``stale_guard`` adds to NVRx 0.6.0's ``prepare_write_data`` on a cached save.

    PYTHONPATH=src:$NVRX python benchmarks/guard_cost.py [--tensors 16,4096] [--bytes 2g]

Builds a real ``torch.distributed.checkpoint`` save plan of N tensors (``--bytes`` in all:
CUDA tensors where CUDA is, else the CPU stand-in ``nvrx_ipc_fix.cli.fakecuda``), lets NVRx's
``FileSystemWriterAsync`` cache its key (a first call, through the guard), then times with
``timeit`` the path of every ordinary save, where NVRx reuses the worker's cache:
``prepare_write_data`` bare and through the guard's wrapper, in turn, ten rounds. The median
of the rounds' differences is what the guard costs a save; compare it with a warm save's
blocking time at the same layout (``gpu_lifecycle.py --overhead``, the same machine). Also
times the call after a storage move, where the guard makes NVRx send the tensors again.
Prints milliseconds per call.
"""

import argparse
import functools
import statistics
import sys
import tempfile
import timeit

UNITS = {"k": 2**10, "m": 2**20, "g": 2**30}


def plan_of(state):
    """A finished local save plan of ``state`` and its planner."""
    from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

    planner = DefaultSavePlanner()
    planner.set_up_planner(state, is_coordinator=True)
    plans, _ = planner.create_global_plan([planner.create_local_plan()])
    return planner.finish_plan(plans[0]), planner


def tensors(count, nbytes):
    import torch

    numel = max(1, nbytes // 4 // count)
    if torch.cuda.is_available():
        return [torch.zeros(numel, device="cuda") for _ in range(count)], "cuda"
    from nvrx_ipc_fix.cli import fakecuda

    fakecuda.install()
    return [fakecuda.on_fake_device(torch.zeros(numel)) for _ in range(count)], "cpu stand-in"


def calls_per_round(call, seconds):
    return max(1, int(seconds / 10 / max(timeit.timeit(call, number=1), 1e-6)))


def interleaved_ms(bare, guarded, seconds, rounds=10):
    """Best per-call time of each, and the median of their per-round differences: the
    two run in turn, so that what else the machine does falls on both alike."""
    number = calls_per_round(bare, seconds)
    times = [
        (
            timeit.timeit(bare, number=number) / number * 1e3,
            timeit.timeit(guarded, number=number) / number * 1e3,
        )
        for _ in range(rounds)
    ]
    return (
        min(t[0] for t in times),
        min(t[1] for t in times),
        statistics.median(t[1] - t[0] for t in times),
    )


def one_case(count, nbytes, seconds, writer_class, cached):
    """One tensor count's rows; its tensors, plan and writer go when it returns."""
    from nvrx_ipc_fix.fixes import stale_guard as _stale_guard

    data, device = tensors(count, nbytes)
    plan, planner = plan_of({f"layer{i}.weight": t for i, t in enumerate(data)})
    writer = writer_class(tempfile.mkdtemp(), use_cached_data_structure=True)
    prepare = functools.partial(writer_class.prepare_write_data, writer)

    def bare():
        return prepare(plan, planner)

    def guarded():
        return _stale_guard.prepare_write_data_wrapper(prepare, writer, (plan, planner), {})

    guarded()  # the first save: NVRx caches the key, the guard records what was sent
    assert writer.cached_tensor_data is not None and cached
    guarded()
    assert writer.cached_tensor_data is None, "not the reuse path"
    alone, with_guard, added = interleaved_ms(bare, guarded, seconds)
    assert writer.cached_tensor_data is None, "the guard saw a move"

    def after_move():
        data[0].set_(data[0].clone())  # new storage, as an offload and onload gives it
        guarded()
        assert writer.cached_tensor_data is not None, "the guard missed a move"

    number = calls_per_round(after_move, seconds)
    moved = min(timeit.repeat(after_move, number=number, repeat=5)) / number * 1e3
    rows = (
        ("NVRx alone (best)", alone),
        ("with stale_guard (best)", with_guard),
        ("stale_guard adds (median)", added),
        ("the save after a move (best)", moved),
    )
    for name, ms in rows:
        print(f"{count:>6} tensors  {device:<12}  {name:<30} {ms:9.3f} ms")
    cached.clear()


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tensors", default="16,4096")
    parser.add_argument("--bytes", default="2g", help="all tensors together, e.g. 2g, 64m")
    parser.add_argument("--seconds", type=float, default=2.0, help="per case, about")
    args = parser.parse_args()
    nbytes = int(args.bytes[:-1]) * UNITS[args.bytes[-1].lower()]
    import nvrx_ipc_fix
    from nvrx_ipc_fix.core.detect import FS

    nvrx_ipc_fix.deactivate()  # NVRx's own prepare_write_data, whatever activated the package
    __import__(FS)
    writer_class = sys.modules[FS].FileSystemWriterAsync
    cached = writer_class._cached_identifiers
    for count in map(int, args.tensors.split(",")):
        one_case(count, nbytes, args.seconds, writer_class, cached)
    return 0


if __name__ == "__main__":
    sys.exit(main())
