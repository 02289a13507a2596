"""Stand-ins (``sys.modules`` entries) for the modules a real framework imports but this
CPU machine cannot: the one place the framework tests fake an import.

Each entry names a module and the attributes its importers take from it at import time;
each attribute is an empty class, so that annotations, ``isinstance`` checks and
subclassing still work. Nothing the tests run calls into them: a test that reached one
would fail on the empty class. The device itself is faked elsewhere
(``nvrx_ipc_fix.testing.fakecuda``).

SkyRL 0.4.0 (``skyrl.backends.skyrl_train.distributed.megatron.megatron_strategy``, whose
``MegatronStrategy.save_checkpoint``/``load_checkpoint`` the tests run for real):
"""

import sys
import types

STAND_INS = {
    # heavy (tokenizers, hub client); SkyRL takes config and tokenizer classes from it for
    # annotations and for helpers that no save or load calls (strategy.py:11,
    # megatron_strategy.py:29, skyrl/utils/tok.py)
    "transformers": ("AutoConfig", "AutoProcessor", "AutoTokenizer", "GenerationConfig",
                     "PreTrainedTokenizer", "PreTrainedTokenizerFast", "PretrainedConfig"),
    # the Tinker API backend, imported by skyrl/backends/__init__.py:3: its pydantic models
    # need Python 3.12 (skyrl/tinker/types.py:137 uses typing.TypedDict; this machine has
    # 3.11 because PyPI has no CPU torch for 3.12)
    "skyrl.backends.backend": ("AbstractBackend",),
    # imports megatron-bridge (megatron_model_wrapper.py:8), which cannot be imported here
    # (tests/doubles/README.md); megatron_strategy.py uses MegatronModelWrapper only in
    # annotations (the model the tests pass has the `actor_module` list it reads)
    "skyrl.backends.skyrl_train.workers.megatron.megatron_model_wrapper": (
        "MegatronModelWrapper",),
}


def install():
    """Put every stand-in into ``sys.modules`` (idempotent)."""
    for name, attrs in STAND_INS.items():
        if name in sys.modules:
            continue
        module = types.ModuleType(name, "stand-in: tests/stand_ins.py")
        for attr in attrs:
            setattr(module, attr, type(attr, (), {"__module__": name}))
        sys.modules[name] = module
