"""Whether a temp directory is short enough for the driver's processes (``driver``,
``runner``): a multiprocessing manager's socket goes below it."""

import os

#: What multiprocessing adds below a temp directory for a manager's socket
#: (``pymp-XXXXXXXX/listener-XXXXXXXX``), whose whole path must stay under AF_UNIX's 108 bytes.
SOCKET_TAIL = 32


def fits(path):
    """Can ``path`` be a temp directory without making a manager's socket path too long?"""
    return len(os.fsencode(path)) + SOCKET_TAIL < 100
