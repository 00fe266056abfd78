"""Static-shape JAX batches: the core `JaggedBatch` as a pytree of fixed-size arrays.

Layout (`DeviceBatch`), for `W` data-parallel ranks of `B` samples each, every leaf has a
leading rank dim that the mesh axis "data" shards (inside `shard_map` a rank sees `[1, ...]`
and `local_view` drops it):

* `lengths[key]`  `[W, B]` int32     TorchRec lengths; padding samples 0
* `values[key]`   `[W, cap_key]`     values of rank r packed at the front, zero after
                                     `sum(lengths)` (capacity padding, never read)
* `dense[key]`    `[W, B, ...]`      per-sample fields, padding rows zero
* `num_real`      `[W]` int32        actual_batch_size of each rank

Everything on device is 32-bit (JAX's default mode): 64-bit host integers are range-checked
and narrowed, and `BatchSpec` keeps the host dtypes, so `to_jagged(to_device(b)) == b` byte for
byte. The token capacity T (HSTU tokens per rank, the model's sequence buffer) is bucketed
(`bucket_capacity`: 128 * 2^k) and the HSTU keys' value capacities derive from it (`item`:
T/2, ...), so jit sees one shape per octave of load, or per capacity of a
`hstu.capacity.CapacityPolicy` when the caller passes one (training does); the spec is the
static part of the pytree, hence the jit cache key. Ranking's candidate keys (a candidate, its
time and its label per candidate token) are bounded tighter where the spec knows the most
candidates a sample has (`BatchSpec.candidates_per_sample`, `data.max_candidates`):
`min(T, B * K)`, the loss rows torch's step graphs hold (`loss_rows_capacity`), so the head,
the final norm of its rows and the loss run on ~B K rows instead of T.

On the way to the device every leaf of a rank rides in one int32 row (`PackedBatch`: the
leaves at static offsets of the spec, `packed_layout`), so a batch is one host-to-device copy
whatever its number of keys; a program that reads the batch slices the leaves out of that row
(`PackedBatch.lengths` etc., the same arrays as `DeviceBatch`'s), which XLA fuses into their
readers. A device exchange yields a `DeviceBatch`; every reader takes either.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import jax
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from hstu.batch import JaggedBatch
from hstu.errors import HSTUError

MIN_CAPACITY = 128
TOKEN_KEYS = (("contextual", 1), ("item", 2), ("candidate", 1))  # tokens = C + 2 L + K
# Keys whose per-rank value count is at most T / divisor, T the rank's token capacity: their
# capacities derive from T, so a batch's shapes (the jit cache key) depend on T alone.
TOKEN_BOUNDED = {
    "contextual": 1,
    "item": 2,
    "action": 2,
    "item_time": 2,
    "candidate": 1,
    "candidate_time": 1,
    "label": 1,
}
# Keys with one value per candidate token: at most B * `candidates_per_sample` per rank.
CANDIDATE_KEYS = ("candidate", "candidate_time", "label")
_INT32 = np.iinfo(np.int32)


def bucket_capacity(n: int, minimum: int = MIN_CAPACITY, fine: bool = False) -> int:
    """Smallest `minimum * 2^k` holding `n` (`fine`: also `1.5 * 2^k`).

    Powers of two keep recompiles rare (one per octave of load) at up to 2x padding; `fine`
    halves the worst-case padding for two shapes per octave.
    """
    size = minimum
    while True:
        if n <= size:
            return size
        if fine and n <= size * 3 // 2:
            return size * 3 // 2
        size *= 2


@dataclass(frozen=True)
class BatchSpec:
    """Static layout of a DeviceBatch: keys, host dtypes, batch size and capacities."""

    keys: tuple[str, ...]
    value_dtypes: tuple[str, ...]  # host dtype per jagged key
    dense_keys: tuple[str, ...]
    dense_dtypes: tuple[str, ...]
    dense_shapes: tuple[tuple[int, ...], ...]  # trailing dims per dense key
    batch_size: int
    capacities: tuple[int, ...]  # values capacity per jagged key
    token_capacity: int  # HSTU tokens (C + 2 L + K) per rank, the model's T
    # the most candidates of one sample (ranking's `data.max_candidates`); 0: unknown, the
    # candidate keys' capacities are then T's
    candidates_per_sample: int = 0

    def capacity(self, key: str) -> int:
        return self.capacities[self.keys.index(key)]

    def with_capacities(self, capacities: Sequence[int], token_capacity: int) -> BatchSpec:
        return dataclasses.replace(
            self, capacities=tuple(int(c) for c in capacities), token_capacity=int(token_capacity)
        )


def token_counts(lengths: dict[str, np.ndarray]) -> np.ndarray:
    """HSTU tokens per sample from per-key lengths (any leading shape)."""
    some = next(iter(lengths.values()))
    total = np.zeros_like(np.asarray(some), dtype=np.int64)
    for key, weight in TOKEN_KEYS:
        if key in lengths:
            total = total + weight * np.asarray(lengths[key], dtype=np.int64)
    return total


def _derived(spec: BatchSpec, key: str, t_cap: int) -> int:
    """The capacity of a key bounded by the token capacity `t_cap` (0: not bounded by it):
    `t_cap` over the key's values per token, and for the candidate keys at most B times the
    spec's candidates per sample."""
    if key not in TOKEN_BOUNDED:
        return 0
    cap = t_cap // TOKEN_BOUNDED[key]
    if key in CANDIDATE_KEYS and spec.candidates_per_sample > 0:
        cap = min(cap, spec.batch_size * spec.candidates_per_sample)
    return cap


def spec_for_lengths(
    spec: BatchSpec,
    rank_lengths: dict[str, np.ndarray],
    capacity: Callable[[int], int] = bucket_capacity,
) -> BatchSpec:
    """`spec` resized to hold every rank: `rank_lengths[key]` is `[W, B]`; `capacity` maps the
    largest rank's token count to the token capacity T (`hstu.capacity.CapacityPolicy`). A key
    whose values exceed its bound (samples past `spec.candidates_per_sample`) gets
    `bucket_capacity` of what it holds instead: a shape of its own, never a lost value."""
    t_cap = capacity(int(token_counts(rank_lengths).sum(axis=1).max(initial=0)))
    caps = []
    for key in spec.keys:
        need = int(np.asarray(rank_lengths[key]).sum(axis=1).max(initial=0))
        derived = _derived(spec, key, t_cap)
        if key == "negative" and "item" in rank_lengths:
            # R negatives per next-item target, at most T / 2 targets: R * T / 2 holds them,
            # so retrieval batches too get shapes that depend on T alone.
            derived = negatives_per_target(rank_lengths) * (t_cap // 2)
        caps.append(derived if derived and need <= derived else bucket_capacity(need))
    return spec.with_capacities(caps, t_cap)


def spec_at_capacity(spec: BatchSpec, t_cap: int) -> BatchSpec | None:
    """The spec `spec_for_lengths` gives a batch of `spec`'s keys at token capacity `t_cap`:
    every key's capacity derives from T (retrieval's negatives from `spec`'s R negatives per
    target), so a capacity names its batch shapes before any such batch exists (the step
    programs built ahead). None where a key's capacity does not derive from T."""
    half = spec.token_capacity // 2
    caps = []
    for key, cap in zip(spec.keys, spec.capacities, strict=True):
        if key in TOKEN_BOUNDED:
            caps.append(_derived(spec, key, t_cap))
        elif key == "negative" and half and cap % half == 0 and cap:
            caps.append(cap // half * (t_cap // 2))
        else:
            return None
    return spec.with_capacities(caps, t_cap)


def negatives_per_target(lengths: dict[str, np.ndarray]) -> int:
    """R of retrieval samples, whose `negative` length is R * (len(item) - 1) (checked on the
    host before any batch gets here); 0 when no sample has a target."""
    item = np.asarray(lengths["item"], np.int64).reshape(-1)
    neg = np.asarray(lengths["negative"], np.int64).reshape(-1)
    has = item >= 2
    return int((neg[has] // (item[has] - 1)).max(initial=0))


def spec_for(
    template: JaggedBatch,
    rank_lengths: dict[str, np.ndarray],
    capacity: Callable[[int], int] = bucket_capacity,
    candidates_per_sample: int = 0,
) -> BatchSpec:
    """Spec of `template`'s keys and dtypes whose capacities hold `rank_lengths` (`[W, B]`);
    `candidates_per_sample`: the most candidates a sample has (`candidate_bound`), 0 unknown."""
    keys = tuple(template.keys)
    dense = {k: np.asarray(v) for k, v in template.dense.items()}
    spec = BatchSpec(
        keys=keys,
        value_dtypes=tuple(np.asarray(template.values[k]).dtype.str for k in keys),
        dense_keys=tuple(dense),
        dense_dtypes=tuple(v.dtype.str for v in dense.values()),
        dense_shapes=tuple(tuple(v.shape[1:]) for v in dense.values()),
        batch_size=template.batch_size,
        capacities=(0,) * len(keys),
        token_capacity=0,
        candidates_per_sample=int(candidates_per_sample),
    )
    return spec_for_lengths(spec, rank_lengths, capacity)


def candidate_bound(cfg) -> int:
    """`candidates_per_sample` of a run's batches: ranking's `data.max_candidates` (the
    synthetic and prepared sources hold to it; a batch of another source past it gets a
    capacity of its own), 0 for retrieval (its keys are bounded by T)."""
    return int(cfg.data.max_candidates) if cfg.model.task == "ranking" else 0


def spec_from_batches(batches: Sequence[JaggedBatch]) -> BatchSpec:
    return spec_for(
        batches[0], {k: np.stack([b.lengths[k] for b in batches]) for k in batches[0].keys}
    )


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class DeviceBatch:
    lengths: dict[str, jax.Array]
    values: dict[str, jax.Array]
    dense: dict[str, jax.Array]
    num_real: jax.Array
    spec: BatchSpec = dataclasses.field(metadata={"static": True})


@functools.cache
def packed_layout(spec: BatchSpec) -> tuple[tuple[str, str, int, tuple[int, ...]], ...]:
    """Where each leaf of a rank sits in its packed row: `(field, key, offset, shape)`, field
    one of lengths / values / dense / num_real (key ""), shape the leaf's per-rank shape."""
    out, off = [], 0
    b = spec.batch_size
    fields = [("lengths", k, (b,)) for k in spec.keys]
    fields += [("values", k, (c,)) for k, c in zip(spec.keys, spec.capacities, strict=True)]
    fields += [
        ("dense", k, (b, *s)) for k, s in zip(spec.dense_keys, spec.dense_shapes, strict=True)
    ]
    fields.append(("num_real", "", ()))
    for field, key, shape in fields:
        out.append((field, key, off, shape))
        off += math.prod(shape)
    return tuple(out)


def packed_width(spec: BatchSpec) -> int:
    _, _, off, shape = packed_layout(spec)[-1]
    return off + math.prod(shape)


def _unpack(buf, spec: BatchSpec, only: str | None = None) -> dict:
    """The leaves of `buf` `[..., width]` (numpy or jax, any leading dims); `only`: those of
    one field."""
    lead = buf.shape[:-1]
    out = {"lengths": {}, "values": {}, "dense": {}}
    for field, key, off, shape in packed_layout(spec):
        if only is not None and field != only:
            continue
        x = buf[..., off : off + math.prod(shape)].reshape(lead + shape)
        if field == "num_real":
            out[field] = x
        else:
            out[field][key] = x
    return out


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class PackedBatch:
    """A DeviceBatch whose leaves ride in one int32 row per rank (`buffer` `[W, width]`;
    inside shard_map `[1, width]`, after `local_view` `[width]`): one transfer per batch.

    Reads like a DeviceBatch: `lengths`, `values`, `dense`, `num_real` slice the row (inside a
    jitted program XLA fuses the slices into their readers; outside one they are eager ops)."""

    buffer: jax.Array
    spec: BatchSpec = dataclasses.field(metadata={"static": True})

    def unpack(self) -> DeviceBatch:
        leaves = _unpack(self.buffer, self.spec)
        return DeviceBatch(
            leaves["lengths"], leaves["values"], leaves["dense"], leaves["num_real"], self.spec
        )

    @property
    def lengths(self) -> dict[str, jax.Array]:
        return _unpack(self.buffer, self.spec, "lengths")["lengths"]

    @property
    def values(self) -> dict[str, jax.Array]:
        return _unpack(self.buffer, self.spec, "values")["values"]

    @property
    def dense(self) -> dict[str, jax.Array]:
        return _unpack(self.buffer, self.spec, "dense")["dense"]

    @property
    def num_real(self) -> jax.Array:
        return _unpack(self.buffer, self.spec, "num_real")["num_real"]


def local_view(batch: DeviceBatch) -> DeviceBatch:
    """Inside shard_map: drop the rank dim of size 1 (the model is single-rank code)."""
    return jax.tree.map(lambda x: x[0], batch)


def rank_view(batch: DeviceBatch) -> DeviceBatch:
    """Inverse of `local_view`: add the rank dim back before leaving shard_map."""
    return jax.tree.map(lambda x: x[None], batch)


def _narrow(arr: np.ndarray, what: str) -> np.ndarray:
    """Host array -> its 32-bit device form (exact, or HSTUError)."""
    arr = np.asarray(arr)
    if arr.dtype == np.float32:
        return arr.view(np.int32)  # bit-exact: rides in the int32 exchange buffers
    if arr.dtype.kind == "b" or (arr.dtype.kind in "iu" and arr.dtype.itemsize < 4):
        return arr.astype(np.int32)
    if arr.dtype.kind in "iu":
        if arr.size and (arr.min() < _INT32.min or arr.max() > _INT32.max):
            raise HSTUError(
                f"{what}: values in [{arr.min()}, {arr.max()}] do not fit int32, "
                "which the JAX backend carries ids and timestamps in"
            )
        return arr.astype(np.int32)
    raise HSTUError(f"{what}: dtype {arr.dtype} is not supported on device (32-bit only)")


def _widen(arr: np.ndarray, dtype: str) -> np.ndarray:
    dt = np.dtype(dtype)
    return arr.view(np.float32) if dt == np.float32 else arr.astype(dt)


def pack_host(batches: Sequence[JaggedBatch], spec: BatchSpec) -> np.ndarray:
    """Per-rank batches -> their packed rows `[len(batches), width]` int32 (`packed_layout`):
    every leaf narrowed to 32 bits (exact, or HSTUError naming it), values zero after their
    count (capacity padding, never read)."""
    out = np.zeros((len(batches), packed_width(spec)), np.int32)
    for field, key, off, shape in packed_layout(spec):
        n = math.prod(shape)
        for r, b in enumerate(batches):
            if field == "num_real":
                out[r, off] = b.actual_batch_size
            elif field == "values":
                v = _narrow(b.values[key], f"values['{key}']")
                if v.shape[0] > n:
                    raise HSTUError(
                        f"values['{key}'] of local rank {r} hold {v.shape[0]} entries, "
                        f"over the capacity {n} of the batch spec"
                    )
                out[r, off : off + v.shape[0]] = v
            else:
                src = b.lengths[key] if field == "lengths" else b.dense[key]
                v = _narrow(src, f"{field}['{key}']")
                if v.shape != shape:
                    raise HSTUError(
                        f"{field}['{key}'] of local rank {r} has shape {v.shape}, "
                        f"the batch spec {shape}"
                    )
                out[r, off : off + n] = v.reshape(-1)
    return out


def host_arrays(batches: Sequence[JaggedBatch], spec: BatchSpec) -> dict:
    """Per-rank batches -> numpy leaves of a DeviceBatch (leading dim = len(batches))."""
    return _unpack(pack_host(batches, spec), spec)


def to_device(
    batches: Sequence[JaggedBatch], sharding: jax.sharding.Sharding, spec: BatchSpec | None = None
) -> PackedBatch:
    """This process's per-rank batches -> a global batch sharded over the data axis, in one
    copy (`PackedBatch`: one int32 row per rank).

    `batches` are the ranks this process drives, in mesh order (single process: all W). The
    copy is asynchronous. Multi-process callers must pass a spec agreed on by every process
    (e.g. from the gathered stats): array shapes are global.
    """
    return to_device_with(batches, sharding, spec)[0]


def to_device_with(
    batches: Sequence[JaggedBatch],
    sharding: jax.sharding.Sharding,
    spec: BatchSpec | None = None,
    scalars: Mapping[str, np.generic | np.ndarray] | None = None,
) -> tuple[PackedBatch, dict[str, jax.Array]]:
    """`to_device`, plus host `scalars` placed replicated over the mesh (`P()`), returned by
    name with their host dtypes.

    A step argument that is a host scalar costs a transfer of its own at every call (a
    `DevicePut` on the dispatching thread, the device idle meanwhile); placed here, it rides
    the batch's one batched copy. Replicated is the sharding a shard_map in_spec `P()`
    expects, so the jitted step takes the array as is. Every process must pass the same
    values (multi-process: each process supplies its copy, nothing checks them).
    """
    spec = spec or spec_from_batches(batches)
    rows = pack_host(batches, spec)
    scal = {k: np.asarray(v) for k, v in (scalars or {}).items()}
    if any(v.ndim for v in scal.values()):
        shapes = {k: v.shape for k, v in scal.items()}
        raise HSTUError(f"to_device_with: scalars must be 0-d, got shapes {shapes}")
    if scal and not isinstance(sharding, NamedSharding):
        raise HSTUError("to_device_with: replicated scalars need a NamedSharding (its mesh)")
    replicated = NamedSharding(sharding.mesh, P()) if scal else sharding  # ({}: no leaves)
    world = sharding.mesh.devices.size if hasattr(sharding, "mesh") else len(batches)
    if sharding.is_fully_addressable:  # one process holds every rank: one batched transfer
        buffer, put = jax.device_put((rows, scal), (sharding, replicated))
    else:
        buffer = jax.make_array_from_process_local_data(sharding, rows, (world, rows.shape[1]))
        # Each process's copy of the replicated value, not `device_put` of host data onto a
        # multi-process sharding: that first checks, with a collective, that they agree.
        put = {
            k: jax.make_array_from_process_local_data(replicated, v, ()) for k, v in scal.items()
        }
    return PackedBatch(buffer, spec), put


def local_rows(x: jax.Array) -> np.ndarray:
    """This process's rank rows of a rank-sharded array, in rank order (host numpy)."""
    if x.is_fully_addressable:
        return np.asarray(x)
    shards = sorted(x.addressable_shards, key=lambda s: s.index[0].start or 0)
    return np.concatenate([np.asarray(s.data) for s in shards])


def to_jagged(batch: DeviceBatch | PackedBatch) -> list[JaggedBatch]:
    """A device batch (packed or not) -> the per-rank JaggedBatches this process holds (host
    dtypes restored)."""
    spec = batch.spec
    if isinstance(batch, PackedBatch):  # this process's rows, split on the host
        host = _unpack(local_rows(batch.buffer), spec)
        lengths, values, dense, num_real = (
            host[f] for f in ("lengths", "values", "dense", "num_real")
        )
    else:
        lengths = {k: local_rows(batch.lengths[k]) for k in spec.keys}
        values = {k: local_rows(batch.values[k]) for k in spec.keys}
        dense = {k: local_rows(batch.dense[k]) for k in spec.dense_keys}
        num_real = local_rows(batch.num_real)
    out = []
    for r in range(num_real.shape[0]):
        lens = {k: lengths[k][r].astype(np.int64) for k in spec.keys}
        vals = {
            k: _widen(values[k][r, : int(lens[k].sum())], dt)
            for k, dt in zip(spec.keys, spec.value_dtypes, strict=True)
        }
        dns = {
            k: _widen(dense[k][r], dt)
            for k, dt in zip(spec.dense_keys, spec.dense_dtypes, strict=True)
        }
        out.append(JaggedBatch(spec.batch_size, int(num_real[r]), lens, vals, dns))
    return out
