"""Seeded synthetic HSTU data: contextual features, item + action history, candidates, labels.

Sample `s` is generated from its own generator seeded by `(seed, s)`, so any rank (and both
backends) can rebuild any sample, and the iterator state is a single integer: the index of
the next global batch. Global batch `t` holds samples `[t * W * B, (t + 1) * W * B)` (W ranks,
B per rank); rank `r` reads the `r`-th contiguous block of `B`. When an epoch of
`num_samples` does not fill the last global batch, that batch is padded per the batch spec,
and trailing ranks may receive no real sample at all.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from hstu.batch import HSTU_DENSE_KEYS, HSTU_JAGGED_KEYS, JaggedBatch, from_samples
from hstu.data.distributions import sample_lengths
from hstu.errors import HSTUError


@dataclass(frozen=True)
class SampleSpec:
    seed: int
    seqlen_dist: str
    seqlen_params: dict
    min_history: int
    max_history: int
    num_contextual: int
    min_candidates: int
    max_candidates: int
    num_items: int
    num_actions: int
    num_contextual_ids: int
    num_tasks: int
    time_step: int
    num_negatives: int  # 0: no "negative" key (ranking)

    @classmethod
    def from_config(cls, cfg) -> SampleSpec:
        d, m = cfg.data, cfg.model
        return cls(
            d.seed,
            d.seqlen_dist,
            dict(d.seqlen_params),
            d.min_history,
            d.max_history,
            d.num_contextual,
            d.min_candidates,
            d.max_candidates,
            m.num_items,
            m.num_actions,
            m.num_contextual_ids,
            m.num_tasks,
            d.time_step,
            m.num_negatives if m.task == "retrieval" else 0,
        )

    @property
    def jagged_keys(self) -> tuple[str, ...]:
        return HSTU_JAGGED_KEYS + (("negative",) if self.num_negatives else ())


def make_sample(spec: SampleSpec, sample_id: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng([spec.seed, sample_id])
    num_history = int(
        sample_lengths(
            spec.seqlen_dist, rng, 1, spec.min_history, spec.max_history, **spec.seqlen_params
        )[0]
    )
    num_cand = int(rng.integers(spec.min_candidates, spec.max_candidates + 1))
    # A user drifts through item space: the next item is near the previous one, so a model
    # can learn something (retrieval) and labels depend on the item and the last action.
    start = rng.integers(0, spec.num_items)
    steps = rng.integers(-3, 4, size=num_history + num_cand)
    walk = (start + np.cumsum(steps)) % spec.num_items
    items, candidates = walk[:num_history], walk[num_history:]
    actions = rng.integers(0, spec.num_actions, size=num_history)
    times = np.cumsum(rng.exponential(spec.time_step, size=num_history + num_cand)).astype(np.int64)
    last_action = int(actions[-1]) if num_history else 0
    label = np.zeros(num_cand, dtype=np.int64)
    for t in range(spec.num_tasks):
        p = 0.2 + 0.6 * (((candidates + t + last_action) % 4) == 0)
        label |= (rng.random(num_cand) < p).astype(np.int64) << t
    sample = {
        "contextual": rng.integers(0, spec.num_contextual_ids, size=spec.num_contextual),
        "item": items,
        "action": actions,
        "item_time": times[:num_history],
        "candidate": candidates,
        "candidate_time": times[num_history:],
        "label": label,
        "sample_id": sample_id,
    }
    if spec.num_negatives:
        # Negatives are drawn here, per sample, so where a sample trains never changes them.
        num_targets = max(num_history - 1, 0)
        sample["negative"] = rng.integers(0, spec.num_items, size=num_targets * spec.num_negatives)
    return sample


class SyntheticSamples:
    """The synthetic sample stream as a `hstu.data.loader.SampleSource`: global index `i`
    is sample `i % num_samples` (every epoch replays the same samples), or `i` when endless."""

    def __init__(self, spec: SampleSpec, num_samples: int = 0):
        self.spec, self.num_samples = spec, num_samples

    @property
    def jagged_keys(self) -> tuple[str, ...]:
        return self.spec.jagged_keys

    def sample(self, index: int) -> dict[str, np.ndarray]:
        return make_sample(self.spec, index % self.num_samples if self.num_samples else index)


class SyntheticDataset:
    """Per-rank iterator of padded JaggedBatches by global batch index (tests and examples;
    training reads through `hstu.data.loader.DataLoader`, by sample position)."""

    def __init__(
        self, spec: SampleSpec, batch_size: int, world_size: int, rank: int, num_samples: int = 0
    ):
        if not 0 <= rank < world_size:
            raise HSTUError(f"rank {rank} outside [0, world_size={world_size})")
        self.spec, self.batch_size = spec, batch_size
        self.world_size, self.rank, self.num_samples = world_size, rank, num_samples
        self.next_batch = 0  # global batch index (counts across epochs)

    @property
    def batches_per_epoch(self) -> int:
        per_global = self.batch_size * self.world_size
        return -(-self.num_samples // per_global) if self.num_samples else 0

    def sample_ids(self, global_batch: int, rank: int | None = None) -> np.ndarray:
        rank = self.rank if rank is None else rank
        per_global = self.batch_size * self.world_size
        epoch_batches = self.batches_per_epoch
        if epoch_batches:
            t = global_batch % epoch_batches  # every epoch replays the same samples
            first = t * per_global + rank * self.batch_size
            last = min(first + self.batch_size, self.num_samples)
            return np.arange(first, max(first, last), dtype=np.int64)
        first = global_batch * per_global + rank * self.batch_size
        return np.arange(first, first + self.batch_size, dtype=np.int64)

    def batch(self, global_batch: int, rank: int | None = None) -> JaggedBatch:
        samples = [make_sample(self.spec, int(s)) for s in self.sample_ids(global_batch, rank)]
        return from_samples(samples, self.batch_size, self.spec.jagged_keys, HSTU_DENSE_KEYS)

    def global_batch(self, global_batch: int) -> list[JaggedBatch]:
        """Every rank's batch of one step (tests and the single-controller JAX backend)."""
        return [self.batch(global_batch, r) for r in range(self.world_size)]

    def __iter__(self):
        return self

    def __next__(self) -> JaggedBatch:
        out = self.batch(self.next_batch)
        self.next_batch += 1
        return out

    def state_dict(self) -> dict:
        return {"next_batch": self.next_batch}

    def load_state_dict(self, state: dict) -> None:
        self.next_batch = int(state["next_batch"])


def source_from_config(cfg) -> SyntheticSamples:
    """The sample source of `cfg.data`."""
    return SyntheticSamples(SampleSpec.from_config(cfg), cfg.data.num_samples)


def dataset_from_config(cfg, world_size: int, rank: int) -> SyntheticDataset:
    return SyntheticDataset(
        SampleSpec.from_config(cfg), cfg.data.batch_size, world_size, rank, cfg.data.num_samples
    )
