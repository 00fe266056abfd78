"""Sharded embedding tables (`embedding.sharding` != none): layout, lookup, touched-rows optimizer.

Layout. Each table (`item`, `action`, `contextual`) is cut row-wise over the mesh's "data" axis
in contiguous blocks: `R` rows padded with zero rows to `W * ceil(R / W)`, rank `o` owning rows
`[o * Rl, (o + 1) * Rl)`, as TorchRec's row-wise sharding. `auto` and `table_wise` place the
tables row-wise too: a table on one device of the SPMD mesh would need a placement outside the
one program every device runs, and the update is per row, so where a row lives never changes
the numbers. `data_parallel` keeps every table whole on every device (replicated).

Lookup (per rank, inside shard_map; ids that only pad a capacity never count):

1. the rank's distinct ids of a table, `[U]` ascending with a sentinel past every row after them
   (`distinct_ids`: a map over the table's rows, or a sort where the table dwarfs the ids);
2. the ids sorted, so those of owner `o` are one contiguous run: sent in a `[W, C]` block
   (`C = min(U, Rl)`: no run can overflow, at the price of W times the ids a balanced batch
   needs; a tighter capacity with an overflow path is left to do) by one `all_to_all`;
3. owners gather the rows and send them back by a second `all_to_all`: the rank then holds a
   cache `(ids [U], rows [U, D])` the model reads every lookup from (`cached_lookup`).

The model is differentiated with respect to the cached rows (never the table: the transpose of
a gather into a table is a dense `[rows, D]` scatter), so its gradient is one row gradient per
distinct id, summed over the rank's lookups. `send_grads` moves those back along the same
routes (`all_to_all`), the owner deduplicates what it received (a row several ranks read) and
sums: `g_r` of docs/MODEL.md. `data_parallel` gathers ids and row gradients from every rank
instead, and every rank applies the same update to its replica.

Update (`apply_rows`): only the touched rows and their state change, read and written by
scatter on donated buffers: nothing per step is the size of a table.

* `row_wise_adagrad`: `s_r += mean_d g_r,d^2`; `w_r -= lr * g_r / (sqrt(s_r) + eps)`
* `adam` (fbgemm's ADAM, t = table steps taken including this one, 1 on the first):
  `m_r = b1 m_r + (1 - b1) g_r`, `v_r = b2 v_r + (1 - b2) g_r^2`,
  `w_r -= lr * (m_r / (1 - b1^t) / (sqrt(v_r / (1 - b2^t)) + eps) + weight_decay * w_r)`
"""

from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np

from hstu import embedding_opt
from hstu.errors import HSTUError

TABLES = ("item", "action", "contextual")
TABLE_KEYS = embedding_opt.TABLE_KEYS  # batch keys whose values each table is read at
STATE_FIELDS = {"row_wise_adagrad": ("sum",), "adam": ("m", "v")}


@dataclass(frozen=True)
class TableLayout:
    """Where one table's rows live: `num_rows` real rows, `padded_rows` stored."""

    name: str
    num_rows: int
    dim: int
    world_size: int
    replicated: bool  # data_parallel: every rank holds every row

    @property
    def rows_per_rank(self) -> int:
        return self.num_rows if self.replicated else -(-self.num_rows // self.world_size)

    @property
    def padded_rows(self) -> int:
        return self.num_rows if self.replicated else self.rows_per_rank * self.world_size

    @property
    def sentinel(self) -> int:
        """The id that fills static-size id buffers: past every stored row, so it sorts last,
        has no owner and reads / writes nothing."""
        return self.padded_rows


@dataclass(frozen=True)
class EmbeddingSetup:
    """The sharded tables of a run (static: part of the step's jit key)."""

    layouts: tuple[TableLayout, ...]
    optimizer: str
    lr: float
    eps: float
    beta1: float
    beta2: float
    weight_decay: float

    @classmethod
    def from_config(cls, cfg, world_size: int) -> EmbeddingSetup:
        ec, mc = cfg.embedding, cfg.model
        if not ec.sharded:
            raise HSTUError("embedding.sharding=none: the tables are dense parameters")
        if ec.optimizer not in STATE_FIELDS:
            raise HSTUError(
                f"embedding.optimizer={ec.optimizer!r}: the JAX backend has {sorted(STATE_FIELDS)}"
            )
        rows = {"item": mc.num_items, "action": mc.num_actions, "contextual": mc.num_contextual_ids}
        replicated = ec.sharding == "data_parallel"
        layouts = tuple(
            TableLayout(n, rows[n], mc.embedding_dim, world_size, replicated) for n in TABLES
        )
        return cls(layouts, ec.optimizer, ec.lr, ec.eps, ec.beta1, ec.beta2, ec.weight_decay)

    @property
    def replicated(self) -> bool:
        return self.layouts[0].replicated

    @property
    def state_fields(self) -> tuple[str, ...]:
        return STATE_FIELDS[self.optimizer]

    def layout(self, name: str) -> TableLayout:
        return next(lay for lay in self.layouts if lay.name == name)


# ------------------------------------------------------------------------------ state
def pad_rows(table: np.ndarray, lay: TableLayout) -> np.ndarray:
    out = np.zeros((lay.padded_rows, *np.shape(table)[1:]), np.float32)
    out[: lay.num_rows] = table
    return out


def device_tables(setup: EmbeddingSetup, mesh, axis: str, rows_of) -> dict:
    """The tables tree `{"weights": {name}, <state field>: {name}, "count"}` on `mesh`, never a
    whole table on the host: each device's block of rows comes from `rows_of(name, start,
    stop)` (fp32 `[stop - start, D]`, real rows only; padding rows are zero), and the optimizer
    state is zero (fbgemm's initial state)."""
    from jax.sharding import NamedSharding

    spec = tables_spec(setup, axis)

    def placed(shape, partition, fill):
        def block(index):
            bounds = [sl.indices(n) for sl, n in zip(index, shape, strict=False)]
            return fill(*bounds[0][:2]) if bounds else fill(0, 0)

        return jax.make_array_from_callback(shape, NamedSharding(mesh, partition), block)

    tree: dict = {"weights": {}}
    tree["count"] = placed((), spec["count"], lambda a, b: np.zeros((), np.int32))
    for f in setup.state_fields:
        tree[f] = {}
    for lay in setup.layouts:
        rows, part = lay.padded_rows, spec["weights"]

        def weights(start, stop, lay=lay):
            out = np.zeros((stop - start, lay.dim), np.float32)
            real = min(stop, lay.num_rows)
            if real > start:
                out[: real - start] = rows_of(lay.name, start, real)
            return out

        tree["weights"][lay.name] = placed((rows, lay.dim), part, weights)
        if "sum" in tree:
            tree["sum"][lay.name] = placed((rows,), part, lambda a, b: np.zeros(b - a, np.float32))
        for f in ("m", "v"):
            if f in tree:
                zeros = lambda a, b, d=lay.dim: np.zeros((b - a, d), np.float32)  # noqa: E731
                tree[f][lay.name] = placed((rows, lay.dim), part, zeros)
    return tree


def tables_spec(setup: EmbeddingSetup, axis: str):
    """PartitionSpec prefix of the tables tree: rows over `axis` (replicated: none)."""
    from jax.sharding import PartitionSpec as P

    rows = P() if setup.replicated else P(axis)
    return {"weights": rows, **{f: rows for f in setup.state_fields}, "count": P()}


# ------------------------------------------------------------------------------ lookup
def touched_ids(values: dict, lengths: dict, keys: tuple[str, ...]) -> tuple[jax.Array, jax.Array]:
    """Every value of `keys` the batch holds `[N]`, and which are real (not capacity padding)."""
    ids, real = [], []
    for key in keys:
        if key in values:
            v = values[key]
            ids.append(v)
            real.append(jnp.arange(v.shape[0]) < jnp.sum(lengths[key]))
    if not ids:
        return jnp.zeros((1,), jnp.int32), jnp.zeros((1,), bool)
    return jnp.concatenate(ids), jnp.concatenate(real)


# Distinct ids and cache slots come from a map with one int32 per table row (a scatter, a
# prefix sum, a gather) where the table has at most `ROWS_PER_ID` rows per id of the call, so
# that the map's work and memory grow with the batch, never with the table alone; beyond, from
# sorting the ids. On an H200 a sort of 15K ids costs ~65 us and a sorted search of 15K ids in
# 12K ~100 us; the maps of a 100K-row table read below the timer's floor (docs/BENCHMARKS.md,
# "jax: table ids without sorts").
ROWS_PER_ID = 128


def _by_map(num_rows: int, num_ids: int) -> bool:
    return num_rows <= ROWS_PER_ID * max(num_ids, 1)


def distinct_ids(ids: jax.Array, num_rows: int, size: int, fill: int) -> jax.Array:
    """`[size]`: the distinct values of `ids` (any shape) in `[0, num_rows)`, ascending, then
    `fill` (`>= num_rows`); the `size` smallest where more are distinct. The values of
    `jnp.unique(where(in range, ids, fill), size=size, fill_value=fill)`, without its sort
    where the table is small enough (`ROWS_PER_ID`)."""
    ids = ids.reshape(-1)
    ok = (ids >= 0) & (ids < num_rows)
    if not _by_map(num_rows, ids.size):
        return jnp.unique(jnp.where(ok, ids, fill), size=size, fill_value=fill)
    present = jnp.zeros((num_rows,), jnp.int32)
    present = present.at[jnp.where(ok, ids, num_rows)].set(1, mode="drop")
    to = jnp.where(present > 0, jnp.cumsum(present) - 1, size)  # each present row's rank
    out = jnp.full((size,), fill, ids.dtype)
    return out.at[to].set(jnp.arange(num_rows, dtype=ids.dtype), mode="drop")


def slot_map(cache_ids: jax.Array, num_rows: int) -> jax.Array:
    """`[num_rows]` int32: each row's position in `cache_ids` (distinct ids; entries out of
    `[0, num_rows)` are ignored), -1 for a row it lacks."""
    ok = (cache_ids >= 0) & (cache_ids < num_rows)
    pos = jnp.arange(cache_ids.shape[0], dtype=jnp.int32)
    slots = jnp.full((num_rows,), -1, jnp.int32)
    return slots.at[jnp.where(ok, cache_ids, num_rows)].set(pos, mode="drop")


def unique_ids(ids: jax.Array, real: jax.Array, lay: TableLayout) -> jax.Array:
    """`[U]` distinct real ids, ascending, `lay.sentinel` after them. Ids out of `[0, rows)`
    (the host check stops them; a caller skipping it) are not touched: they read NaN."""
    size = min(ids.shape[0], lay.num_rows + 1)
    return distinct_ids(jnp.where(real, ids, lay.sentinel), lay.num_rows, size, lay.sentinel)


def _capacity(num_unique: int, lay: TableLayout) -> int:
    return min(num_unique, lay.rows_per_rank)


def plan_route(uniq: jax.Array, lay: TableLayout, axis: str) -> dict:
    """Send each distinct id to its owner; returns the route (`start`, `count` `[W]`: the run of
    `uniq` each owner got; `recv [W, C]`: the ids each source rank sent here)."""
    w, rl, c = lay.world_size, lay.rows_per_rank, _capacity(uniq.shape[0], lay)
    bounds = jnp.arange(w + 1, dtype=uniq.dtype) * rl  # W + 1 queries: compare each id once
    edges = jnp.searchsorted(uniq, bounds, method="compare_all").astype(jnp.int32)
    start, count = edges[:-1], edges[1:] - edges[:-1]
    send = _runs(uniq, start, count, c, lay.sentinel)
    recv = jax.lax.all_to_all(send, axis, 0, 0)  # [W src, C]
    return {"uniq": uniq, "start": start, "count": count, "recv": recv}


def _runs(x: jax.Array, start: jax.Array, count: jax.Array, c: int, fill) -> jax.Array:
    """`[W, C, ...]`: `x[start[o] : start[o] + count[o]]` for each owner o, `fill` after."""
    j = jnp.arange(c, dtype=jnp.int32)
    idx = jnp.clip(start[:, None] + j, 0, x.shape[0] - 1)
    keep = (j < count[:, None]).reshape(*idx.shape, *([1] * (x.ndim - 1)))
    return jnp.where(keep, x[idx], jnp.asarray(fill, x.dtype))


def _owned(route: dict, lay: TableLayout, axis: str) -> jax.Array:
    """`[W, C]` local row of each received id; `rows_per_rank` (one past) for the sentinel."""
    base = jax.lax.axis_index(axis) * lay.rows_per_rank
    recv = route["recv"]
    return jnp.where(recv < lay.sentinel, recv - base, lay.rows_per_rank)


def gather_rows(shard: jax.Array, route: dict, lay: TableLayout, axis: str) -> jax.Array:
    """`[U, D]` rows of `route["uniq"]` (zero for the sentinel), from their owners."""
    rows = shard.at[_owned(route, lay, axis)].get(mode="fill", fill_value=0)  # [W, C, D]
    back = jax.lax.all_to_all(rows, axis, 0, 0)  # [W owner, C, D]
    w, c = back.shape[:2]
    uniq, start = route["uniq"], route["start"]
    owner = jnp.clip(uniq // lay.rows_per_rank, 0, w - 1)
    slot = owner * c + jnp.arange(uniq.shape[0], dtype=jnp.int32) - start[owner]
    flat = back.reshape(w * c, -1)
    real = (uniq < lay.sentinel)[:, None]
    return jnp.where(real, flat[jnp.clip(slot, 0, w * c - 1)], 0.0)


def send_grads(g_uniq: jax.Array, route: dict, axis: str) -> jax.Array:
    """Row gradients `[U, D]` back to the owners: `[W src, C, D]`, aligned with `recv`."""
    c = route["recv"].shape[1]
    return jax.lax.all_to_all(_runs(g_uniq, route["start"], route["count"], c, 0.0), axis, 0, 0)


def sum_by_row(rows: jax.Array, grads: jax.Array, num_rows: int, fill: int, size: int):
    """Distinct `rows` in `[0, num_rows)` (`[size]`, `fill` after them) and the sum of the
    gradients of each; the gradients of the other entries (`fill`: zero rows) are left out."""
    rows = rows.reshape(-1)
    grads = grads.reshape(-1, grads.shape[-1])
    ok = (rows >= 0) & (rows < num_rows)
    if not _by_map(num_rows, rows.size):
        uniq, inverse = jnp.unique(
            jnp.where(ok, rows, fill), size=size, fill_value=fill, return_inverse=True
        )
        inverse = jnp.where(ok, inverse.reshape(-1), size)
    else:
        uniq = distinct_ids(rows, num_rows, size, fill)
        inverse = jnp.where(ok, slot_map(uniq, num_rows)[jnp.where(ok, rows, 0)], size)
    return uniq, jax.ops.segment_sum(grads, inverse, size)  # segment `size`: dropped


def owner_rows(route: dict, g_recv: jax.Array, lay: TableLayout, axis: str):
    """On the owner: `(local rows [M], g [M, D])` of every row some rank touched, summed over
    the ranks; `rows_per_rank` (out of bounds: dropped) after them."""
    local = _owned(route, lay, axis)
    size = min(local.size, lay.rows_per_rank + 1)
    return sum_by_row(local, g_recv, lay.rows_per_rank, lay.rows_per_rank, size)


def cache_slots(cache_ids: jax.Array, ids: jax.Array, num_rows: int) -> jax.Array:
    """The cache slot each of `ids` (any shape) reads: its row of `cache_ids`, or
    `len(cache_ids)` (past the cache) for an id the cache lacks or one out of `[0, num_rows)`.
    A lookup past the cache reads no slot, so its (zero) gradient adds onto none: tokens
    another table serves look a table up at `num_rows` (`model.Embeddings`), and all of them
    adding onto one slot would make T atomic adds onto one row."""
    size = cache_ids.shape[0]
    in_range = (ids >= 0) & (ids < num_rows)
    if _by_map(num_rows, max(size, ids.size)):
        idx = slot_map(cache_ids, num_rows)[jnp.where(in_range, ids, 0)]
        found = (idx >= 0) & in_range
    else:  # one sort of both (the default binary search is a loop of kernels on a GPU)
        idx = jnp.clip(jnp.searchsorted(cache_ids, ids, method="sort"), 0, size - 1)
        found = (cache_ids[idx] == ids) & in_range  # never the sentinel's zero row
    return jnp.where(found, idx, size)


def cached_lookup(cache_ids: jax.Array, cache_rows: jax.Array, ids: jax.Array, num_rows: int):
    """Rows of `ids` (any shape) from a rank's cache. An id the cache lacks is capacity padding
    (every real id was fetched): a zero row, masked by the model; an id out of `[0, rows)`
    reads NaN, as the dense lookup does. Neither reads a slot (`cache_slots`)."""
    in_range = ((ids >= 0) & (ids < num_rows))[..., None]
    slot = cache_slots(cache_ids, ids, num_rows)
    hit = cache_rows.at[slot].get(mode="fill", fill_value=0)
    return jnp.where(in_range, hit, jnp.asarray(jnp.nan, cache_rows.dtype))


# ------------------------------------------------------------------------------ update
def apply_rows(
    setup: EmbeddingSetup, weights: jax.Array, state: dict, rows: jax.Array, g: jax.Array, t
) -> tuple[jax.Array, dict]:
    """The touched-rows update of one table (or one owner's block): `rows [M]` distinct, entries
    out of bounds ignored, `g [M, D]` their summed gradients, `t` this step's count (1-based).
    Gathers and scatters `M` rows; a donated `weights` / `state` is updated in place."""
    s = setup
    w_r = weights.at[rows].get(mode="fill", fill_value=0)
    if s.optimizer == "row_wise_adagrad":
        acc = state["sum"].at[rows].get(mode="fill", fill_value=0) + jnp.mean(g * g, axis=1)
        w_new = w_r - g * (s.lr / (jnp.sqrt(acc) + s.eps))[:, None]
        new_state = {"sum": state["sum"].at[rows].set(acc, mode="drop")}
    else:
        m = s.beta1 * state["m"].at[rows].get(mode="fill", fill_value=0) + (1.0 - s.beta1) * g
        v = s.beta2 * state["v"].at[rows].get(mode="fill", fill_value=0) + (1.0 - s.beta2) * g * g
        tf = jnp.asarray(t, jnp.float32)
        m_hat = m / (1.0 - jnp.power(jnp.float32(s.beta1), tf))
        v_hat = v / (1.0 - jnp.power(jnp.float32(s.beta2), tf))
        w_new = w_r - s.lr * (m_hat / (jnp.sqrt(v_hat) + s.eps) + s.weight_decay * w_r)
        new_state = {
            "m": state["m"].at[rows].set(m, mode="drop"),
            "v": state["v"].at[rows].set(v, mode="drop"),
        }
    return weights.at[rows].set(w_new, mode="drop"), new_state


def table_state(tables: dict, name: str, fields: tuple[str, ...]) -> dict:
    return {f: tables[f][name] for f in fields}


# ------------------------------------------------------------------------------ programs
def make_lookup(setup: EmbeddingSetup, mesh, axis: str):
    """`(weights, batch) -> (routes, rows)`: per rank (leading rank dim) each table's route
    (`uniq [U]`: the cache ids, and the owner runs) and cached rows `[U, D]`."""
    from jax.sharding import PartitionSpec as P

    from hstu.jax_backend.batch import local_view
    from hstu.jax_backend.collectives import shard_map

    assert all(lay.world_size == mesh.size for lay in setup.layouts), "layout != mesh"

    def body(weights, batch):
        b = local_view(batch)
        routes, rows = {}, {}
        for lay in setup.layouts:
            n = lay.name
            uniq = unique_ids(*touched_ids(b.values, b.lengths, TABLE_KEYS[n]), lay)
            if setup.replicated:
                routes[n] = {"uniq": uniq}
                rows[n] = weights[n].at[uniq].get(mode="fill", fill_value=0)
            else:
                routes[n] = plan_route(uniq, lay, axis)
                rows[n] = gather_rows(weights[n], routes[n], lay, axis)
        return jax.tree.map(lambda x: x[None], (routes, rows))

    w_spec = P() if setup.replicated else P(axis)
    return shard_map(body, mesh=mesh, in_specs=(w_spec, P(axis)), out_specs=P(axis))


def make_update(setup: EmbeddingSetup, mesh, axis: str):
    """`(tables, routes, g_rows) -> (tables, sum of squared row gradients)`: the touched-rows
    update of every table; `g_rows` is the loss gradient of `make_lookup`'s rows."""
    from jax.sharding import PartitionSpec as P

    from hstu.jax_backend.collectives import shard_map

    fields = setup.state_fields

    def new_tree(count):
        return {"weights": {}, **{f: {} for f in fields}, "count": count}

    if setup.replicated:
        # every rank's ids and row gradients, then one update that every replica applies

        def update_replicated(tables, routes, g_rows):
            t = tables["count"] + 1
            out, sq = new_tree(t), jnp.zeros((), jnp.float32)
            for lay in setup.layouts:
                n, ids = lay.name, routes[lay.name]["uniq"]  # [W, U]
                if ids.shape[0] == 1:  # one rank: its ids are distinct already, no re-sort
                    rows, g = ids[0], g_rows[n][0]
                else:
                    size = min(ids.size, lay.num_rows + 1)
                    rows, g = sum_by_row(ids, g_rows[n], lay.num_rows, lay.sentinel, size)
                w, st = apply_rows(
                    setup, tables["weights"][n], table_state(tables, n, fields), rows, g, t
                )
                out["weights"][n] = w
                for f in fields:
                    out[f][n] = st[f]
                sq = sq + jnp.sum(g * g)
            return out, sq

        return update_replicated

    def body(weights, state, count, routes, g_rows):
        t = count + 1
        new_w, new_s = {}, {f: {} for f in fields}
        sq = jnp.zeros((), jnp.float32)
        for lay in setup.layouts:
            n = lay.name
            route = jax.tree.map(lambda x: x[0], routes[n])
            g_recv = send_grads(g_rows[n][0], route, axis)
            rows, g = owner_rows(route, g_recv, lay, axis)
            st = {f: state[f][n] for f in fields}
            new_w[n], st = apply_rows(setup, weights[n], st, rows, g, t)
            for f in fields:
                new_s[f][n] = st[f]
            sq = sq + jnp.sum(g * g)
        return new_w, new_s, jax.lax.psum(sq, axis)

    rows_spec = P(axis)
    sharded = shard_map(
        body,
        mesh=mesh,
        in_specs=(rows_spec, rows_spec, P(), rows_spec, rows_spec),
        out_specs=(rows_spec, rows_spec, P()),
    )

    def update(tables, routes, g_rows):
        state = {f: tables[f] for f in fields}
        w, st, sq = sharded(tables["weights"], state, tables["count"], routes, g_rows)
        return {"weights": w, **st, "count": tables["count"] + 1}, sq

    return update
