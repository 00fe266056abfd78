"""Padding and programs of a run's batches, packed or not (`data.pack_window`), on the host.

    python scripts/padding_table.py [--config bench_upstream] [--steps 500] \
        [--batches 8,32,64] [--windows 0,2,4,8] [--backend jax] [key=value ...]

For each batch size B and window (in batches of B; 0: the stream's order) reads the batches
a W=1 run of `--steps` steps reads (`hstu.data.DataLoader` over `source_from_config`), pads
each to the capacity a run of `--backend` pads it to (`hstu.capacity.for_source`: with
`train.capacity_buckets=0`, the default, torch's graphs fit 48 capacities, jax's programs 8),
and prints the distinct capacities (the static-shape programs), the mean relative padding
(`padding_waste`) and the host time per batch. No model, no device: the numbers are the
data's and the policy's.

    python scripts/padding_table.py --world 2 [--steps 300] [--batches 32] [--windows 0,4]

With `--world W` (> 1) it reads the batches of a W-rank run instead and prints, per step
averaged over the run, what balancing has to work with: the ranks' largest real-token count
and largest FLOPs (`hstu.workload.HSTUCost`) over their mean under the identity split, the
same for the FLOPs split by `hstu.partition.partition`, and the speedup that predicts for a
compute-bound step (identity's largest rank over the balanced largest): whether packing, which
evens each rank's tokens, leaves the balanced shuffler anything to gain.
"""

from __future__ import annotations

import argparse
import time

import numpy as np


def main(argv=None) -> None:
    from hstu import capacity
    from hstu.config import load_config
    from hstu.data import DataLoader, source_from_config

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--config", default="bench_upstream")
    p.add_argument("--steps", type=int, default=500)
    p.add_argument("--batches", default="8,32,64")
    p.add_argument("--windows", default="0,2,4,8", help="in batches; 0: no packing")
    p.add_argument("--backend", default="jax", choices=["jax", "torch"])
    p.add_argument("--world", type=int, default=1, help="> 1: the ranks' imbalance instead")
    p.add_argument("overrides", nargs="*")
    args = p.parse_args(argv)
    if args.world > 1:
        print(
            f"{'batch':>5} {'window':>8} {'tokens max/mean':>15} {'FLOPs max/mean':>14} "
            f"{'balanced':>8} {'predicted speedup':>17}"
        )
        for b in (int(x) for x in args.batches.split(",")):
            for w in (int(x) for x in args.windows.split(",")):
                r = rank_imbalance(args.config, b, w * b, args.world, args.steps, args.overrides)
                print(
                    f"{b:>5} {w * b:>8} {r['tokens']:>15.3f} {r['identity']:>14.3f} "
                    f"{r['balanced']:>8.4f} {r['speedup']:>16.3f}x"
                )
        return
    print(f"{'batch':>5} {'window':>8} {'programs':>8} {'padding':>8} {'host ms/batch':>13}")
    for b in (int(x) for x in args.batches.split(",")):
        for w in (int(x) for x in args.windows.split(",")):
            cfg = load_config(
                args.config,
                [*args.overrides, "dist.world_size=1", f"data.batch_size={b}"]
                + [f"data.pack_window={w * b}"],
            )
            source = source_from_config(cfg)
            policy = capacity.for_source(cfg, source, args.backend)
            loader = DataLoader(source, b, 1, [0])
            t0 = time.perf_counter()
            tokens = np.array([next(loader)[0].num_real_tokens() for _ in range(args.steps)])
            host = (time.perf_counter() - t0) / args.steps
            caps = np.array([policy.capacity(int(t)) for t in tokens])
            print(
                f"{b:>5} {w * b:>8} {len(set(caps.tolist())):>8} "
                f"{100 * np.mean(caps / tokens - 1):>7.1f}% {1e3 * host:>13.2f}"
            )


def rank_imbalance(
    config: str, batch: int, window: int, world: int, steps: int, overrides=()
) -> dict:
    """Means over `steps` steps of a `world`-rank run (batch `batch` a rank, `window` samples
    packed, 0: none): `tokens` and `identity`, the largest rank's real tokens and FLOPs over
    the ranks' mean as the identity split gives them; `balanced`, the same for the FLOPs
    split by `hstu.partition.partition`; `speedup`, identity's largest FLOPs over the
    balanced largest."""
    from hstu.config import load_config
    from hstu.data import DataLoader, source_from_config
    from hstu.partition import partition
    from hstu.workload import HSTUCost

    cfg = load_config(
        config,
        [*overrides, f"dist.world_size={world}", f"data.batch_size={batch}"]
        + [f"data.pack_window={window}"],
    )
    cost = HSTUCost.from_model_config(cfg.model)
    loader = DataLoader(source_from_config(cfg), batch, world, list(range(world)))
    rows = []
    for _ in range(steps):
        batches = next(loader)
        tokens = np.array([b.num_real_tokens() for b in batches], float)
        flops = [cost.batch_flops(b) for b in batches]
        ident = np.array([f.sum() for f in flops], float)
        every = np.concatenate(flops)
        bal = np.array([every[part].sum() for part in partition(every, world)], float)
        rows.append(
            (
                tokens.max() / tokens.mean(),
                ident.max() / ident.mean(),
                bal.max() / bal.mean(),
                ident.max() / bal.max(),
            )
        )
    means = np.mean(rows, axis=0)
    return dict(zip(("tokens", "identity", "balanced", "speedup"), means.tolist(), strict=True))


if __name__ == "__main__":
    main()
