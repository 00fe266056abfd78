"""Jagged HSTU attention in Triton: forward and backward, registered as torch.library ops.

Contract: ``kernels/README.md``. Layout is jagged ``[T, H, D]`` with ``seq_offsets[B + 1]``.

Design
------
* Forward: one program per (query block, sample, head); the query tile stays in registers and
  the program walks the key blocks of its sample, accumulating ``silu(z) @ V`` in fp32.
  There is no softmax, so no running max/denominator is needed.
* Backward: two kernels that recompute the scores (no dq atomics, so dq/dk/dv are
  deterministic).  ``dkdv`` runs one program per (key block, sample, head) and walks the query
  blocks; ``dq`` runs one program per (query block, sample, head) and walks the key blocks.
  The ``dq`` kernel also reduces the bias gradient ``dz`` into the tables (fp32 buffers, cast to
  the table dtype afterwards): ``rab_pos`` with one fp32 ``tl.atomic_add`` per visible pair
  (lanes of a warp hit distinct buckets, so contention is low); ``rab_time`` per tile, looping
  only over the few buckets present in the tile, into a register vector flushed with one vector
  atomic per program (per-pair atomics on ~Tb hot addresses were ~10x slower).
* Block skipping: for a query block ``[m0, m1)`` the keys that can be unmasked are
  ``[0, m1)`` (causal), ``[0, n - K)`` if the block holds a contextual query, and the diagonal
  ``[m0, m1)`` for candidates; key blocks between the history and the diagonal are skipped.
  Symmetrically, a key block ``[n0, n1)`` is only visited by query blocks in ``[0, C)`` and
  ``[n0, n)`` (or only ``[n0, n1)`` when all its keys are candidates).  Blocks known to be fully
  visible skip the mask; the masked ranges are walked by one loop (one inlined tile copy).
* Programs are ordered heaviest-first (last query block first) over a flat 1D grid.
"""

import contextlib
import functools
import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

__all__ = ["BlockSizes", "hstu_attention", "is_interpret_mode"]


# ----------------------------------------------------------------------------------------------
# Triton kernels
# ----------------------------------------------------------------------------------------------
# Local positions: ``qi`` (query) and ``kj`` (key) are broadcastable int32 index tensors inside a
# sample of length ``n``; ``hist_end = n - K``.  MASKED=False marks a tile known to be fully
# visible (no mask evaluated).  HAS_TIME is 0 (no rab_time), 1 (Tb <= 31: int32 bucket math) or
# 2 (wider tables: int64 bucket math).


# Only core builtins and this module's own jit helpers are used in the kernels (no tl.zeros,
# tl.sigmoid, tl.cdiv, tl.sum, ...): those live in triton.language.standard and are decorated when
# triton.language is first imported, so if that happened before TRITON_INTERPRET=1 was set (torch
# and torchrec import triton), they would not run in the interpreter.


@triton.jit
def _cdiv(a, b):
    return (a + b - 1) // b


@triton.jit
def _add(a, b):
    return a + b


@triton.jit
def _min(a, b):
    return tl.minimum(a, b)


@triton.jit
def _max(a, b):
    return tl.maximum(a, b)


@triton.jit
def _reduce_sum(x):
    return tl.reduce(tl.reduce(x, 1, _add), 0, _add)


@triton.jit
def _reduce_min(x):
    return tl.reduce(tl.reduce(x, 1, _min), 0, _min)


@triton.jit
def _reduce_max(x):
    return tl.reduce(tl.reduce(x, 1, _max), 0, _max)


@triton.jit
def _dot(a, b, PREC: tl.constexpr):
    """tl.dot with fp32 accumulation. PREC == "upcast" works around the interpreter's bf16 dot
    (it multiplies raw bit patterns): operands go to fp32, which is exact for bf16 products."""
    if PREC == "upcast":
        out = tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    else:
        out = tl.dot(a, b, input_precision=PREC)
    return out


@triton.jit
def _sigmoid(z, FAST: tl.constexpr):
    """sigmoid(z); FAST (CUDA, 16-bit inputs) uses one tanh.approx instead of exp + divide."""
    if FAST:
        t = tl.inline_asm_elementwise(
            "tanh.approx.f32 $0, $1;", "=f,f", [z * 0.5], dtype=tl.float32, is_pure=True, pack=1
        )
        out = 0.5 + 0.5 * t
    else:
        out = 1.0 / (1.0 + tl.exp(-z))
    return out


@triton.jit
def _time_bucket(ts_q, ts_k, TB, HAS_TIME: tl.constexpr):
    """min(floor(log2(1 + |ts_q - ts_k|)), TB - 1) for int64 timestamps, exactly."""
    d = tl.abs(ts_q - ts_k)
    if HAS_TIME == 1:  # noqa: SIM108 (constexpr branch)
        # TB <= 31: every |dt| >= 2^30 - 1 lands in the last bucket, so clamp and go int32
        x = (tl.minimum(d, 1 << 30) + 1).to(tl.int32)
    else:
        x = d + 1
    # exponent of fp32(x); round-to-nearest may carry x up to the next power of two: undo that
    b = (((x.to(tl.float32).to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127).to(x.dtype)
    b = tl.where(((b * 0 + 1) << b) > x, b - 1, b)
    return tl.minimum(b, TB - 1)


@triton.jit
def _visible(qi, kj, n, hist_end, C, HAS_CTX: tl.constexpr):
    """mask(i, j) = (i == j) or (j < n - K and (j <= i or i < C)), restricted to i, j < n."""
    seen = kj <= qi
    if HAS_CTX:
        seen = seen | (qi < C)
    return ((qi == kj) | ((kj < hist_end) & seen)) & (qi < n) & (kj < n)


@triton.jit
def _logits(
    s, qi, kj, ts_q, ts_k, RabPos, RabTime, P, TB, alpha,
    HAS_POS: tl.constexpr, HAS_TIME: tl.constexpr,
):  # fmt: skip
    """z = alpha * s + rab_pos[|i - j|] + rab_time[bucket(|t_i - t_j|)] (tables pre-offset by h)."""
    z = s * alpha
    if HAS_POS:
        z += tl.load(RabPos + tl.minimum(tl.abs(qi - kj), P - 1)).to(tl.float32)
    if HAS_TIME:
        z += tl.load(RabTime + _time_bucket(ts_q, ts_k, TB, HAS_TIME)).to(tl.float32)
    return z


@triton.jit
def _sample_info(
    pid, num_bh, H, num_blocks, SeqOffsets, NumCtx, NumCand,
    HAS_CTX: tl.constexpr, HAS_CAND: tl.constexpr,
):  # fmt: skip
    bh = pid % num_bh
    blk = num_blocks - 1 - pid // num_bh  # heaviest (last) blocks first
    b = bh // H
    h = bh % H
    seq_start = tl.load(SeqOffsets + b)
    n = (tl.load(SeqOffsets + b + 1) - seq_start).to(tl.int32)
    C = 0
    if HAS_CTX:
        C = tl.load(NumCtx + b)
    hist_end = n
    if HAS_CAND:
        hist_end = n - tl.load(NumCand + b)
    return blk, h, seq_start, n, C, hist_end


@triton.jit
def _key_ranges(
    m0, n, hist_end, C, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HAS_CTX: tl.constexpr
):
    """Key blocks for queries [m0, m0 + BLOCK_M): fully visible [0, full), masked [full, hi1),
    and the candidates' diagonal [lo2, hi2); everything else is masked out and skipped."""
    m1 = m0 + BLOCK_M
    hi1 = tl.minimum(m1, hist_end)  # causal
    full = ((m0 + 1) // BLOCK_N) * BLOCK_N  # key blocks wholly <= m0
    if HAS_CTX:
        hi1 = tl.where(m0 < C, hist_end, hi1)  # a contextual query sees all history
        full = tl.where(m1 <= C, hist_end, full)
    hi1 = tl.maximum(hi1, 0)
    full = (tl.maximum(tl.minimum(full, hist_end), 0) // BLOCK_N) * BLOCK_N
    full = tl.where(m1 <= n, full, 0)
    lo2 = tl.maximum(_cdiv(hi1, BLOCK_N) * BLOCK_N, (m0 // BLOCK_N) * BLOCK_N)
    hi2 = tl.minimum(m1, n)
    return full, hi1, lo2, hi2


@triton.jit
def _query_ranges(
    n0, n, hist_end, C, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HAS_CTX: tl.constexpr
):
    """Query blocks for keys [n0, n0 + BLOCK_N): contextual [0, cfull) full and [cfull, chi)
    masked; then [lo, fs) masked, [fs, fe) full, [fe, hi) masked."""
    n1 = n0 + BLOCK_N
    has_hist = n0 < hist_end  # some key is contextual / history: seen by [0, C) and [n0, n)
    keys_full = n1 <= hist_end  # every key is contextual / history (and < n)
    lo = (n0 // BLOCK_M) * BLOCK_M
    hi = tl.where(has_hist, n, tl.minimum(n1, n))  # candidate keys: only their diagonal
    chi = 0
    cfull = 0
    if HAS_CTX:
        chi = tl.where(has_hist, tl.minimum(_cdiv(C, BLOCK_M) * BLOCK_M, lo), 0)
        cfull = tl.where(keys_full, (tl.minimum(C, n) // BLOCK_M) * BLOCK_M, 0)
        cfull = tl.minimum(cfull, chi)
    fs = tl.where(keys_full, _cdiv(n1 - 1, BLOCK_M) * BLOCK_M, hi)  # queries wholly >= n1 - 1
    fs = tl.minimum(tl.maximum(fs, lo), hi)
    fe = tl.where(keys_full, (n // BLOCK_M) * BLOCK_M, fs)
    fe = tl.maximum(fe, fs)
    return cfull, chi, lo, fs, fe, hi


@triton.jit
def _num_blocks(lo, hi, BLOCK: tl.constexpr):
    return _cdiv(tl.maximum(hi - lo, 0), BLOCK)


@triton.jit
def _block_start(it, lo_a, n_a, lo_b, n_b, lo_c, BLOCK: tl.constexpr):
    """Start of block ``it`` of the concatenated block ranges a (n_a blocks), b, c: one loop
    (one inlined copy of the tile code) walks several disjoint ranges."""
    start = tl.where(it < n_a + n_b, lo_b + (it - n_a) * BLOCK, lo_c + (it - n_a - n_b) * BLOCK)
    return tl.where(it < n_a, lo_a + it * BLOCK, start)


@triton.jit
def _fwd_tile(
    acc, q, offs_m, ts_q, start_n, K, V, Ts, RabPos, RabTime, seq_start, stride_kt, stride_vt,
    n, hist_end, C, P, TB, alpha,
    DQK: tl.constexpr, DV: tl.constexpr, BLOCK_DQK: tl.constexpr, BLOCK_DV: tl.constexpr,
    BLOCK_N: tl.constexpr, HAS_CTX: tl.constexpr, HAS_POS: tl.constexpr,
    HAS_TIME: tl.constexpr, PREC: tl.constexpr, FAST: tl.constexpr, MASKED: tl.constexpr,
):  # fmt: skip
    offs_n = start_n + tl.arange(0, BLOCK_N)
    offs_dqk = tl.arange(0, BLOCK_DQK)
    offs_dv = tl.arange(0, BLOCK_DV)
    rows = seq_start + offs_n
    in_n = offs_n < n
    k = tl.load(
        K + rows[:, None] * stride_kt + offs_dqk[None, :],
        mask=in_n[:, None] & (offs_dqk[None, :] < DQK),
        other=0.0,
    )
    v = tl.load(
        V + rows[:, None] * stride_vt + offs_dv[None, :],
        mask=in_n[:, None] & (offs_dv[None, :] < DV),
        other=0.0,
    )
    ts_k = 0
    if HAS_TIME:
        ts_k = tl.load(Ts + rows, mask=in_n, other=0)[None, :]
    qi = offs_m[:, None]
    kj = offs_n[None, :]
    s = _dot(q, tl.trans(k), PREC)
    z = _logits(s, qi, kj, ts_q, ts_k, RabPos, RabTime, P, TB, alpha, HAS_POS, HAS_TIME)
    p = z * _sigmoid(z, FAST)
    if MASKED:
        p = tl.where(_visible(qi, kj, n, hist_end, C, HAS_CTX), p, 0.0)
    return acc + _dot(p.to(v.dtype), v, PREC)


@triton.jit
def _hstu_fwd_kernel(
    Q, K, V, Out, SeqOffsets, NumCtx, NumCand, Ts, RabPos, RabTime,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_ot, stride_oh,
    stride_rp, stride_rt, num_bh, H, num_m_blocks, P, TB, alpha, inv_norm,
    DQK: tl.constexpr, DV: tl.constexpr, BLOCK_DQK: tl.constexpr, BLOCK_DV: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HAS_CTX: tl.constexpr,
    HAS_CAND: tl.constexpr, HAS_POS: tl.constexpr, HAS_TIME: tl.constexpr,
    PREC: tl.constexpr, FAST: tl.constexpr,
):  # fmt: skip
    m_blk, h, seq_start, n, C, hist_end = _sample_info(
        tl.program_id(0), num_bh, H, num_m_blocks, SeqOffsets, NumCtx, NumCand, HAS_CTX, HAS_CAND
    )
    m0 = m_blk * BLOCK_M
    if m0 < n:
        Q += h * stride_qh
        K += h * stride_kh
        V += h * stride_vh
        Out += h * stride_oh
        RabPos += h * stride_rp
        RabTime += h * stride_rt
        offs_m = m0 + tl.arange(0, BLOCK_M)
        offs_dqk = tl.arange(0, BLOCK_DQK)
        offs_dv = tl.arange(0, BLOCK_DV)
        rows_m = seq_start + offs_m
        in_m = offs_m < n
        q = tl.load(
            Q + rows_m[:, None] * stride_qt + offs_dqk[None, :],
            mask=in_m[:, None] & (offs_dqk[None, :] < DQK),
            other=0.0,
        )
        ts_q = 0
        if HAS_TIME:
            ts_q = tl.load(Ts + rows_m, mask=in_m, other=0)[:, None]
        acc = tl.full([BLOCK_M, BLOCK_DV], 0.0, tl.float32)
        full, hi1, lo2, hi2 = _key_ranges(m0, n, hist_end, C, BLOCK_M, BLOCK_N, HAS_CTX)
        for start_n in range(0, full, BLOCK_N):  # fully visible key blocks
            acc = _fwd_tile(
                acc, q, offs_m, ts_q, start_n, K, V, Ts, RabPos, RabTime, seq_start, stride_kt,
                stride_vt, n, hist_end, C, P, TB, alpha, DQK, DV, BLOCK_DQK, BLOCK_DV, BLOCK_N,
                HAS_CTX, HAS_POS, HAS_TIME, PREC, FAST, False,
            )  # fmt: skip
        # masked: the causal / history edge [full, hi1) and the candidates' diagonal [lo2, hi2)
        n_a = _num_blocks(full, hi1, BLOCK_N)
        n_b = _num_blocks(lo2, hi2, BLOCK_N)
        for it in range(0, n_a + n_b):
            start_n = _block_start(it, full, n_a, lo2, n_b, 0, BLOCK_N)
            acc = _fwd_tile(
                acc, q, offs_m, ts_q, start_n, K, V, Ts, RabPos, RabTime, seq_start, stride_kt,
                stride_vt, n, hist_end, C, P, TB, alpha, DQK, DV, BLOCK_DQK, BLOCK_DV, BLOCK_N,
                HAS_CTX, HAS_POS, HAS_TIME, PREC, FAST, True,
            )  # fmt: skip
        tl.store(
            Out + rows_m[:, None] * stride_ot + offs_dv[None, :],
            (acc * inv_norm).to(Out.dtype.element_ty),
            mask=in_m[:, None] & (offs_dv[None, :] < DV),
        )


@triton.jit
def _dkdv_tile(
    dk, dv, k, v, offs_n, ts_k, start_m, Q, DO, Ts, RabPos, RabTime, seq_start, stride_qt,
    stride_dot, n, hist_end, C, P, TB, alpha, inv_norm,
    DQK: tl.constexpr, DV: tl.constexpr, BLOCK_DQK: tl.constexpr, BLOCK_DV: tl.constexpr,
    BLOCK_M: tl.constexpr, HAS_CTX: tl.constexpr, HAS_POS: tl.constexpr,
    HAS_TIME: tl.constexpr, PREC: tl.constexpr, FAST: tl.constexpr, MASKED: tl.constexpr,
):  # fmt: skip
    # transposed orientation: rows are keys, columns are queries
    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_dqk = tl.arange(0, BLOCK_DQK)
    offs_dv = tl.arange(0, BLOCK_DV)
    rows = seq_start + offs_m
    in_m = offs_m < n
    q = tl.load(
        Q + rows[:, None] * stride_qt + offs_dqk[None, :],
        mask=in_m[:, None] & (offs_dqk[None, :] < DQK),
        other=0.0,
    )
    do = tl.load(
        DO + rows[:, None] * stride_dot + offs_dv[None, :],
        mask=in_m[:, None] & (offs_dv[None, :] < DV),
        other=0.0,
    )
    ts_q = 0
    if HAS_TIME:
        ts_q = tl.load(Ts + rows, mask=in_m, other=0)[None, :]
    qi = offs_m[None, :]
    kj = offs_n[:, None]
    s_t = _dot(k, tl.trans(q), PREC)  # [BLOCK_N, BLOCK_M]
    z = _logits(s_t, qi, kj, ts_q, ts_k, RabPos, RabTime, P, TB, alpha, HAS_POS, HAS_TIME)
    sig = _sigmoid(z, FAST)
    p_t = z * sig
    dp_t = _dot(v, tl.trans(do), PREC) * inv_norm
    dz_t = dp_t * sig * (1.0 + z * (1.0 - sig))
    if MASKED:
        mask = _visible(qi, kj, n, hist_end, C, HAS_CTX)
        p_t = tl.where(mask, p_t, 0.0)
        dz_t = tl.where(mask, dz_t, 0.0)
    dv += _dot(p_t.to(do.dtype), do, PREC)
    dk += _dot(dz_t.to(q.dtype), q, PREC)
    return dk, dv


@triton.jit
def _hstu_bwd_dkdv_kernel(
    Q, K, V, DO, DK, DVout, SeqOffsets, NumCtx, NumCand, Ts, RabPos, RabTime,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_dot, stride_doh,
    stride_rp, stride_rt, num_bh, H, num_n_blocks, P, TB, alpha, inv_norm,
    DQK: tl.constexpr, DV: tl.constexpr, BLOCK_DQK: tl.constexpr, BLOCK_DV: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HAS_CTX: tl.constexpr,
    HAS_CAND: tl.constexpr, HAS_POS: tl.constexpr, HAS_TIME: tl.constexpr,
    PREC: tl.constexpr, FAST: tl.constexpr,
):  # fmt: skip
    n_blk, h, seq_start, n, C, hist_end = _sample_info(
        tl.program_id(0), num_bh, H, num_n_blocks, SeqOffsets, NumCtx, NumCand, HAS_CTX, HAS_CAND
    )
    n0 = n_blk * BLOCK_N
    if n0 < n:
        # DK / DVout share K / V strides (allocated with the same layout)
        Q += h * stride_qh
        K += h * stride_kh
        V += h * stride_vh
        DO += h * stride_doh
        DK += h * stride_kh
        DVout += h * stride_vh
        RabPos += h * stride_rp
        RabTime += h * stride_rt
        offs_n = n0 + tl.arange(0, BLOCK_N)
        offs_dqk = tl.arange(0, BLOCK_DQK)
        offs_dv = tl.arange(0, BLOCK_DV)
        rows_n = seq_start + offs_n
        in_n = offs_n < n
        kmask = in_n[:, None] & (offs_dqk[None, :] < DQK)
        vmask = in_n[:, None] & (offs_dv[None, :] < DV)
        k = tl.load(K + rows_n[:, None] * stride_kt + offs_dqk[None, :], mask=kmask, other=0.0)
        v = tl.load(V + rows_n[:, None] * stride_vt + offs_dv[None, :], mask=vmask, other=0.0)
        ts_k = 0
        if HAS_TIME:
            ts_k = tl.load(Ts + rows_n, mask=in_n, other=0)[:, None]
        dk = tl.full([BLOCK_N, BLOCK_DQK], 0.0, tl.float32)
        dv = tl.full([BLOCK_N, BLOCK_DV], 0.0, tl.float32)
        cfull, chi, lo, fs, fe, hi = _query_ranges(n0, n, hist_end, C, BLOCK_M, BLOCK_N, HAS_CTX)
        # fully visible query blocks: contextual [0, cfull) and [fs, fe)
        n_a = cfull // BLOCK_M
        n_b = _num_blocks(fs, fe, BLOCK_M)
        for it in range(0, n_a + n_b):
            start_m = _block_start(it, 0, n_a, fs, n_b, 0, BLOCK_M)
            dk, dv = _dkdv_tile(
                dk, dv, k, v, offs_n, ts_k, start_m, Q, DO, Ts, RabPos, RabTime, seq_start,
                stride_qt, stride_dot, n, hist_end, C, P, TB, alpha, inv_norm, DQK, DV,
                BLOCK_DQK, BLOCK_DV, BLOCK_M, HAS_CTX, HAS_POS, HAS_TIME, PREC, FAST, False,
            )  # fmt: skip
        # masked: [cfull, chi), [lo, fs) around the diagonal and the tail [fe, hi)
        n_a = _num_blocks(cfull, chi, BLOCK_M)
        n_b = _num_blocks(lo, fs, BLOCK_M)
        n_c = _num_blocks(fe, hi, BLOCK_M)
        for it in range(0, n_a + n_b + n_c):
            start_m = _block_start(it, cfull, n_a, lo, n_b, fe, BLOCK_M)
            dk, dv = _dkdv_tile(
                dk, dv, k, v, offs_n, ts_k, start_m, Q, DO, Ts, RabPos, RabTime, seq_start,
                stride_qt, stride_dot, n, hist_end, C, P, TB, alpha, inv_norm, DQK, DV,
                BLOCK_DQK, BLOCK_DV, BLOCK_M, HAS_CTX, HAS_POS, HAS_TIME, PREC, FAST, True,
            )  # fmt: skip
        tl.store(
            DK + rows_n[:, None] * stride_kt + offs_dqk[None, :],
            (dk * alpha).to(DK.dtype.element_ty),
            mask=kmask,
        )
        tl.store(
            DVout + rows_n[:, None] * stride_vt + offs_dv[None, :],
            (dv * inv_norm).to(DVout.dtype.element_ty),
            mask=vmask,
        )


@triton.jit
def _dq_tile(
    dq, dtime, q, do, offs_m, ts_q, start_n, K, V, Ts, RabPos, RabTime, DRabPos, seq_start,
    stride_kt, stride_vt, n, hist_end, C, P, TB, alpha, inv_norm,
    DQK: tl.constexpr, DV: tl.constexpr, BLOCK_DQK: tl.constexpr, BLOCK_DV: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_TB: tl.constexpr, HAS_CTX: tl.constexpr,
    HAS_POS: tl.constexpr, HAS_TIME: tl.constexpr, POS_GRAD: tl.constexpr,
    TIME_GRAD: tl.constexpr, PREC: tl.constexpr, FAST: tl.constexpr, MASKED: tl.constexpr,
):  # fmt: skip
    offs_n = start_n + tl.arange(0, BLOCK_N)
    offs_dqk = tl.arange(0, BLOCK_DQK)
    offs_dv = tl.arange(0, BLOCK_DV)
    rows = seq_start + offs_n
    in_n = offs_n < n
    k = tl.load(
        K + rows[:, None] * stride_kt + offs_dqk[None, :],
        mask=in_n[:, None] & (offs_dqk[None, :] < DQK),
        other=0.0,
    )
    v = tl.load(
        V + rows[:, None] * stride_vt + offs_dv[None, :],
        mask=in_n[:, None] & (offs_dv[None, :] < DV),
        other=0.0,
    )
    ts_k = 0
    if HAS_TIME:
        ts_k = tl.load(Ts + rows, mask=in_n, other=0)[None, :]
    qi = offs_m[:, None]
    kj = offs_n[None, :]
    s = _dot(q, tl.trans(k), PREC)
    z = _logits(s, qi, kj, ts_q, ts_k, RabPos, RabTime, P, TB, alpha, HAS_POS, HAS_TIME)
    sig = _sigmoid(z, FAST)
    dp = _dot(do, tl.trans(v), PREC) * inv_norm
    dz = dp * sig * (1.0 + z * (1.0 - sig))
    mask = None
    if MASKED:
        mask = _visible(qi, kj, n, hist_end, C, HAS_CTX)
        dz = tl.where(mask, dz, 0.0)
    dq += _dot(dz.to(k.dtype), k, PREC)
    if POS_GRAD:
        pos_idx = tl.minimum(tl.abs(qi - kj), P - 1)
        tl.atomic_add(DRabPos + pos_idx, dz, mask=mask, sem="relaxed")
    if TIME_GRAD:
        # few distinct buckets per tile: reduce each in registers, no contended atomics
        tb = _time_bucket(ts_q, ts_k, TB, HAS_TIME).to(tl.int32)
        if MASKED:
            lo_b = _reduce_min(tl.where(mask, tb, BLOCK_TB))
            hi_b = _reduce_max(tl.where(mask, tb, -1))
        else:
            lo_b = _reduce_min(tb)
            hi_b = _reduce_max(tb)
        offs_tb = tl.arange(0, BLOCK_TB)
        for t in range(lo_b, hi_b + 1):
            part = _reduce_sum(tl.where(tb == t, dz, 0.0))
            dtime += tl.where(offs_tb == t, part, 0.0)
    return dq, dtime


@triton.jit
def _hstu_bwd_dq_kernel(
    Q, K, V, DO, DQ, SeqOffsets, NumCtx, NumCand, Ts, RabPos, RabTime, DRabPos, DRabTime,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_dot, stride_doh,
    stride_rp, stride_rt, num_bh, H, num_m_blocks, P, TB, alpha, inv_norm,
    DQK: tl.constexpr, DV: tl.constexpr, BLOCK_DQK: tl.constexpr, BLOCK_DV: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_TB: tl.constexpr,
    HAS_CTX: tl.constexpr, HAS_CAND: tl.constexpr, HAS_POS: tl.constexpr,
    HAS_TIME: tl.constexpr, POS_GRAD: tl.constexpr, TIME_GRAD: tl.constexpr,
    PREC: tl.constexpr, FAST: tl.constexpr,
):  # fmt: skip
    m_blk, h, seq_start, n, C, hist_end = _sample_info(
        tl.program_id(0), num_bh, H, num_m_blocks, SeqOffsets, NumCtx, NumCand, HAS_CTX, HAS_CAND
    )
    m0 = m_blk * BLOCK_M
    if m0 < n:
        # DQ shares Q strides; DRabPos / DRabTime are contiguous fp32 [H, P] / [H, TB]
        Q += h * stride_qh
        K += h * stride_kh
        V += h * stride_vh
        DO += h * stride_doh
        DQ += h * stride_qh
        RabPos += h * stride_rp
        RabTime += h * stride_rt
        DRabPos += h * P
        DRabTime += h * TB
        offs_m = m0 + tl.arange(0, BLOCK_M)
        offs_dqk = tl.arange(0, BLOCK_DQK)
        offs_dv = tl.arange(0, BLOCK_DV)
        rows_m = seq_start + offs_m
        in_m = offs_m < n
        qmask = in_m[:, None] & (offs_dqk[None, :] < DQK)
        q = tl.load(Q + rows_m[:, None] * stride_qt + offs_dqk[None, :], mask=qmask, other=0.0)
        do = tl.load(
            DO + rows_m[:, None] * stride_dot + offs_dv[None, :],
            mask=in_m[:, None] & (offs_dv[None, :] < DV),
            other=0.0,
        )
        ts_q = 0
        if HAS_TIME:
            ts_q = tl.load(Ts + rows_m, mask=in_m, other=0)[:, None]
        dq = tl.full([BLOCK_M, BLOCK_DQK], 0.0, tl.float32)
        dtime = tl.full([BLOCK_TB], 0.0, tl.float32)
        full, hi1, lo2, hi2 = _key_ranges(m0, n, hist_end, C, BLOCK_M, BLOCK_N, HAS_CTX)
        for start_n in range(0, full, BLOCK_N):
            dq, dtime = _dq_tile(
                dq, dtime, q, do, offs_m, ts_q, start_n, K, V, Ts, RabPos, RabTime, DRabPos,
                seq_start, stride_kt, stride_vt, n, hist_end, C, P, TB, alpha, inv_norm, DQK, DV,
                BLOCK_DQK, BLOCK_DV, BLOCK_N, BLOCK_TB, HAS_CTX, HAS_POS, HAS_TIME, POS_GRAD,
                TIME_GRAD, PREC, FAST, False,
            )  # fmt: skip
        n_a = _num_blocks(full, hi1, BLOCK_N)
        n_b = _num_blocks(lo2, hi2, BLOCK_N)
        for it in range(0, n_a + n_b):
            start_n = _block_start(it, full, n_a, lo2, n_b, 0, BLOCK_N)
            dq, dtime = _dq_tile(
                dq, dtime, q, do, offs_m, ts_q, start_n, K, V, Ts, RabPos, RabTime, DRabPos,
                seq_start, stride_kt, stride_vt, n, hist_end, C, P, TB, alpha, inv_norm, DQK, DV,
                BLOCK_DQK, BLOCK_DV, BLOCK_N, BLOCK_TB, HAS_CTX, HAS_POS, HAS_TIME, POS_GRAD,
                TIME_GRAD, PREC, FAST, True,
            )  # fmt: skip
        tl.store(
            DQ + rows_m[:, None] * stride_qt + offs_dqk[None, :],
            (dq * alpha).to(DQ.dtype.element_ty),
            mask=qmask,
        )
        if TIME_GRAD:
            offs_tb = tl.arange(0, BLOCK_TB)
            tl.atomic_add(DRabTime + offs_tb, dtime, mask=offs_tb < TB, sem="relaxed")


# ----------------------------------------------------------------------------------------------
# Launch helpers
# ----------------------------------------------------------------------------------------------


# decided when the kernels were decorated (TRITON_INTERPRET=1 at import); a plain bool so that
# torch.compile can read it without tracing into the kernel object
_INTERPRET = type(_hstu_fwd_kernel).__name__ == "InterpretedFunction"


def is_interpret_mode() -> bool:
    """True when the kernels of this module were built for the Triton CPU interpreter."""
    return _INTERPRET


@dataclass(frozen=True)
class BlockSizes:
    """Tiling tunables. ``block_m``: query rows per tile, ``block_n``: key rows per tile."""

    block_m: int = 64
    block_n: int = 64
    num_warps: int = 4
    num_stages: int = 2

    def __post_init__(self) -> None:
        for name in ("block_m", "block_n"):
            val = getattr(self, name)
            if not isinstance(val, int) or val < 16 or val & (val - 1):
                raise ValueError(f"BlockSizes.{name} must be a power of two >= 16, got {val!r}")
        if not isinstance(self.num_warps, int) or self.num_warps < 1:
            raise ValueError(f"BlockSizes.num_warps must be a positive int, got {self.num_warps!r}")
        if not isinstance(self.num_stages, int) or self.num_stages < 1:
            raise ValueError(
                f"BlockSizes.num_stages must be a positive int, got {self.num_stages!r}"
            )


INTERPRET_BLOCK_SIZES = BlockSizes(16, 16, 1, 1)


@functools.cache
def default_block_sizes(
    dim: int, backward: bool, dtype: torch.dtype = torch.bfloat16
) -> BlockSizes:
    """Defaults: tiny tiles in interpret mode, H100-tuned tiles on CUDA.

    fp32 uses exact (non-tf32) dots, lowered to FMAs: small tiles keep compile times sane.
    """
    if is_interpret_mode():
        return INTERPRET_BLOCK_SIZES
    if dtype == torch.float32:
        return BlockSizes(32, 32, 4, 1) if backward else BlockSizes(64, 32, 4, 1)
    # H100, bf16, D=128, causal 4096: forward 64x64 ~280 TFLOP/s, backward 64x64 ~230 (2.5x)
    return BlockSizes(64, 64, 4, 2) if backward else BlockSizes(64, 64, 4, 3)


def _block_d(d: int) -> int:
    return max(16, triton.next_power_of_2(d))


def _precision(dtype: torch.dtype):
    if dtype == torch.bfloat16 and is_interpret_mode():
        return "upcast"
    return "ieee" if dtype == torch.float32 else None


def _device_ctx(t: torch.Tensor):
    """Make t's GPU current for the launch (Triton launches on the current device)."""
    if t.is_cuda and t.device.index != torch.cuda.current_device():
        return torch.cuda.device(t.device)
    return contextlib.nullcontext()


def _prep(seq_offsets, num_contextual, num_candidates, timestamps, rab_pos, rab_time, dummy):
    """Normalise optional integer / table inputs to what the kernels load."""
    seq_offsets = seq_offsets.to(torch.int64).contiguous()
    nc = num_contextual.to(torch.int32).contiguous() if num_contextual is not None else dummy
    nk = num_candidates.to(torch.int32).contiguous() if num_candidates is not None else dummy
    ts = timestamps.to(torch.int64).contiguous() if rab_time is not None else dummy
    rp = rab_pos.contiguous() if rab_pos is not None else dummy
    rt = rab_time.contiguous() if rab_time is not None else dummy
    return seq_offsets, nc, nk, ts, rp, rt


def _last_dim_contiguous(x: torch.Tensor) -> torch.Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()


def _common_meta(q, v, nc_, nk_, rp_, rt_, bs: BlockSizes) -> dict:
    """Constexpr / launch meta-parameters shared by the three kernels."""
    fast = q.is_cuda and q.dtype in (torch.bfloat16, torch.float16) and not is_interpret_mode()
    has_time = 0 if rt_ is None else (1 if rt_.shape[1] <= 31 else 2)
    return dict(
        DQK=q.shape[2], DV=v.shape[2], BLOCK_DQK=_block_d(q.shape[2]),
        BLOCK_DV=_block_d(v.shape[2]), BLOCK_M=bs.block_m, BLOCK_N=bs.block_n,
        HAS_CTX=nc_ is not None, HAS_CAND=nk_ is not None, HAS_POS=rp_ is not None,
        HAS_TIME=has_time, PREC=_precision(q.dtype), FAST=fast,
        num_warps=bs.num_warps, num_stages=bs.num_stages,
    )  # fmt: skip


def _fwd_impl(q, k, v, seq_offsets, max_seqlen, alpha, normalizer, nc_, nk_, ts_, rp_, rt_, bs):
    q, k, v = (_last_dim_contiguous(x) for x in (q, k, v))
    T, H, _ = q.shape
    out = torch.zeros(T, H, v.shape[2], device=q.device, dtype=q.dtype)
    B = seq_offsets.shape[0] - 1
    num_m = triton.cdiv(max_seqlen, bs.block_m)
    if B <= 0 or H == 0 or num_m == 0:
        return out
    so, nc, nk, ts, rp, rt = _prep(seq_offsets, nc_, nk_, ts_, rp_, rt_, seq_offsets)
    P = rp_.shape[1] if rp_ is not None else 1
    TB = rt_.shape[1] if rt_ is not None else 1
    with _device_ctx(q):
        _hstu_fwd_kernel[(num_m * B * H,)](
            q, k, v, out, so, nc, nk, ts, rp, rt,
            q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
            out.stride(0), out.stride(1),
            rp.stride(0) if rp_ is not None else 0, rt.stride(0) if rt_ is not None else 0,
            B * H, H, num_m, P, TB, float(alpha), 1.0 / float(normalizer),
            **_common_meta(q, v, nc_, nk_, rp_, rt_, bs),
        )  # fmt: skip
    return out


def _bwd_impl(
    grad_out, q, k, v, seq_offsets, max_seqlen, alpha, normalizer, nc_, nk_, ts_, rp_, rt_,
    need_rp, need_rt, bs,
):  # fmt: skip
    q, k, v = (x.contiguous() for x in (q, k, v))  # dq/dk/dv reuse these strides
    grad_out = _last_dim_contiguous(grad_out.to(q.dtype))
    T, H, _ = q.shape
    dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    pos_grad, time_grad = rp_ is not None and need_rp, rt_ is not None and need_rt
    f32 = dict(device=q.device, dtype=torch.float32)
    drp = torch.zeros(rp_.shape, **f32) if pos_grad else torch.empty(0, **f32)
    drt = torch.zeros(rt_.shape, **f32) if time_grad else torch.empty(0, **f32)
    B = seq_offsets.shape[0] - 1
    num_m = triton.cdiv(max_seqlen, bs.block_m)
    num_n = triton.cdiv(max_seqlen, bs.block_n)
    if B > 0 and H > 0 and num_m > 0:
        so, nc, nk, ts, rp, rt = _prep(seq_offsets, nc_, nk_, ts_, rp_, rt_, seq_offsets)
        P = rp_.shape[1] if rp_ is not None else 1
        TB = rt_.shape[1] if rt_ is not None else 1
        meta = _common_meta(q, v, nc_, nk_, rp_, rt_, bs)
        strides = (
            q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
            grad_out.stride(0), grad_out.stride(1),
            rp.stride(0) if rp_ is not None else 0, rt.stride(0) if rt_ is not None else 0,
        )  # fmt: skip
        scalars = (P, TB, float(alpha), 1.0 / float(normalizer))
        with _device_ctx(q):
            _hstu_bwd_dkdv_kernel[(num_n * B * H,)](
                q, k, v, grad_out, dk, dv, so, nc, nk, ts, rp, rt,
                *strides, B * H, H, num_n, *scalars, **meta,
            )  # fmt: skip
            _hstu_bwd_dq_kernel[(num_m * B * H,)](
                q, k, v, grad_out, dq, so, nc, nk, ts, rp, rt,
                drp if pos_grad else so, drt if time_grad else so,
                *strides, B * H, H, num_m, *scalars,
                BLOCK_TB=max(16, triton.next_power_of_2(TB)) if time_grad else 16,
                POS_GRAD=pos_grad, TIME_GRAD=time_grad, **meta,
            )  # fmt: skip
    if pos_grad:
        drp = drp.to(rp_.dtype)
    if time_grad:
        drt = drt.to(rt_.dtype)
    return dq, dk, dv, drp, drt


# ----------------------------------------------------------------------------------------------
# torch.library ops
# ----------------------------------------------------------------------------------------------


def _unpack_blocks(blocks: list[int]) -> tuple[BlockSizes, BlockSizes]:
    return BlockSizes(*blocks[:4]), BlockSizes(*blocks[4:])


@torch.library.custom_op("hstu::hstu_attention_fwd", mutates_args=())
def hstu_attention_fwd(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    seq_offsets: torch.Tensor,
    max_seqlen: int,
    alpha: float,
    normalizer: float,
    num_contextual: torch.Tensor | None,
    num_candidates: torch.Tensor | None,
    timestamps: torch.Tensor | None,
    rab_pos: torch.Tensor | None,
    rab_time: torch.Tensor | None,
    blocks: list[int],
) -> torch.Tensor:
    """Forward op. ``blocks`` = forward BlockSizes fields followed by backward ones."""
    fwd_bs, _ = _unpack_blocks(blocks)
    return _fwd_impl(q, k, v, seq_offsets, max_seqlen, alpha, normalizer, num_contextual,
                     num_candidates, timestamps, rab_pos, rab_time, fwd_bs)  # fmt: skip


@hstu_attention_fwd.register_fake
def _(q, k, v, seq_offsets, max_seqlen, alpha, normalizer, *args):
    return q.new_empty(q.shape[0], q.shape[1], v.shape[2])


@torch.library.custom_op("hstu::hstu_attention_bwd", mutates_args=())
def hstu_attention_bwd(
    grad_out: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    seq_offsets: torch.Tensor,
    max_seqlen: int,
    alpha: float,
    normalizer: float,
    num_contextual: torch.Tensor | None,
    num_candidates: torch.Tensor | None,
    timestamps: torch.Tensor | None,
    rab_pos: torch.Tensor | None,
    rab_time: torch.Tensor | None,
    need_rab_pos_grad: bool,
    need_rab_time_grad: bool,
    blocks: list[int],
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Backward op: (dq, dk, dv, d_rab_pos, d_rab_time); absent table grads are empty."""
    _, bwd_bs = _unpack_blocks(blocks)
    return _bwd_impl(grad_out, q, k, v, seq_offsets, max_seqlen, alpha, normalizer,
                     num_contextual, num_candidates, timestamps, rab_pos, rab_time,
                     need_rab_pos_grad, need_rab_time_grad, bwd_bs)  # fmt: skip


@hstu_attention_bwd.register_fake
def _(grad_out, q, k, v, seq_offsets, max_seqlen, alpha, normalizer, nc, nk, ts, rp, rt,
      need_rp, need_rt, blocks):  # fmt: skip
    drp = rp.new_empty(rp.shape) if rp is not None and need_rp else q.new_empty(0)
    drt = rt.new_empty(rt.shape) if rt is not None and need_rt else q.new_empty(0)
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v), drp, drt


def _setup_context(ctx, inputs, output):
    (q, k, v, seq_offsets, max_seqlen, alpha, normalizer, nc, nk, ts, rp, rt, blocks) = inputs
    ctx.save_for_backward(q, k, v, seq_offsets, nc, nk, ts, rp, rt)
    ctx.args = (max_seqlen, alpha, normalizer, list(blocks))


def _backward_with(bwd, ctx, grad_out):
    q, k, v, seq_offsets, nc, nk, ts, rp, rt = ctx.saved_tensors
    max_seqlen, alpha, normalizer, blocks = ctx.args
    need = ctx.needs_input_grad
    need_rp, need_rt = rp is not None and need[10], rt is not None and need[11]
    dq, dk, dv, drp, drt = bwd(
        grad_out, q, k, v, seq_offsets, max_seqlen, alpha, normalizer, nc, nk, ts, rp, rt,
        need_rp, need_rt, blocks,
    )  # fmt: skip
    return (dq, dk, dv, None, None, None, None, None, None, None,
            drp if need_rp else None, drt if need_rt else None, None)  # fmt: skip


def _backward(ctx, grad_out):
    return _backward_with(hstu_attention_bwd, ctx, grad_out)


hstu_attention_fwd.register_autograd(_backward, setup_context=_setup_context)


def _bwd_eager(*args):
    *rest, blocks = args
    return _bwd_impl(*rest, _unpack_blocks(blocks)[1])


class _EagerHstuAttention(torch.autograd.Function):
    """The op's math and autograd without the custom-op dispatch, which costs a few hundred us
    of CPU per call in eager mode; ``hstu_attention`` uses it unless torch.compile is tracing."""

    @staticmethod
    def forward(ctx, *inputs):
        *args, blocks = inputs
        out = _fwd_impl(*args, _unpack_blocks(blocks)[0])
        _setup_context(ctx, inputs, out)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        return _backward_with(_bwd_eager, ctx, grad_out)


# set to False to route eager calls through the torch.library op as well
EAGER_FAST_PATH = True


# ----------------------------------------------------------------------------------------------
# Public entry point
# ----------------------------------------------------------------------------------------------

_FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_INT_DTYPES = (torch.int32, torch.int64)


def _check_tensor(name, x, ndim, device, dtypes=None, shape=None):
    if not isinstance(x, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if x.dim() != ndim:
        raise ValueError(f"{name} must have {ndim} dims, got shape {tuple(x.shape)}")
    if x.device != device:
        raise ValueError(f"{name} is on {x.device}, expected {device} (the device of q)")
    if dtypes is not None and x.dtype not in dtypes:
        raise ValueError(f"{name} has dtype {x.dtype}, expected one of {dtypes}")
    if shape is not None:
        for axis, want in enumerate(shape):
            if want is not None and x.shape[axis] != want:
                raise ValueError(
                    f"{name} has shape {tuple(x.shape)}, expected dim {axis} to be {want}"
                )


def _validate(q, k, v, seq_offsets, max_seqlen, alpha, normalizer, nc, nk, ts, rp, rt) -> None:
    if not isinstance(q, torch.Tensor):
        raise ValueError(f"q must be a torch.Tensor, got {type(q).__name__}")
    device = q.device
    if device.type == "cuda":
        if is_interpret_mode():
            raise ValueError(
                "q is a CUDA tensor but the kernels were built with TRITON_INTERPRET=1"
            )
    elif not is_interpret_mode():
        raise ValueError(
            f"q is on {device}: the Triton kernel needs CUDA tensors "
            "(or TRITON_INTERPRET=1 set before importing triton, for CPU tensors)"
        )
    _check_tensor("q", q, 3, device, _FLOAT_DTYPES)
    T, H, D = q.shape
    _check_tensor("k", k, 3, device, (q.dtype,), (T, H, D))
    _check_tensor("v", v, 3, device, (q.dtype,), (T, H, None))
    _check_tensor("seq_offsets", seq_offsets, 1, device, _INT_DTYPES)
    if seq_offsets.shape[0] < 1:
        raise ValueError("seq_offsets must hold B + 1 >= 1 entries (a leading 0)")
    B = seq_offsets.shape[0] - 1
    if isinstance(max_seqlen, bool) or not isinstance(max_seqlen, int) or max_seqlen < 0:
        raise ValueError(f"max_seqlen must be a non-negative python int, got {max_seqlen!r}")
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not math.isfinite(alpha):
        raise ValueError(f"alpha must be a finite python float, got {alpha!r}")
    if (
        isinstance(normalizer, bool)
        or not isinstance(normalizer, (int, float))
        or not math.isfinite(normalizer)
        or normalizer == 0
    ):
        raise ValueError(f"normalizer must be a finite non-zero python float, got {normalizer!r}")
    if nc is not None:
        _check_tensor("num_contextual", nc, 1, device, _INT_DTYPES, (B,))
    if nk is not None:
        _check_tensor("num_candidates", nk, 1, device, _INT_DTYPES, (B,))
    if rp is not None:
        _check_tensor("rab_pos", rp, 2, device, _FLOAT_DTYPES, (H,))
        if rp.shape[1] < 1:
            raise ValueError("rab_pos must have at least one bucket (P >= 1)")
    if rt is not None:
        _check_tensor("rab_time", rt, 2, device, _FLOAT_DTYPES, (H,))
        if rt.shape[1] < 1:
            raise ValueError("rab_time must have at least one bucket (Tb >= 1)")
        if ts is None:
            raise ValueError("timestamps is required when rab_time is given")
    if ts is not None:
        _check_tensor("timestamps", ts, 1, device, _INT_DTYPES, (T,))


def hstu_attention(
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
    block_sizes: BlockSizes | tuple[BlockSizes, BlockSizes] | None = None,
) -> torch.Tensor:
    """Jagged HSTU attention (see ``kernels/README.md``); returns ``[T, H, Dv]`` in q's dtype.

    ``max_seqlen`` must bound every sample's length (it sizes the grid; it is not checked
    against ``seq_offsets`` to avoid a device sync).  ``block_sizes`` is one ``BlockSizes``
    for both passes or a ``(forward, backward)`` pair; ``None`` picks defaults.
    """
    _validate(q, k, v, seq_offsets, max_seqlen, alpha, normalizer, num_contextual,
              num_candidates, timestamps, rab_pos, rab_time)  # fmt: skip
    if block_sizes is None:
        fwd_bs = default_block_sizes(q.shape[2], backward=False, dtype=q.dtype)
        bwd_bs = default_block_sizes(q.shape[2], backward=True, dtype=q.dtype)
    elif isinstance(block_sizes, BlockSizes):
        fwd_bs = bwd_bs = block_sizes
    elif (
        isinstance(block_sizes, tuple)
        and len(block_sizes) == 2
        and all(isinstance(b, BlockSizes) for b in block_sizes)
    ):
        fwd_bs, bwd_bs = block_sizes
    else:
        raise ValueError(f"block_sizes must be a BlockSizes or a pair of them, got {block_sizes!r}")
    blocks = [fwd_bs.block_m, fwd_bs.block_n, fwd_bs.num_warps, fwd_bs.num_stages,
              bwd_bs.block_m, bwd_bs.block_n, bwd_bs.num_warps, bwd_bs.num_stages]  # fmt: skip
    args = (q, k, v, seq_offsets, max_seqlen, float(alpha), float(normalizer), num_contextual,
            num_candidates, timestamps if rab_time is not None else None, rab_pos, rab_time,
            blocks)  # fmt: skip
    if EAGER_FAST_PATH and not torch.compiler.is_compiling():
        return _EagerHstuAttention.apply(*args)
    return hstu_attention_fwd(*args)
