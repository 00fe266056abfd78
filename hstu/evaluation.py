"""Offline metrics with the papers' protocols (numpy only).

Retrieval, full corpus (HSTU): every item is scored for each user; the user's seen items are
filtered out, except the target itself (on datasets with repeats the target may have been
seen, and filtering it would make it unreachable). Sampled (SASRec): the target competes with
100 items the user never interacted with. Either way a user's `rank` is the number of
competing items placed before the target (0 = top), and

    HR@K = mean(rank < K),   NDCG@K = mean(1 / log2(rank + 2) if rank < K else 0),
    MRR = mean(1 / (rank + 1)).

Ties are conservative: an item scoring exactly the target's score ranks before it (and a NaN
score ranks before everything; a NaN target ranks last). A model that collapses to constant
scores thus gets the worst rank, never the best; counting ties as half (the expected rank
under random tie-breaking) would still reward a collapsed model with chance-level numbers,
and strict `>` (as the training loop's in-batch HR does) would give it HR = 1.

Ranking: exact AUC per task (ties count one half, via average ranks) and normalized entropy
NE = log loss / entropy of the base rate (He et al., 2014; < 1 beats predicting the rate).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

from hstu.errors import HSTUError

ScoreFn = Callable[[np.ndarray, np.ndarray], np.ndarray]  # (rows, items) -> [rows, items]
DEFAULT_KS = (1, 10, 50, 200)


# ---------------------------------------------------------------------------- retrieval
def retrieval_ranks(
    scores_UI: np.ndarray, targets_U: np.ndarray, seen: Sequence[np.ndarray] | None = None
) -> np.ndarray:
    """Full-corpus rank of each user's target in a dense score matrix, seen items filtered."""
    scores_UI = np.asarray(scores_UI)
    if scores_UI.ndim != 2 or len(targets_U) != scores_UI.shape[0]:
        raise HSTUError(f"scores must be [U, num_items] with U = {len(targets_U)} targets")
    return retrieval_ranks_chunked(
        lambda rows, items: scores_UI[np.ix_(rows, items)],
        scores_UI.shape[1],
        targets_U,
        seen,
    )


def retrieval_ranks_chunked(
    score_fn: ScoreFn,
    num_items: int,
    targets_U: np.ndarray,
    seen: Sequence[np.ndarray] | None = None,
    *,
    user_block: int = 256,
    item_block: int = 1 << 16,
) -> np.ndarray:
    """Like `retrieval_ranks`, scoring blocks of users x items so that no [U, num_items]
    matrix is ever built. `score_fn(rows, items)` returns the [len(rows), len(items)] scores of
    users `rows` (indices into `targets_U`) for `items`; it is called once with the targets of
    a user block (the diagonal gives the target scores) then per item block. The score of a
    (user, item) pair must not depend on the other rows and items of the call beyond float
    rounding, which can only move items that score within rounding of the target."""
    targets_U = np.asarray(targets_U, dtype=np.int64)
    if targets_U.size and (targets_U.min() < 0 or targets_U.max() >= num_items):
        raise HSTUError(f"targets must lie in [0, num_items={num_items})")
    ranks = np.zeros(len(targets_U), dtype=np.int64)
    for lo in range(0, len(targets_U), user_block):
        rows = np.arange(lo, min(lo + user_block, len(targets_U)))
        targets = targets_U[rows]
        target_score = np.diagonal(np.asarray(score_fn(rows, targets))).copy()
        # Filtered pairs (row in block, item): the target itself, then seen items.
        fr, fi = [np.arange(len(rows))], [targets]
        if seen is not None:
            fr += [np.full(len(seen[r]), k) for k, r in enumerate(rows)]
            fi += [np.asarray(seen[r], dtype=np.int64) for r in rows]
        f_row, f_item = np.concatenate(fr), np.concatenate(fi)
        ahead = np.zeros(len(rows), dtype=np.int64)
        for i0 in range(0, num_items, item_block):
            items = np.arange(i0, min(i0 + item_block, num_items))
            s = np.asarray(score_fn(rows, items))
            before = (s >= target_score[:, None]) | np.isnan(s)
            before[np.isnan(target_score)] = True  # a NaN target ranks last
            inside = (f_item >= i0) & (f_item < items[-1] + 1)
            before[f_row[inside], f_item[inside] - i0] = False
            ahead += before.sum(axis=1)
        ranks[rows] = ahead
    return ranks


def sampled_ranks(target_scores_U: np.ndarray, negative_scores_UN: np.ndarray) -> np.ndarray:
    """Rank of each target among its sampled negatives (SASRec: 100), same tie rule."""
    t = np.asarray(target_scores_U, dtype=np.float64)[:, None]
    neg = np.asarray(negative_scores_UN, dtype=np.float64)
    before = (neg >= t) | np.isnan(neg) | np.isnan(t)
    return before.sum(axis=1).astype(np.int64)


def sample_unseen(
    rng: np.random.Generator, num_items: int, seen: np.ndarray, target: int, num: int = 100
) -> np.ndarray:
    """`num` distinct items drawn uniformly from those not in `seen` and not the target."""
    excluded = np.union1d(np.asarray(seen, dtype=np.int64), [int(target)])
    available = num_items - len(excluded)
    if available < num:
        raise HSTUError(
            f"cannot sample {num} unseen items: the user has seen {len(excluded)} of "
            f"{num_items} items"
        )
    if 2 * num > available:  # dense user: draw from the explicit complement
        return rng.choice(np.setdiff1d(np.arange(num_items), excluded), num, replace=False)
    out = np.zeros(0, dtype=np.int64)
    while len(out) < num:  # rejection sampling; at least half the draws are accepted
        draw = rng.integers(0, num_items, size=2 * num + 8)
        pos = np.clip(np.searchsorted(excluded, draw), 0, len(excluded) - 1)
        draw = draw[excluded[pos] != draw]
        merged = np.concatenate([out, draw])
        _, first = np.unique(merged, return_index=True)
        out = merged[np.sort(first)]  # distinct, in draw order
    return out[:num]


def sample_negatives(
    seed: int,
    num_items: int,
    user_ids: np.ndarray,
    seen: Sequence[np.ndarray],
    targets: np.ndarray,
    num: int = 100,
) -> np.ndarray:
    """[U, num] SASRec negatives; user `user_ids[u]`'s come from a generator seeded by (seed,
    that id), so they do not depend on which other users are evaluated with it."""
    out = np.zeros((len(targets), num), dtype=np.int64)
    for row, (user, target) in enumerate(zip(np.asarray(user_ids), np.asarray(targets))):
        rng = np.random.default_rng([seed, int(user)])
        out[row] = sample_unseen(rng, num_items, seen[row], target, num)
    return out


def topk_metrics(ranks: np.ndarray, ks: Sequence[int] = DEFAULT_KS) -> dict[str, float]:
    ranks = np.asarray(ranks, dtype=np.float64)
    if ranks.size == 0:
        return {"num_users": 0}
    out = {}
    for k in ks:
        hit = ranks < k
        out[f"hr@{k}"] = float(hit.mean())
        out[f"ndcg@{k}"] = float(np.where(hit, 1.0 / np.log2(ranks + 2.0), 0.0).mean())
    out["mrr"] = float((1.0 / (ranks + 1.0)).mean())
    out["num_users"] = int(ranks.size)
    return out


# ---------------------------------------------------------------------------- ranking
def average_ranks(x: np.ndarray) -> np.ndarray:
    """1-based ranks of `x`, tied values sharing the mean of their ranks."""
    x = np.asarray(x)
    order = np.argsort(x, kind="stable")
    xs = x[order]
    new = np.ones(len(xs), dtype=bool)
    new[1:] = xs[1:] != xs[:-1]
    group = np.cumsum(new) - 1
    starts = np.flatnonzero(new)
    ends = np.append(starts[1:], len(xs))
    ranks = np.empty(len(xs), dtype=np.float64)
    ranks[order] = ((starts + 1 + ends) / 2.0)[group]
    return ranks


def auc(labels: np.ndarray, scores: np.ndarray) -> float:
    """Exact ROC AUC (Mann-Whitney U); ties count one half. NaN when a class is empty or
    any score is NaN."""
    y = np.asarray(labels).astype(bool)
    scores = np.asarray(scores, dtype=np.float64)
    num_pos = int(y.sum())
    num_neg = len(y) - num_pos
    if num_pos == 0 or num_neg == 0 or np.isnan(scores).any():
        return float("nan")
    rank_sum = average_ranks(scores)[y].sum()
    return float((rank_sum - num_pos * (num_pos + 1) / 2.0) / (num_pos * num_neg))


def log_loss(labels: np.ndarray, logits: np.ndarray) -> float:
    y = np.asarray(labels, dtype=np.float64)
    z = np.asarray(logits, dtype=np.float64)
    return float(np.mean(np.logaddexp(0.0, z) - y * z))  # stable BCE with logits


def normalized_entropy(labels: np.ndarray, logits: np.ndarray) -> float:
    """Log loss over the entropy of the base rate; NaN when the labels are all one class."""
    p = float(np.mean(np.asarray(labels, dtype=np.float64))) if len(labels) else 0.0
    if p <= 0.0 or p >= 1.0:
        return float("nan")
    base = -(p * np.log(p) + (1.0 - p) * np.log(1.0 - p))
    return float(log_loss(labels, logits) / base)


# ---------------------------------------------------------------------------- accumulators
class RetrievalAccumulator:
    """Collects per-user ranks batch by batch; `result()` gives HR/NDCG@K and MRR."""

    def __init__(self, ks: Sequence[int] = DEFAULT_KS):
        self.ks = tuple(ks)
        self._ranks: list[np.ndarray] = []

    def add_ranks(self, ranks: np.ndarray) -> None:
        self._ranks.append(np.asarray(ranks, dtype=np.int64))

    def add_scores(self, scores_UI, targets_U, seen=None) -> None:
        self.add_ranks(retrieval_ranks(scores_UI, targets_U, seen))

    def result(self) -> dict[str, float]:
        ranks = np.concatenate(self._ranks) if self._ranks else np.zeros(0, np.int64)
        return topk_metrics(ranks, self.ks)


class RankingAccumulator:
    """Collects (label bitmask, per-task logits) batch by batch; exact AUC and NE per task."""

    def __init__(self, task_names: Sequence[str]):
        self.task_names = tuple(task_names)
        self._labels: list[np.ndarray] = []
        self._logits: list[np.ndarray] = []

    def add(self, label_bitmask: np.ndarray, logits: np.ndarray) -> None:
        logits = np.asarray(logits, dtype=np.float64)
        if logits.ndim != 2 or logits.shape[1] != len(self.task_names):
            raise HSTUError(f"logits must be [n, {len(self.task_names)}], got {logits.shape}")
        if logits.shape[0] != len(label_bitmask):
            raise HSTUError(f"{len(label_bitmask)} labels for {logits.shape[0]} logit rows")
        self._labels.append(np.asarray(label_bitmask, dtype=np.int64))
        self._logits.append(logits)

    def result(self) -> dict[str, float]:
        if not self._labels:
            return {"num_examples": 0}
        labels, logits = np.concatenate(self._labels), np.concatenate(self._logits)
        out: dict[str, float] = {}
        for t, name in enumerate(self.task_names):
            y = (labels >> t) & 1
            out[f"auc/{name}"] = auc(y, logits[:, t])
            out[f"ne/{name}"] = normalized_entropy(y, logits[:, t])
        out["num_examples"] = int(len(labels))
        return out
