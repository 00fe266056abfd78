"""PreparedDataset: sample structure, epoch coverage, determinism, evaluation examples."""

import numpy as np
import pytest

from hstu.batch import HSTU_DENSE_KEYS, from_samples
from hstu.data.prepare import prepare
from hstu.data.prepared import PreparedDataset, PreparedSpec
from hstu.errors import HSTUError
from hstu.testing_data import PlantedSpec, write_dataset

SPEC = PlantedSpec(num_users=60, num_items=300, max_events=30)


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("prepared")
    out = {}
    for name in ("ml-1m", "kuairand-pure"):
        prepare(name, write_dataset(name, root / f"{name}-src", SPEC), root / name)
        out[name] = root / name
    return out


def user_events(ds, user):
    lo, hi = int(ds._offsets[user]), int(ds._offsets[user + 1])
    return np.asarray(ds._item[lo:hi]), np.asarray(ds._time[lo:hi]), int(ds._num_train[user])


@pytest.mark.parametrize("k, max_history, min_history", [(4, 8, 1), (1, 3, 0), (3, 50, 5)])
def test_ranking_epoch_labels_every_train_event_once(dirs, k, max_history, min_history):
    spec = PreparedSpec("ranking", max_history, min_history, num_candidates=k)
    ds = PreparedDataset(dirs["ml-1m"], spec)
    seen = []
    for i in range(ds.num_samples):
        s = ds.sample(i)
        user, start, cand, end = ds.window(int(ds.permutation(0)[i]))
        items, times, num_train = user_events(ds, user)
        assert cand == end - len(s["candidate"])
        assert 1 <= len(s["candidate"]) <= k and len(s["item"]) <= max_history
        assert end <= num_train  # never a valid/test event
        np.testing.assert_array_equal(s["item"], items[start:cand])  # history right before
        np.testing.assert_array_equal(s["candidate"], items[cand:end])
        np.testing.assert_array_equal(s["candidate_time"], times[cand:end])
        assert len(s["item"]) == min(max_history, cand)
        seen += [(user, p) for p in range(cand, end)]
    want = [(u, p) for u in range(ds.num_users) for p in range(min_history, int(ds._num_train[u]))]
    assert sorted(seen) == want


def test_retrieval_epoch_targets_every_train_event_once(dirs):
    ds = PreparedDataset(dirs["ml-1m"], PreparedSpec("retrieval", max_history=7))
    targets = []
    for s in range(ds.num_samples):
        user, start, cand, end = ds.window(s)
        assert cand == end and 2 <= end - start <= 7 and end <= int(ds._num_train[user])
        targets += [(user, p) for p in range(start + 1, end)]
    want = [(u, p) for u in range(ds.num_users) for p in range(1, int(ds._num_train[u]))]
    assert sorted(targets) == want


def test_samples_batch_like_synthetic_ones(dirs):
    spec = PreparedSpec("retrieval", max_history=12, num_negatives=5)
    ds = PreparedDataset(dirs["kuairand-pure"], spec)
    samples = [ds.sample(i) for i in range(10)]
    assert set(samples[0]) == set(ds.jagged_keys) | set(HSTU_DENSE_KEYS)
    batch = from_samples(samples, 16, ds.jagged_keys).validate()
    np.testing.assert_array_equal(
        batch.lengths["negative"], (batch.lengths["item"] - 1).clip(0) * 5
    )
    assert (batch.lengths["contextual"][:10] == ds.num_contextual).all()
    assert batch.values["contextual"].max() < ds.num_contextual_ids
    assert batch.values["negative"].max() < ds.num_items
    assert (batch.lengths["candidate"] == 0).all()


def test_labels_keep_the_low_task_bits(dirs):
    full = PreparedDataset(dirs["kuairand-pure"], PreparedSpec(num_candidates=8))
    two = PreparedDataset(dirs["kuairand-pure"], PreparedSpec(num_candidates=8, num_tasks=2))
    assert two.task_names == ["is_click", "long_view"] and len(full.task_names) == 8
    for i in range(20):
        a, b = full.sample(i)["label"], two.sample(i)["label"]
        np.testing.assert_array_equal(b, a & 3)
    with pytest.raises(HSTUError, match="num_tasks=9 but kuairand-pure has 8 tasks"):
        PreparedDataset(dirs["kuairand-pure"], PreparedSpec(num_tasks=9))


def test_order_is_seeded_per_epoch_and_rank_independent(dirs):
    spec = PreparedSpec("retrieval", max_history=10, num_negatives=3, seed=4)
    a, b = PreparedDataset(dirs["ml-1m"], spec), PreparedDataset(dirs["ml-1m"], spec)
    n = a.num_samples
    assert not np.array_equal(a.permutation(0), a.permutation(1))
    np.testing.assert_array_equal(sorted(a.permutation(1)), np.arange(n))
    for i in (0, 5, n - 1, n, 2 * n + 3):
        b.sample(3 * n - 1 - i % n)  # `b` reads in another order, as another rank would
        sa, sb = a.sample(i), b.sample(i)
        for key in sa:
            np.testing.assert_array_equal(sa[key], sb[key])
        assert sa["sample_id"] == i
    epoch1 = a.sample(n + 2)
    user, start, _, end = a.window(int(a.permutation(1)[2]))
    np.testing.assert_array_equal(epoch1["item"], user_events(a, user)[0][start:end])
    other = PreparedDataset(dirs["ml-1m"], PreparedSpec("retrieval", 10, num_negatives=3, seed=5))
    assert not np.array_equal(other.permutation(0), a.permutation(0))


def test_eval_examples(dirs):
    ds = PreparedDataset(dirs["ml-1m"], PreparedSpec(max_history=5))
    users = ds.eval_users("test")
    assert len(users) == ds.manifest.num_eval_users
    for user in users[:10]:
        items, times, num_train = user_events(ds, user)
        valid, test = ds.eval_sample("valid", user), ds.eval_sample("test", user)
        assert valid["target"] == items[-2] and test["target"] == items[-1]
        np.testing.assert_array_equal(test["item"], items[-6:-1])  # includes the valid event
        np.testing.assert_array_equal(valid["item"], items[-7:-2])
        np.testing.assert_array_equal(test["seen"], np.unique(items[:-1]))
        assert test["candidate"].tolist() == [items[-1]] and len(test["label"]) == 1
        negatives = ds.eval_sample("test", user, num_negatives=50)["negatives"]
        assert len(set(negatives)) == 50 and not set(negatives) & set(items)
        again = ds.eval_sample("test", user, num_negatives=50)["negatives"]
        np.testing.assert_array_equal(negatives, again)
    assert len(list(ds.eval_samples("valid", max_users=3))) == 3
    with pytest.raises(HSTUError, match="split='train' must be one of"):
        ds.eval_users("train")


def test_ranges_and_spec_validation(dirs):
    ds = PreparedDataset(dirs["ml-1m"])
    m = ds.manifest
    ds.check_model(m.num_items, 10, m.num_contextual_ids, 2)
    with pytest.raises(HSTUError, match=r"model.num_items=10 < \d+ .*model.num_actions=5 < 10"):
        ds.check_model(10, 5, m.num_contextual_ids, 2)
    with pytest.raises(HSTUError, match="model.num_tasks=3 > the dataset's 2 tasks"):
        ds.check_model(m.num_items, 10, m.num_contextual_ids, 3)
    with pytest.raises(HSTUError, match="PreparedSpec.max_history=1 must be >= 2"):
        PreparedSpec("retrieval", max_history=1)
    with pytest.raises(HSTUError, match="PreparedSpec.task='rank'"):
        PreparedSpec("rank")
    with pytest.raises(HSTUError, match="global index -1"):
        ds.sample(-1)


def test_is_a_sample_source_for_the_loader(dirs):
    from hstu.data.loader import DataLoader

    ds = PreparedDataset(dirs["ml-1m"], PreparedSpec(max_history=6, num_candidates=2))
    loader = DataLoader(ds, batch_size=4, world_size=2, ranks=[0, 1])
    ranks = next(loader)
    for rank, batch in enumerate(ranks):
        batch.validate()
        np.testing.assert_array_equal(batch.dense["sample_id"], np.arange(4) + 4 * rank)
        assert batch.values["label"].max() < 4


def test_spec_from_a_training_config():
    from types import SimpleNamespace

    data = SimpleNamespace(
        max_history=50, min_history=2, max_candidates=3, seed=9, num_contextual=2
    )
    model = SimpleNamespace(task="retrieval", num_negatives=16, num_tasks=2)
    spec = PreparedSpec.from_config(SimpleNamespace(data=data, model=model))
    assert spec == PreparedSpec("retrieval", 50, 2, 3, num_negatives=16, num_tasks=None, seed=9)
    model.task = "ranking"
    spec = PreparedSpec.from_config(SimpleNamespace(data=data, model=model))
    assert (spec.num_negatives, spec.num_tasks, spec.num_candidates) == (0, 2, 3)
