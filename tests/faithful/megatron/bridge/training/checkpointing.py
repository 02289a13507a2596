"""Faithful copy of megatron-bridge 0.6.2 ``megatron/bridge/training/checkpointing.py``
lines 401-442 (see ../../../README.md). Only the imports differ."""

from typing import Any as CheckpointConfig  # bridge: megatron.bridge.training.config
from typing import Any as GlobalState  # bridge: megatron.bridge.training.state


def print_rank_0(message):  # bridge: megatron.bridge.utils.common_utils.print_rank_0
    print(message, flush=True)


def maybe_finalize_async_save(
    global_state: GlobalState, ckpt_cfg: CheckpointConfig, blocking: bool = False, terminate: bool = False
) -> None:
    """Finalizes active async save calls.

    Args:
        global_state: The global training state containing the async calls queue.
        ckpt_cfg (CheckpointConfig): The checkpoint configuration.
        blocking (bool, optional): if True, will wait until all active requests
            are done. Otherwise, finalizes only the async request that already
            finished. Defaults to False.
        terminate (bool, optional): if True, the asynchronous queue will
                be closed as the last action of this function.
    """
    if not ckpt_cfg.async_save:
        return

    async_queue = global_state.async_calls_queue

    if blocking and not is_empty_async_queue(global_state):
        print_rank_0("Unfinalized async checkpoint saves. Finalizing them synchronously now.")

    if async_queue is not None:
        async_queue.maybe_finalize_async_calls(blocking)

    if terminate and async_queue is not None:
        async_queue.close()


def is_empty_async_queue(global_state: GlobalState) -> bool:
    """Check if async calls queue is empty. This result is consistent across ranks.

    Args:
        global_state: The global training state containing the async calls queue.

    Returns:
        bool: True if there is no in-flight async checkpoint work.
    """
    async_queue = global_state.async_calls_queue
    if async_queue is not None and async_queue.get_num_unfinalized_calls() > 0:
        return False
    return True
