"""Test double: megatron-bridge binds the name by from-import here
(``mimo_model_io.py:23``, 0.6.2 wheel), which is what the test needs of this module."""

from megatron.bridge.training.checkpointing import maybe_finalize_async_save  # noqa: F401
