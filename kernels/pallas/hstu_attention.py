"""HSTU attention as Pallas kernels (Triton lowering on GPU, interpret mode on CPU).

Contract: ``kernels/README.md`` (jagged ``[T, H, D]`` layout, causal + contextual +
candidate mask, optional relative position / time bias, SiLU attention divided by a fixed
normalizer). Forward and backward are Pallas kernels tied together by ``jax.custom_vjp``:

* forward, grid ``(query block, sample, head)``: one program owns ``block_q`` query rows
  of one sample and head, loops over the key blocks the mask allows and accumulates
  ``silu(alpha * q k^T + bias) / N @ v`` in fp32;
* ``dq`` kernel, same grid and loop as the forward;
* ``dk``/``dv`` kernel, grid ``(key block, sample, head)``: loops over the query blocks
  that can see the key block; it also reduces ``dS`` (the gradient of the pre-SiLU score,
  which is the bias gradient) into per-program partial outputs for ``rab_time`` (bucket
  sums) and per-tile diagonal sums for ``rab_pos``; both are summed in jnp in a fixed
  order (no atomics, deterministic).

The jagged layout is handled by passing ``seq_offsets`` (and the per-sample contextual /
candidate counts) as input refs: every program reads its sample's start and length, and
all loads / stores of token rows are masked to the sample, so blocks never spill into a
neighbour. Tiles are in sample-local coordinates, so the key blocks a query block needs
follow from ``(n, C, K)`` alone and fully masked blocks are skipped; blocks known to be
fully unmasked skip the mask arithmetic.

Numerics: matmuls accumulate in fp32 (fp32 operands at full precision, not TF32); compiled
bf16/fp16 calls evaluate the sigmoid with ``tanh.approx`` (error far below 16-bit rounding).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl

try:  # the Triton-specific Pallas API (load/store with masks, compiler params)
    from jax.experimental.pallas import triton as _plgpu
except ImportError:  # pragma: no cover - very old / stripped jax builds
    _plgpu = None

__all__ = ["BlockSizes", "hstu_attention"]

# --------------------------------------------------------------------------------------
# Version compatibility shim (jax 0.10.x and 0.11.x).
#
# * The Triton compiler params are ``plgpu.CompilerParams`` in jax >= 0.6 (both 0.10.2 and
#   0.11.2); older releases called them ``plgpu.TritonCompilerParams``.
# * Since jax 0.11, ``pallas_call`` on GPU picks its lowering from the *type* of
#   ``compiler_params``, so we always pass the Triton params explicitly.
# * Masked ``load`` / ``store`` live in ``plgpu`` (``pl.load``/``pl.store`` were removed
#   from the top-level namespace); fall back to the top level for older releases.
# --------------------------------------------------------------------------------------


def _resolve(*candidates):
    for mod, name in candidates:
        if mod is not None and hasattr(mod, name):
            return getattr(mod, name)
    return None


_CompilerParams = _resolve((_plgpu, "CompilerParams"), (_plgpu, "TritonCompilerParams"))
_load = _resolve((_plgpu, "load"), (pl, "load"))
_store = _resolve((_plgpu, "store"), (pl, "store"))
_debug_barrier = _resolve((_plgpu, "debug_barrier"))
_approx_tanh = _resolve((_plgpu, "approx_tanh"))


def _compiler_params(num_warps: int, num_stages: int):
    if _CompilerParams is None:  # pragma: no cover
        raise RuntimeError("this jax has no Pallas Triton compiler params")
    return _CompilerParams(num_warps=num_warps, num_stages=num_stages)


def _is_pow2(x: int) -> bool:
    return x >= 1 and (x & (x - 1)) == 0


def _next_pow2(x: int) -> int:
    return 1 << max(0, int(x) - 1).bit_length()


@dataclasses.dataclass(frozen=True)
class BlockSizes:
    """Tiling of the kernels (the same tiles serve forward and backward).

    ``block_q`` / ``block_k``: query / key rows per tile, powers of two >= 16 (Triton
    ``dot`` needs every dimension >= 16). Both are capped at ``next_pow2(max_seqlen)``.
    ``num_warps`` / ``num_stages``: Triton launch parameters (ignored in interpret mode).
    """

    block_q: int = 64
    block_k: int = 32
    num_warps: int = 4
    num_stages: int = 3

    def __post_init__(self):
        for name in ("block_q", "block_k"):
            val = getattr(self, name)
            if not isinstance(val, int) or not _is_pow2(val) or val < 16:
                raise ValueError(f"BlockSizes.{name}: expected a power of two >= 16, got {val!r}")
        if not isinstance(self.num_warps, int) or not _is_pow2(self.num_warps):
            raise ValueError(
                f"BlockSizes.num_warps: expected a power of two, got {self.num_warps!r}"
            )
        if not isinstance(self.num_stages, int) or self.num_stages < 1:
            raise ValueError(
                f"BlockSizes.num_stages: expected an int >= 1, got {self.num_stages!r}"
            )


@dataclasses.dataclass(frozen=True)
class _Cfg:
    """Static configuration of one call (hashable: it is a custom_vjp nondiff arg)."""

    max_seqlen: int
    alpha: float
    normalizer: float
    bq: int
    bk: int
    num_warps: int
    num_stages: int
    interpret: bool
    has_ctx: bool
    has_cand: bool
    pos_size: int  # P, 0 when rab_pos is None
    time_size: int  # Tb, 0 when rab_time is None
    fast_math: bool  # sigmoid via tanh.approx (compiled 16-bit inputs only)

    @property
    def nqb(self) -> int:
        return -(-self.max_seqlen // self.bq)

    @property
    def nkb(self) -> int:
        return -(-self.max_seqlen // self.bk)

    @property
    def time_pad(self) -> int:
        return max(16, _next_pow2(self.time_size))

    @property
    def upad(self) -> int:  # diagonals of a [bq, bk] tile, padded to a power of two
        return _next_pow2(self.bq + self.bk - 1)


# --------------------------------------------------------------------------------------
# In-kernel helpers.
# --------------------------------------------------------------------------------------


class _Refs:
    """Named view over the flat ref list of a pallas_call (optional refs may be None)."""

    def __init__(self, refs, cfg: _Cfg, names_in, names_out):
        refs = list(refs)
        self.off = refs.pop(0)
        self.ctx = refs.pop(0) if cfg.has_ctx else None
        self.cand = refs.pop(0) if cfg.has_cand else None
        self.ts = refs.pop(0) if cfg.time_size else None
        self.rab_pos = refs.pop(0) if cfg.pos_size else None
        self.rab_time = refs.pop(0) if cfg.time_size else None
        self.dtime = self.dpos = self.scratch = None
        for name in names_in:
            setattr(self, name, refs.pop(0))
        for name in names_out:
            if name is not None:
                setattr(self, name, refs.pop(0))
        assert not refs, refs


def _cdiv(x, d: int):
    """Ceil division of a non-negative traced int32 scalar by a static int."""
    return lax.div(x + (d - 1), jnp.int32(d))


def _sample_meta(r: _Refs, b, cfg: _Cfg):
    """(start, n, C, end-of-history) of sample b, all int32 scalars."""
    start = r.off[b]
    n = r.off[b + 1] - start
    c = r.ctx[b] if cfg.has_ctx else jnp.int32(0)
    hist = jnp.clip(n - r.cand[b], 0, n) if cfg.has_cand else n
    return start, n, c, hist


def _key_ranges(qs, n, c, hist, cfg: _Cfg):
    """Key-block ranges [0, n_int) (unmasked), [n_int, hi1) and [lo2, hi2) (masked).

    Together they are the key blocks needed by query rows [qs, qs + bq).

    History keys (j < hist) are needed up to the block's last row, or all of them when the
    block holds a contextual query (qs < C); otherwise only the diagonal is needed.
    """
    active = qs < n
    qe = jnp.minimum(qs + cfg.bq, n)
    a_end = jnp.where(qs < c, hist, jnp.minimum(hist, qe))
    a_end = jnp.where(active, jnp.maximum(a_end, 0), 0)
    hi1 = _cdiv(a_end, cfg.bk)
    lo2 = jnp.maximum(hi1, lax.div(qs, jnp.int32(cfg.bk)))
    hi2 = jnp.where(active, _cdiv(jnp.maximum(qe, 0), cfg.bk), lo2)
    hi2 = jnp.maximum(hi2, lo2)
    # Key blocks [0, n_int) lie entirely before the first query row and inside the
    # history: every pair there is unmasked (query rows past n only meet zero rows).
    n_int = jnp.minimum(lax.div(qs, jnp.int32(cfg.bk)), lax.div(hist, jnp.int32(cfg.bk)))
    n_int = jnp.clip(n_int, 0, hi1)
    return n_int, hi1, lo2, hi2


def _query_ranges(ks, n, c, hist, cfg: _Cfg):
    """Query-block ranges that can see keys [ks, ks + bk): [0, end_a) and [lo_b, q_int)
    (masked), [q_int, hi_b) (unmasked).

    A block holding history keys is seen by every contextual query (i < C) and, causally,
    by every query i >= ks; a block of candidate keys only by its diagonal.
    """
    active = ks < n
    has_hist = ks < hist
    ke = jnp.minimum(ks + cfg.bk, n)
    end_a = jnp.where(active & has_hist, _cdiv(jnp.clip(c, 0, n), cfg.bq), 0)
    lo_b = jnp.maximum(end_a, lax.div(ks, jnp.int32(cfg.bq)))
    hi_b = jnp.where(has_hist, _cdiv(n, cfg.bq), _cdiv(jnp.maximum(ke, 0), cfg.bq))
    hi_b = jnp.where(active, hi_b, lo_b)
    hi_b = jnp.maximum(hi_b, lo_b)
    # Query blocks from q_int on start after the key block's last key, which is history:
    # unmasked (rows past n are zero-loaded and contribute nothing).
    full_hist = ks + cfg.bk <= hist
    q_int = jnp.where(full_hist, jnp.clip(_cdiv(ks + cfg.bk, cfg.bq), lo_b, hi_b), hi_b)
    return end_a, lo_b, q_int, hi_b


def _load_rows(ref, row0, size, h, ok):
    """Masked load of ``size`` token rows of head ``h`` ([size, D]); masked rows are 0."""
    return _load(ref.at[pl.ds(row0, size), h, :], mask=ok[:, None], other=0)


def _load_ts(ref, row0, size, ok):
    return _load(ref.at[pl.ds(row0, size)], mask=ok, other=0)


def _dot(a, b, contract_a: int, contract_b: int):
    """fp32-accumulating 2-D matmul; fp32 operands use full precision (not TF32)."""
    prec = lax.Precision.HIGHEST if a.dtype == jnp.float32 else None
    return lax.dot_general(
        a,
        b,
        (((contract_a,), (contract_b,)), ((), ())),
        precision=prec,
        preferred_element_type=jnp.float32,
    )


def _scores(cfg: _Cfg, r: _Refs, h, q, k, i_pos, j_pos, tq, tk, n, c, hist, masked: bool):
    """Pre-SiLU scores s = alpha q k^T + bias (fp32), the mask (None when the tile is
    known to be fully unmasked), and the time buckets."""
    s = _dot(q, k, 1, 1)
    s = s * jnp.float32(cfg.alpha)
    ii = i_pos[:, None]
    jj = j_pos[None, :]
    if cfg.pos_size:
        rel = jnp.minimum(jnp.abs(ii - jj), cfg.pos_size - 1)
        s = s + r.rab_pos[h, rel].astype(jnp.float32)
    tb = None
    if cfg.time_size:
        dt = jnp.abs(tq[:, None] - tk[None, :])
        tb = jnp.clip(31 - lax.clz(dt + 1), 0, cfg.time_size - 1)
        s = s + r.rab_time[h, tb].astype(jnp.float32)
    if not masked:
        return s, None, tb
    seen = jj <= ii
    if cfg.has_ctx:
        seen = seen | (ii < c)
    mask = (ii == jj) | ((jj < hist) & seen)
    mask = mask & (ii < n) & (jj < n)
    return s, mask, tb


def _silu_and_grad(s, cfg: _Cfg):
    """silu(s) and silu'(s). The fast path uses one MUFU tanh instead of exp + divide:
    sigmoid(s) = (1 + tanh(s / 2)) / 2 (relative error ~1e-3, below bf16/fp16 rounding).
    """
    sig = 0.5 * _approx_tanh(0.5 * s) + 0.5 if cfg.fast_math else jax.nn.sigmoid(s)
    return s * sig, sig * (1.0 + s * (1.0 - sig))


def _apply_mask(mask, x):
    return x if mask is None else jnp.where(mask, x, 0.0)


def _fwd_kernel(*refs, cfg: _Cfg):
    r = _Refs(refs, cfg, ("q", "k", "v"), ("o",))
    bq, bk = cfg.bq, cfg.bk
    qb = cfg.nqb - 1 - pl.program_id(0)  # heavy (late) query blocks first
    b = pl.program_id(1)
    h = pl.program_id(2)
    start, n, c, hist = _sample_meta(r, b, cfg)
    qs = qb * bq
    i_pos = qs + jnp.arange(bq, dtype=jnp.int32)
    q_ok = i_pos < n
    q = _load_rows(r.q, start + qs, bq, h, q_ok)
    tq = _load_ts(r.ts, start + qs, bq, q_ok) if cfg.time_size else None
    inv_n = jnp.float32(1.0 / cfg.normalizer)

    def make_body(masked: bool):
        def body(kb, acc):
            ks = kb * bk
            j_pos = ks + jnp.arange(bk, dtype=jnp.int32)
            k_ok = j_pos < n
            k = _load_rows(r.k, start + ks, bk, h, k_ok)
            v = _load_rows(r.v, start + ks, bk, h, k_ok)
            tk = _load_ts(r.ts, start + ks, bk, k_ok) if cfg.time_size else None
            s, mask, _ = _scores(cfg, r, h, q, k, i_pos, j_pos, tq, tk, n, c, hist, masked)
            silu, _ = _silu_and_grad(s, cfg)
            p = _apply_mask(mask, silu * inv_n)
            return acc + _dot(p.astype(v.dtype), v, 1, 0)

        return body

    n_int, hi1, lo2, hi2 = _key_ranges(qs, n, c, hist, cfg)
    acc = jnp.zeros((bq, r.v.shape[-1]), jnp.float32)
    acc = lax.fori_loop(0, n_int, make_body(False), acc)
    acc = lax.fori_loop(n_int, hi1, make_body(True), acc)
    acc = lax.fori_loop(lo2, hi2, make_body(True), acc)
    _store(r.o.at[pl.ds(start + qs, bq), h, :], acc.astype(r.o.dtype), mask=q_ok[:, None])


def _dq_kernel(*refs, cfg: _Cfg):
    r = _Refs(refs, cfg, ("q", "k", "v", "do"), ("dq",))
    bq, bk = cfg.bq, cfg.bk
    qb = cfg.nqb - 1 - pl.program_id(0)
    b = pl.program_id(1)
    h = pl.program_id(2)
    start, n, c, hist = _sample_meta(r, b, cfg)
    qs = qb * bq
    i_pos = qs + jnp.arange(bq, dtype=jnp.int32)
    q_ok = i_pos < n
    q = _load_rows(r.q, start + qs, bq, h, q_ok)
    do = _load_rows(r.do, start + qs, bq, h, q_ok)
    tq = _load_ts(r.ts, start + qs, bq, q_ok) if cfg.time_size else None
    inv_n = jnp.float32(1.0 / cfg.normalizer)

    def make_body(masked: bool):
        def body(kb, dq):
            ks = kb * bk
            j_pos = ks + jnp.arange(bk, dtype=jnp.int32)
            k_ok = j_pos < n
            k = _load_rows(r.k, start + ks, bk, h, k_ok)
            v = _load_rows(r.v, start + ks, bk, h, k_ok)
            tk = _load_ts(r.ts, start + ks, bk, k_ok) if cfg.time_size else None
            s, mask, _ = _scores(cfg, r, h, q, k, i_pos, j_pos, tq, tk, n, c, hist, masked)
            _, dsilu = _silu_and_grad(s, cfg)
            dp = _dot(do, v, 1, 1)
            ds = _apply_mask(mask, dp * dsilu * inv_n)
            return dq + _dot(ds.astype(k.dtype), k, 1, 0)

        return body

    n_int, hi1, lo2, hi2 = _key_ranges(qs, n, c, hist, cfg)
    dq = jnp.zeros((bq, r.q.shape[-1]), jnp.float32)
    dq = lax.fori_loop(0, n_int, make_body(False), dq)
    dq = lax.fori_loop(n_int, hi1, make_body(True), dq)
    dq = lax.fori_loop(lo2, hi2, make_body(True), dq)
    dq = dq * jnp.float32(cfg.alpha)
    _store(r.dq.at[pl.ds(start + qs, bq), h, :], dq.astype(r.dq.dtype), mask=q_ok[:, None])


def _dkdv_kernel(*refs, cfg: _Cfg):
    names_out = (
        "dk",
        "dv",
        "dtime" if cfg.time_size else None,
        "dpos" if cfg.pos_size else None,
        "scratch" if cfg.pos_size else None,
    )
    r = _Refs(refs, cfg, ("q", "k", "v", "do"), names_out)
    bq, bk = cfg.bq, cfg.bk
    kb = pl.program_id(0)  # early key blocks are seen by the most queries: launch first
    b = pl.program_id(1)
    h = pl.program_id(2)
    start, n, c, hist = _sample_meta(r, b, cfg)
    ks = kb * bk
    j_pos = ks + jnp.arange(bk, dtype=jnp.int32)
    k_ok = j_pos < n
    k = _load_rows(r.k, start + ks, bk, h, k_ok)
    v = _load_rows(r.v, start + ks, bk, h, k_ok)
    tk = _load_ts(r.ts, start + ks, bk, k_ok) if cfg.time_size else None
    inv_n = jnp.float32(1.0 / cfg.normalizer)
    t_iota = jnp.arange(cfg.time_pad, dtype=jnp.int32)
    if cfg.pos_size:
        prog = (b * r.q.shape[1] + h) * cfg.nkb + kb
        # Skewed view of a [bq, bk] tile: y[a, u] = tile[a, a - u + bk - 1], so that
        # sum_a y[a, u] is the tile's diagonal u (local i - j = u - (bk - 1)).
        a_idx = jnp.broadcast_to(jnp.arange(bq, dtype=jnp.int32)[:, None], (bq, cfg.upad))
        c_idx = a_idx - jnp.arange(cfg.upad, dtype=jnp.int32)[None, :] + (bk - 1)
        skew_ok = (c_idx >= 0) & (c_idx < bk)
        c_idx = jnp.clip(c_idx, 0, bk - 1)

    def body(qb, carry, masked: bool):
        dk, dv, dtime = carry
        qs = qb * bq
        i_pos = qs + jnp.arange(bq, dtype=jnp.int32)
        q_ok = i_pos < n
        q = _load_rows(r.q, start + qs, bq, h, q_ok)
        do = _load_rows(r.do, start + qs, bq, h, q_ok)
        tq = _load_ts(r.ts, start + qs, bq, q_ok) if cfg.time_size else None
        s, mask, tb = _scores(cfg, r, h, q, k, i_pos, j_pos, tq, tk, n, c, hist, masked)
        silu, dsilu = _silu_and_grad(s, cfg)
        p = _apply_mask(mask, silu * inv_n)
        dv = dv + _dot(p.astype(do.dtype), do, 0, 0)
        dp = _dot(do, v, 1, 1)
        ds = _apply_mask(mask, dp * dsilu * inv_n)
        dk = dk + _dot(ds.astype(q.dtype), q, 0, 0)
        if cfg.time_size:
            # Bucket sums of dS over the buckets present in this tile (deterministic).
            t_lo = jnp.min(tb if mask is None else jnp.where(mask, tb, cfg.time_pad))
            t_hi = jnp.max(tb if mask is None else jnp.where(mask, tb, -1))

            def bucket_body(t, acc):
                st = jnp.sum(jnp.where(tb == t, ds, 0.0))
                return acc + jnp.where(t_iota == t, st, 0.0)

            dtime = lax.fori_loop(t_lo, t_hi + 1, bucket_body, dtime)
        if cfg.pos_size:
            # Diagonal sums of dS via a program-private scratch tile read back skewed.
            _store(r.scratch.at[prog, :, :], ds)
            if not cfg.interpret:
                _debug_barrier()
            y = _load(
                r.scratch.at[prog, a_idx, c_idx],
                mask=skew_ok,
                other=0.0,
                volatile=not cfg.interpret,
            )
            if not cfg.interpret:
                _debug_barrier()
            _store(r.dpos.at[b, h, kb, qb, :], jnp.sum(y, axis=0))
        return dk, dv, dtime

    end_a, lo_b, q_int, hi_b = _query_ranges(ks, n, c, hist, cfg)
    carry = (
        jnp.zeros((bk, r.q.shape[-1]), jnp.float32),
        jnp.zeros((bk, r.v.shape[-1]), jnp.float32),
        jnp.zeros((cfg.time_pad,), jnp.float32),
    )
    masked_body = functools.partial(body, masked=True)
    carry = lax.fori_loop(0, end_a, masked_body, carry)
    carry = lax.fori_loop(lo_b, q_int, masked_body, carry)
    carry = lax.fori_loop(q_int, hi_b, functools.partial(body, masked=False), carry)
    dk, dv, dtime = carry
    dk = dk * jnp.float32(cfg.alpha)
    _store(r.dk.at[pl.ds(start + ks, bk), h, :], dk.astype(r.dk.dtype), mask=k_ok[:, None])
    _store(r.dv.at[pl.ds(start + ks, bk), h, :], dv.astype(r.dv.dtype), mask=k_ok[:, None])
    if cfg.time_size:
        _store(r.dtime.at[b, h, kb, :], dtime)
    if cfg.pos_size:
        # Tiles this program skipped get zero diagonal sums.
        zeros = jnp.zeros((cfg.upad,), jnp.float32)

        def zero_body(qb, carry):
            _store(r.dpos.at[b, h, kb, qb, :], zeros)
            return carry

        lax.fori_loop(end_a, lo_b, zero_body, 0)
        lax.fori_loop(hi_b, jnp.int32(cfg.nqb), zero_body, 0)


# --------------------------------------------------------------------------------------
# pallas_call wrappers.
# --------------------------------------------------------------------------------------


def _aux_inputs(cfg: _Cfg, offs, ctx, cand, ts, rab_pos, rab_time):
    aux = [offs]
    if cfg.has_ctx:
        aux.append(ctx)
    if cfg.has_cand:
        aux.append(cand)
    if cfg.time_size:
        aux.append(ts)
    if cfg.pos_size:
        aux.append(rab_pos)
    if cfg.time_size:
        aux.append(rab_time)
    return aux


def _call(kernel, cfg: _Cfg, grid, out_shape, args, name):
    kwargs = {}
    if not cfg.interpret:
        kwargs["compiler_params"] = _compiler_params(cfg.num_warps, cfg.num_stages)
    return pl.pallas_call(
        functools.partial(kernel, cfg=cfg),
        out_shape=out_shape,
        grid=grid,
        interpret=cfg.interpret,
        name=name,
        **kwargs,
    )(*args)


def _token_mask(offs, t_cap):
    return (jnp.arange(t_cap, dtype=jnp.int32) < offs[-1])[:, None, None]


def _forward(cfg: _Cfg, q, k, v, rab_pos, rab_time, offs, ctx, cand, ts):
    t_cap, heads, _ = q.shape
    bsz = offs.shape[0] - 1
    aux = _aux_inputs(cfg, offs, ctx, cand, ts, rab_pos, rab_time)
    out = _call(
        _fwd_kernel,
        cfg,
        (cfg.nqb, bsz, heads),
        jax.ShapeDtypeStruct((t_cap, heads, v.shape[-1]), q.dtype),
        [*aux, q, k, v],
        "hstu_attention_fwd",
    )
    return jnp.where(_token_mask(offs, t_cap), out, jnp.zeros((), out.dtype))


@functools.lru_cache(maxsize=32)
def _pos_plan(bq: int, bk: int, nqb: int, nkb: int, upad: int, p_size: int):
    """Static map from per-tile diagonal sums [nkb, nqb, upad] to rab_pos buckets.

    Tile (qb, kb) diagonal u holds pairs with local i - j = qb*bq - kb*bk + u - (bk - 1).
    Returns a padded gather matrix [P - 1, cap] for the buckets below P - 1 (pad index
    points at an appended zero) and a boolean selector for the clamped bucket P - 1.
    """
    kb, qb, u = np.meshgrid(np.arange(nkb), np.arange(nqb), np.arange(upad), indexing="ij")
    rel = qb * bq - kb * bk + u - (bk - 1)
    bucket = np.minimum(np.abs(rel), p_size - 1).ravel()
    bucket[(u >= bq + bk - 1).ravel()] = -1
    total = bucket.size
    clamp_sel = bucket == p_size - 1
    if p_size == 1:
        return np.zeros((0, 1), np.int32), clamp_sel
    small = np.nonzero((bucket >= 0) & (bucket < p_size - 1))[0]
    small = small[np.argsort(bucket[small], kind="stable")]
    sb = bucket[small]
    counts = np.bincount(sb, minlength=p_size - 1)
    cap = max(1, int(counts.max(initial=0)))
    gather = np.full((p_size - 1, cap), total, np.int32)
    starts = np.concatenate([[0], np.cumsum(counts)[:-1]])
    rank = np.arange(small.size) - starts[sb]
    gather[sb, rank] = small
    return gather, clamp_sel


def _reduce_pos_partials(cfg: _Cfg, partial):
    """[B, H, nkb, nqb, upad] per-tile diagonal sums -> [H, P] rab_pos gradient."""
    heads = partial.shape[1]
    x = jnp.sum(partial, axis=0).reshape(heads, -1)  # [H, L]
    gather, clamp_sel = _pos_plan(cfg.bq, cfg.bk, cfg.nqb, cfg.nkb, cfg.upad, cfg.pos_size)
    tail = jnp.sum(jnp.where(jnp.asarray(clamp_sel)[None, :], x, 0.0), axis=1, keepdims=True)
    if cfg.pos_size == 1:
        return tail
    x_ext = jnp.concatenate([x, jnp.zeros((heads, 1), x.dtype)], axis=1)
    head = jnp.sum(jnp.take(x_ext, jnp.asarray(gather), axis=1), axis=-1)  # [H, P - 1]
    return jnp.concatenate([head, tail], axis=1)


def _backward(cfg: _Cfg, res, g):
    q, k, v, rab_pos, rab_time, offs, ctx, cand, ts = res
    t_cap, heads, _ = q.shape
    bsz = offs.shape[0] - 1
    do = g.astype(q.dtype)
    aux = _aux_inputs(cfg, offs, ctx, cand, ts, rab_pos, rab_time)
    tok = _token_mask(offs, t_cap)

    dq = _call(
        _dq_kernel,
        cfg,
        (cfg.nqb, bsz, heads),
        jax.ShapeDtypeStruct(q.shape, q.dtype),
        [*aux, q, k, v, do],
        "hstu_attention_bwd_dq",
    )
    out_shape = [jax.ShapeDtypeStruct(k.shape, k.dtype), jax.ShapeDtypeStruct(v.shape, v.dtype)]
    if cfg.time_size:
        out_shape.append(jax.ShapeDtypeStruct((bsz, heads, cfg.nkb, cfg.time_pad), jnp.float32))
    if cfg.pos_size:
        out_shape.append(
            jax.ShapeDtypeStruct((bsz, heads, cfg.nkb, cfg.nqb, cfg.upad), jnp.float32)
        )
        out_shape.append(jax.ShapeDtypeStruct((bsz * heads * cfg.nkb, cfg.bq, cfg.bk), jnp.float32))
    outs = _call(
        _dkdv_kernel,
        cfg,
        (cfg.nkb, bsz, heads),
        out_shape,
        [*aux, q, k, v, do],
        "hstu_attention_bwd_dkdv",
    )
    dk, dv = outs[0], outs[1]
    zero = jnp.zeros((), q.dtype)
    dq = jnp.where(tok, dq, zero)
    dk = jnp.where(tok, dk, zero)
    dv = jnp.where(tok, dv, zero)
    d_time = None
    d_pos = None
    idx = 2
    if cfg.time_size:
        d_time = jnp.sum(outs[idx], axis=(0, 2))[:, : cfg.time_size].astype(rab_time.dtype)
        idx += 1
    if cfg.pos_size:
        d_pos = _reduce_pos_partials(cfg, outs[idx]).astype(rab_pos.dtype)
    return dq, dk, dv, d_pos, d_time, None, None, None, None


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _hstu_attention(cfg, q, k, v, rab_pos, rab_time, offs, ctx, cand, ts):
    return _forward(cfg, q, k, v, rab_pos, rab_time, offs, ctx, cand, ts)


def _hstu_attention_fwd(cfg, q, k, v, rab_pos, rab_time, offs, ctx, cand, ts):
    out = _forward(cfg, q, k, v, rab_pos, rab_time, offs, ctx, cand, ts)
    return out, (q, k, v, rab_pos, rab_time, offs, ctx, cand, ts)


_hstu_attention.defvjp(_hstu_attention_fwd, _backward)


# --------------------------------------------------------------------------------------
# Public entry point.
# --------------------------------------------------------------------------------------

_FLOATS = (jnp.float32, jnp.bfloat16, jnp.float16)


def _err(name: str, msg: str) -> ValueError:
    return ValueError(f"{name}: {msg}")


def _check_int_vector(x, name: str, length: int):
    if x.ndim != 1 or x.shape[0] != length:
        raise _err(name, f"expected shape ({length},), got {tuple(x.shape)}")
    if not jnp.issubdtype(x.dtype, jnp.integer):
        raise _err(name, f"expected an integer dtype, got {x.dtype}")


@functools.partial(
    jax.jit,
    static_argnames=("max_seqlen", "alpha", "normalizer", "block_sizes", "interpret"),
)
def hstu_attention(
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
    block_sizes: BlockSizes | None = None,
    interpret: bool | None = None,
) -> jax.Array:
    """HSTU attention over a jagged batch (see ``kernels/README.md``).

    Args:
      q, k: ``[T, H, Dqk]``; v: ``[T, H, Dv]`` (fp32, bf16 or fp16, one dtype).
      seq_offsets: ``[B + 1]`` int, leading 0; rows past ``seq_offsets[-1]`` are padding.
      max_seqlen: static bound on every sample's length (tiling only). Samples longer
        than this are not fully computed (not checked: it would need a host sync).
      alpha: scale inside the SiLU; normalizer: fixed divisor.
      num_contextual, num_candidates: ``[B]`` int or None.
      timestamps: ``[T]`` int (used as int32), required with ``rab_time``.
      rab_pos: ``[H, P]``; rab_time: ``[H, Tb]`` bias tables or None.
      block_sizes: tiling, default ``BlockSizes()``.
      interpret: run the Pallas interpreter; None means "when the default backend is CPU".

    Returns ``[T, H, Dv]`` in ``q.dtype`` (fp32 accumulation), zero past
    ``seq_offsets[-1]``. Differentiable in q, k, v, rab_pos and rab_time.
    """
    if q.ndim != 3:
        raise _err("q", f"expected [T, H, Dqk], got shape {tuple(q.shape)}")
    t_cap, heads, d_qk = q.shape
    if k.shape != q.shape:
        raise _err("k", f"expected shape {tuple(q.shape)} (as q), got {tuple(k.shape)}")
    if v.ndim != 3 or v.shape[:2] != (t_cap, heads):
        raise _err("v", f"expected [T={t_cap}, H={heads}, Dv], got {tuple(v.shape)}")
    if q.dtype not in _FLOATS:
        raise _err("q", f"dtype must be float32, bfloat16 or float16, got {q.dtype}")
    if k.dtype != q.dtype:
        raise _err("k", f"dtype {k.dtype} differs from q's {q.dtype}")
    if v.dtype != q.dtype:
        raise _err("v", f"dtype {v.dtype} differs from q's {q.dtype}")
    if seq_offsets.ndim != 1 or seq_offsets.shape[0] < 1:
        raise _err("seq_offsets", f"expected [B + 1], got shape {tuple(seq_offsets.shape)}")
    if not jnp.issubdtype(seq_offsets.dtype, jnp.integer):
        raise _err("seq_offsets", f"expected an integer dtype, got {seq_offsets.dtype}")
    if not isinstance(max_seqlen, int) or isinstance(max_seqlen, bool) or max_seqlen < 1:
        raise _err("max_seqlen", f"expected a python int >= 1, got {max_seqlen!r}")
    if not isinstance(alpha, int | float):
        raise _err("alpha", f"expected a python float, got {alpha!r}")
    if not isinstance(normalizer, int | float) or normalizer == 0:
        raise _err("normalizer", f"expected a non-zero python float, got {normalizer!r}")
    bsz = seq_offsets.shape[0] - 1
    if num_contextual is not None:
        _check_int_vector(num_contextual, "num_contextual", bsz)
    if num_candidates is not None:
        _check_int_vector(num_candidates, "num_candidates", bsz)
    for name, tab in (("rab_pos", rab_pos), ("rab_time", rab_time)):
        if tab is None:
            continue
        if tab.ndim != 2 or tab.shape[0] != heads or tab.shape[1] < 1:
            raise _err(name, f"expected [H={heads}, size >= 1], got {tuple(tab.shape)}")
        if not jnp.issubdtype(tab.dtype, jnp.floating):
            raise _err(name, f"expected a float dtype, got {tab.dtype}")
    if rab_time is not None and timestamps is None:
        raise _err("timestamps", "required when rab_time is given")
    if timestamps is not None:
        _check_int_vector(timestamps, "timestamps", t_cap)
    if block_sizes is None:
        block_sizes = BlockSizes()
    if not isinstance(block_sizes, BlockSizes):
        raise _err("block_sizes", f"expected BlockSizes or None, got {type(block_sizes)}")
    if interpret is None:
        interpret = jax.default_backend() == "cpu"

    d_v = v.shape[2]
    if bsz == 0 or t_cap == 0:
        return jnp.zeros((t_cap, heads, d_v), q.dtype)

    cap = max(16, _next_pow2(max_seqlen))
    cfg = _Cfg(
        max_seqlen=max_seqlen,
        alpha=float(alpha),
        normalizer=float(normalizer),
        bq=min(block_sizes.block_q, cap),
        bk=min(block_sizes.block_k, cap),
        num_warps=block_sizes.num_warps,
        num_stages=block_sizes.num_stages,
        interpret=bool(interpret),
        has_ctx=num_contextual is not None,
        has_cand=num_candidates is not None,
        pos_size=0 if rab_pos is None else int(rab_pos.shape[1]),
        time_size=0 if rab_time is None else int(rab_time.shape[1]),
        fast_math=(not interpret) and q.dtype != jnp.float32 and _approx_tanh is not None,
    )
    # Head dims padded to powers of two >= 16 (Triton tiles); zero columns are inert.
    dqk_p = max(16, _next_pow2(d_qk))
    dv_p = max(16, _next_pow2(d_v))
    if dqk_p != d_qk:
        pad = ((0, 0), (0, 0), (0, dqk_p - d_qk))
        q, k = jnp.pad(q, pad), jnp.pad(k, pad)
    if dv_p != d_v:
        v = jnp.pad(v, ((0, 0), (0, 0), (0, dv_p - d_v)))
    offs = seq_offsets.astype(jnp.int32)
    ctx = None if num_contextual is None else num_contextual.astype(jnp.int32)
    cand = None if num_candidates is None else num_candidates.astype(jnp.int32)
    ts = None if rab_time is None else timestamps.astype(jnp.int32)
    out = _hstu_attention(cfg, q, k, v, rab_pos, rab_time, offs, ctx, cand, ts)
    return out[..., :d_v] if dv_p != d_v else out
