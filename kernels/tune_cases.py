"""The batches the tile sweeps time (``triton.tune``, ``pallas.tune``), in numpy only.

``bench_upstream_batch``: samples shaped like ``configs/bench_upstream.yaml`` (4 contextual
tokens, 2 tokens per event of a bounded Zipf(1.2) history of 16..2000 events, as
``hstu/data/distributions.py`` draws it, then 8..64 candidates). ``mask_pairs``: the number of
(query, key) pairs the HSTU mask lets through, for FLOP counts.
"""

import dataclasses

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


def sweep_table(results: dict, passes, tag_header: str) -> str:
    """The sweep's table and each kernel's best tile. ``results``: case name -> rows
    (kernel, tiles: a BlockSizes dataclass, ms or nan, note), the same candidates in the same
    order in every case;
    best: the lowest sum over cases of time / that case's fastest time, among the tiles timed
    in every case."""
    names = list(results)
    lines = [f"{'kernel':>6} {tag_header:>17} " + " ".join(f"{n:>26}" for n in names)]
    for i, (kern, tiles, _, _) in enumerate(results[names[0]]):
        cells = []
        for n in names:
            _, _, ms, note = results[n][i]
            cells.append(f"{ms:8.3f} ms {note:>14}" if ms == ms else f"{note[:26]:>26}")
        tag = ",".join(str(x) for x in dataclasses.astuple(tiles) if x is not None)
        lines.append(f"{kern:>6} {tag:>17} " + " ".join(cells))
    for kern in passes:
        timed = {n: {t: ms for k, t, ms, _ in rows if k == kern and ms == ms}
                 for n, rows in results.items()}  # fmt: skip
        score: dict = {}
        for times in timed.values():
            for tiles, ms in times.items():
                score[tiles] = score.get(tiles, 0.0) + ms / min(times.values())
        full = [t for t in score if all(t in timed[n] for n in names)]
        lines.append(f"best {kern}: {min(full, key=score.get, default=None)}")
    return "\n".join(lines)
