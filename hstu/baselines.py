"""Reference scorers and the evaluation drivers that run them on a prepared dataset.

A trained model should beat these by a margin; the end-to-end tests assert it. A scorer is
`scorer(users, items) -> scores`, evaluated elementwise with numpy broadcasting on dense user
and item ids (`users[:, None]` against `items[None, :]` for the full corpus, against an [U, N]
array for sampled negatives). A model plugs into the same drivers through a scorer that looks
up its query vector by user.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

from hstu.evaluation import (
    DEFAULT_KS,
    RankingAccumulator,
    retrieval_ranks_chunked,
    sampled_ranks,
    topk_metrics,
)

Scorer = Callable[[np.ndarray, np.ndarray], np.ndarray]
_TIE_BREAK = 0.5  # < 1: never reorders two items whose train counts differ


def _hash_uniform(seed: int, a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Uniform [0, 1) from a splitmix64 hash of (seed, a, b): the same pair always gets the
    same value, however the calls are chunked."""
    with np.errstate(over="ignore"):
        x = np.uint64(seed) * np.uint64(0x9E3779B97F4A7C15)
        x = x + np.asarray(a, np.uint64) * np.uint64(0xBF58476D1CE4E5B9)
        x = x + np.asarray(b, np.uint64) * np.uint64(0x94D049BB133111EB)
        x ^= x >> np.uint64(30)
        x *= np.uint64(0xBF58476D1CE4E5B9)
        x ^= x >> np.uint64(27)
        x *= np.uint64(0x94D049BB133111EB)
        x ^= x >> np.uint64(31)
    return (x >> np.uint64(11)).astype(np.float64) / float(1 << 53)


class PopularityBaseline:
    """Score = the item's train count; equal counts are broken by a fixed hash of the item, so
    that the conservative tie rule of the metrics does not punish the baseline for ties."""

    def __init__(self, dataset, seed: int = 0):
        train = dataset.train_events()
        counts = np.bincount(train["item"], minlength=dataset.num_items).astype(np.float64)
        items = np.arange(len(counts))
        self.scores = counts + _TIE_BREAK * _hash_uniform(seed, items, items)

    def __call__(self, users: np.ndarray, items: np.ndarray) -> np.ndarray:
        return np.broadcast_to(self.scores[items], np.broadcast_shapes(users.shape, items.shape))


class RandomBaseline:
    def __init__(self, seed: int = 0):
        self.seed = seed

    def __call__(self, users: np.ndarray, items: np.ndarray) -> np.ndarray:
        return _hash_uniform(self.seed, users, items)


def _eval_examples(dataset, split: str, max_users: int | None, num_negatives: int = 0):
    examples = list(dataset.eval_samples(split, max_users, num_negatives))
    users = np.asarray([e["user"] for e in examples], dtype=np.int64)
    targets = np.asarray([e["target"] for e in examples], dtype=np.int64)
    return examples, users, targets


def evaluate_full(
    dataset,
    split: str,
    scorer: Scorer,
    ks: Sequence[int] = DEFAULT_KS,
    max_users: int | None = None,
) -> dict[str, float]:
    """HSTU protocol: rank the held-out item against the whole corpus, seen items filtered."""
    examples, users, targets = _eval_examples(dataset, split, max_users)
    ranks = retrieval_ranks_chunked(
        lambda rows, items: scorer(users[rows][:, None], items[None, :]),
        dataset.num_items,
        targets,
        [e["seen"] for e in examples],
    )
    return topk_metrics(ranks, ks)


def evaluate_sampled(
    dataset,
    split: str,
    scorer: Scorer,
    num_negatives: int = 100,
    ks: Sequence[int] = (1, 5, 10),
    max_users: int | None = None,
) -> dict[str, float]:
    """SASRec protocol: the held-out item against `num_negatives` unseen items per user."""
    examples, users, targets = _eval_examples(dataset, split, max_users, num_negatives)
    negatives = np.stack([e["negatives"] for e in examples])
    ranks = sampled_ranks(scorer(users, targets), scorer(users[:, None], negatives))
    return topk_metrics(ranks, ks)


class ItemRateBaseline:
    """Ranking: each task's logit is the item's smoothed train positive rate (the base rate
    for unseen items). What an id-only model can learn without the history."""

    def __init__(self, dataset, prior_weight: float = 5.0):
        train = dataset.train_events()
        bits = (train["label"][:, None] >> np.arange(dataset.num_tasks)) & 1  # [E, T]
        base = bits.mean(axis=0) if len(bits) else np.full(dataset.num_tasks, 0.5)
        shows = np.bincount(train["item"], minlength=dataset.num_items)[:, None]
        hits = np.stack(
            [
                np.bincount(train["item"], bits[:, t], dataset.num_items)
                for t in range(bits.shape[1])
            ],
            axis=1,
        )
        rate = (hits + prior_weight * base) / (shows + prior_weight)
        rate = np.clip(rate, 1e-6, 1 - 1e-6)
        self.logits = np.log(rate) - np.log1p(-rate)  # [num_items, T]

    def __call__(self, example: dict) -> np.ndarray:
        return self.logits[int(example["candidate"][0])]


def evaluate_ranking(
    dataset, split: str, logits_fn: Callable[[dict], np.ndarray], max_users: int | None = None
) -> dict[str, float]:
    """AUC and NE per task of `logits_fn(eval_sample) -> [num_tasks]` on the held-out events."""
    acc = RankingAccumulator(dataset.task_names)
    for ex in dataset.eval_samples(split, max_users):
        acc.add(ex["label"], np.asarray(logits_fn(ex), dtype=np.float64)[None, :])
    return acc.result()
