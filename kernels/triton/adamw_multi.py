"""AdamW over many tensors in one launch, with the gradients' squared norm in the same pass.

torch's fused AdamW runs the update of a model's parameters in a few multi-tensor launches, and
a training step then reads every gradient once more for its norm (`_foreach_norm`, a pass over
the gradients). The data_parallel tables' masked Adam (`adamw_masked_`) is a dozen elementwise
torch kernels per table. Here one kernel walks a table of the tensors' addresses (`[N, 10]`
int64, one row per parameter: parameter, gradient, moments, optional low-precision copy,
optional row marks, step count, size, row width, first program), a program per chunk of `CHUNK`
elements in blocks of `BLOCK`: it reads a block's gradient, adds its squares to the norm's
partial sum, and applies AdamW with the arithmetic of `adamw_rows._adamw_tile` (torch's fused
kernel's, fp32, decoupled weight decay) where the block's rows are marked (`rows`: the other
rows and their moments are left as they are, as `adamw_masked_`). `copies`: the updated
parameter is also written rounded to the copy's dtype (bf16 / fp16), e.g. the operands a
mixed-precision step's GEMMs read.

A program finds its tensor by a binary search of the table's first-program column: no
schedule of size `programs` is built. The table is made on the host per call and sent with
one copy; inside a CUDA graph capture from pinned memory that stays alive with this module
(the replays read it), so the launch is capturable, as long as the tensors' addresses are the
ones the graph replays (a step graph's gradients are: its pool gives them the same memory).

Every sum runs in a fixed order (the per-block partials summed by torch), so the norm is
deterministic. Outside CUDA and the Triton interpreter the same update runs in plain torch
(`adamw_masked_`), the reference the tests hold the kernel to.
"""

from __future__ import annotations

import contextlib
import math

import torch
import triton
import triton.language as tl

from ._common import _add
from .adamw_rows import _adamw_tile, adamw_masked_

_INTERPRET: bool

# the address table's columns
_P, _G, _M, _V, _COPY, _ROWS, _STEP, _NUMEL, _WIDTH, _FIRST = range(10)
_COLS = 10
# elements per iteration, iterations per program (a program's search and table reads are paid
# once for CHUNK = BLOCK * ITERS elements) and warps: 1024 x 16 x 8 warps, 4 fp32 of each
# array per thread an iteration, the fastest of the first sweep on one H200 (0.372 ms for the
# recipe's 43M parameters with their bf16 copies; 2048 x 8: 0.726, 2048 x 1: 0.460;
# scripts/adamw_timing.py, kernels/README.md)
BLOCK, ITERS, WARPS = 1024, 16, 8
CHUNK = BLOCK * ITERS
# host tables a captured launch reads at every replay (kept alive while the process lives)
_CAPTURED: list[torch.Tensor] = []
_COPY_DTYPES = {torch.bfloat16: 1, torch.float16: 2}


@triton.jit
def _adamw_multi_kernel(
    Tab, Sq, NT, lr, beta1, beta2, log2_beta1, log2_beta2, eps, weight_decay,
    SEARCH: tl.constexpr, COPY: tl.constexpr, BLOCK: tl.constexpr, ITERS: tl.constexpr,
):  # fmt: skip
    """Chunk `pid - first` (ITERS blocks of BLOCK elements) of the tensor whose table row holds
    the last first program at or below `pid`: its gradient's squared sum into `Sq[pid]`,
    then AdamW on its marked elements (step count already advanced), and the copy where the
    row has one (`COPY`: 1 bf16, 2 fp16, 0 no copy in this launch)."""
    pid = tl.program_id(0)
    lo = pid * 0
    hi = lo + NT
    for _ in tl.static_range(SEARCH):  # Tab[lo].first <= pid < Tab[hi].first
        mid = (lo + hi) // 2
        go = tl.load(Tab + mid.to(tl.int64) * 10 + 9) <= pid
        lo = tl.where(go, mid, lo)
        hi = tl.where(go, hi, mid)
    row = Tab + lo.to(tl.int64) * 10
    numel = tl.load(row + 7)
    width = tl.load(row + 8)
    marks = tl.load(row + 5)
    copy = tl.load(row + 4)
    P = tl.load(row).to(tl.pointer_type(tl.float32))
    G = tl.load(row + 1).to(tl.pointer_type(tl.float32))
    M = tl.load(row + 2).to(tl.pointer_type(tl.float32))
    V = tl.load(row + 3).to(tl.pointer_type(tl.float32))
    Step = tl.load(row + 6).to(tl.pointer_type(tl.float32))
    base = (pid - tl.load(row + 9)).to(tl.int64) * (BLOCK * ITERS)
    sq = tl.full((BLOCK,), 0.0, tl.float32)
    for k in range(ITERS):
        offs = base + k * BLOCK + tl.arange(0, BLOCK)
        mask = offs < numel
        g = tl.load(G + offs, mask=mask, other=0.0)
        sq += g * g
        if marks != 0:  # rows marked for the update: the others keep values and moments
            mark = tl.load(marks.to(tl.pointer_type(tl.int8)) + offs // width, mask=mask, other=0)
            mask = mask & (mark != 0)
        p = _adamw_tile(P + offs, M + offs, V + offs, mask, g, Step, lr, beta1, beta2,
                        log2_beta1, log2_beta2, eps, weight_decay)  # fmt: skip
        if COPY != 0:  # noqa: SIM102 (the constexpr branch apart from the runtime one)
            if copy != 0:
                if COPY == 1:
                    tl.store(copy.to(tl.pointer_type(tl.bfloat16)) + offs, p.to(tl.bfloat16),
                             mask=mask)  # fmt: skip
                else:
                    tl.store(copy.to(tl.pointer_type(tl.float16)) + offs, p.to(tl.float16),
                             mask=mask)  # fmt: skip
    tl.store(Sq + pid, tl.reduce(sq, 0, _add))


_INTERPRET = type(_adamw_multi_kernel).__name__ == "InterpretedFunction"


def runs_kernel(like: torch.Tensor) -> bool:
    """Whether `adamw_multi_` on tensors like `like` runs the Triton kernel (CUDA, or the
    interpreter), not the plain-torch reference."""
    return like.device.type == "cuda" or _INTERPRET


def _check(params, grads, exp_avgs, exp_avg_sqs, steps, rows, copies) -> None:
    n = len(params)
    for name, xs in (
        ("grads", grads), ("exp_avgs", exp_avgs), ("exp_avg_sqs", exp_avg_sqs),
        ("steps", steps), ("rows", rows), ("copies", copies),
    ):  # fmt: skip
        if len(xs) != n:
            raise ValueError(f"{name}: {len(xs)} tensors for {n} parameters")
    copy_dtypes = set()
    for i, p in enumerate(params):
        if p.dtype != torch.float32 or not p.is_contiguous():
            raise ValueError(f"params[{i}] must be contiguous fp32, got {p.dtype} {p.stride()}")
        for name, t in (("grads", grads[i]), ("exp_avgs", exp_avgs[i]),
                        ("exp_avg_sqs", exp_avg_sqs[i])):  # fmt: skip
            if t.shape != p.shape or t.dtype != torch.float32 or not t.is_contiguous():
                raise ValueError(
                    f"{name}[{i}] must be contiguous fp32 {tuple(p.shape)}, got {t.dtype} "
                    f"{tuple(t.shape)}"
                )
            if t.device != p.device:
                raise ValueError(f"{name}[{i}] is on {t.device}, params[{i}] on {p.device}")
        s = steps[i]
        if s.numel() != 1 or s.dtype != torch.float32 or s.device != p.device:
            raise ValueError(f"steps[{i}] must be a one-element fp32 tensor on {p.device}")
        r = rows[i]
        if r is not None and (
            p.dim() == 0 or r.shape != (p.shape[0],) or r.dtype != torch.bool
            or not r.is_contiguous() or r.device != p.device
        ):  # fmt: skip
            raise ValueError(
                f"rows[{i}] must be a contiguous bool [{p.shape[0] if p.dim() else 0}]"
            )
        c = copies[i]
        if c is not None and r is not None:
            raise ValueError(f"params[{i}] has both rows and a copy: an unmarked row's copy "
                             "would not be written")  # fmt: skip
        if c is not None:
            if c.shape != p.shape or c.dtype not in _COPY_DTYPES or not c.is_contiguous():
                raise ValueError(
                    f"copies[{i}] must be a contiguous bf16 / fp16 {tuple(p.shape)}, got "
                    f"{c.dtype} {tuple(c.shape)}"
                )
            copy_dtypes.add(c.dtype)
    if len(copy_dtypes) > 1:
        raise ValueError(f"copies of one launch share a dtype, got {sorted(map(str, copy_dtypes))}")


def adamw_multi_(
    params: list[torch.Tensor],
    grads: list[torch.Tensor],
    exp_avgs: list[torch.Tensor],
    exp_avg_sqs: list[torch.Tensor],
    steps: list[torch.Tensor],
    *,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    rows: list[torch.Tensor | None] | None = None,
    copies: list[torch.Tensor | None] | None = None,
) -> torch.Tensor:
    """One AdamW step of every `params[i]` (fp32, in place with `exp_avgs[i]`,
    `exp_avg_sqs[i]`) from `grads[i]`, its step count `steps[i]` (a one-element fp32 tensor,
    already advanced, as torch's capturable AdamW keeps it; several may be one tensor).
    `rows[i]` (bool `[params[i].shape[0]]`): only the marked rows are updated. `copies[i]`
    (bf16 / fp16, like `params[i]`): gets the updated parameter, rounded. Returns the
    gradients' squared norm, all of it (marked rows or not), as an fp32 0-dim tensor. No host
    synchronisation: capturable in a CUDA graph (module docstring)."""
    n = len(params)
    rows = rows if rows is not None else [None] * n
    copies = copies if copies is not None else [None] * n
    _check(params, grads, exp_avgs, exp_avg_sqs, steps, rows, copies)
    hyper = dict(lr=lr, beta1=beta1, beta2=beta2, eps=eps, weight_decay=weight_decay)
    if n == 0:
        return torch.zeros((), dtype=torch.float32)
    device = params[0].device
    if not runs_kernel(params[0]):
        return adamw_multi_reference_(
            params, grads, exp_avgs, exp_avg_sqs, steps, **hyper, rows=rows, copies=copies
        )
    table, first = [], 0
    for p, g, m, v, s, r, c in zip(
        params, grads, exp_avgs, exp_avg_sqs, steps, rows, copies, strict=True
    ):
        numel = p.numel()
        width = numel // p.shape[0] if p.dim() and p.shape[0] else 1
        table.append([
            p.data_ptr(), g.data_ptr(), m.data_ptr(), v.data_ptr(),
            c.data_ptr() if c is not None else 0, r.data_ptr() if r is not None else 0,
            s.data_ptr(), numel, max(width, 1), first,
        ])  # fmt: skip
        first += triton.cdiv(numel, CHUNK)
    programs = first
    if programs == 0:
        return torch.zeros((), dtype=torch.float32, device=device)
    host = torch.tensor(table, dtype=torch.int64)
    if device.type == "cuda":
        host = host.pin_memory()
        tab = host.to(device, non_blocking=True)
        if torch.cuda.is_current_stream_capturing():
            _CAPTURED.append(host)  # the graph's copy reads it at every replay
    else:
        tab = host
    sq = torch.empty(programs, dtype=torch.float32, device=device)
    dtypes = {c.dtype for c in copies if c is not None}
    copy = _COPY_DTYPES[dtypes.pop()] if dtypes else 0
    b1, b2 = beta1, beta2
    with torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext():
        _adamw_multi_kernel[(programs,)](
            tab, sq, n, lr, b1, b2,
            math.log2(b1) if b1 > 0 else -math.inf, math.log2(b2) if b2 > 0 else -math.inf,
            eps, weight_decay, SEARCH=_search(n), COPY=copy, BLOCK=BLOCK, ITERS=ITERS,
            num_warps=WARPS,
        )  # fmt: skip
    return sq.sum()


def compile_adamw_multi(like: torch.Tensor, n: int, copy_dtype: torch.dtype | None = None):
    """Compile the kernel `adamw_multi_` launches for `n` tensors like `like` (and copies of
    `copy_dtype`) without running it: before a CUDA graph capture, which should not be where a
    kernel is first built. A no-op where the kernel does not run compiled."""
    if like.device.type != "cuda" or _INTERPRET or n == 0:
        return
    tab = torch.zeros((n, _COLS), dtype=torch.int64, device=like.device)
    sq = torch.empty(1, dtype=torch.float32, device=like.device)
    copy = _COPY_DTYPES[copy_dtype] if copy_dtype is not None else 0
    with torch.cuda.device(like.device):
        _adamw_multi_kernel.warmup(
            tab, sq, n, 1e-3, 0.9, 0.999, math.log2(0.9), math.log2(0.999), 1e-8, 0.0,
            SEARCH=_search(n), COPY=copy, BLOCK=BLOCK, ITERS=ITERS, num_warps=WARPS, grid=(1,),
        )  # fmt: skip


def _search(n: int) -> int:
    """The binary search's steps over `n` table rows."""
    return max(1, math.ceil(math.log2(max(n, 1)))) + 1


def adamw_multi_reference_(
    params, grads, exp_avgs, exp_avg_sqs, steps, *, lr, beta1, beta2, eps, weight_decay,
    rows=None, copies=None,
) -> torch.Tensor:  # fmt: skip
    """`adamw_multi_` in plain torch, tensor by tensor (same arguments, same result up to
    rounding)."""
    n = len(params)
    rows = rows if rows is not None else [None] * n
    copies = copies if copies is not None else [None] * n
    _check(params, grads, exp_avgs, exp_avg_sqs, steps, rows, copies)
    hyper = dict(lr=lr, beta1=beta1, beta2=beta2, eps=eps, weight_decay=weight_decay)
    sq = torch.zeros((), dtype=torch.float32, device=params[0].device if n else None)
    for p, g, m, v, s, r, c in zip(
        params, grads, exp_avgs, exp_avg_sqs, steps, rows, copies, strict=True
    ):
        sq = sq + g.square().sum()
        rows2d = (p.shape[0], -1) if p.dim() else (1, 1)
        two_d = [t.view(rows2d) for t in (p, m, v, g)]
        adamw_masked_(*two_d, r, s, **hyper)
        if c is not None:
            c.copy_(p)
    return sq
