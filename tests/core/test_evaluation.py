"""Every metric against a brute-force Python computation on random inputs, ties included."""

import math

import numpy as np
import pytest

from hstu.errors import HSTUError
from hstu.evaluation import (
    RankingAccumulator,
    RetrievalAccumulator,
    auc,
    normalized_entropy,
    retrieval_ranks,
    retrieval_ranks_chunked,
    sample_negatives,
    sample_unseen,
    sampled_ranks,
    topk_metrics,
)


def brute_rank(row, target, seen):
    t = row[target]
    competitors = [i for i in range(len(row)) if i != target and i not in set(seen)]
    if math.isnan(t):
        return len(competitors)
    return sum(1 for i in competitors if math.isnan(row[i]) or row[i] >= t)


def random_retrieval(seed, num_users=23, num_items=41, levels=4):
    rng = np.random.default_rng(seed)
    scores = rng.integers(0, levels, size=(num_users, num_items)).astype(np.float64)  # ties
    targets = rng.integers(0, num_items, num_users)
    seen = [rng.choice(num_items, rng.integers(0, 10), replace=False) for _ in range(num_users)]
    seen[0] = np.append(seen[0], targets[0])  # a seen target is never filtered
    return scores, targets, seen


@pytest.mark.parametrize("seed", range(4))
def test_full_corpus_ranks_match_brute_force(seed):
    scores, targets, seen = random_retrieval(seed)
    scores[1, 3] = np.nan
    scores[2, targets[2]] = np.nan
    want = [brute_rank(scores[u], targets[u], seen[u]) for u in range(len(targets))]
    np.testing.assert_array_equal(retrieval_ranks(scores, targets, seen), want)
    chunked = retrieval_ranks_chunked(
        lambda rows, items: scores[np.ix_(rows, items)],
        scores.shape[1],
        targets,
        seen,
        user_block=5,
        item_block=7,
    )
    np.testing.assert_array_equal(chunked, want)


def test_ties_rank_the_target_last_and_constant_scores_score_worst():
    scores = np.zeros((3, 10))
    ranks = retrieval_ranks(scores, np.array([0, 4, 9]), [np.array([1, 2]), [], [0]])
    np.testing.assert_array_equal(ranks, [7, 9, 8])
    assert topk_metrics(ranks, ks=(5,))["hr@5"] == 0.0


def test_topk_metrics_match_definitions():
    rng = np.random.default_rng(0)
    ranks = rng.integers(0, 30, 200)
    got = topk_metrics(ranks, ks=(1, 10))
    for k in (1, 10):
        assert got[f"hr@{k}"] == pytest.approx(sum(r < k for r in ranks) / 200)
        ndcg = sum(1 / math.log2(r + 2) for r in ranks if r < k) / 200
        assert got[f"ndcg@{k}"] == pytest.approx(ndcg)
    assert got["mrr"] == pytest.approx(sum(1 / (r + 1) for r in ranks) / 200)
    assert got["num_users"] == 200


def test_sampled_ranks_match_brute_force():
    rng = np.random.default_rng(1)
    target = rng.integers(0, 3, 50).astype(float)
    negatives = rng.integers(0, 3, (50, 100)).astype(float)
    want = [sum(n >= t for n in row) for t, row in zip(target, negatives)]
    np.testing.assert_array_equal(sampled_ranks(target, negatives), want)


def test_sampled_negatives_are_unseen_distinct_and_seeded():
    rng = np.random.default_rng(2)
    seen = [rng.choice(300, 40, replace=False) for _ in range(20)]
    targets = rng.integers(0, 300, 20)
    users = np.arange(20) * 3
    neg = sample_negatives(7, 300, users, seen, targets, 100)
    for u in range(20):
        assert len(set(neg[u])) == 100
        assert not set(neg[u]) & (set(seen[u]) | {targets[u]})
    np.testing.assert_array_equal(neg, sample_negatives(7, 300, users, seen, targets, 100))
    # a user's negatives do not depend on the other users evaluated with it
    odd = slice(1, None, 2)
    again = sample_negatives(7, 300, users[odd], seen[odd], targets[odd], 100)
    np.testing.assert_array_equal(neg[odd], again)
    dense = sample_unseen(np.random.default_rng(0), 150, np.arange(40), 45, 100)  # complement
    assert len(set(dense)) == 100 and dense.min() >= 40 and 45 not in dense
    with pytest.raises(HSTUError, match="cannot sample 100"):
        sample_unseen(np.random.default_rng(0), 120, np.arange(30), 50, 100)


def brute_auc(labels, scores):
    pos = [s for y, s in zip(labels, scores) if y]
    neg = [s for y, s in zip(labels, scores) if not y]
    pairs = sum(1.0 if p > n else 0.5 if p == n else 0.0 for p in pos for n in neg)
    return pairs / (len(pos) * len(neg))


@pytest.mark.parametrize("seed", range(4))
def test_auc_matches_pairwise_count_with_ties(seed):
    rng = np.random.default_rng(seed)
    labels = rng.random(120) < 0.3
    scores = rng.integers(0, 6, 120).astype(float) + labels * rng.random(120)
    assert auc(labels, scores) == pytest.approx(brute_auc(labels, scores))
    assert auc(labels, np.zeros(120)) == 0.5
    assert math.isnan(auc(np.zeros(5), np.arange(5)))


def test_normalized_entropy_matches_formula():
    rng = np.random.default_rng(3)
    y = (rng.random(300) < 0.2).astype(float)
    z = rng.normal(size=300)
    prob = [1 / (1 + math.exp(-zi)) for zi in z]
    loss = -sum(yi * math.log(q) + (1 - yi) * math.log(1 - q) for yi, q in zip(y, prob)) / 300
    p = y.mean()
    entropy = -(p * math.log(p) + (1 - p) * math.log(1 - p))
    assert normalized_entropy(y, z) == pytest.approx(loss / entropy)
    # predicting the base rate everywhere scores exactly 1
    assert normalized_entropy(y, np.full(300, math.log(p / (1 - p)))) == pytest.approx(1.0)
    assert math.isnan(normalized_entropy(np.ones(4), np.zeros(4)))


def test_accumulators_equal_one_shot_metrics():
    scores, targets, seen = random_retrieval(5, num_users=30)
    acc = RetrievalAccumulator(ks=(1, 5))
    for lo in range(0, 30, 7):
        acc.add_scores(scores[lo : lo + 7], targets[lo : lo + 7], seen[lo : lo + 7])
    assert acc.result() == topk_metrics(retrieval_ranks(scores, targets, seen), (1, 5))

    rng = np.random.default_rng(6)
    labels = rng.integers(0, 4, 200)
    logits = rng.normal(size=(200, 2)) + ((labels[:, None] >> np.arange(2)) & 1)
    ranking = RankingAccumulator(["click", "like"])
    for lo in range(0, 200, 64):
        ranking.add(labels[lo : lo + 64], logits[lo : lo + 64])
    got = ranking.result()
    for t, name in enumerate(["click", "like"]):
        y = (labels >> t) & 1
        assert got[f"auc/{name}"] == pytest.approx(brute_auc(y, logits[:, t]))
        assert got[f"ne/{name}"] == pytest.approx(normalized_entropy(y, logits[:, t]))
    assert got["auc/click"] > 0.6 and got["num_examples"] == 200
    with pytest.raises(HSTUError, match="logits must be"):
        ranking.add(labels[:3], logits[:3, :1])
