"""Test double of NeMo RL's ``MegatronValueWorkerImpl``
(``nemo_rl/models/value/workers/megatron_value_worker.py``, commit 0a5a7edaca95; main
7ea279abfbeb), written here: the storage movers the package patches. Facts modelled: none
finalizes a save first; ``prepare_for_inference`` brings the model back and moves grads off;
``finish_inference`` moves params off; ``finish_training`` moves params, grads and the
optimizer off; ``prepare_for_training`` moves model and optimizer back.
``move_model``/``move_optimizer`` come from the test (new storage)."""

from nemo_rl.models.moving import Moving


class MegatronValueWorkerImpl(Moving):
    def prepare_for_training(self):
        self._move("cuda", optimizer=True)

    def prepare_for_inference(self):
        self._move("cuda", grads=False)
        self._move("cpu", params=False)

    def finish_inference(self):
        self._move("cpu", grads=False)

    def finish_training(self):
        self._move("cpu", optimizer=True)
