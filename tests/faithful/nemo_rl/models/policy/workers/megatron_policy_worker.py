"""Faithful copy of the async-checkpoint and offload methods of NeMo RL's
``MegatronPolicyWorkerImpl`` (``nemo_rl/models/policy/workers/megatron_policy_worker.py``,
commit 001759a9acf020907d76e61ffd27baa9c8ae9a90; see tests/faithful/README.md).

Verbatim: ``_async_checkpoint_cuda_cache_active``, ``_requires_nvrx_cuda_cache_release``,
``finalize_async_save`` (PR #3322). The offload methods keep NeMo RL's order (finalize
first where NeMo RL does, then move storage) with the memory prints, MXFP8/FP8 and
teacher-head handling elided and ``torch.randn(1).cuda()`` (an allocator wake-up) left
out; the storage movers ``move_model``/``move_optimizer`` are supplied by the test.
``prepare_for_lp_inference`` is the short form of the older version, which the current
one keeps: it never finalizes before moving the optimizer (NeMo RL #4183).
``prepare_for_training`` (where the model comes back for training) is from NeMo RL main
7ea279abfbeb698b092856d0dab61e7cf39bc909, verbatim but for its memory log line.
"""

import gc

import torch
from megatron.bridge.training.checkpointing import maybe_finalize_async_save
from nvidia_resiliency_ext.checkpointing.async_ckpt.filesystem_async import (
    FileSystemWriterAsync,
)


class MegatronPolicyWorkerImpl:
    _async_checkpoint_cuda_cache_active: bool = False

    def offload_before_refit(self):
        """Offload optimizer state and buffers that are safe to release."""
        self.finalize_async_save()
        self.model = self.move_model(self.model, "cpu", move_params=False, move_grads=True)
        if (
            hasattr(self, "optimizer")
            and self.optimizer is not None
            and not self.optimizer_cpu_offload
            and self.offload_optimizer_for_refit
        ):
            self.move_optimizer("cpu")
        gc.collect()
        torch.cuda.empty_cache()

    def offload_after_refit(self):
        """Offload as much as possible on the CPU."""
        self.finalize_async_save()
        self.model.eval()
        self.model = self.move_model(self.model, "cpu", move_params=True, move_grads=True)
        self.offload_before_refit()  # rerun the old offload function

    def prepare_for_lp_inference(self):
        self.model = self.move_model(self.model, "cuda", move_grads=False)
        self.model.eval()

        # offload grads to cpu
        self.model = self.move_model(
            self.model, "cpu", move_params=False, move_grads=True
        )  # get rid of grad buffers

        # offload optimizer to cpu
        if (
            hasattr(self, "optimizer")
            and self.optimizer is not None
            and not self.optimizer_cpu_offload
            and self.offload_optimizer_for_logprob
        ):
            self.move_optimizer("cpu")

        gc.collect()
        torch.cuda.empty_cache()

    def prepare_for_training(self, *args, **kwargs):
        # onload models and optimizer state to cuda
        self.model = self.move_model(
            self.model, "cuda", move_grads=True, move_params=True
        )
        self.model.train()

        # Training expects optimizer state on CUDA. Keep this unconditional rather
        # than trying to mirror every path that may have offloaded it to CPU.
        if (
            hasattr(self, "optimizer")
            and self.optimizer is not None
            and not self.optimizer_cpu_offload
        ):
            self.move_optimizer("cuda")

        if self.cfg["megatron_cfg"]["empty_unused_memory_level"] >= 1:
            torch.cuda.empty_cache()

    def _requires_nvrx_cuda_cache_release(self) -> bool:
        """Whether checkpoint finalization must also drop cached CUDA IPC handles."""
        ckpt_cfg = self.mcore_state.cfg.checkpoint
        generation_cfg = self.cfg.get("generation") or {}
        colocated_cfg = generation_cfg.get("colocated") or {}
        return bool(
            ckpt_cfg.async_save
            and getattr(ckpt_cfg, "use_persistent_ckpt_worker", False)
            and getattr(ckpt_cfg, "ckpt_assume_constant_structure", False)
            and not getattr(ckpt_cfg, "async_ckpt_use_cpu_shm", False)
            and colocated_cfg.get("enabled", False)
        )

    def finalize_async_save(self):
        """Finalize an async write and release unsafe colocated CUDA IPC caches.

        NVRx constant-structure saves cache CUDA tensor handles in the persistent
        writer. That is safe while model/optimizer storage stays fixed, but a
        colocated policy replaces that storage during CPU offload. In that case,
        close the completed writer and invalidate its training-side cache; NVRx
        starts a fresh persistent writer lazily for the next checkpoint.
        """
        release_cuda_cache = bool(
            self._async_checkpoint_cuda_cache_active
            and self._requires_nvrx_cuda_cache_release()
        )
        maybe_finalize_async_save(
            self.mcore_state,
            ckpt_cfg=self.mcore_state.cfg.checkpoint,
            blocking=True,
            terminate=release_cuda_cache,
        )
        if release_cuda_cache:
            FileSystemWriterAsync.cleanup_tensor_caches()
            gc.collect()
            torch.cuda.ipc_collect()
            torch.cuda.empty_cache()
            self._async_checkpoint_cuda_cache_active = False
