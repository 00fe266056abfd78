"""The JaggedBatch spec: the one batch form every backend converts to and from.

A batch holds `batch_size` samples; samples `[actual_batch_size, batch_size)` are padding
at the tail.

* Jagged features follow TorchRec's convention: per key, `lengths[batch_size]` (int64) and
  `values[sum(lengths)]`; offsets have `batch_size + 1` entries with a leading 0. Padding
  samples have length 0 in every key.
* Dense per-sample fields have dim 0 == `batch_size`; padding rows are zero.

After a shuffle the local batch is again a valid padded batch of the same `batch_size`,
real samples first: padding is kept for jagged AND dense fields alike (upstream stripped the
dense padding but kept the KJT padding; we do not copy that inconsistency). Backends with
dynamic shapes may then call `strip_padding()`, which drops the padding rows of every field at
once; static-shape backends (JAX) keep the padded form and rely on the zero lengths.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from hstu.errors import HSTUError

# The HSTU sample layout used by the synthetic generator, the loaders and both models.
# Every key is jagged with int64 values; a sample's token sequence is
#   [contextual (C)] + interleave(item, action) (2 L) + [candidate (K)].
HSTU_JAGGED_KEYS = (
    "contextual",  # contextual feature ids, C per sample
    "item",  # history item ids, L per sample
    "action",  # history action ids, L per sample (same lengths as item)
    "item_time",  # history timestamps, L per sample
    "candidate",  # candidate item ids, K per sample
    "candidate_time",  # candidate timestamps, K per sample
    "label",  # per-candidate task bitmask, K per sample
)

# HSTU tokens per jagged value: a contextual feature and a candidate are one token, a history
# event two (its item and its action)
TOKENS_PER_VALUE = (("contextual", 1), ("item", 2), ("candidate", 1))


def sample_tokens(sample: dict) -> int:
    """HSTU tokens of one sample (a `SampleSource.sample` dict): C + 2 L + K."""
    return sum(w * len(sample[k]) for k, w in TOKENS_PER_VALUE if k in sample)


HSTU_DENSE_KEYS = ("sample_id",)  # [batch_size] int64, a globally unique id per sample


def lengths_to_offsets(lengths: np.ndarray) -> np.ndarray:
    offsets = np.zeros(len(lengths) + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    return offsets


@dataclass
class JaggedBatch:
    batch_size: int
    actual_batch_size: int
    lengths: dict[str, np.ndarray] = field(default_factory=dict)
    values: dict[str, np.ndarray] = field(default_factory=dict)
    dense: dict[str, np.ndarray] = field(default_factory=dict)

    # ------------------------------------------------------------------ invariants
    def validate(self, rank: int | None = None) -> JaggedBatch:
        """Check every invariant of the spec; raise HSTUError naming field, rank and values.

        Runs on the host before any collective, so a malformed batch fails on its own rank
        with a message instead of leaving the other ranks waiting in a collective.
        """
        where = f" on rank {rank}" if rank is not None else ""

        def fail(msg: str) -> None:
            raise HSTUError(f"invalid batch{where}: {msg}")

        bs, abs_ = self.batch_size, self.actual_batch_size
        if not isinstance(bs, (int, np.integer)) or bs < 0:
            fail(f"batch_size must be a non-negative int, got {bs!r}")
        if not isinstance(abs_, (int, np.integer)) or not 0 <= abs_ <= bs:
            fail(f"actual_batch_size must be in [0, batch_size={bs}], got {abs_!r}")
        if set(self.lengths) != set(self.values):
            fail(
                f"jagged keys differ: lengths has {sorted(self.lengths)}, "
                f"values has {sorted(self.values)}"
            )
        for key, lens in self.lengths.items():
            lens = np.asarray(lens)
            vals = np.asarray(self.values[key])
            if lens.ndim != 1 or lens.shape[0] != bs:
                fail(f"lengths['{key}'] must have shape [{bs}], got {list(lens.shape)}")
            if not np.issubdtype(lens.dtype, np.integer):
                fail(f"lengths['{key}'] must be integer, got dtype {lens.dtype}")
            if lens.size and lens.min() < 0:
                bad = np.flatnonzero(lens < 0)[:5]
                fail(f"lengths['{key}'] has negative entries at samples {bad.tolist()}")
            if np.any(lens[abs_:] != 0):
                bad = (np.flatnonzero(lens[abs_:]) + abs_)[:5]
                fail(
                    f"lengths['{key}'] of padding samples must be 0 (actual_batch_size={abs_}); "
                    f"samples {bad.tolist()} have lengths {lens[bad].tolist()}"
                )
            if vals.ndim != 1 or vals.shape[0] != int(lens.sum()):
                fail(
                    f"values['{key}'] must have shape [sum(lengths)={int(lens.sum())}], "
                    f"got {list(vals.shape)}"
                )
        for name, arr in self.dense.items():
            arr = np.asarray(arr)
            if arr.ndim < 1 or arr.shape[0] != bs:
                fail(f"dense['{name}'] must have dim 0 == batch_size={bs}, got {list(arr.shape)}")
            if np.any(arr[abs_:] != 0):
                bad = (np.flatnonzero(np.any(arr[abs_:].reshape(bs - abs_, -1), axis=1)) + abs_)[:5]
                fail(f"dense['{name}'] padding rows must be zero; rows {bad.tolist()} are not")
        if all(k in self.lengths for k in ("item", "action")) and not np.array_equal(
            self.lengths["item"], self.lengths["action"]
        ):
            bad = np.flatnonzero(self.lengths["item"] != self.lengths["action"])[:5]
            fail(f"lengths['item'] != lengths['action'] at samples {bad.tolist()}")
        for a, b in (
            ("item", "item_time"),
            ("candidate", "candidate_time"),
            ("candidate", "label"),
        ):
            if (
                a in self.lengths
                and b in self.lengths
                and not np.array_equal(self.lengths[a], self.lengths[b])
            ):
                bad = np.flatnonzero(self.lengths[a] != self.lengths[b])[:5]
                fail(f"lengths['{a}'] != lengths['{b}'] at samples {bad.tolist()}")
        return self

    # ------------------------------------------------------------------ accessors
    @property
    def keys(self) -> list[str]:
        return list(self.lengths)

    def offsets(self, key: str) -> np.ndarray:
        return lengths_to_offsets(self.lengths[key])

    def seq_lengths(self) -> np.ndarray:
        """HSTU token count per sample: C + 2 L + K (zero for padding)."""
        total = np.zeros(self.batch_size, dtype=np.int64)
        for key, weight in TOKENS_PER_VALUE:
            if key in self.lengths:
                total += weight * self.lengths[key]
        return total

    def num_real_tokens(self) -> int:
        return int(self.seq_lengths().sum())

    # ------------------------------------------------------------------ reference ops
    def index_select(
        self, indices: Sequence[int] | np.ndarray, actual_batch_size: int | None = None
    ) -> JaggedBatch:
        """Rows `indices` in that order. The result's `batch_size` is `len(indices)`.

        `actual_batch_size` defaults to the number of selected real samples; the caller must
        order real samples first (the shuffle plan does) or validate() will reject the result.
        """
        idx = np.asarray(indices, dtype=np.int64)
        if idx.size and (idx.min() < 0 or idx.max() >= self.batch_size):
            raise HSTUError(
                f"index_select: indices must lie in [0, {self.batch_size}), "
                f"got min {idx.min()} max {idx.max()}"
            )
        if actual_batch_size is None:
            actual_batch_size = int(np.count_nonzero(idx < self.actual_batch_size))
        lengths, values = {}, {}
        for key, lens in self.lengths.items():
            offs = lengths_to_offsets(lens)
            sel_lens = lens[idx]
            starts = offs[:-1][idx]
            # Gather each selected segment: token positions start + arange(length).
            seg = np.repeat(starts - lengths_to_offsets(sel_lens)[:-1], sel_lens)
            pos = seg + np.arange(int(sel_lens.sum()), dtype=np.int64)
            lengths[key] = sel_lens.astype(np.int64)
            values[key] = np.asarray(self.values[key])[pos]
        dense = {name: np.asarray(arr)[idx] for name, arr in self.dense.items()}
        return JaggedBatch(len(idx), actual_batch_size, lengths, values, dense)

    def strip_padding(self) -> JaggedBatch:
        """Drop padding rows of every field (jagged and dense alike)."""
        return self.index_select(np.arange(self.actual_batch_size), self.actual_batch_size)

    def clone(self) -> JaggedBatch:
        return JaggedBatch(
            self.batch_size,
            self.actual_batch_size,
            {k: v.copy() for k, v in self.lengths.items()},
            {k: v.copy() for k, v in self.values.items()},
            {k: v.copy() for k, v in self.dense.items()},
        )

    def equals(self, other: JaggedBatch) -> bool:
        """Exact equality: sizes, keys, dtypes, shapes and every byte."""
        return not self.diff(other)

    def diff(self, other: JaggedBatch) -> list[str]:
        """Human-readable differences (empty when equal); used by tests and parity checks."""
        out = []
        if (self.batch_size, self.actual_batch_size) != (other.batch_size, other.actual_batch_size):
            out.append(
                f"sizes ({self.batch_size}, {self.actual_batch_size}) != "
                f"({other.batch_size}, {other.actual_batch_size})"
            )
        for kind in ("lengths", "values", "dense"):
            mine, theirs = getattr(self, kind), getattr(other, kind)
            if set(mine) != set(theirs):
                out.append(f"{kind} keys {sorted(mine)} != {sorted(theirs)}")
                continue
            for key in mine:
                a, b = np.asarray(mine[key]), np.asarray(theirs[key])
                if a.dtype != b.dtype or a.shape != b.shape or a.tobytes() != b.tobytes():
                    out.append(
                        f"{kind}['{key}'] differs ({a.dtype}{list(a.shape)} vs "
                        f"{b.dtype}{list(b.shape)})"
                    )
        return out

    def __eq__(self, other: object) -> bool:
        return isinstance(other, JaggedBatch) and self.equals(other)

    __hash__ = None  # mutable


def concat(batches: Sequence[JaggedBatch]) -> JaggedBatch:
    """Rank-major concatenation of per-rank batches: what an allgather of the batch yields.

    The result keeps every rank's padding in place (global sample `r * B + i` is sample `i`
    of rank `r`), so `actual_batch_size` is not meaningful for it and is set to the total
    row count; use `real_mask(batches)` for which rows are real.
    """
    if not batches:
        raise HSTUError("concat: need at least one batch")
    keys = batches[0].keys
    dense_keys = list(batches[0].dense)
    for r, b in enumerate(batches):
        if b.keys != keys or list(b.dense) != dense_keys:
            raise HSTUError(
                f"concat: batch {r} has keys {b.keys}/{list(b.dense)}, expected {keys}/{dense_keys}"
            )
    total = sum(b.batch_size for b in batches)
    return JaggedBatch(
        total,
        total,
        {k: np.concatenate([b.lengths[k] for b in batches]) for k in keys},
        {k: np.concatenate([b.values[k] for b in batches]) for k in keys},
        {k: np.concatenate([b.dense[k] for b in batches]) for k in dense_keys},
    )


def real_mask(batches: Sequence[JaggedBatch]) -> np.ndarray:
    """[sum batch_size] bool: which rows of `concat(batches)` are real samples."""
    return (
        np.concatenate([np.arange(b.batch_size) < b.actual_batch_size for b in batches])
        if batches
        else np.zeros(0, dtype=bool)
    )


def empty_like(batch: JaggedBatch, batch_size: int | None = None) -> JaggedBatch:
    """An all-padding batch with the same keys and dtypes."""
    bs = batch.batch_size if batch_size is None else batch_size
    return JaggedBatch(
        bs,
        0,
        {k: np.zeros(bs, dtype=np.int64) for k in batch.lengths},
        {k: np.zeros(0, dtype=np.asarray(v).dtype) for k, v in batch.values.items()},
        {
            k: np.zeros((bs, *np.asarray(v).shape[1:]), dtype=np.asarray(v).dtype)
            for k, v in batch.dense.items()
        },
    )


def pad_to(batch: JaggedBatch, batch_size: int) -> JaggedBatch:
    """Append padding samples so that the batch holds `batch_size` rows."""
    if batch_size < batch.batch_size:
        raise HSTUError(f"pad_to: batch_size {batch_size} < current {batch.batch_size}")
    extra = batch_size - batch.batch_size
    return JaggedBatch(
        batch_size,
        batch.actual_batch_size,
        {k: np.concatenate([v, np.zeros(extra, np.int64)]) for k, v in batch.lengths.items()},
        {k: v.copy() for k, v in batch.values.items()},
        {
            k: np.concatenate([v, np.zeros((extra, *v.shape[1:]), v.dtype)])
            for k, v in batch.dense.items()
        },
    )


def from_samples(
    samples: Sequence[Mapping[str, np.ndarray]],
    batch_size: int,
    jagged_keys: Sequence[str] = HSTU_JAGGED_KEYS,
    dense_keys: Sequence[str] = HSTU_DENSE_KEYS,
) -> JaggedBatch:
    """Build a padded batch from per-sample dicts (jagged key -> 1-D array, dense -> scalar)."""
    if len(samples) > batch_size:
        raise HSTUError(f"from_samples: {len(samples)} samples exceed batch_size {batch_size}")
    lengths = {}
    values = {}
    for k in jagged_keys:
        lens = np.zeros(batch_size, dtype=np.int64)
        lens[: len(samples)] = [len(s[k]) for s in samples]
        lengths[k] = lens
        values[k] = (
            np.concatenate([np.asarray(s[k], dtype=np.int64) for s in samples])
            if samples
            else np.zeros(0, np.int64)
        )
    dense = {}
    for k in dense_keys:
        col = np.zeros(batch_size, dtype=np.int64)
        col[: len(samples)] = [int(s[k]) for s in samples]
        dense[k] = col
    return JaggedBatch(batch_size, len(samples), lengths, values, dense)


@dataclass(frozen=True)
class ModelInputCheck:
    """`check_model_inputs` bound to a model config, as a picklable callable `(batch, rank)`
    (it runs in the data worker processes with `data.workers`)."""

    model: Any
    max_seqlen: int

    def __call__(self, batch: JaggedBatch, rank: int | None = None) -> None:
        check_model_inputs(batch, self.model, self.max_seqlen, rank)


def check_model_inputs(batch: JaggedBatch, model, max_seqlen: int, rank: int | None = None):
    """What the HSTU model of `model` (a ModelConfig) needs of a valid batch, checked on the
    host before any collective, the same for both backends: the jagged keys of its task, ids
    inside their tables, the retrieval negatives' counts, and no sample longer than
    `max_seqlen` tokens (the bound the kernels tile for; a longer sample is an error, never
    truncated). Out-of-range ids would otherwise fail inside a device kernel mid-step (torch)
    or read a wrong row (a clamped gather)."""
    where = f" on rank {rank}" if rank is not None else ""
    needed = HSTU_JAGGED_KEYS + (("negative",) if model.task == "retrieval" else ())
    missing = [k for k in needed if k not in batch.lengths]
    if missing:
        raise HSTUError(f"invalid batch{where}: the {model.task} model needs jagged keys {missing}")
    limits = {
        "contextual": model.num_contextual_ids,
        "item": model.num_items,
        "candidate": model.num_items,
        "action": model.num_actions,
        "label": 2**model.num_tasks,
        "negative": model.num_items,
    }
    for key, limit in limits.items():
        if key not in needed:
            continue
        ids = np.asarray(batch.values[key])
        bad = np.flatnonzero((ids < 0) | (ids >= limit))
        if bad.size:
            raise HSTUError(
                f"invalid batch{where}: values['{key}'] must lie in [0, {limit}); "
                f"positions {bad[:5].tolist()} hold {ids[bad[:5]].tolist()}"
            )
    seq = batch.seq_lengths()
    long = np.flatnonzero(seq > max_seqlen)
    if long.size:
        raise HSTUError(
            f"invalid batch{where}: samples {long[:5].tolist()} have {seq[long[:5]].tolist()} "
            f"tokens, over the configured maximum {max_seqlen} (data.num_contextual + "
            "2 * data.max_history + data.max_candidates); raise those limits"
        )
    if model.task == "retrieval":
        want = np.maximum(batch.lengths["item"] - 1, 0) * model.num_negatives
        bad = np.flatnonzero(batch.lengths["negative"] != want)
        if bad.size:
            raise HSTUError(
                f"invalid batch{where}: lengths['negative'] must be "
                f"(len(item) - 1) * num_negatives={model.num_negatives}; samples "
                f"{bad[:5].tolist()} have {batch.lengths['negative'][bad[:5]].tolist()}"
            )
