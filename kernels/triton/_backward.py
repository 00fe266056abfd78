"""Backward Triton kernels of HSTU attention: ``dk``/``dv`` and ``dq`` (+ bias gradients) of the
split backward, and the fused one (``dk``/``dv`` plus ``dq`` added atomically in fp32).

Design notes in ``hstu_attention.py``.
"""

import triton
import triton.language as tl

from ._common import (
    _add,
    _block_start,
    _dot,
    _entry,
    _key_ranges,
    _key_tile,
    _load_tile,
    _logits,
    _num_blocks,
    _query_ranges,
    _reduce_max,
    _reduce_min,
    _reduce_sum,
    _rows_desc,
    _sample_info,
    _sample_sources,
    _sigmoid,
    _silu_store_rows,
    _store_rows,
    _tail_program,
    _time_bucket,
    _time_path,
    _time_tile,
    _ts_load,
    _visible,
    _zero_tail_rows,
)


@triton.jit
def _dkdv_tile(
    dk, dv, k, v, offs_n, ts_k, ts_lo, start_m, Q, DO, DQacc, DS, Ts, RabPos, RabTime, seq_start,
    stride_qt, stride_dot, stride_dqt, stride_dst, n, hist_end, C, P, TB, alpha, inv_norm,
    DQK: tl.constexpr, DV: tl.constexpr, BLOCK_DQK: tl.constexpr, BLOCK_DV: tl.constexpr,
    BLOCK_M: tl.constexpr, HAS_CTX: tl.constexpr, HAS_POS: tl.constexpr,
    HAS_TIME: tl.constexpr, PREC: tl.constexpr, FAST: tl.constexpr, MASKED: tl.constexpr,
    FUSED: tl.constexpr, STORE_DS: tl.constexpr, TMA: tl.constexpr,
):  # fmt: skip
    # transposed orientation: rows are keys, columns are queries
    offs_m = start_m + tl.arange(0, BLOCK_M)
    rows = seq_start + offs_m
    in_m = offs_m < n
    q = _load_tile(Q, start_m, rows, in_m, stride_qt, DQK, BLOCK_DQK, TMA)
    do = _load_tile(DO, start_m, rows, in_m, stride_dot, DV, BLOCK_DV, TMA)
    ts_q = 0
    if HAS_TIME:
        ts_q = _ts_load(Ts, rows, in_m, ts_lo, HAS_TIME)[None, :]
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
    ds_t = dz_t.to(q.dtype)
    dk += _dot(ds_t, q, PREC)
    if STORE_DS:
        # key-major rows of dS (``DS`` pre-offset to the head and the sample's first key row;
        # a key's row holds its queries by their index in the sample), stored as the
        # accumulator's layout holds them: the dq kernel of "stored" reads them back
        in_n = offs_n < n
        tl.store(
            DS + offs_n[:, None].to(tl.int64) * stride_dst + offs_m[None, :],
            ds_t,
            mask=in_n[:, None] & in_m[None, :],
        )
    if FUSED:
        # this tile's share of dq = dS K ([BLOCK_M, D] fp32; dz_t is 0 where masked), added to
        # the fp32 accumulator: query rows past the sample are never written
        _atomic_add_rows(DQacc, rows, in_m, stride_dqt, _dot(tl.trans(ds_t), k, PREC), DQK,
                         BLOCK_DQK)  # fmt: skip
    return dk, dv


@triton.jit
def _atomic_add_rows(Ptr, rows, in_rows, stride, val, D: tl.constexpr, BLOCK_D: tl.constexpr):
    """``tl.atomic_add`` of fp32 ``val`` where ``_store_rows`` would store it (relaxed: only the
    sum matters, read after the kernel)."""
    offs_d = tl.arange(0, BLOCK_D)
    tl.atomic_add(
        Ptr + rows[:, None] * stride + offs_d[None, :],
        val,
        mask=in_rows[:, None] & (offs_d[None, :] < D),
        sem="relaxed",
    )


@triton.jit
def _dkdv_program(
    Q, K, V, DO, DK, DVout, DQacc, DS, PreK, PreV, BPartK, BPartV, SeqOffsets, NumCtx, NumCand,
    Ts, TsRange, RabPos, RabTime,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_dot, stride_doh,
    stride_dkt, stride_dkh, stride_dvt, stride_dvh,
    stride_rp, stride_rt, stride_dqt, stride_dqh, stride_dsh, stride_dst, Sched, G, Lead, H, P,
    TB, alpha, inv_norm,
    DQK: tl.constexpr, DV: tl.constexpr, BLOCK_DQK: tl.constexpr, BLOCK_DV: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HAS_CTX: tl.constexpr,
    HAS_CAND: tl.constexpr, HAS_POS: tl.constexpr, HAS_TIME: tl.constexpr,
    PREC: tl.constexpr, FAST: tl.constexpr, FUSED: tl.constexpr, STORE_DS: tl.constexpr,
    OUT_LIKE_IN: tl.constexpr, TMA: tl.constexpr, SILU: tl.constexpr, SILU_TMA: tl.constexpr,
):  # fmt: skip
    """One key block of one sample and head: dk / dv over the query blocks that can see it,
    and with FUSED each tile's dq share added into ``DQacc`` (fp32), with STORE_DS each tile's
    dS stored into ``DS [H, T, W]`` (bf16 / fp16; ``_dkdv_tile``). ``TMA``: q, k, v and dO
    read through descriptors over the sample's rows (``_rows_desc``), else pointer tiles.
    ``SILU``: k and v are ``silu(PreK)``, ``silu(PreV)`` (laid out as K, V): dk and dv are
    stored as the gradients of the pre-activations, their column sums as the program's rows
    of the bias partials ``BPartK [G, H DQK]``, ``BPartV [G, H DV]`` (``_silu_store_rows``;
    ``SILU_TMA``: PreK / PreV read through descriptors)."""
    n_blk, h, seq_start, n, C, hist_end = _sample_info(
        tl.program_id(0), H, Sched, G, Lead, SeqOffsets, NumCtx, NumCand, HAS_CTX, HAS_CAND
    )
    ts_lo = 0
    if HAS_TIME:
        ts_lo, runs = _time_path(TsRange, HAS_TIME)
        n = tl.where(runs, n, 0)  # the other time path's launch does this program
    n0 = n_blk * BLOCK_N
    if n0 < n:
        # DK / DVout: strides of their own (columns of a caller's buffer, or contiguous), or
        # K's / V's (OUT_LIKE_IN: the same values; fewer live registers, the tiles spill less)
        if OUT_LIKE_IN:
            stride_dkt, stride_dkh = stride_kt, stride_kh
            stride_dvt, stride_dvh = stride_vt, stride_vh
        Q += h * stride_qh
        K += h * stride_kh
        V += h * stride_vh
        DO += h * stride_doh
        DK += h * stride_dkh
        DVout += h * stride_dvh
        RabPos += h * stride_rp
        RabTime += h * stride_rt
        if FUSED:
            DQacc += h * stride_dqh
        if STORE_DS:
            DS += h.to(tl.int64) * stride_dsh + seq_start.to(tl.int64) * stride_dst
        offs_n = n0 + tl.arange(0, BLOCK_N)
        rows_n = seq_start + offs_n
        in_n = offs_n < n
        Qs, Ks, Vs, DOs = _sample_sources(
            Q, K, V, DO, seq_start, n, stride_qt, stride_kt, stride_vt, stride_dot, DQK, DV,
            BLOCK_DQK, BLOCK_DV, BLOCK_M, BLOCK_N, TMA,
        )  # fmt: skip
        k = _load_tile(Ks, n0, rows_n, in_n, stride_kt, DQK, BLOCK_DQK, TMA)
        v = _load_tile(Vs, n0, rows_n, in_n, stride_vt, DV, BLOCK_DV, TMA)
        ts_k = 0
        if HAS_TIME:
            ts_k = _ts_load(Ts, rows_n, in_n, ts_lo, HAS_TIME)[:, None]
        dk = tl.full([BLOCK_N, BLOCK_DQK], 0.0, tl.float32)
        dv = tl.full([BLOCK_N, BLOCK_DV], 0.0, tl.float32)
        cfull, chi, lo, fs, fe, hi = _query_ranges(n0, n, hist_end, C, BLOCK_M, BLOCK_N, HAS_CTX)
        # fully visible query blocks: contextual [0, cfull) and [fs, fe)
        n_a = cfull // BLOCK_M
        n_b = _num_blocks(fs, fe, BLOCK_M)
        for it in range(0, n_a + n_b):
            start_m = _block_start(it, 0, n_a, fs, n_b, 0, BLOCK_M)
            dk, dv = _dkdv_tile(
                dk, dv, k, v, offs_n, ts_k, ts_lo, start_m, Qs, DOs, DQacc, DS, Ts, RabPos,
                RabTime, seq_start, stride_qt, stride_dot, stride_dqt, stride_dst, n, hist_end, C,
                P, TB, alpha, inv_norm, DQK, DV, BLOCK_DQK, BLOCK_DV, BLOCK_M, HAS_CTX, HAS_POS,
                HAS_TIME, PREC, FAST, False, FUSED, STORE_DS, TMA,
            )  # fmt: skip
        # masked: [cfull, chi), [lo, fs) around the diagonal and the tail [fe, hi)
        n_a = _num_blocks(cfull, chi, BLOCK_M)
        n_b = _num_blocks(lo, fs, BLOCK_M)
        n_c = _num_blocks(fe, hi, BLOCK_M)
        for it in range(0, n_a + n_b + n_c):
            start_m = _block_start(it, cfull, n_a, lo, n_b, fe, BLOCK_M)
            dk, dv = _dkdv_tile(
                dk, dv, k, v, offs_n, ts_k, ts_lo, start_m, Qs, DOs, DQacc, DS, Ts, RabPos,
                RabTime, seq_start, stride_qt, stride_dot, stride_dqt, stride_dst, n, hist_end, C,
                P, TB, alpha, inv_norm, DQK, DV, BLOCK_DQK, BLOCK_DV, BLOCK_M, HAS_CTX, HAS_POS,
                HAS_TIME, PREC, FAST, True, FUSED, STORE_DS, TMA,
            )  # fmt: skip
        if SILU:
            j, _ = _entry(tl.program_id(0), H, G, Lead)
            _silu_store_rows(
                DVout, dv * inv_norm, PreV + h * stride_vh, rows_n, in_n, stride_dvt, stride_vt,
                BPartV + j.to(tl.int64) * (H * DV) + h * DV, seq_start, n, n0, DV, BLOCK_DV,
                SILU_TMA,
            )  # fmt: skip
            _silu_store_rows(
                DK, dk * alpha, PreK + h * stride_kh, rows_n, in_n, stride_dkt, stride_kt,
                BPartK + j.to(tl.int64) * (H * DQK) + h * DQK, seq_start, n, n0, DQK, BLOCK_DQK,
                SILU_TMA,
            )  # fmt: skip
        else:
            _store_rows(DK, rows_n, in_n, stride_dkt, dk * alpha, DQK, BLOCK_DQK)
            _store_rows(DVout, rows_n, in_n, stride_dvt, dv * inv_norm, DV, BLOCK_DV)


@triton.jit
def _hstu_bwd_dkdv_kernel(
    Q, K, V, DO, DK, DVout, DS, PreK, PreV, BPartK, BPartV, SeqOffsets, NumCtx, NumCand, Ts,
    TsRange, RabPos, RabTime,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_dot, stride_doh,
    stride_dkt, stride_dkh, stride_dvt, stride_dvh,
    stride_rp, stride_rt, stride_dsh, stride_dst, Sched, G, Lead, H, P, TB, alpha, inv_norm,
    DQK: tl.constexpr, DV: tl.constexpr, BLOCK_DQK: tl.constexpr, BLOCK_DV: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HAS_CTX: tl.constexpr,
    HAS_CAND: tl.constexpr, HAS_POS: tl.constexpr, HAS_TIME: tl.constexpr,
    PREC: tl.constexpr, FAST: tl.constexpr, OUT_LIKE_IN: tl.constexpr, TMA: tl.constexpr,
    SILU: tl.constexpr, SILU_TMA: tl.constexpr, STORE_DS: tl.constexpr,
):  # fmt: skip
    """Split backward: dk / dv per key block (dq by ``_hstu_bwd_dq_kernel``); with
    ``STORE_DS`` ("stored") also dS into ``DS`` (dq then by ``_hstu_bwd_dq_stored_kernel``)."""
    _dkdv_program(
        Q, K, V, DO, DK, DVout, DK, DS, PreK, PreV, BPartK, BPartV, SeqOffsets, NumCtx, NumCand,
        Ts, TsRange, RabPos, RabTime,
        stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_dot, stride_doh,
        stride_dkt, stride_dkh, stride_dvt, stride_dvh, stride_rp, stride_rt, 0, 0, stride_dsh,
        stride_dst, Sched, G, Lead, H, P, TB, alpha, inv_norm, DQK, DV, BLOCK_DQK, BLOCK_DV,
        BLOCK_M, BLOCK_N, HAS_CTX, HAS_CAND, HAS_POS, HAS_TIME, PREC, FAST, False, STORE_DS,
        OUT_LIKE_IN, TMA, SILU, SILU_TMA,
    )  # fmt: skip


@triton.jit
def _hstu_bwd_fused_kernel(
    Q, K, V, DO, DK, DVout, DQacc, SeqOffsets, NumCtx, NumCand, Ts, TsRange, RabPos, RabTime,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_dot, stride_doh,
    stride_dkt, stride_dkh, stride_dvt, stride_dvh,
    stride_rp, stride_rt, stride_dqt, stride_dqh, Sched, G, Lead, H, P, TB, alpha, inv_norm,
    DQK: tl.constexpr, DV: tl.constexpr, BLOCK_DQK: tl.constexpr, BLOCK_DV: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HAS_CTX: tl.constexpr,
    HAS_CAND: tl.constexpr, HAS_POS: tl.constexpr, HAS_TIME: tl.constexpr,
    PREC: tl.constexpr, FAST: tl.constexpr, OUT_LIKE_IN: tl.constexpr, TMA: tl.constexpr,
):  # fmt: skip
    """Fused backward: dk / dv per key block as ``_hstu_bwd_dkdv_kernel``, and each tile's
    ``dS K`` atomically added into the zeroed fp32 ``DQacc`` ``[T, H, DQK]`` (unscaled: the
    launch multiplies by alpha). No bias-table gradients (the launch uses split for those)."""
    _dkdv_program(
        Q, K, V, DO, DK, DVout, DQacc, DQacc, K, V, DK, DVout, SeqOffsets, NumCtx, NumCand, Ts,
        TsRange, RabPos, RabTime,
        stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_dot, stride_doh,
        stride_dkt, stride_dkh, stride_dvt, stride_dvh, stride_rp, stride_rt, stride_dqt,
        stride_dqh, 0, 0, Sched, G, Lead, H, P, TB, alpha, inv_norm, DQK,
        DV, BLOCK_DQK, BLOCK_DV, BLOCK_M, BLOCK_N, HAS_CTX, HAS_CAND, HAS_POS, HAS_TIME, PREC,
        FAST, True, False, OUT_LIKE_IN, TMA, False, False,
    )  # fmt: skip


@triton.jit
def _pos_grad_diagonals(DRabPos, dz, d0, P, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """Adds a dq tile's ``dz`` into ``DRabPos[min(|d0 + r - c|, P - 1)]`` (row r, column c):
    each diagonal ``r - c`` summed first, so ``BLOCK_M + BLOCK_N - 1`` atomics per tile
    instead of one per pair (the per-pair atomics queue at the L2)."""
    if BLOCK_M >= BLOCK_N:
        _pos_grad_sum_diagonals(DRabPos, dz, d0, P, BLOCK_M, BLOCK_N, 2 * BLOCK_M)
    else:
        _pos_grad_sum_diagonals(DRabPos, dz, d0, P, BLOCK_M, BLOCK_N, 2 * BLOCK_N)


@triton.jit
def _pos_grad_sum_diagonals(
    DRabPos, dz, d0, P, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, W: tl.constexpr
):  # fmt: skip
    # row y of the gathered [W, BLOCK_N] tile holds diagonal r - c = y - (BLOCK_N - 1): its
    # element in column c is dz[y + c - (BLOCK_N - 1), c], zero where that row is outside
    y = tl.arange(0, W)
    r = y[:, None] + tl.arange(0, BLOCK_N)[None, :] - (BLOCK_N - 1)
    inside = (r >= 0) & (r < BLOCK_M)
    diag = tl.gather(dz, tl.minimum(tl.maximum(r, 0), BLOCK_M - 1), 0)
    sums = tl.reduce(tl.where(inside, diag, 0.0), 1, _add)
    dist = tl.minimum(tl.abs(d0 + y - (BLOCK_N - 1)), P - 1)
    tl.atomic_add(DRabPos + dist, sums, mask=y < BLOCK_M + BLOCK_N - 1, sem="relaxed")


@triton.jit
def _dq_tile(
    dq, dtime, q, do, m0, offs_m, ts_q, ts_lo, start_n, K, V, Ts, RabPos, RabTime, DRabPos,
    seq_start, stride_kt, stride_vt, n, hist_end, C, P, TB, alpha, inv_norm,
    DQK: tl.constexpr, DV: tl.constexpr, BLOCK_DQK: tl.constexpr, BLOCK_DV: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_TB: tl.constexpr,
    HAS_CTX: tl.constexpr, HAS_POS: tl.constexpr, HAS_TIME: tl.constexpr, POS_GRAD: tl.constexpr,
    TIME_GRAD: tl.constexpr, PREC: tl.constexpr, FAST: tl.constexpr, MASKED: tl.constexpr,
    TMA: tl.constexpr,
):  # fmt: skip
    k, v, z, qi, kj, ts_k = _key_tile(
        q, offs_m, ts_q, ts_lo, start_n, K, V, Ts, RabPos, RabTime, seq_start, stride_kt,
        stride_vt, n, P, TB, alpha, DQK, DV, BLOCK_DQK, BLOCK_DV, BLOCK_N, HAS_POS, HAS_TIME,
        PREC, TMA,
    )  # fmt: skip
    sig = _sigmoid(z, FAST)
    dp = _dot(do, tl.trans(v), PREC) * inv_norm
    dz = dp * sig * (1.0 + z * (1.0 - sig))
    mask = None
    if MASKED:
        mask = _visible(qi, kj, n, hist_end, C, HAS_CTX)
        dz = tl.where(mask, dz, 0.0)
    dq += _dot(dz.to(k.dtype), k, PREC)
    if POS_GRAD == 1:  # P >= max_seqlen: no pair distance is clamped into the last bucket
        pos_idx = tl.minimum(tl.abs(qi - kj), P - 1)
        tl.atomic_add(DRabPos + pos_idx, dz, mask=mask, sem="relaxed")
    if POS_GRAD >= 2:
        d0 = m0 - start_n  # i - j at the tile's corner (0, 0); r - c added per pair
        d_lo = d0 - (BLOCK_N - 1)
        d_hi = d0 + BLOCK_M - 1
        dist_min = tl.where((d_lo <= 0) & (d_hi >= 0), 0, tl.minimum(tl.abs(d_lo), tl.abs(d_hi)))
        if dist_min < P - 1:
            if POS_GRAD == 3:
                _pos_grad_diagonals(DRabPos, dz, d0, P, BLOCK_M, BLOCK_N)
            else:
                # one atomic per pair below the clamped bucket P - 1; the pairs in it summed
                # in registers and added once (per-pair atomics there would queue every
                # program on one address, 45x slower)
                pos_idx = tl.minimum(tl.abs(qi - kj), P - 1)
                near = pos_idx < P - 1
                if MASKED:
                    near = near & mask
                tl.atomic_add(DRabPos + pos_idx, dz, mask=near, sem="relaxed")
                if tl.maximum(tl.abs(d_lo), tl.abs(d_hi)) >= P - 1:
                    far = _reduce_sum(tl.where(pos_idx == P - 1, dz, 0.0))
                    tl.atomic_add(DRabPos + (P - 1), far, sem="relaxed")
        else:  # every pair in the clamped last bucket: one sum (dz is 0 where masked)
            tl.atomic_add(DRabPos + (P - 1), _reduce_sum(dz), sem="relaxed")
    if TIME_GRAD:
        uniform, b_tile = _time_tile(ts_q, ts_k, TB, HAS_TIME)
        dtime = _dq_time_grad(
            dtime, dz, mask, ts_q, ts_k, TB, uniform, b_tile, HAS_TIME, MASKED, BLOCK_TB,
            TIME_GRAD,
        )  # fmt: skip
    return dq, dtime


@triton.jit
def _dq_time_grad(
    dtime, dz, mask, ts_q, ts_k, TB, uniform, b_tile, HAS_TIME: tl.constexpr,
    MASKED: tl.constexpr, BLOCK_TB: tl.constexpr, TIME_GRAD: tl.constexpr,
):  # fmt: skip
    """The time table's gradient of one tile added into ``dtime`` (``dz`` is 0 where masked):
    the whole tile's sum into one bucket where ``_time_tile`` found one (``uniform``), else
    a sum per bucket the tile holds."""
    if uniform:
        if TIME_GRAD == 2:
            col = tl.arange(0, BLOCK_TB)[None, :]
            part = tl.reduce(dz, 1, _add)
            dtime = tl.where(col == b_tile, dtime + part[:, None], dtime)
        else:
            offs_tb = tl.arange(0, BLOCK_TB)
            dtime += tl.where(offs_tb == b_tile, _reduce_sum(dz), 0.0)
    else:
        # few distinct buckets per tile: each summed in registers, no contended atomics
        tb = _time_bucket(ts_q, ts_k, TB, HAS_TIME)
        if MASKED:
            lo_b = _reduce_min(tl.where(mask, tb, BLOCK_TB))
            hi_b = _reduce_max(tl.where(mask, tb, -1))
        else:
            lo_b = _reduce_min(tb)
            hi_b = _reduce_max(tb)
        if TIME_GRAD == 2:
            # a row sum per bucket (within each warp) into the bucket's column of a
            # [BLOCK_M, BLOCK_TB] accumulator, summed across rows once per program
            col = tl.arange(0, BLOCK_TB)[None, :]
            for t in range(lo_b, hi_b + 1):
                part = tl.reduce(tl.where(tb == t, dz, 0.0), 1, _add)
                dtime = tl.where(col == t, dtime + part[:, None], dtime)
        else:  # a CTA-wide sum per bucket into a [BLOCK_TB] vector: fewer registers
            offs_tb = tl.arange(0, BLOCK_TB)
            for t in range(lo_b, hi_b + 1):
                part = _reduce_sum(tl.where(tb == t, dz, 0.0))
                dtime += tl.where(offs_tb == t, part, 0.0)
    return dtime


@triton.jit
def _store_dq(
    DQ, dq, PreQ, BPart, rows_m, in_m, stride_dqt, stride_qt, seq_start, n, m0, h, G, Lead, H,
    DQK: tl.constexpr, BLOCK_DQK: tl.constexpr, SILU: tl.constexpr, SILU_TMA: tl.constexpr,
):  # fmt: skip
    """A dq program's scaled tile stored: as is, or (``SILU``) as the gradient of q's
    pre-activation ``PreQ`` (pre-offset to the head) with its column sums into the program's
    row of the bias partials ``BPart [G, H DQK]``."""
    if SILU:
        j, _ = _entry(tl.program_id(0), H, G, Lead)
        _silu_store_rows(
            DQ, dq, PreQ, rows_m, in_m, stride_dqt, stride_qt,
            BPart + j.to(tl.int64) * (H * DQK) + h * DQK, seq_start, n, m0, DQK, BLOCK_DQK,
            SILU_TMA,
        )  # fmt: skip
    else:
        _store_rows(DQ, rows_m, in_m, stride_dqt, dq, DQK, BLOCK_DQK)


@triton.jit
def _hstu_bwd_dq_kernel(
    Q, K, V, DO, DQ, PreQ, BPart, SeqOffsets, NumCtx, NumCand, Ts, TsRange, RabPos, RabTime,
    DRabPos, DRabTime,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_dot, stride_doh,
    stride_dqt, stride_dqh, stride_rp, stride_rt, Sched, G, Lead, H, P, TB, alpha, inv_norm,
    Zero, stride_zt, stride_zh, ZH, ZD, B, T,
    DQK: tl.constexpr, DV: tl.constexpr, BLOCK_DQK: tl.constexpr, BLOCK_DV: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_TB: tl.constexpr,
    HAS_CTX: tl.constexpr, HAS_CAND: tl.constexpr, HAS_POS: tl.constexpr,
    HAS_TIME: tl.constexpr, POS_GRAD: tl.constexpr, TIME_GRAD: tl.constexpr,
    PREC: tl.constexpr, FAST: tl.constexpr, OUT_LIKE_IN: tl.constexpr, TMA: tl.constexpr,
    SILU: tl.constexpr, SILU_TMA: tl.constexpr, ZERO_TAIL: tl.constexpr,
    TAIL_ROWS: tl.constexpr, TAIL_COLS: tl.constexpr,
):  # fmt: skip
    """dq per query block (and the bias tables' gradients). ``SILU``: q is ``silu(PreQ)``
    (laid out as Q): dq is stored as the pre-activation's gradient, its column sums as the
    program's row of the bias partials ``BPart [G, H DQK]`` (``_silu_store_rows``; ``SILU_TMA``:
    PreQ read through a descriptor). ``ZERO_TAIL``: the programs past the scheduled ``G * H``
    zero the rows past the last sample (``B`` samples, ``T`` rows) of ``Zero [T, ZH, ZD]``,
    the gradients' capacity padding (``_zero_tail_rows``)."""
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
        # DQ: strides of its own, or Q's (OUT_LIKE_IN); DRabPos / DRabTime are contiguous fp32
        # [H, P] / [H, TB]
        if OUT_LIKE_IN:
            stride_dqt, stride_dqh = stride_qt, stride_qh
        Q += h * stride_qh
        K += h * stride_kh
        V += h * stride_vh
        DO += h * stride_doh
        DQ += h * stride_dqh
        RabPos += h * stride_rp
        RabTime += h * stride_rt
        DRabPos += h * P
        DRabTime += h * TB
        offs_m = m0 + tl.arange(0, BLOCK_M)
        rows_m = seq_start + offs_m
        in_m = offs_m < n
        # the tiles' sources: the sample's rows through descriptors (tiles past its end read
        # as zeros), or the head slices
        Qs, Ks, Vs, DOs = _sample_sources(
            Q, K, V, DO, seq_start, n, stride_qt, stride_kt, stride_vt, stride_dot, DQK, DV,
            BLOCK_DQK, BLOCK_DV, BLOCK_M, BLOCK_N, TMA,
        )  # fmt: skip
        q = _load_tile(Qs, m0, rows_m, in_m, stride_qt, DQK, BLOCK_DQK, TMA)
        do = _load_tile(DOs, m0, rows_m, in_m, stride_dot, DV, BLOCK_DV, TMA)
        ts_q = 0
        if HAS_TIME:
            ts_q = _ts_load(Ts, rows_m, in_m, ts_lo, HAS_TIME)[:, None]
        dq = tl.full([BLOCK_M, BLOCK_DQK], 0.0, tl.float32)
        if TIME_GRAD == 2:
            dtime = tl.full([BLOCK_M, BLOCK_TB], 0.0, tl.float32)
        else:
            dtime = tl.full([BLOCK_TB], 0.0, tl.float32)
        full, hi1, lo2, hi2 = _key_ranges(m0, n, hist_end, C, BLOCK_M, BLOCK_N, HAS_CTX)
        for start_n in range(0, full, BLOCK_N):
            dq, dtime = _dq_tile(
                dq, dtime, q, do, m0, offs_m, ts_q, ts_lo, start_n, Ks, Vs, Ts, RabPos, RabTime,
                DRabPos, seq_start, stride_kt, stride_vt, n, hist_end, C, P, TB, alpha, inv_norm,
                DQK, DV, BLOCK_DQK, BLOCK_DV, BLOCK_M, BLOCK_N, BLOCK_TB, HAS_CTX, HAS_POS,
                HAS_TIME, POS_GRAD, TIME_GRAD, PREC, FAST, False, TMA,
            )  # fmt: skip
        n_a = _num_blocks(full, hi1, BLOCK_N)
        n_b = _num_blocks(lo2, hi2, BLOCK_N)
        for it in range(0, n_a + n_b):
            start_n = _block_start(it, full, n_a, lo2, n_b, 0, BLOCK_N)
            dq, dtime = _dq_tile(
                dq, dtime, q, do, m0, offs_m, ts_q, ts_lo, start_n, Ks, Vs, Ts, RabPos, RabTime,
                DRabPos, seq_start, stride_kt, stride_vt, n, hist_end, C, P, TB, alpha, inv_norm,
                DQK, DV, BLOCK_DQK, BLOCK_DV, BLOCK_M, BLOCK_N, BLOCK_TB, HAS_CTX, HAS_POS,
                HAS_TIME, POS_GRAD, TIME_GRAD, PREC, FAST, True, TMA,
            )  # fmt: skip
        _store_dq(
            DQ, dq * alpha, PreQ + h * stride_qh, BPart, rows_m, in_m, stride_dqt, stride_qt,
            seq_start, n, m0, h, G, Lead, H, DQK, BLOCK_DQK, SILU, SILU_TMA,
        )  # fmt: skip
        if TIME_GRAD:
            offs_tb = tl.arange(0, BLOCK_TB)
            if TIME_GRAD == 2:
                dtime = tl.reduce(dtime, 0, _add)
            tl.atomic_add(DRabTime + offs_tb, dtime, mask=offs_tb < TB, sem="relaxed")
    if ZERO_TAIL:
        _zero_tail_rows(Zero, SeqOffsets, B, T, stride_zt, stride_zh, ZH, ZD, tail, TAIL_ROWS,
                        TAIL_COLS)  # fmt: skip


@triton.jit
def _dq_stored_tile(
    dq, DSs, Ks, m0, offs_m, in_m, start_n, seq_start, stride_kt, stride_dst, n, hist_end, C,
    DQK: tl.constexpr, BLOCK_DQK: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    HAS_CTX: tl.constexpr, PREC: tl.constexpr, MASKED: tl.constexpr, TMA: tl.constexpr,
):  # fmt: skip
    offs_n = start_n + tl.arange(0, BLOCK_N)
    in_n = offs_n < n
    k = _load_tile(Ks, start_n, seq_start + offs_n, in_n, stride_kt, DQK, BLOCK_DQK, TMA)
    # dS^T: the keys' rows, the block's queries (``_dkdv_tile`` stored it so)
    if TMA:
        ds_t = DSs.load([start_n, m0])  # rows / columns past n read as zeros
    else:
        ds_t = tl.load(
            DSs + offs_n[:, None].to(tl.int64) * stride_dst + offs_m[None, :],
            mask=in_n[:, None] & in_m[None, :],
            other=0.0,
        )
    if MASKED:
        # where the dk/dv kernel stored nothing (pairs it skipped, all masked) the buffer
        # holds anything, NaN included: select, do not multiply
        ds_t = tl.where(_visible(offs_m[None, :], offs_n[:, None], n, hist_end, C, HAS_CTX),
                        ds_t, 0.0)  # fmt: skip
    dq += _dot(tl.trans(ds_t), k, PREC)
    return dq


@triton.jit
def _hstu_bwd_dq_stored_kernel(
    Q, K, DS, DQ, PreQ, BPart, SeqOffsets, NumCtx, NumCand,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_dqt, stride_dqh, stride_dsh, stride_dst,
    Sched, G, Lead, H, alpha, Zero, stride_zt, stride_zh, ZH, ZD, B, T,
    DQK: tl.constexpr, BLOCK_DQK: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    HAS_CTX: tl.constexpr, HAS_CAND: tl.constexpr, PREC: tl.constexpr,
    OUT_LIKE_IN: tl.constexpr, TMA: tl.constexpr, SILU: tl.constexpr, SILU_TMA: tl.constexpr,
    ZERO_TAIL: tl.constexpr, TAIL_ROWS: tl.constexpr, TAIL_COLS: tl.constexpr,
):  # fmt: skip
    """dq per query block from the dS the dk/dv kernel stored (``STORE_DS``): ``dq = alpha dS
    K``, one matmul per tile pair instead of the split dq kernel's three (no scores, no dP, no
    SiLU recomputed). The same blocks and masks as ``_hstu_bwd_dq_kernel``; no bias-table
    gradients ("stored" runs split where one is needed). ``SILU`` / ``SILU_TMA`` and
    ``ZERO_TAIL`` as there."""
    pid, tail = _tail_program(G, H, ZERO_TAIL)
    m_blk, h, seq_start, n, C, hist_end = _sample_info(
        pid, H, Sched, G, Lead, SeqOffsets, NumCtx, NumCand, HAS_CTX, HAS_CAND
    )
    n = tl.where(tail < 0, n, 0)  # a tail program: no query block
    m0 = m_blk * BLOCK_M
    if m0 < n:
        if OUT_LIKE_IN:
            stride_dqt, stride_dqh = stride_qt, stride_qh
        K += h * stride_kh
        DQ += h * stride_dqh
        DS += h.to(tl.int64) * stride_dsh + seq_start.to(tl.int64) * stride_dst
        offs_m = m0 + tl.arange(0, BLOCK_M)
        rows_m = seq_start + offs_m
        in_m = offs_m < n
        if TMA:
            Ks = _rows_desc(K, seq_start, n, stride_kt, DQK, BLOCK_N, BLOCK_DQK)
            DSs = tl.make_tensor_descriptor(
                DS, shape=[n, n], strides=[stride_dst, 1], block_shape=[BLOCK_N, BLOCK_M]
            )
        else:
            Ks, DSs = K, DS
        dq = tl.full([BLOCK_M, BLOCK_DQK], 0.0, tl.float32)
        full, hi1, lo2, hi2 = _key_ranges(m0, n, hist_end, C, BLOCK_M, BLOCK_N, HAS_CTX)
        for start_n in range(0, full, BLOCK_N):
            dq = _dq_stored_tile(
                dq, DSs, Ks, m0, offs_m, in_m, start_n, seq_start, stride_kt, stride_dst, n,
                hist_end, C, DQK, BLOCK_DQK, BLOCK_M, BLOCK_N, HAS_CTX, PREC, False, TMA,
            )  # fmt: skip
        n_a = _num_blocks(full, hi1, BLOCK_N)
        n_b = _num_blocks(lo2, hi2, BLOCK_N)
        for it in range(0, n_a + n_b):
            start_n = _block_start(it, full, n_a, lo2, n_b, 0, BLOCK_N)
            dq = _dq_stored_tile(
                dq, DSs, Ks, m0, offs_m, in_m, start_n, seq_start, stride_kt, stride_dst, n,
                hist_end, C, DQK, BLOCK_DQK, BLOCK_M, BLOCK_N, HAS_CTX, PREC, True, TMA,
            )  # fmt: skip
        _store_dq(
            DQ, dq * alpha, PreQ + h * stride_qh, BPart, rows_m, in_m, stride_dqt, stride_qt,
            seq_start, n, m0, h, G, Lead, H, DQK, BLOCK_DQK, SILU, SILU_TMA,
        )  # fmt: skip
    if ZERO_TAIL:
        _zero_tail_rows(Zero, SeqOffsets, B, T, stride_zt, stride_zh, ZH, ZD, tail, TAIL_ROWS,
                        TAIL_COLS)  # fmt: skip
