"""`hstu` command line. Tests call the same `main(argv)` the console script calls."""

from __future__ import annotations

import argparse
import sys

from hstu.errors import HSTUError


def _train(args: argparse.Namespace) -> int:
    from hstu import backends
    from hstu.config import load_config
    from hstu.launch_checks import preflight
    from hstu.metrics import format_summary, summarize

    # Every config and output-dir error is raised here, in the launching process, before any
    # rank starts (and before a framework is imported); the backend's launcher then bounds
    # dist.world_size by what the machine runs. The resolved config is printed by the logging
    # rank once the launcher fixed the world.
    cfg = load_config(args.config, args.overrides)
    preflight(cfg, args.backend)
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


def _eval(args: argparse.Namespace) -> int:
    import json
    from pathlib import Path

    from hstu import backends
    from hstu.config import load_config
    from hstu.convert import backend_convert, find_run_config
    from hstu.data.sources import open_prepared
    from hstu.eval_loop import baseline_metrics, evaluate, format_table

    config = args.config or find_run_config(args.checkpoint)
    if config is None:
        raise HSTUError(
            f"no --config given and no config.yaml found above {args.checkpoint}: pass the "
            "recipe the checkpoint was trained with"
        )
    cfg = load_config(config, args.overrides)
    if cfg.data.source != "prepared":
        raise HSTUError(
            "hstu eval needs held-out data: data.source=prepared data.path=DIR (the run's "
            f"config has data.source={cfg.data.source})"
        )
    dataset = open_prepared(cfg)
    ok, why = backends.available(args.backend)
    if not ok:
        raise HSTUError(why)
    state = backend_convert(args.backend).read_portable(Path(args.checkpoint), cfg)
    state.validate(cfg.model)
    scorer = backend_evaluate(args.backend).from_params(cfg, state.params, cfg.dist.device)
    max_users = cfg.eval.test_max_users if args.max_users is None else args.max_users
    results = evaluate(scorer, dataset, cfg, args.split, max_users)
    base = baseline_metrics(dataset, cfg, args.split, max_users) if args.baselines else {}
    title = f"{args.split} metrics ({args.backend} backend, {state.source}, step {state.step})"
    print(format_table(results, title, base))
    if args.out:
        report = {
            "split": args.split,
            "backend": args.backend,
            "checkpoint": state.source,
            "step": state.step,
            "dataset": dataset.manifest.dataset,
            "metrics": results,
            "baselines": base,
        }
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
        print(f"wrote {args.out}")
    return 0


def backend_evaluate(name: str):
    """`hstu.<name>_backend.evaluate` (imported on demand: the core never imports it)."""
    import importlib

    return importlib.import_module(f"hstu.{name}_backend.evaluate")


def _data(args: argparse.Namespace) -> int:
    from hstu.data.prepare import main as prepare_main

    return prepare_main(args.rest)


def _convert(args: argparse.Namespace) -> int:
    from hstu.config import load_config
    from hstu.convert import convert, describe, find_run_config

    config = args.config or find_run_config(args.src)
    if config is None:
        raise HSTUError(
            f"no --config given and no config.yaml found above {args.src}: pass the recipe "
            "the checkpoint was trained with"
        )
    cfg = load_config(config, args.overrides)
    state, written = convert(args.src_backend, args.dst_backend, args.src, args.dst, cfg)
    print(f"{args.src_backend} {state.source} -> {args.dst_backend} {written}: {describe(state)}")
    return 0


def _config_show(args: argparse.Namespace) -> int:
    from hstu.config import format_keys, load_config

    print(format_keys(load_config(args.config, args.overrides)))
    return 0


def _plot(args: argparse.Namespace) -> int:
    from hstu.plot import main as plot_main

    return plot_main(args.rest)


def _parity(args: argparse.Namespace) -> int:
    from hstu.parity import main as parity_main

    return parity_main(args)


def _bench(args: argparse.Namespace) -> int:
    if args.what == "balance":
        from hstu.bench.balance import main as bench_main
    elif args.what == "e2e":
        from hstu.bench.e2e import main as bench_main
    elif args.what == "attention":
        from hstu.bench.attention import main as bench_main
    elif args.what == "tables":
        from hstu.bench.tables import main as bench_main
    else:  # pragma: no cover - argparse restricts the choices
        raise HSTUError(f"unknown benchmark {args.what!r}")
    return bench_main(args.rest)


def _keys_epilog() -> str:
    from hstu.config import describe

    lines = ["config keys (key.sub=value; `hstu config show` adds the resolved values):"]
    lines += [f"  {k.key} ({k.type}, default {k.default!r}): {k.doc}" for k in describe()]
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="hstu",
        description="Workload-balanced data-parallel training of HSTU generative recommenders.",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    train = sub.add_parser(
        "train",
        help="train a recipe with the torch or jax backend",
        description="Train; key.sub=value arguments override the config. --config takes a "
        "YAML file or a packaged recipe's name (demo, gpu, bench_upstream, ...).",
        epilog=_keys_epilog(),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    train.add_argument("--backend", required=True, choices=["torch", "jax"])
    train.add_argument("--config", default="demo", help="recipe file or name (default: demo)")
    train.add_argument("overrides", nargs="*", metavar="key=value")
    train.set_defaults(func=_train)

    evaluate = sub.add_parser(
        "eval",
        help="evaluate a checkpoint on a prepared dataset's held-out split",
        description="Evaluate CHECKPOINT (a run directory, checkpoints root, step-N folder, or "
        "a parameters file) of the given backend on the valid or test split of the run's "
        "prepared dataset (data.path): the eval.* metrics, with popularity / random baselines. "
        "key=value arguments override the config (default: config.yaml above CHECKPOINT).",
    )
    evaluate.add_argument("--backend", required=True, choices=["torch", "jax"])
    evaluate.add_argument("checkpoint", metavar="CHECKPOINT_OR_RUN_DIR")
    evaluate.add_argument(
        "--config", default=None, help="the run's recipe (default: config.yaml above it)"
    )
    evaluate.add_argument("--split", default="test", choices=["valid", "test"])
    evaluate.add_argument(
        "--max-users",
        type=int,
        default=None,
        help="the first N users (default eval.test_max_users)",
    )
    evaluate.add_argument(
        "--no-baselines", dest="baselines", action="store_false", help="skip the baselines"
    )
    evaluate.add_argument("--out", default=None, help="also write the results to this JSON file")
    evaluate.add_argument("overrides", nargs="*", metavar="key=value")
    evaluate.set_defaults(func=_eval)

    data = sub.add_parser(
        "data",
        help="datasets: `hstu data prepare --dataset NAME --src DIR --out DIR`",
        description="prepare: convert a dataset as its publisher ships it (ml-1m, ml-20m, "
        "kuairand-pure, kuairand-1k, seq-txt) into the memory-mapped format that "
        "data.source=prepared data.path=DIR trains on. `hstu data prepare --help` for options.",
        add_help=True,
    )
    data.add_argument("action", choices=["prepare"])
    data.add_argument("rest", nargs=argparse.REMAINDER, help="arguments of `prepare`")
    data.set_defaults(func=_data)

    convert = sub.add_parser(
        "convert",
        help="convert a checkpoint between backends (parameters, AdamW state, data position)",
        description="Convert SRC (a run directory, checkpoints root, step-N folder, or a "
        "parameters file: *.pt torch state_dict, *.msgpack Flax params) written by one backend "
        "into DST for the other. A run directory as DST gets DST/checkpoints/step-N, which "
        "`hstu train ... output_dir=DST train.resume=true` resumes. key=value arguments "
        "override the config.",
    )
    convert.add_argument("--from", dest="src_backend", required=True, choices=["torch", "jax"])
    convert.add_argument("--to", dest="dst_backend", required=True, choices=["torch", "jax"])
    convert.add_argument("src", metavar="SRC")
    convert.add_argument("dst", metavar="DST")
    convert.add_argument(
        "--config", default=None, help="the run's recipe (default: config.yaml above SRC)"
    )
    convert.add_argument("overrides", nargs="*", metavar="key=value")
    convert.set_defaults(func=_convert)

    parity = sub.add_parser(
        "parity",
        help="train a recipe with both backends and compare the loss curves",
        description="Train the recipe with the torch and the jax backend (each in its own "
        "process) and print per-step losses side by side with their differences and each "
        "backend's tokens/s. Exits 1 when the largest relative difference exceeds --rtol "
        "(or a backend drifts from --golden).",
    )
    parity.add_argument("--config", default="demo", help="recipe file or name (default: demo)")
    parity.add_argument(
        "--rtol",
        type=float,
        default=None,
        help="largest allowed relative loss difference (default by model.dtype: float32 1e-4, "
        "float16 5e-3, bfloat16 3e-2; see hstu/parity.py for why)",
    )
    parity.add_argument(
        "--output-dir", default=None, help="where the two runs go (default: <output_dir>/parity)"
    )
    parity.add_argument("--golden", default=None, help="also check both curves against this file")
    parity.add_argument(
        "--write-golden", default=None, help="write the agreed curve to this golden file"
    )
    parity.add_argument("overrides", nargs="*", metavar="key=value")
    parity.set_defaults(func=_parity)

    config = sub.add_parser("config", help="show every config key: type, default, description")
    config_sub = config.add_subparsers(dest="action", required=True, metavar="ACTION")
    show = config_sub.add_parser(
        "show",
        help="print every key with its type, value, default and description",
        description="Print every config key with its type, resolved value (marked * where it "
        "differs from the default), default and a one-line description.",
    )
    show.add_argument("--config", default=None, help="recipe file or name (default: none)")
    show.add_argument("overrides", nargs="*", metavar="key=value")
    show.set_defaults(func=_config_show)

    plot = sub.add_parser(
        "plot",
        help="PNGs of a run: loss, throughput, per-rank load before/after balancing",
        add_help=False,
    )
    plot.add_argument("rest", nargs=argparse.REMAINDER)
    plot.set_defaults(func=_plot)

    bench = sub.add_parser(
        "bench",
        help="benchmarks (balance: partitioner quality and time; e2e: training end to end; "
        "attention: the kernel over a grid of shapes; tables: step time and memory against "
        "embedding table rows)",
    )
    bench.add_argument("what", choices=["balance", "e2e", "attention", "tables"])
    bench.add_argument("rest", nargs=argparse.REMAINDER, help="arguments of that benchmark")
    bench.set_defaults(func=_bench)
    return parser


def main(argv: list[str] | None = None) -> int:
    from hstu.launch_checks import die_with_env_parent

    die_with_env_parent()  # a benchmark's run: ends with the benchmark
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    # argparse stops filling a positional list at the first option, so overrides given after
    # an option (`SRC DST --config C key=value`) come back unparsed: they are overrides too.
    if extra and hasattr(args, "overrides") and not any(a.startswith("-") for a in extra):
        args.overrides = [*args.overrides, *extra]
    elif extra:
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    try:
        return args.func(args)
    except HSTUError as exc:
        print(f"hstu: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
