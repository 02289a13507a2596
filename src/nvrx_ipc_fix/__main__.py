"""``python -m nvrx_ipc_fix``: the command line, in ``cli/main.py``."""

import sys

from .cli.main import _run

if __name__ == "__main__":
    sys.exit(_run())
