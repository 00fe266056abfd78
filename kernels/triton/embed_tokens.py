"""The tokens' embedding rows in the model's dtype and token order, from two fp32 sources, in
one pass each way.

The step graph (hstu/torch_backend/step_graphs.py) holds two fp32 sources per position of
the token capacity, in source order: the item table's looked-up rows (`rows [C, D]`, a leaf
whose gradient the table's row-wise AdamW reads) and the small tables' rows (`small [S, D]`,
the contextual and action tables read as one, at `small_ids`), `is_small` choosing between
them. Written with torch ops, the layer input is

    x = permute_rows(where(is_small, small[small_ids].to(bf16), rows.to(bf16)), perm, inv)

five `[C, D]` passes forward (a gather, two casts, the select, the permutation) and five back
(the permutation's gather, the select's two, the two casts). Here:

* forward, one kernel: token `t` reads its source row `perm[t]` from the source `is_small`
  picks and writes it rounded to x's dtype (as `.to` rounds);
* backward, one kernel: source row `s` reads its token's gradient (`inv[s]`), widened to fp32,
  and writes it to the gradient of the source it came from, zero in the other; the small
  table's gradient is then summed by id from its dense `[C, D]` part by torch's embedding
  backward (a sort, sums in a fixed order), as `small[small_ids]`'s own backward does.
* backward with `segments` (the step graph's case: the contextual sources are one run of the
  capacity, the action sources another, each reading its own table's rows): no dense small
  part is written and nothing is sorted. Per run, one launch sums its sources' gradients into
  its rows as one-hot matrix products (`_small_grad_kernel`: a program owns a tile of rows x
  columns and walks a share of the run's sources in order); a run of few rows (the 16 action
  rows read by ~5K tokens at batch 32) is split into up to 64 shares whose partials torch
  sums. Where torch's embedding backward took ~10 launches over all C positions, this takes
  one launch per run and one sum.

Same values as the torch ops, bit for bit (one rounding forward, exact widening back), but
the segmented small-table gradient: the same fp32 sums in another fixed order (bit for bit
where they are exact, `tests/unit/test_triton_embed_tokens.py`), deterministic run to run.
`embed_tokens_reference` is that torch form (the tests' reference, and what runs on CPU
outside the Triton interpreter).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from ._common import _dot
from ._launch import _precision

# decided when the kernels were decorated (TRITON_INTERPRET=1 at import), as in _launch.py
_INTERPRET: bool


@triton.jit
def _embed_fwd_kernel(
    X, Rows, Small, SmallIds, IsSmall, Perm, D, stride_x, stride_r, stride_s,
    BLOCK_D: tl.constexpr,
):  # fmt: skip
    t = tl.program_id(0)
    src = tl.load(Perm + t)
    small = tl.load(IsSmall + src) != 0
    row = tl.load(SmallIds + src).to(tl.int64)
    for c in range(0, D, BLOCK_D):
        cols = c + tl.arange(0, BLOCK_D)
        keep = cols < D
        if small:
            v = tl.load(Small + row * stride_s + cols, mask=keep)
        else:
            v = tl.load(Rows + src.to(tl.int64) * stride_r + cols, mask=keep)
        y = v.to(X.dtype.element_ty, fp_downcast_rounding="rtne")  # as torch rounds
        tl.store(X + t.to(tl.int64) * stride_x + cols, y, mask=keep)


@triton.jit
def _embed_bwd_kernel(
    GX, GRows, GSmall, IsSmall, Inv, D, stride_g, stride_o, DENSE_SMALL: tl.constexpr,
    BLOCK_D: tl.constexpr,
):  # fmt: skip
    s = tl.program_id(0)
    tok = tl.load(Inv + s).to(tl.int64)
    small = tl.load(IsSmall + s) != 0
    out = s.to(tl.int64) * stride_o
    for c in range(0, D, BLOCK_D):
        cols = c + tl.arange(0, BLOCK_D)
        keep = cols < D
        g = tl.load(GX + tok * stride_g + cols, mask=keep).to(tl.float32)
        zero = tl.full([BLOCK_D], 0.0, tl.float32)
        tl.store(GRows + out + cols, tl.where(small, zero, g), mask=keep)
        if DENSE_SMALL:
            tl.store(GSmall + out + cols, tl.where(small, g, zero), mask=keep)


@triton.jit
def _small_grad_kernel(
    GX, Inv, Ids, Bounds, Out, D, stride_g, stride_o, K, ROW0, ROWS, PREC: tl.constexpr,
    CHUNKS: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    """Segment `K`'s table gradient: rows `[ROW0, ROW0 + ROWS)` summed from its sources
    `[Bounds[2K], Bounds[2K + 1])`, source `s` adding token `Inv[s]`'s row of GX to row
    `Ids[s]`. A program owns `BLOCK_R` rows x `BLOCK_D` columns of one of `CHUNKS` equal shares
    of the sources and sums them in order, `BLOCK_T` at a time, as a one-hot matrix product
    (exact products, fp32 sums); it writes `Out[chunk, row, col]` (no atomics: the same bits
    every run). Core `tl` builtins only (`tl.full`, no `tl.zeros` / `tl.cdiv`), as
    linear_silu.py explains."""
    r0 = tl.program_id(0) * BLOCK_R
    c0 = tl.program_id(1) * BLOCK_D
    chunk = tl.program_id(2)
    lo = tl.load(Bounds + 2 * K)
    hi = tl.load(Bounds + 2 * K + 1)
    per = (hi - lo + CHUNKS - 1) // CHUNKS
    start = lo + chunk * per
    end = tl.minimum(start + per, hi)
    rows = r0 + tl.arange(0, BLOCK_R)
    cols = c0 + tl.arange(0, BLOCK_D)
    acc = tl.full([BLOCK_R, BLOCK_D], 0.0, tl.float32)
    for t in range(start, end, BLOCK_T):
        src = t + tl.arange(0, BLOCK_T)
        keep = src < end
        ids = tl.load(Ids + src, mask=keep, other=-1) - ROW0
        tok = tl.load(Inv + src, mask=keep, other=0).to(tl.int64)
        g = tl.load(
            GX + tok[:, None] * stride_g + cols[None, :],
            mask=keep[:, None] & (cols < D)[None, :],
            other=0.0,
        )
        # through fp32: the interpreter casts bool to bf16 as zero
        hot = tl.where(rows[:, None] == ids[None, :], 1.0, 0.0).to(g.dtype)
        acc += _dot(hot, g, PREC)
    out = Out + chunk.to(tl.int64) * ROWS * stride_o
    keep = (rows < ROWS)[:, None] & (cols < D)[None, :]
    tl.store(out + rows[:, None] * stride_o + cols[None, :], acc, mask=keep)


@triton.jit
def _source_ids_kernel(
    Src, Starts, ItemIds, Lookups, SmallIds, SmallLookups, IsSmall, C, ctx_rows,
    MARKS: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    """Positions `[pid * BLOCK, (pid + 1) * BLOCK)` of the capacity: what `source_ids` writes."""
    pos = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    inside = pos < C
    item_start, action_start = tl.load(Starts + 1), tl.load(Starts + 2)
    candidate_start, tokens = tl.load(Starts + 3), tl.load(Starts + 4)
    real = pos < tokens
    ids = tl.where(real, tl.load(Src + pos, mask=inside & real, other=0), 0)
    ctx = pos < item_start
    act = (pos >= action_start) & (pos < candidate_start)
    small = ctx | act
    tl.store(ItemIds + pos, tl.where(small, 0, ids), mask=inside)
    tl.store(Lookups + pos, tl.where(small | (pos >= tokens), -1, ids), mask=inside)
    small_ids = tl.where(ctx, ids, tl.where(act, ids + ctx_rows, 0))
    tl.store(SmallIds + pos, small_ids.to(tl.int32), mask=inside)
    if MARKS:
        tl.store(SmallLookups + pos, tl.where(small, small_ids, -1), mask=inside)
    tl.store(IsSmall + pos, small.to(tl.uint8), mask=inside)


_INTERPRET = type(_embed_fwd_kernel).__name__ == "InterpretedFunction"


def embed_tokens_reference(rows, small, small_ids, is_small, perm, inv, dtype):
    """The torch ops `embed_tokens` replaces (module docstring); `inv` unused (autograd's
    backward of the permutation adds each row into zeros)."""
    e = torch.where(is_small[:, None], F.embedding(small_ids, small).to(dtype), rows.to(dtype))
    return e.index_select(0, perm)


class _EmbedTokens(torch.autograd.Function):
    @staticmethod
    def forward(ctx, rows, small, small_ids, is_small, perm, inv, dtype, bounds, sizes):
        c, d = rows.shape
        x = torch.empty((c, d), dtype=dtype, device=rows.device)
        flags = is_small.view(torch.uint8)
        if c:
            _embed_fwd_kernel[(c,)](
                x, rows, small, small_ids, flags, perm, d, x.stride(0), rows.stride(0),
                small.stride(0), BLOCK_D=_block_d(d), num_warps=4,
            )  # fmt: skip
        ctx.save_for_backward(small_ids, flags, inv, bounds)
        ctx.num_small, ctx.sizes = small.shape[0], sizes
        return x

    @staticmethod
    def backward(ctx, gx):
        small_ids, flags, inv, bounds = ctx.saved_tensors
        gx = gx.contiguous()
        c, d = gx.shape
        dense = ctx.sizes is None  # the small tables' gradient summed from a dense [C, D] part
        g_rows = torch.empty((c, d), dtype=torch.float32, device=gx.device)
        g_small = torch.empty((c, d), dtype=torch.float32, device=gx.device) if dense else g_rows
        if c:
            _embed_bwd_kernel[(c,)](
                gx, g_rows, g_small, flags, inv, d, gx.stride(0), g_rows.stride(0),
                DENSE_SMALL=dense, BLOCK_D=_block_d(d), num_warps=4,
            )  # fmt: skip
        if dense:
            g_table = torch.ops.aten.embedding_dense_backward(
                g_small, small_ids, ctx.num_small, -1, False
            )
        else:
            g_table = _segment_sums(gx, inv, small_ids, bounds, ctx.sizes)
        return g_rows, g_table, None, None, None, None, None, None, None


# a segment's sources in shares of at least this many per program at full capacity (one share
# where its rows are many: each share writes a partial of all of them)
_SHARE = 256


def _segment_sums(gx, inv, ids, bounds, sizes) -> torch.Tensor:
    """The small tables' gradient `[sum(sizes), D]` fp32 from the tokens' gradient `gx`, one
    launch per segment (`_small_grad_kernel`), its shares' partials summed by torch where it
    has several (a fixed order: the same bits every run)."""
    c, d = gx.shape
    out = torch.empty((sum(sizes), d), dtype=torch.float32, device=gx.device)
    prec = _precision(gx.dtype)
    block_d = min(64, _block_d(d))
    row0 = 0
    for k, n in enumerate(sizes):
        block_r = 16 if n <= 16 else 32 if n <= 32 else 64
        chunks = 1 if n > 64 else max(1, min(64, c // _SHARE))
        dst = out[row0 : row0 + n]
        part = (
            dst if chunks == 1 else torch.empty((chunks, n, d), dtype=out.dtype, device=out.device)
        )
        grid = (triton.cdiv(n, block_r), triton.cdiv(d, block_d), chunks)
        if n and c:
            _small_grad_kernel[grid](
                gx, inv, ids, bounds, part, d, gx.stride(0), d, k, row0, n, PREC=prec,
                CHUNKS=chunks, BLOCK_R=block_r, BLOCK_T=64, BLOCK_D=block_d, num_warps=4,
            )  # fmt: skip
        elif n:
            part.zero_()
        if chunks > 1:
            torch.sum(part, 0, out=dst)
        row0 += n
    return out


def _check_segments(small_ids, is_small, bounds, sizes) -> None:
    """Raise unless the small sources are exactly the runs' sources, each with an id in its
    run's rows (`embed_tokens`' contract for `segments`)."""
    covered = torch.zeros_like(is_small)
    row0, b = 0, bounds.tolist()
    for k, n in enumerate(sizes):
        lo, hi = b[2 * k], b[2 * k + 1]
        if not 0 <= lo <= hi <= is_small.numel():
            raise ValueError(f"embed_tokens: run {k}'s sources [{lo}, {hi}) are not in the rows")
        ids = small_ids[lo:hi].long()
        if (
            covered[lo:hi].any()
            or not is_small[lo:hi].all()
            or not (((ids >= row0) & (ids < row0 + n)).all())
        ):
            raise ValueError(
                f"embed_tokens: run {k}'s sources [{lo}, {hi}) must be small, in no other run, "
                f"with ids in its rows [{row0}, {row0 + n})"
            )
        covered[lo:hi] = True
        row0 += n
    if (is_small & ~covered).any():
        raise ValueError("embed_tokens: a small source lies in no run of `segments`")


def _block_d(d: int) -> int:
    return min(1024, triton.next_power_of_2(max(d, 16)))


def embed_tokens(
    rows: torch.Tensor,
    small: torch.Tensor,
    small_ids: torch.Tensor,
    is_small: torch.Tensor,
    perm: torch.Tensor,
    inv: torch.Tensor,
    dtype: torch.dtype,
    segments: tuple[torch.Tensor, Sequence[int]] | None = None,
) -> torch.Tensor:
    """`x [C, D]` in `dtype`, token `t` holding source row `perm[t]`: `small[small_ids[s]]`
    where `is_small[s]`, else `rows[s]` (both fp32 `[., D]`, contiguous rows); `inv` is
    `perm`'s inverse. Differentiable in `rows` and `small`; no host synchronisation (CUDA
    graphs capture it). Outside CUDA and the Triton interpreter: the torch ops it replaces.

    `segments = (bounds, sizes)`: where the small sources lie in runs the caller knows, the
    small tables' gradient is summed run by run instead of by torch's sorted embedding
    backward over all C positions (module docstring). `bounds` (a device int tensor of `2K`
    entries, read by the kernels, so it may change between CUDA-graph replays) holds run `k`'s
    sources `[bounds[2k], bounds[2k + 1])`, and `sizes` (K ints summing to `small`'s rows) its
    rows: run `k`'s ids lie in `[sum(sizes[:k]), sum(sizes[:k + 1]))`. Every small source must
    lie in a run, and every source of a run be small with an id in its rows: checked where the
    inputs are on the CPU (ValueError), not on a GPU, where it would wait for the device (there
    a source outside the runs adds nothing)."""
    for name, t in (("rows", rows), ("small", small)):
        if t.dtype != torch.float32 or t.dim() != 2 or t.stride(-1) != 1:
            raise ValueError(f"embed_tokens: {name} must be fp32 [N, D] with contiguous rows")
    if small.shape[1] != rows.shape[1] or not (
        small_ids.shape == is_small.shape == perm.shape == inv.shape == rows.shape[:1]
    ):
        raise ValueError(
            f"embed_tokens: rows {tuple(rows.shape)}, small {tuple(small.shape)}, small_ids "
            f"{tuple(small_ids.shape)}, is_small {tuple(is_small.shape)}, perm "
            f"{tuple(perm.shape)}, inv {tuple(inv.shape)} do not agree"
        )
    if is_small.dtype != torch.bool:
        raise ValueError(f"embed_tokens: is_small must be bool, got {is_small.dtype}")
    # without segments the backward saves small_ids in bounds' place and never reads it
    bounds, sizes = segments if segments is not None else (small_ids, None)
    if sizes is not None:
        sizes = tuple(int(n) for n in sizes)
        if (
            bounds.dtype not in (torch.int32, torch.int64)
            or not bounds.is_contiguous()
            or bounds.numel() != 2 * len(sizes)
            or bounds.device != rows.device
        ):
            raise ValueError(
                f"embed_tokens: segments' bounds must be a contiguous int32 / int64 tensor of "
                f"2 x {len(sizes)} entries on {rows.device}, got {bounds.dtype} "
                f"{tuple(bounds.shape)} on {bounds.device}"
            )
        if min(sizes, default=0) < 0 or sum(sizes) != small.shape[0]:
            raise ValueError(
                f"embed_tokens: segments' sizes {sizes} must be >= 0 and sum to small's "
                f"{small.shape[0]} rows"
            )
        if not rows.is_cuda:  # on the host the runs are checked (on a GPU: a sync, so not)
            _check_segments(small_ids, is_small, bounds, sizes)
    if not (rows.is_cuda or _INTERPRET):
        return embed_tokens_reference(rows, small, small_ids, is_small, perm, inv, dtype)
    return _EmbedTokens.apply(rows, small, small_ids, is_small, perm, inv, dtype, bounds, sizes)


def source_ids_reference(src, starts, ctx_rows: int, marks: bool = True):
    """The torch ops `source_ids` replaces (its docstring): ~25 launches over the capacity."""
    pos = torch.arange(src.numel(), device=src.device)
    item_start, action_start, candidate_start, tokens = starts[1:5].unbind()
    ids = torch.where(pos < tokens, src, 0)
    ctx = pos < item_start
    act = (pos >= action_start) & (pos < candidate_start)
    small = ctx | act
    small_ids = torch.where(ctx, ids, torch.where(act, ids + ctx_rows, 0))
    return (
        torch.where(small, 0, ids),
        torch.where(small | (pos >= tokens), -1, ids),
        small_ids.to(torch.int32),
        torch.where(small, small_ids, -1) if marks else None,
        small,
    )


def source_ids(src: torch.Tensor, starts: torch.Tensor, ctx_rows: int, marks: bool = True):
    """The ids the step graph reads at each position of its token capacity, in one launch.

    `src [C]` (int64): the ids in source order, the runs contextual, item, action, candidate
    one after the other and padding past them; `starts` (int64, on src's device, read by the
    kernel, so it may change between CUDA-graph replays): the runs' starts and the token
    count, `[context_start, item_start, action_start, candidate_start, tokens, ...]`;
    `ctx_rows`: the contextual table's rows (the action table's rows follow them in the small
    tables read as one). Returns, per position:

    * `item_ids` (int64): the item table's row to read, the id at item and candidate positions,
      0 elsewhere;
    * `lookups` (int64): the same with -1 where no item is looked up (contextual, action and
      padding positions), what the table's update skips;
    * `small_ids` (int32): the small tables' row, the contextual id, or the action id past the
      contextual rows, 0 elsewhere (`embed_tokens`' small_ids);
    * `small_lookups` (int64; None unless `marks`): `small_ids` with -1 where no small table is
      read, the rows the small tables' update marks;
    * `is_small` (bool): contextual or action positions (`embed_tokens`' is_small).

    Outside CUDA and the Triton interpreter: `source_ids_reference`, the same values."""
    if src.dtype != torch.int64 or src.dim() != 1 or not src.is_contiguous():
        raise ValueError(f"source_ids: src must be a contiguous int64 vector, got {src.dtype}")
    if starts.dtype != torch.int64 or starts.numel() < 5 or starts.device != src.device:
        raise ValueError(
            f"source_ids: starts must be int64 with at least 5 entries on {src.device}, got "
            f"{starts.dtype} {tuple(starts.shape)} on {starts.device}"
        )
    if not (src.is_cuda or _INTERPRET):
        return source_ids_reference(src, starts, ctx_rows, marks)
    c = src.numel()
    item_ids, lookups = torch.empty_like(src), torch.empty_like(src)
    small_ids = torch.empty(c, dtype=torch.int32, device=src.device)
    small_lookups = torch.empty_like(src) if marks else None
    is_small = torch.empty(c, dtype=torch.bool, device=src.device)
    block = 1024
    if c:
        _source_ids_kernel[(triton.cdiv(c, block),)](
            src, starts.contiguous(), item_ids, lookups, small_ids,
            small_lookups if marks else lookups, is_small.view(torch.uint8), c, ctx_rows,
            MARKS=marks, BLOCK=block, num_warps=4,
        )  # fmt: skip
    return item_ids, lookups, small_ids, small_lookups, is_small
