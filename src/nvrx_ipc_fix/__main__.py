"""``python -m nvrx_ipc_fix [status] [--json] [--no-import]``, ``demo`` and ``selftest``."""

from __future__ import annotations

import argparse
import importlib
import json
import sys

from ._detect import CORE, FS, NVRX_DIST, distribution_version


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m nvrx_ipc_fix",
                                     description="Show what nvrx-ipc-fix does in this environment.")
    sub = parser.add_subparsers(dest="command")
    show = sub.add_parser("status", help="print the status (the default)")
    for p in (parser, show):
        p.add_argument("--json", action="store_true", help="print JSON")
        p.add_argument("--no-import", action="store_true",
                       help="do not import NVRx first (targets stay 'pending')")
    sub.add_parser("demo", help="run the NVRx worker through the failures, "
                                "without and with the fix")
    sub.add_parser("selftest", help="check the fix on this node (GPU memory, next-save time, "
                                    "correctness), without and with the package")
    args = parser.parse_args(argv)
    if args.command in ("demo", "selftest"):
        import importlib

        return importlib.import_module(f".{args.command}", __package__).run()
    return _show(args.json, args.no_import)


def _show(as_json: bool, no_import: bool) -> int:
    import nvrx_ipc_fix

    if not no_import and distribution_version(NVRX_DIST):
        for name in (CORE, FS):  # import NVRx so the hooks fire and the probes can look
            try:
                importlib.import_module(name)
            except Exception as exc:
                print(f"note: could not import {name}: {type(exc).__name__}: {exc}",
                      file=sys.stderr)
    snapshot = nvrx_ipc_fix.status()
    print(json.dumps(snapshot.to_dict(), indent=2) if as_json else snapshot.table())
    return 0


if __name__ == "__main__":
    sys.exit(main())
