"""The two LayerNorms of an HSTU layer as one Pallas kernel each way (Triton lowering): the JAX
twin of ``kernels/triton/layer_norm.py``'s forward and backward.

    y = LN(x) w + b,        x passed on          (``norm_residual``: the input norm of the
                                                   residual stream, whose other use is the
                                                   layer's skip connection)
    y = (LN(a) w + b) * u                        (``gated_norm``: ``attn_norm(a) * u``)

Statistics and arithmetic in fp32 whatever the inputs' dtype, as ``flax.linen.LayerNorm(dtype=
float32, use_fast_variance=False)`` computes them (the mean, then the mean of the centred
squares; ``y = (x - mean) * (rsqrt(var + eps) * w) + b``), and ``y`` rounded once into
``out_dtype`` (the dtype the next GEMM casts it to). ``w`` and ``b`` are read as they are (the
model's fp32 parameters) and their gradients come back in fp32.

Why a kernel: XLA makes several passes of these (docs/BENCHMARKS.md, "jax: device-bound at
batch 32"): the gated norm's forward in four kernels (the mean, the variance, an rsqrt, the
apply), its backward in three; the input norm's backward in one fusion for dx and, for the
parameters' gradients, column reductions of their own (by the profile's kernel names, over a
``dy * xhat`` product written out first; ~65 us a layer at bench_upstream's batch 32 on an
H200, where the bytes that must move take ~20). Here the backward reads ``x``, ``dy`` (and
``u``, or the residual's gradient) once, writes ``dx`` (and ``du``), and sums the parameters'
gradients in per-program fp32 partials that a small reduction adds up, as the torch kernel
does.

The backward's rows per program are fixed (``ROWS_PER_PROGRAM``), not sized from T, so the
parameters' gradients are summed over the same groups of rows whatever capacity padding follows
the real rows (padding rows, zero with a zero upstream gradient, add exact zeros).
``norm_residual``'s second output is ``x`` itself: its cotangent, the gradient that reaches
``x`` through the skip connection, is added into ``dx`` in the same pass (autodiff would add
the two in XLA; with the norm's backward in a kernel that add would be a pass of its own).
"""

from __future__ import annotations

import functools
import os

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from ._common import _compiler_params, _is_pow2, _load, _store

ROWS_PER_PROGRAM = 64  # backward (torch's kernel: 64 rows a program, 4-row slices at D=1024)
MAX_VALUES = 4096  # values per row slice (BLOCK_R x D): the slice's rows at D=1024 are 4
# Triton's software pipelining of the backward's slice loop (torch's kernel: 3 stages took its
# pair of backward calls from 95.0 to 77.5 us at 12288 x 1024 on an H200); no value changes
BWD_STAGES = 3
# "xla": the forwards in jnp for XLA to fuse (the same values up to the sums' order; XLA makes
# one pass of the input norm already, four of the gated one), the backwards the kernels'; an
# A/B of the step in processes of their own (`HSTU_PALLAS_NORM_FORWARD=xla`)
FORWARD = os.environ.get("HSTU_PALLAS_NORM_FORWARD", "kernel")
if FORWARD not in ("kernel", "xla"):
    raise ValueError(f"HSTU_PALLAS_NORM_FORWARD: expected kernel or xla, got {FORWARD!r}")


def supports(rows: int, d: int) -> str | None:
    """None when the kernels can run ``[rows, d]``, else why not."""
    if not _is_pow2(d) or not 16 <= d <= MAX_VALUES:
        return f"width {d} (a power of two from 16 to {MAX_VALUES})"
    if rows <= 0:
        return f"{rows} rows (an empty grid)"
    if (rows + ROWS_PER_PROGRAM) * d >= 2**31:
        return f"{rows} x {d} elements (int32 offsets)"
    return None


def _tiles(d: int) -> tuple[int, int]:
    """(rows per slice, warps) of width ``d``: ~4K values a slice, 4 warps up to that."""
    block_r = max(1, min(8, MAX_VALUES // d))
    return block_r, 4 if block_r * d <= 4096 else 8


def _check(x, **others):
    rows, d = x.shape
    why = supports(rows, d)
    for name, arr in others.items():
        if (
            why is None
            and arr is not None
            and arr.shape != ((d,) if name in ("scale", "bias") else (rows, d))
        ):
            why = f"{name} of shape {arr.shape} for rows of shape {x.shape}"
    if why is not None:
        raise ValueError(f"layer_norm: {why}")
    return rows, d


def _fwd_kernel(*refs, rows, d, eps, block_r, gated):
    if gated:
        x_ref, w_ref, b_ref, u_ref, y_ref, mean_ref, rstd_ref = refs
    else:
        (x_ref, w_ref, b_ref, y_ref, mean_ref, rstd_ref), u_ref = refs, None
    r0 = pl.program_id(0) * block_r
    ok = r0 + jnp.arange(block_r, dtype=jnp.int32) < rows
    at = (pl.ds(r0, block_r), slice(None))
    x = _load(x_ref.at[at], mask=ok[:, None], other=0).astype(jnp.float32)
    mean = jnp.sum(x, axis=1) / d
    xc = x - mean[:, None]
    rstd = lax.rsqrt(jnp.sum(xc * xc, axis=1) / d + eps)
    w = w_ref[...].astype(jnp.float32)
    y = xc * (rstd[:, None] * w[None, :]) + b_ref[...].astype(jnp.float32)[None, :]
    if gated:
        y = y * _load(u_ref.at[at], mask=ok[:, None], other=0).astype(jnp.float32)
    _store(y_ref.at[at], y.astype(y_ref.dtype), mask=ok[:, None])
    _store(mean_ref.at[pl.ds(r0, block_r)], mean, mask=ok)
    _store(rstd_ref.at[pl.ds(r0, block_r)], rstd, mask=ok)


def _forward_xla(x, scale, bias, u, eps, out_dtype):
    """`_forward`'s values in jnp (`FORWARD = "xla"`)."""
    f32 = jnp.float32
    x32 = x.astype(f32)
    mean = jnp.mean(x32, axis=1)
    xc = x32 - mean[:, None]
    rstd = lax.rsqrt(jnp.mean(xc * xc, axis=1) + eps)
    y = xc * (rstd[:, None] * scale.astype(f32)[None, :]) + bias.astype(f32)[None, :]
    if u is not None:
        y = y * u.astype(f32)
    return y.astype(out_dtype), mean, rstd


def _forward(x, scale, bias, u, eps, out_dtype, interpret):
    if FORWARD == "xla":
        return _forward_xla(x, scale, bias, u, eps, out_dtype)
    rows, d = x.shape
    block_r, warps = _tiles(d)
    kwargs = {} if interpret else {"compiler_params": _compiler_params(warps, 1)}
    stats = jax.ShapeDtypeStruct((rows,), jnp.float32)
    return pl.pallas_call(
        functools.partial(
            _fwd_kernel, rows=rows, d=d, eps=eps, block_r=block_r, gated=u is not None
        ),
        out_shape=(jax.ShapeDtypeStruct((rows, d), out_dtype), stats, stats),
        grid=(pl.cdiv(rows, block_r),),
        interpret=interpret,
        name="layer_norm_fwd" if u is None else "gated_norm_fwd",
        **kwargs,
    )(x, scale, bias, *([] if u is None else [u]))


def _bwd_kernel(*refs, rows, d, block_r, gated):
    x_ref, w_ref, b_ref, mean_ref, rstd_ref, dy_ref, other_ref, dx_ref, *rest = refs
    if gated:  # other: the gate u; rest: du and the partials
        du_ref, part_ref = rest
    else:  # other: the residual's gradient
        (part_ref,), du_ref = rest, None
    pid = pl.program_id(0)
    row0 = pid * ROWS_PER_PROGRAM
    w = w_ref[...].astype(jnp.float32)[None, :]
    b = b_ref[...].astype(jnp.float32)[None, :] if gated else None

    def body(i, carry):
        dw, db = carry
        r = row0 + i * block_r
        ok = r + jnp.arange(block_r, dtype=jnp.int32) < rows
        at, m = (pl.ds(r, block_r), slice(None)), ok[:, None]
        x = _load(x_ref.at[at], mask=m, other=0).astype(jnp.float32)
        mean = _load(mean_ref.at[pl.ds(r, block_r)], mask=ok, other=0)
        rstd = _load(rstd_ref.at[pl.ds(r, block_r)], mask=ok, other=0)
        xhat = (x - mean[:, None]) * rstd[:, None]  # masked rows: 0
        dn = _load(dy_ref.at[at], mask=m, other=0).astype(jnp.float32)
        other = _load(other_ref.at[at], mask=m, other=0).astype(jnp.float32)
        if gated:  # the gate's gradient: the norm's output times dy
            _store(du_ref.at[at], (dn * (xhat * w + b)).astype(du_ref.dtype), mask=m)
            dn = dn * other
        dw += jnp.sum(dn * xhat, axis=0)
        db += jnp.sum(dn, axis=0)
        wdn = dn * w
        c1 = jnp.sum(xhat * wdn, axis=1) / d
        c2 = jnp.sum(wdn, axis=1) / d
        dx = (wdn - (xhat * c1[:, None] + c2[:, None])) * rstd[:, None]
        if not gated:  # x's gradient through the skip connection joins the norm's
            dx = dx + other
        _store(dx_ref.at[at], dx.astype(dx_ref.dtype), mask=m)
        return dw, db

    zeros = jnp.zeros((d,), jnp.float32)
    dw, db = lax.fori_loop(0, ROWS_PER_PROGRAM // block_r, body, (zeros, zeros))
    # both partials in one row, so that one reduction sums them (a small kernel a norm less)
    part_ref[pid, pl.ds(0, d)] = dw
    part_ref[pid, pl.ds(d, d)] = db


def _backward(x, scale, bias, mean, rstd, dy, other, gated, interpret):
    """``(dx, du or None, dscale, dbias)``; ``other`` is the gate ``u`` (gated) or the
    gradient reaching ``x`` through the skip connection (added into dx)."""
    rows, d = x.shape
    block_r, warps = _tiles(d)
    programs = pl.cdiv(rows, ROWS_PER_PROGRAM)
    kwargs = {} if interpret else {"compiler_params": _compiler_params(warps, BWD_STAGES)}
    part = jax.ShapeDtypeStruct((programs, 2 * d), jnp.float32)  # [scale's | bias's]
    shapes = [jax.ShapeDtypeStruct((rows, d), x.dtype)]
    if gated:
        shapes.append(jax.ShapeDtypeStruct((rows, d), other.dtype))
    out = pl.pallas_call(
        functools.partial(_bwd_kernel, rows=rows, d=d, block_r=block_r, gated=gated),
        out_shape=(*shapes, part),
        grid=(programs,),
        interpret=interpret,
        name="gated_norm_bwd" if gated else "layer_norm_bwd",
        **kwargs,
    )(x, scale, bias, mean, rstd, dy, other)
    dx, du = out[0], (out[1] if gated else None)
    total = jnp.sum(out[-1], axis=0)
    dscale = total[:d].astype(scale.dtype)
    dbias = total[d:].astype(bias.dtype)
    return dx, du, dscale, dbias


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5))
def norm_residual(x, scale, bias, eps: float, out_dtype, interpret: bool = False):
    """``(LN(x) * scale + bias in out_dtype, x)``: the norm of ``x [T, D]`` and ``x`` itself,
    whose cotangent (the gradient through the skip connection) the backward adds into dx."""
    return _norm_residual_fwd(x, scale, bias, eps, out_dtype, interpret)[0]


def _norm_residual_fwd(x, scale, bias, eps, out_dtype, interpret):
    _check(x, scale=scale, bias=bias)
    y, mean, rstd = _forward(x, scale, bias, None, eps, jnp.dtype(out_dtype), interpret)
    return (y, x), (x, scale, bias, mean, rstd)


def _norm_residual_bwd(eps, out_dtype, interpret, res, grads):
    x, scale, bias, mean, rstd = res
    dy, dres = grads
    dx, _, dscale, dbias = _backward(
        x, scale, bias, mean, rstd, dy.astype(x.dtype), dres.astype(x.dtype), False, interpret
    )
    return dx, dscale, dbias


norm_residual.defvjp(_norm_residual_fwd, _norm_residual_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6))
def gated_norm(a, u, scale, bias, eps: float, out_dtype, interpret: bool = False):
    """``(LN(a) * scale + bias) * u`` in ``out_dtype``, for ``a``, ``u`` of ``[T, D]``."""
    return _gated_norm_fwd(a, u, scale, bias, eps, out_dtype, interpret)[0]


def _gated_norm_fwd(a, u, scale, bias, eps, out_dtype, interpret):
    _check(a, u=u, scale=scale, bias=bias)
    y, mean, rstd = _forward(a, scale, bias, u, eps, jnp.dtype(out_dtype), interpret)
    return y, (a, u, scale, bias, mean, rstd)


def _gated_norm_bwd(eps, out_dtype, interpret, res, dy):
    a, u, scale, bias, mean, rstd = res
    da, du, dscale, dbias = _backward(a, scale, bias, mean, rstd, dy, u, True, interpret)
    return da, du, dscale, dbias


gated_norm.defvjp(_gated_norm_fwd, _gated_norm_bwd)


def layer_norm_reference(x, scale, bias, eps: float, u=None, out_dtype=None):
    """The same forward in jnp, as flax's LayerNorm (fp32, ``use_fast_variance=False``)."""
    f32 = jnp.float32
    x32 = x.astype(f32)
    mean = jnp.mean(x32, axis=-1, keepdims=True)
    var = jnp.mean(jnp.square(x32 - mean), axis=-1, keepdims=True)
    y = (x32 - mean) * (lax.rsqrt(var + eps) * scale.astype(f32)) + bias.astype(f32)
    if u is not None:
        y = y * u.astype(f32)
    return y.astype(out_dtype or x.dtype)


__all__ = [
    "ROWS_PER_PROGRAM",
    "gated_norm",
    "layer_norm_reference",
    "norm_residual",
    "supports",
]
