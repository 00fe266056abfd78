"""Which (block, sample) pair each program of a jagged attention kernel works on.

A grid of ``cdiv(max_seqlen, block) * B`` programs per head is mostly empty on jagged batches
(one long sample sets ``max_seqlen``; the others end after a few blocks), and every empty
program still occupies a streaming multiprocessor while it starts and exits. The kernels
instead run one program per head and per pair that holds tokens, heaviest first:

* a sample of ``nb = cdiv(n, block)`` blocks has one pair at each level ``0 .. nb - 1``;
* the work of level ``l`` grows with ``l``: query block ``l`` (forward, dq) sees ``l + 1`` key
  blocks; key block ``nb - 1 - l`` (dk/dv, ``key_major``) is seen by ``l + 1`` query blocks;
* pairs run by level, highest first, then by sample, so the longest programs start first and
  the short ones fill in behind them.

The grid has ``pairs(T, B, max_seqlen, block)`` entries (at most ``cdiv(T, block) + B``, as a
sample's last block may be partial); entries past the batch's real pairs have nothing to do.
``schedule`` computes the map with the array module ``xp`` given (numpy here, in the tests and
for the Triton interpreter; jax.numpy for the Pallas kernels, which read it as a table); on
CUDA the Triton launches fill the same table with a small kernel (``triton/_common.py``,
``_schedule_kernel``). It builds ``[G, B]`` and ``[G, L]`` intermediates (``L`` =
``cdiv(max_seqlen, block)``): under 1 MB at bench_upstream's 32 samples, over 100 MB at thousands
of samples per batch, where a sorted search per entry would be the better formulation.

Measured effect (kernels/README.md): forward + backward 10-17 % faster in Triton and 25-42 %
in Pallas on bench_upstream batches, almost all of it in the backward.
"""


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def pairs(tokens: int, batch: int, max_seqlen: int, block: int) -> int:
    """Grid entries per head: an upper bound on the (block, sample) pairs holding tokens."""
    return min(cdiv(max_seqlen, block) * batch, cdiv(tokens, block) + batch)


def schedule(xp, seq_offsets, max_seqlen: int, num_pairs: int, block: int, key_major: bool):
    """``(blk, b, valid)``, each int32 ``[num_pairs]``: grid entry ``j``'s block and sample,
    and whether it has work (``valid == 0``: ``blk = b = 0``, nothing to do). Every sample must
    be at most ``max_seqlen`` long."""
    offs = xp.asarray(seq_offsets).astype(xp.int32)
    nblk = (offs[1:] - offs[:-1] + block - 1) // block  # [B]
    levels = xp.arange(cdiv(max_seqlen, block), dtype=xp.int32)  # [L]
    j = xp.arange(num_pairs, dtype=xp.int32)  # [G]
    # pairs above each level; the entry's level is the lowest whose higher levels hold <= j
    above = xp.maximum(nblk[None, :] - 1 - levels[:, None], 0).sum(axis=1)  # [L]
    level = (above[None, :] > j[:, None]).sum(axis=1).astype(xp.int32)
    r = j - xp.take(above, level)  # rank among the pairs of that level
    has = (nblk[None, :] > level[:, None]).astype(xp.int32)  # [G, B]
    valid = r < has.sum(axis=1)
    rank = xp.cumsum(has, axis=1)  # the r-th pair's sample is the first of rank r + 1
    b = xp.where(valid, (rank <= r[:, None]).sum(axis=1), 0)
    blk = xp.take(nblk, b) - 1 - level if key_major else level
    return (
        xp.where(valid, blk, 0).astype(xp.int32),
        b.astype(xp.int32),
        valid.astype(xp.int32),
    )
