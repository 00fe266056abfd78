"""AdamW over many tensors in one launch, with the gradients' squared norm in the same pass.

torch's fused AdamW runs the update of a model's parameters in a few multi-tensor launches, and
a training step then reads every gradient once more for its norm (`_foreach_norm`, a pass over
the gradients). The data_parallel tables' masked Adam (`adamw_masked_`) is a dozen elementwise
torch kernels per table. Here one kernel walks a table of the tensors (`[N, 11]` int64, one row
per parameter: the element offsets of the parameter, its gradient and moments from the launch's
first parameter, of its optional low-precision copy from the first copy, whether it has one,
the addresses of its optional row marks and of its step count, its size, its row width, its
first program), a program per chunk of `CHUNK` elements in blocks of `BLOCK`: it reads a
block's gradient, adds its squares to the norm's partial sum, and applies AdamW with the
arithmetic of `adamw_rows._adamw_tile` (torch's fused kernel's, fp32, decoupled weight decay)
where the block's rows are marked (`rows`: the other rows and their moments are left as they
are, as `adamw_masked_`). `copies`: the updated parameter is also written rounded to the copy's
dtype (bf16 / fp16), e.g. the operands a mixed-precision step's GEMMs read.

Offsets from a base the launch passes, not addresses, so that the compiler can know the
alignment: where every tensor of a launch starts 16-byte aligned and holds a multiple of 4
elements, the offsets and sizes are stored in units of 4 and the loads and stores move 16 bytes
a thread (`ALIGNED`; 60 registers a thread where 4-byte accesses through addresses took 140,
kernels/README.md); the other tensors go in a second launch. A program finds its tensor by a
binary search of the table's first-program column: no schedule of size `programs` is built. The
table is made on the host per call and sent with one copy; inside a CUDA graph capture from
pinned memory that stays alive with this module (the replays read it), so the launch is
capturable, as long as the tensors' addresses are the ones the graph replays (a step graph's
gradients are: its pool gives them the same memory).

Every sum runs in a fixed order (the per-program partials summed by torch), so the norm is
deterministic. Outside CUDA and the Triton interpreter the same update runs in plain torch
(`adamw_multi_reference_`, through `adamw_masked_`), the reference the tests hold the kernel
to.
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

# the table's columns: element offsets of the parameter, gradient and moments from the launch's
# fp32 base and of the copy from its copy base, whether there is a copy, the addresses of the row
# marks (0: none) and of the step count, the size, the row width, the first program
_COLS = 11
# elements per iteration, iterations per program (a program's search and table reads are paid
# once for CHUNK = BLOCK * ITERS elements) and warps: 1024 x 16 x 8 warps, 4 fp32 of each
# array per thread an iteration, one 16-byte access each where the launch is aligned (60
# registers: four programs an SM). One H200, the recipe's 43M parameters with their bf16
# copies (scripts/adamw_timing.py; torch's three passes 0.517 ms): 0.361 ms, the tiles swept
# around it 0.354-0.381; before the 16-byte accesses 0.372 at this tile and 0.726 at 2048 x 8
# (140 registers: one program an SM). kernels/README.md.
BLOCK, ITERS, WARPS = 1024, 16, 8
CHUNK = BLOCK * ITERS
# host tables a captured launch reads at every replay (kept alive while the process lives)
_CAPTURED: list[torch.Tensor] = []
_COPY_DTYPES = {torch.bfloat16: 1, torch.float16: 2}


@triton.jit(do_not_specialize=["NT"])
def _adamw_multi_kernel(
    Tab, Sq, NT, Base, BaseC, lr, beta1, beta2, log2_beta1, log2_beta2, eps, weight_decay,
    SEARCH: tl.constexpr, COPY: tl.constexpr, ALIGNED: tl.constexpr, MARKS: tl.constexpr,
    BLOCK: tl.constexpr, ITERS: tl.constexpr,
):  # fmt: skip
    """Chunk `pid - first` (ITERS blocks of BLOCK elements) of the tensor whose table row holds
    the last first program at or below `pid`: its gradient's squared sum into `Sq[pid]`,
    then AdamW on its marked elements (step count already advanced), and the copy where the
    row has one (`COPY`: 1 bf16, 2 fp16, 0 no copy in this launch). The tensors are reached
    as offsets from `Base` (fp32) and `BaseC` (the copies' dtype), which carry the launch's
    alignment; `ALIGNED`: every tensor of the launch starts 16-byte aligned and holds a
    multiple of 4 elements. `MARKS`: some tensor of the launch has row marks (without, the
    mask stays the bounds' alone, whose alignment the compiler can see)."""
    pid = tl.program_id(0)
    lo = pid * 0
    hi = lo + NT
    for _ in tl.static_range(SEARCH):  # Tab[lo].first <= pid < Tab[hi].first
        mid = (lo + hi) // 2
        go = tl.load(Tab + mid.to(tl.int64) * 11 + 10) <= pid
        lo = tl.where(go, mid, lo)
        hi = tl.where(go, hi, mid)
    row = Tab + lo.to(tl.int64) * 11
    # ALIGNED: the offsets and the size are stored in units of 4 elements, so that the
    # compiler knows them multiples of 4 (16-byte accesses) from the multiplication
    UNIT: tl.constexpr = 4 if ALIGNED else 1
    P = Base + tl.load(row) * UNIT
    G = Base + tl.load(row + 1) * UNIT
    M = Base + tl.load(row + 2) * UNIT
    V = Base + tl.load(row + 3) * UNIT
    C = BaseC + tl.load(row + 4) * UNIT
    has_copy = tl.load(row + 5) != 0
    marks = tl.load(row + 6)
    Step = tl.load(row + 7).to(tl.pointer_type(tl.float32))
    numel = tl.load(row + 8) * UNIT
    width = tl.load(row + 9)
    base = (pid - tl.load(row + 10)).to(tl.int64) * (BLOCK * ITERS)
    sq = tl.full((BLOCK,), 0.0, tl.float32)
    for k in range(ITERS):
        offs = base + k * BLOCK + tl.arange(0, BLOCK)
        mask = offs < numel
        g = tl.load(G + offs, mask=mask, other=0.0)
        sq += g * g
        if MARKS:  # noqa: SIM102 (the constexpr branch apart from the runtime one)
            if marks != 0:  # rows marked for the update: the others keep values and moments
                mark = tl.load(
                    marks.to(tl.pointer_type(tl.int8)) + offs // width, mask=mask, other=0
                )
                mask = mask & (mark != 0)
        p = _adamw_tile(P + offs, M + offs, V + offs, mask, g, Step, lr, beta1, beta2,
                        log2_beta1, log2_beta2, eps, weight_decay)  # fmt: skip
        if COPY != 0:  # noqa: SIM102 (the constexpr branch apart from the runtime one)
            if has_copy:
                tl.store(C + offs, p.to(BaseC.dtype.element_ty), mask=mask)
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
    if not runs_kernel(params[0]):
        return adamw_multi_reference_(
            params, grads, exp_avgs, exp_avg_sqs, steps, **hyper, rows=rows, copies=copies
        )
    dtypes = {c.dtype for c in copies if c is not None}
    copy_dtype = dtypes.pop() if dtypes else None
    items = list(zip(params, grads, exp_avgs, exp_avg_sqs, steps, rows, copies, strict=True))
    # the tensors whose every array starts 16-byte aligned and whose size is a multiple of 4
    # (vectorised loads: one launch), and the others (a second launch, if any)
    aligned = [_is_aligned(item) for item in items]
    sq = None
    for flag in (True, False):
        group = [item for item, a in zip(items, aligned, strict=True) if a == flag]
        if group:
            part = _launch(group, flag, copy_dtype, hyper)
            sq = part if sq is None else sq + part
    return sq


def _is_aligned(item) -> bool:
    p, g, m, v, _, _, c = item
    ts = (p, g, m, v) if c is None else (p, g, m, v, c)
    return p.numel() % 4 == 0 and all(t.data_ptr() % 16 == 0 for t in ts)


def _launch(items, aligned: bool, copy_dtype, hyper) -> torch.Tensor:
    """One kernel launch over `items` (`(param, grad, exp_avg, exp_avg_sq, step, rows, copy)`
    each); their gradients' squared sum."""
    device = items[0][0].device
    base = items[0][0]
    copies = [item[6] for item in items if item[6] is not None]
    base_c = copies[0] if copies else _dummy(device, copy_dtype or torch.bfloat16)
    table, first = [], 0
    unit = 4 if aligned else 1  # the kernel's UNIT: offsets and sizes in units of 4 elements
    for p, g, m, v, s, r, c in items:
        numel = p.numel()
        width = numel // p.shape[0] if p.dim() and p.shape[0] else 1
        table.append([
            *((t.data_ptr() - base.data_ptr()) // (4 * unit) for t in (p, g, m, v)),
            (c.data_ptr() - base_c.data_ptr()) // (c.element_size() * unit) if c is not None
            else 0,
            int(c is not None), r.data_ptr() if r is not None else 0, s.data_ptr(),
            numel // unit, max(width, 1), first,
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
    copy = _COPY_DTYPES[copy_dtype] if copy_dtype is not None else 0
    b1, b2 = hyper["beta1"], hyper["beta2"]
    with torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext():
        _adamw_multi_kernel[(programs,)](
            tab, sq, len(items), base, base_c, hyper["lr"], b1, b2,
            math.log2(b1) if b1 > 0 else -math.inf, math.log2(b2) if b2 > 0 else -math.inf,
            hyper["eps"], hyper["weight_decay"], SEARCH=_search(len(items)), COPY=copy,
            ALIGNED=aligned, MARKS=any(item[5] is not None for item in items), BLOCK=BLOCK,
            ITERS=ITERS, num_warps=WARPS,
        )  # fmt: skip
    return sq.sum()


_DUMMY: dict[tuple[torch.device, torch.dtype], torch.Tensor] = {}


def _dummy(device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """A one-element tensor of `dtype`: the copy base of a launch without copies (unread)."""
    key = (device, dtype)
    if key not in _DUMMY:
        _DUMMY[key] = torch.zeros(1, dtype=dtype, device=device)
    return _DUMMY[key]


def compile_adamw_multi(
    params: list[torch.Tensor],
    exp_avgs: list[torch.Tensor],
    exp_avg_sqs: list[torch.Tensor],
    copies: list[torch.Tensor | None] | None = None,
    rows: bool = False,
) -> None:
    """Compile the kernels `adamw_multi_` launches for these tensors (`rows`: with row marks)
    without running them: before a CUDA graph capture, which should not be where a kernel is
    first built. The gradients, not yet made, are taken to be aligned as fresh allocations
    are. A no-op where the kernel does not run compiled."""
    if not params or params[0].device.type != "cuda" or _INTERPRET:
        return
    device = params[0].device
    copies = copies if copies is not None else [None] * len(params)
    dtypes = {c.dtype for c in copies if c is not None}
    copy = _COPY_DTYPES[dtypes.pop()] if dtypes else 0
    items = [
        (p, p, m, v, None, None, c)
        for p, m, v, c in zip(params, exp_avgs, exp_avg_sqs, copies, strict=True)
    ]
    aligned = [_is_aligned(item) for item in items]
    sq = torch.empty(1, dtype=torch.float32, device=device)
    dummy = _dummy(device, torch.bfloat16 if copy != 2 else torch.float16)
    for flag in (True, False):
        n = sum(a == flag for a in aligned)
        if not n:
            continue
        tab = torch.zeros((n, _COLS), dtype=torch.int64, device=device)
        with torch.cuda.device(device):
            _adamw_multi_kernel.warmup(
                tab, sq, n, params[0], dummy, 1e-3, 0.9, 0.999, math.log2(0.9),
                math.log2(0.999), 1e-8, 0.0, SEARCH=_search(n), COPY=copy, ALIGNED=flag,
                MARKS=rows, BLOCK=BLOCK, ITERS=ITERS, num_warps=WARPS, grid=(1,),
            )  # fmt: skip


def _search(n: int) -> int:
    """The binary search's steps over `n` table rows, in a few sizes (each a compiled
    variant): enough for 8, 128 or 2048 tensors, then the exact count."""
    for steps, most in ((4, 8), (8, 128), (12, 2048)):
        if n <= most:
            return steps
    return math.ceil(math.log2(n)) + 1


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
