"""Forward HSTU attention as a Mosaic GPU kernel (Hopper: TMA loads, wgmma, warp groups).

jax 0.11 deprecates the Triton lowering of Pallas on GPU; Mosaic GPU
(``jax.experimental.pallas.mosaic_gpu``) is its successor. This module holds the forward
pass in it; the backward stays with the Triton-lowering kernels (``_backward.py``), which
need nothing the forward saves beyond q, k and v.

One CTA per head and per (block, sample) pair, heaviest first (``kernels/schedule.py``, block
``2 * block_q``), three warp groups:

* warp group 2 (producer) streams the key / value tiles of the sample through
  ``stages`` shared-memory slots with TMA, refilling a slot once both consumers released it;
* warp groups 0 and 1 (consumers) each own ``block_q`` query rows: per key tile,
  ``S = q k^T`` (wgmma into registers), ``P = silu(alpha S) / N`` masked where the pair
  is not attended, ``acc += P v`` (wgmma, P from registers). A shared "turn" barrier
  staggers the two so one's elementwise work overlaps the other's matmuls (the ping-pong
  of flash-attention 3 and of jax's ``attention_mgpu``).

Jagged rows: TMA addresses global memory in the (8, 64) tiles of the swizzled shared
buffers, so a tile must start on a multiple of 8 rows; the kernel reads a copy of q, k, v in
which every sample starts on one (one gather each, at most 7 zero rows after a sample).
Tiles start at the sample's first token, so a tile's tail may read the next sample's rows
(masked out: never attended) or rows past the array (TMA fills zeros). The output tile of a
CTA always has ``2 * block_q`` rows, so it goes to a buffer with one such tile per CTA (no
CTA writes another's rows) and a gather brings the rows back to the jagged layout. Those
gathers are extra memory traffic (about 4 x T x H x D x 2 bytes) that a model keeping its
samples 8-aligned would not need.

Status: checked in Mosaic GPU's interpreter and lowered for CUDA on the CPU
(``tests/unit/test_pallas_mosaic.py``); not yet compiled and timed on a GPU, hence not the
default (``model.pallas_forward``).

No relative biases here and 16-bit inputs only, with head dims multiple of 64 up to 256
(``supports``); the entry point falls back to the Triton-lowering forward for the rest.
Interpret mode (``InterpretGPUParams``) runs the same kernel on the CPU for the tests.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from ..schedule import pairs, schedule

try:
    from jax.experimental.pallas import mosaic_gpu as plgpu
except ImportError:  # pragma: no cover - jax builds without Mosaic GPU
    plgpu = None

try:  # public in jax 0.11; in jax 0.10 only under _src
    from jax._src.pallas.mosaic_gpu.interpret.params import InterpretGPUParams
except ImportError:  # pragma: no cover
    InterpretGPUParams = None


_JAX_VERSION = tuple(int(x) for x in jax.__version__.split(".")[:2])


@dataclasses.dataclass(frozen=True)
class MosaicTiles:
    """Tiling of the Mosaic GPU forward: ``block_q`` query rows per consumer warp group
    (64: one wgmma row block), ``block_kv`` key rows per tile (a multiple of 64) and
    ``stages`` key / value slots in shared memory (>= 2)."""

    block_q: int = 64
    block_kv: int = 64
    stages: int = 2

    def __post_init__(self):
        if self.block_q != 64:
            raise ValueError(f"MosaicTiles.block_q: must be 64, got {self.block_q!r}")
        if not isinstance(self.block_kv, int) or self.block_kv < 64 or self.block_kv % 64:
            raise ValueError(
                f"MosaicTiles.block_kv: expected a multiple of 64, got {self.block_kv!r}"
            )
        if not isinstance(self.stages, int) or self.stages < 2:
            raise ValueError(f"MosaicTiles.stages: expected an int >= 2, got {self.stages!r}")


# Shared memory an H100 / H200 block may use (227 KiB), less room for the barriers.
_SMEM_BYTES = 227 * 1024 - 1024


def smem_bytes(tiles: MosaicTiles, d_qk: int, d_v: int, itemsize: int = 2) -> int:
    """Shared memory the forward takes: two query tiles (also the output tiles when Dv = Dqk,
    else two more) and the key / value slots."""
    q = 2 * tiles.block_q * (d_qk + (d_v if d_v != d_qk else 0))
    kv = tiles.stages * tiles.block_kv * (d_qk + d_v)
    return (q + kv) * itemsize


def supports(dtype, d_qk: int, d_v: int, has_bias: bool, tiles: MosaicTiles) -> str | None:
    """None when the Mosaic GPU forward can run this call, else why not."""
    if has_bias:
        return "relative biases are not implemented in the Mosaic GPU forward"
    if jnp.dtype(dtype) not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)):
        return f"dtype {jnp.dtype(dtype)} (wgmma takes bfloat16 / float16 here)"
    for name, d in (("Dqk", d_qk), ("Dv", d_v)):
        if d % 64 or not 64 <= d <= 256:
            return f"{name}={d} (a multiple of 64 up to 256)"
    if smem_bytes(tiles, d_qk, d_v) > _SMEM_BYTES:
        return f"{tiles} needs {smem_bytes(tiles, d_qk, d_v)} bytes of shared memory"
    if plgpu is None or InterpretGPUParams is None:
        return "this jax has no Pallas Mosaic GPU"
    if _JAX_VERSION < (0, 11):
        return f"jax {jax.__version__} (the kernel is written for jax >= 0.11)"
    return None


def _cdiv(x, d: int):
    return lax.div(x + (d - 1), jnp.int32(d))


def _key_steps(qs, bq: int, bk: int, n, c, hist):
    """Key tiles query rows [qs, qs + bq) of a sample need: history keys up to the last row
    (all of them when a row is contextual), and the rows' own positions (candidates see
    themselves)."""
    qe = jnp.minimum(qs + bq, n)
    a_end = jnp.where(qs < c, hist, jnp.minimum(hist, qe))
    return jnp.where(qs < n, _cdiv(jnp.maximum(a_end, qe), bk), 0)


def _forward_kernel(
    meta_ref, q_ref, k_ref, v_ref, o_ref, scoped, *, tiles, alpha, normalizer, interpreted
):
    bq, bk, stages = tiles.block_q, tiles.block_kv, tiles.stages
    dtype = q_ref.dtype
    d_v = v_ref.shape[-1]
    (q_smem2, k_smem, v_smem, p_smem2, o_smem2), barriers, (k_free, v_free), turn = scoped
    k_full, v_full, q_full = barriers
    h = lax.axis_index("heads")
    j = lax.axis_index("pairs")
    wg = lax.axis_index("wg")
    start, n, c, hist, blk = (meta_ref[f, j] for f in range(5))
    start = start * 8  # samples start on multiples of 8 rows (TMA tiles)
    q0 = blk * (2 * bq)
    steps0 = _key_steps(q0, bq, bk, n, c, hist)
    steps1 = _key_steps(q0 + bq, bq, bk, n, c, hist)
    cta_steps = jnp.maximum(steps0, steps1)

    def iota(dim):  # jax 0.10's interpreter has no layout casts
        if interpreted:
            return lax.broadcasted_iota(jnp.int32, (bq, bk), dim)
        return plgpu.broadcasted_iota(jnp.int32, (bq, bk), dim, layout=plgpu.Layout.WGMMA)

    def take_turn():
        plgpu.barrier_arrive(turn)
        plgpu.barrier_wait(turn)

    @pl.when(wg < 2)
    def _consumer():
        plgpu.set_max_registers(232, action="increase")
        q_smem = q_smem2.at[wg]
        qs = q0 + wg * bq
        steps = jnp.where(wg == 0, steps0, steps1)
        plgpu.copy_gmem_to_smem(q_ref.at[pl.ds(start + qs, bq), h], q_smem, q_full.at[wg])
        plgpu.barrier_wait(q_full.at[wg])

        @pl.when(steps > 0)
        def _():
            plgpu.barrier_wait(k_full.at[0])

        pl.when(wg == 1)(take_turn)
        # Key tiles below min(qs, hist) are attended by every row: no mask there.
        unmasked = jnp.minimum(lax.div(jnp.minimum(qs, hist), jnp.int32(bk)), steps)
        half_scale = jnp.float32(0.5 * alpha)
        out_scale = jnp.float32(0.5 * alpha / normalizer)

        def run(acc_ref):
            def step(kv, masked: bool):
                slot = lax.rem(kv, jnp.int32(stages))

                def scores(s_ref):
                    plgpu.wgmma(s_ref, q_smem, k_smem.at[slot].transpose((1, 0)))
                    take_turn()
                    return s_ref[...]

                s = pl.run_scoped(scores, plgpu.ACC((bq, bk), jnp.float32))
                plgpu.barrier_arrive(k_free.at[slot])
                # silu(alpha s) / N = (alpha s / 2N) (1 + tanh(alpha s / 2))
                p = (s * out_scale) * (1.0 + jnp.tanh(s * half_scale))
                if masked:
                    i = qs + iota(0)
                    jj = kv * bk + iota(1)
                    keep = (i == jj) | ((jj < hist) & ((jj <= i) | (i < c)))
                    p = jnp.where(keep, p, 0.0)
                p16 = p.astype(dtype)
                plgpu.barrier_arrive(turn)  # done with the elementwise work
                plgpu.barrier_wait(v_full.at[slot])
                plgpu.barrier_wait(turn)  # the tensor cores are ours
                if interpreted:  # the interpreter's wgmma reads only shared memory
                    p_smem2.at[wg][...] = p16
                    plgpu.commit_smem()
                    plgpu.wgmma(acc_ref, p_smem2.at[wg], v_smem.at[slot])
                else:
                    plgpu.wgmma(acc_ref, p16, v_smem.at[slot])
                nxt = kv + 1

                @pl.when(nxt < steps)
                def _():
                    plgpu.barrier_wait(k_full.at[lax.rem(nxt, jnp.int32(stages))])

                plgpu.wgmma_wait(0)
                plgpu.barrier_arrive(v_free.at[slot])

            @pl.loop(0, unmasked)
            def _(kv):
                step(kv, masked=False)

            @pl.loop(unmasked, steps)
            def _(kv):
                step(kv, masked=True)

            # Tiles only the other warp group needs: observe and release them, and keep
            # the turns even.
            @pl.loop(steps, cta_steps)
            def _(kv):
                slot = lax.rem(kv, jnp.int32(stages))
                plgpu.barrier_wait(k_full.at[slot])
                plgpu.barrier_wait(v_full.at[slot])
                plgpu.barrier_arrive(k_free.at[slot])
                plgpu.barrier_arrive(v_free.at[slot])
                take_turn()
                take_turn()

            return acc_ref[...]

        acc = pl.run_scoped(run, plgpu.ACC((bq, d_v), jnp.float32))
        pl.when(wg == 0)(take_turn)
        o_smem = q_smem if o_smem2 is None else o_smem2.at[wg]  # TMA needs it contiguous
        o_smem[...] = acc.astype(dtype)
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(o_smem, o_ref.at[pl.ds(j * 2 * bq + wg * bq, bq), h])
        plgpu.wait_smem_to_gmem(0)

    @pl.when(wg == 2)
    def _producer():
        plgpu.set_max_registers(40, action="decrease")

        def fetch(kv, slot):
            rows = pl.ds(start + kv * bk, bk)
            plgpu.copy_gmem_to_smem(k_ref.at[rows, h], k_smem.at[slot], k_full.at[slot])
            plgpu.copy_gmem_to_smem(v_ref.at[rows, h], v_smem.at[slot], v_full.at[slot])

        for i in range(stages):
            pl.when(i < cta_steps)(functools.partial(fetch, i, i))

        @pl.loop(stages, cta_steps)
        def _(kv):
            slot = lax.rem(kv, jnp.int32(stages))
            plgpu.barrier_wait(k_free.at[slot])
            plgpu.barrier_wait(v_free.at[slot])
            fetch(kv, slot)

        # Observe the last releases too: every slot is free when the block exits.
        @pl.loop(jnp.maximum(cta_steps - stages, 0), cta_steps)
        def _(kv):
            slot = lax.rem(kv, jnp.int32(stages))
            plgpu.barrier_wait(k_free.at[slot])
            plgpu.barrier_wait(v_free.at[slot])


def forward(
    q, k, v, offs, ctx, cand, *, max_seqlen, alpha, normalizer, tiles: MosaicTiles, interpret
):
    """Forward HSTU attention (no biases) with the Mosaic GPU kernel: ``[T, H, Dv]`` in
    ``q.dtype``, zero past ``offs[-1]``. ``ctx`` / ``cand`` are ``[B]`` int32 or None."""
    t_cap, heads, d_qk = q.shape
    d_v = v.shape[-1]
    bq, bk, stages = tiles.block_q, tiles.block_kv, tiles.stages
    block = 2 * bq
    bsz = offs.shape[0] - 1
    num = pairs(t_cap, bsz, max_seqlen, block)
    blk, b, valid = schedule(jnp, offs, max_seqlen, num, block, key_major=False)
    # TMA reads global memory in the shared tiles' (8, 64) tiling, so a tile must start on a
    # multiple of 8 rows: the kernel reads q, k, v from a copy in which every sample starts
    # on one (at most 7 rows of zeros after each sample).
    lens = offs[1:] - offs[:-1]
    aoffs = jnp.concatenate([jnp.zeros((1,), jnp.int32), jnp.cumsum((lens + 7) // 8 * 8)])
    t_al = -(-t_cap // 8) * 8 + 8 * bsz  # static bound on aoffs[-1]
    p = jnp.arange(t_al, dtype=jnp.int32)
    sample_p = jnp.clip(jnp.searchsorted(aoffs, p, side="right") - 1, 0, bsz - 1)
    local_p = p - aoffs[sample_p]
    src = jnp.where(local_p < lens[sample_p], offs[sample_p] + local_p, t_cap)  # t_cap: zeros

    def aligned(x):
        return jnp.take(x, src, axis=0, mode="fill", fill_value=0)

    q, k, v = aligned(q), aligned(k), aligned(v)
    start = aoffs[b] // 8  # in rows of 8: the kernel multiplies back
    n = jnp.where(valid != 0, lens[b], 0)
    c = jnp.zeros_like(n) if ctx is None else ctx[b]
    hist = n if cand is None else jnp.clip(n - cand[b], 0, n)
    meta = jnp.stack([start, n, c, hist, blk]).astype(jnp.int32)  # [5, num]

    tiling = plgpu.TilingTransform((8, 64))
    swizzle = plgpu.SwizzleTransform(128)
    smem = functools.partial(plgpu.SMEM, transforms=(tiling, swizzle))
    interpreted = bool(interpret)

    def entry(meta_ref, q_ref, k_ref, v_ref, o_ref):
        pl.run_scoped(
            lambda *scoped: _forward_kernel(
                meta_ref, q_ref, k_ref, v_ref, o_ref, scoped,
                tiles=tiles, alpha=alpha, normalizer=normalizer, interpreted=interpreted,
            ),
            (
                smem((2, bq, d_qk), q.dtype),
                smem((stages, bk, d_qk), q.dtype),
                smem((stages, bk, d_v), q.dtype),
                smem((2, bq, bk), q.dtype) if interpreted else None,
                smem((2, bq, d_v), q.dtype) if d_v != d_qk else None,
            ),
            (
                plgpu.Barrier(num_barriers=stages),
                plgpu.Barrier(num_barriers=stages),
                plgpu.Barrier(num_barriers=2),
            ),
            (plgpu.Barrier(num_arrivals=2, num_barriers=stages),) * 2,
            plgpu.Barrier(num_arrivals=2),
            collective_axes="wg",
        )  # fmt: skip

    tiles_out = plgpu.kernel(
        entry,
        out_type=jax.ShapeDtypeStruct((num * block, heads, d_v), q.dtype),
        grid=(heads, num),
        grid_names=("heads", "pairs"),
        num_threads=3,
        thread_name="wg",
        compiler_params=plgpu.CompilerParams(
            approx_math=True, lowering_semantics=plgpu.LoweringSemantics.Warpgroup
        ),
        interpret=InterpretGPUParams() if interpret else None,
    )(meta, q, k, v)

    # Each token's row in the CTA tiles: its (block, sample) pair's entry, then its offset.
    levels = -(-max_seqlen // block)
    owner = jnp.where(valid != 0, b, bsz)  # entries without work scatter nowhere
    entry_of = jnp.zeros((bsz, levels), jnp.int32)
    entry_of = entry_of.at[owner, blk].set(jnp.arange(num, dtype=jnp.int32), mode="drop")
    t = jnp.arange(t_cap, dtype=jnp.int32)
    sample = jnp.clip(jnp.searchsorted(offs, t, side="right") - 1, 0, bsz - 1)
    local = t - offs[sample]
    level = jnp.clip(local // block, 0, levels - 1)
    rows = entry_of[sample, level] * block + local % block
    out = jnp.take(tiles_out, rows, axis=0)
    return jnp.where((t < offs[-1])[:, None, None], out, jnp.zeros((), out.dtype))
