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
