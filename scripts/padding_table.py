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
    p.add_argument("overrides", nargs="*")
    args = p.parse_args(argv)
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


if __name__ == "__main__":
    main()
