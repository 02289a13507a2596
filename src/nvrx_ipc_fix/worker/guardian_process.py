"""The guardian's program: ``python -S -I guardian_process.py <trainer pid>``, started by
``worker.guardian``. Standard library only: it imports nothing of the package, torch or NVRx,
and reads no start-up file.

Its stdin is a pipe from the trainer, on which each line ``<pid> <start time>`` names a
process to guard (the start time, field 22 of ``/proc/<pid>/stat``, so that a pid reused
meanwhile is never taken). It waits in one ``poll()`` on the trainer's pidfd, the pipe and
each guarded process's pidfd: a guarded process that ends is forgotten. When the trainer is
gone (its pidfd is readable; without pidfds, the pipe's EOF), it reads the lines still in the
pipe, stops every guarded process and its descendants (SIGSTOP: none can fork or reap any
more), kills them (SIGKILL, descendants first) and exits. SIGINT, SIGQUIT, SIGTERM and
SIGHUP are ignored: a Ctrl-C (or Ctrl-\\) to the process group, a launcher's SIGTERM or a
hang-up leaves it to end what the trainer leaves. Where it has a pidfd of the trainer, the
pipe's EOF only means that nothing more comes (the trainer closed it: an exec); the pidfd
says when the trainer is gone.
"""

import os
import select
import signal
import sys


def start_time(pid):
    """When ``pid`` started (field 22 of its ``/proc/<pid>/stat``), or None: it is gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as stat:
            return int(stat.read().rpartition(b")")[2].split()[19])
    except (OSError, IndexError, ValueError):
        return None


def parent(pid):
    """The parent of ``pid`` (``/proc``), or None."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as stat:
            return int(stat.read().rpartition(b")")[2].split()[1])
    except (OSError, IndexError, ValueError):
        return None


def pidfd(pid):
    """A pidfd of ``pid``, or None (gone, or no pidfds: Linux < 5.3)."""
    try:
        return os.pidfd_open(pid)
    except (AttributeError, OSError):
        return None


def send(pid, fd, signum):
    """``signum`` to the process of ``fd`` (a pidfd), else to ``pid``; gone is fine."""
    try:
        if fd is not None:
            signal.pidfd_send_signal(fd, signum)
        else:
            os.kill(pid, signum)
    except OSError:
        pass


class Guarded:
    """The processes to end: pid -> pidfd (None without pidfds)."""

    def __init__(self, poller):
        self.fds, self.starts, self.poller, self.pending = {}, {}, poller, b""

    def read(self, chunk):
        """Take the lines of ``chunk`` (a partial line waits for the rest)."""
        lines = (self.pending + chunk).split(b"\n")
        self.pending = lines.pop()
        for line in lines:
            try:
                pid, start = map(int, line.split())
            except ValueError:
                continue
            self.add(pid, start)

    def add(self, pid, start):
        if pid in self.fds:
            self.forget(pid)
        fd = pidfd(pid)
        if start_time(pid) != start:  # gone, or another process by now
            if fd is not None:
                os.close(fd)
            return
        self.fds[pid], self.starts[pid] = fd, start
        if fd is not None:
            self.poller.register(fd, select.POLLIN)

    def forget(self, pid):
        fd = self.fds.pop(pid)
        self.starts.pop(pid)
        if fd is not None:
            self.poller.unregister(fd)
            os.close(fd)

    def ended(self, fd):
        """A guarded process's pidfd is readable: it ended."""
        for pid, mine in list(self.fds.items()):
            if mine == fd:
                self.forget(pid)

    def end(self):
        """Stop every guarded process and its descendants, then kill them, descendants
        first. Without pidfds, a guarded pid whose start time changed is left alone."""
        found = {pid: fd for pid, fd in self.fds.items()
                 if fd is not None or start_time(pid) == self.starts[pid]}
        for pid, fd in found.items():
            send(pid, fd, signal.SIGSTOP)
        while True:  # each look is after the stops: a child forked before one is seen here
            added = {}
            for pid in found:
                for child in children(pid):
                    if child in found or child in added:
                        continue
                    fd = pidfd(child)
                    if parent(child) != pid:  # gone (and its pid maybe reused) meanwhile
                        if fd is not None:
                            os.close(fd)
                        continue
                    added[child] = fd
                    send(child, fd, signal.SIGSTOP)
            if not added:
                break
            found.update(added)
        for pid, fd in reversed(list(found.items())):
            send(pid, fd, signal.SIGKILL)


def children(pid):
    """The children of ``pid`` (``/proc/<pid>/task/*/children``; where the kernel has no such
    file, every process's parent is read)."""
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return []
    found = []
    for task in tasks:
        try:
            with open(f"/proc/{pid}/task/{task}/children", "rb") as listed:
                found += map(int, listed.read().split())
        except FileNotFoundError:
            return [int(p) for p in os.listdir("/proc") if p.isdigit() and parent(p) == pid]
        except (OSError, ValueError):
            continue
    return found


def main(argv):
    for signum in (signal.SIGINT, signal.SIGQUIT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(signum, signal.SIG_IGN)
    trainer = int(argv[1])
    watch = pidfd(trainer)
    poller = select.poll()
    guarded = Guarded(poller)
    poller.register(0, select.POLLIN)
    if watch is not None:
        poller.register(watch, select.POLLIN)
    gone = os.getppid() != trainer  # died before it could be watched
    talking = True
    while not gone:
        for fd, _ in poller.poll():
            if fd == 0:
                chunk = os.read(0, 65536)
                if chunk:
                    guarded.read(chunk)
                    continue
                poller.unregister(0)  # the trainer closed the pipe (its exit, an exec)
                talking = False
                gone = watch is None  # else its pidfd says when it is gone
            elif fd == watch:
                gone = True
            else:
                guarded.ended(fd)
    if talking:  # what it sent before it died
        os.set_blocking(0, False)
        try:
            chunk = os.read(0, 65536)
            while chunk:
                guarded.read(chunk)
                chunk = os.read(0, 65536)
        except BlockingIOError:
            pass
    guarded.end()


if __name__ == "__main__":
    main(sys.argv)
