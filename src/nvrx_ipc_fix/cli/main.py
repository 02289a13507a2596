"""``python -m nvrx_ipc_fix [status] [--json] [--no-import]``, ``doctor [--json]
[--python PATH]``, ``install-sitecustomize DIR``, ``bundle DIR``, ``demo``, ``selftest`` and
``--version``.

``--json`` works before the sub-command or after it, for the two that print JSON (status,
doctor); given to another, it is a usage error (exit 2), as ``--no-import`` is to any but
status."""

from __future__ import annotations

import argparse
import importlib
import json
import os
import sys

from ..core import __version__
from ..core.detect import CORE, FS, NVRX_DIST, distribution_version


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m nvrx_ipc_fix",
        description="Show what nvrx-ipc-fix does in this environment.",
    )
    parser.add_argument("--version", action="version", version=f"nvrx-ipc-fix {__version__}")
    sub = parser.add_subparsers(dest="command")
    show = sub.add_parser("status", help="print the status (the default)")
    doctor = sub.add_parser(
        "doctor",
        help="check that processes started like this one get "
        "the fix and every NVRX_IPC_FIX_* setting; exit 1 "
        "if an affected NVRx is installed and they do not, "
        "or a setting is not understood",
    )
    for p in (parser, show, doctor):
        # after the sub-command, SUPPRESS keeps the value given before it (argparse would
        # otherwise reset it to the sub-parser's default)
        default = False if p is parser else argparse.SUPPRESS
        p.add_argument("--json", action="store_true", default=default, help="print JSON")
        if p is not doctor:
            p.add_argument(
                "--no-import",
                action="store_true",
                default=default,
                help="do not import NVRx first (its targets stay 'pending')",
            )
    doctor.add_argument(
        "--python",
        metavar="PATH",
        help="check processes of that interpreter instead (a Ray "
        "py_executable, a NeMo RL actor venv's bin/python), started with "
        "this environment; exit 2 if it cannot be run",
    )
    site = sub.add_parser(
        "install-sitecustomize",
        help="write DIR/sitecustomize.py that activates the package at "
        "start-up (where .pth files are not read)",
    )
    site.add_argument(
        "directory",
        metavar="DIR",
        help="a directory early on sys.path, e.g. the PYTHONPATH entry of the install",
    )
    pack = sub.add_parser(
        "bundle",
        help="copy the package, its dependencies and a "
        "sitecustomize into DIR, for PYTHONPATH (NeMo RL's "
        "actor environments)",
    )
    pack.add_argument(
        "directory", metavar="DIR", help="a new or empty directory, or a bundle to refresh"
    )
    sub.add_parser(
        "demo", help="run the NVRx worker through the failures, without and with the fix"
    )
    sub.add_parser(
        "selftest",
        help="check the fix on this node (GPU memory, next-save time, "
        "correctness), without and with the package",
    )
    args, unknown = parser.parse_known_args(argv)
    if unknown:  # the usage of the sub-command they were given to, not the top level's
        sub.choices.get(args.command, parser).error(f"unrecognized arguments: {' '.join(unknown)}")
    if args.command not in (None, "status", "doctor") and args.json:
        parser.error(f"--json: {args.command} prints no JSON (status and doctor do)")
    if args.command not in (None, "status") and args.no_import:
        parser.error(f"--no-import applies to status, not {args.command}")
    if args.command in ("demo", "selftest"):
        return importlib.import_module(f".{args.command}", __package__).run()
    if args.command in ("install-sitecustomize", "bundle"):
        from .bundle import bundle
        from .sitecustomize import install

        code, message = (install if args.command == "install-sitecustomize" else bundle)(
            args.directory
        )
        print(message, file=sys.stderr if code else sys.stdout)
        return code
    if args.command == "doctor":
        from ..core.log import quiet
        from .doctor import run, run_with

        quiet()  # doctor reports every setting; the package's warnings would repeat them
        if args.python is not None:
            return run_with(args.python, as_json=args.json)
        _import_nvrx()
        return run(as_json=args.json)
    return _show(args.json, args.no_import)


def _run(argv=None):
    """``main()``, quiet when the reader of stdout goes away (``| head``)."""
    try:
        code = main(argv)
        sys.stdout.flush()
    except BrokenPipeError:
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no second error at exit
        code = 141  # 128 + SIGPIPE, as a shell reports a pipe's writer that the reader left
    return code


def _import_nvrx():
    """Import NVRx, if installed, so that the hooks fire and the probes can look."""
    if distribution_version(NVRX_DIST):
        for name in (CORE, FS):
            try:
                importlib.import_module(name)
            except Exception as exc:  # noqa: BLE001 a note, not the end
                print(
                    f"note: could not import {name}: {type(exc).__name__}: {exc}", file=sys.stderr
                )


def _show(as_json: bool, no_import: bool) -> int:
    import nvrx_ipc_fix
    from ..core import detect

    if not no_import:
        _import_nvrx()
    if detect.may_cache(detect.distribution_version(detect.NVRX_DIST)):
        from ..worker import suspend

        suspend.probe()  # the automatic release's line, as doctor says it (where it applies)
    snapshot = nvrx_ipc_fix.status()
    print(json.dumps(snapshot.to_dict(), indent=2) if as_json else snapshot.table())
    return 0
