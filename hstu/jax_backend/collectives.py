"""Data-parallel collectives over the mesh axis "data", written as per-rank `shard_map` bodies.

* `allgather_stats`: the pipeline's phase-1 gather of per-sample stats (one all_gather).
* `exchange_allgather_local`: gather every rank's rows and values (2 all_gathers whatever the
  number of keys: one for the per-sample rows, lengths and dense fields packed together, one for
  all keys' values packed together), then select this rank's rows.
* `exchange_all2all_local`: send only the real samples that change rank (2 all_to_alls of
  fixed-size chunks; `ragged_all_to_all` has no CPU lowering). Kept rows are read locally and
  padding rows are synthesised, so a balanced plan moves O(moved samples) instead of O(W B).

Both produce exactly `hstu.shuffle_plan.exchange_reference`; `shuffler.py` builds their static
`ExchangeSpec` and the small row tables on the host, from the gathered stats.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from hstu.jax_backend.batch import BatchSpec, DeviceBatch, local_view, rank_view

DATA_AXIS = "data"


def shard_map(f, *, mesh: Mesh, in_specs, out_specs, check: bool = True):
    """`jax.shard_map` (new: `check_vma`) or `jax.experimental.shard_map` (old: `check_rep`)."""
    new = getattr(jax, "shard_map", None)
    if new is not None:
        return new(f, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_vma=check)
    from jax.experimental.shard_map import shard_map as old

    return old(f, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_rep=check)


def make_mesh(devices: Sequence[jax.Device]) -> Mesh:
    """1-D data-parallel mesh; rank r is `devices[r]` (keep each process's devices together)."""
    return Mesh(np.asarray(devices, dtype=object), (DATA_AXIS,))


def rank_sharding(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, P(DATA_AXIS))


def local_ranks(mesh: Mesh) -> list[int]:
    """Data-parallel ranks whose device this process drives (single controller: all)."""
    me = jax.process_index()
    return [r for r, d in enumerate(mesh.devices.flat) if d.process_index == me]


def put_local(mesh: Mesh, local: np.ndarray) -> jax.Array:
    """`[len(local_ranks), ...]` host rows of this process -> global `[W, ...]` array."""
    local = np.asarray(local)
    return jax.make_array_from_process_local_data(
        rank_sharding(mesh), local, (mesh.size, *local.shape[1:])
    )


# ---------------------------------------------------------------------------- stats
@functools.cache
def _stats_gather(mesh: Mesh):
    body = lambda x: jax.lax.all_gather(x, DATA_AXIS, tiled=True)  # [1,B,S] -> [W,B,S]
    return jax.jit(shard_map(body, mesh=mesh, in_specs=P(DATA_AXIS), out_specs=P(DATA_AXIS)))


def allgather_stats(mesh: Mesh, local_stats: np.ndarray) -> np.ndarray:
    """Collective: this process's `[n_local * B, S]` int64 stats -> `[W * B, S]` on every process.

    int64 rides as pairs of int32 words (JAX runs without x64), so FLOP counts stay exact.
    """
    n_local = len(local_ranks(mesh))
    stats = np.ascontiguousarray(np.asarray(local_stats, dtype=np.int64))
    words = stats.view(np.int32).reshape(n_local, -1, 2 * stats.shape[1])
    out = _stats_gather(mesh)(put_local(mesh, words))
    first = np.asarray(out.addressable_shards[0].data)  # every rank holds the full gather
    return np.ascontiguousarray(first.reshape(-1, 2 * stats.shape[1])).view(np.int64)


# ---------------------------------------------------------------------------- exchange
@dataclass(frozen=True)
class ExchangeSpec:
    """Static shape of one exchange (part of the jit cache key)."""

    kind: str  # allgather | all2all
    world_size: int
    spec_in: BatchSpec
    spec_out: BatchSpec
    num_rows: int = 0  # all2all: rows per (src, dst) chunk
    chunks: tuple[int, ...] = ()  # all2all: values per (src, dst) chunk, per key


def exclusive_cumsum(x: jax.Array, axis: int = -1) -> jax.Array:
    return jnp.cumsum(x, axis=axis) - x


def segment_ids(ends: jax.Array, size: int) -> jax.Array:
    """`[size]` int32: the segment holding each position `0 .. size - 1`, given the segments'
    non-decreasing exclusive `ends`, clipped to the last segment; exactly
    `clip(searchsorted(ends, pos, side="right"), 0, len(ends) - 1)`.

    jnp.searchsorted's default method is a binary search written as a loop, which XLA runs as a
    loop of small kernels inside the step. Comparing every position with every end is one fused
    reduction while `len(ends) * size` is small (a batch's samples against its tokens); past
    that, one sort of both."""
    n = ends.shape[0]
    method = "compare_all" if n * size <= 1 << 24 else "sort"
    pos = jnp.arange(size, dtype=ends.dtype)
    return jnp.clip(jnp.searchsorted(ends, pos, side="right", method=method), 0, n - 1).astype(
        jnp.int32
    )


def segment_gather(
    src: jax.Array, starts: jax.Array, lengths: jax.Array, capacity: int
) -> jax.Array:
    """Pack segments `src[starts[j] : starts[j] + lengths[j]]` back to back into `[capacity]`.

    Positions past `sum(lengths)` are zero (capacity padding).
    """
    ends = jnp.cumsum(lengths)
    pos = jnp.arange(capacity, dtype=ends.dtype)
    seg = segment_ids(ends, capacity)
    idx = starts[seg] + pos - (ends[seg] - lengths[seg])
    out = jnp.take(src, jnp.clip(idx, 0, src.shape[0] - 1))
    return jnp.where(pos < ends[-1], out, jnp.zeros_like(out))


def pack_rows(batch: DeviceBatch) -> jax.Array:
    """Rank-local `[B, F]` int32: every key's length, then every dense field's columns."""
    b = batch.spec.batch_size
    cols = [batch.lengths[k][:, None] for k in batch.spec.keys]
    cols += [batch.dense[k].reshape(b, -1) for k in batch.spec.dense_keys]
    return jnp.concatenate(cols, axis=1)


def unpack_rows(rows: jax.Array, spec: BatchSpec) -> tuple[dict, dict]:
    lengths = {k: rows[:, i] for i, k in enumerate(spec.keys)}
    dense, col = {}, len(spec.keys)
    for k, shape in zip(spec.dense_keys, spec.dense_shapes, strict=True):
        width = int(np.prod(shape, dtype=np.int64))
        dense[k] = rows[:, col : col + width].reshape(rows.shape[0], *shape)
        col += width
    return lengths, dense


def _key_bases(capacities: Sequence[int]) -> list[int]:
    return [int(c) for c in np.concatenate([[0], np.cumsum(capacities)[:-1]])]


def exchange_allgather_local(
    batch: DeviceBatch,
    rows_idx: jax.Array,
    num_real: jax.Array,
    xspec: ExchangeSpec,
    axis: str = DATA_AXIS,
) -> DeviceBatch:
    """Per rank, inside shard_map: `rows_idx [B]` global rows this rank keeps, real first."""
    spec_in, spec_out, w = xspec.spec_in, xspec.spec_out, xspec.world_size
    b, total_in = spec_in.batch_size, sum(spec_in.capacities)
    g_rows = jax.lax.all_gather(pack_rows(batch), axis, tiled=True)  # [W B, F]
    flat = jnp.concatenate([batch.values[k] for k in spec_in.keys])
    g_vals = jax.lax.all_gather(flat, axis, tiled=True)  # [W total_in]
    lengths, dense = unpack_rows(g_rows[rows_idx], spec_out)
    values = {}
    rank_base = jnp.arange(w, dtype=jnp.int32)[:, None] * total_in
    for i, (key, base) in enumerate(zip(spec_in.keys, _key_bases(spec_in.capacities), strict=True)):
        starts = rank_base + base + exclusive_cumsum(g_rows[:, i].reshape(w, b))
        values[key] = segment_gather(
            g_vals, starts.reshape(-1)[rows_idx], lengths[key], spec_out.capacity(key)
        )
    return DeviceBatch(lengths, values, dense, num_real, spec_out)


def exchange_all2all_local(
    batch: DeviceBatch,
    send_rows: jax.Array,
    recv_rows: jax.Array,
    num_real: jax.Array,
    xspec: ExchangeSpec,
    axis: str = DATA_AXIS,
) -> DeviceBatch:
    """Per rank, inside shard_map.

    `send_rows [W, R]`: local rows sent to each destination (B = none; the own chunk is empty).
    `recv_rows [B]`: for each output row, its row in `[received W*R | own B | empty]`.
    """
    spec_in, spec_out, w = xspec.spec_in, xspec.spec_out, xspec.world_size
    r_rows = xspec.num_rows
    rows = pack_rows(batch)
    rows_ext = jnp.concatenate([rows, jnp.zeros_like(rows[:1])])  # row B: the empty row
    recv = jax.lax.all_to_all(rows_ext[send_rows], axis, 0, 0)  # [W src, R, F]
    combined = jnp.concatenate([recv.reshape(w * r_rows, -1), rows_ext])
    lengths, dense = unpack_rows(combined[recv_rows], spec_out)

    send_vals, own_starts = [], []
    for key, chunk in zip(spec_in.keys, xspec.chunks, strict=True):
        own_len = batch.lengths[key]
        starts = exclusive_cumsum(own_len)
        own_starts.append(starts)
        ext_len = jnp.concatenate([own_len, jnp.zeros_like(own_len[:1])])
        ext_start = jnp.concatenate([starts, jnp.zeros_like(starts[:1])])
        pack = lambda r, v=batch.values[key], s=ext_start, n=ext_len, c=chunk: segment_gather(
            v, s[r], n[r], c
        )
        send_vals.append(jax.vmap(pack)(send_rows))  # [W dst, chunk]
    recv_vals = jax.lax.all_to_all(jnp.concatenate(send_vals, axis=1), axis, 0, 0)

    values = {}
    for i, (key, chunk, base) in enumerate(
        zip(spec_in.keys, xspec.chunks, _key_bases(xspec.chunks), strict=True)
    ):
        src = jnp.concatenate([recv_vals[:, base : base + chunk].reshape(-1), batch.values[key]])
        recv_starts = jnp.arange(w, dtype=jnp.int32)[:, None] * chunk + exclusive_cumsum(
            recv[:, :, i]
        )
        starts = jnp.concatenate(
            [recv_starts.reshape(-1), w * chunk + own_starts[i], jnp.zeros((1,), jnp.int32)]
        )
        values[key] = segment_gather(src, starts[recv_rows], lengths[key], spec_out.capacity(key))
    return DeviceBatch(lengths, values, dense, num_real, spec_out)


@functools.cache
def exchange_fn(mesh: Mesh, xspec: ExchangeSpec):
    """Jitted global exchange: `(DeviceBatch, tables) -> DeviceBatch`, tables from the plan."""

    def body(batch: DeviceBatch, tables: dict) -> DeviceBatch:
        local, t = local_view(batch), jax.tree.map(lambda x: x[0], tables)
        if xspec.kind == "allgather":
            out = exchange_allgather_local(local, t["rows"], t["num_real"], xspec)
        else:
            out = exchange_all2all_local(
                local, t["send_rows"], t["recv_rows"], t["num_real"], xspec
            )
        return rank_view(out)

    spec = P(DATA_AXIS)
    return jax.jit(shard_map(body, mesh=mesh, in_specs=(spec, spec), out_specs=spec))
