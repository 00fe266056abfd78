"""HSTU attention switch for the Flax model: `reference` (plain jnp) or `kernel` (Pallas).

Both come from `hstu_kernels.pallas` (contract in kernels/README.md), imported on first use so
that importing the model never pulls in the kernel module. The kernel runs in Pallas interpret
mode on CPU meshes (CI), compiled on GPU.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass

import jax

IMPLEMENTATIONS = ("reference", "kernel")


def _pallas():
    return importlib.import_module("hstu_kernels.pallas")


@dataclass(frozen=True)
class AttentionConfig:
    impl: str = "reference"
    max_seqlen: int = 1  # static bound on a sample's length (tiling only)
    alpha: float = 1.0
    normalizer: float = 128.0
    interpret: bool | None = None  # kernel only; None: interpret when running on CPU
    lowering: str = "triton"  # kernel only: forward / dq Pallas lowering (triton | mosaic | auto)

    def __post_init__(self):
        if self.impl not in IMPLEMENTATIONS:
            raise ValueError(f"attention impl must be one of {IMPLEMENTATIONS}, got {self.impl!r}")
        if self.max_seqlen < 1:
            raise ValueError(f"attention max_seqlen must be >= 1, got {self.max_seqlen}")


def hstu_attention(
    cfg: AttentionConfig,
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    seq_offsets: jax.Array,
    num_contextual: jax.Array | None,
    num_candidates: jax.Array | None,
    timestamps: jax.Array | None = None,
    rab_pos: jax.Array | None = None,
    rab_time: jax.Array | None = None,
) -> jax.Array:
    """`[T, H, Dv]` attention of the jagged `[T, H, D]` q/k/v (rows past the last offset: 0)."""
    mod = _pallas()
    kwargs = dict(
        max_seqlen=cfg.max_seqlen,
        alpha=cfg.alpha,
        normalizer=cfg.normalizer,
        num_contextual=num_contextual,
        num_candidates=num_candidates,
        timestamps=timestamps if rab_time is not None else None,
        rab_pos=rab_pos,
        rab_time=rab_time,
    )
    if cfg.impl == "reference":
        return mod.hstu_attention_reference(q, k, v, seq_offsets, **kwargs)
    return mod.hstu_attention(
        q, k, v, seq_offsets, interpret=cfg.interpret, lowering=cfg.lowering, **kwargs
    )
