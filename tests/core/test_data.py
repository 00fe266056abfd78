import numpy as np
import pytest

from hstu.data import DISTRIBUTIONS, SyntheticDataset, dataset_from_config, sample_lengths
from hstu.data.synthetic import SampleSpec
from hstu.errors import HSTUError


@pytest.mark.parametrize("name", sorted(DISTRIBUTIONS))
def test_lengths_are_seeded_and_in_range(name):
    a = sample_lengths(name, np.random.default_rng(7), 500, 3, 200)
    b = sample_lengths(name, np.random.default_rng(7), 500, 3, 200)
    np.testing.assert_array_equal(a, b)
    assert a.dtype == np.int64 and a.min() >= 3 and a.max() <= 200


def test_heavy_tails_are_heavy():
    rng = np.random.default_rng(0)
    for name in ("lognormal", "zipf", "pareto"):
        x = sample_lengths(name, rng, 20000, 1, 4096)
        assert np.percentile(x, 99) > 4 * np.median(x), name


def test_unknown_distribution():
    with pytest.raises(HSTUError, match="seqlen_dist"):
        sample_lengths("bimodal", np.random.default_rng(0), 3, 1, 2)


def test_batches_are_valid_and_shaped_by_config(demo_cfg):
    ds = dataset_from_config(demo_cfg, world_size=2, rank=1)
    b = next(ds).validate()
    d = demo_cfg.data
    assert b.batch_size == d.batch_size == b.actual_batch_size
    assert (b.lengths["contextual"] == d.num_contextual).all()
    assert b.lengths["item"].min() >= d.min_history and b.lengths["item"].max() <= d.max_history
    assert b.lengths["candidate"].max() <= d.max_candidates
    np.testing.assert_array_equal(b.dense["sample_id"], np.arange(8, 16))
    assert b.values["label"].max() < 2**demo_cfg.model.num_tasks


def test_incomplete_last_batch_is_padded_and_ranks_can_be_empty(demo_cfg):
    demo_cfg.data.num_samples = 27  # 4 ranks x 8: the 1st global batch holds 27 of 32
    ranks = [dataset_from_config(demo_cfg, 4, r) for r in range(4)]
    assert ranks[0].batches_per_epoch == 1
    sizes = [next(ds).validate().actual_batch_size for ds in ranks]
    assert sizes == [8, 8, 8, 3]
    demo_cfg.data.num_samples = 17
    ranks = [dataset_from_config(demo_cfg, 4, r) for r in range(4)]
    sizes = [next(ds).validate().actual_batch_size for ds in ranks]
    assert sizes == [8, 8, 1, 0]


def test_samples_do_not_depend_on_rank_or_world(demo_cfg):
    a = SyntheticDataset(SampleSpec.from_config(demo_cfg), 8, 1, 0).batch(0)
    parts = SyntheticDataset(SampleSpec.from_config(demo_cfg), 4, 2, 0).global_batch(0)
    assert a.index_select(np.arange(4)) == parts[0]
    assert a.index_select(np.arange(4, 8)) == parts[1]


def test_state_dict_resumes(demo_cfg):
    ds = dataset_from_config(demo_cfg, 2, 0)
    next(ds)
    state = ds.state_dict()
    want = next(ds)
    other = dataset_from_config(demo_cfg, 2, 0)
    other.load_state_dict(state)
    assert next(other) == want


def test_retrieval_task_adds_negatives(demo_cfg):
    demo_cfg.model.task = "retrieval"
    b = next(dataset_from_config(demo_cfg, 1, 0)).validate()
    r = demo_cfg.model.num_negatives
    np.testing.assert_array_equal(b.lengths["negative"], np.maximum(b.lengths["item"] - 1, 0) * r)
