import itertools

import numpy as np
import pytest

from hstu.errors import HSTUError
from hstu.workload import HSTUCost, attention_pairs, fit_calibration


def mask_bruteforce(n, c, k):
    """The mask of kernels/README.md, spelled out case by case."""
    allowed = np.zeros((n, n), dtype=bool)
    for i, j in itertools.product(range(n), range(n)):
        if j >= n - k:  # candidate key: only the candidate itself
            allowed[i, j] = i == j
        elif i < c:  # contextual query: every contextual and history key
            allowed[i, j] = True
        elif i >= n - k:  # candidate query: every non-candidate key
            allowed[i, j] = True
        else:  # history query: causal, diagonal included
            allowed[i, j] = j <= i
    return allowed


@pytest.mark.parametrize("n", range(0, 13))
def test_pairs_equal_bruteforce_count(n):
    for c in range(n + 1):
        for k in range(n - c + 1):
            assert attention_pairs(n, c, k) == mask_bruteforce(n, c, k).sum(), (n, c, k)


def test_pairs_vectorised_and_plain_causal():
    n = np.array([0, 1, 5, 100])
    np.testing.assert_array_equal(attention_pairs(n), n * (n + 1) // 2)


def test_pairs_reject_overlapping_context_and_candidates():
    with pytest.raises(HSTUError, match="num_contextual"):
        attention_pairs(3, 2, 2)


def test_flops_count_every_matmul_once_per_head():
    cost = HSTUCost(embedding_dim=8, num_layers=3, num_heads=2, attention_dim=4, linear_dim=5)
    n, c, k = 10, 2, 3
    pairs = mask_bruteforce(n, c, k).sum()
    proj = 2 * n * 8 * 2 * (2 * 5 + 2 * 4)
    attn = 2 * pairs * 2 * 4 + 2 * pairs * 2 * 5
    out = 2 * n * 2 * 5 * 8
    fwd = 3 * (proj + attn + out)
    assert HSTUCost(8, 3, 2, 4, 5, backward=False).flops(n, c, k) == fwd
    assert cost.flops(n, c, k) == 3 * fwd
    assert cost.flops(0) == 0


def test_batch_flops_zero_for_padding(demo_cfg):
    from hstu.testing import make_global_batch

    (b,) = make_global_batch(demo_cfg, 5, [3])
    f = HSTUCost.from_model_config(demo_cfg.model).batch_flops(b)
    assert (f[:3] > 0).all() and (f[3:] == 0).all()


def test_cost_validates():
    with pytest.raises(HSTUError, match="num_heads"):
        HSTUCost(8, 1, 0, 4, 4)


def test_calibration_recovers_linear_model():
    rng = np.random.default_rng(0)
    flops, n = rng.uniform(1e6, 1e9, 50), rng.integers(1, 4000, 50)
    sec = 2e-12 * flops + 3e-7 * n + 1e-5
    cal = fit_calibration(flops, n, sec)
    np.testing.assert_allclose([cal.a, cal.b, cal.c], [2e-12, 3e-7, 1e-5], rtol=1e-6)
    assert cal.predict([5.0], [0])[0] == 0.0
