"""The guardian's program: ``python -S -I guardian_process.py <trainer pid> [<directory>]``,
started by
``worker.guardian``. Standard library only: it imports nothing of the package, torch or NVRx,
and reads no start-up file.

Its stdin is a pipe from the trainer, on which each line ``<pid> <start time>`` names a
process to guard (the start time, field 22 of ``/proc/<pid>/stat``, so that a pid reused
meanwhile is never taken). Once it watches, it writes one byte to its stdout (a pipe the
trainer reads only if it ends: one that never wrote it could not run). It waits in one
``poll()`` on the trainer's pidfd, the pipe and each guarded process's pidfd: a guarded
process that ends is forgotten. When the trainer is gone (its pidfd is readable; without
pidfds, the pipe's EOF), it reads the lines still in the pipe and ends every guarded process
and its descendants (``end_trees``). SIGINT, SIGQUIT, SIGTERM and SIGHUP are ignored: a
Ctrl-C (or Ctrl-\\) to the process group, a launcher's SIGTERM or a hang-up leaves it to end
what the trainer leaves. Where it has a pidfd of the trainer, the pipe's EOF only means that
nothing more comes (the trainer closed it: an exec); the pidfd says when the trainer is gone.
Then it removes ``<directory>``, the trainer's private one (``inside.directory()``, where its
own stderr is): a killed trainer runs no exit handler to remove it.

A guardian killed while it ends these process trees could leave a process stopped. To
prevent that, it first forks a copy of itself (``twin``) and writes each process's pid to it
before it stops that process. When the guardian has exited, for whatever reason, the copy ends
the same processes and their descendants again (a no-op where all are gone).
"""

import os
import select
import signal
import sys
import time

#: /proc states of a process that cannot fork: stopped, traced, dead
HALTED = (b"T", b"t", b"Z", b"X")


def stat_fields(pid):
    """The fields of ``/proc/<pid>/stat`` after the command name (state first); OSError
    without /proc or without that process."""
    with open(f"/proc/{pid}/stat", "rb") as stat:
        return stat.read().rpartition(b")")[2].split()


def start_time(pid):
    """When ``pid`` started (field 22 of its ``/proc/<pid>/stat``), or None: it is gone."""
    try:
        return int(stat_fields(pid)[19])
    except (OSError, IndexError, ValueError):
        return None


def parent(pid):
    """The parent of ``pid`` (``/proc``), or None."""
    try:
        return int(stat_fields(pid)[1])
    except (OSError, IndexError, ValueError):
        return None


def alive(pid):
    """Is ``pid`` a process that has not exited (a zombie has)? Without /proc: does it
    exist?"""
    try:
        return stat_fields(pid)[0] not in (b"Z", b"X")
    except IndexError:
        return False
    except OSError:
        try:
            os.kill(pid, 0)
            return True
        except OSError:
            return False


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

    def end(self, tell=None):
        """End every guarded process and its descendants (``end_trees``). Without pidfds, a
        guarded pid whose start time changed is left alone."""
        end_trees(
            {
                pid: fd
                for pid, fd in self.fds.items()
                if fd is not None or start_time(pid) == self.starts[pid]
            },
            tell,
        )


def end_trees(roots, tell=None, bound=2.0):
    """Stop, then kill, the processes ``roots`` (pid -> pidfd, or None) and their
    descendants, one generation at a time: the generation is stopped (SIGSTOP), its children
    are listed once each of its threads has stopped (none can fork any more; ``bound``
    seconds at most), and it is killed (SIGKILL); then the children, each taken through a
    pidfd opened while its parent was stopped. Each child is named on ``tell`` (a
    descriptor: ``<pid> <start time>`` lines) before anything is done to it. Returns the
    pids ended."""
    ended, generation = [], dict(roots)
    while generation:
        for pid, fd in generation.items():
            send(pid, fd, signal.SIGSTOP)
        deadline = time.monotonic() + bound
        waiting = list(generation)
        while waiting and time.monotonic() < deadline:
            waiting = [pid for pid in waiting if not halted(pid)]
            if waiting:
                time.sleep(0.001)
        below = {}
        for pid in generation:
            for child in children(pid):
                if child in below or child in generation:
                    continue
                fd = pidfd(child)
                start = start_time(child)
                if parent(child) != pid or start is None:  # gone (its pid maybe reused)
                    if fd is not None:
                        os.close(fd)
                    continue
                if tell is not None:
                    try:
                        os.write(tell, f"{child} {start}\n".encode())
                    except OSError:  # the forked copy has exited
                        tell = None
                below[child] = fd
        for pid, fd in generation.items():
            send(pid, fd, signal.SIGKILL)
            if fd is not None and pid not in roots:
                os.close(fd)
        ended += generation
        generation = below
    return ended


def halted(pid):
    """Can ``pid`` no longer fork: is each of its threads stopped, or is it gone?"""
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return True
    for task in tasks:
        try:
            with open(f"/proc/{pid}/task/{task}/stat", "rb") as stat:
                if stat.read().rpartition(b")")[2].split()[0] not in HALTED:
                    return False
        except (OSError, IndexError):
            continue
    return True


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
    try:
        os.write(1, b".")  # it watches: the trainer's sign that it could run here
    except OSError:
        pass
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
    private = (
        argv[2] if argv[2:] and os.path.basename(argv[2]).startswith("nvrx_ipc_fix-") else None
    )
    guarded.end(twin(guarded, private))
    _remove(private)


def _remove(private):
    """Remove the trainer's private directory (mkdtemp's), which a killed trainer's exit
    handler never removed."""
    if private is not None:
        import shutil

        shutil.rmtree(private, ignore_errors=True)


def twin(guarded, private):
    """Fork a copy of this process that ends the same processes again once this process
    has exited, and removes ``private`` (see the module's docstring). Returns the descriptor
    to write their pids to, or None if the fork failed."""
    try:
        named, tell = os.pipe()
        if os.fork() != 0:
            os.close(named)
            return tell
    except OSError:
        return None
    os.close(tell)
    lines = chunk = os.read(named, 65536)
    while chunk:  # until the guardian has ended
        chunk = os.read(named, 65536)
        lines += chunk
    guarded.read(lines)
    guarded.end()
    _remove(private)  # where the guardian was killed before it did
    os._exit(0)


if __name__ == "__main__":
    main(sys.argv)
