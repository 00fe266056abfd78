"""Plain-jnp reference for HSTU attention (the contract in ``kernels/README.md``).

The jagged input is padded to a dense ``[B, N, H, D]`` layout by a gather with a validity
mask (``N = max_seqlen``), the mask and the relative bias are built densely, everything is
computed in fp32, and the result is gathered back to the jagged layout. All shapes are
static, so the function is jittable, and every step is differentiable by ``jax.grad``
(gradients reach ``q``, ``k``, ``v``, ``rab_pos`` and ``rab_time``).

Memory is ``O(B * H * N^2)``: this is a correctness oracle, not a kernel.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from ._common import sample_of

__all__ = [
    "hstu_attention_reference",
    "hstu_mask_reference",
    "time_bucket",
]


def time_bucket(dt: jax.Array, num_buckets: int) -> jax.Array:
    """``min(floor(log2(1 + dt)), num_buckets - 1)`` for int32 ``dt >= 0``, exactly.

    Uses count-leading-zeros rather than a float ``log2`` so that values near powers of
    two are bucketed exactly.
    """
    x = dt.astype(jnp.int32) + 1
    return jnp.clip(31 - lax.clz(x), 0, num_buckets - 1)


def hstu_mask_reference(
    seq_lengths: jax.Array,
    max_seqlen: int,
    num_contextual: jax.Array | None = None,
    num_candidates: jax.Array | None = None,
) -> jax.Array:
    """Dense HSTU mask ``[B, N, N]`` (bool) over local positions, ``N = max_seqlen``.

    ``mask[b, i, j] = i < n and j < n and (i == j or (j < n - K and (j <= i or i < C)))``
    with ``n = seq_lengths[b]``, ``C = num_contextual[b]`` (0 if None) and
    ``K = num_candidates[b]`` (0 if None).
    """
    n = seq_lengths.astype(jnp.int32)[:, None, None]
    b = seq_lengths.shape[0]
    zeros = jnp.zeros((b,), jnp.int32)
    c = (zeros if num_contextual is None else num_contextual.astype(jnp.int32))[:, None, None]
    kk = (zeros if num_candidates is None else num_candidates.astype(jnp.int32))[:, None, None]
    pos = jnp.arange(max_seqlen, dtype=jnp.int32)
    i = pos[None, :, None]
    j = pos[None, None, :]
    valid = (i < n) & (j < n)
    allowed = (i == j) | ((j < n - kk) & ((j <= i) | (i < c)))
    return valid & allowed


def _check(cond: bool, name: str, msg: str) -> None:
    if not cond:
        raise ValueError(f"{name}: {msg}")


def hstu_attention_reference(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    seq_offsets: jax.Array,
    *,
    max_seqlen: int,
    alpha: float,
    normalizer: float,
    num_contextual: jax.Array | None = None,
    num_candidates: jax.Array | None = None,
    timestamps: jax.Array | None = None,
    rab_pos: jax.Array | None = None,
    rab_time: jax.Array | None = None,
) -> jax.Array:
    """HSTU attention over a jagged batch, padded dense, fp32 compute.

    Args and semantics: see ``kernels/README.md``. Returns ``[T, H, Dv]`` in ``q.dtype``,
    with zero rows past ``seq_offsets[-1]``.
    """
    _check(q.ndim == 3, "q", f"expected [T, H, Dqk], got shape {q.shape}")
    t_cap, h, _ = q.shape
    _check(k.shape == q.shape, "k", f"expected shape {q.shape}, got {k.shape}")
    _check(v.ndim == 3 and v.shape[:2] == (t_cap, h), "v", f"expected [T, H, Dv], got {v.shape}")
    _check(seq_offsets.ndim == 1 and seq_offsets.shape[0] >= 1, "seq_offsets", "expected [B + 1]")
    _check(isinstance(max_seqlen, int) and max_seqlen >= 1, "max_seqlen", "expected int >= 1")
    bsz = seq_offsets.shape[0] - 1
    n_max = max_seqlen
    out_dtype = q.dtype

    offs = seq_offsets.astype(jnp.int32)
    lengths = offs[1:] - offs[:-1]
    pos = jnp.arange(n_max, dtype=jnp.int32)
    valid = pos[None, :] < lengths[:, None]  # [B, N]
    gidx = jnp.clip(offs[:-1, None] + pos[None, :], 0, max(t_cap - 1, 0))  # [B, N]

    def dense(x):
        xd = jnp.take(x, gidx, axis=0).astype(jnp.float32)  # [B, N, H, D]
        return jnp.where(valid[:, :, None, None], xd, 0.0)

    qd, kd, vd = dense(q), dense(k), dense(v)
    hi = lax.Precision.HIGHEST
    s = alpha * jnp.einsum("bihd,bjhd->bhij", qd, kd, precision=hi)

    if rab_pos is not None:
        _check(rab_pos.ndim == 2 and rab_pos.shape[0] == h, "rab_pos", "expected [H, P]")
        p_size = rab_pos.shape[1]
        rel = jnp.minimum(jnp.abs(pos[:, None] - pos[None, :]), p_size - 1)  # [N, N]
        s = s + rab_pos.astype(jnp.float32)[:, rel][None]
    if rab_time is not None:
        _check(rab_time.ndim == 2 and rab_time.shape[0] == h, "rab_time", "expected [H, Tb]")
        _check(timestamps is not None, "timestamps", "required when rab_time is given")
        ts = jnp.take(timestamps.astype(jnp.int32), gidx, axis=0)  # [B, N]
        dt = jnp.abs(ts[:, :, None] - ts[:, None, :])
        bucket = time_bucket(dt, rab_time.shape[1])  # [B, N, N]
        bias_t = rab_time.astype(jnp.float32)[:, bucket]  # [H, B, N, N]
        s = s + jnp.transpose(bias_t, (1, 0, 2, 3))

    mask = hstu_mask_reference(lengths, n_max, num_contextual, num_candidates)  # [B, N, N]
    p = jnp.where(mask[:, None], jax.nn.silu(s), 0.0) / normalizer
    od = jnp.einsum("bhij,bjhd->bihd", p, vd, precision=hi)  # [B, N, H, Dv]

    # Back to jagged: token t belongs to sample searchsorted(ends, t, 'right').
    tok = jnp.arange(t_cap, dtype=jnp.int32)
    if bsz == 0:
        return jnp.zeros((t_cap, h, v.shape[2]), out_dtype)
    sample_c = sample_of(offs[1:], t_cap)
    local = tok - offs[sample_c]
    tok_valid = (tok < offs[-1]) & (local >= 0) & (local < n_max)
    out = od[sample_c, jnp.clip(local, 0, n_max - 1)]  # [T, H, Dv]
    out = jnp.where(tok_valid[:, None, None], out, 0.0)
    return out.astype(out_dtype)
