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


def _bench_llama(args: argparse.Namespace) -> int:
    from tpupedia import bench

    for name, value in (("layers", args.layers), ("hidden", args.hidden), ("seq", args.seq),
                        ("batch", args.batch), ("repeat", args.repeat)):
        if value < 1:
            raise SystemExit(f"tpupedia bench llama: --{name} must be a positive integer, got {value}")
    if args.hidden % 64:
        raise SystemExit(f"tpupedia bench llama: --hidden must be a multiple of 64 (head dim 64), got {args.hidden}")
    record = bench.bench_llama(layers=args.layers, hidden=args.hidden, seq=args.seq,
                               batch=args.batch, repeat=args.repeat)
    path = bench.merge_record(record, args.output)
    m = record["machine"]
    print(f"llama {args.layers}x{args.hidden}, batch {args.batch} x seq {args.seq} on "
          f"{m['device_kind']} ({m['cpu_count']} CPUs)")
    print(f"  torch eager   steady {record['torch_eager']['steady_s'] * 1e3:9.1f} ms")
    print(f"  torchax jit   steady {record['torchax_jit']['steady_s'] * 1e3:9.1f} ms "
          f"(first call {record['torchax_jit']['first_s']:.2f} s)")
    print(f"  ratio jit/eager {record['ratio_jit_over_eager']:.2f}, max abs diff {record['max_abs_diff']:.1e}")
    print(f"  written to {path}")
    return 0


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

    b = sub.add_parser("bench", help="benchmarks; results go to a JSON file the docs render")
    bsub = b.add_subparsers(dest="bench", required=True)
    ll = bsub.add_parser("llama", help="random Llama forward: torchax jit vs PyTorch eager")
    ll.add_argument("--layers", type=int, default=8)
    ll.add_argument("--hidden", type=int, default=512)
    ll.add_argument("--seq", type=int, default=512)
    ll.add_argument("--batch", type=int, default=4)
    ll.add_argument("--repeat", type=int, default=5)
    ll.add_argument("--output", default="docs/results/benchmarks.json", help="results file to merge into")
    ll.set_defaults(func=_bench_llama)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from tpupedia import devices

    devices.quiet_libtpu()  # no libtpu start-up noise on hosts without a TPU
    if args.command == "bench":
        from tpupedia import session

        session.quiet()
    return args.func(args)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
