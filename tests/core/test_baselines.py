"""Baselines on the planted data, through the same metrics a trained model is scored with.

The ordering asserted here (random < popularity < the planted walk) is what makes "a trained
model beats popularity" a meaningful end-to-end check: the structure is there to be learned.
"""

import numpy as np
import pytest

from hstu.baselines import (
    ItemRateBaseline,
    PopularityBaseline,
    RandomBaseline,
    evaluate_full,
    evaluate_ranking,
    evaluate_sampled,
)
from hstu.data.prepare import prepare
from hstu.data.prepared import PreparedDataset
from hstu.testing_data import PlantedSpec, write_dataset


@pytest.fixture(scope="module")
def ds(tmp_path_factory):
    root = tmp_path_factory.mktemp("baselines")
    src = write_dataset("ml-1m", root / "src", PlantedSpec(num_users=300, seed=3))
    prepare("ml-1m", src, root / "out")
    return PreparedDataset(root / "out")


class WalkOracle:
    """Knows the planted rule: the next item is 1-3 ids after the user's last one."""

    def __init__(self, ds, split):
        self.last = np.zeros(ds.num_users, dtype=np.int64)
        for ex in ds.eval_samples(split):
            self.last[ex["user"]] = ex["item"][-1]
        self.num_items = ds.num_items

    def __call__(self, users, items):
        return -((items - self.last[users]) % self.num_items).astype(np.float64)


def test_full_corpus_random_popularity_walk(ds):
    random = evaluate_full(ds, "test", RandomBaseline(seed=0), ks=(10, 50))
    popular = evaluate_full(ds, "test", PopularityBaseline(ds), ks=(10, 50))
    walk = evaluate_full(ds, "test", WalkOracle(ds, "test"), ks=(10, 50))
    assert random["num_users"] == popular["num_users"] == 300
    assert random["hr@10"] < 0.06  # chance is 10 / num_items = 0.02
    assert popular["hr@10"] > 3 * max(random["hr@10"], 0.02)
    assert walk["hr@10"] > popular["hr@10"] + 0.3
    assert walk["ndcg@10"] > popular["ndcg@10"] > random["ndcg@10"]
    assert evaluate_full(ds, "test", RandomBaseline(seed=0), ks=(10, 50)) == random


def test_sampled_protocol_orders_the_same(ds):
    random = evaluate_sampled(ds, "valid", RandomBaseline(seed=1))
    popular = evaluate_sampled(ds, "valid", PopularityBaseline(ds))
    walk = evaluate_sampled(ds, "valid", WalkOracle(ds, "valid"))
    assert abs(random["hr@10"] - 10 / 101) < 0.06
    assert popular["hr@10"] > random["hr@10"] + 0.08
    assert walk["hr@10"] > popular["hr@10"] + 0.3


def test_ranking_item_rate_beats_constant(ds):
    rate = evaluate_ranking(ds, "test", ItemRateBaseline(ds))
    constant = evaluate_ranking(ds, "test", lambda ex: np.zeros(2))
    assert constant["auc/rating>=4"] == 0.5
    assert rate["auc/rating>=4"] > 0.75 and rate["ne/rating>=4"] < 0.9
    assert rate["num_examples"] == 300
