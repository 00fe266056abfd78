"""The batches the tile sweeps time (``triton.tune``, ``pallas.tune``), in numpy only.

``bench_upstream_batch``: samples shaped like ``configs/bench_upstream.yaml`` (4 contextual
tokens, 2 tokens per event of a bounded Zipf(1.2) history of 16..2000 events, as
``hstu/data/distributions.py`` draws it, then 8..64 candidates). ``mask_pairs``: the number of
(query, key) pairs the HSTU mask lets through, for FLOP counts.
"""

import numpy as np

CONTEXTUAL = 4
MAX_SEQLEN = 4100  # 4 + 2 x 2000 + 64, rounded up


def bench_upstream_batch(rng: np.random.Generator, batch: int = 32):
    """(lengths, candidates) of ``batch`` samples, both int64 ``[batch]``."""
    support = np.arange(1, 2000 - 16 + 2, dtype=np.float64)
    cdf = np.cumsum(support**-1.2)
    hist = 16 + np.searchsorted(cdf / cdf[-1], rng.random(batch), side="right").clip(0, 1984)
    cand = rng.integers(8, 65, size=batch)
    return CONTEXTUAL + 2 * hist + cand, cand


def mask_pairs(lengths, num_contextual: int = 0, num_candidates=None) -> int:
    """Unmasked pairs over samples: mask(i, j) = i == j or (j < n - K and (j <= i or i < C))."""
    cands = np.zeros(len(lengths), np.int64) if num_candidates is None else num_candidates
    total = 0
    for n, k in zip(np.asarray(lengths).tolist(), np.asarray(cands).tolist(), strict=True):
        hist = n - k
        j = np.arange(hist)
        causal = int((n - j).sum())  # history keys j, seen by every query i >= j
        i = np.arange(min(num_contextual, hist))
        ahead = int(np.maximum(hist - 1 - i, 0).sum())  # contextual queries see later history
        total += causal + ahead + k  # candidate keys: their own diagonal only
    return total
