"""Files that order saves: a save's write (run inside NVRx's worker, or the process NVRx
forks for the save) waits for a file before it starts and makes one when it is done, so that
a test decides which of two saves in flight puts its results first by what it waits for,
never by how long the writes take.

``gated`` is a plain module function: pickled by reference in an ``AsyncRequest`` in place
of NVRx's ``async_fn``, with NVRx's own write function as its argument.
"""

import os
import time

WAIT_S = 60.0  # a gate never opened fails the save (or the test) after this long


def gated(gate, done, write, *args, **kwargs):
    """Wait until the file ``gate`` exists (if given), run ``write(*args, **kwargs)``, then
    make the file ``done`` (if given)."""
    if gate:
        wait_for(gate)
    result = write(*args, **kwargs)
    if done:
        open_gate(done)
    return result


def open_gate(path):
    """Make the file ``path``: what waits for it goes on."""
    with open(path, "w"):
        pass


def wait_for(path, limit=WAIT_S):
    """Until the file ``path`` exists; ``TimeoutError`` after ``limit`` seconds."""
    deadline = time.monotonic() + limit
    while not os.path.exists(path):
        if time.monotonic() > deadline:
            raise TimeoutError(f"{path} did not appear within {limit} s")
        time.sleep(0.01)
