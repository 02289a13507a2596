"""What each test costs: wall time, Python interpreters started, processes forked.

``python tests/costs.py install`` (tox runs it before the tests) puts a start-up hook into
the env's site-packages (``_nvrx_ipc_fix_test_costs.pth`` and its module). It does nothing
unless ``NVRX_TESTS_COSTS`` names a file; then every Python process of that env that starts
(a test's child, NVRx's spawned worker, a forkserver, multiprocessing's resource tracker)
appends one line, ``<test id>\\t<kind>\\t<pid>``, and each process forked from one appends a
``fork`` line. The test id is the ``PYTEST_CURRENT_TEST`` that pytest exports to children.
``conftest.py`` sets the variable for a session, and prints the slowest tests with their
counts at its end (``summary``).
"""

import os
import sys
import sysconfig

VARIABLE = "NVRX_TESTS_COSTS"  # not NVRX_IPC_FIX_*: conftest strips those from children
HOOK = "_nvrx_ipc_fix_test_costs"
#: The start-up hook (standard library only; a no-op unless the variable is set).
MODULE = f'''"""Test cost records of nvrx-ipc-fix's test suite (tests/costs.py)."""
import os

_path = os.environ.get({VARIABLE!r})


def _record(kind):
    test = os.environ.get("PYTEST_CURRENT_TEST", "-").rsplit(" (", 1)[0]
    try:
        with open(_path, "a") as out:
            out.write(test + "\\t" + kind + "\\t" + str(os.getpid()) + "\\n")
    except OSError:
        pass


if _path:
    try:
        with open("/proc/self/cmdline", "rb") as _cmdline:
            _argv = _cmdline.read()
    except OSError:
        _argv = b""
    _record("spawned" if b"multiprocessing.spawn import spawn_main" in _argv
            else "forkserver" if b"multiprocessing.forkserver import main" in _argv
            else "tracker" if b"multiprocessing.resource_tracker import main" in _argv
            else "interpreter")
    os.register_at_fork(after_in_child=lambda: _record("fork"))
'''
KINDS = ("interpreter", "spawned", "forkserver", "fork")


def install():
    """Write the hook into this interpreter's site-packages."""
    site = sysconfig.get_paths()["purelib"]
    with open(os.path.join(site, f"{HOOK}.py"), "w") as module:
        module.write(MODULE)
    with open(os.path.join(site, f"{HOOK}.pth"), "w") as pth:
        pth.write(f"import {HOOK}\n")


def installed():
    return os.path.exists(os.path.join(sysconfig.get_paths()["purelib"], f"{HOOK}.pth"))


def read(path):
    """``{test id: {kind: count}}`` from the records in ``path``."""
    counts = {}
    try:
        with open(path) as records:
            for line in records:
                test, _, rest = line.rstrip("\n").partition("\t")
                kind = rest.partition("\t")[0]
                counts.setdefault(test, dict.fromkeys(KINDS, 0))
                if kind in counts[test]:
                    counts[test][kind] += 1
    except OSError:
        pass
    return counts


def summary(durations, path, top=20):
    """Lines of a table: the ``top`` slowest tests (``durations``: {test id: seconds}), with
    what they started, and the totals."""
    counts = read(path)
    zero = dict.fromkeys(KINDS, 0)
    lines = [f"{'seconds':>8} {'interp':>6} {'spawned':>7} {'fksrv':>5} {'forks':>5}  test"]
    for test, seconds in sorted(durations.items(), key=lambda item: -item[1])[:top]:
        c = counts.get(test, zero)
        lines.append(f"{seconds:8.1f} {c['interpreter']:6d} {c['spawned']:7d} "
                     f"{c['forkserver']:5d} {c['fork']:5d}  {test}")
    totals = {kind: sum(c[kind] for c in counts.values()) for kind in KINDS}
    lines.append(f"{sum(durations.values()):8.1f} {totals['interpreter']:6d} "
                 f"{totals['spawned']:7d} {totals['forkserver']:5d} {totals['fork']:5d}  "
                 f"all {len(durations)} tests")
    return lines


if __name__ == "__main__" and sys.argv[1:] == ["install"]:
    install()
