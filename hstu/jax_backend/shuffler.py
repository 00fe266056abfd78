"""The data half of the JAX pipeline backend: placement, stats gather and the balanced exchange.

`JaxShuffler` supplies `to_device`, `allgather_stats` and `exchange` of `hstu.pipeline.Backend`;
the core `Balancer` drives it (identity or balanced, partitioning on its worker thread while the
device runs the previous step under async dispatch). Collectives are jitted programs over the
whole mesh, issued in the schedule's order, so every process issues the same sequence.

Capacities: a batch's value buffers are sized when its shape is known to every process, i.e.
right after the stats gather (the gathered stats carry every sample's per-key lengths), so the
copy is issued then, still before the previous step's forward. The exchange output is sized
from the plan (the post-shuffle per-rank sums); balancing lowers the largest rank's token count,
hence the capacity every rank pads to (`Placed.token_capacity`, the metric `token_capacity`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from hstu import signature
from hstu.batch import JaggedBatch
from hstu.errors import HSTUError
from hstu.jax_backend import batch as jb
from hstu.jax_backend import collectives as col
from hstu.pipeline import (
    NUM_FIXED_STATS,
    STAT_LOSS_TOKENS,
    Balancer,
    Prepared,
    gathered_lengths,
    sample_stats,
)
from hstu.shuffle_plan import ShufflePlan, exchange_reference
from hstu.workload import HSTUCost

# Device arithmetic is int32 (JAX's default mode); the mask's pair count of a sample of n
# tokens is below n^2, exact in int32 while n < 46341.
MAX_EXACT_TOKENS = 46_340


@dataclass
class Placed:
    """A batch on its way to (or on) the devices."""

    host: list[JaggedBatch] | None  # until the global shape is known
    batch: jb.DeviceBatch | None = None
    lengths: dict[str, np.ndarray] = field(default_factory=dict)  # per key [W * B], global
    # The global loss-token count (the step's divisor), known from the stats gather, and its
    # float32 copy replicated over the mesh, placed with the batch (`JaxShuffler._materialize`)
    # so the step needs no transfer of its own; None for a batch that skipped the gather.
    loss_tokens: int | None = None
    loss_tokens_device: jax.Array | None = None

    @property
    def token_capacity(self) -> int:
        """Token slots per rank of the device batch (the model's T): what a step computes."""
        return self.batch.spec.token_capacity


def _rank_lengths(lengths: dict[str, np.ndarray], rows: np.ndarray) -> dict[str, np.ndarray]:
    return {k: v[rows] for k, v in lengths.items()}


def next_pow2(n: int) -> int:
    return 1 << max(int(n) - 1, 0).bit_length()


def plan_exchange(
    plan: ShufflePlan,
    lengths: dict[str, np.ndarray],
    spec_in: jb.BatchSpec,
    kind: str,
    capacity: Callable[[int], int] = jb.bucket_capacity,
) -> tuple[col.ExchangeSpec, dict[str, np.ndarray]]:
    """Host side of an exchange: its static spec and the `[W, ...]` int32 row tables.

    `lengths[key]` holds every global sample's length (`[W * B]`, rank-major), which every
    process knows from the stats gather. all2all chunks are sized to the largest (src, dst)
    transfer (rows: next power of two, at most B; values: `bucket_capacity`), so a balanced
    plan that moves few samples also sends small chunks.
    """
    w, b = plan.world_size, plan.batch_size
    after = _rank_lengths(lengths, plan.indices)  # [W, B] per key
    spec_out = jb.spec_for_lengths(spec_in, after, capacity)
    tables = {"num_real": plan.num_real.astype(np.int32)}
    if kind == "allgather":
        tables["rows"] = plan.indices.astype(np.int32)
        return col.ExchangeSpec(kind, w, spec_in, spec_out), tables
    sends = [
        [plan.send_local(s, d) if s != d else np.zeros(0, np.int64) for d in range(w)]
        for s in range(w)
    ]
    num_rows = min(b, next_pow2(max([len(x) for row in sends for x in row] + [1])))
    send_rows = np.full((w, w, num_rows), b, np.int32)
    chunks = [0] * len(spec_in.keys)
    for s in range(w):
        for d in range(w):
            send_rows[s, d, : len(sends[s][d])] = sends[s][d]
            rows = s * b + sends[s][d]
            for i, key in enumerate(spec_in.keys):
                chunks[i] = max(chunks[i], int(lengths[key][rows].sum()))
    recv_rows = np.full((w, b), w * num_rows + b, np.int32)
    for d in range(w):
        seen = np.zeros(w, np.int64)  # rows from each source arrive in ascending order
        for j, g in enumerate(plan.indices[d, : plan.num_real[d]]):
            s, i = divmod(int(g), b)
            recv_rows[d, j] = num_rows * w + i if s == d else s * num_rows + seen[s]
            seen[s] += s != d
    tables |= {"send_rows": send_rows, "recv_rows": recv_rows}
    xspec = col.ExchangeSpec(
        kind, w, spec_in, spec_out, num_rows, tuple(jb.bucket_capacity(c) for c in chunks)
    )
    return xspec, tables


@jax.jit
def _tokens_and_pairs(lengths: dict[str, jax.Array]) -> tuple[jax.Array, jax.Array]:
    zeros = jnp.zeros_like(lengths["item"])
    c = lengths.get("contextual", zeros)
    k = lengths.get("candidate", zeros)
    n = c + 2 * lengths["item"] + k
    h = n - k  # contextual + history tokens
    return n, c * h + (h * (h + 1) - c * (c + 1)) // 2 + k * (h + 1)


def local_workloads(batch: jb.DeviceBatch, cost: HSTUCost) -> np.ndarray:
    """Per-sample FLOPs `[len(local_ranks), batch_size]` (int64) of this process's ranks, from
    the pytree's lengths.

    The same formula as `HSTUCost.batch_flops` (hstu/workload.py): token and mask-pair counts
    are computed on device from `batch.lengths`, then weighted on the host in int64 (the FLOPs
    themselves overflow int32). The parity suite checks that both give identical numbers.
    """
    n, pairs = (jb.local_rows(x).astype(np.int64) for x in _tokens_and_pairs(batch.lengths))
    if n.size and n.max() > MAX_EXACT_TOKENS:
        raise HSTUError(
            f"local_workloads: a sample has {int(n.max())} tokens; int32 pair counts are exact "
            f"up to {MAX_EXACT_TOKENS}"
        )
    per_layer = n * cost.linear_flops_per_token() + pairs * cost.attention_flops_per_pair()
    return per_layer * (cost.num_layers * (3 if cost.backward else 1))


class JaxShuffler:
    """`to_device` / `allgather_stats` / `exchange` of the pipeline Backend, over a mesh."""

    def __init__(
        self,
        mesh: Mesh,
        exchange: str = "allgather",
        capacity: Callable[[int], int] = jb.bucket_capacity,
        host_exchange: bool | None = None,
        candidates_per_sample: int = 0,
    ):
        """`capacity`: token count -> token capacity (`hstu.capacity.CapacityPolicy`);
        `candidates_per_sample`: the bound on the candidate keys (`jb.candidate_bound`).
        `host_exchange` (default: one process drives the whole mesh): gather the stats and
        apply the plan on the host, where every rank's batch already is, and copy each rank
        its balanced batch; with several processes the device collectives do both."""
        if exchange not in ("allgather", "all2all"):
            raise ValueError(f"exchange must be 'allgather' or 'all2all', got {exchange!r}")
        self.mesh, self.exchange_kind, self.capacity = mesh, exchange, capacity
        self.candidates_per_sample = candidates_per_sample
        self.world_size = mesh.size
        self.local_ranks = col.local_ranks(mesh)
        self.sharding = col.rank_sharding(mesh)
        single = len(self.local_ranks) == self.world_size
        self.host_exchange = single if host_exchange is None else host_exchange
        if self.host_exchange and not single:
            raise HSTUError("host_exchange needs one process driving every rank of the mesh")
        self._pending: list[Placed] = []
        self.compiled: set = set()  # distinct static shapes seen = jit compilations

    @property
    def num_compiles(self) -> int:
        return len(self.compiled)

    def to_device(self, batches: Sequence[JaggedBatch]) -> Placed:
        placed = Placed(list(batches))
        self._pending.append(placed)  # its copy starts once the stats gather sizes it
        return placed

    def allgather_stats(self, local_stats: np.ndarray) -> np.ndarray:
        # This process's ranks must agree on the batch size before the gather (their rows
        # would be misattributed); every rank's layout is checked right after it, before the
        # copy below sizes device buffers from it (`hstu.signature`).
        signature.local_batch_size(local_stats, self.local_ranks, NUM_FIXED_STATS)
        if self.host_exchange:  # every rank's stats are this process's: no device round trip
            stats = np.ascontiguousarray(local_stats, dtype=np.int64)
        else:
            stats = col.allgather_stats(self.mesh, local_stats)
            self.compiled.add(("stats", local_stats.shape))
        signature.check_gathered(stats, self.world_size, NUM_FIXED_STATS)
        if self._pending:
            placed = self._pending.pop(0)
            placed.lengths = gathered_lengths(stats, placed.host[0].keys)
            placed.loss_tokens = int(stats[:, STAT_LOSS_TOKENS].sum())
            if not self.host_exchange:  # else the exchange copies the balanced batch (or
                self._materialize(placed, placed.lengths)  # `ensure`, the batch as loaded)
        return stats

    def _materialize(self, placed: Placed, lengths: dict[str, np.ndarray]) -> None:
        w = self.world_size
        rank_lengths = {k: v.reshape(w, -1) for k, v in lengths.items()}
        spec = jb.spec_for(placed.host[0], rank_lengths, self.capacity, self.candidates_per_sample)
        count = placed.loss_tokens  # rides the batch's copy (the step's divisor, float32)
        scalars = {} if count is None else {"loss_tokens": np.float32(count)}
        try:
            placed.batch, put = jb.to_device_with(placed.host, self.sharding, spec, scalars)
        except HSTUError as exc:  # say which rank's batch cannot go to the device
            for rank, batch in zip(self.local_ranks, placed.host, strict=True):
                try:
                    jb.host_arrays([batch], spec)
                except HSTUError as one:
                    raise HSTUError(f"invalid batch on rank {rank}: {one}") from exc
            raise
        placed.lengths, placed.host = lengths, None
        placed.loss_tokens_device = put.get("loss_tokens")

    def ensure(self, placed: Placed) -> Placed:
        """Copy a batch that is not on the devices yet (single process only): one that skipped
        the stats gather, or, with the host exchange, one that trains as loaded."""
        if placed.batch is None:
            if placed in self._pending:
                self._pending.remove(placed)
            keys = placed.host[0].keys
            lengths = placed.lengths or {
                k: np.concatenate([b.lengths[k] for b in placed.host]) for k in keys
            }
            self._materialize(placed, lengths)
        return placed

    def exchange(
        self, placed: Placed, plan: ShufflePlan, stats: np.ndarray | None = None
    ) -> Placed:
        # Buffers were sized at the stats gather already (`allgather_stats`), so `stats` is
        # not needed here; it is accepted to follow the pipeline's Backend protocol.
        if self.host_exchange and placed.batch is None:
            # One process holds every rank's batch: apply the plan on the host and copy each
            # device its balanced batch (what the device exchange yields, byte for byte).
            # Moving samples between ranks leaves the global loss-token count as it is.
            moved = Placed(exchange_reference(placed.host, plan), loss_tokens=placed.loss_tokens)
            after = _rank_lengths(placed.lengths, plan.indices)
            self._materialize(moved, {k: v.reshape(-1) for k, v in after.items()})
            return moved
        placed = self.ensure(placed)
        xspec, tables = plan_exchange(
            plan, placed.lengths, placed.batch.spec, self.exchange_kind, self.capacity
        )
        self.compiled.add(("exchange", xspec))
        local = {k: col.put_local(self.mesh, v[self.local_ranks]) for k, v in tables.items()}
        out = col.exchange_fn(self.mesh, xspec)(placed.batch, local)
        after = _rank_lengths(placed.lengths, plan.indices)
        lengths = {k: v.reshape(-1) for k, v in after.items()}  # the count stays: replicated
        return Placed(None, out, lengths, placed.loss_tokens, placed.loss_tokens_device)

    def shuffle(
        self,
        batches: Sequence[JaggedBatch],
        cost,
        task: str,
        shuffler: str = "balanced",
        method: str = "auto",
    ) -> Prepared:
        """One global batch through both balancer phases (library use, outside `run`)."""
        balancer = Balancer(self, shuffler, method, overlap=False)
        try:
            dev = self.to_device(batches)
            out = balancer.phase2(*balancer.phase1(dev, sample_stats(batches, cost, task)))
            out.device_batch = self.ensure(out.device_batch)
            return out
        finally:
            balancer.close()
