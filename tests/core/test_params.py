import numpy as np

from hstu.config import ModelConfig
from hstu.params import init_params, num_params, param_shapes


def test_init_is_seeded_and_shaped():
    m = ModelConfig(rab_position_buckets=8, rab_time_buckets=4)
    a, b = init_params(m, 3), init_params(m, 3)
    assert list(a) == list(param_shapes(m))
    for name, arr in a.items():
        assert arr.dtype == np.float32 and arr.shape == param_shapes(m)[name]
        np.testing.assert_array_equal(arr, b[name])
    assert sum(v.size for v in a.values()) == num_params(m)
    assert not np.array_equal(init_params(m, 4)["layers.0.uvqk.kernel"], a["layers.0.uvqk.kernel"])


def test_adding_a_parameter_keeps_the_others():
    plain = init_params(ModelConfig(), 0)
    with_rab = init_params(ModelConfig(rab_position_buckets=8), 0)
    for name, arr in plain.items():
        np.testing.assert_array_equal(arr, with_rab[name])


def test_retrieval_has_no_ranking_head():
    names = param_shapes(ModelConfig(task="retrieval"))
    assert not any(n.startswith("head.") for n in names)


def test_a_table_is_drawn_in_seeded_row_blocks_any_slice_alone():
    """A sharded rank draws only its rows, yet gets exactly what the whole-table init gives;
    a table of up to one block is the single draw of earlier releases (checkpoints and golden
    curves keep their numbers)."""
    import zlib

    from hstu.params import TABLE_INIT_BLOCK, init_table_rows

    m = ModelConfig(embedding_dim=4, num_items=2 * TABLE_INIT_BLOCK + 5, num_actions=7)
    whole = init_params(m, 1)
    for name in ("embedding.item", "embedding.action"):
        rows = whole[name].shape[0]
        for a, b in (
            (0, rows),
            (3, 9),
            (TABLE_INIT_BLOCK - 2, TABLE_INIT_BLOCK + 3),
            (rows - 1, rows),
        ):
            if b <= rows:
                for workers in (1, 3):  # threads draw the blocks: same values however many
                    got = init_table_rows(m, 1, name, a, b, workers=workers)
                    np.testing.assert_array_equal(got, whole[name][a:b])
    one_draw = np.random.default_rng([1, zlib.crc32(b"embedding.action")]).normal(0, 0.5, (7, 4))
    np.testing.assert_array_equal(whole["embedding.action"], one_draw.astype(np.float32))
    first = whole["embedding.item"][:TABLE_INIT_BLOCK]
    assert not np.array_equal(first[:5], whole["embedding.item"][TABLE_INIT_BLOCK:][:5])
    assert "embedding.item" not in init_params(m, 1, tables=False)
