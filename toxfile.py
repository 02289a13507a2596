"""tox's inline plugin (tox loads this file itself): a line as each env starts and as it ends,
and, while envs run, a line every ``NVRX_TESTS_PROGRESS`` seconds (30) naming them and how
long each has run. A parallel run (``scripts/test``) shows an env's own output only when it
fails, and the first envs take minutes: without these lines it is silent until the first one
ends. There, an env that passed is followed by its counts and slowest tests (each pytest run's
``$NVRX_TESTS_SUMMARY``, ``conftest.pytest_terminal_summary``); a failed env's output, which
tox shows, has them already."""

import os
import sys
import threading
import time

from tox.plugin import impl
from tox.tox_env.runner import RunToxEnv

PERIOD = float(os.environ.get("NVRX_TESTS_PROGRESS") or 30)
_lock = threading.Lock()
_started = {}  # env name -> time.monotonic() at its start
_exit_codes = {}  # env name -> its commands' exit code
_said = [time.monotonic()]  # when the last line was written
_ticker = []  # the thread that writes the progress lines, once started


def _write(text):
    with _lock:
        sys.stdout.write(text)
        sys.stdout.flush()
        _said[0] = time.monotonic()


def _say(name, what):
    _write(f"[{time.strftime('%H:%M:%S')}] {name}: {what}\n")


def _elapsed(seconds):
    minutes, seconds = divmod(round(seconds), 60)
    return f"{minutes} min {seconds} s" if minutes else f"{seconds} s"


def _tick():
    """A line naming the envs that run, ``PERIOD`` seconds after the last line."""
    while True:
        with _lock:
            now = time.monotonic()
            due = _said[0] + PERIOD - now
            running = [f"{name} ({_elapsed(now - at)})" for name, at in _started.items()]
        if due > 0:
            time.sleep(due)
        elif running:
            _write(f"[{time.strftime('%H:%M:%S')}] running: {', '.join(running)}\n")
        else:
            time.sleep(PERIOD)


def _start(tox_env):
    name = tox_env.conf.name
    with _lock:
        if not isinstance(tox_env, RunToxEnv) or name in _started:
            return
        _started[name] = time.monotonic()
        if not _ticker:
            _ticker.append(threading.Thread(target=_tick, name="progress", daemon=True))
            _ticker[0].start()
    _say(name, "started")


def _hidden(tox_env):
    """Does tox hide this env's output (a parallel run, not live, no parallel_show_output)?"""
    return (
        getattr(tox_env.options, "parallel_live", True) is False
        and not tox_env.conf["parallel_show_output"]
    )


def _summary(tox_env):
    """What the env's pytest runs wrote to ``$NVRX_TESTS_SUMMARY`` ("" if none)."""
    set_env = tox_env.conf["set_env"]
    if "NVRX_TESTS_SUMMARY" not in set_env:
        return ""
    try:
        with open(set_env.load("NVRX_TESTS_SUMMARY")) as summary:
            return summary.read()
    except FileNotFoundError:
        return ""


@impl
def tox_on_install(tox_env, arguments, section, of_type):
    """The first step of an env's set-up (its deps, whether they change or not)."""
    _start(tox_env)


@impl
def tox_before_run_commands(tox_env):
    _start(tox_env)  # an env with nothing to install


@impl
def tox_after_run_commands(tox_env, exit_code, outcomes):
    _exit_codes[tox_env.conf.name] = exit_code


@impl
def tox_env_teardown(tox_env):
    name = tox_env.conf.name
    with _lock:
        if name not in _started:
            return
        code, at = _exit_codes.pop(name, None), _started.pop(name)
    outcome = "no commands run" if code is None else "ok" if code == 0 else f"exit {code}"
    shown = _summary(tox_env) if code == 0 and _hidden(tox_env) else ""
    _say(name, f"ended after {time.monotonic() - at:.0f} s ({outcome})\n{shown}".rstrip("\n"))
