"""Helpers for tests and parity checks (numpy only): build global batches with chosen padding."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from hstu.batch import JaggedBatch, from_samples
from hstu.data import SampleSpec, make_sample

REPO_ROOT = Path(__file__).resolve().parents[1]
DEMO_CONFIG = REPO_ROOT / "configs" / "demo.yaml"

# Global batches every exchange test covers: (task, real samples per rank) at 6 per rank: full,
# incomplete, a rank with none, all padding, a single sample, uneven.
EXCHANGE_CASES = (
    ("ranking", (6, 6, 6, 6)),
    ("ranking", (6, 6, 6, 3)),
    ("retrieval", (6, 4, 0, 2)),
    ("ranking", (0, 0, 0, 0)),
    ("retrieval", (1, 0, 0, 0)),
    ("retrieval", (5, 6, 2, 6)),
)


def make_global_batch(
    cfg, batch_size: int, real_per_rank: Sequence[int], first_id: int = 0
) -> list[JaggedBatch]:
    """One batch per rank; rank r holds `real_per_rank[r]` real samples, the rest padding.

    `real_per_rank` of zeros gives an all-padding global batch; a single zero entry gives a rank
    with no real sample (what an incomplete last batch produces).
    """
    spec = SampleSpec.from_config(cfg)
    out, sid = [], first_id
    for n in real_per_rank:
        samples = [make_sample(spec, sid + i) for i in range(n)]
        sid += n
        out.append(from_samples(samples, batch_size, spec.jagged_keys))
    return out
