"""Run Megatron-LM PR #6971's failure tests against released megatron-core with this
package active, on a GPU machine (megatron-core's finalize and its spawned worker use CUDA).

    python benchmarks/pr6971.py PATH/test_async_worker_failure.py

PATH is ``tests/unit_tests/dist_checkpointing/test_async_worker_failure.py`` of the PR's
branch (commit ``1156462cdb``), fetched by you: this project ships none of its code. The
file runs unchanged but for one import: released megatron-core has no
``PersistentAsyncWorkerError``, so the test imports this package's (the same class under that
name). ``tests.unit_tests.test_utilities.Utils``, Megatron's test helper, is stood in for by
a world of one rank on NCCL. Exits with pytest's status.
"""

import os
import subprocess
import sys
import tempfile
import textwrap

UPSTREAM_IMPORT = "    PersistentAsyncWorkerError,\n"
UTILS = '''
    """Stands in for Megatron's test helper: one rank on NCCL, model parallel 1 x 1."""
    import os

    import torch


    class Utils:
        rank = 0
        world_size = 1

        @staticmethod
        def initialize_model_parallel(tensor_model_parallel_size=1,
                                      pipeline_model_parallel_size=1):
            from megatron.core import parallel_state

            if not torch.distributed.is_initialized():
                os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
                os.environ.setdefault("MASTER_PORT", "29517")
                torch.cuda.set_device(0)
                torch.distributed.init_process_group("nccl", rank=0, world_size=1)
            parallel_state.initialize_model_parallel(tensor_model_parallel_size,
                                                     pipeline_model_parallel_size)

        @staticmethod
        def destroy_model_parallel():
            from megatron.core import parallel_state

            parallel_state.destroy_model_parallel()
'''


def main(argv):
    if len(argv) != 1:
        sys.exit(__doc__)
    with open(argv[0]) as found:
        source = found.read()
    if UPSTREAM_IMPORT not in source:
        sys.exit(f"{argv[0]}: no '{UPSTREAM_IMPORT.strip()}' import to stand in for")
    source = source.replace(UPSTREAM_IMPORT, "").replace(
        "from tests.unit_tests.test_utilities import Utils",
        "from tests.unit_tests.test_utilities import Utils\n"
        "from nvrx_ipc_fix import PersistentAsyncWorkerError  # not in released megatron-core",
    )
    with tempfile.TemporaryDirectory(prefix="pr6971-") as root:
        helpers = os.path.join(root, "tests", "unit_tests")
        os.makedirs(helpers)
        for package in (os.path.join(root, "tests"), helpers):
            open(os.path.join(package, "__init__.py"), "w").close()
        with open(os.path.join(helpers, "test_utilities.py"), "w") as out:
            out.write(textwrap.dedent(UTILS))
        with open(os.path.join(root, "test_async_worker_failure.py"), "w") as out:
            out.write(source)
        env = dict(
            os.environ,
            PYTHONPATH=os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")])),
        )
        return subprocess.call(
            [
                sys.executable,
                "-m",
                "pytest",
                "-v",
                "-p",
                "no:cacheprovider",
                "test_async_worker_failure.py",
            ],
            cwd=root,
            env=env,
            timeout=540,
        )


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
