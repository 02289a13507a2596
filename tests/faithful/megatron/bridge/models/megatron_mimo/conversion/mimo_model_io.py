"""Faithful copy of the binding at megatron-bridge 0.6.2
``megatron/bridge/models/megatron_mimo/conversion/mimo_model_io.py:23``."""

from megatron.bridge.training.checkpointing import maybe_finalize_async_save  # noqa: F401
