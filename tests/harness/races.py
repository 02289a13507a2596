"""Races the tests drive in the trainer (a scenario's ``prelude`` installs them).

``status_readers_meet(path)``: two threads that read a forkserver child's exit status (the
monitor thread, the trainer's, the scenario's watchdog) meet inside CPython's
``popen_forkserver.Popen.poll``, right before its read of the status pipe
(``forkserver.read_signed``), and read it one after the other, the trainer's thread second
(of two others, the second to reach the meeting), once the first read's status is stored.
Each meeting is a line in ``path``. A reader that finds no other within ``MEET_S`` reads
alone (where reads are one at a time, the other waits outside ``poll``).
"""

import sys
import threading
import time
from multiprocessing import forkserver, popen_forkserver

MEET_S = 2.0  # the trainer and the watchdog poll a dead worker every 0.2 s
TRAINER = "MainThread"


def status_readers_meet(path):
    real, poll, meetings = forkserver.read_signed, popen_forkserver.Popen.poll.__code__, {}

    def read_signed(fd):
        frame = sys._getframe(1)
        if frame.f_code is not poll:
            return real(fd)
        popen, me = frame.f_locals["self"], threading.current_thread().name
        barrier, names = meetings.setdefault(id(popen), (threading.Barrier(2), []))
        names.append(me)
        try:
            index = barrier.wait(MEET_S)
        except threading.BrokenBarrierError:
            return real(fd)  # alone
        finally:
            meetings.pop(id(popen), None)
        with open(path, "a") as met:
            met.write(me + "\n")
        if me == TRAINER or (TRAINER not in names and index == 0):
            deadline = time.monotonic() + 10 * MEET_S
            while popen.returncode is None and time.monotonic() < deadline:
                time.sleep(0.005)
        return real(fd)

    forkserver.read_signed = read_signed
