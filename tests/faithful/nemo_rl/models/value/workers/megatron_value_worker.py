"""Faithful copy of the storage movers of NeMo RL's ``MegatronValueWorkerImpl``
(``nemo_rl/models/value/workers/megatron_value_worker.py``, commit
0a5a7edaca9581e56e7bb75a768af9120e67b3ac), verbatim but for ``move_model`` and
``move_optimizer``, which the test supplies. None of them finalizes a save first.
``prepare_for_training`` is from NeMo RL main 7ea279abfbeb698b092856d0dab61e7cf39bc909."""

import gc

import torch


class MegatronValueWorkerImpl:
    def prepare_for_training(self) -> None:
        """Move model and optimizer to CUDA for training."""
        self.model = self.move_model(
            self.model, "cuda", move_grads=True, move_params=True
        )
        self.model.train()

        if (
            hasattr(self, "optimizer")
            and self.optimizer is not None
            and not self.optimizer_cpu_offload
        ):
            self.move_optimizer("cuda")

        if self.cfg["megatron_cfg"]["empty_unused_memory_level"] >= 1:
            torch.cuda.empty_cache()

    def prepare_for_inference(self):
        """Prepare model for value inference."""
        self.model = self.move_model(self.model, "cuda", move_grads=False)
        self.model.eval()
        # Offload gradients
        self.model = self.move_model(
            self.model, "cpu", move_params=False, move_grads=True
        )
        gc.collect()
        torch.cuda.empty_cache()

    def finish_inference(self) -> None:
        """Offload model params to CPU after inference."""
        self.model = self.move_model(
            self.model, "cpu", move_params=True, move_grads=False
        )
        gc.collect()
        torch.cuda.empty_cache()

    def finish_training(self) -> None:
        """Offload model, gradients, and optimizer to CPU after training."""
        self.model = self.move_model(
            self.model, "cpu", move_params=True, move_grads=True
        )
        self.model.eval()
        if (
            hasattr(self, "optimizer")
            and self.optimizer is not None
            and not self.optimizer_cpu_offload
        ):
            self.move_optimizer("cpu")
        gc.collect()
        torch.cuda.empty_cache()
