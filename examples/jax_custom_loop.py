"""Use the JAX backend as a library: your own jitted loop around the balanced exchange.

The loop below builds the Flax HSTU model, computes a balanced shuffle plan on the host from
per-sample workloads, runs the exchange *inside* `shard_map` in a jitted function of its own,
and reuses the backend's train step (forward, backward, gradient all-reduce, AdamW) on the
balanced batch. No `hstu.pipeline.run`: every step is spelled out.

    python examples/jax_custom_loop.py --steps 5 --world-size 4 [--exchange all2all]
"""

from __future__ import annotations

import argparse
import functools
import time

import jax


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--world-size", type=int, default=4)
    ap.add_argument("--exchange", choices=["allgather", "all2all"], default="allgather")
    ap.add_argument("--config", default="configs/demo.yaml")
    args = ap.parse_args(argv)
    # Several host devices on a CPU machine: must be set before JAX initialises.
    jax.config.update("jax_num_cpu_devices", args.world_size)

    from jax.sharding import PartitionSpec as P

    from hstu.config import load_config
    from hstu.data.synthetic import dataset_from_config
    from hstu.jax_backend import batch as jb
    from hstu.jax_backend import collectives as col
    from hstu.jax_backend.model import build_model
    from hstu.jax_backend.shuffler import plan_exchange
    from hstu.jax_backend.train_step import init_state, make_optimizer, make_train_step
    from hstu.params import init_params
    from hstu.pipeline import (
        STAT_LOSS_TOKENS,
        STAT_REAL,
        STAT_WORKLOAD,
        gathered_lengths,
        sample_stats,
    )
    from hstu.shuffle_plan import make_plan
    from hstu.workload import HSTUCost

    cfg = load_config(args.config, [f"dist.world_size={args.world_size}"])
    w = cfg.dist.world_size
    mesh = col.make_mesh(jax.devices()[:w])
    model = build_model(cfg.model, cfg.data.max_seqlen)
    optimizer = make_optimizer(cfg.train)
    state = init_state(init_params(cfg.model, cfg.train.seed), optimizer, mesh)
    train_step = make_train_step(model, optimizer, mesh, donate=False)  # reused as is
    cost = HSTUCost.from_model_config(cfg.model)
    data = dataset_from_config(cfg, w, 0)

    @functools.partial(jax.jit, static_argnames="xspec")
    def balanced_step(state, batch, tables, global_loss_tokens, xspec):
        def exchange(b, t):  # per rank: this is where samples change device
            t = jax.tree.map(lambda x: x[0], t)
            fn = (
                col.exchange_allgather_local
                if xspec.kind == "allgather"
                else col.exchange_all2all_local
            )
            rows = (t["rows"],) if xspec.kind == "allgather" else (t["send_rows"], t["recv_rows"])
            return jb.rank_view(fn(jb.local_view(b), *rows, t["num_real"], xspec))

        spec = P(col.DATA_AXIS)
        balanced = col.shard_map(exchange, mesh=mesh, in_specs=(spec, spec), out_specs=spec)(
            batch, tables
        )
        return train_step(state, balanced, global_loss_tokens)

    for step in range(args.steps):
        t0 = time.perf_counter()
        host = data.global_batch(step)  # one JaggedBatch per rank (single process: all)
        stats = sample_stats(host, cost, cfg.model.task)  # [W * B, S]; multi-process: gather
        plan = make_plan(stats[:, STAT_WORKLOAD], stats[:, STAT_REAL].astype(bool), w)
        batch = jb.to_device(host, col.rank_sharding(mesh))
        xspec, tables = plan_exchange(
            plan, gathered_lengths(stats, host[0].keys), batch.spec, args.exchange
        )
        tables = {k: col.put_local(mesh, v) for k, v in tables.items()}
        glt = float(stats[:, STAT_LOSS_TOKENS].sum())
        state, metrics = balanced_step(state, batch, tables, glt, xspec=xspec)
        loads = stats[:, STAT_WORKLOAD].reshape(w, -1).sum(axis=1)
        after = stats[plan.indices, STAT_WORKLOAD].sum(axis=1)
        print(
            f"step {step} loss {float(metrics['loss']):.5f} "
            f"max/mean load {loads.max() / loads.mean():.3f} -> {after.max() / after.mean():.3f} "
            f"token capacity {batch.spec.token_capacity} -> {xspec.spec_out.token_capacity} "
            f"({time.perf_counter() - t0:.2f} s)",
            flush=True,
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
