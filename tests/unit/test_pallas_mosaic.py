"""The Mosaic GPU kernels of the Pallas HSTU attention (``kernels/pallas/_mosaic.py``): the
forward, dq and dk / dv, chosen by ``lowering="mosaic"``.

* interpret mode (Mosaic GPU's own CPU interpreter, which simulates the warp groups, the
  barriers and the TMA copies): forward and gradients against the jnp reference on jagged
  batches with contextual and candidate tokens, empty and one-token samples, samples not
  starting on a multiple of 8 rows and capacity padding, and against ``lowering="triton"``;
* the compiled path is lowered for CUDA on this machine (no GPU needed): each kernel must
  produce a Mosaic GPU kernel within shared memory for each head dim, the recipe's 256
  included;
* ``-m gpu``: compiled on a Hopper GPU against the reference at long jagged batches.

The kernels are written for jax >= 0.11 (the GPU image's 0.11.2); with jax 0.10 these tests
skip with that reason, and ``make test-mosaic`` runs them in a Python 3.12 environment
with jax 0.11.2. The interpreter runs each warp group as a host thread blocking in XLA
callbacks: it needs at least 4 host devices' threads (``make test-mosaic`` sets them).
"""

from __future__ import annotations

import os
import re
from dataclasses import replace
from unittest import mock

import numpy as np
import pytest

jax = pytest.importorskip("jax")
jnp = pytest.importorskip("jax.numpy")

from hstu_kernels.pallas import (  # noqa: E402
    MosaicTiles,
    _mosaic,  # noqa: E402
    hstu_attention,
    hstu_attention_reference,
    mosaic_problem,
)

DEFAULT = (MosaicTiles(), MosaicTiles())
_WHY = mosaic_problem(jnp.bfloat16, 64, 64, False, DEFAULT, interpret=True)
needs_mosaic = pytest.mark.skipif(_WHY is not None, reason=f"Mosaic GPU kernels: {_WHY}")
needs_threads = pytest.mark.skipif(
    jax.default_backend() == "cpu" and len(jax.devices()) < 4,
    reason="the Mosaic GPU interpreter needs >= 4 host devices' threads (make test-mosaic)",
)

# (n, C, K) per sample: starts at 0, 37, 37, 38, 111, 175 ... (most not multiples of 8)
LENGTHS = [(37, 3, 4), (0, 0, 0), (1, 0, 0), (73, 0, 9), (64, 5, 0), (130, 2, 7), (9, 9, 0)]


def _inputs(dqk: int, dv: int, heads: int = 2, pad: int = 11, seed: int = 0):
    rng = np.random.default_rng(seed)
    n = np.array([x[0] for x in LENGTHS], np.int32)
    offs = np.concatenate([[0], np.cumsum(n)]).astype(np.int32)
    t_cap = int(offs[-1]) + pad

    def rand(*shape):
        return jnp.asarray(rng.standard_normal(shape), jnp.bfloat16)

    q, k, v = rand(t_cap, heads, dqk), rand(t_cap, heads, dqk), rand(t_cap, heads, dv)
    kw = dict(
        max_seqlen=int(n.max()) + 5,
        alpha=1.0 / np.sqrt(dqk),
        normalizer=128.0,
        num_contextual=jnp.asarray([x[1] for x in LENGTHS], jnp.int32),
        num_candidates=jnp.asarray([x[2] for x in LENGTHS], jnp.int32),
    )
    return q, k, v, jnp.asarray(offs), kw


def _rel_err(a, b) -> float:
    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    return float(np.max(np.abs(a - b)) / max(np.max(np.abs(b)), 1e-6))


def _reference(q, k, v, offs, **kw):
    """The jnp reference in fp32 (differentiable in the 16-bit inputs)."""
    return hstu_attention_reference(*(x.astype(jnp.float32) for x in (q, k, v)), offs, **kw)


def _lowered_for_cuda(kind: str, q, k, v, offs, kw) -> str:
    """The compiled path of one kernel (``fwd``, ``dq`` or ``dkdv``, the output mode its
    default or the caller's environment names), lowered for CUDA, with the work table from
    XLA: jax 0.11 lowers the meta kernel (Pallas' Triton lowering) for CUDA only with a GPU
    present, so its own lowering is checked under jax 0.10
    (`test_meta_kernel_builds_the_schedules_table`) and compiled on the GPU (the tests marked
    gpu, default set)."""
    kw = dict(kw)
    ctx, cand = kw.pop("num_contextual"), kw.pop("num_candidates")
    tiles = _mosaic.default_tiles(kind, q.shape[2], v.shape[2])

    def f(q, k, v, offs, ctx, cand):
        if kind == "fwd":
            return _mosaic.forward(q, k, v, offs, ctx, cand, **kw, tiles=tiles, interpret=False)
        do = jnp.zeros_like(v)
        fn = _mosaic.backward_dq if kind == "dq" else _mosaic.backward_dkdv
        return fn(q, k, v, do, offs, ctx, cand, **kw, tiles=tiles, interpret=False)

    with mock.patch.dict(os.environ, {"HSTU_MOSAIC_META": "xla"}):
        traced = jax.jit(f).trace(q, k, v, offs, ctx, cand)
    return traced.lower(lowering_platforms=("cuda",)).as_text()


@needs_mosaic
@needs_threads
@pytest.mark.parametrize(
    ("dqk", "dv", "tiles"),
    [
        (64, 64, None),
        # padded head dims; the forward's and dq's CTAs launched in a mixed order (`lead`); dq
        # in the 32-row, three-stage ring it takes at head dim 256
        (
            32,
            48,
            (
                MosaicTiles(block_kv=128, stages=3, lead=2),
                MosaicTiles(block_kv=32, stages=3, lead=1),
            ),
        ),
        (256, 128, None),  # wide query / key rows (every kernel's 64-row tiles still fit)
    ],
)
def test_forward_and_gradients_match_the_reference(dqk, dv, tiles):
    q, k, v, offs, kw = _inputs(dqk, dv, seed=dqk)
    cot = jnp.asarray(np.random.default_rng(dv).standard_normal(v.shape), jnp.float32)

    def run(fn, **extra):
        def loss(q, k, v):
            out = fn(q, k, v, offs, **kw, **extra)
            return jnp.sum(out.astype(jnp.float32) * cot), out

        (_, out), grads = jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True)(q, k, v)
        return out, grads

    out, grads = run(hstu_attention, lowering="mosaic", mosaic_tiles=tiles, interpret=True)
    want, want_grads = run(_reference)
    assert out.shape == want.shape and out.dtype == q.dtype
    assert _rel_err(out, want) < 1e-2
    assert not np.any(np.asarray(out[int(offs[-1]) :], np.float32))  # capacity padding: 0
    for name, g, w in zip("qkv", grads, want_grads, strict=True):
        assert _rel_err(g, w) < 2e-2, name
    # and each gradient within bf16 rounding of the Triton lowering's (same fp32 sums, in
    # another order)
    _, tri = run(hstu_attention, lowering="triton", interpret=True)
    for name, a, b in zip("qkv", grads, tri, strict=True):
        assert _rel_err(a, b) < 4e-3, name


@needs_mosaic
@pytest.mark.parametrize(("dqk", "dv"), [(64, 64), (128, 128), (256, 256), (128, 256), (256, 128)])
@pytest.mark.parametrize("kind", ["fwd", "dq", "dkdv"])
@pytest.mark.parametrize("out", _mosaic.OUTS)
def test_the_compiled_kernels_lower_for_cuda(kind, dqk, dv, out, monkeypatch):
    monkeypatch.setenv("HSTU_MOSAIC_OUT", out)
    assert "mosaic_gpu" in _lowered_for_cuda(kind, *_inputs(dqk, dv, heads=4))


@needs_mosaic
@pytest.mark.parametrize("kind", ["fwd", "dq", "dkdv"])
def test_the_kernels_read_the_callers_rows_in_place(kind, monkeypatch):
    """No copy of q, k, v (dO) before the kernel, though most samples start off a multiple of
    8 rows: with the outputs as tiles (dq's and dk / dv's default, here every kernel's) the
    program's only gather of `[T, H, D]` rows is the one that brings them back from the CTA
    tiles, and nothing is padded where T is whole 8-row tiles."""
    monkeypatch.setenv("HSTU_MOSAIC_OUT", "tiles")
    q, k, v, offs, kw = _inputs(
        64, 64, heads=4, pad=11 + (-(int(sum(x[0] for x in LENGTHS)) + 11) % 8)
    )
    assert q.shape[0] % 8 == 0 and int(offs[1]) % 8 != 0
    text = _lowered_for_cuda(kind, q, k, v, offs, kw)
    rows = re.compile(r"-> tensor<\d+x4x64xbf16>")  # rows of q, k, v, dO or the output
    gathers = [ln for ln in text.splitlines() if "gather" in ln and rows.search(ln)]
    # one gather (dk / dv: one for both, the same jitted take called twice)
    assert len(gathers) == 1, gathers
    assert all(f"tensor<{q.shape[0]}x4x64xbf16>" in g for g in gathers), gathers
    assert "stablehlo.pad" not in text


@needs_mosaic
@pytest.mark.parametrize("kind", ["fwd", "dq", "dkdv"])
def test_outputs_at_their_rows_need_no_gather(kind, monkeypatch):
    """`out="rows"` (here through `$HSTU_MOSAIC_OUT`): no gather of `[T, H, D]` rows at all;
    what follows the kernel is one scatter of the side slots per output, in place, and no
    select (the kernel zeroes the rows past the batch itself)."""
    monkeypatch.setenv("HSTU_MOSAIC_OUT", "rows")
    q, k, v, offs, kw = _inputs(
        64, 64, heads=4, pad=11 + (-(int(sum(x[0] for x in LENGTHS)) + 11) % 8)
    )
    text = _lowered_for_cuda(kind, q, k, v, offs, kw)
    rows = re.compile(r"-> tensor<\d+x4x64xbf16>")
    assert not [ln for ln in text.splitlines() if "gather" in ln and rows.search(ln)]
    lines = text.splitlines()
    # a scatter's types follow its update region, a few lines on
    scatters = [
        i
        for i, ln in enumerate(lines)
        if "stablehlo.scatter" in ln and rows.search("\n".join(lines[i : i + 6]))
    ]
    assert len(scatters) == (2 if kind == "dkdv" else 1), scatters
    assert not [ln for ln in lines if "stablehlo.select" in ln and "x4x64xbf16>" in ln]
    # "select" (per kernel): no scatter of rows, the shared rows one select over the output
    monkeypatch.setenv("HSTU_MOSAIC_OUT", f"{kind}=select")
    lines = _lowered_for_cuda(kind, q, k, v, offs, kw).splitlines()
    assert not [i for i, ln in enumerate(lines) if "stablehlo.scatter" in ln and rows.search(
        "\n".join(lines[i : i + 6])
    )]  # fmt: skip
    selects = [ln for ln in lines if "stablehlo.select" in ln and "x4x64xbf16>" in ln]
    assert selects, "no select of the output's rows"
    for bad in ("bogus", "fwd=rows,dq=gather", "bwd=rows"):
        monkeypatch.setenv("HSTU_MOSAIC_OUT", bad)
        with pytest.raises(ValueError, match="HSTU_MOSAIC_OUT"):
            _lowered_for_cuda(kind, q, k, v, offs, kw)


def test_output_mode_per_kernel(monkeypatch):
    """`$HSTU_MOSAIC_OUT`: one mode for every kernel, or per kernel (the others: their
    default); a `MosaicTiles.out` wins over it; unset, the forward writes its rows and the
    backward's kernels their tiles (`DEFAULT_OUT`, as measured)."""
    monkeypatch.delenv("HSTU_MOSAIC_OUT", raising=False)
    got = [_mosaic.output_mode(MosaicTiles(), k) for k in _mosaic.KINDS]
    assert got == ["rows", "tiles", "tiles"]
    monkeypatch.setenv("HSTU_MOSAIC_OUT", "tiles")
    assert {_mosaic.output_mode(MosaicTiles(), k) for k in _mosaic.KINDS} == {"tiles"}
    monkeypatch.setenv("HSTU_MOSAIC_OUT", "dkdv=select")
    got = [_mosaic.output_mode(MosaicTiles(), k) for k in _mosaic.KINDS]
    assert got == ["rows", "tiles", "select"]
    monkeypatch.setenv("HSTU_MOSAIC_OUT", "fwd=tiles,dq=rows")
    got = [_mosaic.output_mode(MosaicTiles(), k) for k in _mosaic.KINDS]
    assert got == ["tiles", "rows", "tiles"]
    assert _mosaic.output_mode(MosaicTiles(out="select"), "fwd") == "select"


def test_meta_mode_defaults_to_the_kernel(monkeypatch):
    """`$HSTU_MOSAIC_META`: the work table from the Pallas kernel unless it says xla; anything
    else is named."""
    monkeypatch.delenv("HSTU_MOSAIC_META", raising=False)
    assert _mosaic.meta_mode() == "kernel"
    monkeypatch.setenv("HSTU_MOSAIC_META", "xla")
    assert _mosaic.meta_mode() == "xla"
    monkeypatch.setenv("HSTU_MOSAIC_META", "triton")
    with pytest.raises(ValueError, match="HSTU_MOSAIC_META: expected xla or kernel, got 'triton'"):
        _mosaic.meta_mode()


def _kernel_outputs(kind: str, q, k, v, do, offs, kw, tiles) -> tuple:
    """One kernel's outputs (interpreted), as a tuple."""
    kw = dict(kw)
    ctx, cand = kw.pop("num_contextual"), kw.pop("num_candidates")
    if kind == "fwd":
        return (_mosaic.forward(q, k, v, offs, ctx, cand, **kw, tiles=tiles, interpret=True),)
    fn = _mosaic.backward_dq if kind == "dq" else _mosaic.backward_dkdv
    out = fn(q, k, v, do, offs, ctx, cand, **kw, tiles=tiles, interpret=True)
    return out if kind == "dkdv" else (out,)


@needs_mosaic
@needs_threads
@pytest.mark.parametrize(
    ("dqk", "dv", "block_kv", "pad", "meta"),
    [(64, 64, None, 11, "kernel"), (64, 128, 32, 600, "xla"), (256, 128, None, 11, "kernel")],
)
def test_outputs_written_at_their_rows_equal_the_gathered_tiles(
    dqk, dv, block_kv, pad, meta, monkeypatch
):
    """`MosaicTiles(out="rows")`: each CTA writes its tile's 8-row chunks at their rows, the
    chunks two samples share go through the side slots, and the tail CTAs zero the rows past
    the batch (600 of them: more blocks than tail CTAs); the same bits as the tiles gathered
    back (`out="tiles"`), in every kernel. The interpreter fills memory nobody wrote with NaN,
    so a row that no CTA and no side slot placed would show. The rows mode's work table from
    `meta` (`HSTU_MOSAIC_META`), the tiles mode's from XLA."""
    q, k, v, offs, kw = _inputs(dqk, dv, pad=pad, seed=dqk + 1)
    do = jnp.asarray(np.random.default_rng(3).standard_normal(v.shape), jnp.bfloat16)
    real = int(offs[-1])
    for kind in _mosaic.KINDS:
        base = _mosaic.default_tiles(kind, dqk, dv)
        if block_kv is not None:
            base = MosaicTiles(block_kv=block_kv, stages=3)
        outs = {}
        for mode in _mosaic.OUTS:
            monkeypatch.setenv("HSTU_MOSAIC_META", meta if mode != "tiles" else "xla")
            outs[mode] = _kernel_outputs(kind, q, k, v, do, offs, kw, replace(base, out=mode))
        for mode in ("rows", "select"):
            for got, want in zip(outs[mode], outs["tiles"], strict=True):
                got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
                assert got.shape == want.shape == (q.shape[0], q.shape[1], got.shape[2])
                assert not np.isnan(got).any(), (kind, mode)
                assert np.array_equal(got, want), (kind, mode)
                assert not np.any(got[real:]), (kind, mode)


def test_side_rows_place_each_shared_chunk_row_of_its_own_sample():
    """`_side_rows`: slot rows go to the rows of their own sample only, every row of a chunk
    that a sample shares (its first where it starts or ends inside it, its last where it ends
    mid-chunk) has a slot, and the chunks wholly a sample's have none."""
    lens = np.array([37, 0, 1, 73, 64, 130, 9, 8, 16, 3], np.int32)
    offs = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
    dead = offs[:-1] % 8
    t_pad = 400
    dst = np.asarray(_mosaic._side_rows(jnp.asarray(offs), jnp.asarray(dead), t_pad))
    placed = dst[dst < t_pad]
    assert len(set(placed.tolist())) == len(placed)  # no row placed twice
    want = set()
    for b, (lo, hi) in enumerate(zip(offs[:-1], offs[1:], strict=True)):
        slots = dst[16 * b : 16 * b + 16]
        assert all(lo <= r < hi for r in slots if r < t_pad), b
        for a in range(lo - lo % 8, hi, 8):  # the chunks holding the sample's rows
            if a < lo or a + 8 > hi:
                want |= set(range(max(a, lo), min(a + 8, hi)))
    assert set(placed.tolist()) == want


def _meta_tables(offs, ctx, cand, block: int, max_seqlen: int, t_cap: int, key_major: bool):
    """(the jnp schedule's work table, the meta kernel's (interpreted)) of one call."""
    from hstu_kernels.schedule import pairs, schedule

    bsz = offs.shape[0] - 1
    frame_seqlen = max_seqlen + 7
    num = pairs(t_cap + 7 * bsz, bsz, frame_seqlen, block)
    lens = offs[1:] - offs[:-1]
    seen = jnp.where(lens > 0, lens + offs[:-1] % 8, 0)
    frame = jnp.concatenate([jnp.zeros((1,), jnp.int32), jnp.cumsum(seen)])
    sched = schedule(jnp, frame, frame_seqlen, num, block, key_major=key_major)
    want = _mosaic._meta_from_schedule(offs, ctx, cand, *sched)
    args = (offs, ctx, cand, block, frame_seqlen, num, key_major)
    return np.asarray(want), np.asarray(_mosaic._meta_table(*args, True)), args


@pytest.mark.parametrize(("block", "key_major"), [(128, False), (64, True)])
def test_meta_kernel_builds_the_schedules_table(block, key_major):
    """`HSTU_MOSAIC_META=kernel`: one Pallas kernel builds the table of the CTAs' work that the
    jnp schedule builds in some ten small XLA kernels, entry for entry: on the tests' jagged
    batch (empty and one-token samples, one program of entries, with and without contextual
    and candidate counts) and a bench_upstream-like batch (32 Zipf samples up to 4,100 tokens,
    several programs)."""
    q, _, _, offs, kw = _inputs(64, 64)
    ctx, cand = kw["num_contextual"], kw["num_candidates"]
    for c, k in ((ctx, cand), (None, None), (ctx, None)):
        want, got, _ = _meta_tables(offs, c, k, block, kw["max_seqlen"], q.shape[0], key_major)
        assert want.shape == got.shape and np.array_equal(got, want)
    rng = np.random.default_rng(block)
    lens = np.minimum(16 + 2 * rng.zipf(1.2, 32), 4100)
    lens[3] = 0
    offs = jnp.asarray(np.concatenate([[0], np.cumsum(lens)]), jnp.int32)
    cand = jnp.asarray(rng.integers(8, 65, 32), jnp.int32)
    t_cap = -(-int(lens.sum()) // 256) * 256
    want, got, args = _meta_tables(
        offs, jnp.full((32,), 4, jnp.int32), cand, block, 4160, t_cap, key_major
    )
    assert want.shape[1] > _mosaic._META_ENTRIES and np.array_equal(got, want)
    # compiled: Triton's lowering takes the kernel (jax 0.11 lowers Pallas-Triton calls only
    # with a GPU present)
    try:
        text = (
            jax.jit(lambda o, c, k: _mosaic._meta_table(o, c, k, *args[3:], False))
            .trace(*args[:3])
            .lower(lowering_platforms=("cuda",))
            .as_text()
        )
    except RuntimeError as exc:
        if "No supported GPU devices" not in str(exc):
            raise
    else:
        assert "mosaic_meta" in text


def test_bad_lowering_choices_are_named():
    q, k, v, offs, kw = _inputs(64, 64)
    with pytest.raises(ValueError, match="lowering: expected one of"):
        hstu_attention(q, k, v, offs, **kw, lowering="cutlass", interpret=True)
    rab = jnp.zeros((2, 8), jnp.float32)
    with pytest.raises(ValueError, match="Mosaic GPU kernels cannot run this call: relative"):
        hstu_attention(q, k, v, offs, **kw, rab_pos=rab, lowering="mosaic", interpret=True)
    f32 = [x.astype(jnp.float32) for x in (q, k, v)]
    with pytest.raises(ValueError, match="Mosaic GPU kernels cannot run this call: dtype"):
        hstu_attention(*f32, offs, **kw, lowering="mosaic", interpret=True)
    with pytest.raises(ValueError, match="MosaicTiles.block_kv"):
        MosaicTiles(block_kv=48)
    with pytest.raises(ValueError, match="MosaicTiles.lead"):
        MosaicTiles(lead=-1)
    with pytest.raises(ValueError, match="MosaicTiles.out"):
        MosaicTiles(out="scatter")


@pytest.mark.parametrize("lead", [0, 1, 5, 7, 30])
def test_launch_order_takes_every_entry_and_head_once(lead):
    """CTA i of the launch (dispatched in turn) works on `_entry_and_head(i)`: the first `lead`
    schedule entries with their heads together, then the rest head by head."""
    num, heads = 7, 4
    cta = jnp.arange(num * heads, dtype=jnp.int32)
    entry, head = (np.asarray(x) for x in _mosaic._entry_and_head(cta, num, heads, lead))
    assert sorted(zip(entry.tolist(), head.tolist())) == [
        (e, h) for e in range(num) for h in range(heads)
    ]
    front = min(lead, num) * heads
    # the lead entries first, each with its heads in a row
    assert entry[:front].tolist() == [e for e in range(min(lead, num)) for _ in range(heads)]
    assert head[:front].tolist() == list(range(heads)) * min(lead, num)
    # then head by head, each head's entries heaviest (lowest) first
    rest = [(h, e) for h in range(heads) for e in range(min(lead, num), num)]
    assert list(zip(head[front:].tolist(), entry[front:].tolist())) == rest


def test_supports_names_each_limit():
    assert "relative biases" in _mosaic.supports(jnp.bfloat16, 64, 64, True, DEFAULT)
    assert "dtype float32" in _mosaic.supports(jnp.float32, 64, 64, False, DEFAULT)
    assert "Dv=320" in _mosaic.supports(jnp.bfloat16, 64, 320, False, DEFAULT)
    big = MosaicTiles(block_kv=128, stages=4)
    assert "fwd tiles" in _mosaic.supports(jnp.bfloat16, 256, 256, False, (big, DEFAULT[1]))
    # dq at head dim 256 holds a dO tile too: 64-row key tiles overflow, 32-row ones fit in
    # three stages (the default there, as swept), not four
    assert "dq tiles" in _mosaic.supports(jnp.bfloat16, 256, 256, False, DEFAULT)
    assert _mosaic.default_tiles("dq", 256, 256) == MosaicTiles(block_kv=32, stages=3)
    four = (DEFAULT[0], MosaicTiles(block_kv=32, stages=4))
    assert "dq tiles" in _mosaic.supports(jnp.bfloat16, 256, 256, False, four)
    assert _mosaic.default_tiles("dq", 128, 128) == MosaicTiles()
    assert _mosaic.default_tiles("fwd", 256, 256) == MosaicTiles()
    # dk / dv: the CTA's key and value tiles plus the query / dO slots; a pair of tiles takes
    # the default dk / dv tiles
    ok = (MosaicTiles(), MosaicTiles(block_kv=32))
    assert _mosaic.default_tiles("dkdv", 256, 256) == MosaicTiles()
    assert _mosaic.full_tiles(ok, 256, 256) == (*ok, MosaicTiles())
    why = _mosaic.supports(jnp.bfloat16, 256, 256, False, ok)  # None, or this jax's version
    assert why is None or "tiles" not in why, why
    wide = (*ok, MosaicTiles(block_kv=128))
    assert "dkdv tiles" in _mosaic.supports(jnp.bfloat16, 256, 256, False, wide)
    with pytest.raises(ValueError, match="one per kernel"):
        _mosaic.full_tiles(ok[:1], 256, 256)


@pytest.mark.gpu
@needs_mosaic
@pytest.mark.parametrize("dim", [64, 128, 256])
def test_compiled_kernels_match_the_reference(dim):
    tiles = tuple(_mosaic.default_tiles(kind, dim, dim) for kind in _mosaic.KINDS)
    if mosaic_problem(jnp.bfloat16, dim, dim, False, tiles, False):
        pytest.skip("needs a Hopper GPU")
    rng = np.random.default_rng(dim)
    lens = rng.integers(1, 3000, 12)
    offs = jnp.asarray(np.concatenate([[0], np.cumsum(lens)]), jnp.int32)
    t_cap = int(offs[-1]) + 100
    q, k, v, g = (jnp.asarray(rng.standard_normal((t_cap, 4, dim)), jnp.bfloat16) for _ in range(4))
    kw = dict(
        max_seqlen=3000,
        alpha=1.0 / np.sqrt(dim),
        normalizer=3000.0,
        num_contextual=jnp.asarray(rng.integers(0, 6, 12), jnp.int32),
        num_candidates=jnp.asarray(rng.integers(0, 65, 12), jnp.int32),
    )

    def run(fn):
        out, vjp = jax.vjp(fn, q, k, v)
        return out, vjp(g.astype(out.dtype))

    # alpha, max_seqlen and normalizer are static: bound here, not passed through the jit
    out, grads = run(
        jax.jit(lambda q, k, v: hstu_attention(q, k, v, offs, **kw, lowering="mosaic"))
    )
    want, want_grads = run(lambda q, k, v: _reference(q, k, v, offs, **kw))
    assert _rel_err(out, want) < 1e-2
    for name, got, ref in zip("qkv", grads, want_grads, strict=True):
        assert _rel_err(got, ref) < 2e-2, name


@pytest.mark.gpu
@needs_mosaic
@pytest.mark.parametrize("dim", [64, 128, 256])
@pytest.mark.parametrize("whole", [True, False], ids=["T-whole-tiles", "T-padded"])
@pytest.mark.parametrize(
    ("out", "meta"),
    [("", ""), ("tiles", "xla"), ("rows", "xla"), ("rows", "kernel")],
    ids=lambda v: v or "default",
)
def test_compiled_kernels_match_the_triton_lowering(dim, whole, out, meta, monkeypatch):
    """The training case, compiled: 32 samples of bench_upstream-like lengths, most starting off
    a multiple of 8 rows, read in place (with T whole 8-row tiles nothing is copied), against the
    Triton lowering's kernels (themselves held to the reference), sample by sample. Fast where
    the dense reference is not at head dim 256 and 40K tokens. The output modes and work
    tables: the defaults (empty variables), and each named."""
    tiles = tuple(_mosaic.default_tiles(kind, dim, dim) for kind in _mosaic.KINDS)
    if mosaic_problem(jnp.bfloat16, dim, dim, False, tiles, False):
        pytest.skip("needs a Hopper GPU")
    monkeypatch.setenv("HSTU_MOSAIC_OUT", out)
    monkeypatch.setenv("HSTU_MOSAIC_META", meta)
    rng = np.random.default_rng(dim + whole)
    lens = np.minimum(16 + 2 * rng.zipf(1.2, 32), 4100)
    lens[3], lens[7] = 0, 1  # an empty and a one-token sample
    offs_np = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
    real = int(offs_np[-1])
    assert np.count_nonzero(offs_np[1:-1] % 8) > 16
    t_cap = -(-real // 256) * 256 if whole else real + 13
    q, k, v, g = (
        jnp.asarray(rng.standard_normal((t_cap, 4, dim)) * 0.5, jnp.bfloat16) for _ in range(4)
    )
    kw = dict(
        max_seqlen=4160,
        alpha=1.0 / np.sqrt(dim),
        normalizer=4096.0,
        num_contextual=jnp.full((32,), 4, jnp.int32),
        num_candidates=jnp.asarray(rng.integers(8, 65, 32), jnp.int32),
    )
    offs = jnp.asarray(offs_np)

    def run(lowering):
        f = jax.jit(lambda q, k, v: hstu_attention(q, k, v, offs, **kw, lowering=lowering))
        out, vjp = jax.vjp(f, q, k, v)
        return [np.asarray(x, np.float32) for x in (out, *vjp(g))]

    for got, want, name in zip(run("mosaic"), run("triton"), ("out", *"qkv"), strict=True):
        scale = np.abs(want[:real]).max()
        for i in np.nonzero(lens)[0]:
            rows = slice(offs_np[i], offs_np[i + 1])
            err = np.abs(got[rows] - want[rows]).max() / scale
            assert err < 1e-2, (name, i, int(offs_np[i]), err)
        assert not np.any(got[real:]), name  # capacity padding: 0


@needs_mosaic
@needs_threads
def test_bench_attention_runs_the_mosaic_lowering():
    """`hstu bench attention --backend jax --lowerings mosaic`: its runner passes the lowering
    to the kernel and checks it against the reference before any timing."""
    from hstu.bench.attention import Case, verdict
    from hstu.jax_backend.bench_attention import Runner

    runner = Runner(lowering="mosaic")
    assert runner.kernel == "mosaic" and runner.problem((64,), "bf16", rab=False) is None
    assert "relative biases" in runner.problem((64,), "bf16", rab=True)
    case = Case(2, 48, 64, 1, "bf16", "zipf", (48, 21))
    result = verdict(runner.check(case), "bf16")
    assert result["ok"], result
    assert set(result["errors"]) == {"out", "dq", "dk", "dv"}
