"""The standby's last preload (``worker.standby``): what its server held once the modules before
it were imported, taken as this module is imported there, for the readiness probe, a process
forked from the server, to report. Later imports in the probe (``__main__``, as every child
of a forkserver imports it) do not count. Standard library only."""

import os
import sys
import threading

SERVER = os.getpid()  # where this module was imported: the standby, if it preloaded it
IMPORTED = frozenset(sys.modules)
#: Python threads: a fork keeps only the thread that forks, so a lock another one held (the
#: import lock, a logging handler's) stays held in the child. Native pools that run no
#: Python (OpenBLAS's, which numpy starts as torch imports it) handle the fork themselves.
THREADS = threading.active_count()
CUDA = "torch" in sys.modules and bool(sys.modules["torch"].cuda.is_initialized())


def report(answer, modules):
    """In the probe: send, on the connection ``answer``, the server's Python threads, whether
    it had initialized CUDA, and which of ``modules`` it had not imported (all of them if this
    module was not among them)."""
    preloaded = SERVER == os.getppid()
    answer.send(
        {
            "threads": THREADS,
            "cuda": CUDA,
            "missing": [m for m in modules if not preloaded or m not in IMPORTED],
        }
    )
    answer.close()
