"""Where a process waits, as ``"<file>:<function>"`` of each frame, innermost last: the
main thread of this process (``main``), or the current thread of another one from the
traceback that ``faulthandler`` wrote at a signal (``dumped``); whether a thread is inside a
function (``in_frame``: a race test waits until its other thread stands where it wants it).
A test that says a wait never ends names the wait, not only the time it waited. Standard
library only."""

import os
import sys
import threading
import traceback


def main():
    """This process's main thread's frames."""
    frame = sys._current_frames().get(threading.main_thread().ident)
    return (
        []
        if frame is None
        else [
            f"{os.path.basename(entry.filename)}:{entry.name}"
            for entry in traceback.extract_stack(frame)
        ]
    )


def dumped(text):
    """The current thread's frames in ``faulthandler``'s dump within ``text`` (a stderr)."""
    frames, current = [], False
    for line in text.splitlines():
        line = line.strip()
        if line.startswith(("Current thread", "Thread ")):
            current = line.startswith("Current thread")
        elif current and line.startswith('File "'):
            path, _, function = line[len('File "') :].partition('", line ')
            frames.append(f"{os.path.basename(path)}:{function.partition(' in ')[2]}")
    return frames[::-1]


def in_frame(thread, name):
    """Is ``thread`` now inside a function named ``name`` (any frame of its stack)?"""
    frame = sys._current_frames().get(thread.ident)
    while frame is not None:
        if frame.f_code.co_name == name:
            return True
        frame = frame.f_back
    return False
