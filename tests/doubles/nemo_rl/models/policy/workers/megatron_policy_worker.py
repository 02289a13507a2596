"""Test double of NeMo RL's ``MegatronPolicyWorkerImpl``
(``nemo_rl/models/policy/workers/megatron_policy_worker.py``), written here: the methods the
package patches, making the calls NeMo RL makes, in its order (../../../../README.md).

Facts modelled (NeMo RL commit 001759a9acf0, PR #3322 = e4b8f3e5e; main 7ea279abfbeb):
``offload_before_refit`` and ``offload_after_refit`` call ``self.finalize_async_save()``
first, then move storage to the CPU (main ``:3073-3080``, ``:3171-3177``; the latter
moves params and grads, then runs ``offload_before_refit``); ``prepare_for_lp_inference``
brings the model back, then moves grads and the optimizer off without finalizing (NeMo RL
#4183); ``prepare_for_training`` moves model and optimizer back. ``finalize_async_save``
(``:3379-3415``) finalizes with ``blocking=True`` and terminates the worker when
``_async_checkpoint_cuda_cache_active`` (set by ``save_checkpoint``, ``:3290-3294``) and
``_requires_nvrx_cuda_cache_release()`` (``:3365-3377``: async save, persistent worker,
constant structure, no CPU shm, colocated generation) both hold, then clears the writer's
tensor caches. ``move_model``/``move_optimizer`` come from the test (new storage).
"""

import torch
from megatron.bridge.training.checkpointing import maybe_finalize_async_save
from nemo_rl.models.moving import Moving
from nvidia_resiliency_ext.checkpointing.async_ckpt.filesystem_async import (
    FileSystemWriterAsync,
)


class MegatronPolicyWorkerImpl(Moving):
    _async_checkpoint_cuda_cache_active = False

    def offload_before_refit(self):
        self.finalize_async_save()
        self._move("cpu", params=False, optimizer="offload_optimizer_for_refit")

    def offload_after_refit(self):
        self.finalize_async_save()
        self._move("cpu")
        self.offload_before_refit()

    def prepare_for_lp_inference(self):
        self._move("cuda", grads=False)
        self._move("cpu", params=False, optimizer="offload_optimizer_for_logprob")

    def prepare_for_training(self, *args, **kwargs):
        self._move("cuda", optimizer=True)

    def _requires_nvrx_cuda_cache_release(self):
        ckpt = self.mcore_state.cfg.checkpoint
        colocated = (self.cfg.get("generation") or {}).get("colocated") or {}
        return bool(
            ckpt.async_save
            and ckpt.use_persistent_ckpt_worker
            and ckpt.ckpt_assume_constant_structure
            and not ckpt.async_ckpt_use_cpu_shm
            and colocated.get("enabled")
        )

    def finalize_async_save(self):
        release = bool(
            self._async_checkpoint_cuda_cache_active and self._requires_nvrx_cuda_cache_release()
        )
        maybe_finalize_async_save(
            self.mcore_state,
            ckpt_cfg=self.mcore_state.cfg.checkpoint,
            blocking=True,
            terminate=release,
        )
        if release:
            FileSystemWriterAsync.cleanup_tensor_caches()
            torch.cuda.ipc_collect()
            self._async_checkpoint_cuda_cache_active = False
