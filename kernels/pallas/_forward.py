"""Forward Pallas kernel of HSTU attention and its ``pallas_call`` wrapper."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from ._common import (
    _apply_mask,
    _aux_inputs,
    _call,
    _Cfg,
    _dot,
    _load_block,
    _program,
    _Refs,
    _sample_meta,
    _schedule_table,
    _scores,
    _silu_and_grad,
    _store,
    _sweep_key_blocks,
    _token_mask,
)


def _fwd_kernel(*refs, cfg: _Cfg):
    r = _Refs(refs, cfg, ("q", "k", "v"), ("o",))
    bq, bk = cfg.bq, cfg.bk
    qb, b, valid, h = _program(r)  # heavy (late) query blocks first
    start, n, c, hist = _sample_meta(r, b, valid, cfg)
    qs = qb * bq
    i_pos, q_ok, (q,), tq = _load_block(r, cfg, ("q",), qs, bq, start, n, h)
    inv_n = jnp.float32(1.0 / cfg.normalizer)

    def make_body(masked: bool):
        def body(kb, acc):
            j_pos, _, (k, v), tk = _load_block(r, cfg, ("k", "v"), kb * bk, bk, start, n, h)
            s, mask, _ = _scores(cfg, r, h, q, k, i_pos, j_pos, tq, tk, n, c, hist, masked)
            silu, _ = _silu_and_grad(s, cfg)
            p = _apply_mask(mask, silu * inv_n)
            return acc + _dot(p.astype(v.dtype), v, 1, 0)

        return body

    acc = _sweep_key_blocks(make_body, r.v.shape[-1], qs, n, c, hist, cfg)
    _store(r.o.at[pl.ds(start + qs, bq), h, :], acc.astype(r.o.dtype), mask=q_ok[:, None])


def _forward(cfg: _Cfg, q, k, v, rab_pos, rab_time, offs, ctx, cand, ts):
    t_cap, heads, _ = q.shape
    num, sched = _schedule_table(cfg, offs, t_cap, key_major=False)
    aux = _aux_inputs(cfg, sched, offs, ctx, cand, ts, rab_pos, rab_time)
    out = _call(
        _fwd_kernel,
        cfg,
        (num, heads),
        jax.ShapeDtypeStruct((t_cap, heads, v.shape[-1]), q.dtype),
        [*aux, q, k, v],
        "hstu_attention_fwd",
    )
    return jnp.where(_token_mask(offs, t_cap), out, jnp.zeros((), out.dtype))
