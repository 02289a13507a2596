"""Functions that run inside the NVRx checkpoint worker.

They travel in an ``AsyncRequest`` and are pickled by reference (module and name), so
the worker imports this module to run them. That import activates the package in the
worker too, which is harmless: nothing there closes workers or prepares writes.
"""

import gc
import importlib
import json
import os
import sys

CORE = "nvidia_resiliency_ext.checkpointing.async_ckpt.core"


def drop_cache():
    """Drop every cached tensor, so the worker releases its CUDA IPC mappings."""
    cache = sys.modules[CORE].PersistentAsyncCaller._worker_data_cache
    cache.clear()
    gc.collect()
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized():
        torch.cuda.empty_cache()


def warm_up(modules):
    """Import ``modules`` (what the saves will unpickle here), so that the first save to a
    prewarmed worker does not wait for them; a failure is left for that save to meet."""
    for name in modules:
        try:
            importlib.import_module(name)
        except Exception:
            pass


def describe_cache(path):
    """Write what the worker holds to ``path`` as JSON: pid, cached keys, mapped
    shared-memory segments (the CPU stand-in's equivalent of IPC mappings), and the
    bytes of CUDA memory the worker has opened from other processes (None without CUDA)."""
    cache = sys.modules[CORE].PersistentAsyncCaller._worker_data_cache
    with open("/proc/self/maps") as maps:
        shm = {line.split()[-2] if line.rstrip().endswith("(deleted)") else line.split()[-1]
               for line in maps if "/dev/shm/" in line or "torch_" in line}
    with open(path, "w") as out:
        json.dump({"pid": os.getpid(), "keys": sorted(cache), "shm_segments": len(shm)}, out)
