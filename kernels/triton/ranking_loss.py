"""The ranking loss over a step graph's padded loss rows, one launch each way.

    loss = sum over rows r < num_real, tasks t of BCE(logits[r, t], bit t of label_bits[r])
           / max(loss_tokens, 1)

with `BCE(x, y) = (1 - y) x - log_sigmoid(x)`, torch's `binary_cross_entropy_with_logits`.
The torch step graph (hstu/torch_backend/step_graphs.py) holds its loss rows at a capacity
(`loss_rows`, the rows past `num_real` padding) and the counts on the device (they change
between replays): written with torch ops, the labels from the bits, the BCE, the padding's
mask, the sum and the division are ~15 launches of a few microseconds forward and ~10 back,
over a few thousand values. Here the forward is one program summing every term in a fixed
order (deterministic, whatever the padding: padded terms are skipped, not added as zeros)
and the backward one elementwise launch, `(sigmoid(x) - y) * grad / max(loss_tokens, 1)` on
the real rows and zero on the padding.

Core `tl` builtins only (see linear_silu.py): `tl.reduce` with `_add`, no `tl.sum` or
`tl.sigmoid`. `ranking_bce_reference` is the torch form (the tests' reference, and what runs
on the CPU outside the Triton interpreter).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from torch.autograd.function import once_differentiable

from ._common import _add

_BLOCK = 1024


@triton.jit
def _label(Bits, r, t, mask):
    bits = tl.load(Bits + r, mask=mask, other=0)
    return ((bits >> t) & 1).to(tl.float32)


@triton.jit
def _bce_sum_kernel(
    Logits, Bits, NumReal, LossTokens, Out, R, T: tl.constexpr, BLOCK: tl.constexpr
):  # fmt: skip
    """One program: the real rows' terms summed block by block in a fixed order."""
    n = tl.load(NumReal) * T
    denom = tl.maximum(tl.load(LossTokens), 1).to(tl.float32)
    acc = tl.full([BLOCK], 0.0, tl.float32)
    for start in range(0, R * T, BLOCK):
        i = start + tl.arange(0, BLOCK)
        real = i < n
        x = tl.load(Logits + i, mask=real, other=0.0)
        y = _label(Bits, i // T, i % T, real)
        # torch's log_sigmoid: min(x, 0) - log1p(exp(-|x|))
        log_sig = tl.minimum(x, 0.0) - tl.log(1.0 + tl.exp(-tl.abs(x)))
        acc += tl.where(real, (1.0 - y) * x - log_sig, 0.0)
    tl.store(Out, tl.reduce(acc, 0, _add) / denom)


@triton.jit
def _bce_bwd_kernel(
    Logits, Bits, NumReal, LossTokens, Grad, DLogits, R, T: tl.constexpr, BLOCK: tl.constexpr
):  # fmt: skip
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    inside = i < R * T
    real = i < tl.load(NumReal) * T
    scale = tl.load(Grad) / tl.maximum(tl.load(LossTokens), 1).to(tl.float32)
    x = tl.load(Logits + i, mask=inside, other=0.0)
    y = _label(Bits, i // T, i % T, real)
    sig = 1.0 / (1.0 + tl.exp(-x))
    tl.store(DLogits + i, tl.where(real, (sig - y) * scale, 0.0), mask=inside)


# decided when the kernels were decorated (TRITON_INTERPRET=1 at import), as in _launch.py
_INTERPRET = type(_bce_sum_kernel).__name__ == "InterpretedFunction"


def ranking_bce_reference(logits, label_bits, num_real, loss_tokens):
    """The torch ops `ranking_bce` replaces (module docstring)."""
    rows, tasks = logits.shape
    bits = torch.arange(tasks, device=logits.device)
    labels = ((label_bits[:, None] >> bits) & 1).to(logits.dtype)
    bce = F.binary_cross_entropy_with_logits(logits, labels, reduction="none")
    real = torch.arange(rows, device=logits.device) < num_real
    denom = loss_tokens.clamp(min=1).to(torch.float32)
    return torch.where(real[:, None], bce, 0.0).sum() / denom


class _RankingBCE(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, label_bits, num_real, loss_tokens):
        rows, tasks = logits.shape
        out = torch.empty((), dtype=torch.float32, device=logits.device)
        _bce_sum_kernel[(1,)](
            logits, label_bits, num_real, loss_tokens, out, rows, T=tasks, BLOCK=_BLOCK,
            num_warps=4,
        )  # fmt: skip
        ctx.save_for_backward(logits, label_bits, num_real, loss_tokens)
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx, grad):
        logits, label_bits, num_real, loss_tokens = ctx.saved_tensors
        rows, tasks = logits.shape
        d = torch.empty_like(logits)
        _bce_bwd_kernel[(triton.cdiv(rows * tasks, _BLOCK),)](
            logits, label_bits, num_real, loss_tokens, grad.float().contiguous(), d, rows,
            T=tasks, BLOCK=_BLOCK, num_warps=4,
        )  # fmt: skip
        return d, None, None, None


def ranking_bce(
    logits: torch.Tensor,
    label_bits: torch.Tensor,
    num_real: torch.Tensor,
    loss_tokens: torch.Tensor,
) -> torch.Tensor:
    """The ranking loss (module docstring) of `logits [R, T]` (fp32, contiguous) against the
    task bits of `label_bits [R]` (int64; bit t: task t), over the first `num_real` rows (a
    0-d int64 tensor on the logits' device, read by the kernels, so it may change between
    CUDA-graph replays), divided by `max(loss_tokens, 1)` (likewise). A 0-d fp32 tensor,
    differentiable in `logits`. Outside CUDA and the Triton interpreter: the torch ops."""
    if logits.dtype != torch.float32 or logits.dim() != 2 or not logits.is_contiguous():
        raise ValueError(
            f"ranking_bce: logits must be contiguous fp32 [rows, tasks], got {logits.dtype} "
            f"{tuple(logits.shape)}"
        )
    if label_bits.dtype != torch.int64 or label_bits.shape != logits.shape[:1]:
        raise ValueError(
            f"ranking_bce: label_bits must be int64 [{logits.shape[0]}], got "
            f"{label_bits.dtype} {tuple(label_bits.shape)}"
        )
    for name, t in (("num_real", num_real), ("loss_tokens", loss_tokens)):
        if t.dtype != torch.int64 or t.numel() != 1 or t.device != logits.device:
            raise ValueError(f"ranking_bce: {name} must be one int64 on {logits.device}")
    if not (logits.is_cuda or _INTERPRET):
        return ranking_bce_reference(logits, label_bits, num_real, loss_tokens)
    return _RankingBCE.apply(logits, label_bits, num_real.reshape(()), loss_tokens.reshape(()))
