"""Jagged HSTU attention in Triton: forward and backward, registered as torch.library ops.

Contract: ``kernels/README.md``. Layout is jagged ``[T, H, D]`` with ``seq_offsets[B + 1]``.

Design
------
* Forward: one program per (query block, sample, head); the query tile stays in registers and
  the program walks the key blocks of its sample, accumulating ``silu(z) @ V`` in fp32.
  There is no softmax, so no running max/denominator is needed.
* Backward, three modes (``hstu_attention(..., backward=)``; ``None``: ``default_backward`` of
  the head dim, "split" everywhere for now).
* "split": two kernels that recompute the scores (no dq atomics, so dq/dk/dv are
  deterministic).  ``dkdv`` runs one program per (key block, sample, head) and walks the query
  blocks; ``dq`` runs one program per (query block, sample, head) and walks the key blocks:
  7 matmuls per tile pair (both compute S and dP).
  The ``dq`` kernel also reduces the bias gradient ``dz`` into the tables (fp32 buffers, cast to
  the table dtype afterwards): ``rab_pos`` with one fp32 ``tl.atomic_add`` per visible pair
  below the clamped last bucket (lanes of a warp hit distinct buckets, so contention is low)
  and, when ``P < max_seqlen``, the last bucket summed per tile and added once (per-pair
  atomics there put every program on one address: 82 ms instead of 1.8 ms for a 4 x 4096
  fwd+bwd on an H200 with P = 128); ``rab_time`` per tile, looping
  only over the few buckets present in the tile, into a register vector flushed with one vector
  atomic per program (per-pair atomics on ~Tb hot addresses were ~10x slower).
* "fused": one key-major kernel (``_hstu_bwd_fused_kernel``: the ``dkdv`` kernel's code on the
  dk/dv tiles, default ``default_block_sizes(dim, "fused")``) that also computes each tile's dq
  share ``dS K`` ([BLOCK_M, Dqk] fp32, zero on masked pairs) and adds it with ``tl.atomic_add``
  (fp32, relaxed, masked to the sample's query rows) into a zeroed fp32 ``[T, H, Dqk]`` buffer;
  after the kernel dq = buffer * alpha, cast to q's dtype.  5 matmuls per tile pair and one
  launch, but the atomics' order, so dq's last bits, may vary from run to run on a GPU (dk / dv
  stay deterministic).  The table gradients are reduced by the split ``dq`` kernel alone, so
  "fused" runs "split" where a ``rab_pos`` / ``rab_time`` gradient is needed:
  ``hstu_attention`` picks split when a given table requires grad (with the split tiles), and
  the backward op, asked for "fused", runs split when it must return a table gradient.
  Biases without gradients run fused (they only enter the logits).
* "stored": the split ``dkdv`` kernel also stores each visited tile's dS (the inputs' 16-bit
  dtype, key-major rows: a key's row holds its sample's queries) into an ``[H, T, W]`` buffer
  (W = max_seqlen rounded up to 64; a sample's n rows use n x n of it), and
  ``_hstu_bwd_dq_stored_kernel`` computes dq = alpha dS K from it: 4 + 1 matmuls per tile pair
  instead of 4 + 3, no atomics (deterministic), the buffer's write and read instead. Its dq
  walks the split dq kernel's blocks and applies its mask to what it reads (pairs the dk/dv
  kernel skipped are never written). Runs "split" where a table gradient is needed, and in
  ``_bwd_impl`` where the buffer would pass ``STORED_DS_MAX_BYTES``.
* Block skipping: for a query block ``[m0, m1)`` the keys that can be unmasked are
  ``[0, m1)`` (causal), ``[0, n - K)`` if the block holds a contextual query, and the diagonal
  ``[m0, m1)`` for candidates; key blocks between the history and the diagonal are skipped.
  Symmetrically, a key block ``[n0, n1)`` is only visited by query blocks in ``[0, C)`` and
  ``[n0, n)`` (or only ``[n0, n1)`` when all its keys are candidates).  Blocks known to be fully
  visible skip the mask; the masked ranges are walked by one loop (one inlined tile copy).
* Grid: one program per head and (block, sample) pair that holds tokens, heaviest first
  (``kernels/schedule.py``), over a flat 1D grid; each launch's schedule table is filled by
  a one-program-per-entry kernel first (in the attention kernels it cost registers that the
  head-dim-256 tiles need: the dq kernel spilled 130 instead of 92 values and ran 25 %
  slower on 8 x 4096).
"""

import math

import torch

from ..tiles import resolve_tiles
from . import layer_norm as _ln
from . import linear_silu as _ls
from ._launch import (
    INTERPRET_BLOCK_SIZES,  # noqa: F401 (re-export)
    BlockSizes,
    _bwd_impl,
    _fwd_impl,
    check_backward,
    default_backward,
    default_block_sizes,
    is_interpret_mode,
    shared_schedules,
)

__all__ = [
    "BlockSizes",
    "hstu_attention",
    "hstu_linear_uvqk_attention",
    "hstu_uvqk_attention",
    "is_interpret_mode",
    "shared_schedules",
]


# ----------------------------------------------------------------------------------------------
# torch.library ops
# ----------------------------------------------------------------------------------------------


def _pack_blocks(tiles) -> list[int]:
    """The ops' int list of the forward, dk/dv and dq kernels' BlockSizes: 5 ints each, the
    launch order's ``lead`` last (-1 for None)."""
    return [
        x
        for bs in tiles
        for x in (
            bs.block_m,
            bs.block_n,
            bs.num_warps,
            bs.num_stages,
            -1 if bs.lead is None else bs.lead,
        )
    ]


def _unpack_blocks(blocks: list[int]) -> tuple[BlockSizes, tuple[BlockSizes, BlockSizes]]:
    """The BlockSizes ``_pack_blocks`` packed: forward, (dk/dv, dq)."""
    fwd, dkdv, dq = (
        BlockSizes(*blocks[i : i + 4], lead=None if blocks[i + 4] < 0 else blocks[i + 4])
        for i in (0, 5, 10)
    )
    return fwd, (dkdv, dq)


@torch.library.custom_op("hstu::hstu_attention_fwd", mutates_args=())
def hstu_attention_fwd(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    seq_offsets: torch.Tensor,
    max_seqlen: int,
    alpha: float,
    normalizer: float,
    num_contextual: torch.Tensor | None,
    num_candidates: torch.Tensor | None,
    timestamps: torch.Tensor | None,
    rab_pos: torch.Tensor | None,
    rab_time: torch.Tensor | None,
    blocks: list[int],
    backward: str,
) -> torch.Tensor:
    """Forward op. ``blocks`` = the forward, dk/dv and dq kernels' tiles (``_pack_blocks``);
    ``backward`` = the backward mode ("split" / "fused" / "stored"), kept for the backward
    op."""
    fwd_bs, _ = _unpack_blocks(blocks)
    return _fwd_impl(q, k, v, seq_offsets, max_seqlen, alpha, normalizer, num_contextual,
                     num_candidates, timestamps, rab_pos, rab_time, fwd_bs)  # fmt: skip


@hstu_attention_fwd.register_fake
def _(q, k, v, seq_offsets, max_seqlen, alpha, normalizer, *args):
    return q.new_empty(q.shape[0], q.shape[1], v.shape[2])


@torch.library.custom_op("hstu::hstu_attention_bwd", mutates_args=())
def hstu_attention_bwd(
    grad_out: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    seq_offsets: torch.Tensor,
    max_seqlen: int,
    alpha: float,
    normalizer: float,
    num_contextual: torch.Tensor | None,
    num_candidates: torch.Tensor | None,
    timestamps: torch.Tensor | None,
    rab_pos: torch.Tensor | None,
    rab_time: torch.Tensor | None,
    need_rab_pos_grad: bool,
    need_rab_time_grad: bool,
    blocks: list[int],
    backward: str,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Backward op: (dq, dk, dv, d_rab_pos, d_rab_time); absent table grads are empty."""
    _, bwd_bs = _unpack_blocks(blocks)
    return _bwd_impl(grad_out, q, k, v, seq_offsets, max_seqlen, alpha, normalizer,
                     num_contextual, num_candidates, timestamps, rab_pos, rab_time,
                     need_rab_pos_grad, need_rab_time_grad, bwd_bs, backward)  # fmt: skip


@hstu_attention_bwd.register_fake
def _(grad_out, q, k, v, seq_offsets, max_seqlen, alpha, normalizer, nc, nk, ts, rp, rt,
      need_rp, need_rt, blocks, backward):  # fmt: skip
    drp = rp.new_empty(rp.shape) if rp is not None and need_rp else q.new_empty(0)
    drt = rt.new_empty(rt.shape) if rt is not None and need_rt else q.new_empty(0)
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v), drp, drt


def _setup_context(ctx, inputs, output):
    (q, k, v, seq_offsets, max_seqlen, alpha, normalizer, nc, nk, ts, rp, rt, blocks,
     backward) = inputs  # fmt: skip
    ctx.save_for_backward(q, k, v, seq_offsets, nc, nk, ts, rp, rt)
    ctx.args = (max_seqlen, alpha, normalizer, list(blocks), backward)


def _backward_with(bwd, ctx, grad_out):
    q, k, v, seq_offsets, nc, nk, ts, rp, rt = ctx.saved_tensors
    max_seqlen, alpha, normalizer, blocks, backward = ctx.args
    need = ctx.needs_input_grad
    need_rp, need_rt = rp is not None and need[10], rt is not None and need[11]
    dq, dk, dv, drp, drt = bwd(
        grad_out, q, k, v, seq_offsets, max_seqlen, alpha, normalizer, nc, nk, ts, rp, rt,
        need_rp, need_rt, blocks, backward,
    )  # fmt: skip
    return (dq, dk, dv, None, None, None, None, None, None, None,
            drp if need_rp else None, drt if need_rt else None, None, None)  # fmt: skip


def _backward(ctx, grad_out):
    return _backward_with(hstu_attention_bwd, ctx, grad_out)


hstu_attention_fwd.register_autograd(_backward, setup_context=_setup_context)


def _bwd_eager(*args):
    *rest, blocks, backward = args
    return _bwd_impl(*rest, _unpack_blocks(blocks)[1], backward)


class _EagerHstuAttention(torch.autograd.Function):
    """The op's math and autograd without the custom-op dispatch, which costs a few hundred us
    of CPU per call in eager mode; ``hstu_attention`` uses it unless torch.compile is tracing."""

    @staticmethod
    def forward(ctx, *inputs):
        *args, blocks, _backward = inputs
        out = _fwd_impl(*args, _unpack_blocks(blocks)[0])
        _setup_context(ctx, inputs, out)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        return _backward_with(_bwd_eager, ctx, grad_out)


def _uvqk_views(x: torch.Tensor, heads: int, linear_dim: int, attention_dim: int):
    """``(u [T, H dv], v [T, H, dv], q [T, H, dqk], k [T, H, dqk])``: views of the columns of
    ``x [T, H (2 dv + 2 dqk)]`` in the HSTU layer's order (u, v, q, k)."""
    hv, hqk = heads * linear_dim, heads * attention_dim
    u, v, q, k = torch.split(x, [hv, hv, hqk, hqk], dim=-1)
    return (u, v.unflatten(-1, (heads, linear_dim)), q.unflatten(-1, (heads, attention_dim)),
            k.unflatten(-1, (heads, attention_dim)))  # fmt: skip


class _UvqkAttention(torch.autograd.Function):
    """``hstu_uvqk_attention``: the attention of the q / k / v columns of one ``[T, W]``
    activation, returning its u columns (a view) with the output. The backward writes dq, dk
    and dv into the columns of one new ``[T, W]`` gradient and du beside them, so the
    gradient of the split is not a concatenation of four tensors; q, k and v are read where
    they lie, not copied."""

    @staticmethod
    def forward(ctx, uvqk, heads, linear_dim, attention_dim, *inputs):
        *args, blocks, _backward = inputs
        u, v, q, k = _uvqk_views(uvqk, heads, linear_dim, attention_dim)
        out = _fwd_impl(q, k, v, *args, _unpack_blocks(blocks)[0])
        _setup_context(ctx, (q, k, v, *inputs), out)
        ctx.layout = (uvqk.shape, uvqk.dtype, uvqk.device, heads, linear_dim, attention_dim)
        return u, out

    @staticmethod
    def backward(ctx, du, grad_out):
        q, k, v, seq_offsets, nc, nk, ts, rp, rt = ctx.saved_tensors
        max_seqlen, alpha, normalizer, blocks, backward = ctx.args
        shape, dtype, device, heads, linear_dim, attention_dim = ctx.layout
        need = ctx.needs_input_grad  # (uvqk, heads, dv, dqk, offsets, ..., rp [11], rt [12])
        need_rp, need_rt = rp is not None and need[11], rt is not None and need[12]
        grad = torch.empty(shape, dtype=dtype, device=device)
        gu, gv, gq, gk = _uvqk_views(grad, heads, linear_dim, attention_dim)
        if du is None:
            gu.zero_()
        else:
            gu.copy_(du)
        drp = drt = None
        if grad_out is None:
            for g in (gv, gq, gk):
                g.zero_()
        else:
            *_, drp, drt = _bwd_impl(  # dq, dk, dv: written into gq, gk, gv
                grad_out, q, k, v, seq_offsets, max_seqlen, alpha, normalizer, nc, nk, ts, rp,
                rt, need_rp, need_rt, _unpack_blocks(blocks)[1], backward, out=(gq, gk, gv),
            )  # fmt: skip
        return (grad, None, None, None, None, None, None, None, None, None, None,
                drp if need_rp else None, drt if need_rt else None, None, None)  # fmt: skip


class _UvqkAttentionNorm(torch.autograd.Function):
    """``hstu_uvqk_attention(norm=...)``: the attention of the q / k / v columns, then the
    layer's gated norm ``LN(out) * u`` (``layer_norm.py``'s kernels), in one op. The backward
    writes the gate's gradient straight into the u columns of the ``[T, W]`` gradient it builds
    (with the norm a separate op, that gradient arrives as its own tensor and is copied there:
    a strided ``[T, H dv]`` copy per layer), then dq, dk, dv beside it."""

    @staticmethod
    def forward(ctx, uvqk, weight, bias, eps, heads, linear_dim, attention_dim, *inputs):
        *args, blocks, backward = inputs
        u, v, q, k = _uvqk_views(uvqk, heads, linear_dim, attention_dim)
        out = _fwd_impl(q, k, v, *args, _unpack_blocks(blocks)[0])
        out2 = out.view(out.shape[0], heads * linear_dim)
        y, _, mean, rstd = _ln.forward(out2, weight, bias, eps, g2=u)
        seq_offsets, max_seqlen, alpha, normalizer, nc, nk, ts, rp, rt = args
        ctx.save_for_backward(q, k, v, seq_offsets, nc, nk, ts, rp, rt, u, out2, weight, bias,
                              mean, rstd)  # fmt: skip
        ctx.args = (max_seqlen, alpha, normalizer, list(blocks), backward)
        ctx.layout = (uvqk.shape, uvqk.dtype, uvqk.device, heads, linear_dim, attention_dim)
        return y

    @staticmethod
    def backward(ctx, dy):
        q, k, v, seq_offsets, nc, nk, ts, rp, rt, u, out2, weight, bias, mean, rstd = (
            ctx.saved_tensors
        )
        max_seqlen, alpha, normalizer, blocks, backward = ctx.args
        shape, dtype, device, heads, linear_dim, attention_dim = ctx.layout
        # (uvqk, weight, bias, eps, heads, dv, dqk, offsets, ..., rp [14], rt [15], ...)
        need = ctx.needs_input_grad
        need_rp, need_rt = rp is not None and need[14], rt is not None and need[15]
        grad = torch.empty(shape, dtype=dtype, device=device)
        gu, gv, gq, gk = _uvqk_views(grad, heads, linear_dim, attention_dim)
        dy2 = dy if dy.stride(-1) == 1 else dy.contiguous()
        dout, _, dweight, dbias, _ = _ln.backward(out2, weight, bias, mean, rstd, dy2, g2=u, dg=gu)
        *_, drp, drt = _bwd_impl(  # dq, dk, dv: written into gq, gk, gv
            dout.view(q.shape[0], heads, linear_dim), q, k, v, seq_offsets, max_seqlen, alpha,
            normalizer, nc, nk, ts, rp, rt, need_rp, need_rt, _unpack_blocks(blocks)[1],
            backward, out=(gq, gk, gv),
        )  # fmt: skip
        nothing = (None,) * 11  # eps, heads, dv, dqk, offsets, ..., timestamps
        tables = (drp if need_rp else None, drt if need_rt else None)
        return (grad, dweight, dbias, *nothing, *tables, None, None)


class _LinearUvqkAttentionNorm(torch.autograd.Function):
    """``hstu_linear_uvqk_attention``: ``uvqk = silu(x @ w + b)``, its attention and the gated
    norm, in one op whose backward runs SiLU's backward where the gradients are written: the
    gated norm's kernel writes the gradient of u's pre-activation (it reads that instead of
    u: ``u = silu(p)`` in registers), the dk / dv and dq kernels those of v's, k's and q's in
    their epilogues (``_bwd_impl(silu=...)``), and each sums its columns of the bias gradient
    per program. What the separate SiLU-backward kernel (``linear_silu``) read and wrote, the
    ``[T, W]`` gradient of ``silu(pre)`` once each way, is gone; the kernels read ``pre``."""

    @staticmethod
    def forward(ctx, x, weight, bias, weight_x, bias_x, nweight, nbias, eps, heads, linear_dim,
                attention_dim, *inputs):  # fmt: skip
        *args, blocks, backward = inputs
        w = weight.to(x.dtype) if weight_x is None else weight_x
        pre = torch.addmm(bias.to(x.dtype) if bias_x is None else bias_x, x, w)
        uvqk = torch.nn.functional.silu(pre)
        u, v, q, k = _uvqk_views(uvqk, heads, linear_dim, attention_dim)
        out = _fwd_impl(q, k, v, *args, _unpack_blocks(blocks)[0])
        out2 = out.view(out.shape[0], heads * linear_dim)
        y, _, mean, rstd = _ln.forward(out2, nweight, nbias, eps, g2=u)
        seq_offsets, max_seqlen, alpha, normalizer, nc, nk, ts, rp, rt = args
        ctx.save_for_backward(x, w, pre, q, k, v, seq_offsets, nc, nk, ts, rp, rt, out2,
                              nweight, nbias, mean, rstd)  # fmt: skip
        ctx.args = (max_seqlen, alpha, normalizer, list(blocks), backward)
        ctx.layout = (heads, linear_dim, attention_dim, weight.dtype, bias.dtype)
        return y

    @staticmethod
    def backward(ctx, dy):
        (x, w, pre, q, k, v, seq_offsets, nc, nk, ts, rp, rt, out2, nweight, nbias, mean,
         rstd) = ctx.saved_tensors  # fmt: skip
        max_seqlen, alpha, normalizer, blocks, backward = ctx.args
        heads, linear_dim, attention_dim, weight_dtype, bias_dtype = ctx.layout
        # (x, weight, bias, weight_x, bias_x, nweight, nbias, eps, heads, dv, dqk, offsets,
        #  max_seqlen, alpha, normalizer, nc, nk, ts, rp [18], rt [19], blocks, backward)
        need = ctx.needs_input_grad
        need_rp, need_rt = rp is not None and need[18], rt is not None and need[19]
        grad = torch.empty_like(pre)  # of pre: every column written below
        gu, gv, gq, gk = _uvqk_views(grad, heads, linear_dim, attention_dim)
        pu, pv, pq, pk = _uvqk_views(pre, heads, linear_dim, attention_dim)
        dy2 = dy if dy.stride(-1) == 1 else dy.contiguous()
        dout, _, dnweight, dnbias, _, part_u = _ln.backward(
            out2, nweight, nbias, mean, rstd, dy2, dg=gu, gate_pre=pu
        )
        *_, drp, drt, (part_q, part_k, part_v) = _bwd_impl(
            dout.view(q.shape[0], heads, linear_dim), q, k, v, seq_offsets, max_seqlen, alpha,
            normalizer, nc, nk, ts, rp, rt, need_rp, need_rt, _unpack_blocks(blocks)[1],
            backward, out=(gq, gk, gv), silu=(pq, pk, pv),
        )  # fmt: skip
        dbias = None
        if need[2]:  # the columns' partials: u, v, q, k
            dbias = torch.empty(pre.shape[1], dtype=bias_dtype, device=pre.device)
            hv, hqk = heads * linear_dim, heads * attention_dim
            at = 0
            for part, width in zip((part_u, part_v, part_q, part_k), (hv, hv, hqk, hqk)):
                _ls.sum_partials(part, dbias[at : at + width])
                at += width
        dx, dweight = _ls.weight_grads(x, w, grad, weight_dtype, need[0], need[1])
        tables = (drp if need_rp else None, drt if need_rt else None)
        nothing = (None,) * 11  # eps, heads, dv, dqk, offsets, max_seqlen, ..., timestamps
        return (dx, dweight, dbias, None, None, dnweight, dnbias, *nothing, *tables, None,
                None)  # fmt: skip


# set to False to route eager calls through the torch.library op as well
EAGER_FAST_PATH = True


# ----------------------------------------------------------------------------------------------
# Public entry point
# ----------------------------------------------------------------------------------------------

_FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_INT_DTYPES = (torch.int32, torch.int64)


def _check_tensor(name, x, ndim, device, dtypes=None, shape=None):
    if not isinstance(x, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if x.dim() != ndim:
        raise ValueError(f"{name} must have {ndim} dims, got shape {tuple(x.shape)}")
    if x.device != device:
        raise ValueError(f"{name} is on {x.device}, expected {device} (the device of q)")
    if dtypes is not None and x.dtype not in dtypes:
        raise ValueError(f"{name} has dtype {x.dtype}, expected one of {dtypes}")
    if shape is not None:
        for axis, want in enumerate(shape):
            if want is not None and x.shape[axis] != want:
                raise ValueError(
                    f"{name} has shape {tuple(x.shape)}, expected dim {axis} to be {want}"
                )


def _validate(q, k, v, seq_offsets, max_seqlen, alpha, normalizer, nc, nk, ts, rp, rt) -> None:
    if not isinstance(q, torch.Tensor):
        raise ValueError(f"q must be a torch.Tensor, got {type(q).__name__}")
    device = q.device
    if device.type == "cuda":
        if is_interpret_mode():
            raise ValueError(
                "q is a CUDA tensor but the kernels were built with TRITON_INTERPRET=1"
            )
    elif not is_interpret_mode():
        raise ValueError(
            f"q is on {device}: the Triton kernel needs CUDA tensors "
            "(or TRITON_INTERPRET=1 set before importing triton, for CPU tensors)"
        )
    _check_tensor("q", q, 3, device, _FLOAT_DTYPES)
    T, H, D = q.shape
    _check_tensor("k", k, 3, device, (q.dtype,), (T, H, D))
    _check_tensor("v", v, 3, device, (q.dtype,), (T, H, None))
    _check_tensor("seq_offsets", seq_offsets, 1, device, _INT_DTYPES)
    if seq_offsets.shape[0] < 1:
        raise ValueError("seq_offsets must hold B + 1 >= 1 entries (a leading 0)")
    B = seq_offsets.shape[0] - 1
    if isinstance(max_seqlen, bool) or not isinstance(max_seqlen, int) or max_seqlen < 0:
        raise ValueError(f"max_seqlen must be a non-negative python int, got {max_seqlen!r}")
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not math.isfinite(alpha):
        raise ValueError(f"alpha must be a finite python float, got {alpha!r}")
    if (
        isinstance(normalizer, bool)
        or not isinstance(normalizer, (int, float))
        or not math.isfinite(normalizer)
        or normalizer == 0
    ):
        raise ValueError(f"normalizer must be a finite non-zero python float, got {normalizer!r}")
    if nc is not None:
        _check_tensor("num_contextual", nc, 1, device, _INT_DTYPES, (B,))
    if nk is not None:
        _check_tensor("num_candidates", nk, 1, device, _INT_DTYPES, (B,))
    if rp is not None:
        _check_tensor("rab_pos", rp, 2, device, _FLOAT_DTYPES, (H,))
        if rp.shape[1] < 1:
            raise ValueError("rab_pos must have at least one bucket (P >= 1)")
    if rt is not None:
        _check_tensor("rab_time", rt, 2, device, _FLOAT_DTYPES, (H,))
        if rt.shape[1] < 1:
            raise ValueError("rab_time must have at least one bucket (Tb >= 1)")
        if ts is None:
            raise ValueError("timestamps is required when rab_time is given")
    if ts is not None:
        _check_tensor("timestamps", ts, 1, device, _INT_DTYPES, (T,))


def _resolve_backward(backward, q, v, rab_pos, rab_time) -> str:
    """The backward mode to run: ``backward``, or the head dim's default for None; "fused" and
    "stored" become "split" where a bias table requires grad (the split dq kernel reduces
    those)."""
    dim = max(q.shape[2], v.shape[2])
    mode = default_backward(dim, q.dtype) if backward is None else check_backward(backward)
    if mode != "split" and any(t is not None and t.requires_grad for t in (rab_pos, rab_time)):
        return "split"
    return mode


def _resolve_blocks(
    block_sizes, q, v, backward: str = "split", table_grads: bool = False
) -> tuple[BlockSizes, BlockSizes, BlockSizes]:
    """(forward, dk/dv, dq) tiles; the fused backward runs on the dk/dv slot, whose default is
    then the fused kernel's, and "stored"'s dq kernel on the dq slot (default its own);
    ``table_grads``: a bias table requires grad (the dq kernel's default tiles are then those
    for reducing its gradient)."""
    dim = max(q.shape[2], v.shape[2])

    def default(kernel):
        if backward == "fused" and kernel == "dkdv":
            kernel = "fused"
        elif backward == "stored" and kernel == "dq":
            kernel = "dq_stored"
        return default_block_sizes(dim, kernel, q.dtype, table_grads)

    return resolve_tiles(block_sizes, BlockSizes, default)


def _op_args(q, k, v, seq_offsets, max_seqlen, alpha, normalizer, nc, nk, ts, rp, rt,
             block_sizes, backward) -> tuple:  # fmt: skip
    """The ops' arguments, checked, with the backward mode and every kernel's tiles resolved:
    ``(q, k, v, seq_offsets, max_seqlen, alpha, normalizer, nc, nk, ts, rp, rt, blocks,
    mode)`` (timestamps only where rab_time reads them)."""
    _validate(q, k, v, seq_offsets, max_seqlen, alpha, normalizer, nc, nk, ts, rp, rt)
    mode = _resolve_backward(backward, q, v, rp, rt)
    table_grads = any(t is not None and t.requires_grad for t in (rp, rt))
    fwd_bs, dkdv_bs, dq_bs = _resolve_blocks(block_sizes, q, v, mode, table_grads)
    blocks = _pack_blocks((fwd_bs, dkdv_bs, dq_bs))
    return (q, k, v, seq_offsets, max_seqlen, float(alpha), float(normalizer), nc, nk,
            ts if rt is not None else None, rp, rt, blocks, mode)  # fmt: skip


def hstu_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    seq_offsets: torch.Tensor,
    *,
    max_seqlen: int,
    alpha: float,
    normalizer: float,
    num_contextual: torch.Tensor | None = None,
    num_candidates: torch.Tensor | None = None,
    timestamps: torch.Tensor | None = None,
    rab_pos: torch.Tensor | None = None,
    rab_time: torch.Tensor | None = None,
    block_sizes: BlockSizes | tuple[BlockSizes, ...] | None = None,
    backward: str | None = None,
) -> torch.Tensor:
    """Jagged HSTU attention (see ``kernels/README.md``); returns ``[T, H, Dv]`` in q's dtype.

    ``max_seqlen`` must bound every sample's length (it sizes the grid; it is not checked
    against ``seq_offsets`` to avoid a device sync).  ``block_sizes`` is one ``BlockSizes``
    for every kernel, a ``(forward, backward)`` pair or a ``(forward, dk/dv, dq)`` triple;
    ``None`` picks the defaults tuned per head dim (``default_block_sizes``).

    ``backward``: "split" (a dk/dv and a dq kernel; deterministic), "fused" (one kernel on the
    dk/dv tiles that adds dq atomically in fp32: the summation order, so dq's last bits, may
    vary from run to run on a GPU), "stored" (the dk/dv kernel stores dS, 16-bit, in a buffer
    of ``stored_ds_bytes`` bytes, and dq is one matmul per tile pair from it; deterministic)
    or ``None`` for the head dim's default (``default_backward``). "fused" and "stored" fall
    back to "split" when a gradient of ``rab_pos`` / ``rab_time`` is needed (a table that
    requires grad): the split dq kernel reduces those. Biases without gradients run either.
    """
    args = _op_args(
        q,
        k,
        v,
        seq_offsets,
        max_seqlen,
        alpha,
        normalizer,
        num_contextual,
        num_candidates,
        timestamps,
        rab_pos,
        rab_time,
        block_sizes,
        backward,
    )
    if EAGER_FAST_PATH and not torch.compiler.is_compiling():
        return _EagerHstuAttention.apply(*args)
    return hstu_attention_fwd(*args)


def hstu_uvqk_attention(
    uvqk: torch.Tensor,
    seq_offsets: torch.Tensor,
    *,
    num_heads: int,
    linear_dim: int,
    attention_dim: int,
    max_seqlen: int,
    alpha: float,
    normalizer: float,
    num_contextual: torch.Tensor | None = None,
    num_candidates: torch.Tensor | None = None,
    timestamps: torch.Tensor | None = None,
    rab_pos: torch.Tensor | None = None,
    rab_time: torch.Tensor | None = None,
    block_sizes: BlockSizes | tuple[BlockSizes, ...] | None = None,
    backward: str | None = None,
    norm: tuple[torch.Tensor, torch.Tensor, float] | None = None,
) -> tuple[torch.Tensor, torch.Tensor] | torch.Tensor:
    """The HSTU layer's split and attention in one op: ``uvqk [T, H (2 dv + 2 dqk)]`` holds
    the columns u, v, q, k (in that order); returns ``(u [T, H dv], hstu_attention(q, k, v))``,
    u a view of ``uvqk``. Same values and gradients as splitting and calling
    ``hstu_attention`` (every argument means what it means there); the gradient with respect
    to ``uvqk`` is built in one buffer (no concatenation, no copies of q, k, v).

    ``norm = (weight [H dv], bias [H dv], eps)``: returns the layer's gated norm of the output
    instead, ``layer_norm(out.reshape(T, H dv), weight, bias, eps, gate=u)``
    (``layer_norm.py``), differentiable in ``weight`` and ``bias`` too; its backward writes u's
    gradient in place (``_UvqkAttentionNorm``)."""
    if not isinstance(uvqk, torch.Tensor) or uvqk.dim() != 2:
        raise ValueError(f"uvqk must be a 2-D torch.Tensor, got {getattr(uvqk, 'shape', uvqk)!r}")
    dims = {"num_heads": num_heads, "linear_dim": linear_dim, "attention_dim": attention_dim}
    for name, value in dims.items():
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive python int, got {value!r}")
    width = num_heads * (2 * linear_dim + 2 * attention_dim)
    if uvqk.shape[1] != width or uvqk.stride(1) != 1:
        raise ValueError(
            f"uvqk must be [T, {width}] (num_heads * (2 linear_dim + 2 attention_dim)) with a "
            f"contiguous last dim, got shape {tuple(uvqk.shape)}, strides {uvqk.stride()}"
        )
    u, v, q, k = _uvqk_views(uvqk, num_heads, linear_dim, attention_dim)
    args = _op_args(
        q,
        k,
        v,
        seq_offsets,
        max_seqlen,
        alpha,
        normalizer,
        num_contextual,
        num_candidates,
        timestamps,
        rab_pos,
        rab_time,
        block_sizes,
        backward,
    )
    if norm is not None:
        weight, bias, eps = _check_norm(norm, num_heads * linear_dim, uvqk.device)
    if not EAGER_FAST_PATH or torch.compiler.is_compiling():
        out = hstu_attention_fwd(*args)
        if norm is None:
            return u, out
        return _ln.layer_norm(out.reshape(u.shape), weight, bias, eps, gate=u)
    if norm is not None:
        return _UvqkAttentionNorm.apply(
            uvqk, weight, bias, eps, num_heads, linear_dim, attention_dim, *args[3:]
        )
    # u from the op (not the view above): its gradient goes into the op's one buffer
    return _UvqkAttention.apply(uvqk, num_heads, linear_dim, attention_dim, *args[3:])


def hstu_linear_uvqk_attention(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor,
    seq_offsets: torch.Tensor,
    *,
    norm: tuple[torch.Tensor, torch.Tensor, float],
    num_heads: int,
    linear_dim: int,
    attention_dim: int,
    max_seqlen: int,
    alpha: float,
    normalizer: float,
    num_contextual: torch.Tensor | None = None,
    num_candidates: torch.Tensor | None = None,
    timestamps: torch.Tensor | None = None,
    rab_pos: torch.Tensor | None = None,
    rab_time: torch.Tensor | None = None,
    block_sizes: BlockSizes | tuple[BlockSizes, ...] | None = None,
    backward: str | None = None,
    reduced: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """The HSTU layer from its normed input to its gated norm in one op:
    ``hstu_uvqk_attention(linear_silu(x, weight, bias, reduced), seq_offsets, norm=norm, ...)``
    (every argument means what it means there), the same values and gradients, with SiLU's
    backward and the uvqk bias gradient done by the kernels that write the gradients
    (``_LinearUvqkAttentionNorm``). Where the attention runs the fused backward (dq atomics)
    or torch.compile traces, it is that composition."""
    _ls._check(x, weight, bias)
    width = num_heads * (2 * linear_dim + 2 * attention_dim)
    if weight.shape[1] != width:
        raise ValueError(
            f"weight must be [in, {width}] (num_heads * (2 linear_dim + 2 attention_dim)), got "
            f"shape {tuple(weight.shape)}"
        )
    if reduced is not None and (reduced[0].shape, reduced[1].shape) != (weight.shape, bias.shape):
        raise ValueError(
            f"reduced copies of shapes {tuple(reduced[0].shape)}, {tuple(reduced[1].shape)} "
            f"for weight {tuple(weight.shape)} and bias {tuple(bias.shape)}"
        )
    dims = dict(num_heads=num_heads, linear_dim=linear_dim, attention_dim=attention_dim)
    kw = dict(
        max_seqlen=max_seqlen, alpha=alpha, normalizer=normalizer,
        num_contextual=num_contextual, num_candidates=num_candidates, timestamps=timestamps,
        rab_pos=rab_pos, rab_time=rab_time, block_sizes=block_sizes, backward=backward,
    )  # fmt: skip
    # the op's checks and resolved arguments, on a stand-in of uvqk's shape (one element)
    _, v, q, k = _uvqk_views(
        x.new_empty(1).expand(x.shape[0], width), num_heads, linear_dim, attention_dim
    )
    args = _op_args(q, k, v, seq_offsets, *kw.values())
    nweight, nbias, eps = _check_norm(norm, num_heads * linear_dim, x.device)
    if args[-1] == "fused" or not EAGER_FAST_PATH or torch.compiler.is_compiling():
        uvqk = _ls.linear_silu(x, weight, bias, reduced)
        return hstu_uvqk_attention(uvqk, seq_offsets, **dims, **kw, norm=norm)
    weight_x, bias_x = reduced if reduced is not None else (None, None)
    return _LinearUvqkAttentionNorm.apply(
        x, weight, bias, weight_x, bias_x, nweight, nbias, eps, num_heads, linear_dim,
        attention_dim, *args[3:],
    )  # fmt: skip


def _check_norm(norm, width: int, device) -> tuple[torch.Tensor, torch.Tensor, float]:
    if not (isinstance(norm, tuple) and len(norm) == 3):
        raise ValueError(f"norm must be (weight, bias, eps), got {type(norm).__name__}")
    weight, bias, eps = norm
    for name, t in (("weight", weight), ("bias", bias)):
        if not isinstance(t, torch.Tensor) or tuple(t.shape) != (width,):
            raise ValueError(
                f"norm {name} must be a [{width}] tensor (num_heads * linear_dim), got "
                f"{tuple(getattr(t, 'shape', ())) or type(t).__name__}"
            )
        if not t.is_floating_point() or t.device != device:
            raise ValueError(
                f"norm {name} must be floating point on {device}, got {t.dtype} on {t.device}"
            )
    if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not eps > 0:
        raise ValueError(f"norm eps must be a positive number, got {eps!r}")
    return weight, bias, float(eps)
