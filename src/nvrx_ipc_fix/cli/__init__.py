"""``python -m nvrx_ipc_fix``: the command line (``main``) and its sub-commands."""
