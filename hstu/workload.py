"""Per-sample cost model: exact matmul FLOPs of the configured HSTU stack.

A sample of `n` tokens (C contextual, 2 L interleaved item/action, K candidates) costs, per
layer and forward:

* input projection  D -> H (2 Dv + 2 Dqk):   2 n D H (2 Dv + 2 Dqk)
* attention over the `p` unmasked pairs:     2 p H Dqk (q k^T)  +  2 p H Dv (attn v)
* output projection H Dv -> D:               2 n H Dv D

and backward costs twice the forward for every one of these matmuls (one product for the
input gradient, one for the weight/other-operand gradient), so forward + backward = 3x.
The unmasked pair count follows the mask of `kernels/README.md`:

    mask(i, j) = (i == j) or (j < n - K and (j <= i or i < C))

Unlike the upstream estimate, heads are counted once, masks/context/candidates are exact and
every layer is included. Elementwise work (SiLU, LayerNorm) is ignored: it is memory-bound and
linear in n, so it moves no partition decision the linear term does not already move.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from hstu.errors import HSTUError


def attention_pairs(n, num_contextual=0, num_candidates=0) -> np.ndarray:
    """Number of (query, key) pairs the HSTU mask lets through, vectorised over samples."""
    n = np.asarray(n, dtype=np.int64)
    c = np.broadcast_to(np.asarray(num_contextual, dtype=np.int64), n.shape)
    k = np.broadcast_to(np.asarray(num_candidates, dtype=np.int64), n.shape)
    if np.any(c + k > n):
        bad = np.flatnonzero(np.atleast_1d(c + k > n))[:5]
        raise HSTUError(f"attention_pairs: num_contextual + num_candidates > n at samples {bad}")
    h = n - k  # contextual + history tokens
    # contextual queries see all h non-candidate keys; history query i sees i + 1 keys;
    # each candidate sees the h non-candidate keys and itself.
    history = (h * (h + 1) - c * (c + 1)) // 2
    return c * h + history + k * (h + 1)


@dataclass(frozen=True)
class HSTUCost:
    embedding_dim: int
    num_layers: int
    num_heads: int
    attention_dim: int  # Dqk per head
    linear_dim: int  # Dv per head
    backward: bool = True  # count forward + backward (training) or forward only

    def __post_init__(self):
        for name in ("embedding_dim", "num_layers", "num_heads", "attention_dim", "linear_dim"):
            if getattr(self, name) <= 0:
                raise HSTUError(f"HSTUCost.{name} must be positive, got {getattr(self, name)}")

    @classmethod
    def from_model_config(cls, model, backward: bool = True) -> HSTUCost:
        return cls(
            model.embedding_dim,
            model.num_layers,
            model.num_heads,
            model.attention_dim,
            model.linear_dim,
            backward,
        )

    def linear_flops_per_token(self) -> int:
        d, h, dqk, dv = self.embedding_dim, self.num_heads, self.attention_dim, self.linear_dim
        return 2 * d * h * (2 * dv + 2 * dqk) + 2 * h * dv * d

    def attention_flops_per_pair(self) -> int:
        return 2 * self.num_heads * (self.attention_dim + self.linear_dim)

    def flops(self, n, num_contextual=0, num_candidates=0) -> np.ndarray:
        """Exact FLOPs per sample (int64), vectorised; zero for empty (padding) samples."""
        n = np.asarray(n, dtype=np.int64)
        pairs = attention_pairs(n, num_contextual, num_candidates)
        per_layer = n * self.linear_flops_per_token() + pairs * self.attention_flops_per_pair()
        return per_layer * self.num_layers * (3 if self.backward else 1)

    def batch_flops(self, batch) -> np.ndarray:
        """FLOPs of every sample of a JaggedBatch (padding samples cost 0)."""
        zeros = np.zeros(batch.batch_size, dtype=np.int64)
        c = batch.lengths.get("contextual", zeros)
        k = batch.lengths.get("candidate", zeros)
        return self.flops(batch.seq_lengths(), c, k)


def upstream_workloads(seqlens, num_heads: int, head_dim: int) -> np.ndarray:
    """The upstream estimate, for comparison only: heads counted twice, no masks/layers."""
    s = np.asarray(seqlens, dtype=np.int64)
    return 4 * s * s * num_heads * head_dim * num_heads  # (sic) heads enter twice


@dataclass(frozen=True)
class Calibration:
    """Optional map FLOPs -> seconds, fitted from measured per-sample step times.

    time = a * flops + b * n + c: short sequences run at lower MFU (fixed per-token costs),
    which pure FLOPs misses. Fit with `fit_calibration`; use `predict` as the workload.
    """

    a: float
    b: float
    c: float

    def predict(self, flops, n) -> np.ndarray:
        n = np.asarray(n, dtype=np.float64)
        t = self.a * np.asarray(flops, dtype=np.float64) + self.b * n + self.c
        return np.where(n > 0, t, 0.0)


def fit_calibration(flops, n, seconds) -> Calibration:
    """Least-squares fit of measured seconds on [flops, n, 1]."""
    x = np.stack([np.asarray(flops, float), np.asarray(n, float), np.ones(len(n))], axis=1)
    coef, *_ = np.linalg.lstsq(x, np.asarray(seconds, float), rcond=None)
    return Calibration(*map(float, coef))
