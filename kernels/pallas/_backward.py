"""Backward Pallas kernels of HSTU attention (``dq``; ``dk``/``dv`` with the bias-gradient
partials) and the deterministic reductions of those partials into ``rab_pos`` / ``rab_time``
gradients."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl

from . import _mosaic
from ._common import (
    _apply_mask,
    _aux_inputs,
    _call,
    _Cfg,
    _debug_barrier,
    _dot,
    _load,
    _load_block,
    _program,
    _query_ranges,
    _Refs,
    _sample_meta,
    _schedule_table,
    _scores,
    _silu_and_grad,
    _store,
    _sweep_key_blocks,
    _token_mask,
)


def _dq_kernel(*refs, cfg: _Cfg):
    r = _Refs(refs, cfg, ("q", "k", "v", "do"), ("dq",))
    bq, bk = cfg.bq, cfg.bk
    qb, b, valid, h = _program(r)
    start, n, c, hist = _sample_meta(r, b, valid, cfg)
    qs = qb * bq
    i_pos, q_ok, (q, do), tq = _load_block(r, cfg, ("q", "do"), qs, bq, start, n, h)
    inv_n = jnp.float32(1.0 / cfg.normalizer)

    def make_body(masked: bool):
        def body(kb, dq):
            j_pos, _, (k, v), tk = _load_block(r, cfg, ("k", "v"), kb * bk, bk, start, n, h)
            s, mask, _ = _scores(cfg, r, h, q, k, i_pos, j_pos, tq, tk, n, c, hist, masked)
            _, dsilu = _silu_and_grad(s, cfg)
            dp = _dot(do, v, 1, 1)
            ds = _apply_mask(mask, dp * dsilu * inv_n)
            return dq + _dot(ds.astype(k.dtype), k, 1, 0)

        return body

    dq = _sweep_key_blocks(make_body, r.q.shape[-1], qs, n, c, hist, cfg)
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
    kb, b, valid, h = _program(r)  # early key blocks are seen by the most queries
    start, n, c, hist = _sample_meta(r, b, valid, cfg)
    ks = kb * bk
    j_pos, k_ok, (k, v), tk = _load_block(r, cfg, ("k", "v"), ks, bk, start, n, h)
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
        i_pos, _, (q, do), tq = _load_block(r, cfg, ("q", "do"), qb * bq, bq, start, n, h)
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
    # partials of an idle program (no work: its b, kb alias a real pair's) are not stored
    if cfg.time_size:
        _store(r.dtime.at[b, h, kb, :], dtime, mask=jnp.broadcast_to(valid, dtime.shape))
    if cfg.pos_size:
        # Tiles this program skipped get zero diagonal sums.
        zeros = jnp.zeros((cfg.upad,), jnp.float32)
        keep = jnp.broadcast_to(valid, zeros.shape)

        def zero_body(qb, carry):
            _store(r.dpos.at[b, h, kb, qb, :], zeros, mask=keep)
            return carry

        lax.fori_loop(end_a, lo_b, zero_body, 0)
        lax.fori_loop(hi_b, jnp.int32(cfg.nqb), zero_body, 0)


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
    tok = _token_mask(offs, t_cap)
    dq_cfg, kv = cfg.for_kernel("dq"), cfg.for_kernel("dkdv")  # each kernel's own tiles

    if cfg.lowering == "mosaic":  # no biases there: no bias gradients from dq
        dq = _mosaic.backward_dq(q, k, v, do, offs, ctx, cand, **cfg.mosaic_kwargs("dq"))
    else:
        num, sched = _schedule_table(dq_cfg, offs, t_cap, key_major=False)
        dq = _call(
            _dq_kernel,
            dq_cfg,
            (num, heads),
            jax.ShapeDtypeStruct(q.shape, q.dtype),
            [*_aux_inputs(dq_cfg, sched, offs, ctx, cand, ts, rab_pos, rab_time), q, k, v, do],
            "hstu_attention_bwd_dq",
        )
    if cfg.lowering == "mosaic":  # no biases: nothing but dk, dv
        dk, dv = _mosaic.backward_dkdv(q, k, v, do, offs, ctx, cand, **cfg.mosaic_kwargs("dkdv"))
        zero = jnp.zeros((), q.dtype)
        dq = jnp.where(tok, dq, zero)
        return dq, dk, dv, None, None, None, None, None, None
    out_shape = [jax.ShapeDtypeStruct(k.shape, k.dtype), jax.ShapeDtypeStruct(v.shape, v.dtype)]
    if kv.time_size:
        out_shape.append(jax.ShapeDtypeStruct((bsz, heads, kv.nkb, kv.time_pad), jnp.float32))
    if kv.pos_size:
        out_shape.append(jax.ShapeDtypeStruct((bsz, heads, kv.nkb, kv.nqb, kv.upad), jnp.float32))
        out_shape.append(jax.ShapeDtypeStruct((bsz * heads * kv.nkb, kv.bq, kv.bk), jnp.float32))
    num, sched = _schedule_table(kv, offs, t_cap, key_major=True)
    outs = _call(
        _dkdv_kernel,
        kv,
        (num, heads),
        out_shape,
        [*_aux_inputs(kv, sched, offs, ctx, cand, ts, rab_pos, rab_time), q, k, v, do],
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
    # key blocks past a sample's end ran no program: their partials were never written
    nblk = (offs[1:] - offs[:-1] + kv.bk - 1) // kv.bk
    ran = jnp.arange(kv.nkb, dtype=jnp.int32)[None, :] < nblk[:, None]  # [B, nkb]
    if kv.time_size:
        part = jnp.where(ran[:, None, :, None], outs[idx], 0.0)
        d_time = jnp.sum(part, axis=(0, 2))[:, : kv.time_size].astype(rab_time.dtype)
        idx += 1
    if kv.pos_size:
        part = jnp.where(ran[:, None, :, None, None], outs[idx], 0.0)
        d_pos = _reduce_pos_partials(kv, part).astype(rab_pos.dtype)
    return dq, dk, dv, d_pos, d_time, None, None, None, None
