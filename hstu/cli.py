"""`hstu` command line. Tests call the same `main(argv)` the console script calls."""

from __future__ import annotations

import argparse
import sys

from hstu.errors import HSTUError


def _train(args: argparse.Namespace) -> int:
    from hstu import backends
    from hstu.config import load_config
    from hstu.metrics import format_summary, summarize

    cfg = load_config(args.config, args.overrides)
    print(f"# resolved config (backend={args.backend})\n{cfg.to_yaml()}", flush=True)
    train = backends.get_train(args.backend)
    rows = train(cfg)
    if rows:  # only the process that logs (rank 0) returns rows
        print(
            format_summary(
                summarize(rows),
                f"{args.backend} backend, "
                f"{cfg.dist.world_size} rank(s), shuffler={cfg.balance.shuffler}",
            )
        )
        print(f"metrics: {cfg.output_dir}/metrics.jsonl")
    return 0


def _bench(args: argparse.Namespace) -> int:
    if args.what == "balance":
        from hstu.bench.balance import main as bench_main
    else:  # pragma: no cover - argparse restricts the choices
        raise HSTUError(f"unknown benchmark {args.what!r}")
    return bench_main(args.rest)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="hstu",
        description="Workload-balanced data-parallel training of HSTU generative recommenders.",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    train = sub.add_parser(
        "train",
        help="train a recipe with the torch or jax backend",
        description="Train; key.sub=value arguments override the config.",
    )
    train.add_argument("--backend", required=True, choices=["torch", "jax"])
    train.add_argument("--config", default="configs/demo.yaml")
    train.add_argument("overrides", nargs="*", metavar="key=value")
    train.set_defaults(func=_train)

    bench = sub.add_parser("bench", help="benchmarks (balance: partitioner quality and time)")
    bench.add_argument("what", choices=["balance"])
    bench.add_argument("rest", nargs=argparse.REMAINDER, help="arguments of that benchmark")
    bench.set_defaults(func=_bench)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except HSTUError as exc:
        print(f"hstu: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
