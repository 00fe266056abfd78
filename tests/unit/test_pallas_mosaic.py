"""The Mosaic GPU forward of the Pallas HSTU attention (``kernels/pallas/_mosaic.py``).

* interpret mode (Mosaic GPU's own CPU interpreter, which simulates the warp groups, the
  barriers and the TMA copies): forward against the jnp reference on jagged batches with
  contextual and candidate tokens, empty and one-token samples, samples not starting on a
  multiple of 8 rows and capacity padding; gradients through ``forward="mosaic"`` equal
  those through the Triton-lowering forward (the backward is shared);
* the compiled path is lowered for CUDA on this machine (no GPU needed): it must produce a
  Mosaic GPU kernel for each head dim, the recipe's 256 included;
* ``-m gpu``: compiled on a Hopper GPU against the reference at the recipe's shapes.

The kernel is written for jax >= 0.11 (the GPU image's 0.11.2); with jax 0.10 these tests
skip with that reason, and ``make test-mosaic`` runs them in a Python 3.12 environment
with jax 0.11.2. The interpreter runs each warp group as a host thread blocking in XLA
callbacks: it needs at least 4 host devices' threads (``make test-mosaic`` sets them).
"""

from __future__ import annotations

import numpy as np
import pytest

jax = pytest.importorskip("jax")
jnp = pytest.importorskip("jax.numpy")

from hstu_kernels.pallas import (  # noqa: E402
    MosaicTiles,
    _mosaic,  # noqa: E402
    hstu_attention,
    hstu_attention_reference,
    mosaic_forward_problem,
)

_WHY = mosaic_forward_problem(jnp.bfloat16, 64, 64, False, MosaicTiles(), interpret=True)
needs_mosaic = pytest.mark.skipif(_WHY is not None, reason=f"Mosaic GPU forward: {_WHY}")
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


def _reference(q, k, v, offs, kw):
    f32 = [x.astype(jnp.float32) for x in (q, k, v)]
    return hstu_attention_reference(*f32, offs, **kw)


@needs_mosaic
@needs_threads
@pytest.mark.parametrize(
    ("dqk", "dv", "tiles"),
    [
        (64, 64, MosaicTiles()),
        (32, 48, MosaicTiles(block_kv=128, stages=3)),  # padded to 64; wider key tiles
        (256, 128, MosaicTiles()),
    ],
)
def test_forward_matches_reference(dqk, dv, tiles):
    q, k, v, offs, kw = _inputs(dqk, dv)
    out = hstu_attention(q, k, v, offs, **kw, forward="mosaic", mosaic_tiles=tiles, interpret=True)
    want = _reference(q, k, v, offs, kw)
    assert out.shape == want.shape and out.dtype == q.dtype
    assert _rel_err(out, want) < 1e-2
    # capacity padding rows are zero
    assert not np.any(np.asarray(out[int(offs[-1]) :], np.float32))


@needs_mosaic
@needs_threads
def test_gradients_equal_the_triton_forward_path():
    q, k, v, offs, kw = _inputs(64, 64, heads=1, seed=3)
    cot = jnp.asarray(np.random.default_rng(4).standard_normal(v.shape), jnp.float32)

    def loss(forward):
        def f(q, k, v):
            out = hstu_attention(q, k, v, offs, **kw, forward=forward, interpret=True)
            return jnp.sum(out.astype(jnp.float32) * cot)

        return jax.value_and_grad(f, argnums=(0, 1, 2))(q, k, v)

    (lm, gm), (lt, gt) = loss("mosaic"), loss("triton")
    assert abs(float(lm) - float(lt)) <= 1e-2 * max(abs(float(lt)), 1.0)
    for a, b in zip(gm, gt, strict=True):  # the same backward kernels on the same inputs
        np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))


@needs_mosaic
@pytest.mark.parametrize(("dqk", "dv"), [(64, 64), (128, 128), (256, 256), (128, 256), (256, 128)])
def test_the_compiled_kernel_lowers_for_cuda(dqk, dv):
    q, k, v, offs, kw = _inputs(dqk, dv, heads=4)
    ctx, cand = kw.pop("num_contextual"), kw.pop("num_candidates")

    def f(q, k, v, offs, ctx, cand):
        return _mosaic.forward(q, k, v, offs, ctx, cand, **kw, tiles=MosaicTiles(), interpret=False)

    text = jax.jit(f).trace(q, k, v, offs, ctx, cand).lower(lowering_platforms=("cuda",))
    assert "mosaic_gpu" in text.as_text()


def test_bad_forward_choices_are_named():
    q, k, v, offs, kw = _inputs(64, 64)
    with pytest.raises(ValueError, match="forward: expected one of"):
        hstu_attention(q, k, v, offs, **kw, forward="cutlass", interpret=True)
    rab = jnp.zeros((2, 8), jnp.float32)
    with pytest.raises(ValueError, match="Mosaic GPU forward cannot run"):
        hstu_attention(q, k, v, offs, **kw, rab_pos=rab, forward="mosaic", interpret=True)
    f32 = [x.astype(jnp.float32) for x in (q, k, v)]
    with pytest.raises(ValueError, match="Mosaic GPU forward cannot run"):
        hstu_attention(*f32, offs, **kw, forward="mosaic", interpret=True)
    with pytest.raises(ValueError, match="MosaicTiles.block_kv"):
        MosaicTiles(block_kv=96)


def test_supports_names_each_limit():
    tiles = MosaicTiles()
    assert "relative biases" in _mosaic.supports(jnp.bfloat16, 64, 64, True, tiles)
    assert "dtype float32" in _mosaic.supports(jnp.float32, 64, 64, False, tiles)
    assert "Dv=320" in _mosaic.supports(jnp.bfloat16, 64, 320, False, tiles)
    big = MosaicTiles(block_kv=128, stages=4)
    assert "shared memory" in _mosaic.supports(jnp.bfloat16, 256, 256, False, big)


@pytest.mark.gpu
@needs_mosaic
@pytest.mark.parametrize("dim", [64, 128, 256])
def test_compiled_forward_matches_reference(dim):
    if mosaic_forward_problem(jnp.bfloat16, dim, dim, False, MosaicTiles(), False):
        pytest.skip("needs a Hopper GPU")
    rng = np.random.default_rng(dim)
    lens = rng.integers(1, 3000, 12)
    offs = jnp.asarray(np.concatenate([[0], np.cumsum(lens)]), jnp.int32)
    t_cap = int(offs[-1]) + 100
    q, k, v = (jnp.asarray(rng.standard_normal((t_cap, 4, dim)), jnp.bfloat16) for _ in range(3))
    kw = dict(
        max_seqlen=3000,
        alpha=1.0 / np.sqrt(dim),
        normalizer=3000.0,
        num_contextual=jnp.asarray(rng.integers(0, 6, 12), jnp.int32),
        num_candidates=jnp.asarray(rng.integers(0, 65, 12), jnp.int32),
    )
    out = hstu_attention(q, k, v, offs, **kw, forward="mosaic")
    assert _rel_err(out, _reference(q, k, v, offs, kw)) < 1e-2
