"""Shared pieces of the Pallas HSTU attention kernels (see ``hstu_attention.py``).

Version compatibility shim, ``BlockSizes`` and the static per-call ``_Cfg``, the in-kernel
helpers (block ranges, masked loads, scores / mask / bias, SiLU) and the ``pallas_call``
plumbing shared by the forward (``_forward.py``) and backward (``_backward.py``) passes.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from ..schedule import pairs, schedule
from ..tiles import KERNELS

try:  # the Triton-specific Pallas API (load/store with masks, compiler params)
    from jax.experimental.pallas import triton as _plgpu
except ImportError:  # pragma: no cover - very old / stripped jax builds
    _plgpu = None


def sample_of(ends: jax.Array, size: int) -> jax.Array:
    """``[size]`` int32: the sample holding each row ``0 .. size - 1`` given the samples'
    non-decreasing exclusive ``ends``, clipped to ``[0, len(ends) - 1]``; exactly
    ``clip(searchsorted(ends, row, side="right"), 0, len(ends) - 1)``. Not jnp.searchsorted's
    default binary search, which XLA runs as a loop of small kernels: one fused comparison of
    every row with every end while that is small (a batch's samples), one sort beyond."""
    n = ends.shape[0]
    method = "compare_all" if n * size <= 1 << 24 else "sort"
    rows = jnp.arange(size, dtype=ends.dtype)
    out = jnp.searchsorted(ends, rows, side="right", method=method)
    return jnp.clip(out, 0, n - 1).astype(jnp.int32)


# --------------------------------------------------------------------------------------
# Version compatibility shim (jax 0.10.x and 0.11.x).
#
# * The Triton compiler params are ``plgpu.CompilerParams`` in jax >= 0.6 (both 0.10.2 and
#   0.11.2); older releases called them ``plgpu.TritonCompilerParams``.
# * Since jax 0.11, ``pallas_call`` on GPU picks its lowering from the *type* of
#   ``compiler_params``, so we always pass the Triton params explicitly.
# * Masked ``load`` / ``store`` live in ``plgpu`` (``pl.load``/``pl.store`` were removed
#   from the top-level namespace); fall back to the top level for older releases.
# --------------------------------------------------------------------------------------


def _resolve(*candidates):
    for mod, name in candidates:
        if mod is not None and hasattr(mod, name):
            return getattr(mod, name)
    return None


_CompilerParams = _resolve((_plgpu, "CompilerParams"), (_plgpu, "TritonCompilerParams"))
_load = _resolve((_plgpu, "load"), (pl, "load"))
_store = _resolve((_plgpu, "store"), (pl, "store"))
_debug_barrier = _resolve((_plgpu, "debug_barrier"))
_approx_tanh = _resolve((_plgpu, "approx_tanh"))


def _compiler_params(num_warps: int, num_stages: int):
    if _CompilerParams is None:  # pragma: no cover
        raise RuntimeError("this jax has no Pallas Triton compiler params")
    return _CompilerParams(num_warps=num_warps, num_stages=num_stages)


def _is_pow2(x: int) -> bool:
    return x >= 1 and (x & (x - 1)) == 0


def _next_pow2(x: int) -> int:
    return 1 << max(0, int(x) - 1).bit_length()


@dataclasses.dataclass(frozen=True)
class BlockSizes:
    """Tiling of one kernel (``hstu_attention`` takes one for all three kernels, a (forward,
    backward) pair or a (forward, dk/dv, dq) triple).

    ``block_q`` / ``block_k``: query / key rows per tile, powers of two >= 16 (Triton
    ``dot`` needs every dimension >= 16). Both are capped at ``next_pow2(max_seqlen)``.
    ``num_warps`` / ``num_stages``: Triton launch parameters (ignored in interpret mode).
    """

    block_q: int = 64
    block_k: int = 32
    num_warps: int = 4
    num_stages: int = 3

    def __post_init__(self):
        for name in ("block_q", "block_k"):
            val = getattr(self, name)
            if not isinstance(val, int) or not _is_pow2(val) or val < 16:
                raise ValueError(f"BlockSizes.{name}: expected a power of two >= 16, got {val!r}")
        if not isinstance(self.num_warps, int) or not _is_pow2(self.num_warps):
            raise ValueError(
                f"BlockSizes.num_warps: expected a power of two, got {self.num_warps!r}"
            )
        if not isinstance(self.num_stages, int) or self.num_stages < 1:
            raise ValueError(
                f"BlockSizes.num_stages: expected an int >= 1, got {self.num_stages!r}"
            )


# bf16 / fp16 tiles per head dim (the larger of Dqk and Dv, rounded up to a power of two) and
# kernel, from `python -m hstu_kernels.pallas.tune` on an H200 (table in kernels/README.md).
# Head dims without a row use ``BlockSizes()`` for every kernel.
_TUNED: dict[int, dict[str, BlockSizes]] = {
    256: {"fwd": BlockSizes(128, 64, 8, 2), "dkdv": BlockSizes(64, 32, 4, 2),
          "dq": BlockSizes(64, 32, 4, 3)},
}  # fmt: skip


def default_block_sizes(
    dim: int, kernel: str, dtype=jnp.bfloat16, interpret: bool = False
) -> BlockSizes:
    """Tiles of kernel ``fwd`` / ``dkdv`` / ``dq`` for head dim ``dim``: the tuned table for
    compiled 16-bit inputs, ``BlockSizes()`` otherwise (fp32, interpret mode, untuned dims)."""
    if kernel not in KERNELS:
        raise ValueError(f"kernel must be one of {KERNELS}, got {kernel!r}")
    if interpret or jnp.dtype(dtype) == jnp.float32:
        return BlockSizes()
    row = _TUNED.get(max(16, _next_pow2(dim)), {})
    return row.get(kernel, BlockSizes())


@dataclasses.dataclass(frozen=True)
class _Cfg:
    """Static configuration of one call (hashable: it is a custom_vjp nondiff arg). ``tiles``
    holds every kernel's ``BlockSizes``; ``kernel`` names the one whose tiles ``bq`` / ``bk``
    / ``num_warps`` / ``num_stages`` read (``for_kernel``)."""

    max_seqlen: int
    alpha: float
    normalizer: float
    tiles: tuple[BlockSizes, BlockSizes, BlockSizes]  # (forward, dk/dv, dq)
    interpret: bool
    has_ctx: bool
    has_cand: bool
    pos_size: int  # P, 0 when rab_pos is None
    time_size: int  # Tb, 0 when rab_time is None
    fast_math: bool  # sigmoid via tanh.approx (compiled 16-bit inputs only)
    kernel: str = "fwd"
    lowering: str = "triton"  # the kernels' lowering: triton | mosaic (``_mosaic.py``)
    mosaic_tiles: tuple = ()  # (forward, dq, dk/dv) ``_mosaic.MosaicTiles`` when mosaic

    def mosaic_kwargs(self, kind: str) -> dict:
        """Keyword arguments of ``_mosaic.forward`` / ``backward_dq`` / ``backward_dkdv``."""
        return dict(
            max_seqlen=self.max_seqlen,
            alpha=self.alpha,
            normalizer=self.normalizer,
            tiles=self.mosaic_tiles[("fwd", "dq", "dkdv").index(kind)],
            interpret=self.interpret,
        )

    def for_kernel(self, kernel: str) -> _Cfg:
        return dataclasses.replace(self, kernel=kernel)

    @property
    def _tile(self) -> BlockSizes:
        return self.tiles[KERNELS.index(self.kernel)]

    @property
    def bq(self) -> int:  # tiles never exceed the (power-of-two) longest sample
        return min(self._tile.block_q, max(16, _next_pow2(self.max_seqlen)))

    @property
    def bk(self) -> int:
        return min(self._tile.block_k, max(16, _next_pow2(self.max_seqlen)))

    @property
    def num_warps(self) -> int:
        return self._tile.num_warps

    @property
    def num_stages(self) -> int:
        return self._tile.num_stages

    @property
    def nqb(self) -> int:
        return -(-self.max_seqlen // self.bq)

    @property
    def nkb(self) -> int:
        return -(-self.max_seqlen // self.bk)

    @property
    def time_pad(self) -> int:
        return max(16, _next_pow2(self.time_size))

    @property
    def upad(self) -> int:  # diagonals of a [bq, bk] tile, padded to a power of two
        return _next_pow2(self.bq + self.bk - 1)


# --------------------------------------------------------------------------------------
# In-kernel helpers.
# --------------------------------------------------------------------------------------


class _Refs:
    """Named view over the flat ref list of a pallas_call (optional refs may be None)."""

    def __init__(self, refs, cfg: _Cfg, names_in, names_out):
        refs = list(refs)
        self.sched = refs.pop(0)
        self.off = refs.pop(0)
        self.ctx = refs.pop(0) if cfg.has_ctx else None
        self.cand = refs.pop(0) if cfg.has_cand else None
        self.ts = refs.pop(0) if cfg.time_size else None
        self.rab_pos = refs.pop(0) if cfg.pos_size else None
        self.rab_time = refs.pop(0) if cfg.time_size else None
        self.dtime = self.dpos = self.scratch = None
        for name in names_in:
            setattr(self, name, refs.pop(0))
        for name in names_out:
            if name is not None:
                setattr(self, name, refs.pop(0))
        assert not refs, refs


def _cdiv(x, d: int):
    """Ceil division of a non-negative traced int32 scalar by a static int."""
    return lax.div(x + (d - 1), jnp.int32(d))


def _program(r: _Refs):
    """(block, sample, has work, head) of this program: its row of the schedule table
    (``_schedule_table``) and the grid's head axis."""
    j = pl.program_id(0)
    num = r.sched.shape[0] // 3
    return r.sched[j], r.sched[num + j], r.sched[2 * num + j] != 0, pl.program_id(1)


def _sample_meta(r: _Refs, b, valid, cfg: _Cfg):
    """(start, n, C, end-of-history) of sample b, all int32 scalars; n = 0 where the program
    has no work."""
    start = r.off[b]
    n = jnp.where(valid, r.off[b + 1] - start, 0)
    c = r.ctx[b] if cfg.has_ctx else jnp.int32(0)
    hist = jnp.clip(n - r.cand[b], 0, n) if cfg.has_cand else n
    return start, n, c, hist


def _key_ranges(qs, n, c, hist, cfg: _Cfg):
    """Key-block ranges [0, n_int) (unmasked), [n_int, hi1) and [lo2, hi2) (masked).

    Together they are the key blocks needed by query rows [qs, qs + bq).

    History keys (j < hist) are needed up to the block's last row, or all of them when the
    block holds a contextual query (qs < C); otherwise only the diagonal is needed.
    """
    active = qs < n
    qe = jnp.minimum(qs + cfg.bq, n)
    a_end = jnp.where(qs < c, hist, jnp.minimum(hist, qe))
    a_end = jnp.where(active, jnp.maximum(a_end, 0), 0)
    hi1 = _cdiv(a_end, cfg.bk)
    lo2 = jnp.maximum(hi1, lax.div(qs, jnp.int32(cfg.bk)))
    hi2 = jnp.where(active, _cdiv(jnp.maximum(qe, 0), cfg.bk), lo2)
    hi2 = jnp.maximum(hi2, lo2)
    # Key blocks [0, n_int) lie entirely before the first query row and inside the
    # history: every pair there is unmasked (query rows past n only meet zero rows).
    n_int = jnp.minimum(lax.div(qs, jnp.int32(cfg.bk)), lax.div(hist, jnp.int32(cfg.bk)))
    n_int = jnp.clip(n_int, 0, hi1)
    return n_int, hi1, lo2, hi2


def _query_ranges(ks, n, c, hist, cfg: _Cfg):
    """Query-block ranges that can see keys [ks, ks + bk): [0, end_a) and [lo_b, q_int)
    (masked), [q_int, hi_b) (unmasked).

    A block holding history keys is seen by every contextual query (i < C) and, causally,
    by every query i >= ks; a block of candidate keys only by its diagonal.
    """
    active = ks < n
    has_hist = ks < hist
    ke = jnp.minimum(ks + cfg.bk, n)
    end_a = jnp.where(active & has_hist, _cdiv(jnp.clip(c, 0, n), cfg.bq), 0)
    lo_b = jnp.maximum(end_a, lax.div(ks, jnp.int32(cfg.bq)))
    hi_b = jnp.where(has_hist, _cdiv(n, cfg.bq), _cdiv(jnp.maximum(ke, 0), cfg.bq))
    hi_b = jnp.where(active, hi_b, lo_b)
    hi_b = jnp.maximum(hi_b, lo_b)
    # Query blocks from q_int on start after the key block's last key, which is history:
    # unmasked (rows past n are zero-loaded and contribute nothing).
    full_hist = ks + cfg.bk <= hist
    q_int = jnp.where(full_hist, jnp.clip(_cdiv(ks + cfg.bk, cfg.bq), lo_b, hi_b), hi_b)
    return end_a, lo_b, q_int, hi_b


def _load_rows(ref, row0, size, h, ok):
    """Masked load of ``size`` token rows of head ``h`` ([size, D]); masked rows are 0."""
    return _load(ref.at[pl.ds(row0, size), h, :], mask=ok[:, None], other=0)


def _load_ts(ref, row0, size, ok):
    return _load(ref.at[pl.ds(row0, size)], mask=ok, other=0)


def _load_block(r, cfg: _Cfg, names, first, size, start, n, h):
    """Block of ``size`` local positions from ``first`` in the sample starting at token
    ``start``: (positions, in-sample flags, one row tile per ref in ``names``, timestamps or
    None when there is no time bias)."""
    pos = first + jnp.arange(size, dtype=jnp.int32)
    ok = pos < n
    tiles = tuple(_load_rows(getattr(r, name), start + first, size, h, ok) for name in names)
    ts = _load_ts(r.ts, start + first, size, ok) if cfg.time_size else None
    return pos, ok, tiles, ts


def _sweep_key_blocks(make_body, width: int, qs, n, c, hist, cfg: _Cfg):
    """Fold ``make_body(masked)(kb, acc)`` from a zero fp32 ``[bq, width]`` accumulator over
    the key blocks that query rows ``[qs, qs + bq)`` need (``_key_ranges``): the unmasked
    ones, then the two masked ranges."""
    n_int, hi1, lo2, hi2 = _key_ranges(qs, n, c, hist, cfg)
    carry = jnp.zeros((cfg.bq, width), jnp.float32)
    carry = lax.fori_loop(0, n_int, make_body(False), carry)
    carry = lax.fori_loop(n_int, hi1, make_body(True), carry)
    return lax.fori_loop(lo2, hi2, make_body(True), carry)


def _dot(a, b, contract_a: int, contract_b: int):
    """fp32-accumulating 2-D matmul; fp32 operands use full precision (not TF32)."""
    prec = lax.Precision.HIGHEST if a.dtype == jnp.float32 else None
    return lax.dot_general(
        a,
        b,
        (((contract_a,), (contract_b,)), ((), ())),
        precision=prec,
        preferred_element_type=jnp.float32,
    )


def _scores(cfg: _Cfg, r: _Refs, h, q, k, i_pos, j_pos, tq, tk, n, c, hist, masked: bool):
    """Pre-SiLU scores s = alpha q k^T + bias (fp32), the mask (None when the tile is
    known to be fully unmasked), and the time buckets."""
    s = _dot(q, k, 1, 1)
    s = s * jnp.float32(cfg.alpha)
    ii = i_pos[:, None]
    jj = j_pos[None, :]
    if cfg.pos_size:
        rel = jnp.minimum(jnp.abs(ii - jj), cfg.pos_size - 1)
        s = s + r.rab_pos[h, rel].astype(jnp.float32)
    tb = None
    if cfg.time_size:
        dt = jnp.abs(tq[:, None] - tk[None, :])
        tb = jnp.clip(31 - lax.clz(dt + 1), 0, cfg.time_size - 1)
        s = s + r.rab_time[h, tb].astype(jnp.float32)
    if not masked:
        return s, None, tb
    seen = jj <= ii
    if cfg.has_ctx:
        seen = seen | (ii < c)
    mask = (ii == jj) | ((jj < hist) & seen)
    mask = mask & (ii < n) & (jj < n)
    return s, mask, tb


def _silu_and_grad(s, cfg: _Cfg):
    """silu(s) and silu'(s). The fast path uses one MUFU tanh instead of exp + divide:
    sigmoid(s) = (1 + tanh(s / 2)) / 2 (relative error ~1e-3, below bf16/fp16 rounding).
    """
    sig = 0.5 * _approx_tanh(0.5 * s) + 0.5 if cfg.fast_math else jax.nn.sigmoid(s)
    return s * sig, sig * (1.0 + s * (1.0 - sig))


def _apply_mask(mask, x):
    return x if mask is None else jnp.where(mask, x, 0.0)


# --------------------------------------------------------------------------------------
# pallas_call wrappers.
# --------------------------------------------------------------------------------------


def _schedule_table(cfg: _Cfg, offs, t_cap: int, key_major: bool):
    """Grid size and schedule table (flat int32 ``[3 * G]``: blocks, samples, has-work) of the
    kernel ``cfg`` is for: one program per (block, sample) pair holding tokens, heaviest first
    (``kernels/schedule.py``)."""
    block = cfg.bk if key_major else cfg.bq
    num = pairs(t_cap, offs.shape[0] - 1, cfg.max_seqlen, block)
    return num, jnp.concatenate(schedule(jnp, offs, cfg.max_seqlen, num, block, key_major))


def _aux_inputs(cfg: _Cfg, sched, offs, ctx, cand, ts, rab_pos, rab_time):
    aux = [sched, offs]
    if cfg.has_ctx:
        aux.append(ctx)
    if cfg.has_cand:
        aux.append(cand)
    if cfg.time_size:
        aux.append(ts)
    if cfg.pos_size:
        aux.append(rab_pos)
    if cfg.time_size:
        aux.append(rab_time)
    return aux


def _call(kernel, cfg: _Cfg, grid, out_shape, args, name):
    kwargs = {}
    if not cfg.interpret:
        kwargs["compiler_params"] = _compiler_params(cfg.num_warps, cfg.num_stages)
    return pl.pallas_call(
        functools.partial(kernel, cfg=cfg),
        out_shape=out_shape,
        grid=grid,
        interpret=cfg.interpret,
        name=name,
        **kwargs,
    )(*args)


def _token_mask(offs, t_cap):
    return (jnp.arange(t_cap, dtype=jnp.int32) < offs[-1])[:, None, None]
