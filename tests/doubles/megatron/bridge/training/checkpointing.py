"""Test double of megatron-bridge's ``megatron.bridge.training.checkpointing`` (written here;
the real module cannot be imported on this machine: ../../../README.md).

It has the one function the package patches there, with the signature and the behaviour
megatron-bridge 0.6.2 has (wheel ``checkpointing.py:401-427``, tag v0.6.0; main 067f987df
``:417-443``): nothing unless ``ckpt_cfg.async_save``; else the queue in
``global_state.async_calls_queue`` is finalized with ``blocking`` (collectives: default
``no_dist``), then, with ``terminate``, closed.
"""


def maybe_finalize_async_save(global_state, ckpt_cfg, blocking=False, terminate=False):
    queue = global_state.async_calls_queue if ckpt_cfg.async_save else None
    if queue is not None:
        queue.maybe_finalize_async_calls(blocking)
        if terminate:
            queue.close()
