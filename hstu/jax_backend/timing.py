"""Device timing of the JAX backend's compute, for `hstu bench e2e`.

JAX runs a whole step as one program over the mesh, so its parts are timed as programs of their
own, each on the devices and arrays the step uses (`median_time`: calls dispatched back to back,
then waited for, median of repeats, after a compiling warm-up):

* `RankTimer`: one rank's forward (+ backward) of its shard of a DeviceBatch, alone on its
  device (no collective, no update), differentiated as the step does: the per-rank compute
  time;
* `LocalTimer`: one device standing in for W ranks (`hstu bench e2e --simulate-ranks W`): each
  rank's local batch, padded as the W-rank run would pad it (the run's capacity policy), and
  the optimizer update.
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from collections.abc import Callable, Sequence

import jax
import numpy as np

from hstu.batch import JaggedBatch
from hstu.embedding_opt import touched_rows
from hstu.jax_backend import batch as jb
from hstu.jax_backend import collectives as col
from hstu.jax_backend.state import copy_state
from hstu.pipeline import loss_tokens


def median_time(
    run: Callable[[], object], repeats: int, warmup: int = 1, back_to_back: int = 4
) -> float:
    """Median seconds of one `run()` on the device: each sample dispatches `back_to_back` calls
    before waiting for them, so each call's dispatch overlaps the previous one's execution, as
    in the training loop, and the host's dispatch and wait latency is spread over the calls
    (one call waited for alone pays it in full: 1-3 ms per step-sized program)."""
    for _ in range(warmup):
        jax.block_until_ready(run())
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready([run() for _ in range(back_to_back)])
        times.append((time.perf_counter() - t0) / back_to_back)
    return statistics.median(times)


def donated_update(optimizer) -> Callable:
    """`((params, opt_state)) -> ((params, opt_state), None)`: the optimizer's update on zero
    gradients, jitted with its input donated (in place, as inside the train step), for
    `time_chained`."""
    from hstu.jax_backend.train_step import _zero_update

    update = _zero_update(optimizer)
    return jax.jit(lambda state: (update(*state), None), donate_argnums=(0,))


def donated_tables_update(optimizer, setup, mesh) -> Callable:
    """`((params, opt_state, tables), routes) -> ((params, opt_state, tables), None)`: with
    sharded tables the update of both, the dense params' on zero gradients and the tables'
    touched rows (those of `routes`, `embedding.make_lookup`'s) on zero row gradients,
    state donated, for `time_chained`."""
    from hstu.jax_backend import embedding as emb
    from hstu.jax_backend.train_step import _zero_update

    dense, tables_update = _zero_update(optimizer), emb.make_update(setup, mesh, col.DATA_AXIS)

    def update(state, routes, rows):
        params, opt_state, tables = state
        tables, _ = tables_update(tables, routes, jax.tree.map(jax.numpy.zeros_like, rows))
        return (*dense(params, opt_state), tables), None

    return jax.jit(update, donate_argnums=(0,))


def time_chained(fn: Callable, state, repeats: int) -> float:
    """Median seconds of `fn(state) -> (state, aux)`, a program that donates its state as the
    train step does: each call consumes the last one's output, on a copy of
    `state`, which is left alone. Timing such a program without donation also allocates and
    writes a second copy of the state every call: for bench_upstream's AdamW update on an
    H200, 3.1 against 1.3 ms (146.5M parameters: 1.8 GB of params and moments)."""
    held = [copy_state(state)]

    def run():
        held[0], _ = fn(held[0])
        return held  # waited for as it then stands: the latest state (earlier ones are donated)

    return median_time(run, repeats)


def shard_on(x: jax.Array, device) -> jax.Array:
    """The piece of `x` that lives on `device` (a rank's rows, or a replica)."""
    return next(s.data for s in x.addressable_shards if s.device == device)


class RankTimer:
    """Forward (+ backward) of one rank's batch shard, alone on its device, differentiated as
    the step differentiates: the item table's gradient from the rows the shard reads
    (`make_train_step`'s `table_rows`, no `[V, D]` gradient); with sharded tables (a model
    with external tables) from the rank's looked-up rows. The collectives and the update are
    not in the time."""

    def __init__(self, model):
        def loss(params, batch, global_loss_tokens, ids=None, rows=None):
            tables = None if ids is None else {n: (ids[n][0], rows[n][0]) for n in ids}
            out, _ = model.apply(
                {"params": params}, jb.local_view(batch), global_loss_tokens, tables=tables
            )
            return out

        def from_item_rows(params, batch, global_loss_tokens, ids=None, rows=None):
            from hstu.jax_backend.train_step import read_rows

            read = read_rows(params["embedding"]["item"], batch)
            if read is None:  # the step's dense gradient too
                value, grads = jax.value_and_grad(loss)(params, batch, global_loss_tokens)
                return value, (grads, {})
            uniq, item_rows = read
            value, (grads, g_rows) = jax.value_and_grad(
                lambda p, r: loss(p, batch, global_loss_tokens, {"item": uniq[None]}, {"item": r}),
                argnums=(0, 1),
            )(params, item_rows[None])
            dense = {k: g for k, g in grads["embedding"].items() if k != "item"}
            return value, ({**grads, "embedding": dense}, g_rows)

        self._forward = jax.jit(loss)
        if model.external_tables:
            self._forward_backward = jax.jit(jax.value_and_grad(loss, argnums=(0, 4)))
        else:
            self._forward_backward = jax.jit(from_item_rows)

    def time(
        self,
        params,
        batch: jb.DeviceBatch,
        device,
        global_loss_tokens: float,
        repeats: int = 3,
        forward_only: bool = False,
        looked_up: tuple[dict, dict] | None = None,
        run_on=None,
    ) -> float:
        """`looked_up`: `(ids, rows)` of `embedding.make_lookup` for `batch` (sharded tables).
        `run_on`: the device that runs it (default `device`): `device`'s shard is copied there
        first. A program is compiled per device it runs on, so timing every rank's shard on
        one device of the same kind compiles each shape once instead of once per rank."""
        run_on = device if run_on is None else run_on
        p = jax.tree.map(lambda x: shard_on(x, run_on), params)  # replicated: run_on's replica
        b, t = jax.tree.map(lambda x: shard_on(x, device), (batch, looked_up))
        if run_on != device:
            b, t = jax.device_put((b, t), run_on)
        ids, rows = t if t is not None else (None, None)
        fn = self._forward if forward_only else self._forward_backward
        glt = np.float32(global_loss_tokens)
        return median_time(lambda: fn(p, b, glt, ids, rows), repeats)


class LocalTimer:
    """One device standing in for W ranks: times each rank's local batch and the update."""

    def __init__(self, cfg, device=None, repeats: int = 3):
        from hstu.capacity import for_source
        from hstu.jax_backend import embedding as emb
        from hstu.jax_backend.model import build_model
        from hstu.jax_backend.state import init_sharded_state, init_state, make_optimizer
        from hstu.params import init_params, init_table_rows

        self.device = device or jax.devices()[0]
        self.cfg, self.repeats = cfg, repeats
        self.policy = for_source(cfg, backend="jax")  # the capacities a run of `cfg` pads to
        self.mesh = col.make_mesh([self.device])
        cpu = self.device.platform == "cpu"
        sharded, seed = cfg.embedding.sharded, cfg.train.seed
        self.model = build_model(
            cfg.model, cfg.data.max_seqlen, interpret=cpu, external_tables=sharded
        )
        self.optimizer = make_optimizer(cfg.train)
        params = init_params(cfg.model, seed, tables=not sharded)
        # sharded tables: every row on this one device (a replica), looked up and updated as
        # a data_parallel step does (any sharding holds every row at one device)
        self.setup = None
        if sharded:
            replica = dataclasses.replace(cfg.embedding, sharding="data_parallel")
            self.setup = emb.EmbeddingSetup.from_config(
                dataclasses.replace(cfg, embedding=replica), 1
            )
        if self.setup is None:
            self.state = init_state(params, self.optimizer, self.mesh, seed)
        else:

            def table_rows(name: str, start: int, stop: int) -> np.ndarray:
                return init_table_rows(cfg.model, seed, f"embedding.{name}", start, stop)

            self.state = init_sharded_state(
                params, self.optimizer, self.setup, self.mesh, seed, table_rows
            )
            self.lookup = jax.jit(emb.make_lookup(self.setup, self.mesh, col.DATA_AXIS))
        self.ranks = RankTimer(self.model)
        self.device_name = "cpu" if cpu else self.device.device_kind

    def time_ranks(
        self, local: Sequence[JaggedBatch], forward_only: bool = False, policy=None
    ) -> list[float]:
        """Each rank's local batch, sized as the W-rank run sizes it: every rank padded to the
        token capacity `policy` (`hstu.capacity.CapacityPolicy`, default: the config's) gives
        the largest rank, the shape the real step compiles for."""
        rank_lengths = {k: np.stack([b.lengths[k] for b in local]) for k in local[0].keys}
        spec = jb.spec_for(
            local[0],
            rank_lengths,
            (policy or self.policy).capacity,
            jb.candidate_bound(self.cfg),
        )
        total = float(sum(loss_tokens(b, self.cfg.model.task).sum() for b in local))
        out = []
        for b in local:
            if not b.actual_batch_size:
                out.append(0.0)
                continue
            placed = jb.to_device([b], col.rank_sharding(self.mesh), spec)
            looked = None
            if self.setup is not None:  # from the looked-up rows, as the run's probes time them
                routes, rows = self.lookup(self.state.tables["weights"], placed)
                looked = ({n: r["uniq"] for n, r in routes.items()}, rows)
            out.append(
                self.ranks.time(
                    self.state.params,
                    placed,
                    self.device,
                    total,
                    self.repeats,
                    forward_only,
                    looked,
                )  # fmt: skip
            )
        return out

    def time_optimizer(self, batches: Sequence[JaggedBatch] = ()) -> float:
        """The AdamW update of the dense params (on zero gradients), in place; with sharded
        tables also their touched-rows update on the rows `batches` (one step's, every rank's)
        touch, as a replica of `data_parallel` tables runs it (a row-wise owner moves its share
        of them)."""
        st = self.state
        if self.setup is None:
            return time_chained(
                donated_update(self.optimizer), (st.params, st.opt_state), self.repeats
            )
        update, routes, g_rows = self.update_program(batches)
        state = (st.params, st.opt_state, st.tables)
        return time_chained(lambda s: update(s, routes, g_rows), state, self.repeats)

    def update_program(self, batches: Sequence[JaggedBatch]) -> tuple[Callable, dict, dict]:
        """`(update, routes, g_rows)`: `donated_tables_update`'s program and its arguments for
        the rows `batches` touch (zero gradients)."""
        jnp = jax.numpy
        update = donated_tables_update(self.optimizer, self.setup, self.mesh)
        touched = touched_rows(batches)
        routes = {n: {"uniq": jnp.asarray(r[None].astype(np.int32))} for n, r in touched.items()}
        g_rows = {
            lay.name: jnp.zeros((1, touched[lay.name].size, lay.dim), jnp.float32)
            for lay in self.setup.layouts
        }
        return update, routes, g_rows
