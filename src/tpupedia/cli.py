"""The `tpupedia` command. Each subcommand is a thin shell over a library function."""

from __future__ import annotations

import argparse
import sys

from tpupedia import __version__

__all__ = ["main", "build_parser"]


def _doctor(args: argparse.Namespace) -> int:
    from tpupedia import doctor

    report = doctor.run(topology=args.topology)
    print(report.to_json() if args.json else doctor.format_report(report))
    return 0 if all(c.ok for c in report.checks) else 1


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="tpupedia",
        description="gpu-tpu-pedia helpers: check a machine, plan and run TPU video generation.",
    )
    parser.add_argument("--version", action="version", version=f"tpupedia {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("doctor", help="platform, devices, versions, AOT availability, preset")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.add_argument(
        "--topology", default="v6e:2x4", help="TPU slice to try an AOT description of (v6e:2x4)"
    )
    p.set_defaults(func=_doctor)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
