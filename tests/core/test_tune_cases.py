"""The tile sweeps' shared pieces (numpy only): mask pair counts and the best-tile choice."""

import dataclasses

import numpy as np
from hstu_kernels.tune_cases import bench_upstream_batch, mask_pairs, sweep_table


def _brute_pairs(n: int, c: int, k: int) -> int:
    i, j = np.arange(n)[:, None], np.arange(n)[None, :]
    return int(((i == j) | ((j < n - k) & ((j <= i) | (i < c)))).sum())


def test_mask_pairs_match_the_mask():
    cases = [(10, 0, 0), (10, 3, 2), (7, 4, 0), (5, 0, 5), (1, 0, 0), (6, 10, 1)]
    for n, c, k in cases:
        assert mask_pairs([n], c, np.array([k])) == _brute_pairs(n, c, k)
    assert mask_pairs([10, 7], 3, np.array([2, 0])) == _brute_pairs(10, 3, 2) + _brute_pairs(
        7, 3, 0
    )


def test_bench_upstream_batch_is_in_range_and_seeded():
    lengths, cand = bench_upstream_batch(np.random.default_rng(0), 32)
    assert ((cand >= 8) & (cand <= 64)).all()
    hist = (lengths - 4 - cand) // 2
    assert ((hist >= 16) & (hist <= 2000)).all()
    again, _ = bench_upstream_batch(np.random.default_rng(0), 32)
    assert (again == lengths).all()


@dataclasses.dataclass(frozen=True)
class _Tiles:
    q: int
    k: int


def test_sweep_table_picks_the_best_tile_timed_in_every_case():
    a, b, c = _Tiles(64, 32), _Tiles(128, 64), _Tiles(32, 32)
    results = {  # b is fastest in one case, a in the other; c failed in one case
        "equal": [("fwd", a, 1.0, ""), ("fwd", b, 0.9, ""), ("fwd", c, 0.5, "")],
        "jagged": [("fwd", a, 1.0, ""), ("fwd", b, 1.5, ""), ("fwd", c, float("nan"), "Err")],
    }
    text = sweep_table(results, ["fwd"], "q,k")
    assert "best fwd: _Tiles(q=64, k=32)" in text  # 1.0/0.9 + 1 beats 1 + 1.5
    assert "128,64" in text and "Err" in text
