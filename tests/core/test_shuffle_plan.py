import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hstu.batch import concat, real_mask
from hstu.errors import HSTUError
from hstu.partition import lower_bound
from hstu.shuffle_plan import exchange_reference, identity_plan, make_plan
from hstu.testing import make_global_batch


@st.composite
def gathered(draw):
    w = draw(st.integers(1, 8))
    b = draw(st.integers(1, 12))
    real = np.array(draw(st.lists(st.booleans(), min_size=w * b, max_size=w * b)))
    work = np.array(draw(st.lists(st.integers(1, 10**6), min_size=w * b, max_size=w * b)))
    return w, b, np.where(real, work, 0), real


@settings(max_examples=150, deadline=None)
@given(gathered())
def test_plan_is_an_equal_size_permutation_with_real_rows_first(case):
    w, b, work, real = case
    plan = make_plan(work, real, w)
    assert plan.indices.shape == (w, b)
    np.testing.assert_array_equal(np.sort(plan.indices.ravel()), np.arange(w * b))
    assert plan.num_real.sum() == real.sum()
    for r in range(w):
        rows, k = plan.indices[r], plan.num_real[r]
        assert real[rows[:k]].all() and not real[rows[k:]].any()
        assert (np.diff(rows[:k]) > 0).all() and (np.diff(rows[k:]) > 0).all()
    # deterministic and respects the lower bound
    again = make_plan(work.copy(), real.copy(), w)
    np.testing.assert_array_equal(plan.indices, again.indices)
    sums = work[plan.indices].sum(axis=1)
    assert sums.max() >= lower_bound(work, w) - 1e-6


@settings(max_examples=100, deadline=None)
@given(gathered())
def test_send_plan_covers_exactly_the_real_rows(case):
    w, b, work, real = case
    plan = make_plan(work, real, w)
    counts = plan.send_counts()
    assert counts.sum() == real.sum()
    np.testing.assert_array_equal(counts.sum(axis=0), plan.num_real)
    for d in range(w):
        # receiver order = concatenation of the source runs in source order
        got = np.concatenate([s * b + plan.send_local(s, d) for s in range(w)])
        np.testing.assert_array_equal(got, plan.indices[d, : plan.num_real[d]])
    assert plan.num_moved() == counts.sum() - np.trace(counts)


def test_identity_plan_keeps_rows_and_moves_nothing():
    real = np.array([1, 1, 0, 1, 0, 0], dtype=bool)
    plan = identity_plan(real, 2)
    np.testing.assert_array_equal(plan.indices, [[0, 1, 2], [3, 4, 5]])
    np.testing.assert_array_equal(plan.num_real, [2, 1])
    assert plan.num_moved() == 0


def test_reference_exchange_balances_and_preserves_samples(demo_cfg):
    from hstu.pipeline import STAT_WORKLOAD, sample_stats
    from hstu.workload import HSTUCost

    parts = make_global_batch(demo_cfg, 6, [6, 5, 0, 3])
    stats = sample_stats(parts, HSTUCost.from_model_config(demo_cfg.model), "ranking")
    plan = make_plan(stats[:, STAT_WORKLOAD], stats[:, 3].astype(bool), 4)
    out = exchange_reference(parts, plan)
    for b in out:
        b.validate()
    ids = np.sort(np.concatenate([b.strip_padding().dense["sample_id"] for b in out]))
    glob = concat(parts)
    np.testing.assert_array_equal(ids, np.sort(glob.dense["sample_id"][real_mask(parts)]))
    before = stats[:, STAT_WORKLOAD].reshape(4, 6).sum(1)
    after = stats[plan.indices, STAT_WORKLOAD].sum(1)
    assert after.max() / after.mean() < before.max() / before.mean()


def test_all_padding_global_batch(demo_cfg):
    parts = make_global_batch(demo_cfg, 3, [0, 0])
    plan = make_plan(np.zeros(6), np.zeros(6, bool), 2)
    out = exchange_reference(parts, plan)
    assert all(b.actual_batch_size == 0 and b.batch_size == 3 for b in out)


def test_bad_sizes_are_reported():
    with pytest.raises(HSTUError, match="world_size=4"):
        make_plan(np.ones(6), None, 4)
    with pytest.raises(HSTUError, match="real_mask"):
        make_plan(np.ones(4), np.ones(3, bool), 2)
