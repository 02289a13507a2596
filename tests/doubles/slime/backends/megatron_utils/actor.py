"""Test double of slime's ``MegatronTrainRayActor`` (THUDM/slime, commit 624b824a898a,
2026-08-21), written here: the calls ``save_model`` makes, in slime's order.

Facts modelled: ``slime/backends/megatron_utils/arguments.py:160-161`` sets
``args.use_persistent_ckpt_worker = True`` and ``args.ckpt_assume_constant_structure = True``
(so Megatron's NVRx queue is persistent and its writer caches IPC handles);
``actor.py:571-596`` ``save_model(rollout_id, force_sync=False)``: with ``offload_train``,
``self.wake_up()``; with ``async_save``, ``maybe_finalize_async_save(blocking=True)``
imported from ``megatron.training.async_utils`` inside the method; ``save(...)``
(``model.py:946``, Megatron's ``save_checkpoint``); with ``force_sync``, finalize again;
then, with ``offload_train``, ``self.sleep()`` (``actor.py:206``: ``torch_memory_saver.pause()``),
while the async save may still be in flight. ``wake_up`` (``actor.py:225``) resumes.
``save``, ``pause`` and ``resume`` come from the test.
"""


class MegatronTrainRayActor:
    def sleep(self):
        self.pause()

    def wake_up(self):
        self.resume()

    def save_model(self, rollout_id, force_sync=False):
        if self.args.offload_train:
            self.wake_up()
        if self.args.async_save:
            from megatron.training.async_utils import maybe_finalize_async_save

            maybe_finalize_async_save(blocking=True)
        self.save(rollout_id)
        if force_sync and self.args.async_save:
            maybe_finalize_async_save(blocking=True)
        if self.args.offload_train:
            self.sleep()
