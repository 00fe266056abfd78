import numpy as np
import pytest

from hstu.batch import JaggedBatch, concat, empty_like, lengths_to_offsets, pad_to, real_mask
from hstu.errors import HSTUError
from hstu.testing import make_global_batch


def small_batch():
    return JaggedBatch(
        batch_size=4,
        actual_batch_size=3,
        lengths={"a": np.array([2, 0, 1, 0]), "b": np.array([1, 1, 1, 0])},
        values={"a": np.array([10, 11, 12]), "b": np.array([20, 21, 22])},
        dense={"sample_id": np.array([5, 6, 7, 0])},
    )


def test_offsets_have_leading_zero():
    np.testing.assert_array_equal(lengths_to_offsets(np.array([2, 0, 3])), [0, 2, 2, 5])


def test_index_select_gathers_segments_in_order():
    b = small_batch().validate()
    out = b.index_select([2, 0, 3], actual_batch_size=2)
    np.testing.assert_array_equal(out.lengths["a"], [1, 2, 0])
    np.testing.assert_array_equal(out.values["a"], [12, 10, 11])
    np.testing.assert_array_equal(out.values["b"], [22, 20])
    np.testing.assert_array_equal(out.dense["sample_id"], [7, 5, 0])
    assert out.batch_size == 3 and out.actual_batch_size == 2
    out.validate()


def test_index_select_counts_real_rows_by_default():
    out = small_batch().index_select([0, 3])
    assert out.actual_batch_size == 1


def test_strip_padding_drops_jagged_and_dense_padding_together():
    out = small_batch().strip_padding()
    assert out.batch_size == out.actual_batch_size == 3
    assert out.dense["sample_id"].shape == (3,)
    assert out.lengths["a"].shape == (3,)
    out.validate()


def test_concat_is_rank_major_and_keeps_padding(demo_cfg):
    parts = make_global_batch(demo_cfg, 4, [4, 2, 0])
    glob = concat(parts)
    assert glob.batch_size == 12
    np.testing.assert_array_equal(real_mask(parts), [1] * 4 + [1, 1, 0, 0] + [0] * 4)
    for r, p in enumerate(parts):
        back = glob.index_select(np.arange(r * 4, r * 4 + 4), p.actual_batch_size)
        assert back == p


def test_equality_is_bytewise():
    a, b = small_batch(), small_batch()
    assert a == b
    b.values["a"] = b.values["a"].astype(np.int32)
    assert a != b and "values['a']" in a.diff(b)[0]


@pytest.mark.parametrize(
    "mutate, message",
    [
        (lambda b: b.lengths.__setitem__("a", np.array([2, 0, 1])), "lengths['a'] must have shape"),
        (lambda b: b.lengths.__setitem__("a", np.array([2, 0, 0, 1])), "padding samples must be 0"),
        (lambda b: b.values.__setitem__("a", np.array([1, 2])), "values['a'] must have shape"),
        (lambda b: b.dense.__setitem__("sample_id", np.array([1, 2, 3, 4])), "padding rows"),
        (lambda b: b.dense.__setitem__("sample_id", np.array([1, 2, 3])), "dim 0 == batch_size"),
        (lambda b: setattr(b, "actual_batch_size", 5), "actual_batch_size"),
        (lambda b: b.lengths.__setitem__("a", np.array([-1, 0, 1, 0])), "negative"),
        (lambda b: b.values.pop("b"), "jagged keys differ"),
    ],
)
def test_validate_names_field_and_rank(mutate, message):
    b = small_batch()
    mutate(b)
    with pytest.raises(HSTUError, match="rank 3") as info:
        b.validate(rank=3)
    assert message in str(info.value)
    assert isinstance(info.value, ValueError)


def test_item_and_action_lengths_must_agree(demo_cfg):
    (b,) = make_global_batch(demo_cfg, 4, [3])
    b.lengths["action"] = b.lengths["action"].copy()
    b.lengths["action"][0] += 1
    b.values["action"] = np.concatenate([b.values["action"], [0]])
    with pytest.raises(HSTUError, match="item.*action"):
        b.validate()


def test_empty_like_and_pad_to(demo_cfg):
    (b,) = make_global_batch(demo_cfg, 3, [3])
    e = empty_like(b).validate()
    assert e.actual_batch_size == 0 and e.num_real_tokens() == 0
    p = pad_to(b, 5).validate()
    assert p.batch_size == 5 and p.strip_padding() == b.strip_padding()


def test_seq_lengths_follow_the_token_layout(demo_cfg):
    (b,) = make_global_batch(demo_cfg, 4, [3])
    expected = b.lengths["contextual"] + 2 * b.lengths["item"] + b.lengths["candidate"]
    np.testing.assert_array_equal(b.seq_lengths(), expected)
    assert b.seq_lengths()[3] == 0


def test_model_input_check_names_bad_ids_negatives_and_long_samples():
    from hstu.batch import check_model_inputs
    from hstu.config import load_config
    from hstu.testing import DEMO_CONFIG

    cfg = load_config(DEMO_CONFIG, ["model.task=retrieval"])
    limit = cfg.data.max_seqlen
    (batch,) = make_global_batch(cfg, 4, [3])
    check_model_inputs(batch, cfg.model, limit)
    bad = batch.clone()
    bad.values["action"][0] = cfg.model.num_actions
    with pytest.raises(HSTUError, match=r"rank 2: values\['action'\]"):
        check_model_inputs(bad, cfg.model, limit, rank=2)
    bad = batch.clone()
    bad.values["item"][1] = -1
    with pytest.raises(HSTUError, match=r"values\['item'\] must lie in \[0, 2000\)"):
        check_model_inputs(bad, cfg.model, limit)
    bad = batch.clone()
    bad.lengths["negative"][0] += 1
    with pytest.raises(HSTUError, match="negative"):
        check_model_inputs(bad, cfg.model, limit)
    longest = int(batch.seq_lengths().max())
    with pytest.raises(HSTUError, match=f"over the configured maximum {longest - 1}"):
        check_model_inputs(batch, cfg.model, longest - 1, rank=0)
    ranking = load_config(DEMO_CONFIG)
    with pytest.raises(HSTUError, match="needs jagged keys"):
        check_model_inputs(make_global_batch(ranking, 4, [3])[0], cfg.model, limit)
