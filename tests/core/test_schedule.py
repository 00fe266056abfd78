"""The attention kernels' program schedule (numpy): every (block, sample) pair holding tokens
exactly once, heaviest first, within the grid bound."""

import numpy as np
import pytest
from hstu_kernels.schedule import cdiv, pairs, schedule


def _work(blk, n, block, key_major):
    """Blocks the program walks: query block blk sees blk + 1 key blocks; key block blk is seen
    by the query blocks from blk to the sample's last."""
    return cdiv(n, block) - blk if key_major else blk + 1


@pytest.mark.parametrize("key_major", [False, True], ids=["query_major", "key_major"])
@pytest.mark.parametrize("block", [16, 64])
def test_schedule_covers_each_pair_once_heaviest_first(key_major, block):
    rng = np.random.default_rng(block)
    for trial in range(20):
        batch = int(rng.integers(1, 40))
        lengths = rng.integers(0, 300, size=batch)
        lengths[rng.random(batch) < 0.2] = 0  # empty samples
        max_seqlen = max(int(lengths.max()), 1) + int(rng.integers(0, 100))
        offs = np.concatenate([[0], np.cumsum(lengths)])
        tokens = int(offs[-1]) + int(rng.integers(0, 50))  # capacity padding after the last
        grid = pairs(tokens, batch, max_seqlen, block)
        blk, b, valid = schedule(np, offs, max_seqlen, grid, block, key_major)
        want = {(m, s) for s, n in enumerate(lengths.tolist()) for m in range(cdiv(n, block))}
        got = list(zip(blk[valid == 1].tolist(), b[valid == 1].tolist(), strict=True))
        assert len(got) == len(set(got)) and set(got) == want, (trial, lengths)
        assert grid >= len(want)
        assert not valid[len(want) :].any() and valid[: len(want)].all()
        work = [_work(m, lengths[s], block, key_major) for m, s in got]
        assert work == sorted(work, reverse=True)
        assert not blk[valid == 0].any() and not b[valid == 0].any()


def test_grid_bound_is_tight_for_jagged_and_equal_batches():
    # 8 x 4096 equal: every level of every sample (64-row blocks: 64 x 8 pairs)
    assert pairs(8 * 4096, 8, 4096, 64) == 8 * 64
    # one long sample among short ones: the bound follows the tokens, not max_seqlen x B
    assert pairs(4000 + 31 * 20, 32, 4100, 128) == cdiv(4620, 128) + 32
