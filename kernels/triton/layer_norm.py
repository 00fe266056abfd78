"""LayerNorm over the last dim, optionally times a gate or after a residual add, as one Triton
kernel each way.

    y = (x - mean) * rstd * weight + bias            (gate=None)
    y = ((x - mean) * rstd * weight + bias) * gate   (HSTU's `attn_norm(a) * u`)
    h = x + r; y = LN(h)                             (`add_layer_norm`: a residual stream's add
                                                      with the next layer's input norm)
    h = x + (r + c); y = LN(h)                       (`residual_bias=c`: the bias of the linear
                                                      that made `r`, added here)

Statistics and arithmetic in fp32 whatever `x`'s dtype; `weight` and `bias` are read in their
own dtype (the model's fp32 parameters: no cast kernels, and their gradients come back in it).
Eager torch runs this as a norm kernel, two dtype casts of the parameters, a multiply, and in
backward a second multiply, the input-gradient kernel, a weight/bias-gradient reduction and the
casts back: the fused backward reads `x`, `dy` (and `gate`) once, writes `dx` (and `dgate`),
and reduces the weight/bias gradients in per-program fp32 partials summed at the end.

With a residual the forward also writes `h` (rounded to `x`'s dtype, and normalised as rounded,
as eager torch's add then norm), and the backward adds `h`'s own upstream gradient to the
norm's: one kernel each way where eager torch runs the add, the norm, and in backward the
accumulation of the two gradients of `h`. A residual bias `c` (`[D]`, the parameter's dtype)
is added in fp32 before the one rounding of `h`; its gradient, the column sum of `h`'s whole
gradient, is summed in the same backward pass as the norm's (the linear that made `r` then
runs its GEMM without a bias, and no separate column reduction of its output gradient runs).

Rows are independent: padding rows of a token capacity (all zero, zero upstream gradient) give
a zero `dx` and add nothing to `dweight` / `dbias`, as with `F.layer_norm`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _layer_norm_fwd_kernel(
    X, R, RB, H, W, B, G, Y, MEAN, RSTD,
    stride_x, stride_r, stride_h, stride_g, stride_y, T, D, eps,
    HAS_GATE: tl.constexpr, HAS_RES: tl.constexpr, HAS_RB: tl.constexpr, BLOCK_R: tl.constexpr,
    BLOCK_D: tl.constexpr,
):  # fmt: skip
    rows = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.arange(0, BLOCK_D)
    rmask = rows < T
    mask = rmask[:, None] & (cols < D)[None, :]
    x = tl.load(X + rows[:, None] * stride_x + cols[None, :], mask=mask, other=0.0)
    if HAS_RES:  # h = x + r, stored and normalised as rounded to the stream's dtype
        r = tl.load(R + rows[:, None] * stride_r + cols[None, :], mask=mask, other=0.0)
        r = r.to(tl.float32)
        if HAS_RB:  # the residual's bias, in fp32: h is rounded once
            r += tl.load(RB + cols, mask=cols < D, other=0.0).to(tl.float32)[None, :]
        x = tl.where(mask, x.to(tl.float32) + r, 0.0).to(H.dtype.element_ty)
        tl.store(H + rows[:, None] * stride_h + cols[None, :], x, mask=mask)
    x = x.to(tl.float32)
    mean = tl.sum(x, axis=1) / D
    xc = tl.where(mask, x - mean[:, None], 0.0)
    rstd = 1.0 / tl.sqrt(tl.sum(xc * xc, axis=1) / D + eps)
    w = tl.load(W + cols, mask=cols < D, other=0.0).to(tl.float32)
    b = tl.load(B + cols, mask=cols < D, other=0.0).to(tl.float32)
    y = xc * rstd[:, None] * w[None, :] + b[None, :]
    if HAS_GATE:
        g = tl.load(G + rows[:, None] * stride_g + cols[None, :], mask=mask, other=0.0)
        y = y * g.to(tl.float32)
    tl.store(Y + rows[:, None] * stride_y + cols[None, :], y.to(Y.dtype.element_ty), mask=mask)
    tl.store(MEAN + rows, mean, mask=rmask)
    tl.store(RSTD + rows, rstd, mask=rmask)


@triton.jit
def _bwd_load(
    X, DY, G, DH, MEAN, RSTD, rows, end, cols, cmask, stride_x, stride_dy, stride_g, stride_dh,
    HAS_GATE: tl.constexpr, HAS_DH: tl.constexpr,
):  # fmt: skip
    """What the backward reads of `rows` (those at or past `end` masked off): x, dy, the gate
    and dh (x again where there is none: not read), the row statistics."""
    rmask = rows < end
    mask = rmask[:, None] & cmask[None, :]
    x = tl.load(X + rows[:, None] * stride_x + cols[None, :], mask=mask, other=0.0)
    dy = tl.load(DY + rows[:, None] * stride_dy + cols[None, :], mask=mask, other=0.0)
    g = x
    if HAS_GATE:
        g = tl.load(G + rows[:, None] * stride_g + cols[None, :], mask=mask, other=0.0)
    dh = x
    if HAS_DH:
        dh = tl.load(DH + rows[:, None] * stride_dh + cols[None, :], mask=mask, other=0.0)
    mean = tl.load(MEAN + rows, mask=rmask, other=0.0)
    rstd = tl.load(RSTD + rows, mask=rmask, other=0.0)
    return x, dy, g, dh, mean, rstd


@triton.jit
def _layer_norm_bwd_kernel(
    X, W, B, G, DY, DH, DX, DG, MEAN, RSTD, DW_PART, DB_PART, DRB_PART, DG_PART,
    stride_x, stride_g, stride_dy, stride_dh, stride_dx, stride_dg, T, D,
    HAS_GATE: tl.constexpr, HAS_DH: tl.constexpr, HAS_RB: tl.constexpr,
    GATE_SILU: tl.constexpr, ROWS: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr,
    PREFETCH: tl.constexpr = False, STAGES: tl.constexpr = 0,
):  # fmt: skip
    """Rows `[pid * ROWS, (pid + 1) * ROWS)`: their dx (and dgate), and their weight / bias
    gradient sums as row `pid` of the partials. `HAS_DH`: `X` is a residual sum `h` whose
    own upstream gradient `DH` joins the norm's (dx = dh + the norm's dx). `HAS_RB`: the
    column sums of dx (fp32, before its rounding) as row `pid` of the residual bias's.
    `GATE_SILU`: `G` holds the gate's pre-activation `p` (gate = silu(p)), and `DG` gets
    `p`'s gradient, its column sums (fp32) as row `pid` of `DG_PART`. `PREFETCH`: each slice's
    loads are issued before the previous slice's arithmetic (in registers; the last prefetch is
    masked off). `STAGES` > 0: the slice loop is software-pipelined by Triton in that many
    stages. Neither changes a value: the arithmetic and its order are the same."""
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK_D)
    cmask = cols < D
    w = tl.load(W + cols, mask=cmask, other=0.0).to(tl.float32)
    b = tl.load(B + cols, mask=cmask, other=0.0).to(tl.float32)
    dw = tl.zeros((BLOCK_D,), dtype=tl.float32)
    db = tl.zeros((BLOCK_D,), dtype=tl.float32)
    drb = tl.zeros((BLOCK_D,), dtype=tl.float32)
    dgs = tl.zeros((BLOCK_R, BLOCK_D), dtype=tl.float32)  # reduced once, after the rows
    row0 = pid.to(tl.int64) * ROWS
    end = tl.minimum(row0 + ROWS, T)
    if PREFETCH:
        nx, ndy, ng, ndh, nmean, nrstd = _bwd_load(
            X, DY, G, DH, MEAN, RSTD, row0 + tl.arange(0, BLOCK_R), end, cols, cmask,
            stride_x, stride_dy, stride_g, stride_dh, HAS_GATE, HAS_DH,
        )  # fmt: skip
    for start in tl.range(0, ROWS, BLOCK_R, num_stages=STAGES if STAGES > 0 else None):
        rows = row0 + start + tl.arange(0, BLOCK_R)
        rmask = rows < T
        mask = rmask[:, None] & cmask[None, :]
        if PREFETCH:
            x, dy, g, dh, mean, rstd = nx, ndy, ng, ndh, nmean, nrstd
            nx, ndy, ng, ndh, nmean, nrstd = _bwd_load(
                X, DY, G, DH, MEAN, RSTD, rows + BLOCK_R, end, cols, cmask,
                stride_x, stride_dy, stride_g, stride_dh, HAS_GATE, HAS_DH,
            )  # fmt: skip
        else:
            x, dy, g, dh, mean, rstd = _bwd_load(
                X, DY, G, DH, MEAN, RSTD, rows, end, cols, cmask,
                stride_x, stride_dy, stride_g, stride_dh, HAS_GATE, HAS_DH,
            )  # fmt: skip
        xhat = tl.where(mask, (x.to(tl.float32) - mean[:, None]) * rstd[:, None], 0.0)
        dn = dy.to(tl.float32)
        if HAS_GATE:
            dg = dn * (xhat * w[None, :] + b[None, :])
            g = g.to(tl.float32)
            if GATE_SILU:  # g is the pre-activation p: the gate is silu(p)
                sg = 1.0 / (1.0 + tl.exp(-g))
                dg = tl.where(mask, dg * sg * (1.0 + g * (1.0 - sg)), 0.0)
                dgs += dg
                g = g * sg
            tl.store(
                DG + rows[:, None] * stride_dg + cols[None, :],
                dg.to(DG.dtype.element_ty),
                mask=mask,
            )
            dn = dn * g
        dw += tl.sum(dn * xhat, axis=0)
        db += tl.sum(dn, axis=0)
        wdn = dn * w[None, :]
        c1 = tl.sum(xhat * wdn, axis=1) / D
        c2 = tl.sum(wdn, axis=1) / D
        dx = (wdn - (xhat * c1[:, None] + c2[:, None])) * rstd[:, None]
        if HAS_DH:
            dx += dh.to(tl.float32)
        if HAS_RB:
            drb += tl.sum(dx, axis=0)
        tl.store(
            DX + rows[:, None] * stride_dx + cols[None, :], dx.to(DX.dtype.element_ty), mask=mask
        )
    tl.store(DW_PART + pid * D + cols, dw, mask=cmask)
    tl.store(DB_PART + pid * D + cols, db, mask=cmask)
    if HAS_RB:
        tl.store(DRB_PART + pid * D + cols, drb, mask=cmask)
    if GATE_SILU:
        tl.store(DG_PART + pid * D + cols, tl.sum(dgs, axis=0), mask=cmask)


@triton.jit
def _layer_norm_sum_partials_kernel(
    DW_PART, DB_PART, DRB_PART, DW, DB, DRB, P, D,
    HAS_RB: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_C: tl.constexpr,
):  # fmt: skip
    """Column block `pid` of the weight / bias (and residual bias) gradients: the partials
    summed tile by tile in a fixed order (rows past `P` load as zeros, as zero partials
    would)."""
    cols = tl.program_id(0) * BLOCK_C + tl.arange(0, BLOCK_C)
    cmask = cols < D
    dw = tl.zeros((BLOCK_C,), dtype=tl.float32)
    db = tl.zeros((BLOCK_C,), dtype=tl.float32)
    drb = tl.zeros((BLOCK_C,), dtype=tl.float32)
    for start in range(0, P, BLOCK_P):
        p = start + tl.arange(0, BLOCK_P)
        mask = (p < P)[:, None] & cmask[None, :]
        offs = p[:, None] * D + cols[None, :]
        dw += tl.sum(tl.load(DW_PART + offs, mask=mask, other=0.0), axis=0)
        db += tl.sum(tl.load(DB_PART + offs, mask=mask, other=0.0), axis=0)
        if HAS_RB:
            drb += tl.sum(tl.load(DRB_PART + offs, mask=mask, other=0.0), axis=0)
    tl.store(DW + cols, dw.to(DW.dtype.element_ty), mask=cmask)
    tl.store(DB + cols, db.to(DB.dtype.element_ty), mask=cmask)
    if HAS_RB:
        tl.store(DRB + cols, drb.to(DRB.dtype.element_ty), mask=cmask)


# Rows per backward program. Fixed, not sized from T: the weight / bias gradient is then summed
# over the same groups of rows, in the same order, whatever padding follows the real rows
# (padding rows and the partials of padding-only programs are exact zeros), so a step padded to
# a token capacity (`train.cuda_graphs`) gets bit for bit the gradients of the unpadded one.
# 64 (was 32) with the slice loop pipelined in 3 stages: the pair of backward calls of a layer at
# 12288 x 1024 bf16 77.5 us against 93.6 on an H200 (scripts/norm_tiles.py; kernels/README.md).
ROWS_PER_PROGRAM = 64
# The partials' sum: columns per program (1024 wide: 64 programs; with 64 columns, 16 programs
# walked ~380 partial rows each at 11K tokens, 12 us per norm on an H200) and rows per tile.
_SUM_COLS, _SUM_ROWS = 16, 64
# The backward's loads: issued a slice ahead (`PREFETCH`) / Triton's pipelining of the slice loop
# in `STAGES` stages (0: none). Values are the same either way (scripts/norm_tiles.py times them).
BWD_PREFETCH, BWD_STAGES = False, 3


def _tiles(d: int) -> tuple[int, int, int]:
    block_d = triton.next_power_of_2(d)
    block_r = max(1, min(8, 4096 // block_d))  # ~4K values per tile
    warps = 4 if block_d * block_r <= 4096 else 8
    return block_r, block_d, warps


def _rows(t: torch.Tensor, d: int) -> torch.Tensor:
    """`t` as `[T, d]` with unit column stride (a view when it already is one)."""
    t = t.reshape(-1, d)
    return t if t.stride(-1) == 1 else t.contiguous()


def forward(x2, weight, bias, eps, g2=None, r2=None, y=None, rb=None):
    """The norm of `x2 [T, D]` (plus `r2` and its bias `rb` when given), times `g2` when
    given, into `y` (new when None). Returns `(y, h, mean, rstd)`: `h` the residual sum
    `x2 + r2 (+ rb)` (None without `r2`), the row statistics as the backward needs them.
    Shared by the autograd functions here and the attention op that applies its gated norm in
    place (`hstu_attention.hstu_uvqk_attention(norm=...)`)."""
    t, d = x2.shape
    if y is None:
        y = torch.empty((t, d), dtype=x2.dtype, device=x2.device)
    h = torch.empty_like(x2) if r2 is not None else None
    mean = torch.empty(t, dtype=torch.float32, device=x2.device)
    rstd = torch.empty_like(mean)
    g, r, hh = (
        (g2 if g2 is not None else x2),
        (r2 if r2 is not None else x2),
        (h if h is not None else x2),
    )
    block_r, block_d, warps = _tiles(d)
    if rb is not None and r2 is None:
        raise ValueError("a residual bias needs a residual")
    _layer_norm_fwd_kernel[(triton.cdiv(t, block_r),)](
        x2, r, rb if rb is not None else weight, hh, weight, bias, g, y, mean, rstd,
        x2.stride(0), r.stride(0), hh.stride(0), g.stride(0), y.stride(0), t, d, eps,
        HAS_GATE=g2 is not None, HAS_RES=r2 is not None, HAS_RB=rb is not None,
        BLOCK_R=block_r, BLOCK_D=block_d, num_warps=warps,
    )  # fmt: skip
    return y, h, mean, rstd


def backward(
    x2, weight, bias, mean, rstd, dy2, g2=None, dh2=None, dx=None, dg=None, rb=None,
    gate_pre=None,
):  # fmt: skip
    """The gradients of `forward`: `(dx, dgate, dweight, dbias, dresidual_bias)`. `x2` is what
    was normalised (the residual sum `h` when there was one: then `dh2`, `h`'s own upstream
    gradient, is added into dx, which is the gradient of both summands). `dx` / `dg`: where to
    write them (views with unit column stride may be strided rows, e.g. the u columns of a
    wider gradient); new when None. dgate is None without `g2`; the residual bias's gradient
    (the column sums of dx, in `rb`'s dtype) None without `rb`.

    `gate_pre`: the gate's pre-activation `p` with `g2 = silu(p)` (then `g2` itself is not
    read and may be None): dgate is `p`'s gradient, and a sixth value is returned, its
    column sums per program, fp32 `[programs, D]` (the rows of a bias gradient's partials,
    `linear_silu.sum_partials`)."""
    if gate_pre is not None:
        g2 = gate_pre
    t, d = x2.shape
    if dx is None:
        dx = torch.empty_like(x2)
    if g2 is not None and dg is None:
        dg = torch.empty((t, d), dtype=g2.dtype, device=x2.device)
    g, dgo, dh = (
        (g2 if g2 is not None else x2),
        (dg if g2 is not None else dx),
        (dh2 if dh2 is not None else dy2),
    )
    programs = triton.cdiv(t, ROWS_PER_PROGRAM)
    dw = torch.empty((programs, d), dtype=torch.float32, device=x2.device)
    db = torch.empty_like(dw)
    drb = torch.empty_like(dw) if rb is not None else dw  # not written without rb
    dgp = torch.empty_like(dw) if gate_pre is not None else dw  # nor without gate_pre
    block_r, block_d, warps = _tiles(d)
    _layer_norm_bwd_kernel[(programs,)](
        x2, weight, bias, g, dy2, dh, dx, dgo, mean, rstd, dw, db, drb, dgp,
        x2.stride(0), g.stride(0), dy2.stride(0), dh.stride(0), dx.stride(0), dgo.stride(0), t, d,
        HAS_GATE=g2 is not None, HAS_DH=dh2 is not None, HAS_RB=rb is not None,
        GATE_SILU=gate_pre is not None, ROWS=ROWS_PER_PROGRAM, BLOCK_R=block_r,
        BLOCK_D=block_d, PREFETCH=BWD_PREFETCH, STAGES=BWD_STAGES, num_warps=warps,
    )  # fmt: skip
    dweight, dbias = torch.empty_like(weight), torch.empty_like(bias)
    drbias = torch.empty_like(rb) if rb is not None else None
    _layer_norm_sum_partials_kernel[(triton.cdiv(d, _SUM_COLS),)](
        dw, db, drb, dweight, dbias, drbias if rb is not None else dbias, programs, d,
        HAS_RB=rb is not None, BLOCK_P=_SUM_ROWS, BLOCK_C=_SUM_COLS,
    )  # fmt: skip
    if gate_pre is not None:
        return dx, dg, dweight, dbias, drbias, dgp
    return dx, (dg if g2 is not None else None), dweight, dbias, drbias


class _LayerNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, gate, eps):
        d = x.shape[-1]
        x2 = _rows(x, d)
        g2 = _rows(gate, d) if gate is not None else None
        y, _, mean, rstd = forward(x2, weight, bias, eps, g2=g2)
        ctx.save_for_backward(x2, weight, bias, g2, mean, rstd)
        ctx.shape = x.shape
        return y.reshape(x.shape)

    @staticmethod
    def backward(ctx, dy):
        x2, weight, bias, g2, mean, rstd = ctx.saved_tensors
        dx, dg, dweight, dbias, _ = backward(
            x2, weight, bias, mean, rstd, _rows(dy, x2.shape[1]), g2=g2
        )
        dgate = dg.reshape(ctx.shape) if dg is not None else None
        return dx.reshape(ctx.shape), dweight, dbias, dgate, None


class _AddLayerNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, residual, weight, bias, eps, residual_bias):
        d = x.shape[-1]
        y, h, mean, rstd = forward(
            _rows(x, d), weight, bias, eps, r2=_rows(residual, d), rb=residual_bias
        )
        ctx.save_for_backward(h, weight, bias, mean, rstd, residual_bias)
        ctx.shape = x.shape
        ctx.set_materialize_grads(False)  # an unused output's gradient arrives as None
        return h.reshape(x.shape), y.reshape(x.shape)

    @staticmethod
    def backward(ctx, dh, dy):
        h, weight, bias, mean, rstd, rb = ctx.saved_tensors
        d = h.shape[1]
        if dy is None:  # only h was used downstream: its gradient passes to both summands
            drb = None
            if rb is not None and ctx.needs_input_grad[5]:
                drb = dh.reshape(-1, d).sum(0, dtype=torch.float32).to(rb.dtype)
            return dh, dh, None, None, None, drb
        dh2 = _rows(dh, d) if dh is not None else None
        dx, _, dweight, dbias, drb = backward(
            h, weight, bias, mean, rstd, _rows(dy, d), dh2=dh2, rb=rb
        )
        dx = dx.reshape(ctx.shape)
        return dx, dx, dweight, dbias, None, drb


def layer_norm(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor,
    eps: float,
    gate: torch.Tensor | None = None,
) -> torch.Tensor:
    """`F.layer_norm(x, weight, bias, eps)` over the last dim, times `gate` (same shape as `x`)
    when given; differentiable in `x`, `weight`, `bias` and `gate`."""
    if gate is not None and gate.shape != x.shape:
        raise ValueError(f"gate {tuple(gate.shape)} must have the shape of x {tuple(x.shape)}")
    return _LayerNorm.apply(x, weight, bias, gate, eps)


def add_layer_norm(
    x: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor,
    eps: float,
    residual_bias: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`(h, layer_norm(h))` with `h = x + residual (+ residual_bias)` (rounded once to `x`'s
    dtype): a residual stream's add and the next norm in one kernel each way; differentiable
    in all of them. `residual_bias` `[D]`: the bias of the linear that made `residual` (which
    then skips it), its gradient summed in the norm's backward pass."""
    if residual.shape != x.shape or residual.dtype != x.dtype:
        raise ValueError(
            f"residual {tuple(residual.shape)} {residual.dtype} must have the shape and dtype of "
            f"x {tuple(x.shape)} {x.dtype}"
        )
    if residual_bias is not None and tuple(residual_bias.shape) != (x.shape[-1],):
        raise ValueError(
            f"residual_bias {tuple(residual_bias.shape)} must be [D] = [{x.shape[-1]}]"
        )
    return _AddLayerNorm.apply(x, residual, weight, bias, eps, residual_bias)


def layer_norm_reference(x, weight, bias, eps, gate=None):
    """The same in plain torch (what the kernel is tested against)."""
    y = torch.nn.functional.layer_norm(
        x, x.shape[-1:], weight.to(x.dtype), bias.to(x.dtype), eps=eps
    )
    return y if gate is None else y * gate


def add_layer_norm_reference(x, residual, weight, bias, eps, residual_bias=None):
    """`add_layer_norm` in plain torch (the residual's bias added in fp32 or wider)."""
    if residual_bias is None:
        h = x + residual
    else:
        wide = torch.promote_types(x.dtype, torch.float32)
        h = (x.to(wide) + residual.to(wide) + residual_bias.to(wide)).to(x.dtype)
    return h, layer_norm_reference(h, weight, bias, eps)
