"""From gathered workloads to the exchange every rank performs. Pure numpy, no communication.

Global sample `g = r * B + i` is sample `i` of rank `r` (rank-major, what an allgather yields).
Every rank computes the same plan from the same gathered workloads, so no rank needs to be
told what the others do.

Layout of the local batch after the exchange: rank `r` holds `B` rows, its real samples first
in ascending global index, then padding. Because global indices are rank-major, the real rows
arriving from source rank `s` form one contiguous run, and the runs come in source order: the
all2all receiver needs no permutation, only concatenation in source order.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from hstu.errors import HSTUError
from hstu.partition import partition


@dataclass(frozen=True)
class ShufflePlan:
    world_size: int
    batch_size: int
    indices: np.ndarray  # [W, B] int64: global rows rank r holds after the exchange
    num_real: np.ndarray  # [W] int64: leading real rows of each rank's new batch

    def local_indices(self, rank: int) -> np.ndarray:
        return self.indices[rank]

    def send_local(self, src: int, dst: int) -> np.ndarray:
        """Local row indices (on `src`) of the real samples `src` sends to `dst`, in order."""
        real = self.indices[dst, : self.num_real[dst]]
        mine = real[real // self.batch_size == src]
        return mine - src * self.batch_size

    def send_counts(self) -> np.ndarray:
        """[W, W]: counts[s, d] = real samples that go from rank s to rank d (s == d: kept)."""
        w, b = self.world_size, self.batch_size
        counts = np.zeros((w, w), dtype=np.int64)
        for d in range(w):
            src = self.indices[d, : self.num_real[d]] // b
            counts[:, d] = np.bincount(src, minlength=w)
        return counts

    def num_moved(self) -> int:
        """Real samples that change rank: the all2all traffic, in samples."""
        counts = self.send_counts()
        return int(counts.sum() - np.trace(counts))


def _real_first(part: np.ndarray, real: np.ndarray) -> tuple[np.ndarray, int]:
    part = np.sort(part)
    is_real = real[part]
    return np.concatenate([part[is_real], part[~is_real]]), int(is_real.sum())


def make_plan(
    workloads: np.ndarray, real_mask: np.ndarray | None, world_size: int, method: str = "auto"
) -> ShufflePlan:
    """Balanced plan: equal-size partition of the `W * B` gathered workloads.

    Padding rows (real_mask False, or workload 0 when no mask is given) take part in the
    partition with workload 0, so every rank keeps exactly B rows.
    """
    workloads = np.asarray(workloads)
    n = workloads.shape[0]
    if world_size < 1 or n % world_size:
        raise HSTUError(
            f"make_plan: gathered workloads ({n}) must split evenly over world_size={world_size}"
        )
    real = (workloads > 0) if real_mask is None else np.asarray(real_mask, dtype=bool)
    if real.shape != (n,):
        raise HSTUError(f"make_plan: real_mask must have shape [{n}], got {list(real.shape)}")
    w = np.where(real, workloads, 0)
    parts = partition(w, world_size, method=method)
    rows, counts = zip(*(_real_first(p, real) for p in parts), strict=True)
    return ShufflePlan(
        world_size,
        n // world_size,
        np.stack(rows).astype(np.int64),
        np.asarray(counts, dtype=np.int64),
    )


def identity_plan(real_mask: np.ndarray, world_size: int) -> ShufflePlan:
    """Every rank keeps its own rows (what the identity shuffler amounts to)."""
    real = np.asarray(real_mask, dtype=bool)
    n = real.shape[0]
    if world_size < 1 or n % world_size:
        raise HSTUError(f"identity_plan: {n} rows do not split over world_size={world_size}")
    b = n // world_size
    rows, counts = zip(
        *(_real_first(np.arange(r * b, (r + 1) * b), real) for r in range(world_size)),
        strict=True,
    )
    return ShufflePlan(
        world_size, b, np.stack(rows).astype(np.int64), np.asarray(counts, dtype=np.int64)
    )


def exchange_reference(batches, plan: ShufflePlan):
    """numpy reference exchange: what every backend's allgather and all2all paths must yield."""
    from hstu.batch import concat

    if len(batches) != plan.world_size:
        raise HSTUError(
            f"exchange_reference: {len(batches)} batches for world_size {plan.world_size}"
        )
    glob = concat(batches)
    return [
        glob.index_select(plan.indices[r], int(plan.num_real[r])) for r in range(plan.world_size)
    ]
