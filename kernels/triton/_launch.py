"""Host-side launch of the HSTU attention kernels: interpret-mode flag, block sizes, input
normalisation and the forward / backward implementations behind the torch.library ops."""

import contextlib
import functools
import os
from dataclasses import dataclass

import numpy as np
import torch
import triton

from ..schedule import pairs, schedule
from ..tiles import KERNELS, launch_lead
from ._backward import (
    _hstu_bwd_dkdv_kernel,
    _hstu_bwd_dq_kernel,
    _hstu_bwd_dq_stored_kernel,
    _hstu_bwd_fused_kernel,
)
from ._common import _schedule_kernel, _time_range_kernel, _zero_tail_kernel
from ._forward import _hstu_fwd_kernel

# ----------------------------------------------------------------------------------------------
# Launch helpers
# ----------------------------------------------------------------------------------------------


# decided when the kernels were decorated (TRITON_INTERPRET=1 at import); a plain bool so that
# torch.compile can read it without tracing into the kernel object
_INTERPRET = type(_hstu_fwd_kernel).__name__ == "InterpretedFunction"


def is_interpret_mode() -> bool:
    """True when the kernels of this module were built for the Triton CPU interpreter."""
    return _INTERPRET


@dataclass(frozen=True)
class BlockSizes:
    """Tiling tunables. ``block_m``: query rows per tile, ``block_n``: key rows per tile.
    ``lead``: the launch order over the heaviest-first schedule (``kernels/schedule.py``),
    which the GPU dispatches in turn: its first ``lead`` entries with their heads together, the
    rest head by head (0: all head by head); None: the kernel's measured default, the forward
    0, dq and dk / dv every entry with its heads (kernels/README.md, "Dispatch order"; the
    Mosaic kernels' ``MosaicTiles.lead`` is the same knob with the same defaults)."""

    block_m: int = 64
    block_n: int = 64
    num_warps: int = 4
    num_stages: int = 2
    lead: int | None = None

    def __post_init__(self) -> None:
        for name in ("block_m", "block_n"):
            val = getattr(self, name)
            if not isinstance(val, int) or val < 16 or val & (val - 1):
                raise ValueError(f"BlockSizes.{name} must be a power of two >= 16, got {val!r}")
        if not isinstance(self.num_warps, int) or self.num_warps < 1:
            raise ValueError(f"BlockSizes.num_warps must be a positive int, got {self.num_warps!r}")
        if not isinstance(self.num_stages, int) or self.num_stages < 1:
            raise ValueError(
                f"BlockSizes.num_stages must be a positive int, got {self.num_stages!r}"
            )
        if self.lead is not None and (not isinstance(self.lead, int) or self.lead < 0):
            raise ValueError(f"BlockSizes.lead must be None or an int >= 0, got {self.lead!r}")


INTERPRET_BLOCK_SIZES = BlockSizes(16, 16, 1, 1)


# the backward modes (``hstu_attention(..., backward=)``): "split" runs the dk/dv and the dq
# kernels (deterministic), "fused" one key-major kernel that also adds dq atomically in fp32,
# "stored" the dk/dv kernel storing dS (16-bit) and a dq kernel that reads it (deterministic)
BACKWARDS = ("split", "fused", "stored")
# kernels with tiles of their own: the three of the split path (``KERNELS``), the fused one
# and the dq kernel of "stored"
TILE_KERNELS = (*KERNELS, "fused", "dq_stored")
# "stored" keeps dS as ``[H, T, W]`` in the inputs' dtype, W = max_seqlen rounded up to 64 (a
# sample's key rows hold its queries; only the pairs its tiles visit are written): it runs
# "split" where that buffer would pass this many bytes
STORED_DS_MAX_BYTES = 4 << 30


# bf16 / fp16 tiles per head dim (the larger of Dqk and Dv, rounded up to a power of two) and
# kernel, from `python -m hstu_kernels.triton.tune` on an H200 (table in kernels/README.md).
# Wider heads hold larger accumulators per row: the backward kernels' fp32 dk/dv (two [N, D]
# tiles) and dq spill at D=256 with 64-row tiles on 4 warps. "fused" (not swept by tune yet):
# the fused kernel also holds a [M, D] fp32 dq tile, so at D=256 it wants fewer query rows than
# dkdv's 64 x 32 on 4 warps (6.3 KB of spills per thread, 2x the backward time of the tiles
# below in a first probe on one H100); wide key blocks halve the dq atomics per pair. The
# D=256 forward: 64 x 64 x 4 x 3 since it launches head by head (-17 % on the jagged batch,
# 8 x 4096 level; 128 x 64 x 8 x 2 before, faster on batches of short equal samples).
_TUNED = {
    64: {"fwd": BlockSizes(64, 64, 4, 3), "dkdv": BlockSizes(64, 64, 4, 2),
         "dq": BlockSizes(64, 64, 4, 2),  # not swept yet: the D=128 tiles of the last round
         "fused": BlockSizes(64, 64, 4, 2), "dq_stored": BlockSizes(64, 64, 4, 3)},
    128: {"fwd": BlockSizes(64, 32, 4, 3), "dkdv": BlockSizes(32, 64, 4, 2),
          "dq": BlockSizes(64, 64, 4, 2), "fused": BlockSizes(64, 128, 8, 2),
          "dq_stored": BlockSizes(64, 64, 4, 3)},
    256: {"fwd": BlockSizes(64, 64, 4, 3), "dkdv": BlockSizes(64, 32, 4, 2),
          "dq": BlockSizes(64, 32, 4, 3), "fused": BlockSizes(32, 64, 8, 2),
          "dq_stored": BlockSizes(64, 32, 4, 3)},
}  # fmt: skip
# backward mode per head dim for 16-bit inputs on CUDA (one H200, forward + backward,
# kernels/README.md): "stored" at D=256, where the split dq kernel is register-bound (-7.6 %
# on the bench_upstream batches, -9 % on 8 x 4096); "split" at 128 (stored level to 8 %
# slower) and 64 (9-33 % slower). "fused" trails split by 16 % at 256 on the recipe's batches.
# The dq_stored tiles at 64 / 128 are not swept (that backward is not their default).
_DEFAULT_BACKWARD = {64: "split", 128: "split", 256: "stored"}


# dq tiles where it also reduces bias-table gradients (the per-bucket sums of the time table,
# the position table's atomics): the 64 x 64 tiles spill in that loop. One H100, 4 x 4096
# tokens, 4 heads, dq kernel with rab_time gradients, float64 buckets, 16 / 32 buckets:
# head dim 128 2.48 / 1.33 ms (64 x 64) vs 0.97 / 0.97 ms (64 x 32, 3 stages); head dim 64
# 0.95 / 1.17 vs 0.72 / 0.73 ms. Without table gradients 64 x 64 stays the faster (head dim
# 128: 0.44 vs 0.45 ms). Head dim 256 already takes 64 x 32 x 3 stages.
_TUNED_DQ_TABLE_GRADS = {64: BlockSizes(64, 32, 4, 3), 128: BlockSizes(64, 32, 4, 3)}


@functools.cache
def default_block_sizes(
    dim: int, kernel: str, dtype: torch.dtype = torch.bfloat16, table_grads: bool = False
) -> BlockSizes:
    """Tiles of kernel ``fwd`` / ``dkdv`` / ``dq`` / ``fused`` for head dim ``dim``: tiny tiles
    in interpret mode, small FMA tiles for fp32, the tuned table for 16-bit inputs on CUDA
    (``table_grads``: the dq kernel also reduces bias-table gradients)."""
    if kernel not in TILE_KERNELS:
        raise ValueError(f"kernel must be one of {TILE_KERNELS}, got {kernel!r}")
    if is_interpret_mode():
        return INTERPRET_BLOCK_SIZES
    if dtype == torch.float32:  # exact (non-tf32) dots are lowered to FMAs
        return BlockSizes(64, 32, 4, 1) if kernel == "fwd" else BlockSizes(32, 32, 4, 1)
    if dim > 256:
        return BlockSizes(32, 32, 8, 1)  # untuned: small tiles keep the accumulators in registers
    key = max(64, triton.next_power_of_2(dim))
    if kernel == "dq" and table_grads and key in _TUNED_DQ_TABLE_GRADS:
        return _TUNED_DQ_TABLE_GRADS[key]
    return _TUNED[key][kernel]


def default_backward(dim: int, dtype: torch.dtype = torch.bfloat16) -> str:
    """The backward mode ``hstu_attention(backward=None)`` runs for head dim ``dim``: from
    ``_DEFAULT_BACKWARD`` for 16-bit inputs on CUDA, "split" otherwise."""
    if is_interpret_mode() or dtype == torch.float32 or dim > 256:
        return "split"
    return _DEFAULT_BACKWARD[max(64, triton.next_power_of_2(dim))]


def check_backward(backward) -> str:
    """``backward`` if it names a backward mode, else a ValueError naming it."""
    if not isinstance(backward, str) or backward not in BACKWARDS:
        raise ValueError(f"backward must be None or one of {BACKWARDS}, got {backward!r}")
    return backward


# The kernels named here read a sample's rows through tensor descriptors (TMA) where the
# hardware has them (sm_90+; the interpreter emulates them) and the inputs allow them, else
# through pointer tiles. HSTU_TRITON_TMA: "1" (the default set: the forward and dq, measured
# faster on an H200), "0" (pointer loads everywhere: A/B, or a Triton whose descriptors
# misbehave), or a comma-separated list of kernels among fwd, dkdv, dq, fused.
_TMA_DEFAULT = frozenset({"fwd", "dq"})


def _tma_kernels(setting: str) -> frozenset[str]:
    """The kernels an ``HSTU_TRITON_TMA`` value turns descriptors on for."""
    setting = setting.strip()
    if setting in ("", "1"):
        return _TMA_DEFAULT
    if setting == "0":
        return frozenset()
    names = frozenset(x.strip() for x in setting.split(",") if x.strip())
    unknown = names - set(TILE_KERNELS)
    if unknown:
        raise ValueError(
            f"HSTU_TRITON_TMA: unknown kernel(s) {sorted(unknown)}; expected 0, 1 or a "
            f"comma-separated list of {TILE_KERNELS}"
        )
    return names


_TMA_KERNELS = _tma_kernels(os.environ.get("HSTU_TRITON_TMA", "1"))


def _scratch(size: int, alignment: int, stream) -> torch.Tensor:
    """Global scratch for device-made tensor descriptors, on the current device (the launches
    run under ``_device_ctx``); a CUDA graph capture takes it from the graph's pool."""
    device = "cpu" if is_interpret_mode() else "cuda"
    return torch.empty(size, dtype=torch.int8, device=device)


def _ensure_allocator() -> None:
    """Give Triton an allocator in this thread if it has none: descriptors made by a program
    need scratch, and Triton keeps its allocator per thread (a context variable), so
    autograd's backward thread starts without the one a caller may have set elsewhere."""
    from triton.runtime import _allocation

    current = getattr(_allocation, "_allocator", None)
    if current is None or isinstance(current.get(), _allocation.NullAllocator):
        triton.set_allocator(_scratch)


def use_tma(kernel: str, *tensors: torch.Tensor) -> bool:
    """Whether ``kernel`` loads ``tensors`` ([T, H, D] each) through tensor descriptors:
    enabled for it (``HSTU_TRITON_TMA``), on sm_90+ (or the interpreter), with 16-byte
    aligned base pointers and row / head strides and a contiguous last dim, as TMA requires."""
    return kernel in _TMA_KERNELS and tma_capable(*tensors)


def tma_capable(*tensors: torch.Tensor) -> bool:
    """Whether TMA can read ``tensors`` ([T, H, D] each): on sm_90+ (or the interpreter), with
    16-byte aligned base pointers and row / head strides and a contiguous last dim."""
    first = tensors[0]
    if not is_interpret_mode() and (
        not first.is_cuda or torch.cuda.get_device_capability(first.device)[0] < 9
    ):
        return False
    for t in tensors:
        size = t.element_size()
        if t.data_ptr() % 16 or t.stride(-1) != 1:
            return False
        if (t.stride(0) * size) % 16 or (t.stride(1) * size) % 16:
            return False
    return True


def _block_d(d: int) -> int:
    return max(16, triton.next_power_of_2(d))


def _precision(dtype: torch.dtype):
    if dtype == torch.bfloat16 and is_interpret_mode():
        return "upcast"
    return "ieee" if dtype == torch.float32 else None


def _device_ctx(t: torch.Tensor):
    """Make t's GPU current for the launch (Triton launches on the current device)."""
    if t.is_cuda and t.device.index != torch.cuda.current_device():
        return torch.cuda.device(t.device)
    return contextlib.nullcontext()


def _prep(seq_offsets, num_contextual, num_candidates, timestamps, rab_pos, rab_time, dummy):
    """Normalise optional integer / table inputs to what the kernels load."""
    seq_offsets = seq_offsets.to(torch.int64).contiguous()
    nc = num_contextual.to(torch.int32).contiguous() if num_contextual is not None else dummy
    nk = num_candidates.to(torch.int32).contiguous() if num_candidates is not None else dummy
    ts = timestamps.to(torch.int64).contiguous() if rab_time is not None else dummy
    rp = rab_pos.contiguous() if rab_pos is not None else dummy
    rt = rab_time.contiguous() if rab_time is not None else dummy
    return seq_offsets, nc, nk, ts, rp, rt


def _time_range(ts: torch.Tensor, so: torch.Tensor) -> torch.Tensor:
    """int64 ``[2]``: the smallest timestamp of the batch's tokens and the bitwise NOT of the
    largest, on the device without a host sync. The kernels take float64 time buckets relative
    to the smallest where the two are less than 2^53 apart, else exact int64 ones."""
    rng = torch.full((2,), torch.iinfo(torch.int64).max, dtype=torch.int64, device=ts.device)
    if ts.shape[0]:
        _time_range_kernel[(triton.cdiv(ts.shape[0], 1024),)](
            ts, so, so.shape[0] - 1, rng, BLOCK=1024, num_warps=4
        )
    return rng


def _last_dim_contiguous(x: torch.Tensor) -> torch.Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()


def _time_paths(rt_) -> tuple[int, ...]:
    """HAS_TIME of each launch of a kernel: none without a time table; with one, the float64
    path and the integer one (int32 math for tables of <= 31 buckets), of which each program
    runs the one its launch's timestamp span calls for (``_time_path``)."""
    return (0,) if rt_ is None else (3, 1 if rt_.shape[1] <= 31 else 2)


def _common_meta(q, v, nc_, nk_, rp_, has_time: int, bs: BlockSizes) -> dict:
    """Constexpr / launch meta-parameters shared by the three kernels."""
    fast = q.is_cuda and q.dtype in (torch.bfloat16, torch.float16) and not is_interpret_mode()
    return dict(
        DQK=q.shape[2], DV=v.shape[2], BLOCK_DQK=_block_d(q.shape[2]),
        BLOCK_DV=_block_d(v.shape[2]), BLOCK_M=bs.block_m, BLOCK_N=bs.block_n,
        HAS_CTX=nc_ is not None, HAS_CAND=nk_ is not None, HAS_POS=rp_ is not None,
        HAS_TIME=has_time, PREC=_precision(q.dtype), FAST=fast,
        num_warps=bs.num_warps, num_stages=bs.num_stages,
    )  # fmt: skip


# the schedule tables built inside ``shared_schedules()``, by launch: None outside
_SHARED: dict | None = None


@contextlib.contextmanager
def shared_schedules(share: bool = True):
    """Inside, each schedule table is built once and reused by every launch with the same
    sequence offsets (the same tensor, unchanged), rows and block: the layers of a step share
    one offsets tensor, so a step builds three tables (forward, dq, dk / dv) instead of three a
    layer. Wrap one step's forward and backward (or their capture into a CUDA graph, whose
    replays run the one recorded table kernel each step); the tables are dropped on exit, and
    whenever a CUDA graph capture starts or ends in between (a graph must not read a table its
    replays do not rebuild; one capture per context, as the step graphs make them). A nested
    use has tables of its own; `share=False`: none shared inside (each launch builds its own),
    e.g. around a forward graph and a backward graph captured one after the other, where the
    second must not read a table of the first."""
    global _SHARED
    outer, _SHARED = _SHARED, ({} if share else None)
    try:
        yield
    finally:
        _SHARED = outer


def _schedule(
    so: torch.Tensor, T: int, H: int, max_seqlen: int, block: int, key_major: bool,
    on_device: bool | None = None,
):  # fmt: skip
    shared = _SHARED
    if shared is None:
        return _build_schedule(so, T, H, max_seqlen, block, key_major, on_device)
    # the offsets by their memory and version (views share it; an in-place write bumps it):
    # the entry holds the tensor, so that memory is not another tensor's while it lives
    where = (so.device, so.data_ptr(), so.numel(), so._version)
    key = (*where, T, max_seqlen, block, key_major, on_device)
    # a capture starting or ending drops what was built before it (those tables' kernels
    # are outside the graph, or in one that is done)
    capturing = so.is_cuda and torch.cuda.is_current_stream_capturing()
    if shared.get("capturing", capturing) != capturing:
        shared.clear()
    shared["capturing"] = capturing
    if key not in shared:
        shared[key] = (so, _build_schedule(so, T, H, max_seqlen, block, key_major, on_device))
    _, table, G = shared[key][1]
    return (G * H,), table, G


def _build_schedule(
    so: torch.Tensor, T: int, H: int, max_seqlen: int, block: int, key_major: bool,
    on_device: bool | None = None,
):  # fmt: skip
    """Grid and schedule table of a launch over blocks of ``block`` rows: one program per head
    and (block, sample) pair that can hold tokens, heaviest first (``kernels/schedule.py``).
    Returns ``((programs,), table, G)``. The table (int32 ``[3 G]``) is filled on the device by
    ``_schedule_kernel`` (one small launch; no host sync, so CUDA graphs capture it); in the
    interpreter (``on_device=None``) by the numpy reference instead, whose equality with the
    kernel is tested: interpreting the kernel's programs one by one would double the time of
    the CPU test suite's training runs."""
    B = so.shape[0] - 1
    num_levels = triton.cdiv(max_seqlen, block)
    G = pairs(T, B, max_seqlen, block)
    if on_device is False or (on_device is None and is_interpret_mode()):
        ref = schedule(np, so.cpu().numpy(), max_seqlen, G, block, key_major)
        return (G * H,), torch.from_numpy(np.concatenate(ref)).to(so.device), G
    table = torch.empty(3 * G, device=so.device, dtype=torch.int32)
    _schedule_kernel[(G,)](
        table, so, B, num_levels, max(num_levels - 1, 0).bit_length(), G,
        BLOCK=block, BLOCK_B=max(16, triton.next_power_of_2(B)), KEY_MAJOR=key_major,
        num_warps=1,
    )  # fmt: skip
    return (G * H,), table, G


def _ds_width(max_seqlen: int) -> int:
    """The row width of "stored"'s dS buffer: ``max_seqlen`` rounded up to 64 (128-byte rows
    for 16-bit dS, so its tiles can be read through descriptors)."""
    return triton.cdiv(max(max_seqlen, 1), 64) * 64


def stored_ds_bytes(T: int, H: int, max_seqlen: int, dtype: torch.dtype = torch.bfloat16) -> int:
    """Bytes of the dS buffer the "stored" backward allocates for ``T`` rows, ``H`` heads and
    samples of at most ``max_seqlen`` tokens (``[H, T, W]``, ``_ds_width``): it bounds the
    pairs of any batch of those rows, since a sample's n rows hold n * n <= n * max_seqlen."""
    return H * T * _ds_width(max_seqlen) * torch.empty((), dtype=dtype).element_size()


def _ds_buffer(H: int, T: int, max_seqlen: int, like: torch.Tensor) -> torch.Tensor:
    """The uninitialised dS buffer of "stored" (the dq kernel reads only what the dk/dv kernel
    wrote, and masks the rest: tests fill it with NaN)."""
    return torch.empty((H, T, _ds_width(max_seqlen)), dtype=like.dtype, device=like.device)


# rows per program of the capacity padding's zeros, in ``_zero_tail`` and in the attention
# kernels' tail programs (``_tail_meta``)
TAIL_ROWS = 64


def _tail_meta(x: torch.Tensor, zero: bool) -> dict:
    """Meta-parameters of an attention launch that zeros (``zero``) the capacity padding of
    ``x [T, H, D]`` (rows past the last sample, which no attention program writes) in tail
    programs past its scheduled ones (``_tail_program``) instead of a launch of its own:
    ``programs``, how many to add to the grid, then the kernel's constexprs."""
    T, H, D = x.shape
    return dict(
        programs=triton.cdiv(T, TAIL_ROWS) if zero else 0,
        ZERO_TAIL=zero,
        TAIL_ROWS=TAIL_ROWS,
        TAIL_COLS=min(256, triton.next_power_of_2(max(H * D, 1))),
    )


def _zero_tail(x: torch.Tensor, so: torch.Tensor) -> None:
    """Zero the rows of ``x [T, H, D]`` past the last sample (``so[-1]``): the capacity
    padding, which no attention program writes. On the device without a host sync (CUDA
    graphs capture it); in the interpreter with torch."""
    T, H, D = x.shape
    if is_interpret_mode():
        x[int(so[-1]) :] = 0
        return
    if T:
        _zero_tail_kernel[(triton.cdiv(T, TAIL_ROWS),)](
            x, so, so.shape[0] - 1, T, x.stride(0), x.stride(1), H, D,
            BLOCK_R=TAIL_ROWS, BLOCK_C=min(256, triton.next_power_of_2(H * D)), num_warps=4,
        )  # fmt: skip


def _tail_spans(xs) -> list[torch.Tensor]:
    """The tensors whose capacity padding zeroes ``xs``' ([T, H, D] each): one ``[T, 1,
    width]`` view where they are adjacent column ranges of the rows of one buffer (the
    backward's dq, dk, dv written into the uvqk gradient), else ``xs`` themselves."""
    spans = sorted(xs, key=lambda x: x.data_ptr())
    first = spans[0]
    width = sum(x.shape[1] * x.shape[2] for x in spans)
    adjacent = (
        all(
            x.dtype == first.dtype
            and x.shape[0] == first.shape[0]
            and x.stride(0) == first.stride(0)
            and x.stride(1) == x.shape[2]
            and x.data_ptr() == y.data_ptr() + y.shape[1] * y.shape[2] * y.element_size()
            for y, x in zip(spans, spans[1:])
        )
        and first.stride(1) == first.shape[2]
        and width <= first.stride(0)
    )
    if not adjacent:
        return list(xs)
    return [first.as_strided((first.shape[0], 1, width), (first.stride(0), width, 1))]


def _outputs(like, out: torch.Tensor | None) -> torch.Tensor:
    """``out`` (a caller's buffer, e.g. columns of a wider one) checked against ``like``'s
    shape and dtype, or a new contiguous tensor; its rows are all written by the kernels and
    ``_zero_tail``."""
    if out is None:
        return torch.empty(like.shape, dtype=like.dtype, device=like.device)
    if out.shape != like.shape or out.dtype != like.dtype or out.stride(-1) != 1:
        raise ValueError(
            f"out: expected shape {tuple(like.shape)}, dtype {like.dtype} and a contiguous last "
            f"dim, got {tuple(out.shape)}, {out.dtype}, strides {out.stride()}"
        )
    return out


def _table_grad_modes(
    pos_grad: bool, time_grad: bool, dim: int, num_pos: int, max_seqlen: int
) -> tuple[int, int]:
    """How the dq kernel reduces the bias-table gradients, (POS_GRAD, TIME_GRAD).

    rab_pos: 0 none; 1 one atomic per pair (``num_pos >= max_seqlen``: no pair is clamped
    into the last bucket); 2 the same below the clamped last bucket, whose pairs are summed
    per tile; 3 each tile's diagonals summed first, one atomic per diagonal, through a gather
    (registers and shuffles). rab_time: 0 none; 1 a CTA-wide sum per bucket per tile; 2 a
    row sum per bucket into a [BLOCK_M, BLOCK_TB] accumulator (no cross-warp sum per bucket,
    a tile's worth of registers more). Measured at head dims 128 and 32 on an H200 and an
    H100, dq kernel (``bench_bias --kernels``; docs/BENCHMARKS.md): the gather and the
    accumulator pay where the registers are there and spill beside each other at head dim
    128, so the diagonals go with no time gradient only, and at head dim > 64 (64 itself
    not measured) the accumulator with no position gradient only."""
    pos = 0
    if pos_grad:
        pos = (1 if num_pos >= max_seqlen else 2) if time_grad else 3
    time = (1 if pos_grad and dim > 64 else 2) if time_grad else 0
    return pos, time


def _block_tb(num_buckets: int, time_mode: int, bs: BlockSizes) -> int:
    """The dq kernel's time-gradient width: a power of two >= the buckets, and with the
    accumulator (mode 2) >= the key tile, so it shares the scores' register layout."""
    width = max(16, triton.next_power_of_2(num_buckets))
    return max(width, bs.block_n) if time_mode == 2 else width


def _fwd_impl(q, k, v, seq_offsets, max_seqlen, alpha, normalizer, nc_, nk_, ts_, rp_, rt_, bs):
    q, k, v = (_last_dim_contiguous(x) for x in (q, k, v))
    T, H, _ = q.shape
    out = torch.empty(T, H, v.shape[2], device=q.device, dtype=q.dtype)
    B = seq_offsets.shape[0] - 1
    num_m = triton.cdiv(max_seqlen, bs.block_m)
    if B <= 0 or H == 0 or num_m == 0:
        return out.zero_()
    so, nc, nk, ts, rp, rt = _prep(seq_offsets, nc_, nk_, ts_, rp_, rt_, seq_offsets)
    P = rp_.shape[1] if rp_ is not None else 1
    TB = rt_.shape[1] if rt_ is not None else 1
    tma = use_tma("fwd", q, k, v)
    with _device_ctx(q):
        if tma:
            _ensure_allocator()
        grid, table, G = _schedule(so, T, H, max_seqlen, bs.block_m, key_major=False)
        tsr = _time_range(ts, so) if rt_ is not None else so
        for i, has_time in enumerate(_time_paths(rt_)):
            # the first launch also zeros out's capacity padding (``_tail_meta``)
            tail = _tail_meta(out, i == 0)
            _hstu_fwd_kernel[(grid[0] + tail.pop("programs"),)](
                q, k, v, out, so, nc, nk, ts, tsr, rp, rt,
                q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
                out.stride(0), out.stride(1),
                rp.stride(0) if rp_ is not None else 0, rt.stride(0) if rt_ is not None else 0,
                table, G, launch_lead("fwd", bs.lead, G), H, P, TB, float(alpha),
                1.0 / float(normalizer), B, T, TMA=tma, **tail,
                **_common_meta(q, v, nc_, nk_, rp_, has_time, bs),
            )  # fmt: skip
    return out


def _bwd_impl(
    grad_out, q, k, v, seq_offsets, max_seqlen, alpha, normalizer, nc_, nk_, ts_, rp_, rt_,
    need_rp, need_rt, bs, backward="split", out=None, silu=None,
):  # fmt: skip
    """``bs``: the (dk/dv, dq) kernels' BlockSizes; ``backward``: "split", "fused" (the dk/dv
    tiles, one launch, dq added atomically into an fp32 buffer) or "stored" (the dk/dv kernel
    stores dS, the dq kernel of ``bs[1]``'s tiles reads it: ``stored_ds_bytes``). "fused" and
    "stored" run split where a bias-table gradient is needed: the dq kernel reduces those;
    "stored" also where its buffer would pass ``STORED_DS_MAX_BYTES``. ``out``: None, or the
    (dq, dk, dv) tensors to write, any row / head strides (columns of one buffer: the caller
    then needs no concatenation); returned as given.

    ``silu``: None, or ``(pre_q, pre_k, pre_v)`` with q, k, v = silu of them, each laid out
    as its activation (same strides): the kernels then write the pre-activations' gradients
    (SiLU's backward in their epilogues, split and stored backward only) and the bias
    gradient's column sums per program, returned sixth as fp32 ``(part_q [Gq, H Dqk],
    part_k [Gkv, H Dqk], part_v [Gkv, H Dv])``: each column's sum over the rows of its part
    is that column's bias gradient (``linear_silu.sum_partials``)."""
    dkdv_bs, dq_bs = bs
    check_backward(backward)
    if silu is not None:
        if backward == "fused":
            raise ValueError(
                "silu's backward runs in the split and stored kernels only, got 'fused'"
            )
        for name, x, pre in zip("qkv", (q, k, v), silu, strict=True):
            if pre.shape != x.shape or pre.stride() != x.stride() or pre.dtype != x.dtype:
                raise ValueError(
                    f"silu's pre-activation of {name} must be laid out as {name} (shape "
                    f"{tuple(x.shape)}, strides {x.stride()}, {x.dtype}), got "
                    f"{tuple(pre.shape)}, {pre.stride()}, {pre.dtype}"
                )
    q, k, v = (_last_dim_contiguous(x) for x in (q, k, v))
    grad_out = _last_dim_contiguous(grad_out.to(q.dtype))
    T, H, _ = q.shape
    dq_out, dk, dv = (_outputs(x, o) for x, o in zip((q, k, v), out or (None,) * 3, strict=True))
    pos_grad, time_grad = rp_ is not None and need_rp, rt_ is not None and need_rt
    fused = backward == "fused" and not (pos_grad or time_grad)
    stored = (
        backward == "stored"
        and not (pos_grad or time_grad)
        and stored_ds_bytes(T, H, max_seqlen, q.dtype) <= STORED_DS_MAX_BYTES
    )
    f32 = dict(device=q.device, dtype=torch.float32)
    # fused: dq accumulates unscaled in fp32 ([T, H, Dqk], contiguous) and is scaled by alpha
    # and cast after the kernel; split: the dq kernel stores it scaled
    dq = torch.zeros(q.shape, **f32) if fused else dq_out
    drp = torch.zeros(rp_.shape, **f32) if pos_grad else torch.empty(0, **f32)
    drt = torch.zeros(rt_.shape, **f32) if time_grad else torch.empty(0, **f32)
    B = seq_offsets.shape[0] - 1
    num_m = triton.cdiv(max_seqlen, dq_bs.block_m)
    parts = None
    if silu is not None:  # zeros: programs without rows, and empty launches, add nothing
        parts = [torch.zeros((0, H * x.shape[2]), **f32) for x in (q, k, v)]
    if B > 0 and H > 0 and num_m > 0:
        so, nc, nk, ts, rp, rt = _prep(seq_offsets, nc_, nk_, ts_, rp_, rt_, seq_offsets)
        P = rp_.shape[1] if rp_ is not None else 1
        TB = rt_.shape[1] if rt_ is not None else 1
        inputs = (
            q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
            grad_out.stride(0), grad_out.stride(1),
        )  # fmt: skip
        tables = (rp.stride(0) if rp_ is not None else 0, rt.stride(0) if rt_ is not None else 0)
        dkdv_out = (dk.stride(0), dk.stride(1), dv.stride(0), dv.stride(1))
        # the kernels take the inputs' strides for their outputs where those agree (constexpr)
        dq_like = dq.stride()[:2] == q.stride()[:2]
        dkdv_like = dk.stride()[:2] == k.stride()[:2] and dv.stride()[:2] == v.stride()[:2]
        scalars = (P, TB, float(alpha), 1.0 / float(normalizer))
        with _device_ctx(q):
            tsr = _time_range(ts, so) if rt_ is not None else so
            grid, table, G = _schedule(so, T, H, max_seqlen, dkdv_bs.block_n, key_major=True)
            if silu is not None:
                parts[1:] = [torch.zeros((G, H * x.shape[2]), **f32) for x in (k, v)]
            pre_k, pre_v = silu[1:] if silu is not None else (k, v)
            part_k, part_v = parts[1:] if silu is not None else (dk, dv)
            # the pre-activations through descriptors wherever TMA can read them (unless
            # HSTU_TRITON_TMA=0): pointer loads in the accumulators' layout ran ~40 us a
            # layer slower per kernel at bench_upstream's batch 32 (H200)
            silu_tma = silu is not None and bool(_TMA_KERNELS) and tma_capable(*silu)
            if silu_tma:
                _ensure_allocator()
            paths = _time_paths(rt_)
            tma = use_tma("fused" if fused else "dkdv", q, k, v, grad_out)
            if tma:
                _ensure_allocator()
            ds = dk  # unread without STORE_DS
            if stored:
                ds = _ds_buffer(H, T, max_seqlen, q)
            if fused:
                for has_time in paths:
                    _hstu_bwd_fused_kernel[grid](
                        q, k, v, grad_out, dk, dv, dq, so, nc, nk, ts, tsr, rp, rt,
                        *inputs, *dkdv_out, *tables, dq.stride(0), dq.stride(1), table, G,
                        launch_lead("dkdv", dkdv_bs.lead, G), H,
                        *scalars, OUT_LIKE_IN=dkdv_like, TMA=tma,
                        **_common_meta(q, v, nc_, nk_, rp_, has_time, dkdv_bs),
                    )  # fmt: skip
            else:
                for has_time in paths:
                    _hstu_bwd_dkdv_kernel[grid](
                        q, k, v, grad_out, dk, dv, ds, pre_k, pre_v, part_k, part_v, so, nc,
                        nk, ts, tsr, rp, rt, *inputs, *dkdv_out, *tables,
                        ds.stride(0) if stored else 0, ds.stride(1) if stored else 0, table, G,
                        launch_lead("dkdv", dkdv_bs.lead, G), H, *scalars,
                        OUT_LIKE_IN=dkdv_like, TMA=tma, SILU=silu is not None,
                        SILU_TMA=silu_tma, STORE_DS=stored,
                        **_common_meta(q, v, nc_, nk_, rp_, has_time, dkdv_bs),
                    )  # fmt: skip
                grid, table, G = _schedule(so, T, H, max_seqlen, dq_bs.block_m, key_major=False)
                if silu is not None:
                    parts[0] = torch.zeros((G, H * q.shape[2]), **f32)
            # the gradients' capacity padding: zeroed by the dq launch's tail programs where one
            # span covers dq, dk and dv (the model's uvqk gradient), else by launches of its own
            spans = _tail_spans((dk, dv) if fused else (dq, dk, dv))
            fold = not fused and len(spans) == 1
            zero = spans[0]
            zero_args = (zero, zero.stride(0), zero.stride(1), *zero.shape[1:], B, T)
            if stored:
                tma = use_tma("dq", q, k, ds)
                if tma:
                    _ensure_allocator()
                meta = _common_meta(q, v, nc_, nk_, rp_, 0, dq_bs)
                tail = _tail_meta(zero, fold)
                _hstu_bwd_dq_stored_kernel[(grid[0] + tail.pop("programs"),)](
                    q, k, ds, dq, silu[0] if silu is not None else q,
                    parts[0] if silu is not None else dq, so, nc, nk,
                    q.stride(0), q.stride(1), k.stride(0), k.stride(1), dq.stride(0),
                    dq.stride(1), ds.stride(0), ds.stride(1), table, G,
                    launch_lead("dq", dq_bs.lead, G), H, float(alpha), *zero_args,
                    DQK=meta["DQK"], BLOCK_DQK=meta["BLOCK_DQK"], BLOCK_M=dq_bs.block_m,
                    BLOCK_N=dq_bs.block_n, HAS_CTX=meta["HAS_CTX"], HAS_CAND=meta["HAS_CAND"],
                    PREC=meta["PREC"], OUT_LIKE_IN=dq_like, TMA=tma, SILU=silu is not None,
                    SILU_TMA=silu_tma, num_warps=dq_bs.num_warps, num_stages=dq_bs.num_stages,
                    **tail,
                )  # fmt: skip
            elif not fused:
                pos_mode, time_mode = _table_grad_modes(
                    pos_grad, time_grad, q.shape[2], P, max_seqlen
                )
                tma = use_tma("dq", q, k, v, grad_out)
                if tma:
                    _ensure_allocator()
                for i, has_time in enumerate(paths):
                    tail = _tail_meta(zero, fold and i == 0)
                    _hstu_bwd_dq_kernel[(grid[0] + tail.pop("programs"),)](
                        q, k, v, grad_out, dq, silu[0] if silu is not None else q,
                        parts[0] if silu is not None else dq, so, nc, nk, ts, tsr, rp, rt,
                        drp if pos_grad else so, drt if time_grad else so,
                        *inputs, dq.stride(0), dq.stride(1), *tables, table, G,
                        launch_lead("dq", dq_bs.lead, G), H, *scalars, *zero_args,
                        BLOCK_TB=_block_tb(TB, time_mode, dq_bs), POS_GRAD=pos_mode,
                        TIME_GRAD=time_mode, OUT_LIKE_IN=dq_like, TMA=tma,
                        SILU=silu is not None, SILU_TMA=silu_tma, **tail,
                        **_common_meta(q, v, nc_, nk_, rp_, has_time, dq_bs),
                    )  # fmt: skip
            if not fold:
                for x in spans:
                    _zero_tail(x, so)
    else:
        for x in (dq, dk, dv):
            x.zero_()
    if fused:
        dq = dq_out.copy_(dq.mul_(float(alpha)))
    if pos_grad:
        drp = drp.to(rp_.dtype)
    if time_grad:
        drt = drt.to(rt_.dtype)
    if silu is not None:
        return dq, dk, dv, drp, drt, tuple(parts)
    return dq, dk, dv, drp, drt
