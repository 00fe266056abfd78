"""`silu(x @ weight + bias)` whose backward fuses the SiLU gradient with the bias gradient.

    pre = x @ weight.to(x.dtype) + bias.to(x.dtype)      (torch.addmm)
    y   = silu(pre)                                      (F.silu)

The forward is plain torch: one GEMM with the bias in its epilogue, one elementwise SiLU.
The point is the backward. Eager autograd runs there a SiLU-backward kernel that writes
`dpre = dy * silu'(pre)` (`[T, out]`), then, for the bias, a separate column reduction
`dpre.sum(0)` that reads the whole `[T, out]` gradient once more, and the casts of the
parameters' gradients back to fp32. Here one Triton kernel reads `dy` and `pre`, writes `dpre`
in `x`'s dtype and, in the same pass, sums its tile's columns of the (fp32, unrounded) `dpre`
into per-program partials; a second small kernel sums the partials into `dbias`, in fp32 and
in the parameter's dtype (eager sums the bf16 `dpre` into a bf16 bias gradient). The matmuls
of the input and weight gradients stay with torch (`dpre @ w.T`, `x.T @ dpre`).

One H200, 12K tokens, 1024 -> 4096, bf16 (torch.profiler, device time of the backward):
378 us eager (SiLU backward 72, `sum(0)` 41) -> 344 us (81 + 3.4 for the two kernels); at 2K
tokens 90 -> 79 us. The dpre it writes equals torch's SiLU backward's bit for bit there.

Rows are independent: padding rows of a token capacity (zero upstream gradient) give a zero
`dpre`, so they add nothing to `dweight` / `dbias` and leave `dx` of the real rows alone. The
bias gradient is summed over groups of a fixed number of rows in a fixed order, so a padded
step gets it bit for bit as the unpadded one (see `ROWS_PER_PROGRAM`). `dweight = x.T @ dpre`
is torch's GEMM over the token dim: bit for bit only where the GEMM library keeps its
summation order whatever zero rows follow (cuBLAS picks kernels by shape; MKL's fp32 GEMM
changes order past ~128 rows), otherwise equal up to rounding.

The kernels use core `tl` builtins only (`tl.full`, `tl.reduce`, `tl.exp`, no `tl.zeros`,
`tl.sum`, `tl.sigmoid`): those of `triton.language.standard` are decorated when triton is
first imported and would not run in the interpreter had that been before `TRITON_INTERPRET=1`
was set (as in `_common.py`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from torch.autograd.function import once_differentiable

from ._common import _add  # the bias gradient's combine function (standard's: see there)


@triton.jit
def _silu_bwd_kernel(
    DY, PRE, DPRE, DB_PART,
    stride_dy, stride_pre, stride_dpre, T, N,
    ROWS: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr,
    WRITE_DPRE: tl.constexpr, WRITE_DB: tl.constexpr,
):  # fmt: skip
    """Rows `[pid_r * ROWS, (pid_r + 1) * ROWS)`, columns of block `pid_n`: their
    `dpre = dy * s * (1 + pre * (1 - s))`, `s = sigmoid(pre)` in fp32 (stored in DPRE's dtype),
    and their column sums (fp32) as row `pid_r` of the bias partials `DB_PART [P, N]`.

    The rows go in slices of BLOCK_R, unrolled; the sums stay elementwise in a
    `[BLOCK_R, BLOCK_N]` accumulator until one reduction over its rows at the end (an order
    set by the constexprs alone). Offsets inside the program are int32 (`ROWS * stride` must
    stay below 2**31), the program's first row int64."""
    row0 = tl.program_id(0).to(tl.int64) * ROWS
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    cmask = cols < N
    left = T - row0  # rows of this program that exist (may be > ROWS)
    dy_ptr, pre_ptr = DY + row0 * stride_dy, PRE + row0 * stride_pre
    dpre_ptr = DPRE + row0 * stride_dpre
    acc = tl.full((BLOCK_R, BLOCK_N), 0.0, tl.float32)
    for start in tl.static_range(0, ROWS, BLOCK_R):
        r = start + tl.arange(0, BLOCK_R)
        mask = (r < left)[:, None] & cmask[None, :]
        dy = tl.load(dy_ptr + r[:, None] * stride_dy + cols[None, :], mask=mask, other=0.0)
        pre = tl.load(pre_ptr + r[:, None] * stride_pre + cols[None, :], mask=mask, other=0.0)
        pre = pre.to(tl.float32)
        s = 1.0 / (1.0 + tl.exp(-pre))
        dpre = dy.to(tl.float32) * s * (1.0 + pre * (1.0 - s))  # torch's silu_backward
        if WRITE_DPRE:
            tl.store(
                dpre_ptr + r[:, None] * stride_dpre + cols[None, :],
                dpre.to(DPRE.dtype.element_ty),
                mask=mask,
            )
        if WRITE_DB:
            acc += dpre  # masked rows / columns: dy = 0, dpre = 0
    if WRITE_DB:
        db = tl.reduce(acc, 0, _add)
        tl.store(DB_PART + tl.program_id(0).to(tl.int64) * N + cols, db, mask=cmask)


@triton.jit
def _sum_partials_kernel(DB_PART, DB, P, N, BLOCK_P: tl.constexpr, BLOCK_C: tl.constexpr):
    """Columns of block `pid` of the bias gradient: the partials `DB_PART [P, N]` summed tile
    by tile in a fixed order (rows past `P` load as zeros, as zero partials would)."""
    cols = tl.program_id(0) * BLOCK_C + tl.arange(0, BLOCK_C)
    cmask = cols < N
    acc = tl.full((BLOCK_C,), 0.0, tl.float32)
    for start in range(0, P, BLOCK_P):
        p = start + tl.arange(0, BLOCK_P)
        mask = (p < P)[:, None] & cmask[None, :]
        part = tl.load(DB_PART + p[:, None].to(tl.int64) * N + cols[None, :], mask=mask, other=0.0)
        acc += tl.reduce(part, 0, _add)
    tl.store(DB + cols, acc.to(DB.dtype.element_ty), mask=cmask)


# Rows per program of the SiLU backward. Fixed, not sized from T: the bias gradient is then
# summed over the same groups of rows, in the same order, whatever padding follows the real
# rows (padding rows, and the partials of padding-only programs, are exact zeros), so a step
# padded to a token capacity (`train.cuda_graphs`) gets bit for bit the unpadded one's.
# 128 rows x 64 columns per program, in 4 slices of 32 rows, 4 warps: the fastest of 48
# tilings (32 to 128 rows, slices of 8 to 64, 64 to 256 columns, 4 or 8 warps) on one H200 at
# 12K x 4096 bf16 (80 us, against 71 us for torch's SiLU backward alone and 68.5 us for a copy
# of two reads and one write; torch's SiLU backward and `sum(0)` together: 110 us) and at
# 2K x 4096 (15 us, against 13.5 + 10.9 us).
ROWS_PER_PROGRAM = 128
# The partials' sum: narrow column blocks, so that even a 1024-wide layer has enough programs
# to spread over a GPU's SMs (4096 wide: 256 programs), each looping over the row groups in
# tiles of `_PARTIAL_ROWS` (~2.6 us at 94 x 4096 partials on an H200).
_PARTIAL_COLS = 16
_PARTIAL_ROWS = 64


def sum_partials(parts: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """``out[c] = sum_p parts[p, c]`` for fp32 partials ``parts [P, N]`` (rows summed in a
    fixed order, in fp32, cast to ``out``'s dtype on the store); ``out`` ``[N]`` contiguous,
    e.g. a column range of a wider bias gradient. Zeros for P = 0."""
    p, n = parts.shape
    if out.shape != (n,) or out.stride() != (1,):
        raise ValueError(f"out must be a contiguous [{n}], got {tuple(out.shape)}")
    if n > 0:
        _sum_partials_kernel[(triton.cdiv(n, _PARTIAL_COLS),)](
            parts, out, p, n, BLOCK_P=_PARTIAL_ROWS, BLOCK_C=_PARTIAL_COLS
        )
    return out


def weight_grads(x, w, dpre, weight_dtype, need_x: bool, need_w: bool):
    """``(dx, dweight)`` of ``pre = x @ w + b`` from ``dpre`` (None where not needed);
    ``dweight`` in ``weight_dtype``, on CUDA from the GEMM's fp32 accumulator."""
    dx = dpre @ w.t() if need_x else None
    dweight = None
    if need_w:
        if x.is_cuda and x.dtype != weight_dtype:  # cuBLAS's accumulator, not rounded
            dweight = torch.mm(x.t(), dpre, out_dtype=weight_dtype)
        else:
            dweight = (x.t() @ dpre).to(weight_dtype)
    return dx, dweight


def _tiles(n: int) -> tuple[int, int, int]:
    """(BLOCK_R, BLOCK_N, num_warps) of the SiLU backward for `out = n`."""
    return 32, min(64, triton.next_power_of_2(n)), 4


def _rows(t: torch.Tensor) -> torch.Tensor:
    """`t` with unit column stride (a view when it already has one)."""
    return t if t.stride(-1) == 1 else t.contiguous()


def _check(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor) -> None:
    if x.dim() != 2:
        raise ValueError(f"x must be 2-D [T, in], got shape {tuple(x.shape)}")
    if weight.dim() != 2 or weight.shape[0] != x.shape[1]:
        raise ValueError(
            f"weight must be [in, out] with in = x's last dim {x.shape[1]}, "
            f"got shape {tuple(weight.shape)}"
        )
    if bias.dim() != 1 or bias.shape[0] != weight.shape[1]:
        raise ValueError(
            f"bias must be [out] with out = weight's last dim {weight.shape[1]}, "
            f"got shape {tuple(bias.shape)}"
        )
    if not x.is_floating_point():
        raise ValueError(f"x must be a floating-point tensor, got {x.dtype}")
    if weight.device != x.device or bias.device != x.device:
        raise ValueError(
            f"x, weight and bias must be on one device, got {x.device}, {weight.device}, "
            f"{bias.device}"
        )


class _LinearSiLU(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, weight_x, bias_x):
        """`weight_x`, `bias_x`: the parameters in x's dtype (the caller's, or cast here)."""
        w = weight.to(x.dtype) if weight_x is None else weight_x
        pre = torch.addmm(bias.to(x.dtype) if bias_x is None else bias_x, x, w)
        y = F.silu(pre)
        ctx.save_for_backward(x, w, pre)
        ctx.param_dtypes = weight.dtype, bias.dtype
        return y

    @staticmethod
    @once_differentiable
    def backward(ctx, dy):
        x, w, pre = ctx.saved_tensors
        need_x, need_w, need_b = ctx.needs_input_grad[:3]
        weight_dtype, bias_dtype = ctx.param_dtypes
        if not (need_x or need_w or need_b):
            return None, None, None
        t, n = pre.shape
        dy = _rows(dy)
        write_dpre = need_x or need_w
        dpre = torch.empty_like(pre) if write_dpre else pre  # not written then
        programs = triton.cdiv(t, ROWS_PER_PROGRAM)
        partials = (
            torch.empty((programs, n), dtype=torch.float32, device=pre.device)
            if need_b
            else pre  # not written then
        )
        block_r, block_n, warps = _tiles(n)
        if t > 0 and n > 0:
            _silu_bwd_kernel[(programs, triton.cdiv(n, block_n))](
                dy, pre, dpre, partials,
                dy.stride(0), pre.stride(0), dpre.stride(0), t, n,
                ROWS=ROWS_PER_PROGRAM, BLOCK_R=block_r, BLOCK_N=block_n,
                WRITE_DPRE=write_dpre, WRITE_DB=need_b, num_warps=warps,
            )  # fmt: skip
        dbias = None
        if need_b:  # no rows (P = 0): zeros
            dbias = sum_partials(partials, torch.empty(n, dtype=bias_dtype, device=pre.device))
        dx, dweight = weight_grads(x, w, dpre, weight_dtype, need_x, need_w)
        return dx, dweight, dbias, None, None


def linear_silu(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor,
    reduced: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """silu(x @ weight.to(x.dtype) + bias.to(x.dtype)), weight [in, out], bias [out] (fp32
    parameters, x [T, in] in the compute dtype, e.g. bf16); differentiable in x, weight, bias.
    `reduced`: `(weight, bias)` already in x's dtype (copies the caller made for a whole stack
    at once), the forward's GEMM operands; the gradients are still `weight`'s and `bias`'s,
    in their dtype: on CUDA the weight's from the GEMM's fp32 accumulator (`out_dtype`)."""
    _check(x, weight, bias)
    if reduced is not None and (reduced[0].shape, reduced[1].shape) != (weight.shape, bias.shape):
        raise ValueError(
            f"reduced copies of shapes {tuple(reduced[0].shape)}, {tuple(reduced[1].shape)} "
            f"for weight {tuple(weight.shape)} and bias {tuple(bias.shape)}"
        )
    weight_x, bias_x = reduced if reduced is not None else (None, None)
    return _LinearSiLU.apply(x, weight, bias, weight_x, bias_x)


def linear_silu_reference(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor):
    """The same in plain torch (what the kernel is tested against)."""
    return F.silu(torch.addmm(bias.to(x.dtype), x, weight.to(x.dtype)))
