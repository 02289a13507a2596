"""Nothing of the package's or NVRx's outlives the trainer, whatever kills it
(``worker/guardian.py``). A trainer runs in a session of its own, is brought to a state (its
worker idle after a save, busy writing, forked from the standby after a ``restart`` release,
suspended; NVRx's process of a save in flight on a queue that is not persistent), checked
there, and SIGKILLed, as the OOM killer does; within 10 s (the docs' bound) no process of its
session is left, nor its private directory (``inside.directory()``, the guardian's stderr).
Without the guardian its checkpoint worker, NVRx's results-queue manager, multiprocessing's
resource tracker (and the harness's forkserver, whose alive pipe the worker holds) stayed.
A Ctrl-C to the trainer's process group leaves the guardian alone, and a process that never
started a worker has none.

Each trainer's session is killed at the end of its test, whatever happened: nothing leaks
into the suite."""

import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from conftest import EXPECT, GPU, MCORE, NVRX, _env, _forkable, _the_zygote, needs_cache
from conftest import needs_nvrx, needs_warmup, run_python

BOUND = 10.0  # seconds a killed trainer's session may take to empty and its private directory
#               to go: the docs' bound (its guarded processes: 54-151 ms on a loaded 2-core
#               VM, benchmarks/guardian_cost.py; the wait ends as soon as none is left)
REACH = 300.0  # seconds a trainer may take to reach its state (a cold standby under load)

# Steps of this file's own: ``writing`` waits until the worker is inside the write that the
# ``fault-hold`` save holds; ``note`` writes what the state is (``note.json``: the pids of the
# worker, NVRx's process of the save, the process in the held write, the standby, with their
# /proc state and parent, the worker's once it is neither running nor in a disk wait: idle,
# blocked or stopped; status().guardian; the package's private directory); ``hold`` writes
# it to ``state.json`` and waits to be killed (a Ctrl-C is noted in ``interrupted``, and the
# wait goes on); ``exit`` is ``sys.exit(0)``, with no close (the exit handlers run);
# ``kill-guardian`` SIGKILLs the guardian once it watches, and reaps it.
PRELUDE = """
    import json, os, signal, sys, time
    import nvrx_ipc_fix
    from harness import scenario as _s
    from nvrx_ipc_fix.worker.guardian_process import stat_fields

    _out = os.environ["ORPHANS_DIR"]

    def _proc(pid):
        try:
            state, parent = stat_fields(pid)[:2]
            return state.decode(), int(parent)
        except (OSError, IndexError, ValueError):
            return None, None

    def _settled(pid, bound=120.0):
        # _proc(pid) once it is neither running (R) nor in a disk wait (D), or at the
        # bound: a state reached, not one instant's
        deadline = time.monotonic() + bound
        found = _proc(pid)
        while found[0] in ("R", "D") and time.monotonic() < deadline:
            time.sleep(0.02)
            found = _proc(pid)
        return found

    def _write(name, what):
        path = os.path.join(_out, name)
        with open(path + ".tmp", "w") as out:
            json.dump(what, out)
        os.replace(path + ".tmp", path)

    def _writing(trainer):
        path = os.path.join(trainer.directory, "writing")
        deadline = time.monotonic() + 120
        while not os.path.exists(path) and time.monotonic() < deadline:
            time.sleep(0.05)

    def _state(trainer):
        worker = trainer.worker()
        calls = getattr(trainer.queue, "async_calls", ())
        temporal = getattr(calls[-1][1], "process", None) if calls and not getattr(
            trainer.queue, "persistent", True) else None
        writing = os.path.join(trainer.directory, "writing")
        standby = sys.modules.get("nvrx_ipc_fix.worker.standby")
        inside = sys.modules.get("nvrx_ipc_fix.worker.inside")
        status = nvrx_ipc_fix.status()
        state = {"trainer": os.getpid(), "worker": getattr(worker, "pid", None),
                 "temporal": getattr(temporal, "pid", None),
                 "writer": int(open(writing).read()) if os.path.exists(writing) else None,
                 "standby": getattr(getattr(standby, "_standby", None), "pid", None),
                 "guardian": getattr(status, "guardian", None),
                 "private": inside and inside._private[0]}
        for key in ("worker", "temporal", "writer"):
            state[key + "_proc"] = _proc(state[key]) if state[key] else None
        if state["worker"]:
            state["worker_proc"] = _settled(state["worker"])
        return state

    def _note(trainer):
        _write("note.json", _state(trainer))

    def _hold(trainer):
        state = _state(trainer)
        signal.signal(signal.SIGINT, lambda *_: _write("interrupted", {"at": time.time()}))
        _write("state.json", state)
        while True:
            signal.pause()

    def _exit(trainer):
        sys.exit(0)

    def _kill_guardian(trainer):
        import select
        from nvrx_ipc_fix.worker import guardian
        # once it watches (its byte on the pipe, left there for the package to read): one
        # killed before is taken for one that cannot run here
        if not select.select([guardian._ready], [], [], 120)[0]:
            raise AssertionError("the guardian never said that it watches")
        os.kill(guardian._process.pid, signal.SIGKILL)
        guardian._process.wait(30)

    _s.EXTRA_STEPS.update(hold=_hold, note=_note, writing=_writing, exit=_exit,
                           **{"kill-guardian": _kill_guardian})
"""
TEMPORAL = """
    _made = _s.Trainer.__init__

    def _temporal(self, *args, **kwargs):  # NVRx's process per save
        _made(self, *args, **kwargs)
        self.queue.close()
        self.queue = self.core.AsyncCallsQueue(persistent=False)

    _s.Trainer.__init__ = _temporal
"""


def session(sid):
    """The live processes of session ``sid`` (zombies are gone): ``{pid: command line}``."""
    found = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as stat:
                fields = stat.read().rpartition(b")")[2].split()
            if int(fields[3]) != sid or fields[0] in (b"Z", b"X"):
                continue
            with open(f"/proc/{entry}/cmdline", "rb") as cmdline:
                found[int(entry)] = cmdline.read().replace(b"\0", b" ").decode()[:200]
        except (OSError, IndexError, ValueError):
            continue
    return found


def ignores(pid, signum):
    """Whether ``pid`` ignores ``signum`` (its ``SigIgn`` mask in ``/proc/<pid>/status``)."""
    with open(f"/proc/{pid}/status") as status:
        mask = next(line for line in status if line.startswith("SigIgn:")).split()[1]
    return bool(int(mask, 16) >> (signum - 1) & 1)


class Trainer:
    """The harness's trainer running ``steps`` (ending in ``hold``) in a session of its own: a
    child of the zygote where that stands for a fresh interpreter, else a fresh one."""

    def __init__(
        self, steps, directory, env=None, prelude="", fix=True, impl="nvrx", tensors=8, numel=512
    ):
        self.directory = directory
        env = {**(env or {}), "ORPHANS_DIR": directory}
        code = (
            textwrap.dedent(PRELUDE)
            + textwrap.dedent(prelude)
            + textwrap.dedent(f"""
            import tempfile
            _s.run({list(steps)!r}, tempfile.mkdtemp(), timeout=600, n_tensors={tensors},
                   numel={numel}, starts={"spawn" if GPU else "forkserver"!r}, impl={impl!r})
        """)
        )
        self.err = os.path.join(directory, "stderr")
        self.proc = None
        if _forkable(fix, False, env):
            self.pid = _the_zygote().start(
                code, _env(fix, False, env), os.path.join(directory, "stdout"), self.err
            )
        else:
            with open(self.err, "w") as err:
                self.proc = subprocess.Popen(
                    [sys.executable, "-c", code],
                    env=_env(fix, False, env),
                    stderr=err,
                    stdout=subprocess.DEVNULL,
                    start_new_session=True,
                )
            self.pid = self.proc.pid
        self.exit = None
        self.private = None  # the package's private directory, once a state names it

    def _exited(self, timeout):
        if self.exit is None:
            self.exit = (
                _the_zygote().wait(self.pid, timeout)
                if self.proc is None
                else _wait(self.proc, timeout)
            )
        return self.exit

    def reached(self, name="state.json", timeout=REACH):
        """What the trainer wrote to ``name`` once it got there (it may write it and exit)."""
        path = os.path.join(self.directory, name)
        deadline = time.monotonic() + timeout
        while not os.path.exists(path):
            ended = self._exited(0.1) is not None or time.monotonic() > deadline
            if ended and not os.path.exists(path):  # looked again after the end
                with open(self.err) as err:
                    pytest.fail(
                        f"the trainer never wrote {name} (exit {self.exit})\n{err.read()[-3000:]}"
                    )
        with open(path) as found:
            state = json.load(found)
        if isinstance(state, dict):  # the trainer's state (other files hold lists)
            self.private = state.get("private", self.private)
        return state

    def kill(self, signum=signal.SIGKILL):
        os.kill(self.pid, signum)

    def left(self, bound=BOUND):
        """What is left ``bound`` seconds after the trainer died (sooner, once nothing is):
        the processes of its session alive, ``{pid: command line}``, and its private
        directory, if a state named one and it is still there (``{path: "directory"}``)."""
        assert self._exited(30) is not None, "the trainer did not die"
        deadline = time.monotonic() + bound
        while self._left() and time.monotonic() < deadline:
            time.sleep(0.05)
        return self._left()

    def _left(self):
        found = session(self.pid)
        if self.private and os.path.exists(self.private):
            found[self.private] = "directory"
        return found

    def clean(self):
        """Kill whatever is left of the session, the trainer included."""
        for pid in session(self.pid):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self._exited(30)


def _wait(proc, timeout):
    try:
        return proc.wait(timeout)
    except subprocess.TimeoutExpired:
        return None


@pytest.fixture
def trainer(tmp_path):
    """Start a trainer (``trainer(steps, env=..., prelude=...)``); its session is killed at
    the end of the test."""
    made = []

    def start(steps, **options):
        made.append(Trainer(steps, str(tmp_path), **options))
        return made[-1]

    yield start
    for one in made:
        one.clean()


def killed(one):
    """SIGKILL the trainer; what of its session, and of its private directory, is left."""
    assert one.private and os.path.isdir(one.private), one.private  # there, to be removed
    one.kill()
    return one.left()


def expect_cache():
    return EXPECT[NVRX]["cache"]


def guarding(state, count):
    """``status().guardian`` says it guards ``count`` processes (at least)."""
    text = state["guardian"] or ""
    assert text.startswith("running (pid "), state
    guarded = int(text.split("guarding ", 1)[1].split()[0])
    assert guarded >= count, state


@needs_nvrx
@pytest.mark.worker
def test_the_worker_idle_after_a_save_goes_with_the_trainer(trainer):
    one = trainer(["save", "hold"])
    state = one.reached()
    assert state["worker_proc"][0] == "S", state  # alive, idle
    guarding(state, 2)  # the worker and the results-queue manager
    assert killed(one) == {}


@needs_nvrx
@pytest.mark.worker
def test_a_worker_busy_writing_goes_with_the_trainer(trainer):
    one = trainer(["save", "fault-hold-async", "writing", "hold"])
    state = one.reached()
    assert state["writer"] == state["worker"], state  # the worker is inside the write
    assert killed(one) == {}


@needs_warmup
@pytest.mark.worker
def test_the_standby_and_its_forked_worker_go_with_the_trainer(trainer):
    """After a ``restart`` release and onload: the worker is forked from the standby."""
    one = trainer(
        [
            "save",
            "offloading-restart",
            "standby",
            "ready",
            "save",
            "offloading-restart",
            "ready",
            "hold",
        ],
        env={"NVRX_IPC_FIX_STANDBY": "on"},
    )
    state = one.reached()
    assert state["standby"] and state["worker_proc"][1] == state["standby"], state
    assert killed(one) == {}


@needs_cache
@pytest.mark.worker
@pytest.mark.parametrize(
    "steps, proc",
    [(["suspend"], "T"), (["offloading-suspend", "resumed"], "S")],
    ids=["suspended", "resumed-at-the-onload"],
)
def test_a_suspended_worker_goes_with_the_trainer(trainer, steps, proc):
    """Suspended through the driver's stand-in (its lock stops the worker, SIGSTOP), and
    after a ``suspend`` release and onload."""
    one = trainer(["driver", "save", *steps, "hold"])
    state = one.reached()
    assert state["worker_proc"][0] == proc, state
    assert killed(one) == {}


@needs_warmup
@pytest.mark.worker
def test_a_worker_started_ahead_of_its_first_save_goes_with_the_trainer(trainer):
    """``NVRX_IPC_FIX_PREWARM=start``: in NVRx's warm-up slot, before any save."""
    one = trainer(["ready", "hold"], env={"NVRX_IPC_FIX_PREWARM": "start"})
    state = one.reached()
    assert state["worker_proc"][0] == "S", state  # idle, waiting for its first save
    guarding(state, 1)
    assert killed(one) == {}


@needs_nvrx
@pytest.mark.worker
def test_nvrx_s_process_of_a_save_in_flight_goes_with_the_trainer(trainer):
    """A queue that is not persistent: NVRx forks a process for each save."""
    one = trainer(["save", "fault-hold-async", "writing", "hold"], prelude=TEMPORAL)
    state = one.reached()
    assert state["worker"] is None and state["writer"] == state["temporal"], state
    assert killed(one) == {}


@pytest.mark.skipif(MCORE is None, reason="megatron-core is not installed here")
@pytest.mark.mcore
@pytest.mark.worker
@pytest.mark.parametrize(
    "steps", [["save"], ["save", "fault-hold-async", "writing"]], ids=["idle", "writing"]
)
def test_megatron_core_s_worker_goes_with_the_trainer(trainer, steps):
    """megatron-core's own worker, on its classes (forked from the trainer on the CPU)."""
    one = trainer([*steps, "hold"], impl="mcore")
    state = one.reached()
    assert state["worker_proc"][1] == state["trainer"], state
    if "writing" in steps:
        assert state["writer"] == state["worker"], state
    guarding(state, 1)
    assert killed(one) == {}


@needs_nvrx
@pytest.mark.worker
def test_a_ctrl_c_to_the_process_group_leaves_the_guardian(trainer):
    """The trainer goes on after it (its handler notes it): so does the guardian, which still
    ends what is left when the trainer is then killed."""
    one = trainer(["save", "hold"])
    state = one.reached()
    guardian = int(state["guardian"].split("pid ", 1)[1].split(",")[0].rstrip(")"))
    # the guardian ignores SIGINT from its first line on; before that, a loaded machine may
    # not have run it yet (a state to wait for, not the Ctrl-C's subject)
    deadline = time.monotonic() + REACH
    while not ignores(guardian, signal.SIGINT):
        assert time.monotonic() < deadline, f"the guardian never ignored SIGINT: {state}"
        time.sleep(0.05)
    os.killpg(one.pid, signal.SIGINT)
    one.reached("interrupted")
    assert guardian in session(one.pid)
    assert killed(one) == {}


@needs_nvrx
@pytest.mark.worker
def test_a_clean_exit_leaves_nothing_and_resumes_a_suspended_worker_first(trainer):
    """The guardian sees the exit too; the exit handlers stopped the workers (a suspended
    one resumed first: else multiprocessing's join at exit would wait on it for ever)."""
    steps = (
        ["driver", "save", "suspend", "note", "exit"]
        if expect_cache()
        else ["save", "note", "exit"]
    )
    one = trainer(steps)
    note = one.reached("note.json")
    guarding(note, 2)
    assert note["worker_proc"][0] == ("T" if expect_cache() else "S"), note
    assert one.left() == {}
    assert one.exit == 0


@needs_nvrx
@pytest.mark.worker
def test_a_forked_child_leaves_the_guardian_to_the_trainer(trainer):
    """A child of ``os.fork()`` that exits: the trainer's guardian still ends its workers."""
    one = trainer(["save", "fork-exit", "hold"])
    state = one.reached()
    guarding(state, 2)
    assert killed(one) == {}


@needs_nvrx
@pytest.mark.worker
def test_a_guardian_that_died_is_replaced_by_the_next_save(trainer):
    one = trainer(["save", "kill-guardian", "save", "hold"])
    state = one.reached()
    assert "; 1 replaced" in state["guardian"], state
    guarding(state, 2)
    assert killed(one) == {}


@needs_nvrx
@pytest.mark.worker
def test_without_the_package_the_worker_outlives_the_trainer(trainer):
    """Nothing ends the worker without the package: alive 10 s after the trainer died (the
    bound the docs give for the package's), it stays."""
    one = trainer(["save", "hold"], fix=False)
    state = one.reached()
    one.kill()
    left = one.left(bound=10)
    assert state["worker"] in left, (state, left)


@needs_nvrx
def test_no_guardian_without_a_worker():
    """Importing and activating the package, importing NVRx and making a queue start no
    process."""
    found = run_python("""
        import glob, json, os
        import nvrx_ipc_fix
        from nvidia_resiliency_ext.checkpointing.async_ckpt import core, filesystem_async
        queue = core.AsyncCallsQueue(persistent=True)
        children = "".join(open(path).read() for path in glob.glob("/proc/self/task/*/children"))
        print(json.dumps({"children": children.split(), "status": nvrx_ipc_fix.status().guardian}))
    """)
    assert found["children"] == [], found
    assert found["status"].startswith("not started"), found


@pytest.mark.once  # the guardian's own code: NVRx plays no part
def test_a_forked_child_closes_the_guardian_s_pipe_and_forgets_it():
    """Where the guardian has no pidfd, the pipe's EOF is the trainer's death: a child of
    ``os.fork()`` must not hold it open. It starts a guardian of its own if it needs one."""
    found = run_python("""
        import json, os, subprocess, sys
        import nvrx_ipc_fix
        from nvrx_ipc_fix.worker import guardian

        sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
        guardian.guard(sleeper)
        pipe, first = guardian._pipe, guardian._process.pid
        answer, tell = os.pipe()
        pid = os.fork()
        if pid == 0:
            try:
                os.fstat(pipe)
                still = True
            except OSError:
                still = False
            before = guardian.describe()
            own = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
            guardian.guard(own)  # a guardian of its own, which ends it with this child
            os.write(tell, json.dumps({"open": still, "before": before,
                                       "after": guardian.describe(),
                                       "guardian": guardian._process.pid}).encode())
            os._exit(0)
        os.waitpid(pid, 0)
        child = json.loads(os.read(answer, 65536))
        print(json.dumps({"child": child, "parent": guardian.describe(), "first": first}))
        sleeper.kill()
    """)
    child, first = found["child"], found["first"]
    assert child["open"] is False, found
    assert child["before"].startswith("not started"), found
    assert child["after"].startswith("running (pid ") and child["guardian"] != first, found
    assert found["parent"] == f"running (pid {first}), guarding 1 process(es)", found


@pytest.mark.once  # the guardian's own code: NVRx plays no part
def test_without_pidfds_the_pipe_s_eof_is_the_trainer_s_death():
    """The guardian's program with ``os.pidfd_open`` taken away (Linux before 5.3), once it
    watches (it read its pipe): the trainer's death closes the pipe (its forked child closed
    its copy, as the package's callback does), and the guarded worker is killed."""
    found = run_python("""
        import fcntl, json, os, signal, subprocess, sys, termios, time
        from nvrx_ipc_fix.worker.guardian import PROGRAM, start_time

        BOOT = ("import os, sys; del os.pidfd_open; path = sys.argv.pop(1); "
                "exec(compile(open(path).read(), path, 'exec'), {'__name__': '__main__'})")
        answer, tell = os.pipe()
        trainer = os.fork()
        if trainer == 0:
            os.close(answer)
            worker = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"])
            read, write = os.pipe()
            guardian = subprocess.Popen([sys.executable, "-S", "-I", "-c", BOOT, PROGRAM,
                                         str(os.getpid())], stdin=read, close_fds=True,
                                        stdout=subprocess.DEVNULL)
            os.close(read)
            os.write(write, f"{worker.pid} {start_time(worker.pid)}\\n".encode())
            deadline = time.monotonic() + 60  # until the guardian has read it: it watches
            while fcntl.ioctl(write, termios.FIONREAD, b"\\0" * 4) != b"\\0" * 4:
                assert time.monotonic() < deadline, "the guardian does not read its pipe"
                time.sleep(0.01)
            child = os.fork()
            if child == 0:
                os.close(write)  # what the package's after-fork callback does
                time.sleep(300)
                os._exit(0)
            os.write(tell, json.dumps([worker.pid, guardian.pid, child]).encode())
            time.sleep(300)
            os._exit(0)
        os.close(tell)
        worker, guardian, child = json.loads(os.read(answer, 65536))
        os.kill(trainer, signal.SIGKILL)
        os.waitpid(trainer, 0)

        def running(pid):
            try:
                return open(f"/proc/{pid}/stat").read().rpartition(")")[2].split()[0] != "Z"
            except OSError:  # gone
                return False

        deadline = time.monotonic() + 120  # until both are gone (at once, unloaded)
        while (running(worker) or running(guardian)) and time.monotonic() < deadline:
            time.sleep(0.05)
        alive = {name: running(pid) for name, pid in (("worker", worker),
                                                      ("guardian", guardian), ("child", child))}
        for pid in (worker, guardian, child):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        print(json.dumps(alive))
    """)
    assert found == {"worker": False, "guardian": False, "child": True}, found


@pytest.mark.once  # the guardian's own code: NVRx plays no part
def test_a_pid_that_names_another_process_by_now_is_not_guarded():
    """The start time sent with a pid must be the process's: a pid reused meanwhile is
    never taken (nor killed)."""
    import importlib.util
    import runpy
    import select

    package = importlib.util.find_spec("nvrx_ipc_fix").submodule_search_locations[0]
    program = runpy.run_path(os.path.join(package, "worker", "guardian_process.py"))
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    try:
        guarded = program["Guarded"](select.poll())
        start = program["start_time"](sleeper.pid)
        guarded.read(f"{sleeper.pid} {start + 1}\n".encode())
        assert guarded.fds == {}
        guarded.read(f"{sleeper.pid} {start}\n{sleeper.pid + 1}".encode())  # and a partial line
        assert (
            list(guarded.fds) == [sleeper.pid] and guarded.pending == str(sleeper.pid + 1).encode()
        )
    finally:
        sleeper.kill()
        sleeper.wait()


@pytest.mark.once
def test_no_module_beside_the_guardian_s_program_shadows_the_standard_library():
    """Python 3.10 puts the program's folder first on its ``sys.path`` (``-I`` implies ``-P``
    only from 3.11): a module there named as one of the standard library's would be imported
    in its place."""
    import importlib.util

    package = importlib.util.find_spec("nvrx_ipc_fix").submodule_search_locations[0]
    names = {
        name[:-3] for name in os.listdir(os.path.join(package, "worker")) if name.endswith(".py")
    }
    assert names and sorted(names & set(sys.stdlib_module_names)) == []
