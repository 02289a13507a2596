"""What ``stale_guard`` adds to one cached save, per tensor count, without a whole save's noise.

    PYTHONPATH=src:$NVRX python benchmarks/guard_cost.py [--tensors 16,4096]

On NVRx 0.6.0 the guard runs before every ``prepare_write_data``: it lists the plan's tensor
items, computes NVRx's cache key from them and checks each cached tensor's storage (weak
reference and data pointer). This times that work, with ``timeit``, on a real
``torch.distributed.checkpoint`` save plan of N CPU tensors whose key NVRx has cached and
whose storages have not moved (the path of every ordinary save), against what NVRx itself
does with the same items on that path: its key and its ``resolve_data`` of every tensor.
Prints milliseconds per save.
"""

import argparse
import sys
import timeit
from types import SimpleNamespace


def plan_of(count):
    """A finished local save plan and its planner for ``count`` small tensors."""
    import torch
    from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

    state = {f"layer{i}.weight": torch.zeros(64) for i in range(count)}
    planner = DefaultSavePlanner()
    planner.set_up_planner(state, is_coordinator=True)
    plans, _ = planner.create_global_plan([planner.create_local_plan()])
    return planner.finish_plan(plans[0]), planner


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tensors", default="16,4096")
    parser.add_argument("--seconds", type=float, default=2.0, help="per case, about")
    args = parser.parse_args()
    from nvrx_ipc_fix import _stale_guard
    from nvrx_ipc_fix._detect import FS

    __import__(FS)
    fs = sys.modules[FS]
    for count in map(int, args.tensors.split(",")):
        plan, planner = plan_of(count)
        items = _stale_guard._tensor_items(plan)
        key = fs._compute_data_structure_key_from_plan(items)
        fs.FileSystemWriterAsync._cached_identifiers.add(key)
        sent = SimpleNamespace(consistent_data_identifier=SimpleNamespace(key=key),
                               cached_tensor_data=(items, [planner.resolve_data(item)
                                                           for item in items]))
        _stale_guard._record_sent(sent, items)  # what the guard keeps after a full send

        def guard():
            _stale_guard._invalidate_if_moved(None, _stale_guard._tensor_items(plan), planner)

        def nvrx_own():
            fs._compute_data_structure_key_from_plan(items)
            [planner.resolve_data(item) for item in items]

        for name, call in (("stale_guard", guard), ("NVRx's key and resolve_data", nvrx_own)):
            number = max(1, int(args.seconds / 5 / max(timeit.timeit(call, number=1), 1e-6)))
            best = min(timeit.repeat(call, number=number, repeat=5)) / number
            print(f"{count:>6} tensors  {name:<30} {best * 1e3:8.3f} ms per save")
        assert key in fs.FileSystemWriterAsync._cached_identifiers, "the guard saw a move"
    return 0


if __name__ == "__main__":
    sys.exit(main())
