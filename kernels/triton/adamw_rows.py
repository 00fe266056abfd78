"""AdamW on an embedding table from the gradient of its looked-up rows, without the dense
gradient.

A lookup `W[ids]` gives `W` a gradient that is zero in every row but the looked-up ones: eager
torch builds it dense (`[V, D]` fp32: a zero fill, a sort and a scatter), AdamW then reads it
in full, and the gradient norm reads it once more. At `bench_upstream`'s 100K x 1024 item
table that is ~0.8 GB of memory traffic per step that carries ~2-20K rows of information
(docs/BENCHMARKS.md, "what the item table costs"). Here:

1. the ids are sorted (stable; as int32 keys where the table has fewer than 2**31 rows: CUB's
   radix sort makes a pass per key byte, half of int64's) and each run of equal ids summed in
   sorted order, in chunks of `CHUNK` positions, one program per chunk
   (`_chunk_sums_kernel`): a row looked up thousands of times (a popular item) is summed by
   many programs, not one;
2. one streaming kernel (`_adamw_rows_kernel`) updates every row of the table, its moments
   and parameter, taking a touched row's gradient as the sum of its chunks' sums and zero
   for the others, and writes the squared gradient of its tile for the norm.

Every sum runs in a fixed order (deterministic, as torch's sorted embedding backward).

That is dense AdamW with decoupled weight decay, exactly as `torch.optim.AdamW` (the fused
implementation's arithmetic, fp32) applies it to the dense gradient: every row's moments
decay and every row takes its weight decay, touched or not. Only the traffic changes: the
table, its two moments and their writes, nothing else of size `V`.

`sparse=True` is the touched-rows Adam of `data_parallel` tables (docs/MODEL.md, fbgemm's
`ADAM`): the same arithmetic on the looked-up rows only, by `_adamw_touched_kernel`, one
program per sorted position (those that start a run update their row), in place of step 2:
every other row and its moments are neither read nor written, and nothing of size `V` is
built, so the update costs the lookups' traffic, not the table's (one H200, bench_upstream:
-0.45 to -0.50 ms per step against the dense pass, docs/BENCHMARKS.md).

`adamw_rows_reference_` is the same update through the dense gradient in plain torch (the
tests' reference, and what runs on CPU outside the Triton interpreter).
"""

from __future__ import annotations

import contextlib
import math

import torch
import triton
import triton.language as tl

from ._common import _add, _max, _reduce_sum

# decided when the kernels were decorated (TRITON_INTERPRET=1 at import), as in _launch.py
_INTERPRET: bool


@triton.jit
def _chunk_sums_kernel(
    Sorted, Perm, Starts, Ends, R, stride_r, Out, stride_o, D,
    CHUNK: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    """Position `i` of the sorted ids, if it starts a chunk of its run of equal ids (the run's
    first position, then every CHUNK-th): the sum of the chunk's gradient rows, in sorted
    order, into `Out[i]` (other positions are not written). Negative ids are no lookup."""
    i = tl.program_id(0)
    row = tl.load(Sorted + i)
    start = tl.load(Starts + i)
    if (row >= 0) & ((i - start) % CHUNK == 0):
        cols = tl.arange(0, BLOCK_D)
        cmask = cols < D
        end = tl.minimum(tl.load(Ends + i), i + CHUNK)
        acc = tl.full([BLOCK_D], 0.0, tl.float32)
        for j in range(i, end):
            src = tl.load(Perm + j)
            acc += tl.load(R + src * stride_r + cols, mask=cmask, other=0.0).to(tl.float32)
        tl.store(Out + i.to(tl.int64) * stride_o + cols, acc, mask=cmask)


@triton.jit
def _adamw_rows_kernel(
    P, M, V2, Starts, Ends, Sorted, G, stride_g, Sq, Step, N, V, D,
    lr, beta1, beta2, log2_beta1, log2_beta2, eps, weight_decay,
    CHUNK: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    """Rows `[pid_r * BLOCK_R, ...)`, columns `[pid_c * BLOCK_D, ...)` of the table: a row
    whose run of ids starts at `Starts[r]` of the sorted ids takes the sum of its chunks'
    sums, the others zero; then AdamW as torch's fused kernel computes it (step count `Step`,
    fp32, already advanced). The tile's squared gradient goes to `Sq[program]`."""
    pid_r = tl.program_id(0)
    pid_c = tl.program_id(1)
    rows = pid_r.to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = pid_c * BLOCK_D + tl.arange(0, BLOCK_D)
    rmask = rows < V
    mask = rmask[:, None] & (cols < D)[None, :]
    first = tl.load(Starts + rows, mask=rmask, other=N)
    at = tl.minimum(first, N - 1)
    touched = rmask & (first < N) & (tl.load(Sorted + at, mask=rmask, other=-1) == rows)
    end = tl.where(touched, tl.load(Ends + at, mask=rmask, other=0), first)
    chunks = tl.reduce((end - first + CHUNK - 1) // CHUNK, 0, _max)  # the tile's longest run
    g = tl.full([BLOCK_R, BLOCK_D], 0.0, tl.float32)
    for c in range(0, chunks):
        pos = first + c * CHUNK
        live = touched & (pos < end)
        g += tl.load(
            G + tl.minimum(pos, N - 1)[:, None] * stride_g + cols[None, :],
            mask=mask & live[:, None],
            other=0.0,
        )
    tl.store(Sq + pid_r * tl.num_programs(1) + pid_c, _reduce_sum(g * g))
    offs = rows[:, None] * D + cols[None, :]
    _adamw_tile(P + offs, M + offs, V2 + offs, mask, g, Step, lr, beta1, beta2, log2_beta1,
                log2_beta2, eps, weight_decay)  # fmt: skip


@triton.jit
def _adamw_tile(
    P, M, V2, mask, g, Step, lr, beta1, beta2, log2_beta1, log2_beta2, eps, weight_decay
):  # fmt: skip
    """AdamW as torch's fused kernel computes it (fp32, step count `Step` already advanced)
    on the elements at pointers `P`, `M`, `V2` where `mask`, from their gradient `g`; returns
    the updated parameter (fp32)."""
    p = tl.load(P, mask=mask, other=0.0)
    m = tl.load(M, mask=mask, other=0.0)
    v = tl.load(V2, mask=mask, other=0.0)
    step = tl.load(Step).to(tl.float32)
    bias1 = 1.0 - tl.exp2(step * log2_beta1)
    bias2_sqrt = tl.sqrt(1.0 - tl.exp2(step * log2_beta2))
    p = p * (1.0 - lr * weight_decay)
    m = beta1 * m + (1.0 - beta1) * g
    v = beta2 * v + (1.0 - beta2) * g * g
    p = p - (lr / bias1) * m / (tl.sqrt(v) / bias2_sqrt + eps)
    tl.store(P, p, mask=mask)
    tl.store(M, m, mask=mask)
    tl.store(V2, v, mask=mask)
    return p


@triton.jit
def _adamw_touched_kernel(
    P, M, V2, Starts, Ends, Sorted, G, stride_g, Sq, Step, D,
    lr, beta1, beta2, log2_beta1, log2_beta2, eps, weight_decay,
    CHUNK: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    """`sparse=True`: position `i` of the sorted ids, if it starts its run (and the id is a
    lookup): the run's chunk sums added, then AdamW on that row, columns `[pid_c * BLOCK_D,
    ...)`. One program per position, so the work is the lookups', not the table's; the
    row's squared gradient goes to `Sq[i, pid_c]` (zero for the other positions)."""
    i = tl.program_id(0)
    pid_c = tl.program_id(1)
    cols = pid_c * BLOCK_D + tl.arange(0, BLOCK_D)
    cmask = cols < D
    row = tl.load(Sorted + i)
    sq = 0.0
    if (row >= 0) & (tl.load(Starts + i) == i):
        end = tl.load(Ends + i)
        g = tl.full([BLOCK_D], 0.0, tl.float32)
        run = G + i.to(tl.int64) * stride_g + cols
        for k in range(0, end - i, CHUNK):  # the sums sit at the run's chunk starts
            g += tl.load(run + k * stride_g, mask=cmask, other=0.0)
        sq = tl.reduce(g * g, 0, _add)
        offs = row.to(tl.int64) * D + cols
        _adamw_tile(P + offs, M + offs, V2 + offs, cmask, g, Step, lr, beta1, beta2,
                    log2_beta1, log2_beta2, eps, weight_decay)  # fmt: skip
    tl.store(Sq + i * tl.num_programs(1) + pid_c, sq)


_INTERPRET = type(_adamw_rows_kernel).__name__ == "InterpretedFunction"
_ARANGE: dict[tuple[int, torch.device], torch.Tensor] = {}
# positions summed by one program: a row looked up k times is summed by cdiv(k, CHUNK)
# programs in parallel, then its update adds their cdiv(k, CHUNK) sums
CHUNK = 32


def _check(param, exp_avg, exp_avg_sq, step, ids, grad_rows) -> None:
    if param.dim() != 2 or not param.is_contiguous() or param.dtype != torch.float32:
        raise ValueError(f"param must be a contiguous fp32 [V, D] table, got {param.dtype} "
                         f"{tuple(param.shape)}")  # fmt: skip
    for name, t in (("exp_avg", exp_avg), ("exp_avg_sq", exp_avg_sq)):
        if t.shape != param.shape or t.dtype != param.dtype or not t.is_contiguous():
            raise ValueError(f"{name} must be contiguous like param {tuple(param.shape)}")
    if step.numel() != 1:
        raise ValueError(f"step must be a one-element tensor, got shape {tuple(step.shape)}")
    if ids.dim() != 1 or grad_rows.shape != (ids.numel(), param.shape[1]):
        raise ValueError(
            f"grad_rows {tuple(grad_rows.shape)} must be [len(ids), D] = "
            f"[{ids.numel()}, {param.shape[1]}]"
        )


def adamw_rows_(
    param: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    step: torch.Tensor,
    ids: torch.Tensor,
    grad_rows: torch.Tensor,
    *,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    sparse: bool = False,
    advance_step: bool = True,
) -> torch.Tensor:
    """One AdamW step of table `param [V, D]` (fp32, in place with its moments), whose
    gradient is that of the lookup `param[ids]`: `grad_rows [N, D]`, repeated ids summed.
    `step`: AdamW's step count (a one-element tensor, advanced by one here, as torch's
    capturable AdamW keeps it; `advance_step=False`: already advanced by the caller, e.g. one
    count shared by several tables). `sparse`: only the looked-up rows (module docstring).
    Returns the gradient's squared norm (an fp32 0-dim tensor). No host synchronisation:
    capturable in a CUDA graph. Ids must be below `V`; a negative id marks a position that is
    no lookup of this table (padding): its row is ignored."""
    _check(param, exp_avg, exp_avg_sq, step, ids, grad_rows)
    hyper = dict(lr=lr, beta1=beta1, beta2=beta2, eps=eps, weight_decay=weight_decay)
    if not (param.is_cuda or _INTERPRET):
        return adamw_rows_reference_(
            param, exp_avg, exp_avg_sq, step, ids, grad_rows, **hyper, sparse=sparse,
            advance_step=advance_step,
        )  # fmt: skip
    if advance_step:
        step.add_(1)
    return _launch(param, exp_avg, exp_avg_sq, step, ids, grad_rows, hyper, True, sparse)


def compile_adamw_rows(
    param, exp_avg, exp_avg_sq, step, ids, grad_rows, sparse: bool = False
) -> None:
    """Compile the kernels `adamw_rows_` launches for these arguments without running them
    (nothing is read or written): before a CUDA graph capture, which should not be where a
    kernel is first built and loaded."""
    _check(param, exp_avg, exp_avg_sq, step, ids, grad_rows)
    if param.is_cuda and not _INTERPRET:
        hyper = dict(lr=0.0, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0)
        _launch(param, exp_avg, exp_avg_sq, step, ids, grad_rows, hyper, False, sparse)


def _launch(param, exp_avg, exp_avg_sq, step, ids, grad_rows, hyper, run: bool, sparse: bool):
    num_rows, d = param.shape
    n = ids.numel()
    if n == 0:  # nothing looked up: a zero gradient everywhere
        ids = torch.full((1,), -1, dtype=torch.int64, device=param.device)
        grad_rows = torch.zeros((1, d), dtype=torch.float32, device=param.device)
        n = 1
    # int32 keys where the table allows (half the radix passes of int64 keys)
    key_dtype = torch.int32 if num_rows < 2**31 else torch.int64
    sorted_ids, perm = torch.sort(ids.to(key_dtype), stable=True)
    starts = torch.searchsorted(sorted_ids, sorted_ids)
    ends = torch.searchsorted(sorted_ids, sorted_ids, right=True)
    grad_rows = grad_rows if grad_rows.stride(-1) == 1 else grad_rows.contiguous()
    sums = torch.empty((n, d), dtype=torch.float32, device=param.device)
    block_d = triton.next_power_of_2(d)
    block_c = min(block_d, 1024)
    b1, b2 = hyper["beta1"], hyper["beta2"]
    adamw = (
        hyper["lr"],
        b1,
        b2,
        math.log2(b1) if b1 > 0 else -math.inf,
        math.log2(b2) if b2 > 0 else -math.inf,
        hyper["eps"],
        hyper["weight_decay"],
    )
    if sparse:  # one program per sorted position: the touched rows' work only
        grid = (n, triton.cdiv(d, block_c))
        sq = torch.empty(grid[0] * grid[1], dtype=torch.float32, device=param.device)
        update = (
            _adamw_touched_kernel,
            grid,
            (
                param,
                exp_avg,
                exp_avg_sq,
                starts,
                ends,
                sorted_ids,
                sums,
                sums.stride(0),
                sq,
                step,
                d,
                *adamw,
            ),  # fmt: skip
            dict(CHUNK=CHUNK, BLOCK_D=block_c, num_warps=4 if block_c <= 512 else 8),
        )
    else:  # every row of the table
        key = (num_rows, param.device)
        if key not in _ARANGE:
            _ARANGE[key] = torch.arange(num_rows, dtype=key_dtype, device=param.device)
        first = torch.searchsorted(sorted_ids, _ARANGE[key])
        block_r = max(1, 4096 // block_c)
        grid = (triton.cdiv(num_rows, block_r), triton.cdiv(d, block_c))
        sq = torch.empty(grid[0] * grid[1], dtype=torch.float32, device=param.device)
        update = (
            _adamw_rows_kernel,
            grid,
            (
                param,
                exp_avg,
                exp_avg_sq,
                first,
                ends,
                sorted_ids,
                sums,
                sums.stride(0),
                sq,
                step,
                n,
                num_rows,
                d,
                *adamw,
            ),  # fmt: skip
            dict(CHUNK=CHUNK, BLOCK_R=block_r, BLOCK_D=block_c, num_warps=8),
        )
    launches = [
        (
            _chunk_sums_kernel,
            (n,),
            (
                sorted_ids,
                perm,
                starts,
                ends,
                grad_rows,
                grad_rows.stride(0),
                sums,
                sums.stride(0),
                d,
            ),  # fmt: skip
            dict(CHUNK=CHUNK, BLOCK_D=block_d, num_warps=4 if block_d <= 1024 else 8),
        ),
        update,
    ]
    with torch.cuda.device(param.device) if param.is_cuda else contextlib.nullcontext():
        for kernel, grid_, args, meta in launches:
            if run:
                kernel[grid_](*args, **meta)
            else:
                kernel.warmup(*args, grid=grid_, **meta)
    return sq.sum()


def adamw_rows_reference_(
    param, exp_avg, exp_avg_sq, step, ids, grad_rows, *, lr, beta1, beta2, eps, weight_decay,
    sparse=False, advance_step=True,
) -> torch.Tensor:  # fmt: skip
    """`adamw_rows_` through the dense gradient, in plain torch (same arguments, same result
    up to rounding)."""
    _check(param, exp_avg, exp_avg_sq, step, ids, grad_rows)
    keep = ids >= 0
    grad = torch.zeros_like(param).index_add_(0, ids[keep].long(), grad_rows[keep].float())
    if advance_step:
        step.add_(1)
    rows = None
    if sparse:
        rows = torch.zeros(param.shape[0], dtype=torch.bool, device=param.device)
        rows.index_fill_(0, ids[keep].long(), True)
    hyper = dict(lr=lr, beta1=beta1, beta2=beta2, eps=eps, weight_decay=weight_decay)
    adamw_masked_(param, exp_avg, exp_avg_sq, grad, rows, step, **hyper)
    return grad.square().sum()


def adamw_masked_(
    param, exp_avg, exp_avg_sq, grad, rows, step, *, lr, beta1, beta2, eps, weight_decay
) -> None:
    """AdamW from the dense gradient `grad [V, D]` on the rows where `rows [V]` (bool) is
    set, every row when it is None; `step` already advanced. Plain torch, no host sync."""
    t = step.reshape(()).float()
    new_m = exp_avg * beta1 + grad * (1.0 - beta1)
    new_v = exp_avg_sq * beta2 + grad * grad * (1.0 - beta2)
    bias1 = 1.0 - torch.pow(beta1, t)
    bias2_sqrt = torch.sqrt(1.0 - torch.pow(beta2, t))
    new_p = param * (1.0 - lr * weight_decay) - (lr / bias1) * new_m / (
        new_v.sqrt() / bias2_sqrt + eps
    )
    for out, new in ((param, new_p), (exp_avg, new_m), (exp_avg_sq, new_v)):
        out.copy_(new if rows is None else torch.where(rows[:, None], new, out))
