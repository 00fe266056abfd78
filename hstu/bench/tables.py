"""`hstu bench tables`: embedding tables at scale, step time and memory against table rows.

    hstu bench tables --config gpu [--backends torch,jax] [--rows 1000000,100000000]
        [--sharding row_wise] [--replicated 10000000] [--repeats R] [--steps N] [--out DIR]
        [key=value ...]

Every (backend, rows) pair trains in its own process (`hstu train`, identity shuffler, the
config's `dist.world_size`) with the item table at that many rows, sharded as `--sharding`
says; `--replicated ROWS` adds a run with `embedding.sharding=none` (dense tables, AdamW) for
the memory comparison. Runs go in rounds (`--repeats`): every pair once per round, so a slow
drift of the machine falls on all of them. The batches are the same in every run (lengths
from the data seed; item ids drawn from each table's rows).

Per row: the median step over the timed steps of all its rounds, each round's median, the
ratio to the backend's smallest sharded table (the update touches rows, not the table: it
should stay near 1), peak device memory, and the table's bytes per device. Writes
`tables.json` under `--out`.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from hstu.backends import check_names as check_backend_names
from hstu.bench.e2e import _train, summarize_run
from hstu.config import load_config
from hstu.errors import HSTUError


def _rows_list(text: str) -> list[int]:
    try:
        rows = [int(x) for x in text.split(",") if x]
    except ValueError:
        raise HSTUError(f"hstu bench tables: --rows takes integers, got {text!r}") from None
    if not rows or min(rows) <= 0:
        raise HSTUError(f"hstu bench tables: --rows must be positive integers, got {text!r}")
    return rows


def plan_runs(backends, rows, sharding: str, replicated: int) -> list[tuple[str, str, int]]:
    """(backend, sharding, rows) of one round, in the order they run."""
    out = [(b, sharding, r) for b in backends for r in rows]
    if replicated:
        out += [(b, "none", replicated) for b in backends]
    return out


def table_gib_per_device(rows: int, dim: int, sharding: str, world: int) -> float:
    """fp32 table bytes one device holds: a row-wise (or table-wise: the whole table on one
    device, the largest share) shard, or the whole table when replicated."""
    share = rows if sharding in ("none", "table_wise", "data_parallel") else -(-rows // world)
    return share * dim * 4 / 2**30


def format_table(results: list[dict]) -> str:
    head = (
        f"{'backend':<8}{'rows':>13}  {'sharding':<10}{'step ms':>9}{'rounds (ms)':>22}"
        f"{'vs smallest':>13}{'peak GiB':>10}{'table GiB/dev':>15}"
    )
    lines = [head, "-" * len(head)]
    for r in results:
        rounds = " ".join(f"{x:.2f}" for x in r["step_ms_runs"])
        ratio = f"{r['vs_smallest']:.3f}x" if r.get("vs_smallest") else "-"
        peak = f"{r['max_memory_gib']:.1f}" if r.get("max_memory_gib") is not None else "-"
        lines.append(
            f"{r['backend']:<8}{r['rows']:>13,}  {r['sharding']:<10}{r['step_ms']:>9.2f}"
            f"{rounds:>22}{ratio:>13}{peak:>10}{r['table_gib_per_device']:>15.2f}"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="hstu bench tables", description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", default="gpu")
    parser.add_argument("--backends", default="torch,jax")
    parser.add_argument("--rows", default="1000000,100000000", help="item table rows, per run")
    parser.add_argument("--sharding", default="row_wise", help="embedding.sharding of the runs")
    parser.add_argument(
        "--replicated", type=int, default=0, help="rows of an extra sharding=none run (0: none)"
    )
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--out", default=None, help="default: <output_dir>/bench_tables")
    parser.add_argument("overrides", nargs="*", metavar="key=value")
    args = parser.parse_args(argv)
    rows = _rows_list(args.rows)
    if args.repeats < 1:
        raise HSTUError(f"hstu bench tables: --repeats must be >= 1, got {args.repeats}")
    if args.sharding == "none":
        raise HSTUError("hstu bench tables: --sharding names a sharded layout (see --replicated)")
    backends = args.backends.split(",")
    check_backend_names(backends, "hstu bench tables")
    plan = plan_runs(backends, rows, args.sharding, args.replicated)

    def overrides(sharding: str, num_rows: int) -> list[str]:
        return [*args.overrides, f"model.num_items={num_rows}", f"embedding.sharding={sharding}"]

    # every run's config checked here, before any run
    cfgs = {(b, s, n): load_config(args.config, overrides(s, n)) for b, s, n in plan}
    world = next(iter(cfgs.values())).dist.world_size
    out = Path(args.out or Path(next(iter(cfgs.values())).output_dir) / "bench_tables")
    out.mkdir(parents=True, exist_ok=True)
    # `_train` reads these fields of the e2e arguments: identity, no probes
    e2e_args = argparse.Namespace(
        config=args.config, steps=args.steps, probe_every=0, breakdown=False
    )
    runs: dict[tuple, list[list[dict]]] = {key: [] for key in plan}
    for rnd in range(args.repeats):
        for i, (b, s, n) in enumerate(plan):
            t0 = time.time()
            e2e_args.overrides = overrides(s, n)
            where = out / f"{b}-{s}-{n}" / f"run{rnd}"
            got = _train(e2e_args, b, "identity", "-", where)
            runs[(b, s, n)].append(got)
            med = summarize_run([got], world)["step_ms"]
            print(
                f"[{rnd * len(plan) + i + 1}/{len(plan) * args.repeats}] {b} {n:,} rows {s}: "
                f"{med:.2f} ms/step ({time.time() - t0:.0f} s)",
                flush=True,
            )
    results = []
    for (b, s, n), key_runs in runs.items():
        r = summarize_run(key_runs, world)
        dim = cfgs[(b, s, n)].model.embedding_dim
        results.append(
            {
                "backend": b,
                "sharding": s,
                "rows": n,
                "step_ms": r["step_ms"],
                "step_ms_runs": r["step_ms_runs"],
                "steps_timed": r["steps_timed"],
                "max_memory_gib": r["max_memory_gib"],
                "table_gib_per_device": table_gib_per_device(n, dim, s, world),
                "loss_last": r["loss_last"],
            }
        )
    for r in results:
        if r["sharding"] == args.sharding:
            base = next(
                x for x in results if x["backend"] == r["backend"] and x["rows"] == min(rows)
            )
            r["vs_smallest"] = r["step_ms"] / base["step_ms"]
    print(f"\nhstu bench tables: {args.config} {' '.join(args.overrides)}, W={world}")
    print(format_table(results))
    report = {"config": args.config, "overrides": args.overrides, "world_size": world}
    report |= {"repeats": args.repeats, "steps": args.steps, "runs": results}
    (out / "tables.json").write_text(json.dumps(report, indent=1))
    print(f"\nwrote {out / 'tables.json'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
