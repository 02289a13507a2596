"""tox's inline plugin (tox loads this file itself): one line as each env starts and one as
it ends. A parallel run (``scripts/test``) shows an env's output only when it fails, and the
first envs take minutes: without these lines it is silent until the first one ends."""

import sys
import time

from tox.plugin import impl
from tox.tox_env.runner import RunToxEnv

_started = {}  # env name -> time.monotonic() at its start
_exit_codes = {}  # env name -> its commands' exit code


def _say(name, what):
    sys.stdout.write(f"[{time.strftime('%H:%M:%S')}] {name}: {what}\n")
    sys.stdout.flush()


def _start(tox_env):
    name = tox_env.conf.name
    if isinstance(tox_env, RunToxEnv) and name not in _started:
        _started[name] = time.monotonic()
        _say(name, "started")


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
    if name in _started:
        code = _exit_codes.pop(name, None)
        outcome = "no commands run" if code is None else "ok" if code == 0 else f"exit {code}"
        _say(name, f"ended after {time.monotonic() - _started.pop(name):.0f} s ({outcome})")
