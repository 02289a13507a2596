"""Where a process waits, as ``"<file>:<function>"`` of each frame, innermost last: the
main thread of this process (``main``), or the current thread of another one from the
traceback that ``faulthandler`` wrote at a signal (``dumped``). A test that says a wait never
ends names the wait, not only the time it waited. Standard library only."""

import os
import sys
import threading
import traceback


def main():
    """This process's main thread's frames."""
    frame = sys._current_frames().get(threading.main_thread().ident)
    return [] if frame is None else [f"{os.path.basename(entry.filename)}:{entry.name}"
                                     for entry in traceback.extract_stack(frame)]


def dumped(text):
    """The current thread's frames in ``faulthandler``'s dump within ``text`` (a stderr)."""
    frames, current = [], False
    for line in text.splitlines():
        line = line.strip()
        if line.startswith(("Current thread", "Thread ")):
            current = line.startswith("Current thread")
        elif current and line.startswith('File "'):
            path, _, function = line[len('File "'):].partition('", line ')
            frames.append(f"{os.path.basename(path)}:{function.partition(' in ')[2]}")
    return frames[::-1]
