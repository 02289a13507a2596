"""A CPU stand-in for CUDA IPC, to drive NVRx's worker cache on a machine without a GPU.

This and ``fakedriver`` (the CUDA driver's process checkpoint API) are the only fakes in the
tests and the demo, and they fake only the device:

* ``FakeCudaTensor`` reports ``cuda:0`` in the trainer process and its real CPU device in
  any other process. NVRx therefore puts it in its "GPU" bucket and caches it. Pickled to
  the spawned worker, its storage moves to shared memory, which the worker keeps mapped
  exactly as it keeps a CUDA IPC mapping: the worker reads the trainer's live storage,
  and an abandoned storage stays alive in the worker (so stale data reproduces).
* NVRx's finalize and ``sync_all_async_calls`` build their flag tensors on
  ``torch.cuda.current_device()``; ``install()`` points that at the CPU in the trainer,
  where a gloo process group all-reduces them.
* Loading a checkpoint the worker wrote needs ``FakeCudaTensor`` among torch's safe globals.
* megatron-core's worker sets a CUDA device before anything else: ``install(forked_worker=True)``
  makes that harmless in a worker forked from the trainer (the scenario forks it there).
* A prewarmed worker imports this module before it is ready (``install`` adds it to
  ``worker.inside.WORKER_IMPORTS``) and pins host memory ahead of its first save
  (``worker.inside.pin_host``); page-locked memory is the CUDA driver's, so here ``pinned``
  stands in with plain memory (``worker.inside.pin_without_cuda``).
* NVRx 0.4.1 and 0.5.0 call ``torch.cuda.synchronize()`` in the worker after every copy,
  and NeMo RL's cleanup calls ``torch.cuda.ipc_collect()``; without CUDA there is nothing
  to wait for or collect, so importing this module (the worker does, to unpickle the
  tensors) makes both no-ops when CUDA is not available.

The worker must use ``AsyncCallsQueue(cpu_shm_mode=True)`` where that exists, so that it
does not initialise CUDA; the writer still takes the GPU IPC path, and ``mark_queue``
tells ``release()`` so (``worker.release.fake_device_queues``; it leaves real CPU-shm queues
alone).
"""

import os

import torch

from ..worker import inside as _worker

_trainer_pid = None

if not torch.cuda.is_available():
    torch.cuda.synchronize = lambda device=None: None
    torch.cuda.ipc_collect = lambda: None


class FakeCudaTensor(torch.Tensor):
    """A CPU tensor that says it is on ``cuda:0`` in the trainer process."""

    @property
    def device(self):
        real = torch.Tensor.device.__get__(self)
        if os.getpid() == _trainer_pid and real.type == "cpu":
            return torch.device("cuda", 0)
        return real


def install(forked_worker=False):
    """Make this process the trainer for ``FakeCudaTensor`` (idempotent).

    ``forked_worker``: megatron-core's worker calls ``torch.cuda.set_device(rank %
    torch.cuda.device_count())`` first thing; for a worker forked from this process, make
    both harmless (one "device", setting it does nothing)."""
    global _trainer_pid
    _trainer_pid = os.getpid()
    if __name__ not in _worker.WORKER_IMPORTS:  # a prewarmed worker unpickles its tensors
        _worker.WORKER_IMPORTS.append(__name__)
    torch.cuda.current_device = lambda: "cpu"
    torch.serialization.add_safe_globals([FakeCudaTensor])
    if forked_worker:
        torch.cuda.device_count = lambda: 1
        torch.cuda.set_device = lambda device: None


def pinned(size):
    """Stands in for ``torch.empty(size, dtype=torch.uint8, pin_memory=True)``."""
    return torch.empty(size, dtype=torch.uint8)


if not torch.cuda.is_available():
    _worker.pin_without_cuda = pinned


def on_fake_device(tensor):
    """``tensor`` (a CPU tensor) as a ``FakeCudaTensor`` sharing its storage."""
    return tensor.as_subclass(FakeCudaTensor)


def mark_queue(queue):
    """``queue``'s CPU-shm flag only keeps CUDA out of the worker (see module doc): release
    it as a queue that holds IPC handles."""
    from ..worker.release import fake_device_queues

    fake_device_queues.add(queue)
