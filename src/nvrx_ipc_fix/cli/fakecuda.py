"""A CPU stand-in for CUDA IPC, to drive NVRx's worker cache on a machine without a GPU.

The demo's: it ships in the wheel for ``python -m nvrx_ipc_fix demo``, whose trainer
(``cli.driver``) installs it where there is no GPU; the tests use it through that driver.
Nothing else of the package imports it: without it, the hooks it sets are unused
(``worker.inside.pin_without_cuda`` is ``None``, ``worker.release.fake_device_queues`` empty,
``worker.inside.WORKER_IMPORTS`` holds NVRx's writer alone). This and ``fakedriver`` (the
CUDA driver's process checkpoint API, the tests' own, not shipped) are the only fakes in the
tests and the demo, and they fake only the device:

* ``FakeCudaTensor`` reports ``cuda:0`` in the trainer process and its real CPU device in
  any other process. NVRx therefore puts it in its "GPU" bucket and caches it. Its storage
  is born in shared memory (``on_fake_device``), so that, as a CUDA tensor sent over IPC,
  it does not move when it is pickled to the worker: the worker maps the very storage the
  trainer writes, and keeps it mapped as it keeps a CUDA IPC mapping (an abandoned
  storage stays alive in the worker, so stale data reproduces).
* A storage sent to another process is not freed for reuse while a process started from
  the trainer still maps it, however the trainer drops it: torch keeps a CUDA block sent
  over IPC (``CudaIPCSentDataLimbo``) until its receiver released it. Without this, a new
  tensor could be born at the address of one the worker still reads, and NVRx 0.7.0's
  data-pointer check would take it for the storage it cached. The storages are forgotten
  (``collect``) when a tensor is born and at ``torch.cuda.ipc_collect()``, once no such
  process maps them (``/proc/<pid>/maps``). Shared memory does not grow back in place after
  ``storage.resize_(0)`` as a GPU's does (torch crashes): give such a tensor private memory
  first (``t.set_(t.clone())``). Where it still differs: NVRx's worker copies a CUDA tensor
  to the host before it writes (its preload, inside the save's schedule), but a stand-in
  tensor is on the host already, so the worker writes from the live storage: a value the
  trainer writes after the schedule can reach that checkpoint (the tests finalize first).
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
* NVRx 0.4.1 and 0.5.0 call ``torch.cuda.synchronize()`` in the worker after every copy:
  without CUDA there is nothing to wait for, so importing this module (the worker does, to
  unpickle the tensors) makes it a no-op when CUDA is not available, and
  ``torch.cuda.ipc_collect()`` (NeMo RL's cleanup calls it) ``collect``.

The worker must use ``AsyncCallsQueue(cpu_shm_mode=True)`` where that exists, so that it
does not initialise CUDA; the writer still takes the GPU IPC path, and ``mark_queue``
tells ``release()`` so (``worker.release.fake_device_queues``; it leaves real CPU-shm queues
alone).
"""

import os
import threading

import torch

from ..worker import inside as _worker

_trainer_pid = None
_sent: dict[int, torch.UntypedStorage] = {}  # data_ptr -> a storage the trainer sent
_sent_lock = threading.Lock()  # pickling runs in a queue's feeder thread


class FakeCudaTensor(torch.Tensor):
    """A CPU tensor that says it is on ``cuda:0`` in the trainer process."""

    @property
    def device(self):
        real = torch.Tensor.device.__get__(self)
        if os.getpid() == _trainer_pid and real.type == "cpu":
            return torch.device("cuda", 0)
        return real

    def __reduce_ex__(self, protocol):
        """Pickled in the trainer (sent to another process): keep its storage (``collect``)."""
        if os.getpid() == _trainer_pid:
            storage = self.untyped_storage()
            if storage.data_ptr():
                with _sent_lock:
                    _sent[storage.data_ptr()] = storage
        return super().__reduce_ex__(protocol)


def collect():
    """Forget the sent storages that no process started from the trainer maps any more: once
    the trainer drops one too, its memory is free for a new tensor (``torch.cuda.ipc_collect()``
    frees a CUDA block its receiver released)."""
    if os.getpid() != _trainer_pid or not _sent:
        return
    with _sent_lock:
        mapped, files = _mapped_by_descendants(), _shm_files(os.getpid())
        for ptr in list(_sent):
            inode = next((i for (start, end), i in files.items() if start <= ptr < end), None)
            if inode not in mapped:
                del _sent[ptr]


def _shm_files(pid):
    """``{(start, end): inode}`` of the shared-memory files ``pid`` maps (none if it is gone)."""
    found = {}
    try:
        with open(f"/proc/{pid}/maps") as maps:
            for line in maps:
                if "/dev/shm/" in line:
                    span, _, _, _, inode = line.split(None, 5)[:5]
                    start, end = span.split("-")
                    found[int(start, 16), int(end, 16)] = int(inode)
    except OSError:
        pass
    return found


def _mapped_by_descendants():
    """The inodes of the shared-memory files that the processes started from this one (its
    children, theirs, ...) map."""
    from ..worker.guardian_process import children

    inodes, look, seen = set(), children(os.getpid()), set()
    while look:
        pid = look.pop()
        if pid not in seen:
            seen.add(pid)
            look += children(pid)
            inodes.update(_shm_files(pid).values())
    return inodes


if not torch.cuda.is_available():
    torch.cuda.synchronize = lambda device=None: None
    torch.cuda.ipc_collect = collect


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
    """``tensor`` (a CPU tensor, just made: its storage moves into shared memory now) as a
    ``FakeCudaTensor`` sharing its storage."""
    collect()
    return tensor.share_memory_().as_subclass(FakeCudaTensor)


def mark_queue(queue):
    """``queue``'s CPU-shm flag only keeps CUDA out of the worker (see module doc): release
    it as a queue that holds IPC handles."""
    from ..worker.release import fake_device_queues

    fake_device_queues.add(queue)
