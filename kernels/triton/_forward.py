"""Forward Triton kernel of HSTU attention (design notes in ``hstu_attention.py``)."""

import triton
import triton.language as tl

from ._common import (
    _block_start,
    _dot,
    _key_ranges,
    _key_tile,
    _load_tile,
    _num_blocks,
    _rows_desc,
    _sample_info,
    _sigmoid,
    _store_rows,
    _tail_program,
    _time_path,
    _ts_load,
    _visible,
    _zero_tail_rows,
)


@triton.jit
def _fwd_tile(
    acc, q, offs_m, ts_q, ts_lo, start_n, K, V, Ts, RabPos, RabTime, seq_start, stride_kt,
    stride_vt, n, hist_end, C, P, TB, alpha,
    DQK: tl.constexpr, DV: tl.constexpr, BLOCK_DQK: tl.constexpr, BLOCK_DV: tl.constexpr,
    BLOCK_N: tl.constexpr, HAS_CTX: tl.constexpr, HAS_POS: tl.constexpr,
    HAS_TIME: tl.constexpr, PREC: tl.constexpr, FAST: tl.constexpr, MASKED: tl.constexpr,
    TMA: tl.constexpr,
):  # fmt: skip
    k, v, z, qi, kj, _ = _key_tile(
        q, offs_m, ts_q, ts_lo, start_n, K, V, Ts, RabPos, RabTime, seq_start, stride_kt,
        stride_vt, n, P, TB, alpha, DQK, DV, BLOCK_DQK, BLOCK_DV, BLOCK_N, HAS_POS, HAS_TIME,
        PREC, TMA,
    )  # fmt: skip
    p = z * _sigmoid(z, FAST)
    if MASKED:
        p = tl.where(_visible(qi, kj, n, hist_end, C, HAS_CTX), p, 0.0)
    return acc + _dot(p.to(v.dtype), v, PREC)


@triton.jit
def _hstu_fwd_kernel(
    Q, K, V, Out, SeqOffsets, NumCtx, NumCand, Ts, TsRange, RabPos, RabTime,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_ot, stride_oh,
    stride_rp, stride_rt, Sched, G, Lead, H, P, TB, alpha, inv_norm, B, T,
    DQK: tl.constexpr, DV: tl.constexpr, BLOCK_DQK: tl.constexpr, BLOCK_DV: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HAS_CTX: tl.constexpr,
    HAS_CAND: tl.constexpr, HAS_POS: tl.constexpr, HAS_TIME: tl.constexpr,
    PREC: tl.constexpr, FAST: tl.constexpr, TMA: tl.constexpr, ZERO_TAIL: tl.constexpr,
    TAIL_ROWS: tl.constexpr, TAIL_COLS: tl.constexpr,
):  # fmt: skip
    """Out for one query block of one sample and head. ``ZERO_TAIL``: the programs past the
    scheduled ``G * H`` zero Out's rows past the last sample (``B`` samples, ``T`` rows), the
    capacity padding, ``TAIL_ROWS`` rows each (``_zero_tail_rows``)."""
    pid, tail = _tail_program(G, H, ZERO_TAIL)
    m_blk, h, seq_start, n, C, hist_end = _sample_info(
        pid, H, Sched, G, Lead, SeqOffsets, NumCtx, NumCand, HAS_CTX, HAS_CAND
    )
    n = tl.where(tail < 0, n, 0)  # a tail program: no query block
    ts_lo = 0
    if HAS_TIME:
        ts_lo, runs = _time_path(TsRange, HAS_TIME)
        n = tl.where(runs, n, 0)  # the other time path's launch does this program
    m0 = m_blk * BLOCK_M
    if m0 < n:
        Q += h * stride_qh
        K += h * stride_kh
        V += h * stride_vh
        Out += h * stride_oh
        RabPos += h * stride_rp
        RabTime += h * stride_rt
        offs_m = m0 + tl.arange(0, BLOCK_M)
        rows_m = seq_start + offs_m
        in_m = offs_m < n
        # the tiles' sources: the sample's rows through descriptors (tiles past its end read
        # as zeros), or the head slices
        if TMA:
            Qs = _rows_desc(Q, seq_start, n, stride_qt, DQK, BLOCK_M, BLOCK_DQK)
            Ks = _rows_desc(K, seq_start, n, stride_kt, DQK, BLOCK_N, BLOCK_DQK)
            Vs = _rows_desc(V, seq_start, n, stride_vt, DV, BLOCK_N, BLOCK_DV)
        else:
            Qs, Ks, Vs = Q, K, V
        q = _load_tile(Qs, m0, rows_m, in_m, stride_qt, DQK, BLOCK_DQK, TMA)
        ts_q = 0
        if HAS_TIME:
            ts_q = _ts_load(Ts, rows_m, in_m, ts_lo, HAS_TIME)[:, None]
        acc = tl.full([BLOCK_M, BLOCK_DV], 0.0, tl.float32)
        full, hi1, lo2, hi2 = _key_ranges(m0, n, hist_end, C, BLOCK_M, BLOCK_N, HAS_CTX)
        for start_n in range(0, full, BLOCK_N):  # fully visible key blocks
            acc = _fwd_tile(
                acc, q, offs_m, ts_q, ts_lo, start_n, Ks, Vs, Ts, RabPos, RabTime, seq_start,
                stride_kt, stride_vt, n, hist_end, C, P, TB, alpha, DQK, DV, BLOCK_DQK, BLOCK_DV,
                BLOCK_N, HAS_CTX, HAS_POS, HAS_TIME, PREC, FAST, False, TMA,
            )  # fmt: skip
        # masked: the causal / history edge [full, hi1) and the candidates' diagonal [lo2, hi2)
        n_a = _num_blocks(full, hi1, BLOCK_N)
        n_b = _num_blocks(lo2, hi2, BLOCK_N)
        for it in range(0, n_a + n_b):
            start_n = _block_start(it, full, n_a, lo2, n_b, 0, BLOCK_N)
            acc = _fwd_tile(
                acc, q, offs_m, ts_q, ts_lo, start_n, Ks, Vs, Ts, RabPos, RabTime, seq_start,
                stride_kt, stride_vt, n, hist_end, C, P, TB, alpha, DQK, DV, BLOCK_DQK, BLOCK_DV,
                BLOCK_N, HAS_CTX, HAS_POS, HAS_TIME, PREC, FAST, True, TMA,
            )  # fmt: skip
        _store_rows(Out, rows_m, in_m, stride_ot, acc * inv_norm, DV, BLOCK_DV)
    if ZERO_TAIL:
        _zero_tail_rows(Out, SeqOffsets, B, T, stride_ot, stride_oh, H, DV, tail, TAIL_ROWS,
                        TAIL_COLS)  # fmt: skip
