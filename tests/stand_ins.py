"""Stand-ins (``sys.modules`` entries) for the modules a real framework imports but this
CPU machine cannot: the one place the framework tests fake an import.

Each entry names a module and the attributes its importers take from it at import time;
each attribute is an empty class, so that annotations, ``isinstance`` checks and
subclassing still work. Nothing the tests run calls into them: a test that reached one
would fail on the empty class. The device itself is faked elsewhere
(``nvrx_ipc_fix.cli.fakecuda``).

SkyRL 0.4.0 (``skyrl.backends.skyrl_train.distributed.megatron.megatron_strategy``, whose
``MegatronStrategy.save_checkpoint``/``load_checkpoint`` the tests run for real): ``STAND_INS``.
megatron-bridge 0.6.2 with megatron-core 0.19.2 (``megatron.bridge.training.checkpointing``,
whose ``maybe_finalize_async_save`` tests/test_bridge.py runs for real): ``BRIDGE_STAND_INS``,
put in by ``install_for_bridge()``.
"""

import importlib.machinery
import importlib.util
import sys
import types

STAND_INS = {
    # heavy (tokenizers, hub client); SkyRL takes config and tokenizer classes from it for
    # annotations and for helpers that no save or load calls (strategy.py:11,
    # megatron_strategy.py:29, skyrl/utils/tok.py)
    "transformers": (
        "AutoConfig",
        "AutoProcessor",
        "AutoTokenizer",
        "GenerationConfig",
        "PreTrainedTokenizer",
        "PreTrainedTokenizerFast",
        "PretrainedConfig",
    ),
    # the Tinker API backend, imported by skyrl/backends/__init__.py:3: its pydantic models
    # need Python 3.12 (skyrl/tinker/types.py:137 uses typing.TypedDict; this machine has
    # 3.11 because PyPI has no CPU torch for 3.12)
    "skyrl.backends.backend": ("AbstractBackend",),
    # imports megatron-bridge (megatron_model_wrapper.py:8), which needs megatron-core 0.19
    # (the megatron env has 0.17.1: tests/doubles/README.md); megatron_strategy.py uses
    # MegatronModelWrapper only in annotations (the model the tests pass has the `actor_module`
    # list it reads)
    "skyrl.backends.skyrl_train.workers.megatron.megatron_model_wrapper": ("MegatronModelWrapper",),
}


BRIDGE_STAND_INS = {
    # NVIDIA Model Optimizer (quantization and distillation for NVIDIA GPUs):
    # megatron/bridge/training/checkpointing.py:56 takes its state savers, called only when a
    # model carries modelopt state
    "modelopt.torch.opt.plugins": (
        "restore_modelopt_state",
        "save_modelopt_state",
        "save_sharded_modelopt_state",
    ),
    # Transformer Engine (CUDA kernels): megatron/bridge/peft/lora_layers.py:20 imports it
    # unconditionally and names te.ops.Sequential in annotations (:111); no LoRA layer is built
    "transformer_engine.pytorch": ("GroupedLinear",),
    "transformer_engine.pytorch.ops": ("Sequential",),
    # heavy (pyarrow, pandas, an HTTP client): Bridge's SFT data builders take loaders from it
    # (megatron/bridge/data/datasets/gpt_sft.py:23), called only when data is built
    "datasets": ("builder", "concatenate_datasets", "load_dataset"),
    # heavy (s3fs, multi-storage-client, webdataset): the Energon data module
    # (megatron/bridge/data/energon/base_energon_datamodule.py:19), called only when data is built
    "megatron.energon": ("WorkerConfig", "get_savable_loader", "get_train_dataset"),
}


_MADE = set()  # the names of the stand-ins in sys.modules


def _module(name):
    """An empty package with a spec (``importlib.util.find_spec`` reads it). Where its top-level
    package cannot be imported here at all (``transformer_engine``), its missing parents are
    made the same way, each set as an attribute of the one above; a real parent
    (``megatron`` for ``megatron.energon``, ``skyrl.backends``) is left alone."""
    module = types.ModuleType(name, "stand-in: tests/stand_ins.py")
    module.__path__ = []
    module.__spec__ = importlib.machinery.ModuleSpec(name, None, is_package=True)
    sys.modules[name] = module
    parent, _, child = name.rpartition(".")
    if (
        parent
        and parent not in sys.modules
        and importlib.util.find_spec(name.partition(".")[0]) is None
    ):
        _module(parent)
    if parent in _MADE:
        setattr(sys.modules[parent], child, module)
    _MADE.add(name)
    return module


def install(stand_ins=STAND_INS):
    """Put every stand-in into ``sys.modules`` (idempotent)."""
    for name, attrs in stand_ins.items():
        if name in sys.modules:
            continue
        module = _module(name)
        for attr in attrs:
            setattr(module, attr, type(attr, (), {"__module__": name}))


def install_for_bridge():
    """What ``import megatron.bridge.training.checkpointing`` needs here, in this order:

    - ``typing.override`` (Python 3.12, PEP 698) is taken from typing_extensions, the same
      decorator backported: megatron-core 0.19.2 is a cp312 wheel and its
      ``megatron/training/models/gpt.py:5`` and ``hybrid.py:5`` import it from typing;
    - ``megatron.training`` (real, from megatron-core) is imported before any stand-in:
      megatron-core probes for Transformer Engine with try/import while it is imported
      (``megatron/core/utils.py``, ``megatron/core/extensions/transformer_engine.py``) and a
      Transformer Engine stand-in seen then would send it down the TE code paths (it asks for
      the ``transformer-engine`` distribution's version and fails); Bridge's own unconditional
      import comes after (``checkpointing.py:63`` → ``utils/common_utils.py:29`` imports
      ``megatron.training`` before ``peft/lora_layers.py:20``);
    - then ``BRIDGE_STAND_INS``.
    """
    import typing

    if not hasattr(typing, "override"):
        import typing_extensions

        typing.override = typing_extensions.override
    import megatron.training  # noqa: F401

    install(BRIDGE_STAND_INS)
