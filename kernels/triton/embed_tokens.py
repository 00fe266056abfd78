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

Same values as the torch ops, bit for bit (one rounding forward, exact widening back).
`embed_tokens_reference` is that torch form (the tests' reference, and what runs on CPU
outside the Triton interpreter).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

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
    GX, GRows, GSmall, IsSmall, Inv, D, stride_g, stride_o, BLOCK_D: tl.constexpr
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
        tl.store(GSmall + out + cols, tl.where(small, g, zero), mask=keep)


_INTERPRET = type(_embed_fwd_kernel).__name__ == "InterpretedFunction"


def embed_tokens_reference(rows, small, small_ids, is_small, perm, inv, dtype):
    """The torch ops `embed_tokens` replaces (module docstring); `inv` unused (autograd's
    backward of the permutation adds each row into zeros)."""
    e = torch.where(is_small[:, None], F.embedding(small_ids, small).to(dtype), rows.to(dtype))
    return e.index_select(0, perm)


class _EmbedTokens(torch.autograd.Function):
    @staticmethod
    def forward(ctx, rows, small, small_ids, is_small, perm, inv, dtype):
        c, d = rows.shape
        x = torch.empty((c, d), dtype=dtype, device=rows.device)
        flags = is_small.view(torch.uint8)
        if c:
            _embed_fwd_kernel[(c,)](
                x, rows, small, small_ids, flags, perm, d, x.stride(0), rows.stride(0),
                small.stride(0), BLOCK_D=_block_d(d), num_warps=4,
            )  # fmt: skip
        ctx.save_for_backward(small_ids, flags, inv)
        ctx.num_small = small.shape[0]
        return x

    @staticmethod
    def backward(ctx, gx):
        small_ids, flags, inv = ctx.saved_tensors
        gx = gx.contiguous()
        c, d = gx.shape
        g_rows = torch.empty((c, d), dtype=torch.float32, device=gx.device)
        g_small = torch.empty((c, d), dtype=torch.float32, device=gx.device)
        if c:
            _embed_bwd_kernel[(c,)](
                gx, g_rows, g_small, flags, inv, d, gx.stride(0), g_rows.stride(0),
                BLOCK_D=_block_d(d), num_warps=4,
            )  # fmt: skip
        g_table = torch.ops.aten.embedding_dense_backward(
            g_small, small_ids, ctx.num_small, -1, False
        )
        return g_rows, g_table, None, None, None, None, None


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
) -> torch.Tensor:
    """`x [C, D]` in `dtype`, token `t` holding source row `perm[t]`: `small[small_ids[s]]`
    where `is_small[s]`, else `rows[s]` (both fp32 `[., D]`, contiguous rows); `inv` is
    `perm`'s inverse. Differentiable in `rows` and `small`; no host synchronisation (CUDA
    graphs capture it). Outside CUDA and the Triton interpreter: the torch ops it replaces."""
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
    if not (rows.is_cuda or _INTERPRET):
        return embed_tokens_reference(rows, small, small_ids, is_small, perm, inv, dtype)
    return _EmbedTokens.apply(rows, small, small_ids, is_small, perm, inv, dtype)
