"""Plain-torch reference for HSTU attention (padded dense, fp32 math).

Follows ``kernels/README.md`` literally; it is meant to be read, not to be fast.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = ["hstu_attention_reference", "hstu_mask_reference", "time_bucket_reference"]


def hstu_mask_reference(
    n: int, num_contextual: int = 0, num_candidates: int = 0, *, device=None
) -> torch.Tensor:
    """Bool ``[n, n]``: ``mask(i, j) = (i == j) or (j < n - K and (j <= i or i < C))``."""
    i = torch.arange(n, device=device)[:, None]
    j = torch.arange(n, device=device)[None, :]
    return (i == j) | ((j < n - num_candidates) & ((j <= i) | (i < num_contextual)))


def time_bucket_reference(dt: torch.Tensor, num_buckets: int) -> torch.Tensor:
    """``min(floor(log2(1 + dt)), num_buckets - 1)`` for integer ``dt >= 0``, exactly."""
    x = dt.to(torch.int64) + 1
    # the count of powers 2^1 .. 2^(num_buckets - 1) that x reaches, in one pass (a loop of
    # comparisons over [B, N, N] cost seconds a layer on a CPU); floor(log2(x)) <= 62 in int64
    bounds = 2 ** torch.arange(1, min(num_buckets, 63), dtype=torch.int64, device=x.device)
    return torch.bucketize(x, bounds, right=True)


def hstu_attention_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    seq_offsets: torch.Tensor,
    *,
    max_seqlen: int,
    alpha: float,
    normalizer: float,
    num_contextual: torch.Tensor | None = None,
    num_candidates: torch.Tensor | None = None,
    timestamps: torch.Tensor | None = None,
    rab_pos: torch.Tensor | None = None,
    rab_time: torch.Tensor | None = None,
) -> torch.Tensor:
    """Jagged ``[T, H, Dv]`` HSTU attention computed densely in fp32 (autograd-friendly)."""
    T, H, _ = q.shape
    device = q.device
    offsets = seq_offsets.to(device=device, dtype=torch.int64)
    lengths = offsets[1:] - offsets[:-1]  # [B]
    B = lengths.numel()
    N = int(lengths.max()) if B > 0 else 0
    if max_seqlen < N:
        raise ValueError(f"max_seqlen={max_seqlen} is smaller than a sample's length {N}")

    pos = torch.arange(N, device=device)
    valid = pos[None, :] < lengths[:, None]  # [B, N]
    rows = (offsets[:-1, None] + pos[None, :]).clamp(max=max(T - 1, 0))  # [B, N]

    def dense(x: torch.Tensor) -> torch.Tensor:  # [T, H, D] -> [B, N, H, D], zero padded
        return x.float()[rows] * valid[:, :, None, None]

    qd, kd, vd = dense(q), dense(k), dense(v)
    s = torch.einsum("bihd,bjhd->bhij", qd, kd)  # [B, H, N, N]

    # mask(i, j) with per-sample n, C, K
    i, j = pos[None, :, None], pos[None, None, :]
    n = lengths[:, None, None]
    zeros = torch.zeros_like(lengths)
    c = (num_contextual.to(device).long() if num_contextual is not None else zeros)[:, None, None]
    kk = (num_candidates.to(device).long() if num_candidates is not None else zeros)[:, None, None]
    mask = (i == j) | ((j < n - kk) & ((j <= i) | (i < c)))
    mask = mask & valid[:, :, None] & valid[:, None, :]  # [B, N, N]

    z = alpha * s
    if rab_pos is not None:
        P = rab_pos.shape[1]
        dist = (pos[:, None] - pos[None, :]).abs().clamp(max=P - 1)  # [N, N]
        z = z + rab_pos.float()[:, dist][None]  # [1, H, N, N]
    if rab_time is not None:
        if timestamps is None:
            raise ValueError("timestamps is required when rab_time is given")
        ts = timestamps.to(device).long()[rows]  # [B, N]
        bucket = time_bucket_reference((ts[:, :, None] - ts[:, None, :]).abs(), rab_time.shape[1])
        z = z + rab_time.float()[:, bucket].permute(1, 0, 2, 3)  # [B, H, N, N]

    p = F.silu(z) * mask[:, None] / normalizer
    out_dense = torch.einsum("bhij,bjhd->bihd", p, vd)  # [B, N, H, Dv]

    out = torch.zeros(T, H, v.shape[2], device=device, dtype=torch.float32)
    out = out.index_put((rows[valid],), out_dense[valid])
    return out.to(q.dtype)
