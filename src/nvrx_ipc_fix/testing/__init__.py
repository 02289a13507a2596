"""The harness that drives the real NVRx worker for the demo, ``selftest``, the tests and
the benchmarks: ``scenario`` (and its ``scenario_runner``), the CUDA stand-in ``fakecuda`` and
the worker fault injectors ``faults``. Nothing on the activation path imports it. Here:
``fits``, which the scenario and its runner both ask."""

import os

#: What multiprocessing adds below a temp directory for a manager's socket
#: (``pymp-XXXXXXXX/listener-XXXXXXXX``), whose whole path must stay under AF_UNIX's 108 bytes.
SOCKET_TAIL = 32


def fits(path):
    """Can ``path`` be a temp directory without making a manager's socket path too long?"""
    return len(os.fsencode(path)) + SOCKET_TAIL < 100
