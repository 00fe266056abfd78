"""HSTU attention as Pallas kernels (Triton lowering on GPU, interpret mode on CPU).

Contract: ``kernels/README.md`` (jagged ``[T, H, D]`` layout, causal + contextual +
candidate mask, optional relative position / time bias, SiLU attention divided by a fixed
normalizer). Forward and backward are Pallas kernels tied together by ``jax.custom_vjp``:

* forward, grid ``(pair, head)``: one program owns ``block_q`` query rows of one sample
  and head, loops over the key blocks the mask allows and accumulates
  ``silu(alpha * q k^T + bias) / N @ v`` in fp32;
* ``dq`` kernel, same grid and loop as the forward;
* ``dk``/``dv`` kernel, grid ``(pair, head)`` over key blocks: loops over the query blocks
  that can see the key block; it also reduces ``dS`` (the gradient of the pre-SiLU score,
  which is the bias gradient) into per-program partial outputs for ``rab_time`` (bucket
  sums) and per-tile diagonal sums for ``rab_pos``; both are summed in jnp in a fixed
  order (no atomics, deterministic).

A grid entry ``pair`` is one (block, sample) pair that holds tokens, read from a schedule
table computed in jnp (``kernels/schedule.py``): heaviest blocks first, and no programs for
the blocks past a sample's end (a ``(max_seqlen / block) x B`` grid is mostly those on
jagged batches).

The jagged layout is handled by passing ``seq_offsets`` (and the per-sample contextual /
candidate counts) as input refs: every program reads its sample's start and length, and
all loads / stores of token rows are masked to the sample, so blocks never spill into a
neighbour. Tiles are in sample-local coordinates, so the key blocks a query block needs
follow from ``(n, C, K)`` alone and fully masked blocks are skipped; blocks known to be
fully unmasked skip the mask arithmetic.

Numerics: matmuls accumulate in fp32 (fp32 operands at full precision, not TF32); compiled
bf16/fp16 calls evaluate the sigmoid with ``tanh.approx`` (error far below 16-bit rounding).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from ..tiles import resolve_tiles
from . import _mosaic
from ._backward import _backward
from ._common import KERNELS, BlockSizes, _approx_tanh, _Cfg, _next_pow2, default_block_sizes
from ._forward import _forward

__all__ = [
    "LOWERINGS",
    "KERNELS",
    "BlockSizes",
    "MosaicTiles",
    "default_block_sizes",
    "hstu_attention",
    "mosaic_problem",
]

LOWERINGS = ("triton", "mosaic", "auto")
MosaicTiles = _mosaic.MosaicTiles


def _any_forward(cfg, q, k, v, rab_pos, rab_time, offs, ctx, cand, ts):
    if cfg.lowering == "mosaic":
        return _mosaic.forward(q, k, v, offs, ctx, cand, **cfg.mosaic_kwargs("fwd"))
    return _forward(cfg, q, k, v, rab_pos, rab_time, offs, ctx, cand, ts)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _hstu_attention(cfg, q, k, v, rab_pos, rab_time, offs, ctx, cand, ts):
    return _any_forward(cfg, q, k, v, rab_pos, rab_time, offs, ctx, cand, ts)


def _hstu_attention_fwd(cfg, q, k, v, rab_pos, rab_time, offs, ctx, cand, ts):
    out = _any_forward(cfg, q, k, v, rab_pos, rab_time, offs, ctx, cand, ts)
    return out, (q, k, v, rab_pos, rab_time, offs, ctx, cand, ts)


_hstu_attention.defvjp(_hstu_attention_fwd, _backward)


# --------------------------------------------------------------------------------------
# Public entry point.
# --------------------------------------------------------------------------------------

_FLOATS = (jnp.float32, jnp.bfloat16, jnp.float16)


def _err(name: str, msg: str) -> ValueError:
    return ValueError(f"{name}: {msg}")


def _resolve_blocks(
    block_sizes, dim: int, dtype, interpret: bool
) -> tuple[BlockSizes, BlockSizes, BlockSizes]:
    return resolve_tiles(
        block_sizes, BlockSizes, lambda k: default_block_sizes(dim, k, dtype, interpret)
    )


def _check_int_vector(x, name: str, length: int):
    if x.ndim != 1 or x.shape[0] != length:
        raise _err(name, f"expected shape ({length},), got {tuple(x.shape)}")
    if not jnp.issubdtype(x.dtype, jnp.integer):
        raise _err(name, f"expected an integer dtype, got {x.dtype}")


@functools.partial(
    jax.jit,
    static_argnames=(
        "max_seqlen",
        "alpha",
        "normalizer",
        "block_sizes",
        "interpret",
        "lowering",
        "mosaic_tiles",
    ),
)
def hstu_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    seq_offsets: jax.Array,
    *,
    max_seqlen: int,
    alpha: float,
    normalizer: float,
    num_contextual: jax.Array | None = None,
    num_candidates: jax.Array | None = None,
    timestamps: jax.Array | None = None,
    rab_pos: jax.Array | None = None,
    rab_time: jax.Array | None = None,
    block_sizes: BlockSizes | tuple[BlockSizes, ...] | None = None,
    interpret: bool | None = None,
    lowering: str = "triton",
    mosaic_tiles: tuple[MosaicTiles, ...] | None = None,
) -> jax.Array:
    """HSTU attention over a jagged batch (see ``kernels/README.md``).

    Args:
      q, k: ``[T, H, Dqk]``; v: ``[T, H, Dv]`` (fp32, bf16 or fp16, one dtype).
      seq_offsets: ``[B + 1]`` int, leading 0; rows past ``seq_offsets[-1]`` are padding.
      max_seqlen: static bound on every sample's length (tiling only). Samples longer
        than this are not fully computed (not checked: it would need a host sync).
      alpha: scale inside the SiLU; normalizer: fixed divisor.
      num_contextual, num_candidates: ``[B]`` int or None.
      timestamps: ``[T]`` int (used as int32), required with ``rab_time``.
      rab_pos: ``[H, P]``; rab_time: ``[H, Tb]`` bias tables or None.
      block_sizes: tiling: one ``BlockSizes`` for every kernel, a (forward, backward) pair
        or a (forward, dk/dv, dq) triple; None: ``default_block_sizes`` of the head dim.
      interpret: run the Pallas interpreter; None means "when the default backend is CPU".
      lowering: the Pallas lowering of the kernels: ``triton`` (Triton), ``mosaic`` (Mosaic
        GPU, ``_mosaic.py``: jax >= 0.11, no biases, 16-bit inputs, head dims up to 256; an
        error names what rules a call out) or ``auto`` (Mosaic GPU where it can run,
        compiled on a Hopper GPU; else Triton).
      mosaic_tiles: (forward, dq, dk/dv) ``MosaicTiles`` (a (forward, dq) pair: default dk /
        dv tiles); None: ``_mosaic.default_tiles``.

    Returns ``[T, H, Dv]`` in ``q.dtype`` (fp32 accumulation), zero past
    ``seq_offsets[-1]``. Differentiable in q, k, v, rab_pos and rab_time.
    """
    if q.ndim != 3:
        raise _err("q", f"expected [T, H, Dqk], got shape {tuple(q.shape)}")
    t_cap, heads, d_qk = q.shape
    if k.shape != q.shape:
        raise _err("k", f"expected shape {tuple(q.shape)} (as q), got {tuple(k.shape)}")
    if v.ndim != 3 or v.shape[:2] != (t_cap, heads):
        raise _err("v", f"expected [T={t_cap}, H={heads}, Dv], got {tuple(v.shape)}")
    if q.dtype not in _FLOATS:
        raise _err("q", f"dtype must be float32, bfloat16 or float16, got {q.dtype}")
    if k.dtype != q.dtype:
        raise _err("k", f"dtype {k.dtype} differs from q's {q.dtype}")
    if v.dtype != q.dtype:
        raise _err("v", f"dtype {v.dtype} differs from q's {q.dtype}")
    if seq_offsets.ndim != 1 or seq_offsets.shape[0] < 1:
        raise _err("seq_offsets", f"expected [B + 1], got shape {tuple(seq_offsets.shape)}")
    if not jnp.issubdtype(seq_offsets.dtype, jnp.integer):
        raise _err("seq_offsets", f"expected an integer dtype, got {seq_offsets.dtype}")
    if not isinstance(max_seqlen, int) or isinstance(max_seqlen, bool) or max_seqlen < 1:
        raise _err("max_seqlen", f"expected a python int >= 1, got {max_seqlen!r}")
    if not isinstance(alpha, int | float):
        raise _err("alpha", f"expected a python float, got {alpha!r}")
    if not isinstance(normalizer, int | float) or normalizer == 0:
        raise _err("normalizer", f"expected a non-zero python float, got {normalizer!r}")
    bsz = seq_offsets.shape[0] - 1
    if num_contextual is not None:
        _check_int_vector(num_contextual, "num_contextual", bsz)
    if num_candidates is not None:
        _check_int_vector(num_candidates, "num_candidates", bsz)
    for name, tab in (("rab_pos", rab_pos), ("rab_time", rab_time)):
        if tab is None:
            continue
        if tab.ndim != 2 or tab.shape[0] != heads or tab.shape[1] < 1:
            raise _err(name, f"expected [H={heads}, size >= 1], got {tuple(tab.shape)}")
        if not jnp.issubdtype(tab.dtype, jnp.floating):
            raise _err(name, f"expected a float dtype, got {tab.dtype}")
    if rab_time is not None and timestamps is None:
        raise _err("timestamps", "required when rab_time is given")
    if timestamps is not None:
        _check_int_vector(timestamps, "timestamps", t_cap)
    if interpret is None:
        interpret = jax.default_backend() == "cpu"
    tiles = _resolve_blocks(block_sizes, max(d_qk, v.shape[2]), q.dtype, interpret)

    if lowering not in LOWERINGS:
        raise _err("lowering", f"expected one of {LOWERINGS}, got {lowering!r}")
    dims = (max(64, _next_pow2(d_qk)), max(64, _next_pow2(v.shape[2])))  # Mosaic's padding
    if mosaic_tiles is None:
        mosaic_tiles = tuple(_mosaic.default_tiles(kind, *dims) for kind in _mosaic.KINDS)
    mosaic_tiles = _mosaic.full_tiles(mosaic_tiles, *dims)
    has_bias = rab_pos is not None or rab_time is not None
    why = mosaic_problem(q.dtype, d_qk, v.shape[2], has_bias, mosaic_tiles, interpret)
    if lowering == "mosaic" and why is not None:
        raise _err("lowering", f"the Mosaic GPU kernels cannot run this call: {why}")
    auto = lowering == "auto" and why is None and not interpret  # never the interpreter
    lowering = "mosaic" if lowering == "mosaic" or auto else "triton"

    d_v = v.shape[2]
    if bsz == 0 or t_cap == 0:
        return jnp.zeros((t_cap, heads, d_v), q.dtype)

    cfg = _Cfg(
        max_seqlen=max_seqlen,
        alpha=float(alpha),
        normalizer=float(normalizer),
        tiles=tiles,
        interpret=bool(interpret),
        has_ctx=num_contextual is not None,
        has_cand=num_candidates is not None,
        pos_size=0 if rab_pos is None else int(rab_pos.shape[1]),
        time_size=0 if rab_time is None else int(rab_time.shape[1]),
        fast_math=(not interpret) and q.dtype != jnp.float32 and _approx_tanh is not None,
        lowering=lowering,
        mosaic_tiles=mosaic_tiles,
    )
    # Head dims padded to powers of two >= 16 (Triton tiles; >= 64 for Mosaic GPU's wgmma
    # tiles); zero columns are inert.
    least = 64 if lowering == "mosaic" else 16
    dqk_p = max(least, _next_pow2(d_qk))
    dv_p = max(least, _next_pow2(d_v))
    if dqk_p != d_qk:
        pad = ((0, 0), (0, 0), (0, dqk_p - d_qk))
        q, k = jnp.pad(q, pad), jnp.pad(k, pad)
    if dv_p != d_v:
        v = jnp.pad(v, ((0, 0), (0, 0), (0, dv_p - d_v)))
    offs = seq_offsets.astype(jnp.int32)
    ctx = None if num_contextual is None else num_contextual.astype(jnp.int32)
    cand = None if num_candidates is None else num_candidates.astype(jnp.int32)
    ts = None if rab_time is None else timestamps.astype(jnp.int32)
    out = _hstu_attention(cfg, q, k, v, rab_pos, rab_time, offs, ctx, cand, ts)
    return out[..., :d_v] if dv_p != d_v else out


def _on_hopper() -> bool:
    devices = jax.devices()
    cc = getattr(devices[0], "compute_capability", "") if devices else ""
    return devices[0].platform == "gpu" and str(cc).startswith("9")


def mosaic_problem(
    dtype, d_qk: int, d_v: int, has_bias: bool, tiles, interpret: bool | None
) -> str | None:
    """None when ``lowering="mosaic"`` can run a call of this shape with ``tiles`` (forward,
    dq and dk/dv, or a (forward, dq) pair; None: the defaults for these head dims) here, else
    why not. Head dims as given: they are padded to a power of two >= 64."""
    dims = (max(64, _next_pow2(d_qk)), max(64, _next_pow2(d_v)))
    if tiles is None:
        tiles = tuple(_mosaic.default_tiles(kind, *dims) for kind in _mosaic.KINDS)
    why = _mosaic.supports(dtype, *dims, has_bias, tiles)
    if why is None and not interpret and not _on_hopper():
        why = "no Hopper GPU (wgmma needs compute capability 9.x)"
    return why
