"""SiLU's backward and its bias gradient in one Pallas kernel (Triton lowering): the JAX twin
of ``_silu_bwd_kernel`` in ``kernels/triton/linear_silu.py``.

    dpre = dy * s * (1 + pre * (1 - s)),  s = sigmoid(pre)        (fp32, stored in pre's dtype)
    dbias = sum over rows of dpre                                  (fp32, from the unrounded dpre)

for the layer's ``pre = x @ w + b`` of ``[T, N]`` columns, whose gradient ``dy`` arrives as
column blocks (HSTU's u, v, q and k: the split's pieces, one array each). XLA computes the
same with autodiff, but as two passes: the fusion of SiLU's backward with the split's
transpose (a concatenation, which XLA emits with code no reduction joins), then the bias
gradient's column sum reading the whole ``[T, N]`` gradient once more (0.21 ms of a batch-32
bench_upstream step on an H200, docs/BENCHMARKS.md). Rewritten with pads so that XLA could
fuse the sum, XLA made one multi-output column reduction of it that ran 1.8x slower than the
two passes; this kernel reads each piece and ``pre`` once, writes ``dpre`` and per-program
column sums of it, and a small reduction adds those up.

Each program takes ``ROWS_PER_PROGRAM`` rows (in slices of ``BLOCK_R``) of one ``BLOCK_N``
column block; its block lies in one piece (every piece's width is a multiple of ``BLOCK_N``).
The rows per program are fixed, not sized from T, so each program sums the same rows in the
same order whatever capacity padding follows (padding rows have a zero ``dy``: a zero
``dpre``, and padding-only programs zero partials), as in the torch kernel; the partials'
final sum is XLA's reduction, whose order may follow the number of programs (torch sums them
in a fixed order with a kernel of its own). Tiles as torch's (128 rows in slices of
32 x 64 columns, 4 warps: the fastest of 48 tilings there); ``scripts/silu_tiles.py`` sweeps
them here.

Given the bias, the kernel takes the GEMM's output ``z`` and forms ``pre = z + bias`` itself
(``model._linear_silu_split`` keeps ``z`` as its residual: a residual ``z + b`` is an array XLA
writes in a pass of its own). On an H200 at bench_upstream's batch 32 the step is still ~1 %
slower with the kernel than with XLA's fusion of autodiff's backward, so jax runs it only when
asked (docs/BENCHMARKS.md, "the SiLU-backward kernel without its biased residual").
"""

from __future__ import annotations

import functools
import os

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from ._common import _compiler_params, _load, _store

ROWS_PER_PROGRAM = 128
BLOCK_R = 32
BLOCK_N = 64
WARPS = 4
# "rows,slice,columns,warps" in place of the four above (an A/B of tiles swept by
# scripts/silu_tiles.py, in a process of its own)
if os.environ.get("HSTU_PALLAS_SILU_TILES"):
    ROWS_PER_PROGRAM, BLOCK_R, BLOCK_N, WARPS = (
        int(v) for v in os.environ["HSTU_PALLAS_SILU_TILES"].split(",")
    )


def supports(widths, rows: int) -> str | None:
    """None when ``silu_backward`` can run pieces of these column widths, else why not."""
    if not widths or any(w <= 0 or w % BLOCK_N for w in widths):
        return f"column blocks {tuple(widths)} (each a positive multiple of {BLOCK_N})"
    if rows <= 0:
        return f"{rows} rows (an empty grid)"
    if rows * sum(widths) >= 2**31:
        return f"{rows} x {sum(widths)} elements (int32 offsets)"
    return None


def _kernel(*refs, widths, rows, has_bias):
    if has_bias:
        *grads, pre_ref, bias_ref, dpre_ref, part_ref = refs
    else:
        (*grads, pre_ref, dpre_ref, part_ref), bias_ref = refs, None
    pid_r, col = pl.program_id(0), pl.program_id(1) * BLOCK_N
    row0 = pid_r * ROWS_PER_PROGRAM
    start = 0
    for g_ref, width in zip(grads, widths, strict=True):  # the piece holding this block

        @pl.when((col >= start) & (col < start + width))
        def _(g_ref=g_ref, local=col - start):
            acc = jnp.zeros((BLOCK_R, BLOCK_N), jnp.float32)
            cols = pl.ds(col, BLOCK_N)
            # the block's bias, read once for all of the program's row slices
            b = None if bias_ref is None else bias_ref[cols].astype(jnp.float32)[None, :]
            for s in range(0, ROWS_PER_PROGRAM, BLOCK_R):
                r = row0 + s
                ok = (r + jnp.arange(BLOCK_R, dtype=jnp.int32) < rows)[:, None]
                dy = _load(g_ref.at[pl.ds(r, BLOCK_R), pl.ds(local, BLOCK_N)], mask=ok, other=0)
                pre = _load(pre_ref.at[pl.ds(r, BLOCK_R), cols], mask=ok, other=0)
                if b is not None:  # pre = z + b, rounded as the forward's add rounds it
                    pre = (pre.astype(jnp.float32) + b).astype(pre_ref.dtype)
                pre = pre.astype(jnp.float32)
                sig = 1.0 / (1.0 + jnp.exp(-pre))
                dpre = dy.astype(jnp.float32) * sig * (1.0 + pre * (1.0 - sig))
                _store(dpre_ref.at[pl.ds(r, BLOCK_R), cols], dpre.astype(dpre_ref.dtype), mask=ok)
                acc += dpre  # rows past T: dy = 0, dpre = 0
            part_ref[pid_r, pl.ds(col, BLOCK_N)] = jnp.sum(acc, axis=0)

        start += width


@functools.partial(jax.jit, static_argnames=("interpret",))
def silu_backward(grads, pre: jax.Array, bias: jax.Array | None = None, interpret: bool = False):
    """``(dpre [T, N] in pre's dtype, dbias [N] fp32)`` of ``silu(pre)`` given the gradient of
    its output as column blocks ``grads`` (``[T, n_i]`` each, ``sum(n_i) = N``, in order).
    With ``bias`` (``[N]``), ``pre`` is the GEMM's output ``z`` and the pre-activation
    ``z + bias`` (rounded to ``z``'s dtype, as the forward's add) is formed in the kernel: the
    forward then keeps ``z``, which the GEMM wrote anyway, as its residual, and XLA writes no
    biased copy of it (a ``[T, N]`` add kernel, 47 us a layer at bench_upstream's batch 32)."""
    grads = tuple(grads)
    rows, n = pre.shape
    widths = tuple(g.shape[1] for g in grads)
    why = supports(widths, rows)
    if why is None and sum(widths) != n:
        why = f"column blocks {widths} for {n} columns"
    if why is None and any(g.shape[0] != rows for g in grads):
        why = f"row counts {tuple(g.shape[0] for g in grads)} for {rows} rows"
    if why is None and bias is not None and bias.shape != (n,):
        why = f"bias of shape {bias.shape} for {n} columns"
    if why is not None:
        raise ValueError(f"silu_backward: {why}")
    programs = pl.cdiv(rows, ROWS_PER_PROGRAM)
    kwargs = {} if interpret else {"compiler_params": _compiler_params(WARPS, 1)}
    dpre, partials = pl.pallas_call(
        functools.partial(_kernel, widths=widths, rows=rows, has_bias=bias is not None),
        out_shape=(
            jax.ShapeDtypeStruct((rows, n), pre.dtype),
            jax.ShapeDtypeStruct((programs, n), jnp.float32),
        ),
        grid=(programs, n // BLOCK_N),
        interpret=interpret,
        name="silu_bwd_bias",
        **kwargs,
    )(*grads, pre, *([] if bias is None else [bias]))
    return dpre, jnp.sum(partials, axis=0)


def silu_backward_reference(grads, pre: jax.Array, bias: jax.Array | None = None):
    """The same in jnp (fp32 arithmetic, the bias gradient from the unrounded dpre)."""
    dy = jnp.concatenate([g.astype(jnp.float32) for g in grads], axis=1)
    if bias is not None:
        pre = (pre.astype(jnp.float32) + bias.astype(jnp.float32)).astype(pre.dtype)
    p = pre.astype(jnp.float32)
    sig = jax.nn.sigmoid(p)
    dpre = dy * sig * (1.0 + p * (1.0 - sig))
    return dpre.astype(pre.dtype), jnp.sum(dpre, axis=0)
