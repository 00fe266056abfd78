"""Jitted data-parallel train step, the pipeline Backend, and `train(cfg)`.

The step is one jitted program: per rank (shard_map over "data") the model's loss divided by
the global loss-token count; the sum over ranks is the reported loss (a psum), and its gradient
with respect to the replicated params is the psum of the per-rank gradients (the transpose of
a replicated shard_map input), then Optax AdamW. Where a sample trains never changes the loss
or the gradient, so identity and balanced shuffling agree to float rounding.

Order of parallelism, in one place: (1) the core pipeline's balanced shuffle of the batch over
the data axis, (2) the data-parallel step over the same axis, params replicated; with sharded
tables (`embedding.sharding` != none, `make_sharded_train_step`) the step is (2a) the table
lookup (ids to their owners and rows back: 2 all_to_alls per table, `embedding.py`), (2b) the
data-parallel forward and backward with respect to the dense params and the looked-up rows,
(2c) the row gradients back to their owners (1 all_to_all per table) and the touched-rows
update, then AdamW on the dense params; all one jitted program, over the same axis.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from functools import partial

import jax
import numpy as np
import optax
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from hstu.errors import HSTUError
from hstu.jax_backend import collectives as col
from hstu.jax_backend import embedding as emb
from hstu.jax_backend.batch import (
    DeviceBatch,
    PackedBatch,
    candidate_bound,
    local_view,
    packed_width,
    spec_at_capacity,
)
from hstu.jax_backend.model import COPIES, DTYPES, HSTUModel, weight_copies
from hstu.jax_backend.shuffler import JaxShuffler, Placed
from hstu.jax_backend.state import (
    TrainState,
    copies_wanted,
    copy_state,
    init_sharded_state,
    init_state,
    make_optimizer,
    with_copies,
)
from hstu.pipeline import STAT_LOSS_TOKENS

__all__ = [
    "JaxBackend",
    "TrainState",
    "init_state",
    "item_ids",
    "make_loss_fn",
    "make_optimizer",
    "make_rows_loss_fn",
    "make_sharded_loss_fn",
    "make_sharded_train_step",
    "make_train_step",
    "read_capacity",
    "read_rows",
    "run_training",
]


def _vma_checked(model: HSTUModel) -> bool:
    """Whether shard_map may check varying-axes types: pallas_call outputs carry none, so a
    model running a Pallas kernel (attention, the uvqk SiLU's backward, the norms) runs
    unchecked."""
    return (
        model.attn.impl == "reference" and model.silu_kernel is None and model.norm_kernel is None
    )


def _variables(params, copies) -> dict:
    """`model.apply`'s variables: the params, and the weights' copies where the state has them
    (`TrainState.copies`)."""
    return {"params": params} if copies is None else {"params": params, COPIES: copies}


def _next_copies(copies, params):
    """The next step's weight copies from the updated `params` (None where there are none)."""
    if copies is None:
        return None
    return weight_copies(params, jax.tree.leaves(copies)[0].dtype)


def _copies_last(inner: Callable, arity: int) -> Callable:
    """`inner` (a shard_map of `arity` positional arguments, the weights' copies last) with
    the copies optional: None where left out (the forward casts the weights itself)."""

    def fn(*args):
        return inner(*args) if len(args) == arity else inner(*args, None)

    return fn


def make_loss_fn(model: HSTUModel, mesh: Mesh, train: bool = True) -> Callable:
    """`(params, batch, global_loss_tokens, rng, copies=None) -> (loss, aux)`: global, over
    all ranks; `copies`: the linears' weights in the compute dtype (`TrainState.copies`).

    Differentiable: its gradient is the all-reduced gradient. `batch` is a global DeviceBatch.
    """

    def per_rank(params, batch, global_loss_tokens, rng, copies):
        rng = jax.random.fold_in(rng, jax.lax.axis_index(col.DATA_AXIS))
        loss, aux = model.apply(
            _variables(params, copies),
            local_view(batch),
            global_loss_tokens,
            deterministic=not train,
            rngs={"dropout": rng},
        )
        return jax.lax.psum((loss, aux), col.DATA_AXIS)

    # unchecked with a Pallas kernel (`_vma_checked`); the gradient of the replicated params
    # is the psum of per-rank gradients either way.
    inner = col.shard_map(
        per_rank,
        mesh=mesh,
        in_specs=(P(), P(col.DATA_AXIS), P(), P(), P()),
        out_specs=(P(), P()),
        check=_vma_checked(model),
    )
    return _copies_last(inner, 5)


def make_rows_loss_fn(model: HSTUModel, mesh: Mesh) -> Callable:
    """`(params, rows, ids, batch, global_loss_tokens, rng, copies=None) -> (loss, aux)`:
    `make_loss_fn`'s loss with the item table read from `rows [U, D]`, the table's rows at the
    sorted ids `ids [U]` (every id the global batch reads), instead of the parameter.

    Each rank gets its own copy of the rows (`[W, U, D]`, split by rank), so that their
    gradient is every rank's own, summed over the ranks outside (the transpose of the
    broadcast: one all-reduce of `[U, D]`). Passed replicated (`P()`), the rows' gradient
    came out wrong under `check_vma` (jax 0.10.2, 4 CPU devices: every rank's row gradients
    summed into one row), while the dense params' did not."""

    def per_rank(params, rows, ids, batch, global_loss_tokens, rng, copies):
        rng = jax.random.fold_in(rng, jax.lax.axis_index(col.DATA_AXIS))
        loss, aux = model.apply(
            _variables(params, copies),
            local_view(batch),
            global_loss_tokens,
            deterministic=False,
            rngs={"dropout": rng},
            tables={"item": (ids, rows[0])},
        )
        return jax.lax.psum((loss, aux), col.DATA_AXIS)

    inner = col.shard_map(
        per_rank,
        mesh=mesh,
        in_specs=(P(), P(col.DATA_AXIS), P(), P(col.DATA_AXIS), P(), P(), P()),
        out_specs=(P(), P()),
        check=_vma_checked(model),
    )
    world = mesh.devices.size

    def loss_fn(params, rows, ids, batch, global_loss_tokens, rng, copies=None):
        per_rank_rows = jax.numpy.broadcast_to(rows[None], (world, *rows.shape))
        return inner(params, per_rank_rows, ids, batch, global_loss_tokens, rng, copies)

    return loss_fn


ITEM_KEYS = ("item", "candidate", "negative")  # the keys whose values index the item table


def item_ids(batch: DeviceBatch) -> jax.Array:
    """Every id the model may read from the item table for `batch` (padding included)."""
    parts = [batch.values[k].reshape(-1) for k in ITEM_KEYS if k in batch.values]
    return jax.numpy.concatenate(parts)


def read_capacity(batch: DeviceBatch) -> int:
    """How many distinct item ids `batch`'s real values can hold, known at trace time: per
    rank `L + K` items and candidates, at most the token capacity `T` (a rank's tokens
    `C + 2 L + K` fit in `T`), plus the negatives' capacity; at most every slot of
    `item_ids`. At T = 12,288 a rank's slots are 1.5 T (items T / 2, candidates T): a third
    fewer rows; with ranking's candidate bound (`BatchSpec.candidates_per_sample`) T / 2 + B K,
    bench_upstream's 8,192 at batch 32."""
    spec = batch.spec
    neg = spec.capacity("negative") if "negative" in spec.keys else 0
    slots = spec.capacity("item") + spec.capacity("candidate")
    ranks = batch.values["item"].size // spec.capacity("item")
    return ranks * (min(slots, spec.token_capacity) + neg)


def _real_ids(batch: DeviceBatch, fill: int) -> jax.Array:
    """`item_ids` with every padding slot set to `fill`: a rank's values of a key are its
    samples' (`lengths`) followed by padding."""
    jnp = jax.numpy
    parts = []
    for key in ITEM_KEYS:
        if key not in batch.values:
            continue
        v = batch.values[key]
        v = v.reshape(-1, v.shape[-1])  # [ranks, capacity]
        real = batch.lengths[key].reshape(v.shape[0], -1).sum(axis=1)
        slot = jnp.arange(v.shape[1])[None, :]
        parts.append(jnp.where(slot < real[:, None], v, fill).reshape(-1))
    return jnp.concatenate(parts)


def read_rows(table: jax.Array, batch: DeviceBatch) -> tuple[jax.Array, jax.Array] | None:
    """`(ids [U], rows [U, D])`: the item table's rows `batch`'s real values read (ascending,
    deduplicated, padded with the out-of-range id `V` and zero rows to `U = read_capacity`,
    known at trace time; `embedding.distinct_ids`); None where `U` reaches the table's `V` rows
    (the dense gradient is then no larger). A padding slot's id is left out: the model masks
    its token, and reads a zero row for an id `ids` lacks (`embedding.cached_lookup`); an id
    out of `[0, V)` (past the host check) reads NaN there. The real ids come first, so where
    they fill all `U` slots only the filler is cut."""
    num_items = table.shape[0]
    size = read_capacity(batch)
    if size >= num_items:
        return None
    ids = emb.distinct_ids(_real_ids(batch, num_items), num_items, size, num_items)
    return ids, table.at[ids].get(mode="fill", fill_value=0)


# Leaves below this many elements (biases, norm scales) are reduced together by `grad_norm`.
SMALL_LEAF = 1 << 16


def grad_norm(tree) -> jax.Array:
    """The L2 norm of `tree`'s leaves (fp32), as `optax.tree.norm`, but the small leaves in one
    reduction over their concatenation. Reduced one by one, each small leaf's reduction joins
    its optimizer update in a kernel of its own (XLA fuses the two, which read the same
    gradient), some 40 kernels a step; without it they are elementwise only, and on an H200
    a 1,024-element update then takes 1.5 us instead of 5.7 (docs/BENCHMARKS.md)."""
    f32 = jax.numpy.float32
    leaves = jax.tree.leaves(tree)
    small = [x.ravel().astype(f32) for x in leaves if x.size < SMALL_LEAF]
    total = sum(
        jax.numpy.sum(jax.numpy.square(x.astype(f32))) for x in leaves if x.size >= SMALL_LEAF
    )
    if small:
        total = total + jax.numpy.sum(jax.numpy.square(jax.numpy.concatenate(small)))
    return jax.numpy.sqrt(jax.numpy.asarray(total, f32))


def make_train_step(
    model: HSTUModel,
    optimizer: optax.GradientTransformation,
    mesh: Mesh,
    donate: bool = True,
    table_rows: bool = True,
) -> Callable:
    """Jitted `(state, batch, global_loss_tokens) -> (state, metrics)`; donates the state.

    `table_rows` (False: the dense gradient): the item table's gradient from the rows the batch
    reads. The loss differentiates with respect to those rows (`make_rows_loss_fn`), and the table's
    dense gradient is a gather of their gradients (zero for every other row) that XLA fuses
    into AdamW's update and the norm: no zero fill, scatter and read of a `[V, D]` gradient.
    The same update and norm (AdamW still moves every row). Across devices the rows are those
    of every rank's ids (the global batch's, deduplicated: `[U, D]`, a copy per rank), so the
    gradients' all-reduce carries `U` rows instead of the table's `V`. A program whose global
    batch may read as many rows as the table has (`U >= V`, known at trace time) takes the
    dense gradient. As torch reduces its replicated tables over the rows some rank looked up
    (`grad_sync.TouchedRowsReduce`). On 4 x H200 (`bench_upstream`, batch 32 per rank,
    balanced) the step is ~0.5 ms shorter than with the dense gradient, whose 400 MB
    all-reduce ends the backward (docs/BENCHMARKS.md)."""
    jnp = jax.numpy
    loss_fn = make_loss_fn(model, mesh)
    rows_loss_fn = make_rows_loss_fn(model, mesh)
    num_items = model.cfg.num_items

    def grads_of(params, batch, global_loss_tokens, rng, copies):
        table = params["embedding"]["item"]
        read = read_rows(table, batch) if table_rows else None
        if read is None:
            return jax.value_and_grad(loss_fn, has_aux=True)(
                params, batch, global_loss_tokens, rng, copies
            )
        ids, rows = read
        out, (grads, g_rows) = jax.value_and_grad(rows_loss_fn, argnums=(0, 1), has_aux=True)(
            params, rows, ids, batch, global_loss_tokens, rng, copies
        )
        slot = emb.slot_map(ids, num_items)
        g_table = jnp.where(slot[:, None] >= 0, g_rows[jnp.maximum(slot, 0)], 0.0)
        embedding = {**grads["embedding"], "item": g_table.astype(table.dtype)}
        return out, {**grads, "embedding": embedding}

    def step(state: TrainState, batch: DeviceBatch, global_loss_tokens):
        rng = jax.random.fold_in(state.rng, state.step)
        (loss, aux), grads = grads_of(state.params, batch, global_loss_tokens, rng, state.copies)
        updates, opt_state = optimizer.update(grads, state.opt_state, state.params)
        params = optax.apply_updates(state.params, updates)
        metrics = {"loss": loss, "grad_norm": grad_norm(grads), **aux}
        copies = _next_copies(state.copies, params)
        return TrainState(params, opt_state, state.step + 1, state.rng, copies=copies), metrics

    return jax.jit(step, donate_argnums=(0,) if donate else ())


def make_sharded_loss_fn(model: HSTUModel, mesh: Mesh, train: bool = True) -> Callable:
    """`(params, ids, rows, batch, global_loss_tokens, rng, copies=None) -> (loss, aux)` of a
    model with external tables: `ids[name] [W, U]`, `rows[name] [W, U, D]` each rank's cache
    (`embedding.make_lookup`). Its gradient with respect to `rows` is per rank (no sum)."""

    def per_rank(params, ids, rows, batch, global_loss_tokens, rng, copies):
        rng = jax.random.fold_in(rng, jax.lax.axis_index(col.DATA_AXIS))
        tables = {n: (ids[n][0], rows[n][0]) for n in ids}
        loss, aux = model.apply(
            _variables(params, copies),
            local_view(batch),
            global_loss_tokens,
            deterministic=not train,
            rngs={"dropout": rng},
            tables=tables,
        )
        return jax.lax.psum((loss, aux), col.DATA_AXIS)

    ranks = P(col.DATA_AXIS)
    inner = col.shard_map(
        per_rank,
        mesh=mesh,
        in_specs=(P(), ranks, ranks, ranks, P(), P(), P()),
        out_specs=(P(), P()),
        check=_vma_checked(model),
    )
    return _copies_last(inner, 7)


def make_sharded_train_step(
    model: HSTUModel,
    optimizer: optax.GradientTransformation,
    setup: emb.EmbeddingSetup,
    mesh: Mesh,
    donate: bool = True,
) -> Callable:
    """Jitted `(state, batch, global_loss_tokens) -> (state, metrics)` with sharded tables;
    donates the state (the tables' touched rows are written in place). `grad_norm` is that of
    the gradients a data-parallel run all-reduces, as in torch (docs/MODEL.md): the dense
    ones, and with `data_parallel` the tables' too (the touched rows': every other is zero)."""
    if not model.external_tables:
        raise HSTUError("embedding.sharding: the model must be built with external_tables=True")
    loss_fn = make_sharded_loss_fn(model, mesh)
    lookup = emb.make_lookup(setup, mesh, col.DATA_AXIS)
    update = emb.make_update(setup, mesh, col.DATA_AXIS)

    def step(state: TrainState, batch: DeviceBatch, global_loss_tokens):
        rng = jax.random.fold_in(state.rng, state.step)
        routes, rows = lookup(state.tables["weights"], batch)
        ids = {n: r["uniq"] for n, r in routes.items()}
        (loss, aux), (grads, g_rows) = jax.value_and_grad(loss_fn, argnums=(0, 2), has_aux=True)(
            state.params, ids, rows, batch, global_loss_tokens, rng, state.copies
        )
        tables, table_sq = update(state.tables, routes, g_rows)
        updates, opt_state = optimizer.update(grads, state.opt_state, state.params)
        params = optax.apply_updates(state.params, updates)
        if not setup.replicated:
            table_sq = 0.0
        norm = jax.numpy.sqrt(grad_norm(grads) ** 2 + table_sq)
        metrics = {"loss": loss, "grad_norm": norm, **aux}
        copies = _next_copies(state.copies, params)
        return TrainState(params, opt_state, state.step + 1, state.rng, tables, copies), metrics

    return jax.jit(step, donate_argnums=(0,) if donate else ())


def full_params(state: TrainState, setup: emb.EmbeddingSetup, mesh: Mesh):
    """The Flax params tree with the sharded tables gathered whole, replicated (evaluation)."""

    def merge(params, weights):
        tables = {lay.name: weights[lay.name][: lay.num_rows] for lay in setup.layouts}
        return {**params, "embedding": tables}

    replicated = jax.sharding.NamedSharding(mesh, P())
    return jax.jit(merge, out_shardings=replicated)(state.params, state.tables["weights"])


def bytes_on(tree, device) -> int:
    """The bytes of `tree`'s arrays held on `device` (its shards there)."""
    return sum(
        s.data.nbytes
        for leaf in jax.tree.leaves(tree)
        for s in getattr(leaf, "addressable_shards", ())
        if s.device == device
    )


def copy_fits(held: int, stats: dict | None, headroom: float = 2.0) -> bool:
    """Whether `headroom` x `held` bytes fit in the free memory a device's `memory_stats()`
    reports (a device that reports none, such as the CPU: True)."""
    if not stats or "bytes_limit" not in stats:
        return True
    return headroom * held <= stats["bytes_limit"] - stats.get("bytes_in_use", 0)


def _zero_update(optimizer: optax.GradientTransformation) -> Callable:
    """The AdamW update on zero gradients: the update's cost without its gradients."""

    def update(params, opt_state):
        grads = jax.tree.map(jax.numpy.zeros_like, params)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    return update


class JaxBackend:
    """The core trainer's Backend over a mesh: the shuffler's data half plus the fused step."""

    def __init__(
        self,
        shuffler: JaxShuffler,
        step_fn: Callable,
        state: TrainState,
        model: HSTUModel | None = None,
        optimizer: optax.GradientTransformation | None = None,
        tables: emb.EmbeddingSetup | None = None,
        build_ahead: Sequence[int] = (),
    ):
        """`build_ahead`: token capacities whose step programs are built at the first step,
        in parallel (`train.build_ahead`; the capacity policy's), beside its own."""
        self.shuffler, self.step_fn, self.state = shuffler, step_fn, state
        self.build_ahead = tuple(build_ahead)
        self._built: dict | None = None  # BatchSpec -> compiled step, after the first step
        self.model, self.optimizer = model, optimizer  # for `probe` (benchmarks)
        self.tables = tables  # sharded embedding tables (state.tables), or None
        self._full: tuple = (None, None)  # (state, its params with the tables gathered)
        self._timers: dict = {}
        self.world_size, self.local_ranks = shuffler.world_size, shuffler.local_ranks
        self.is_main = jax.process_index() == 0
        me = jax.process_index()
        self._devices = [d for d in shuffler.mesh.devices.flat if d.process_index == me]
        first = shuffler.mesh.devices.flat[0]
        self.device_name = first.device_kind if first.platform != "cpu" else "cpu"

    def to_device(self, batches):
        return self.shuffler.to_device(batches)

    def annotate(self, name: str):
        """A named host range in a jax.profiler trace (nothing when no trace runs)."""
        return jax.profiler.TraceAnnotation(name)

    def allgather_stats(self, local_stats: np.ndarray) -> np.ndarray:
        return self.shuffler.allgather_stats(local_stats)

    def exchange(self, placed: Placed, plan, stats: np.ndarray) -> Placed:
        return self.shuffler.exchange(placed, plan, stats)

    def forward_backward(self, placed: Placed, global_loss_tokens: int, stats=None):
        """Dispatches forward, backward, gradient psum *and* the AdamW update (one program,
        async): the pipeline's exchange of the next batch queues behind it. (`stats`: not
        read; the placed batch carries every size this program needs.)

        The loss-token count goes in as the replicated device scalar placed with the batch
        (`Placed.loss_tokens_device`): a host scalar would cost a transfer of its own per step.
        A batch that skipped the stats gather has none and passes the host value."""
        placed = self.shuffler.ensure(placed)
        self.shuffler.compiled.add(("train_step", placed.batch.spec))
        if placed.loss_tokens is not None and placed.loss_tokens != int(global_loss_tokens):
            raise HSTUError(
                f"forward_backward: the batch was placed with {placed.loss_tokens} global loss "
                f"tokens (its stats gather), but the step was given {int(global_loss_tokens)}"
            )
        tokens = placed.loss_tokens_device
        if tokens is None:
            tokens = np.float32(global_loss_tokens)
        if self.build_ahead and self._built is None and isinstance(tokens, jax.Array):
            self._build(placed.batch, tokens)
        step = self._program(placed.batch.spec, tokens)
        self.state, metrics = step(self.state, placed.batch, tokens)
        return metrics, placed

    def _program(self, spec, tokens) -> Callable:
        """The step for a batch of `spec`: its program built ahead (`_build`, which built for
        the device scalar of the loss tokens), else the jitted step."""
        if self._built and isinstance(tokens, jax.Array):
            return self._built.get(spec, self.step_fn)
        return self.step_fn

    def _build(self, batch: PackedBatch, tokens: jax.Array) -> None:
        """The step programs of `batch`'s capacity and of every capacity in `build_ahead`,
        lowered here one by one and compiled in threads at once (XLA compiles without the
        GIL), before the first step runs: a capacity's first step then finds its program
        built, and the run pays the longest compile instead of their sum. Nothing of a
        later step runs meanwhile, so no compile shares the devices with training (XLA's
        GPU autotuning times kernels on them). A capacity whose batch shapes do not follow
        from it (`spec_at_capacity`), or a batch past every capacity, compiles at its first
        step as before."""
        self._built = {}
        if not isinstance(batch, PackedBatch):
            return
        buf = batch.buffer
        specs = {batch.spec: batch}
        for t_cap in self.build_ahead:
            spec = spec_at_capacity(batch.spec, t_cap)
            if spec is not None and spec not in specs:
                shape = (buf.shape[0], packed_width(spec))
                abstract = jax.ShapeDtypeStruct(shape, buf.dtype, sharding=buf.sharding)
                specs[spec] = PackedBatch(abstract, spec)
        t0 = time.perf_counter()
        lowered = {s: self.step_fn.lower(self.state, b, tokens) for s, b in specs.items()}
        # the cores this process may run on (a launcher that binds each process to its own
        # share of the host's cores is obeyed)
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None
        workers = max(1, min(len(lowered), cores or os.cpu_count() or 1))
        with ThreadPoolExecutor(workers, thread_name_prefix="hstu-build") as pool:
            built = {s: pool.submit(low.compile) for s, low in lowered.items()}
            self._built = {s: future.result() for s, future in built.items()}
        for spec in self._built:
            self.shuffler.compiled.add(("train_step", spec))
        built_s, t1 = time.perf_counter() - t0, time.perf_counter()
        ran = self._run_once(buf, tokens)
        if self.is_main:
            caps = ", ".join(str(s.token_capacity) for s in self._built)
            print(
                f"train.build_ahead: {len(self._built)} step programs (token capacities {caps}) "
                f"built in {built_s:.1f} s, {workers} at a time, "
                + (
                    f"and run once on empty batches in {time.perf_counter() - t1:.1f} s"
                    if ran
                    else "not run ahead (a copy of the state does not fit beside it)"
                ),
                flush=True,
            )

    def _run_once(self, buf: jax.Array, tokens: jax.Array) -> bool:
        """Every built program run once on an empty batch of its shapes (an all-zero buffer:
        no sample), chained on a copy of the state that is then dropped; the state trains on
        untouched. A program's first run sets it up on the devices: 40-60 ms per program on
        an H200 host, which would otherwise land on the first step of its capacity (W=2,
        bench_upstream; docs/BENCHMARKS.md). Skipped (False) where the copy may not fit in
        the devices' free memory (large tables): those first steps pay it, as before."""
        device = self._devices[0]
        if not copy_fits(bytes_on(self.state, device), device.memory_stats()):
            return False
        state = copy_state(self.state)
        for spec, program in self._built.items():
            shape = (buf.shape[0], packed_width(spec))
            zeros = jax.jit(partial(jax.numpy.zeros, shape, buf.dtype), out_shardings=buf.sharding)
            state, _ = program(state, PackedBatch(zeros(), spec), tokens)
        jax.block_until_ready(state)
        return True

    def optimizer_step(self, handle):
        metrics, placed = handle  # the update was dispatched with the step: start the copies
        for value in metrics.values():
            value.copy_to_host_async()
        return metrics, placed.token_capacity, self.shuffler.num_compiles

    def fetch_metrics(self, pending) -> dict[str, float]:
        metrics, capacity, num_compiles = pending
        # Replicated scalars; read this process's copy (multi-process arrays are not fully
        # addressable, so no device_get of the global value).
        out = {k: float(np.asarray(v.addressable_data(0))) for k, v in metrics.items()}
        return out | {"token_capacity": capacity, "num_compiles": num_compiles}

    def probe(self, prepared, repeats: int = 3, phases: bool = True) -> dict:
        """Device timing of the step just fetched (`hstu bench e2e`); every process calls it.

        JAX fuses the step into one program, so its parts are timed as programs of their own
        on the same arrays: each local rank's forward + backward alone on one device, this
        process's first (`compute_s_before` / `_after`: the batch as loaded and as balanced;
        with sharded tables from the rows the step's lookup gives, as torch times them) and,
        with `phases`, the first rank's forward alone, the whole step (the training step's
        own program) and the update alone (both in place, state donated as in training, on a
        copy of the state; with sharded tables the update is the dense params' and the
        tables' touched rows'); `grad_reduce` is what the step takes beyond the slowest rank's
        forward + backward and the update (with sharded tables: the lookup's and the row
        gradients' exchanges too). Each program compiles once per shape."""
        from hstu.jax_backend import timing

        if self.model is None or self.optimizer is None:
            raise HSTUError("JaxBackend.probe needs the model and optimizer it was built with")
        mesh, setup = self.shuffler.mesh, self.tables
        if not self._timers:
            self._timers["rank"] = timing.RankTimer(self.model)
            if setup is None:
                self._timers["update"] = timing.donated_update(self.optimizer)
            else:
                self._timers["update"] = timing.donated_tables_update(self.optimizer, setup, mesh)
                self._timers["lookup"] = jax.jit(emb.make_lookup(setup, mesh, col.DATA_AXIS))
        jax.block_until_ready(self.state)
        devices = list(mesh.devices.flat)
        glt = float(prepared.stats[:, STAT_LOSS_TOKENS].sum())
        params, ranks = self.state.params, self._timers["rank"]

        def looked_up(placed):
            if setup is None:
                return None, None
            routes, rows = self._timers["lookup"](self.state.tables["weights"], placed.batch)
            return routes, ({n: r["uniq"] for n, r in routes.items()}, rows)

        # every local rank's shard runs on this process's first device: one compile per shape
        # rather than one per rank (the devices are of one kind)
        here = self._devices[0]

        def per_rank(placed, forward_only=False, looked=None, first_only=False):
            local = self.local_ranks[:1] if first_only else self.local_ranks
            return [
                ranks.time(
                    params, placed.batch, devices[r], glt, repeats, forward_only, looked, here
                )
                for r in local
            ]

        ensure = self.shuffler.ensure  # the host exchange leaves the loaded split on the host
        after_placed, before_placed = ensure(prepared.device_batch), ensure(prepared.loaded_batch)
        routes, after_looked = looked_up(after_placed)
        before = per_rank(before_placed, looked=looked_up(before_placed)[1])
        after = per_rank(after_placed, looked=after_looked)
        b = after_placed.batch.spec.batch_size
        ns = np.repeat(np.rint(np.array([before, after]).T * 1e9).astype(np.int64), b, axis=0)
        every = col.allgather_stats(mesh, ns)[::b] / 1e9  # [W, 2]
        out = {"compute_s_before": every[:, 0].tolist(), "compute_s_after": every[:, 1].tolist()}
        if phases:
            forward = per_rank(after_placed, True, after_looked, first_only=True)  # rank 0's
            # the step's own program, on its own inputs: nothing to compile
            batch, tokens = after_placed.batch, after_placed.loss_tokens_device
            step = self._program(batch.spec, tokens)
            tokens = np.float32(glt) if tokens is None else tokens
            step_s = timing.time_chained(lambda s: step(s, batch, tokens), self.state, repeats)
            update, st = self._timers["update"], self.state
            if setup is None:
                update_s = timing.time_chained(update, (st.params, st.opt_state), repeats)
            else:
                rows = after_looked[1]
                update_s = timing.time_chained(
                    lambda s: update(s, routes, rows), (st.params, st.opt_state, st.tables), repeats
                )
            out["device_s"] = {
                "forward": forward[0],
                "backward": after[0] - forward[0],
                "grad_reduce": max(0.0, step_s - float(every[:, 1].max()) - update_s),
                "optimizer": update_s,
                "step": step_s,
            }
        return out

    def evaluator(self):
        """Scores with the live parameters on this process's first device."""
        from hstu.jax_backend.evaluate import JaxEvaluator

        if self.model is None:
            raise HSTUError("JaxBackend.evaluator needs the model it was built with")
        bound = self.shuffler.candidates_per_sample  # the candidate keys sized as in training
        if self.tables is None:
            return JaxEvaluator(self.model, lambda: self.state.params, self._devices[0], bound)
        model = self.model.clone(external_tables=False)  # the tables as params again
        return JaxEvaluator(model, self._full_params, self._devices[0], bound)

    def _full_params(self):
        """One gathered tree per train state (the evaluator copies it once per step)."""
        if self._full[0] is not self.state:
            self._full = (self.state, full_params(self.state, self.tables, self.shuffler.mesh))
        return self._full[1]

    def prepare_evaluation(self) -> None:
        """Every process: gather sharded tables whole (a program over the whole mesh, so with
        several processes all of them run it), for the logging process's evaluator."""
        if self.tables is not None:
            self._full_params()

    def broadcast_flag(self, flag: bool) -> bool:
        if jax.process_count() == 1:  # one controller drives every rank
            return bool(flag)
        from jax.experimental import multihost_utils

        return bool(multihost_utils.broadcast_one_to_all(np.int32(flag)))

    def memory_gib(self) -> float | None:
        peaks = [(d.memory_stats() or {}).get("peak_bytes_in_use") for d in self._devices]
        peaks = [p for p in peaks if p is not None]
        return max(peaks) / 2**30 if peaks else None


def run_training(cfg, devices: list[jax.Device], on_step=None, source=None) -> list[dict]:
    """The core trainer over `devices`: this backend's step, shuffler and checkpointer."""
    from hstu import capacity, trainer
    from hstu.data import source_from_config
    from hstu.jax_backend.checkpoint import TrainCheckpointer
    from hstu.jax_backend.model import build_model
    from hstu.params import init_params, init_table_rows

    tc, sharded = cfg.train, cfg.embedding.sharded
    # the weights' copies' dtype, or None (before any collective: a bad value is named)
    copies = DTYPES[cfg.model.dtype] if copies_wanted(cfg.model.dtype) else None
    mesh = col.make_mesh(devices)
    model = build_model(
        cfg.model,
        cfg.data.max_seqlen,
        interpret=devices[0].platform == "cpu",
        external_tables=sharded,
    )
    optimizer = make_optimizer(tc)
    params = init_params(cfg.model, tc.seed, tables=not sharded)
    setup = emb.EmbeddingSetup.from_config(cfg, mesh.size) if sharded else None
    if setup is not None:  # each device's rows drawn alone: no whole table on the host

        def table_rows(name: str, start: int, stop: int) -> np.ndarray:
            return init_table_rows(cfg.model, tc.seed, f"embedding.{name}", start, stop)

        state = init_sharded_state(params, optimizer, setup, mesh, tc.seed, table_rows)
        step_fn = make_sharded_train_step(model, optimizer, setup, mesh)
    else:
        state = init_state(params, optimizer, mesh, tc.seed)
        step_fn = make_train_step(model, optimizer, mesh)
    if copies is not None:
        state = with_copies(state, copies)
    source = source if source is not None else source_from_config(cfg)
    policy = capacity.for_source(cfg, source, "jax")
    backend = JaxBackend(
        JaxShuffler(
            mesh,
            cfg.balance.exchange,
            policy.capacity,
            candidates_per_sample=candidate_bound(cfg),
        ),
        step_fn,
        state,
        model,
        optimizer,
        setup,
        build_ahead=policy.capacities if tc.build_ahead else (),
    )

    def set_state(tree: dict) -> None:
        state = TrainState.from_dict(tree)
        backend.state = with_copies(state, copies) if copies is not None else state

    checkpointer = TrainCheckpointer(
        cfg.output_dir, tc.keep_checkpoints, lambda: backend.state.as_dict(), set_state
    )
    return trainer.train(cfg, backend, checkpointer, source, "jax", on_step)
