"""Shared ``@triton.jit`` helpers of the HSTU attention kernels (see ``hstu_attention.py``).

Index math, block ranges, bias / mask evaluation and the small reductions used by the forward
(``_forward.py``) and backward (``_backward.py``) kernels.
"""

import os

import triton
import triton.language as tl

# The time bias per key tile (``_time_bias``): where the tile's pairs all fall in one bucket
# (their |t_i - t_j| range, from the two tiles' timestamp ranges, inside one bucket: far
# pairs clamped into the last one, most of a long sample's), one table entry for the tile
# instead of a bucket and a gather per pair. Off unless ``HSTU_TRITON_TIME_TILES=1`` (built,
# not yet timed on a GPU); read once, at import.
TIME_TILES = tl.constexpr(os.environ.get("HSTU_TRITON_TIME_TILES", "0") == "1")

# Local positions: ``qi`` (query) and ``kj`` (key) are broadcastable int32 index tensors inside a
# sample of length ``n``; ``hist_end = n - K``.  MASKED=False marks a tile known to be fully
# visible (no mask evaluated).  HAS_TIME is 0 (no rab_time), 1 (Tb <= 31: int32 bucket math),
# 2 (wider tables: int64 bucket math) or 3 (float64 bucket math, see ``_time_bucket``).


# Only core builtins and the jit helpers of this module are used in the kernels (no tl.zeros,
# tl.sigmoid, tl.cdiv, tl.sum, ...): those live in triton.language.standard and are decorated when
# triton.language is first imported, so if that happened before TRITON_INTERPRET=1 was set (torch
# and torchrec import triton), they would not run in the interpreter.


@triton.jit
def _cdiv(a, b):
    return (a + b - 1) // b


# The combine functions of the reductions and scans: triton.language.standard's own (the ones
# tl.sum / tl.max / tl.min / tl.cumsum pass). The kernels only hand them to tl.reduce /
# tl.associative_scan, never call them, so the decoration order above does not matter; and the
# interpreter recognises them and runs each reduction as one numpy call, where a combine function
# of ours is applied element by element in Python (seconds per reduction on 2 cores; the
# item table's row update spent ~30 s of a four-step test there). Compiled, the same `a + b`.
_add = tl.standard._sum_combine
_min = tl.standard._elementwise_min
_max = tl.standard._elementwise_max


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
    """min(floor(log2(1 + |ts_q - ts_k|)), TB - 1) (int32), exactly, from timestamps as
    ``_ts_load`` gives them.

    HAS_TIME 3: float64 timestamps relative to the launch's smallest, every pair less than 2^53
    apart (``_time_path``), so 1 + |dt| is an exact integer and the exponent field of the
    float64 is the floor of its log2: a subtract, an add (the absolute value folds into it) and
    a shift per pair. 1 and 2: int64 timestamps, integer math."""
    if HAS_TIME == 3:
        x = tl.abs(ts_q - ts_k) + 1.0
        b = (x.to(tl.int64, bitcast=True) >> 52).to(tl.int32) - 1023
    else:
        d = tl.abs(ts_q - ts_k)
        if HAS_TIME == 1:  # noqa: SIM108 (constexpr branch)
            # TB <= 31: every |dt| >= 2^30 - 1 lands in the last bucket, so clamp and go int32
            x = (tl.minimum(d, 1 << 30) + 1).to(tl.int32)
        else:
            x = d + 1
        # exponent of fp32(x); round-to-nearest may carry x up to the next power of two: undo
        b = (((x.to(tl.float32).to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127).to(x.dtype)
        b = tl.where(((b * 0 + 1) << b) > x, b - 1, b).to(tl.int32)
    return tl.minimum(b, TB - 1)


@triton.jit
def _time_path(TsRange, HAS_TIME: tl.constexpr):
    """(the launch's smallest timestamp, whether this launch's path runs). Timestamps less than
    2^53 apart take the float64 path (HAS_TIME 3), others the integer one: a time-bias call
    launches both, each of whose programs finds from ``TsRange`` (the min and the bitwise NOT
    of the max, ``_time_range_kernel``) whether it has work, without a host sync."""
    lo = tl.load(TsRange)
    span = ~tl.load(TsRange + 1) - lo
    fast = (span >= 0) & (span < 9007199254740992)
    if HAS_TIME != 3:
        fast = fast == 0
    return lo, fast


@triton.jit
def _ts_load(Ts, rows, in_rows, ts_lo, HAS_TIME: tl.constexpr):
    """Timestamps of ``rows`` as ``_time_bucket`` takes them: relative to the launch's smallest
    in float64 (HAS_TIME 3), else int64."""
    t = tl.load(Ts + rows, mask=in_rows, other=0)
    if HAS_TIME == 3:
        t = (t - ts_lo).to(tl.float64)
    return t


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
        uniform, b = _time_tile(ts_q, ts_k, TB, HAS_TIME)
        if uniform:  # (always False without TIME_TILES)
            z += tl.load(RabTime + b).to(tl.float32)
        else:
            z += tl.load(RabTime + _time_bucket(ts_q, ts_k, TB, HAS_TIME)).to(tl.float32)
    return z


@triton.jit
def _time_tile(ts_q, ts_k, TB, HAS_TIME: tl.constexpr):
    """(whether every pair of the tile of query timestamps ``ts_q [M, 1]`` and key timestamps
    ``ts_k [1, N]`` falls in one time bucket, that bucket): the buckets of the smallest and the
    largest |t_i - t_j| the two ranges allow (the bucket grows with the distance). Rows past a
    sample read timestamp 0, which only widens the range (then no claim). Without
    ``TIME_TILES``: (False, 0), nothing computed."""
    uniform = False
    b = 0
    if TIME_TILES:
        qa = _reduce_min(ts_q)
        qb = _reduce_max(ts_q)
        ka = _reduce_min(ts_k)
        kb = _reduce_max(ts_k)
        lo = tl.maximum(tl.maximum(qa - kb, ka - qb), qa * 0)  # 0 where the ranges overlap
        hi = tl.maximum(qb - ka, kb - qa)
        b = _time_bucket(lo, lo * 0, TB, HAS_TIME)
        uniform = b == _time_bucket(hi, hi * 0, TB, HAS_TIME)
    return uniform, b


@triton.jit
def _key_tile(
    q, offs_m, ts_q, ts_lo, start_n, K, V, Ts, RabPos, RabTime, seq_start, stride_kt,
    stride_vt, n, P, TB, alpha,
    DQK: tl.constexpr, DV: tl.constexpr, BLOCK_DQK: tl.constexpr, BLOCK_DV: tl.constexpr,
    BLOCK_N: tl.constexpr, HAS_POS: tl.constexpr, HAS_TIME: tl.constexpr, PREC: tl.constexpr,
    TMA: tl.constexpr,
):  # fmt: skip
    """The key block at ``start_n`` against the query tile ``q`` (the forward's and dq's inner
    step): its ``k`` and ``v`` tiles, the logits ``z`` (``_logits``), the pairs' query and key
    indices ``qi [BLOCK_M, 1]``, ``kj [1, BLOCK_N]`` and the keys' timestamps ``ts_k``."""
    offs_n = start_n + tl.arange(0, BLOCK_N)
    rows = seq_start + offs_n
    in_n = offs_n < n
    k = _load_tile(K, start_n, rows, in_n, stride_kt, DQK, BLOCK_DQK, TMA)
    v = _load_tile(V, start_n, rows, in_n, stride_vt, DV, BLOCK_DV, TMA)
    ts_k = 0
    if HAS_TIME:
        ts_k = _ts_load(Ts, rows, in_n, ts_lo, HAS_TIME)[None, :]
    qi = offs_m[:, None]
    kj = offs_n[None, :]
    s = _dot(q, tl.trans(k), PREC)
    z = _logits(s, qi, kj, ts_q, ts_k, RabPos, RabTime, P, TB, alpha, HAS_POS, HAS_TIME)
    return k, v, z, qi, kj, ts_k


@triton.jit
def _sum1(x):
    return tl.reduce(x, 0, _add)


@triton.jit
def _schedule(
    j, B, num_levels, num_halvings, SeqOffsets,
    BLOCK: tl.constexpr, BLOCK_B: tl.constexpr, KEY_MAJOR: tl.constexpr,
):  # fmt: skip
    """Schedule entry ``j`` -> (block, sample b, has work), heaviest work first, over only the
    (block, sample) pairs that hold tokens: at most ``cdiv(T, BLOCK) + B`` entries per head,
    not ``cdiv(max_seqlen, BLOCK) * B`` mostly empty ones.

    A sample of ``nb = cdiv(n, BLOCK)`` blocks has one pair per level ``0 .. nb - 1``; the
    work of level ``l`` grows with ``l`` (query block ``l`` sees ``l + 1`` key blocks; key
    block ``nb - 1 - l`` is seen by ``l + 1`` query blocks, ``KEY_MAJOR``). Pairs are ordered
    by level, highest first, then by sample; ``kernels/schedule.py`` is the reference.
    Entries past the last pair get ``valid = 0`` (nothing to do)."""
    offs = tl.arange(0, BLOCK_B)
    in_b = offs < B
    starts = tl.load(SeqOffsets + offs, mask=in_b, other=0)
    lens = (tl.load(SeqOffsets + offs + 1, mask=in_b, other=0) - starts).to(tl.int32)
    nblk = (lens + BLOCK - 1) // BLOCK
    # the lowest level whose higher levels hold at most j pairs (bisection; that count falls
    # as the level rises, and is 0 at the top level)
    lo = 0
    hi = num_levels - 1
    for _ in range(num_halvings):
        mid = (lo + hi) // 2
        go_low = _sum1(tl.maximum(nblk - 1 - mid, 0)) <= j
        hi = tl.where(go_low, mid, hi)
        lo = tl.where(go_low, lo, mid + 1)
    r = j - _sum1(tl.maximum(nblk - 1 - lo, 0))  # rank among the pairs of level lo
    has = (nblk > lo).to(tl.int32)
    valid = r < _sum1(has)
    rank = tl.associative_scan(has, 0, _add)  # inclusive: the r-th pair's sample has rank r + 1
    b = tl.where(valid, _sum1((rank <= r).to(tl.int32)), 0)
    blk = lo
    if KEY_MAJOR:
        blk = tl.where(valid, _sum1(tl.where(offs == b, nblk, 0)) - 1 - lo, 0)
    return blk, b, valid


@triton.jit
def _schedule_kernel(
    Sched, SeqOffsets, B, num_levels, num_halvings, G,
    BLOCK: tl.constexpr, BLOCK_B: tl.constexpr, KEY_MAJOR: tl.constexpr,
):  # fmt: skip
    """The schedule table of a kernel launch: entry j's block, sample and has-work flag at
    ``Sched[j]``, ``Sched[G + j]``, ``Sched[2 G + j]`` (one program per entry). Computed once
    per launch, so the attention kernels spend no registers on it (their tiles at head dim
    256 already fill the register file)."""
    j = tl.program_id(0)
    blk, b, valid = _schedule(j, B, num_levels, num_halvings, SeqOffsets, BLOCK, BLOCK_B, KEY_MAJOR)
    tl.store(Sched + j, blk)
    tl.store(Sched + G + j, b)
    tl.store(Sched + 2 * G + j, valid.to(tl.int32))


@triton.jit
def _time_range_kernel(Ts, SeqOffsets, B, TsRange, BLOCK: tl.constexpr):
    """The smallest timestamp of tokens ``[0, SeqOffsets[B])`` and the bitwise NOT of the
    largest (the order reversed without overflow), atomically min-ed into ``TsRange[0]`` and
    ``TsRange[1]`` (both set to the int64 maximum first): one program per ``BLOCK`` tokens."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    valid = offs < tl.load(SeqOffsets + B)
    t = tl.load(Ts + offs, mask=valid, other=0)
    top = 9223372036854775807
    tl.atomic_min(TsRange, tl.reduce(tl.where(valid, t, top), 0, _min), sem="relaxed")
    tl.atomic_min(TsRange + 1, tl.reduce(tl.where(valid, ~t, top), 0, _min), sem="relaxed")


@triton.jit
def _zero_tail_kernel(
    X, SeqOffsets, B, T, stride_t, stride_h, H, D,
    BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr,
):  # fmt: skip
    """Zeros in rows ``[SeqOffsets[B], T)`` of ``X [T, H, D]`` (last dim contiguous): the
    capacity padding, which no attention program writes. One program per ``BLOCK_R`` rows
    (``_zero_tail_rows``)."""
    _zero_tail_rows(X, SeqOffsets, B, T, stride_t, stride_h, H, D, tl.program_id(0), BLOCK_R,
                    BLOCK_C)  # fmt: skip


@triton.jit
def _zero_tail_rows(
    X, SeqOffsets, B, T, stride_t, stride_h, H, D, blk,
    BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr,
):  # fmt: skip
    """Zeros in the rows of block ``blk`` (rows ``[blk BLOCK_R, (blk + 1) BLOCK_R)``) of ``X
    [T, H, D]`` (last dim contiguous) that lie in ``[SeqOffsets[B], T)``; nothing for a block
    wholly below the last sample's end or a negative ``blk`` (an attention kernel's programs
    before its tail programs: ``_tail_program``)."""
    end = tl.load(SeqOffsets + B).to(tl.int32)
    r0 = blk * BLOCK_R
    if (blk >= 0) & (r0 + BLOCK_R > end):
        rows = r0 + tl.arange(0, BLOCK_R)
        keep = (rows >= end) & (rows < T)
        for c0 in range(0, H * D, BLOCK_C):
            cols = c0 + tl.arange(0, BLOCK_C)
            offs = rows[:, None] * stride_t + ((cols // D) * stride_h + cols % D)[None, :]
            zero = tl.full([BLOCK_R, BLOCK_C], 0.0, X.dtype.element_ty)
            tl.store(X + offs, zero, mask=keep[:, None] & (cols < H * D)[None, :])


@triton.jit
def _tail_program(G, H, ZERO_TAIL: tl.constexpr):
    """(pid, tail) of an attention-kernel program. With ``ZERO_TAIL`` the launch's grid holds
    programs past its ``G * H`` scheduled ones, one per block of the output's rows to zero
    (``_zero_tail_rows``): those get the last scheduled pid (its table entry is in range; the
    kernel runs no block for them) and ``tail``, their index past the scheduled ones; every
    other program its own pid and ``tail = -1``."""
    pid = tl.program_id(0)
    tail = -1
    if ZERO_TAIL:
        tail = pid - G * H
        pid = tl.minimum(pid, G * H - 1)
    return pid, tail


@triton.jit
def _entry(pid, H, G, Lead):
    """The program's (schedule entry j, head h). Programs go out in ``pid`` order: the table's
    first ``Lead`` entries (``Lead <= G``) with their heads together, then the rest head by
    head (``BlockSizes.lead``)."""
    front = pid < Lead * H
    back = pid - Lead * H
    rest = tl.maximum(G - Lead, 1)
    j = tl.where(front, pid // H, Lead + back % rest)
    h = tl.where(front, pid % H, back // rest)
    return j, h


@triton.jit
def _sample_info(
    pid, H, Sched, G, Lead, SeqOffsets, NumCtx, NumCand, HAS_CTX: tl.constexpr,
    HAS_CAND: tl.constexpr,
):  # fmt: skip
    """The program's block, head and sample (start, length n, contextual C, history end) from
    the launch's schedule table (``_entry``); ``n = 0`` for a program with nothing to do."""
    j, h = _entry(pid, H, G, Lead)
    blk = tl.load(Sched + j)
    b = tl.load(Sched + G + j)
    seq_start = tl.load(SeqOffsets + b)
    n = tl.where(
        tl.load(Sched + 2 * G + j) != 0, (tl.load(SeqOffsets + b + 1) - seq_start).to(tl.int32), 0
    )
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
def _load_rows(Ptr, rows, in_rows, stride, D: tl.constexpr, BLOCK_D: tl.constexpr):
    """Tile ``[len(rows), BLOCK_D]`` of a row-major ``[T, D]`` head slice: token rows ``rows``
    (``stride`` elements apart), zero outside ``in_rows`` and beyond column ``D``."""
    offs_d = tl.arange(0, BLOCK_D)
    return tl.load(
        Ptr + rows[:, None] * stride + offs_d[None, :],
        mask=in_rows[:, None] & (offs_d[None, :] < D),
        other=0.0,
    )


@triton.jit
def _rows_desc(Ptr, seq_start, n, stride, D: tl.constexpr, BLOCK_R: tl.constexpr,
               BLOCK_D: tl.constexpr):  # fmt: skip
    """A tensor descriptor (TMA on Hopper) over one sample's rows ``[seq_start, seq_start + n)``
    of a row-major ``[T, D]`` head slice, in tiles of ``[BLOCK_R, BLOCK_D]``: rows past ``n``
    and columns past ``D`` read as zeros, as ``_load_rows`` masks them. Made by the program
    (the launch gives Triton an allocator for the descriptors' scratch)."""
    return tl.make_tensor_descriptor(
        Ptr + seq_start * stride, shape=[n, D], strides=[stride, 1], block_shape=[BLOCK_R, BLOCK_D]
    )


@triton.jit
def _sample_sources(
    Q, K, V, DO, seq_start, n, stride_qt, stride_kt, stride_vt, stride_dot,
    DQK: tl.constexpr, DV: tl.constexpr, BLOCK_DQK: tl.constexpr, BLOCK_DV: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, TMA: tl.constexpr,
):  # fmt: skip
    """Where a backward program's tiles come from (``_load_tile``'s ``Src``): with ``TMA``
    descriptors over the sample's rows, q and dO in tiles of ``BLOCK_M`` rows and k and v of
    ``BLOCK_N`` (tiles past its end read as zeros), else the head slices themselves."""
    if TMA:
        Qs = _rows_desc(Q, seq_start, n, stride_qt, DQK, BLOCK_M, BLOCK_DQK)
        DOs = _rows_desc(DO, seq_start, n, stride_dot, DV, BLOCK_M, BLOCK_DV)
        Ks = _rows_desc(K, seq_start, n, stride_kt, DQK, BLOCK_N, BLOCK_DQK)
        Vs = _rows_desc(V, seq_start, n, stride_vt, DV, BLOCK_N, BLOCK_DV)
    else:
        Qs, Ks, Vs, DOs = Q, K, V, DO
    return Qs, Ks, Vs, DOs


@triton.jit
def _load_tile(Src, start, rows, in_rows, stride, D: tl.constexpr, BLOCK_D: tl.constexpr,
               TMA: tl.constexpr):  # fmt: skip
    """The tile of rows ``start + [0, len(rows))`` of a sample: through its descriptor
    (``TMA``, ``Src`` from ``_rows_desc``; ``start`` is the row inside the sample) or through
    pointers (``Src`` the head slice, ``rows`` the token rows, ``in_rows`` their mask)."""
    if TMA:  # noqa: SIM108 (constexpr branch)
        t = Src.load([start, 0])
    else:
        t = _load_rows(Src, rows, in_rows, stride, D, BLOCK_D)
    return t


@triton.jit
def _silu_grad_part(
    g, Pre, rows, in_rows, stride, Part, c0, seq_start, n, start, D: tl.constexpr,
    BLOCK_D: tl.constexpr, TMA: tl.constexpr,
):  # fmt: skip
    """``_silu_store_rows`` of the columns ``[c0, c0 + BLOCK_D)``: ``g`` is their tile."""
    offs_d = c0 + tl.arange(0, BLOCK_D)
    mask = in_rows[:, None] & (offs_d[None, :] < D)
    if TMA:  # a coalesced copy; pointer loads in the accumulator's layout cost ~40 us a layer
        desc = _rows_desc(Pre, seq_start, n, stride, D, g.shape[0], BLOCK_D)
        pre = desc.load([start, c0])
    else:
        pre = tl.load(Pre + rows[:, None] * stride + offs_d[None, :], mask=mask, other=0.0)
    pre = pre.to(tl.float32)
    s = 1.0 / (1.0 + tl.exp(-pre))
    g = tl.where(mask, g * s * (1.0 + pre * (1.0 - s)), 0.0)
    tl.store(Part + offs_d, tl.reduce(g, 0, _add), mask=offs_d < D)
    return g, offs_d, mask


@triton.jit
def _silu_store_rows(
    Out, g, Pre, rows, in_rows, stride_out, stride_pre, Part, seq_start, n, start,
    D: tl.constexpr, BLOCK_D: tl.constexpr, TMA: tl.constexpr,
):  # fmt: skip
    """Store ``g * silu'(pre)`` where ``_store_rows(Out, ...)`` would store ``g``: ``g`` (fp32)
    the gradient of ``silu(pre)`` at token rows ``rows`` (rows ``start + [0, len(rows))`` of
    the sample at ``seq_start`` of length ``n``) of ``Pre`` (the pre-activation, rows
    ``stride_pre`` apart), zero outside ``in_rows``; its column sums (fp32, before rounding)
    stored at ``Part[:D]`` (this program's row of the bias gradient's partials). silu'(x) =
    s (1 + x (1 - s)), s = sigmoid(x), in fp32 as torch's SiLU backward. ``TMA``: ``Pre``
    read through a descriptor. Wide tiles go in two column halves (a whole 64 x 256 tile with
    its pre-activation spilled 2 KB per thread in the dq kernel, sm_90a, and ran slower)."""
    if BLOCK_D >= 128:
        HALF: tl.constexpr = BLOCK_D // 2
        lo, hi = tl.split(tl.permute(tl.reshape(g, [g.shape[0], 2, HALF]), [0, 2, 1]))
        lo, offs, mask = _silu_grad_part(
            lo, Pre, rows, in_rows, stride_pre, Part, 0, seq_start, n, start, D, HALF, TMA
        )
        tl.store(Out + rows[:, None] * stride_out + offs[None, :],
                 lo.to(Out.dtype.element_ty), mask=mask)  # fmt: skip
        hi, offs, mask = _silu_grad_part(
            hi, Pre, rows, in_rows, stride_pre, Part, HALF, seq_start, n, start, D, HALF, TMA
        )
        tl.store(Out + rows[:, None] * stride_out + offs[None, :],
                 hi.to(Out.dtype.element_ty), mask=mask)  # fmt: skip
    else:
        g, offs, mask = _silu_grad_part(
            g, Pre, rows, in_rows, stride_pre, Part, 0, seq_start, n, start, D, BLOCK_D, TMA
        )
        tl.store(Out + rows[:, None] * stride_out + offs[None, :],
                 g.to(Out.dtype.element_ty), mask=mask)  # fmt: skip


@triton.jit
def _store_rows(Ptr, rows, in_rows, stride, val, D: tl.constexpr, BLOCK_D: tl.constexpr):
    """Write ``val`` (cast to the pointer's dtype) where ``_load_rows`` would read it."""
    offs_d = tl.arange(0, BLOCK_D)
    tl.store(
        Ptr + rows[:, None] * stride + offs_d[None, :],
        val.to(Ptr.dtype.element_ty),
        mask=in_rows[:, None] & (offs_d[None, :] < D),
    )
