"""HSTU attention kernels in Mosaic GPU (Hopper: TMA loads, wgmma, warp groups): the forward,
the query gradient and the key / value gradients.

jax 0.11 deprecates the Triton lowering of Pallas on GPU; Mosaic GPU
(``jax.experimental.pallas.mosaic_gpu``) is its successor. None of the kernels needs anything
saved beyond q, k and v.

Each kernel runs one CTA per head and per (block, sample) pair, heaviest first
(``kernels/schedule.py``), with three warp groups: warp group 2 (producer) streams tiles of
the sample through ``stages`` shared-memory slots with TMA, refilling a slot once both
consumers released it; warp groups 0 and 1 (consumers) run the matmuls on wgmma with the
elementwise work in registers. HSTU's SiLU needs no running maximum: no rescaling.

* Forward and dq (query-major, block ``2 * block_q``): the producer streams key / value
  tiles; each consumer owns ``block_q`` query rows. Forward, per key tile: ``S = q k^T``,
  ``P = silu(alpha S) / N`` masked where the pair is not attended, ``acc += P v`` (P from
  registers). dq: ``S = q k^T`` and ``dP = dO v^T``, ``dS = dP silu'(alpha S) / N`` masked,
  ``acc += dS k``; times alpha at the end. A shared "turn" barrier staggers the two consumers
  so one's elementwise work overlaps the other's matmuls (the ping-pong of flash-attention 3
  and of jax's ``attention_mgpu``).
* dk / dv (key-major, block ``block_q``): the CTA holds ``block_q`` keys and their values;
  the producer streams the query / dO tiles that see them. Warp group 0 accumulates
  ``dv += P^T dO`` (``S^T = k q^T``), warp group 1 ``dk += dS^T q`` (``S^T`` and
  ``dP^T = v dO^T``), so each holds one ``[block_q, D]`` fp32 accumulator: at head dim 256
  the two would take all of one warp group's registers. ``S^T`` is computed by both (five
  matmuls per tile pair where one warp group holding both would run four), the price of
  fitting; the two then run side by side on the SM.

Jagged rows: TMA addresses global memory in the tiles of the swizzled shared buffers, so a
tile must start on a multiple of 8 rows. The kernels read q, k, v (dO) where they lie: a
sample starting at row ``o`` is seen from row ``o - r`` (``r = o mod 8``), as ``r`` dead rows
then its own, and the masks count the dead rows out (never attended, their outputs dropped;
dk / dv also drop dead and past-the-end query rows, which would otherwise add to the keys'
gradients). A tile's tail may read the next sample's rows (masked out the same way) or rows
past the array (TMA fills zeros). A CTA's output tile always has ``block`` rows. With
``MosaicTiles.out="tiles"`` (dq's and dk / dv's default) it goes to a buffer with one such
tile per CTA (no CTA writes another's rows) and a gather brings the rows back to the jagged
layout. With ``out="rows"`` (the forward's default; ``_store``) each CTA writes the 8-row
chunks that are wholly its sample's straight into the jagged output; the at most two chunks
a sample shares with a neighbour go to the sample's side slots, which one scatter of at most
16 rows a sample places after the kernel, in place; ``TAIL_CTAS`` more CTAs per head zero
the rows past the batch (the capacity's padding), so the output needs no gather and no
select. The table of the CTAs' work comes from one Pallas kernel (``_meta_table``) or, with
``HSTU_MOSAIC_META=xla``, from jnp's schedule in some ten small XLA kernels (``DEFAULT_OUT``
and ``meta_mode`` say what was measured). (Until 2026-11-29 the inputs were
first gathered into copies with every sample 8-aligned: 0.40 ms a step at bench_upstream's
batch 32 on an H200.)

No relative biases, 16-bit inputs only, head dims multiples of 64 up to 256 (``supports``);
the entry point uses the Triton lowering for the rest. Interpret mode
(``InterpretGPUParams``) runs the same kernels on the CPU for the tests.

Status: checked in Mosaic GPU's interpreter, lowered for CUDA on the CPU and compiled against
the reference and the Triton lowering on an H200 (``tests/unit/test_pallas_mosaic.py``).
Timed there against the Triton lowering on the recipe's jagged batches and 8 x 4096 (forward +
backward, kernels/README.md): 1.02-1.32x at head dims 64 to 256, the forward 0.6-1.26x (below
0.85x on one batch of short samples at head dims 64 and 128); ``auto`` in bench_upstream, not
the option's default. Against torch's Triton kernels, forward + backward on the recipe's
batches: 1.06-1.15x at head dim 128, 1.30-1.35x at 256 (session of 2026-12-02; the two
backends timed in different calls on one machine).
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import os

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from ..schedule import pairs, schedule
from ..tiles import launch_lead
from ._common import _compiler_params, _next_pow2, _query_ranges, sample_of
from ._common import _load as _pl_load
from ._common import _store as _pl_store

try:
    from jax.experimental.pallas import mosaic_gpu as plgpu
except ImportError:  # pragma: no cover - jax builds without Mosaic GPU
    plgpu = None

try:  # public in jax 0.11; in jax 0.10 only under _src
    from jax._src.pallas.mosaic_gpu.interpret.params import InterpretGPUParams
except ImportError:  # pragma: no cover
    InterpretGPUParams = None


_JAX_VERSION = tuple(int(x) for x in jax.__version__.split(".")[:2])


KINDS = ("fwd", "dq", "dkdv")  # the kernels written in Mosaic GPU


@dataclasses.dataclass(frozen=True)
class MosaicTiles:
    """Tiling of one Mosaic GPU kernel: ``block_q`` rows of a consumer warp group's matmuls
    (64: one wgmma row block; query rows, or key rows for dk / dv), ``block_kv`` rows per
    streamed tile (key rows, or query rows for dk / dv; a multiple of 32, where 32 puts the
    shared buffers on a 64-byte swizzle) and ``stages`` streamed slots (>= 2). ``lead``: the
    launch order of the CTAs over the heaviest-first schedule (``kernels/schedule.py``), which
    the GPU dispatches in turn: its first ``lead`` entries with their heads together, the rest
    head by head (0: all head by head); None: the kernel's measured default, the forward 0,
    dq and dk / dv every entry with its heads (kernels/README.md, "Dispatch order").
    ``out``: where the CTAs write their output tiles, ``"tiles"`` (one tile per CTA in a
    buffer of its own, gathered into the jagged rows after the kernel), ``"rows"`` (straight
    into the jagged rows, ``_store``; the rows two samples share scattered in after the
    kernel) or ``"select"`` (as ``"rows"``, but the shared rows selected from the side slots
    where the output is read: no kernel of their own where XLA fuses the select into the
    consumer, a pass of the whole output where the consumer is another kernel); None:
    ``$HSTU_MOSAIC_OUT``, else the kernel's ``DEFAULT_OUT``."""

    block_q: int = 64
    block_kv: int = 64
    stages: int = 2
    lead: int | None = None
    out: str | None = None

    def __post_init__(self):
        if self.block_q != 64:
            raise ValueError(f"MosaicTiles.block_q: must be 64, got {self.block_q!r}")
        if not isinstance(self.block_kv, int) or self.block_kv < 32 or self.block_kv % 32:
            raise ValueError(
                f"MosaicTiles.block_kv: expected a multiple of 32, got {self.block_kv!r}"
            )
        if not isinstance(self.stages, int) or self.stages < 2:
            raise ValueError(f"MosaicTiles.stages: expected an int >= 2, got {self.stages!r}")
        if self.lead is not None and (not isinstance(self.lead, int) or self.lead < 0):
            raise ValueError(f"MosaicTiles.lead: expected None or an int >= 0, got {self.lead!r}")
        if self.out not in (None, *OUTS):
            raise ValueError(f"MosaicTiles.out: expected None or one of {OUTS}, got {self.out!r}")


OUTS = ("tiles", "rows", "select")  # MosaicTiles.out
# Each kernel's output mode where neither MosaicTiles.out nor $HSTU_MOSAIC_OUT names one. One
# H200, 2026-12-05, head dim 256, device time (scripts/attention_jagged.py, gpu_check mrows):
# the forward at its rows 0.165 / 0.144 / 0.080 ms on the recipe's three batches against
# 0.192 / 0.172 / 0.099 as tiles, 0.415 against 0.470 on 8 x 4096; the backward's rows mode
# gave that back (forward + backward 0.801 / 0.711 / 0.357 against 0.794 / 0.709 / 0.353), so
# dq and dk / dv keep their tiles. The step (bench_upstream, batch 32, packed) with the forward
# at its rows, the meta kernel and the bf16 weight copies: 1.018x and 1.016x over the same
# steps in two calls (docs/BENCHMARKS.md, "jax: the forward at its rows"), all three the
# defaults.
DEFAULT_OUT = {"fwd": "rows", "dq": "tiles", "dkdv": "tiles"}


def output_mode(tiles: MosaicTiles, kind: str) -> str:
    """``tiles.out``, or ``$HSTU_MOSAIC_OUT`` (an A/B without a config key: one mode for the
    three kernels, or ``KIND=MODE`` pairs, e.g. ``fwd=rows,dq=select,dkdv=select``; a kernel
    it does not name: its default), else ``DEFAULT_OUT[kind]``."""
    if tiles.out is not None:
        return tiles.out
    text = os.environ.get("HSTU_MOSAIC_OUT", "")
    if not text:
        return DEFAULT_OUT[kind]
    if "=" not in text:
        text = ",".join(f"{k}={text}" for k in KINDS)
    modes = {}
    for item in text.split(","):
        name, _, mode = item.partition("=")
        if name not in KINDS or mode not in OUTS:
            raise ValueError(
                f"HSTU_MOSAIC_OUT: expected a mode of {OUTS} or KIND=MODE pairs with KIND one "
                f"of {KINDS}, got {item!r}"
            )
        modes[name] = mode
    return modes.get(kind, DEFAULT_OUT[kind])


_Blocks = collections.namedtuple("_Blocks", "bq bk")  # the tiles ``_query_ranges`` reads


# Shared memory an H100 / H200 block may use (227 KiB), less room for the barriers.
_SMEM_BYTES = 227 * 1024 - 1024


def smem_bytes(kind: str, tiles: MosaicTiles, d_qk: int, d_v: int, itemsize: int = 2) -> int:
    """Shared memory kernel ``kind`` takes: per consumer a query tile (dq: and a dO tile; an
    output tile unless it fits in the query tile), and the key / value slots; dk / dv: the
    CTA's key and value tiles and the query / dO slots."""
    if kind == "dkdv":
        return (tiles.block_q + tiles.stages * tiles.block_kv) * (d_qk + d_v) * itemsize
    d_out = d_v if kind == "fwd" else d_qk
    per_rows = d_qk + (d_out if d_out != d_qk else 0) + (d_v if kind == "dq" else 0)
    kv = tiles.stages * tiles.block_kv * (d_qk + d_v)
    return (2 * tiles.block_q * per_rows + kv) * itemsize


def default_tiles(kind: str, d_qk: int, d_v: int) -> MosaicTiles:
    """64-row streamed tiles in two stages where they fit in shared memory; else 32-row ones,
    in three stages where those fit (dq at head dim 256: swept on an H200, the backward -1 to
    -2 % against two stages; kernels/README.md, "The Mosaic tiles swept"), else two."""
    tiles = MosaicTiles()
    if smem_bytes(kind, tiles, d_qk, d_v) > _SMEM_BYTES:
        tiles = MosaicTiles(block_kv=32, stages=3)
        if smem_bytes(kind, tiles, d_qk, d_v) > _SMEM_BYTES:
            tiles = MosaicTiles(block_kv=32)
    return tiles


def supports(dtype, d_qk: int, d_v: int, has_bias: bool, tiles) -> str | None:
    """None when the Mosaic GPU kernels can run this call with ``tiles`` (forward, dq, dk /
    dv; a (forward, dq) pair takes the default dk / dv tiles), else why not."""
    if has_bias:
        return "relative biases are not implemented in the Mosaic GPU kernels"
    if jnp.dtype(dtype) not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)):
        return f"dtype {jnp.dtype(dtype)} (wgmma takes bfloat16 / float16 here)"
    for name, d in (("Dqk", d_qk), ("Dv", d_v)):
        if d % 64 or not 64 <= d <= 256:
            return f"{name}={d} (a multiple of 64 up to 256)"
    for kind, t in zip(KINDS, full_tiles(tiles, d_qk, d_v), strict=True):
        if smem_bytes(kind, t, d_qk, d_v) > _SMEM_BYTES:
            return f"{kind} tiles {t} need {smem_bytes(kind, t, d_qk, d_v)} bytes of shared memory"
    if plgpu is None or InterpretGPUParams is None:
        return "this jax has no Pallas Mosaic GPU"
    if _JAX_VERSION < (0, 11):
        return f"jax {jax.__version__} (the kernels are written for jax >= 0.11)"
    return None


def full_tiles(tiles, d_qk: int, d_v: int) -> tuple:
    """``tiles`` for every kernel of ``KINDS``: a (forward, dq) pair gets the default dk / dv
    tiles for these head dims."""
    tiles = tuple(tiles)
    if len(tiles) == len(KINDS) - 1:
        tiles += (default_tiles("dkdv", d_qk, d_v),)
    if len(tiles) != len(KINDS):
        raise ValueError(f"mosaic tiles: expected one per kernel {KINDS}, got {len(tiles)}")
    return tiles


def _cdiv(x, d: int):
    return lax.div(x + (d - 1), jnp.int32(d))


def _entry_and_head(cta, num: int, heads: int, lead: int):
    """(schedule entry, head) of CTA ``cta``, the launch's linear index: the first ``lead``
    entries (of ``num``) with their ``heads`` heads together, then the rest head by head."""
    lead = min(lead, num)
    front = (lax.div(cta, jnp.int32(heads)), lax.rem(cta, jnp.int32(heads)))
    if lead == num:
        return front
    back = cta - lead * heads
    rest = jnp.int32(num - lead)
    is_front = cta < lead * heads
    return (
        jnp.where(is_front, front[0], lead + lax.rem(back, rest)),
        jnp.where(is_front, front[1], lax.div(back, rest)),
    )


def _key_steps(qs, bq: int, bk: int, n, c, hist):
    """Key tiles query rows [qs, qs + bq) of a sample need: history keys up to the last row
    (all of them when a row is contextual), and the rows' own positions (candidates see
    themselves)."""
    qe = jnp.minimum(qs + bq, n)
    a_end = jnp.where(qs < c, hist, jnp.minimum(hist, qe))
    return jnp.where(qs < n, _cdiv(jnp.maximum(a_end, qe), bk), 0)


def _query_kernel(meta_ref, *refs, kind, tiles, order, alpha, normalizer, rows_out, interpreted):
    """One CTA: ``2 x block_q`` query rows of one sample and head (``kind`` "fwd": the
    attention output; "dq": the query gradient, ``refs`` then also hold dO). ``rows_out``:
    the output written at its rows (``_store``; ``refs`` then hold its side buffer)."""
    bq, bk, stages = tiles.block_q, tiles.block_kv, tiles.stages
    refs, scoped = refs[:-1], refs[-1]
    side_ref = refs[-1] if rows_out else None
    refs = refs[:-1] if rows_out else refs
    if kind == "fwd":
        q_ref, k_ref, v_ref, o_ref = refs
        do_ref = None
        (q_smem2, k_smem, v_smem, t_smem2, o_smem2), barriers, frees, turn = scoped
        (k_full, v_full, q_full), do_full = barriers, None
    else:
        q_ref, k_ref, v_ref, do_ref, o_ref = refs
        (q_smem2, k_smem, v_smem, t_smem2, o_smem2, do_smem2), barriers, frees, turn = scoped
        k_full, v_full, q_full, do_full = barriers
    k_free, v_free = frees
    dtype = q_ref.dtype
    d_out = o_ref.shape[-1]
    j, h, zero_slot = _cta_work(lax.axis_index("cta"), order)
    wg = lax.axis_index("wg")
    start, n, c, hist, blk, dead, sample = (meta_ref[f, j] for f in range(7))
    start = start * 8  # TMA tiles start on multiples of 8 rows
    # The sample in the frame the tiles see: `dead` rows of the previous sample, then its own
    # (row i of the frame is the sample's i - dead); context only where the sample has some.
    n, hist = n + dead, hist + dead
    n = jnp.where(zero_slot < 0, n, 0)  # a tail CTA: no block of its own
    c = jnp.where(c > 0, c + dead, 0)
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

    def matmul(s_ref, a, b):
        plgpu.wgmma(s_ref, a, b)
        return s_ref

    def accumulate(t16, b_smem, acc_ref, kv, free, steps):
        """A step's last matmul ``acc += t16 @ b`` (``_mma_from_registers``), then: wait for
        the next key tile, drain the wgmma and release ``free``, the slot it read."""
        _mma_from_registers(acc_ref, t16, b_smem, t_smem2, wg, interpreted)
        nxt = kv + 1

        @pl.when(nxt < steps)
        def _():
            plgpu.barrier_wait(k_full.at[lax.rem(nxt, jnp.int32(stages))])

        plgpu.wgmma_wait(0)
        plgpu.barrier_arrive(free)

    @pl.when(wg < 2)
    def _consumer():
        plgpu.set_max_registers(232, action="increase")
        q_smem = q_smem2.at[wg]
        qs = q0 + wg * bq
        steps = jnp.where(wg == 0, steps0, steps1)
        rows = pl.ds(start + qs, bq)
        plgpu.copy_gmem_to_smem(q_ref.at[rows, h], q_smem, q_full.at[wg])
        if do_ref is not None:
            plgpu.copy_gmem_to_smem(do_ref.at[rows, h], do_smem2.at[wg], do_full.at[wg])
            plgpu.barrier_wait(do_full.at[wg])
        plgpu.barrier_wait(q_full.at[wg])
        pl.when(wg == 1)(take_turn)
        # Key tiles below min(qs, hist) are attended by every row: no mask there, but for the
        # first tile where it holds dead rows.
        first = jnp.minimum(jnp.where(dead > 0, 1, 0), steps)
        unmasked = jnp.maximum(
            jnp.minimum(lax.div(jnp.minimum(qs, hist), jnp.int32(bk)), steps), first
        )

        def keep(kv):
            i = qs + iota(0)
            jj = kv * bk + iota(1)
            return (jj >= dead) & ((i == jj) | ((jj < hist) & ((jj <= i) | (i < c))))

        def fwd_step(acc_ref, kv, slot, masked):
            def scores(s_ref):
                matmul(s_ref, q_smem, k_smem.at[slot].transpose((1, 0)))
                take_turn()
                return s_ref[...]

            s = pl.run_scoped(scores, plgpu.ACC((bq, bk), jnp.float32))
            plgpu.barrier_arrive(k_free.at[slot])
            # silu(alpha s) / N = (alpha s / 2N) (1 + tanh(alpha s / 2))
            p = (s * jnp.float32(0.5 * alpha / normalizer)) * (
                1.0 + jnp.tanh(s * jnp.float32(0.5 * alpha))
            )
            if masked:
                p = jnp.where(keep(kv), p, 0.0)
            p16 = p.astype(dtype)
            plgpu.barrier_arrive(turn)  # done with the elementwise work
            plgpu.barrier_wait(v_full.at[slot])
            plgpu.barrier_wait(turn)  # the tensor cores are ours
            accumulate(p16, v_smem.at[slot], acc_ref, kv, v_free.at[slot], steps)

        def dq_step(acc_ref, kv, slot, masked):
            plgpu.barrier_wait(v_full.at[slot])

            def scores(s_ref, dp_ref):
                matmul(s_ref, q_smem, k_smem.at[slot].transpose((1, 0)))
                matmul(dp_ref, do_smem2.at[wg], v_smem.at[slot].transpose((1, 0)))
                take_turn()
                return s_ref[...], dp_ref[...]

            acc = plgpu.ACC((bq, bk), jnp.float32)
            s, dp = pl.run_scoped(scores, acc, acc)
            plgpu.barrier_arrive(v_free.at[slot])
            # d silu(x) / dx = sig (1 + x (1 - sig)), sig = (1 + tanh(x / 2)) / 2, x = alpha s;
            # alpha is applied to dq once at the end.
            x = s * jnp.float32(alpha)
            sig = 0.5 + 0.5 * jnp.tanh(x * 0.5)
            ds = dp * (sig * (1.0 + x * (1.0 - sig))) * jnp.float32(1.0 / normalizer)
            if masked:
                ds = jnp.where(keep(kv), ds, 0.0)
            ds16 = ds.astype(dtype)
            plgpu.barrier_arrive(turn)
            plgpu.barrier_wait(turn)
            accumulate(ds16, k_smem.at[slot], acc_ref, kv, k_free.at[slot], steps)

        step = fwd_step if kind == "fwd" else dq_step

        @pl.when(steps > 0)
        def _():
            plgpu.barrier_wait(k_full.at[0])

        def run(acc_ref):
            @pl.loop(0, first)
            def _(kv):
                step(acc_ref, kv, lax.rem(kv, jnp.int32(stages)), masked=True)

            @pl.loop(first, unmasked)
            def _(kv):
                step(acc_ref, kv, lax.rem(kv, jnp.int32(stages)), masked=False)

            @pl.loop(unmasked, steps)
            def _(kv):
                step(acc_ref, kv, lax.rem(kv, jnp.int32(stages)), masked=True)

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

        acc = pl.run_scoped(run, plgpu.ACC((bq, d_out), jnp.float32))
        if kind == "dq":
            acc = acc * jnp.float32(alpha)
        pl.when(wg == 0)(take_turn)
        o_smem = q_smem if o_smem2 is None else o_smem2.at[wg]  # TMA needs it contiguous
        o_smem[...] = acc.astype(dtype)
        plgpu.commit_smem()
        if rows_out:
            _store(o_smem, o_ref, side_ref, h, qs, start, dead, n, sample)
            tail0 = meta_ref[0, order[0]] * 8
            pl.when((zero_slot >= 0) & (wg == 0))(
                lambda: _zero_tail(o_smem, o_ref, h, zero_slot, tail0)
            )
        else:
            plgpu.copy_smem_to_gmem(o_smem, o_ref.at[pl.ds(j * 2 * bq + wg * bq, bq), h])
            plgpu.wait_smem_to_gmem(0)

    @pl.when(wg == 2)
    def _producer():
        plgpu.set_max_registers(40, action="decrease")

        def fetch(kv, slot):
            rows = pl.ds(start + kv * bk, bk)
            plgpu.copy_gmem_to_smem(k_ref.at[rows, h], k_smem.at[slot], k_full.at[slot])
            plgpu.copy_gmem_to_smem(v_ref.at[rows, h], v_smem.at[slot], v_full.at[slot])

        _stream(fetch, cta_steps, stages, (k_free, v_free))


# Outputs at their rows (``MosaicTiles.out`` "rows" / "select"): CTAs per head, launched after
# the schedule's, that zero the output's rows past the batch (``_zero_tail``).
TAIL_CTAS = 4


def _cta_work(cta, order):
    """(schedule entry, head, tail slot) of CTA ``cta`` of a launch of ``order = (num,
    heads, lead[, tail CTAs per head])``: the schedule's CTAs first (``_entry_and_head``; tail
    slot -1), then the tail CTAs (entry 0, which they do not work on; slot 0 ..)."""
    num, heads, lead = order[:3]
    real = num * heads
    j, h = _entry_and_head(jnp.minimum(cta, real - 1), num, heads, lead)
    if len(order) == 3:
        return j, h, jnp.int32(-1)
    extra = cta - real
    is_tail = extra >= 0
    return (
        jnp.where(is_tail, 0, j),
        jnp.where(is_tail, lax.rem(extra, jnp.int32(heads)), h),
        jnp.where(is_tail, lax.div(extra, jnp.int32(heads)), -1),
    )


def _zero_tail(smem, out_ref, h, slot, tail0) -> None:
    """Tail CTA ``slot`` of head ``h``: zeros into rows ``[tail0, T)`` of ``out_ref`` (``tail0``:
    the batch's end rounded down to 8 rows; the batch's rows in that first chunk are placed
    after the kernel), its share of the ``smem``-high blocks, the rest of ``T - tail0`` (whole
    8-row chunks) by slot 0."""
    rows, total = smem.shape[0], out_ref.shape[0]
    smem[...] = jnp.zeros(smem.shape, smem.dtype)
    plgpu.commit_smem()
    blocks = lax.div(total - tail0, jnp.int32(rows))

    @pl.loop(slot, blocks, step=TAIL_CTAS)
    def _(i):
        plgpu.copy_smem_to_gmem(smem, out_ref.at[pl.ds(tail0 + i * rows, rows), h])

    rest = tail0 + blocks * rows
    for i in range(rows // 8):
        r = rest + 8 * i
        chunk = functools.partial(
            plgpu.copy_smem_to_gmem, smem.at[pl.ds(0, 8)], out_ref.at[pl.ds(r, 8), h]
        )
        pl.when((slot == 0) & (r < total))(chunk)
    # the CTA's last wait: for shared memory to be read, not for the writes to land (the
    # kernel's end publishes them, as jax's Hopper matmul ends)
    plgpu.wait_smem_to_gmem(0, wait_read_only=True)


def _store(smem, out_ref, side_ref, h, f0, start, dead, n, sample) -> None:
    """Write a CTA's output tile at its rows (``MosaicTiles.out`` "rows" / "select"): the tile holds
    rows ``[f0, f0 + rows)`` of its sample's frame (frame row ``i`` is the array's row
    ``start + i``; the sample's own rows are ``[dead, n)``). TMA writes whole 8-row chunks;
    a chunk the sample shares with a neighbour (its first where ``dead > 0``, its last where
    it ends mid-chunk) would be written by two CTAs at once, so those go to the sample's two
    8-row slots of ``side_ref`` (first chunk, last chunk) for the wrapper to place
    (``_side_rows``); the chunks wholly the sample's go to their rows of ``out_ref``, in one
    copy where the tile has no other; chunks past the sample's end nowhere."""
    rows = smem.shape[0]
    whole = ((f0 > 0) | (dead == 0)) & (f0 + rows <= n)

    @pl.when(whole)
    def _():
        plgpu.copy_smem_to_gmem(smem, out_ref.at[pl.ds(start + f0, rows), h])

    @pl.when(jnp.logical_not(whole) & (f0 < n))
    def _():
        for i in range(rows // 8):
            a = f0 + 8 * i
            own = ((a > 0) | (dead == 0)) & (a + 8 <= n)
            chunk = smem.at[pl.ds(8 * i, 8)]
            dst = out_ref.at[pl.ds(start + a, 8), h]
            # (as 8 x a row count: Mosaic GPU must see that a TMA row offset is a multiple of 8)
            side = side_ref.at[pl.ds(8 * (2 * sample + jnp.where(a == 0, 0, 1)), 8), h]
            pl.when(own)(functools.partial(plgpu.copy_smem_to_gmem, chunk, dst))
            shared = jnp.logical_not(own) & (a < n)
            pl.when(shared)(functools.partial(plgpu.copy_smem_to_gmem, chunk, side))

    plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # as `_zero_tail`'s


def _mma_from_registers(acc_ref, t16, b_smem, t_smem2, wg, interpreted: bool) -> None:
    """``acc += t16 @ b``, ``t16`` from registers; in the interpreter, whose wgmma reads only
    shared memory, through warp group ``wg``'s slot of ``t_smem2``."""
    if interpreted:
        t_smem2.at[wg][...] = t16
        plgpu.commit_smem()
        plgpu.wgmma(acc_ref, t_smem2.at[wg], b_smem)
    else:
        plgpu.wgmma(acc_ref, t16, b_smem)


def _stream(fetch, steps, stages: int, frees) -> None:
    """The producer's loop over ``steps`` streamed tiles: ``fetch(step, slot)`` fills the first
    ``stages`` slots, then refills a slot once each barrier of ``frees`` says both consumers
    released it; the last releases are observed too (every slot is free when the block
    exits)."""
    for i in range(stages):
        pl.when(i < steps)(functools.partial(fetch, i, i))

    def released(s):
        slot = lax.rem(s, jnp.int32(stages))
        for free in frees:
            plgpu.barrier_wait(free.at[slot])
        return slot

    @pl.loop(stages, steps)
    def _(s):
        fetch(s, released(s))

    @pl.loop(jnp.maximum(steps - stages, 0), steps)
    def _(s):
        released(s)


def _query_tiles(k0, bk: int, bq: int, n, c, hist, dead):
    """The query tiles that see keys [k0, k0 + bk) of a sample (in its frame: ``dead`` rows
    first), as steps ``0 .. steps``: ``tile(s)`` and the steps ``[u0, u1)`` whose tiles need
    no mask. The ranges are the Triton lowering's (``_common._query_ranges``); here a key
    block holding dead rows is masked too, and so is the tile holding the sample's end (its
    rows past it are the next sample's, not zeros)."""
    end_a, lo_b, q_int, hi_b = _query_ranges(k0, n, c, hist, _Blocks(bq, bk))
    q_int = jnp.where((k0 > 0) | (dead == 0), q_int, hi_b)
    q_end = jnp.clip(lax.div(n, jnp.int32(bq)), q_int, hi_b)

    def tile(s):
        return jnp.where(s < end_a, s, s - end_a + lo_b)

    shift = end_a - lo_b
    return tile, end_a + hi_b - lo_b, q_int + shift, q_end + shift


def _key_kernel(meta_ref, *refs, tiles, order, alpha, normalizer, rows_out, interpreted):
    """One CTA: ``block_q`` key rows of one sample and head, both gradients. Warp group 0
    accumulates dv (``P^T dO``), warp group 1 dk (``dS^T q``, ``S^T`` recomputed: at head dim
    256 one warp group cannot hold both ``[64, D]`` fp32 accumulators); warp group 2 streams
    the query / dO tiles that see the keys. ``rows_out``: dk and dv written at their rows
    (``_store``; ``refs`` then hold their side buffers)."""
    if rows_out:
        q_ref, k_ref, v_ref, do_ref, dk_ref, dv_ref, dk_side, dv_side, scoped = refs
    else:
        q_ref, k_ref, v_ref, do_ref, dk_ref, dv_ref, scoped = refs
        dk_side = dv_side = None
    (k_smem, v_smem, q_smem, do_smem, t_smem2), (kv_full, q_full, do_full), free, done = scoped
    bk, bq, stages = tiles.block_q, tiles.block_kv, tiles.stages
    dtype = q_ref.dtype
    j, h, zero_slot = _cta_work(lax.axis_index("cta"), order)
    wg = lax.axis_index("wg")
    start, n, c, hist, blk, dead, sample = (meta_ref[f, j] for f in range(7))
    start = start * 8
    n, hist = n + dead, hist + dead
    n = jnp.where(zero_slot < 0, n, 0)  # a tail CTA: no block of its own
    c = jnp.where(c > 0, c + dead, 0)
    k0 = blk * bk
    tile, steps, u0, u1 = _query_tiles(k0, bk, bq, n, c, hist, dead)
    inv_n = jnp.float32(1.0 / normalizer)

    def iota(dim):
        if interpreted:
            return lax.broadcasted_iota(jnp.int32, (bk, bq), dim)
        return plgpu.broadcasted_iota(jnp.int32, (bk, bq), dim, layout=plgpu.Layout.WGMMA)

    def keep(t):
        jj = k0 + iota(0)  # keys: the rows here
        i = t * bq + iota(1)
        attended = (i == jj) | ((jj < hist) & ((jj <= i) | (i < c)))
        return (jj >= dead) & (i >= dead) & (i < n) & attended

    def scores_t(slot, with_dp: bool):
        """``S^T = k q^T`` (and ``dP^T = v dO^T``) for the query tile in ``slot``."""

        def body(s_ref, dp_ref=None):
            plgpu.wgmma(s_ref, k_smem, q_smem.at[slot].transpose((1, 0)))
            if dp_ref is not None:
                plgpu.wgmma(dp_ref, v_smem, do_smem.at[slot].transpose((1, 0)))
                return s_ref[...], dp_ref[...]
            return s_ref[...]

        acc = plgpu.ACC((bk, bq), jnp.float32)
        return pl.run_scoped(body, acc, acc) if with_dp else pl.run_scoped(body, acc)

    def accumulate(t16, b_smem, acc_ref, slot):
        """``acc += t16 @ b`` (``_mma_from_registers``), then release the slot."""
        _mma_from_registers(acc_ref, t16, b_smem, t_smem2, wg, interpreted)
        plgpu.wgmma_wait(0)
        plgpu.barrier_arrive(free.at[slot])

    def dv_step(acc_ref, s, masked):
        slot = lax.rem(s, jnp.int32(stages))
        plgpu.barrier_wait(q_full.at[slot])
        plgpu.barrier_wait(do_full.at[slot])
        st = scores_t(slot, with_dp=False)
        # silu(alpha s) / N = (alpha s / 2N) (1 + tanh(alpha s / 2))
        p = (st * jnp.float32(0.5 * alpha / normalizer)) * (
            1.0 + jnp.tanh(st * jnp.float32(0.5 * alpha))
        )
        if masked:
            p = jnp.where(keep(tile(s)), p, 0.0)
        accumulate(p.astype(dtype), do_smem.at[slot], acc_ref, slot)

    def dk_step(acc_ref, s, masked):
        slot = lax.rem(s, jnp.int32(stages))
        plgpu.barrier_wait(q_full.at[slot])
        plgpu.barrier_wait(do_full.at[slot])
        st, dpt = scores_t(slot, with_dp=True)
        x = st * jnp.float32(alpha)
        sig = 0.5 + 0.5 * jnp.tanh(x * 0.5)
        ds = dpt * (sig * (1.0 + x * (1.0 - sig))) * inv_n
        if masked:
            ds = jnp.where(keep(tile(s)), ds, 0.0)
        accumulate(ds.astype(dtype), q_smem.at[slot], acc_ref, slot)

    def consume(step, d: int, out_smem, out_ref, side_ref, scale: float):
        def run(acc_ref):
            @pl.loop(0, u0)
            def _(s):
                step(acc_ref, s, masked=True)

            @pl.loop(u0, u1)
            def _(s):
                step(acc_ref, s, masked=False)

            @pl.loop(u1, steps)
            def _(s):
                step(acc_ref, s, masked=True)

            return acc_ref[...]

        acc = pl.run_scoped(run, plgpu.ACC((bk, d), jnp.float32))
        if scale != 1.0:
            acc = acc * jnp.float32(scale)
        # Both warp groups are done reading k and v: each writes its gradient over one.
        plgpu.barrier_arrive(done)
        plgpu.barrier_wait(done)
        out_smem[...] = acc.astype(dtype)
        plgpu.commit_smem()
        if rows_out:
            _store(out_smem, out_ref, side_ref, h, k0, start, dead, n, sample)
            tail0 = meta_ref[0, order[0]] * 8
            pl.when(zero_slot >= 0)(lambda: _zero_tail(out_smem, out_ref, h, zero_slot, tail0))
        else:
            plgpu.copy_smem_to_gmem(out_smem, out_ref.at[pl.ds(j * bk, bk), h])
            plgpu.wait_smem_to_gmem(0)

    @pl.when(wg < 2)
    def _consumer():
        plgpu.set_max_registers(232, action="increase")
        plgpu.barrier_wait(kv_full.at[0])
        plgpu.barrier_wait(kv_full.at[1])
        d_qk, d_v = dk_ref.shape[-1], dv_ref.shape[-1]
        pl.when(wg == 0)(lambda: consume(dv_step, d_v, v_smem, dv_ref, dv_side, 1.0))
        pl.when(wg == 1)(lambda: consume(dk_step, d_qk, k_smem, dk_ref, dk_side, alpha))

    @pl.when(wg == 2)
    def _producer():
        plgpu.set_max_registers(40, action="decrease")
        rows = pl.ds(start + k0, bk)
        plgpu.copy_gmem_to_smem(k_ref.at[rows, h], k_smem, kv_full.at[0])
        plgpu.copy_gmem_to_smem(v_ref.at[rows, h], v_smem, kv_full.at[1])

        def fetch(s, slot):
            rows = pl.ds(start + tile(s) * bq, bq)
            plgpu.copy_gmem_to_smem(q_ref.at[rows, h], q_smem.at[slot], q_full.at[slot])
            plgpu.copy_gmem_to_smem(do_ref.at[rows, h], do_smem.at[slot], do_full.at[slot])

        _stream(fetch, steps, stages, (free,))


def _call(kind, q, k, v, do, offs, ctx, cand, *, max_seqlen, alpha, normalizer, tiles, interpret):
    """Run the ``kind`` kernel over the jagged batch: ``[T, H, D]`` (D: Dv for "fwd", Dqk for
    "dq"; "dkdv": the pair dk, dv) in ``q.dtype``, zero past ``offs[-1]``."""
    t_cap, heads, d_qk = q.shape
    d_v = v.shape[-1]
    bq, bk, stages = tiles.block_q, tiles.block_kv, tiles.stages
    key_major = kind == "dkdv"
    block = bq if key_major else 2 * bq  # rows a CTA owns: its keys, or two query blocks
    bsz = offs.shape[0] - 1
    # TMA reads global memory in the shared tiles' (8, 64) tiling, so a tile must start on a
    # multiple of 8 rows: each sample is seen from the multiple of 8 at or before its start,
    # with the rows between (at most 7, the previous sample's) dead. The blocks are the frame's.
    offs = offs.astype(jnp.int32)
    lens = offs[1:] - offs[:-1]
    dead = offs[:-1] % 8
    frame_seqlen = max_seqlen + 7
    num = pairs(t_cap + 7 * bsz, bsz, frame_seqlen, block)
    out_mode = output_mode(tiles, kind)
    rows_out = out_mode != "tiles"
    if meta_mode() == "kernel":
        meta = _meta_table(offs, ctx, cand, block, frame_seqlen, num, key_major, bool(interpret))
        blk, b, valid = meta[4, :num], meta[6, :num], (meta[1, :num] > 0).astype(jnp.int32)
    else:
        seen = jnp.where(lens > 0, lens + dead, 0)  # an empty sample: no block
        frame = jnp.concatenate([jnp.zeros((1,), jnp.int32), jnp.cumsum(seen)])
        blk, b, valid = schedule(jnp, frame, frame_seqlen, num, block, key_major=key_major)
        meta = _meta_from_schedule(offs, ctx, cand, blk, b, valid)
    ins = [q, k, v] if kind == "fwd" else [q, k, v, do]
    if t_cap % 8:
        # Mosaic GPU describes the whole array to TMA in the shared tiles' (8, 64) tiling and
        # refuses rows that are not whole tiles (jax 0.11.2: "must have size smaller or a
        # multiple of its tiling"), so such a call pays a copy of each input; a training
        # step's capacities are multiples of 256 rows (`hstu.capacity.ALIGN`) and pay none.
        ins = [jnp.pad(x, ((0, -t_cap % 8), (0, 0), (0, 0))) for x in ins]

    # A wgmma contracting over the streamed tiles' rows (P v, dS k; P^T dO, dS^T q) needs K
    # to be a multiple of the swizzle's width (in elements), and both operands of a wgmma one
    # swizzle: 32-row streamed tiles put every buffer on a 64-byte swizzle.
    swizzle = min(128, bk * 2)
    smem = functools.partial(
        plgpu.SMEM,
        transforms=(plgpu.TilingTransform((8, swizzle // 2)), plgpu.SwizzleTransform(swizzle)),
    )
    interpreted = bool(interpret)
    # Launch order (one grid axis, which the GPU dispatches in turn): dq / dk / dv send each
    # entry's heads together, so every head's heaviest entries start first: forward +
    # backward -3 to -15 % on bench_upstream's batches, +4-6 % on 8 x 4096. The forward goes
    # head by head: entry by entry measured 4-5 % slower for it (kernels/README.md, "Dispatch
    # order").
    lead = launch_lead(kind, tiles.lead, num)
    order = (num, heads, lead) + ((TAIL_CTAS,) if rows_out else ())
    # P / dS (P^T / dS^T) for the interpreter, whose wgmma reads only shared memory
    t_buf = smem((2, bq, bk), q.dtype) if interpreted else None
    if key_major:
        buffers = [
            smem((bq, d_qk), q.dtype),
            smem((bq, d_v), q.dtype),
            smem((stages, bk, d_qk), q.dtype),
            smem((stages, bk, d_v), q.dtype),
            t_buf,
        ]
        barriers = [
            plgpu.Barrier(num_barriers=2),
            plgpu.Barrier(num_barriers=stages),
            plgpu.Barrier(num_barriers=stages),
        ]
        rest = (plgpu.Barrier(num_arrivals=2, num_barriers=stages), plgpu.Barrier(num_arrivals=2))
        body = functools.partial(
            _key_kernel,
            tiles=tiles,
            order=order,
            alpha=alpha,
            normalizer=normalizer,
            rows_out=rows_out,
        )
        widths = (d_qk, d_v)
    else:
        d_out = d_v if kind == "fwd" else d_qk
        buffers = [
            smem((2, bq, d_qk), q.dtype),
            smem((stages, bk, d_qk), q.dtype),
            smem((stages, bk, d_v), q.dtype),
            t_buf,
            smem((2, bq, d_out), q.dtype) if d_out != d_qk else None,
        ]
        barriers = [
            plgpu.Barrier(num_barriers=stages),
            plgpu.Barrier(num_barriers=stages),
            plgpu.Barrier(num_barriers=2),
        ]
        if kind == "dq":
            buffers.append(smem((2, bq, d_v), q.dtype))
            barriers.append(plgpu.Barrier(num_barriers=2))
        rest = ((plgpu.Barrier(num_arrivals=2, num_barriers=stages),) * 2,)
        rest += (plgpu.Barrier(num_arrivals=2),)
        body = functools.partial(
            _query_kernel,
            kind=kind,
            tiles=tiles,
            order=order,
            alpha=alpha,
            normalizer=normalizer,
            rows_out=rows_out,
        )
        widths = (d_out,)
    t_pad = ins[0].shape[0]
    if rows_out:  # the jagged rows, then each output's side slots (16 rows a sample)
        shapes = [(t_pad, heads, d) for d in widths] + [(16 * bsz, heads, d) for d in widths]
    else:  # one tile per CTA
        shapes = [(num * block, heads, d) for d in widths]
    out_type = tuple(jax.ShapeDtypeStruct(shape, q.dtype) for shape in shapes)

    def entry(meta_ref, *refs):
        pl.run_scoped(
            lambda *scoped: body(meta_ref, *refs, scoped, interpreted=interpreted),
            tuple(buffers),
            tuple(barriers),
            *rest,
            collective_axes="wg",
        )

    outs = plgpu.kernel(
        entry,
        out_type=out_type,
        grid=(num * heads + (TAIL_CTAS * heads if rows_out else 0),),
        grid_names=("cta",),
        num_threads=3,
        thread_name="wg",
        compiler_params=plgpu.CompilerParams(
            approx_math=True, lowering_semantics=plgpu.LoweringSemantics.Warpgroup
        ),
        interpret=InterpretGPUParams() if interpret else None,
    )(meta, *ins)
    if rows_out:
        dst = _side_rows(offs, dead, t_pad)
        if out_mode == "rows":
            # the chunks two samples share, placed after the kernel: a scatter of at most 16
            # rows a sample into the kernel's own output, in place
            def place(o, side):
                return o.at[dst].set(side, mode="drop")

        else:
            # each row's side slot (-1: none; the same map for every call of a step), and
            # the shared rows selected from the slots where the output is read
            slot = jnp.full((t_pad,), -1, jnp.int32)
            slot = slot.at[dst].set(jnp.arange(dst.shape[0], dtype=jnp.int32), mode="drop")
            shared = (slot >= 0)[:, None, None]

            def place(o, side):
                picked = jnp.take(side, jnp.maximum(slot, 0), axis=0, mode="clip")
                return jnp.where(shared, picked, o)

        outs = tuple(
            place(o, side)[:t_cap]
            for o, side in zip(outs[: len(widths)], outs[len(widths) :], strict=True)
        )
        return outs if key_major else outs[0]

    # Each token's row in the CTA tiles: its (block, sample) pair's entry, then its offset.
    levels = -(-frame_seqlen // block)
    owner = jnp.where(valid != 0, b, bsz)  # entries without work scatter nowhere
    entry_of = jnp.zeros((bsz, levels), jnp.int32)
    entry_of = entry_of.at[owner, blk].set(jnp.arange(num, dtype=jnp.int32), mode="drop")
    t = jnp.arange(t_cap, dtype=jnp.int32)
    sample = sample_of(offs[1:], t_cap)
    local = t - offs[sample] + dead[sample]  # in the sample's frame
    level = jnp.clip(local // block, 0, levels - 1)
    rows = entry_of[sample, level] * block + local % block
    live = (t < offs[-1])[:, None, None]

    def back(tiles_out):
        out = jnp.take(tiles_out, rows, axis=0)
        return jnp.where(live, out, jnp.zeros((), out.dtype))

    outs = tuple(back(o) for o in outs)
    return outs if key_major else outs[0]


def meta_mode() -> str:
    """``$HSTU_MOSAIC_META``: where a call's table of CTA work (``_call``'s ``meta``) is
    computed, ``"kernel"`` (default: one Pallas kernel, ``_meta_table``) or ``"xla"`` (jnp,
    some ten small XLA kernels a call where a training step does not share them). In device
    time (H200, head dim 256, the forward at its rows) the kernel took 3-4 us off each
    standalone forward of short samples and left forward + backward within -5 / +11 us of
    XLA's; it is the default as part of the set the step was measured with (``DEFAULT_OUT``).
    Its lowering is Pallas' Triton one, as the norm kernels' (jax 0.11 lowers it for CUDA
    only with a GPU present)."""
    mode = os.environ.get("HSTU_MOSAIC_META", "") or "kernel"
    if mode not in ("xla", "kernel"):
        raise ValueError(f"HSTU_MOSAIC_META: expected xla or kernel, got {mode!r}")
    return mode


def _meta_from_schedule(offs, ctx, cand, blk, b, valid):
    """The kernels' ``[7, num + 1]`` int32 table from the schedule's ``(blk, b, valid)``: per
    entry the sample's first row in chunks of 8 (its frame's), its length (0: no work), its
    contextual tokens, its history end, the block, the dead rows before it in its frame's
    first chunk and the sample; column ``num``: the chunk holding the batch's end (row 0)."""
    lens = offs[1:] - offs[:-1]
    dead = offs[:-1] % 8
    start = (offs[b] - dead[b]) // 8  # in rows of 8: the kernel multiplies back
    n = jnp.where(valid != 0, lens[b], 0)
    c = jnp.zeros_like(n) if ctx is None else ctx[b]
    hist = n if cand is None else jnp.clip(n - cand[b], 0, n)
    r = jnp.where(valid != 0, dead[b], 0)
    sample = jnp.where(valid != 0, b, 0)
    meta = jnp.stack([start, n, c, hist, blk, r, sample]).astype(jnp.int32)  # [7, num]
    tail0 = offs[-1] // 8
    col = jnp.concatenate([tail0[None], jnp.zeros((6,), jnp.int32)])
    return jnp.concatenate([meta, col[:, None]], axis=1)


_META_ENTRIES = 128  # entries per program of `_meta_kernel`


def _meta_kernel(*refs, bsz, block, levels, num, key_major, has_ctx, has_cand):
    """``_META_ENTRIES`` entries of ``_meta_from_schedule``'s table: ``kernels/schedule.py``'s
    sums over the samples' frames (each sample seen from the multiple of 8 at or before its
    start) in registers, the samples' fields picked by a one-hot sum per entry."""
    offs_ref, *rest = refs
    ctx_ref = rest.pop(0) if has_ctx else None
    cand_ref = rest.pop(0) if has_cand else None
    (meta_ref,) = rest
    nb_b, nb_l = max(16, _next_pow2(bsz)), max(16, _next_pow2(levels))
    i32 = jnp.int32
    bi = jnp.arange(nb_b, dtype=i32)
    inb = bi < bsz

    def load(ref, shift=0):  # ref[b + shift] of each sample b (0 past the batch)
        return _pl_load(ref.at[jnp.minimum(bi + shift, bsz)], mask=inb, other=0)

    lo, hi = load(offs_ref), load(offs_ref, 1)
    lens = hi - lo
    dead = lo % 8
    nblk = (jnp.where(lens > 0, lens + dead, 0) + (block - 1)) // block  # [B]: the frame's
    lv = jnp.arange(nb_l, dtype=i32)
    above = jnp.sum(jnp.maximum(nblk[None, :] - 1 - lv[:, None], 0), axis=1)  # [L]
    j = pl.program_id(0) * _META_ENTRIES + jnp.arange(_META_ENTRIES, dtype=i32)
    level = jnp.sum((above[None, :] > j[:, None]).astype(i32), axis=1)
    r = j - jnp.sum(jnp.where(lv[None, :] == level[:, None], above[None, :], 0), axis=1)
    has = (nblk[None, :] > level[:, None]).astype(i32)  # [G, B]
    valid = (r < jnp.sum(has, axis=1)) & (j < num)
    rank = jnp.cumsum(has, axis=1)  # the r-th pair's sample is the first of rank r + 1
    b = jnp.where(valid, jnp.sum((rank <= r[:, None]).astype(i32), axis=1), 0)
    one = bi[None, :] == b[:, None]

    def pick(x):  # x[b] of each entry
        return jnp.sum(jnp.where(one, x[None, :], 0), axis=1)

    blk = pick(nblk) - 1 - level if key_major else level
    n = jnp.where(valid, pick(lens), 0)
    r_dead = jnp.where(valid, pick(dead), 0)
    c = jnp.zeros_like(n)
    if ctx_ref is not None:
        c = pick(load(ctx_ref))
    hist = n
    if cand_ref is not None:
        cand = pick(load(cand_ref))
        hist = jnp.clip(n - cand, 0, n)
    start = (pick(lo) - r_dead) // 8
    # column num: the chunk holding the batch's end
    end = jnp.sum(jnp.where(bi == bsz - 1, hi, 0)) // 8
    start = jnp.where(j == num, end, start)
    cols = (start, n, jnp.where(j < num, c, 0), hist, jnp.where(valid, blk, 0), r_dead, b)
    keep = j <= num
    for f, col in enumerate(cols):
        at = (pl.ds(f, 1), pl.ds(pl.program_id(0) * _META_ENTRIES, _META_ENTRIES))
        _pl_store(meta_ref.at[at], col[None, :], mask=keep[None, :])


def _meta_table(offs, ctx, cand, block, frame_seqlen, num, key_major, interpret: bool):
    """``_meta_from_schedule``'s table by one Pallas kernel (Triton lowering)."""
    bsz = offs.shape[0] - 1
    levels = -(-frame_seqlen // block)
    ins = [offs] + [x.astype(jnp.int32) for x in (ctx, cand) if x is not None]
    kwargs = {} if interpret else {"compiler_params": _compiler_params(4, 1)}
    return pl.pallas_call(
        functools.partial(
            _meta_kernel,
            bsz=bsz,
            block=block,
            levels=levels,
            num=num,
            key_major=key_major,
            has_ctx=ctx is not None,
            has_cand=cand is not None,
        ),
        out_shape=jax.ShapeDtypeStruct((7, num + 1), jnp.int32),
        grid=(pl.cdiv(num + 1, _META_ENTRIES),),
        interpret=interpret,
        name="mosaic_meta",
        **kwargs,
    )(*ins)


def _side_rows(offs, dead, t_pad: int):
    """``[16 B]`` int32: the row of the jagged output each side slot's row goes to (``_store``:
    sample ``b``'s first chunk at slots ``16 b .. 16 b + 7``, its last at ``16 b + 8 ..``),
    ``t_pad`` (past the array: dropped) for slots that hold no row of their sample. A chunk is
    in a slot when the sample shares it: the first where the sample starts past the chunk's
    first row or ends before its last, the last (when not the first) where it ends mid-chunk."""
    lo, hi = offs[:-1], offs[1:]
    first = lo - dead  # the frame's row 0, a multiple of 8
    n = hi - first  # the frame's rows
    a_last = jnp.maximum(n - 1, 0) // 8 * 8  # the last chunk's first row, in the frame
    used = (
        jnp.stack([(dead > 0) | (n < 8), (a_last > 0) & (a_last + 8 > n)], axis=1)
        & (hi > lo)[:, None]
    )
    r = jnp.stack([first, first + a_last], axis=1)[:, :, None] + jnp.arange(8, dtype=jnp.int32)
    mine = used[:, :, None] & (r >= lo[:, None, None]) & (r < hi[:, None, None])
    return jnp.where(mine, r, t_pad).reshape(-1)


def forward(q, k, v, offs, ctx, cand, **kw):
    """Forward HSTU attention (no biases) with the Mosaic GPU kernel: ``[T, H, Dv]`` in
    ``q.dtype``, zero past ``offs[-1]``. ``ctx`` / ``cand`` are ``[B]`` int32 or None;
    ``kw``: ``max_seqlen``, ``alpha``, ``normalizer``, ``tiles`` and ``interpret``."""
    return _call("fwd", q, k, v, None, offs, ctx, cand, **kw)


def backward_dq(q, k, v, do, offs, ctx, cand, **kw):
    """The query gradient of the (bias-free) HSTU attention given dO: ``[T, H, Dqk]``."""
    return _call("dq", q, k, v, do, offs, ctx, cand, **kw)


def backward_dkdv(q, k, v, do, offs, ctx, cand, **kw):
    """The key and value gradients of the (bias-free) HSTU attention given dO: ``([T, H,
    Dqk], [T, H, Dv])``."""
    return _call("dkdv", q, k, v, do, offs, ctx, cand, **kw)
