"""``python -m nvrx_ipc_fix doctor``: is the fix active in processes started like this one?

A process "started like this one" runs the same interpreter with the same flags and
environment. It is covered when its start-up (the ``.pth`` file or the sitecustomize
fallback) activates the package; the import this command makes does not count. One line
per check; exit status 1 when an NVRx with the IPC cache (0.6.0, 0.7.0, a dev build) is
installed and such processes are not covered, else 0.

``doctor --python PATH`` runs the same checks under another interpreter (a Ray
``py_executable``, one of NeMo RL's per-actor venvs) with this environment; where that
interpreter cannot import the package at all, a standard-library probe says so (exit 1
when its NVRx needs the fix, 2 when the interpreter cannot be run).
"""

import json
import os
import site
import subprocess
import sys

from ..core import config as _config, detect as _detect
from ..core.fix_names import FIXES

PTH = "nvrx_ipc_fix.pth"
FIX_LEVELS = {
    "active": "ok",
    "fixed_upstream": "ok",
    "not_applicable": "ok",
    "pending": "info",
    "disabled": "warn",
    "unsupported": "warn",
    "error": "warn",
}
OTHER_WAYS = (
    "`import nvrx_ipc_fix` first in each entry point; for Ray workers "
    "ray.init(runtime_env=nvrx_ipc_fix.ray_runtime_env())"
)
#: The oldest Python the package runs on (pyproject's requires-python).
MIN_PYTHON = (3, 10)
#: Run by ``doctor --python`` first: standard library only, as the package may be missing
#: there, and Python 2 syntax before the version check, so that an old interpreter says what
#: it is instead of failing.
PROBE = """import json, sys
if sys.version_info[:2] < MIN_PYTHON:
    print(json.dumps({"python": sys.executable, "version": sys.version.split()[0],
                      "nvrx": None, "importable": False, "too_old": True}))
    sys.exit(0)
import importlib.util
from importlib import metadata
try:
    nvrx = metadata.version("nvidia-resiliency-ext")
except (ImportError, OSError, ValueError):  # not installed, or a broken dist-info
    nvrx = None
print(json.dumps({"python": sys.executable, "version": sys.version.split()[0], "nvrx": nvrx,
                  "importable": importlib.util.find_spec("nvrx_ipc_fix") is not None}))
""".replace("MIN_PYTHON", repr(MIN_PYTHON))


def run(out=print, as_json=False):
    """Print the checks; return the exit status.

    Each check is ``(level, label, text)``: ``ok``, ``info``, ``warn``, or ``fail``, which
    is a reason for exit status 1 when an affected NVRx is installed (shown as ``FAIL``)
    and only a warning otherwise.
    """
    import nvrx_ipc_fix

    status = nvrx_ipc_fix.status()
    startup = sys.modules.get("_nvrx_ipc_fix_startup")  # imported only by start-up
    ran = getattr(startup, "ran", [])
    package_dir = os.path.dirname(os.path.abspath(nvrx_ipc_fix.__file__))
    affected = _detect.may_cache(status.nvrx_version)
    covered = status.activated and status.source in ("pth", "sitecustomize")

    checks = [
        (
            "info",
            "package",
            f"nvrx-ipc-fix {status.version} in {package_dir}; Python "
            f"{sys.version.split()[0]} ({sys.executable}), pid {status.pid}",
        ),
        _pth(_installed_pth(), ran, covered),
        _sitecustomize("sitecustomize" in ran),
    ]
    invalid = []  # (name, value) of each setting the package does not understand
    for setting in _config.SETTINGS:
        checks.append(_setting(setting, invalid))
    unknown = [(name, os.environ[name], *found) for name, *found in _config.unknown()]
    invalid += [(name, raw) for name, raw, *_ in unknown]  # a name none reads: not understood
    checks += [("fail", name, f"{raw!r} {problem}") for name, raw, _, problem in unknown]
    checks += [
        _startup_error(startup),
        ("ok" if covered else "fail", "activation", _activation(status, covered)),
        ("ok", "wrapt", status.wrapt_version)
        if status.wrapt_version
        else ("fail", "wrapt", "not installed: nothing can be patched"),
        _nvrx(status.nvrx_version, affected),
        _mcore(status.untested),
        affected and _automatic_release(),
    ]
    checks += [
        (FIX_LEVELS[fix.state.value], f"fix {fix.name}", f"{fix.state.value}: {fix.reason}")
        for fix in status.fixes
    ]
    rows = [
        (("FAIL" if affected else "warn") if level == "fail" else level, label, text)
        for level, label, text in filter(None, checks)
    ]

    names = {s.name for s in _config.SETTINGS} | {name for name, *_ in unknown}
    causes = [
        f"{label}: {text}"
        for level, label, text in filter(None, checks)
        if level == "fail"
        and label != "activation"
        and (label not in names or label in (_config.DISABLE, _config.AUTO))
    ]
    switches = (_config.DISABLE, _config.AUTO)  # their consequence is a cause of its own

    def fallback(which):
        which = [f"{name}={raw!r}" for name, raw in which]
        return (
            (
                f"the package does not understand {', '.join(which)} and falls back as said "
                f"above: fix or unset {'it' if len(which) == 1 else 'them'}"
            )
            if which
            else ""
        )

    off = [(_config.DISABLE, os.environ.get(_config.DISABLE, ""))]
    if _config.SETTINGS[0].check()[1] is not None:  # understood: a near miss of its name?
        off = [(name, raw) for name, raw, near_off, _ in unknown if near_off]
    others = [
        (name, raw) for name, raw in invalid if name not in switches and (name, raw) not in off
    ]
    if not affected:
        result, code = (
            (
                "ok: no NVRx with the IPC cache is installed; nothing needs the fix"
                + (f" (but {fallback(invalid)})" if invalid else "")
            ),
            0,
        )
    elif off:  # NVRX_IPC_FIX_DISABLE, or a near miss of its name: the package is off
        result, code = (
            (
                f"NVRx {status.nvrx_version} needs the fix, and {off[0][0]}="
                f"{off[0][1]!r} turns the package off in every process that has it "
                f"(start-up, `import nvrx_ipc_fix`, the Ray hook alike): unset it, or "
                f"set {_config.DISABLE} to the fixes to turn off (a comma list of "
                f"{', '.join(FIXES)})" + (f". Also, {fallback(others)}" if others else "") + "."
            ),
            1,
        )
    elif not causes and covered:
        how = (
            f"processes started like this one activate at start-up ({status.source}), "
            f"before NVRx is imported"
        )
        result, code = (f"ok: {how}", 0) if not others else (f"{how}, but {fallback(others)}.", 1)
    else:
        result, code = (
            (
                f"NVRx {status.nvrx_version} needs the fix, and processes started like "
                f"this one do not get it "
                f"({'; '.join(causes) or 'start-up did not activate'}). "
                f"Other ways: {OTHER_WAYS}." + (f" Also, {fallback(others)}." if others else "")
            ),
            1,
        )
    return _emit(out, rows, result, code, as_json)


def _emit(out, rows, result, code, as_json):
    """Print ``rows`` (``(mark, label, text)``) and the result, as lines or as one JSON
    object; return ``code``."""
    if as_json:
        out(
            json.dumps(
                {
                    "checks": [
                        {"level": mark.lower(), "label": label, "text": text}
                        for mark, label, text in rows
                    ],
                    "result": result,
                    "exit": code,
                },
                indent=2,
            )
        )
    else:
        for mark, label, text in rows:
            out(f"{mark:<4}  {label}: {text}")
        out(f"result: {result}")
    return code


def _setting(setting, invalid):
    """The check of one ``NVRX_IPC_FIX_*`` variable; records a value not understood."""
    raw, value, problem = setting.check()
    if problem:
        invalid.append((setting.name, raw))
    if setting.name == _config.DISABLE:
        if value is None:
            understood = raw.strip().lower() in _config._TRUE
            return (
                "fail",
                setting.name,
                f"{raw!r}: the package is off"
                + (
                    ""
                    if understood
                    else " (a value the kill switch does not understand turns it off)"
                ),
            )
        if value:
            return "warn", setting.name, f"{raw!r}: {', '.join(sorted(value))} off"
        return "ok", setting.name, "not set" if raw is None else f"{raw!r}: every fix on"
    if setting.name == _config.AUTO and not value:
        return (
            "fail",
            setting.name,
            f"{raw!r}: start-up activation is off"
            + (" (a value it does not understand turns it off)" if problem else ""),
        )
    if problem:
        return "fail", setting.name, f"{raw!r} {problem}"
    shown = setting.show(value)
    return (
        ("ok" if raw is None else "info"),
        setting.name,
        (f"not set: {shown}" if raw is None else f"{raw!r}: {shown}"),
    )


def _installed_pth():
    """Where the installed distribution put ``nvrx_ipc_fix.pth`` (from its RECORD), or None."""
    from importlib import metadata

    try:
        files = metadata.distribution("nvrx-ipc-fix").files or ()
    except metadata.PackageNotFoundError:
        return None
    return next((os.path.abspath(f.locate()) for f in files if f.name == PTH), None)


def _pth(path, ran, covered):
    where = os.path.dirname(path or "")
    if "pth" in ran:
        return "ok", PTH, f"in {where}, read at start-up"
    if "sitecustomize" in ran:
        return "info", PTH, "not read here; the sitecustomize fallback activates instead"
    if path is None or not os.path.exists(path):
        why = (
            "not installed (no nvrx-ipc-fix distribution lists it: a source tree on "
            "sys.path?): install the wheel, or use the sitecustomize fallback"
        )
    elif sys.flags.no_site:
        why = (
            f"in {where}, not read: `python -S` imports no site, so neither .pth files "
            "nor a sitecustomize run"
        )
    elif where not in _site_dirs():
        why = (
            f"in {where}, not read: Python reads .pth files only in site directories, and "
            f"this one is reached through PYTHONPATH or sys.path; fallback: "
            f"`python -m nvrx_ipc_fix install-sitecustomize {where}`"
        )
    else:
        why = f"in {where}, not read by this interpreter (a hidden file? an embedded Python?)"
    return ("info" if covered else "fail"), PTH, why


def _site_dirs():
    dirs = list(site.getsitepackages())
    if site.ENABLE_USER_SITE:
        dirs.append(site.getusersitepackages())
    return {os.path.abspath(d) for d in dirs}


def _sitecustomize(ran):
    if ran:
        return "ok", "sitecustomize", "the fallback ran at start-up"
    return "info", "sitecustomize", "did not run (the fallback where the .pth file is not read)"


def _startup_error(startup):
    error = getattr(startup, "error", None)
    return ("fail", "start-up", f"activation failed: {error}") if error else None


def _activation(status, covered):
    if not status.activated:
        return "not active"
    also = [s for s in status.requested_by if s != status.source]
    text = f"active, source {status.source}" + (f" (then {', '.join(also)})" if also else "")
    if not covered:
        text += ": only this command's own import; processes started like this one are not"
    return text


def _nvrx(version, affected):
    if version is None:
        return "info", "NVRx", "not installed: nothing to fix"
    if not affected:
        return "info", "NVRx", f"{version}: no IPC tensor cache (added in 0.6.0): nothing to fix"
    if _detect.untested(_detect.NVRX_DIST, version):
        return "warn", "NVRx", f"{version}: {_untested(_detect.NVRX_DIST)}"
    if _detect.release_has_cache(version) is None:
        return (
            "info",
            "NVRx",
            f"{version}: a dev or unknown build that may have the IPC cache: the fixes apply",
        )
    return "info", "NVRx", f"{version}: has the IPC tensor cache: the fixes apply"


def _automatic_release():
    """Which strategy the automatic release uses on this machine, and why (the driver is
    probed here), as the status says it."""
    from ..worker import suspend

    suspend.probe()
    return "info", "automatic release", suspend.automatic_release()


def _mcore(untested):
    """megatron-core's line, only where it is newer than tested."""
    version = untested.get(_detect.MCORE_DIST)
    return version and ("warn", _detect.MCORE_DIST, f"{version}: {_untested(_detect.MCORE_DIST)}")


def _untested(dist):
    return (
        f"untested (newest tested: {_detect.TESTED[dist]}): the fixes apply where their "
        f"checks of its code pass"
    )


def run_with(python, out=print, timeout=300, as_json=False):
    """``doctor`` under interpreter ``python``, started with this environment; its exit status."""
    try:
        probe = subprocess.run(
            [python, "-c", PROBE], capture_output=True, text=True, timeout=timeout
        )
        found = _json(probe.stdout) if probe.returncode == 0 else None
        keys = {"python", "version", "nvrx", "importable"}
        if not (isinstance(found, dict) and keys <= set(found)):
            raise ValueError(
                " ".join(
                    [
                        f"exit {probe.returncode}, no probe result",
                        *probe.stderr.strip().splitlines()[-1:],
                    ]
                )
            )
        if found.get("too_old"):
            return _emit(
                out,
                [
                    (
                        "FAIL",
                        "python",
                        f"{found['python']} is Python "
                        f"{found['version']}: nvrx-ipc-fix needs Python >= "
                        f"{'.'.join(map(str, MIN_PYTHON))}",
                    )
                ],
                "not checked: point --python at the interpreter your processes run",
                2,
                as_json,
            )
        if found["importable"]:
            checked = subprocess.run(
                [python, "-m", "nvrx_ipc_fix", "doctor", *(["--json"] if as_json else [])],
                capture_output=True,
                text=True,
                timeout=timeout,
            )
            sys.stderr.write(checked.stderr)
            for line in checked.stdout.rstrip().splitlines():
                out(line)
            return checked.returncode
    except (OSError, subprocess.SubprocessError, ValueError) as exc:
        return _emit(
            out,
            [("FAIL", "python", f"cannot run {python!r} as a Python interpreter: {exc}")],
            "not checked",
            2,
            as_json,
        )
    affected = _detect.may_cache(found["nvrx"])
    where = f"{found['python']} (Python {found['version']})"
    rows = [
        (
            "FAIL" if affected else "warn",
            "package",
            f"nvrx_ipc_fix is not importable by "
            f"{where}: not installed in its environment and not on its PYTHONPATH",
        ),
        _nvrx(found["nvrx"], affected),
    ]
    if not affected:
        return _emit(
            out,
            rows,
            "ok: no NVRx with the IPC cache is installed there; nothing needs the fix",
            0,
            as_json,
        )
    return _emit(
        out,
        rows,
        f"NVRx {found['nvrx']} needs the fix, and processes started with "
        f"{python} do not get it. Install nvrx-ipc-fix into that "
        f"environment, or make a bundle (`python -m nvrx_ipc_fix bundle "
        f"DIR`) and put DIR first on PYTHONPATH.",
        1,
        as_json,
    )


def _json(text):
    """The last line of ``text`` as JSON, or ``None``."""
    try:
        return json.loads(text.strip().splitlines()[-1])
    except (ValueError, IndexError):
        return None
