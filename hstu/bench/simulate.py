"""`--simulate-ranks W`: what W ranks would gain from balancing, measured on one device.

The global batches of a W-rank run are drawn exactly as that run draws them (the same loader,
positions and seed), split by identity and by the balancer (the core plan, as every rank would
compute it), and each rank's local batch runs forward + backward alone on the one device, timed
on the device (`hstu.<backend>_backend.timing.LocalTimer`), padded to the token capacities a
W-rank run of that split would fit (`hstu.capacity`). A W-rank step waits for its slowest
rank, so the projected step is

    max over ranks (forward + backward) + update (+ what the real run adds: gradient reduction,
    and for the balancer its exposed host time, measured at the world size the machine has and
    stated as such)

and the projected speedup is identity's projected step over the balancer's. With sharded tables
(`embedding.sharding`) each rank is timed from its looked-up rows, as the run's probes time it,
and the update is the dense params' plus the tables' on the rows one global batch touches (what
a `data_parallel` replica updates; a row-wise owner updates its share). The report also
says how well FLOPs predict time: the per-rank time imbalance (max / mean) after balancing by
FLOPs, and the correlation of per-rank FLOPs with per-rank time.

Run per backend in its own process: `python -m hstu.bench.simulate --backend B --world W ...`.
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys

import numpy as np

from hstu.capacity import CapacityPolicy, for_source
from hstu.config import config_from_dict, load_config
from hstu.data import DataLoader, source_from_config
from hstu.pipeline import STAT_REAL, STAT_WORKLOAD, imbalance_of, sample_stats
from hstu.shuffle_plan import exchange_reference, identity_plan, make_plan
from hstu.workload import HSTUCost


def simulate(cfg, backend: str, world: int, num_batches: int, warmup: int = 1) -> dict:
    """Per-batch per-rank times under both splits, and the projection; see the module doc."""
    timing = importlib.import_module(f"hstu.{backend}_backend.timing")
    timer = timing.LocalTimer(cfg, repeats=cfg.bench.probe_repeats)
    cost = HSTUCost.from_model_config(cfg.model)
    source = source_from_config(cfg)
    loader = DataLoader(source, cfg.data.batch_size, world, range(world))
    # each split as a W-rank run of it pads its ranks: the capacities fitted for that run
    policies = {
        name: run_policy(cfg, world, name, source, backend) for name in ("identity", "balanced")
    }
    rows = []
    for i in range(warmup + num_batches):
        batches = next(loader)
        stats = sample_stats(batches, cost, cfg.model.task)
        real = stats[:, STAT_REAL].astype(bool)
        plans = {
            "identity": identity_plan(real, world),
            "balanced": make_plan(stats[:, STAT_WORKLOAD], real, world, cfg.balance.method),
        }
        row = {"batch": i}
        for name, plan in plans.items():
            local = exchange_reference(batches, plan)
            flops = stats[:, STAT_WORKLOAD].astype(np.float64)[plan.indices].sum(axis=1)
            rank_s = timer.time_ranks(local, policy=policies[name])
            row[name] = {"rank_s": rank_s, "rank_flops": flops.tolist()}
        if i >= warmup:  # the warm-up batch compiles (JAX buckets, Triton autotuning)
            rows.append(row)
    update_s = timer.time_optimizer(batches)  # sharded tables: this step's touched rows
    return summarize(rows, update_s, backend, world, timer.device_name)


def run_policy(
    cfg, world: int, shuffler: str, source, backend: str | None = None
) -> CapacityPolicy:
    """The capacity policy of a `world`-rank run of `cfg` with `shuffler` on `backend`."""
    tree = cfg.to_dict()
    tree["dist"]["world_size"], tree["balance"]["shuffler"] = world, shuffler
    return for_source(config_from_dict(tree), source, backend)


def summarize(rows: list[dict], update_s: float, backend: str, world: int, device: str) -> dict:
    out = {"backend": backend, "world": world, "device": device, "update_s": update_s}
    for name in ("identity", "balanced"):
        rank_s = np.array([r[name]["rank_s"] for r in rows])  # [batches, W]
        flops = np.array([r[name]["rank_flops"] for r in rows])
        projected = rank_s.max(axis=1) + update_s
        out[name] = {
            "projected_step_s": float(np.median(projected)),
            "max_rank_s": float(np.median(rank_s.max(axis=1))),
            "mean_rank_s": float(np.median(rank_s.mean(axis=1))),
            "imbalance_time": float(np.median([imbalance_of(t) for t in rank_s])),
            "imbalance_flops": float(np.median([imbalance_of(f) for f in flops])),
            "flops_time_corr": _corr(flops.ravel(), rank_s.ravel()),
            "per_batch_step_s": projected.tolist(),
        }
    out["batches"] = [r["batch"] for r in rows]  # the run's step index of each batch
    out["projected_speedup"] = (
        out["identity"]["projected_step_s"] / out["balanced"]["projected_step_s"]
    )
    out["rows"] = rows
    return out


def _corr(a: np.ndarray, b: np.ndarray) -> float:
    if a.size < 2 or np.std(a) == 0 or np.std(b) == 0:
        return float("nan")
    return float(np.corrcoef(a, b)[0, 1])


def projected_speedup(sim: dict, extra_s: float = 0.0, exchange_s: float = 0.0) -> float:
    """Identity's projected step over the balancer's, with what the real run adds (`extra_s`
    to both, `exchange_s` to the balancer's)."""
    return (sim["identity"]["projected_step_s"] + extra_s) / (
        sim["balanced"]["projected_step_s"] + extra_s + exchange_s
    )


def format_simulation(
    sim: dict, extra_s: float = 0.0, extra_note: str = "", exchange_s: float = 0.0
) -> str:
    """The projection table; `extra_s` (both splits) and `exchange_s` (the balancer's only)
    are what the real run adds at its world size, measured there."""
    w = sim["world"]
    added = {"identity": extra_s, "balanced": extra_s + exchange_s}
    lines = [
        f"simulated W={w} on one {sim['device']} ({sim['backend']}): per-rank forward+backward "
        f"timed alone, update {1e3 * sim['update_s']:.2f} ms"
        + (f", plus {1e3 * extra_s:.2f} ms {extra_note}" if extra_s else "")
        + (
            f", plus {1e3 * exchange_s:.2f} ms exposed balancer time (balanced)"
            if exchange_s
            else ""
        ),
        f"{'split':<10}{'projected step':>16}{'slowest rank':>14}{'mean rank':>11}"
        f"{'imb. time':>11}{'imb. FLOPs':>12}{'corr':>7}",
    ]
    for name in ("identity", "balanced"):
        s = sim[name]
        lines.append(
            f"{name:<10}{1e3 * (s['projected_step_s'] + added[name]):>13.2f} ms"
            f"{1e3 * s['max_rank_s']:>11.2f} ms{1e3 * s['mean_rank_s']:>8.2f} ms"
            f"{s['imbalance_time']:>11.3f}{s['imbalance_flops']:>12.3f}"
            f"{s['flops_time_corr']:>7.2f}"
        )
    speedup = projected_speedup(sim, extra_s, exchange_s)
    lines.append(f"projected balanced speedup at W={w}: {speedup:.3f}x")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m hstu.bench.simulate")
    parser.add_argument("--backend", required=True, choices=["torch", "jax"])
    parser.add_argument("--config", required=True)
    parser.add_argument("--world", type=int, required=True)
    parser.add_argument("--batches", type=int, default=8)
    parser.add_argument("--out", default=None, help="write the result as JSON here")
    parser.add_argument("overrides", nargs="*", metavar="key=value")
    args = parser.parse_args(argv)
    cfg = load_config(args.config, args.overrides)
    if args.backend == "jax":
        from hstu.jax_backend.launch import init_distributed

        init_distributed()
    sim = simulate(cfg, args.backend, args.world, args.batches)
    print(format_simulation(sim), flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(sim, f)
    return 0


if __name__ == "__main__":
    from hstu.launch_checks import die_with_env_parent

    die_with_env_parent()  # started by `hstu bench e2e`: ends with it
    sys.exit(main())
