"""The HSTU layer's two LayerNorms as Pallas kernels (``kernels/pallas/layer_norm.py``) against
flax's LayerNorm and autodiff, in the Pallas interpreter (compiled on a GPU below, and in the
step there by default, `model.fused_norm`). `make test-mosaic` runs them too, under the
GPU image's jax (0.11.2), whose environment has no flax: there the norm's jnp statement
(`layer_norm_reference`, flax's arithmetic) stands in for it."""

from __future__ import annotations

import functools

import numpy as np
import pytest

jax = pytest.importorskip("jax")
jnp = pytest.importorskip("jax.numpy")
try:
    import flax.linen as nn
except ImportError:  # make test-mosaic's environment
    nn = None

from hstu_kernels.pallas.layer_norm import (  # noqa: E402
    ROWS_PER_PROGRAM,
    gated_norm,
    layer_norm_reference,
    norm_residual,
    supports,
)

EPS = 1e-6


def _inputs(rows, d, dtype=jnp.bfloat16, seed=0):
    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.standard_normal((rows, d)) * 2 + 0.5, dtype)
    u = jnp.asarray(rng.standard_normal((rows, d)), dtype)
    w = jnp.asarray(1 + 0.1 * rng.standard_normal(d), jnp.float32)
    b = jnp.asarray(0.1 * rng.standard_normal(d), jnp.float32)
    return x, u, w, b


def _flax(x, w, b, u=None, out_dtype=None):
    """The model's path without the kernels: flax's LayerNorm in fp32 (times the gate), then
    the cast the next GEMM makes (without flax: its jnp statement)."""
    if nn is None:
        return layer_norm_reference(x, w, b, EPS, u=u, out_dtype=out_dtype)
    ln = nn.LayerNorm(epsilon=EPS, use_fast_variance=False, dtype=jnp.float32)
    y = ln.apply({"params": {"scale": w, "bias": b}}, x)
    if u is not None:
        y = y * u
    return y.astype(out_dtype or x.dtype)


def _kernel_residual(x, w, b):
    return norm_residual(x, w, b, EPS, x.dtype, True)


def _flax_residual(x, w, b):
    return _flax(x, w, b), x


def _close(got, want, dtype):
    """Equal up to the rounding of the output dtype (the statistics are the same fp32 sums
    in another order: a last-bit difference of fp32, which can flip a bf16 rounding)."""
    got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
    ulp = 2.0**-7 if dtype == jnp.bfloat16 else 2.0**-20
    assert np.all(np.abs(got - want) <= ulp * np.abs(want) + 1e-6), np.abs(got - want).max()
    if dtype == jnp.bfloat16:
        assert np.mean(got == want) > 0.9  # nearly all the same rounded value


@pytest.mark.parametrize(
    ("rows", "d", "dtype"),
    [
        (150, 64, jnp.bfloat16),  # a last program of masked rows
        (ROWS_PER_PROGRAM * 2, 16, jnp.float32),
        (3, 128, jnp.bfloat16),  # fewer rows than a slice
    ],
)
def test_forward_is_flax_layer_norm(rows, d, dtype):
    x, u, w, b = _inputs(rows, d, dtype, seed=rows)
    y, passed = _kernel_residual(x, w, b)
    assert y.dtype == dtype and passed is x
    _close(y, _flax(x, w, b), dtype)
    _close(y, layer_norm_reference(x, w, b, EPS), dtype)
    _close(gated_norm(x, u, w, b, EPS, dtype, True), _flax(x, w, b, u), dtype)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_gradients_match_autodiff(dtype):
    """The backward's one pass against autodiff of flax's norm: fp32 to rounding, bf16 within
    one rounding of dx (the kernel rounds its fp32 dx once; autodiff rounds the sum of the
    norm's and the skip connection's gradients too). The residual's cotangent is added."""
    rows, d = 150, 64
    x, u, w, b = _inputs(rows, d, dtype, seed=2)
    rng = np.random.default_rng(3)
    cy, cx = (jnp.asarray(rng.standard_normal((rows, d)), jnp.float32) for _ in range(2))

    def residual_loss(fn):
        def loss(x, w, b):
            y, passed = fn(x, w, b)
            return jnp.sum(y.astype(jnp.float32) * cy) + jnp.sum(passed.astype(jnp.float32) * cx)

        return jax.grad(loss, argnums=(0, 1, 2))

    def gated_loss(fn):
        return jax.grad(
            lambda a, u, w, b: jnp.sum(fn(a, u, w, b).astype(jnp.float32) * cy),
            argnums=(0, 1, 2, 3),
        )

    got = residual_loss(_kernel_residual)(x, w, b)
    want = residual_loss(_flax_residual)(x, w, b)
    got += gated_loss(lambda a, u, w, b: gated_norm(a, u, w, b, EPS, dtype, True))(x, u, w, b)
    want += gated_loss(lambda a, u, w, b: _flax(a, w, b, u))(x, u, w, b)
    names = ["dx", "dscale", "dbias", "da", "du", "dscale (gated)", "dbias (gated)"]
    for name, g, ref in zip(names, got, want, strict=True):
        assert g.dtype == ref.dtype, name
        g, ref = np.asarray(g, np.float32), np.asarray(ref, np.float32)
        scale = float(np.abs(ref).max())
        tol = (
            1e-5 if dtype == jnp.float32 or name.startswith("ds") or name.startswith("db") else 1e-2
        )
        assert float(np.abs(g - ref).max()) <= tol * scale, (name, np.abs(g - ref).max(), scale)
    assert float(np.abs(np.asarray(got[0], np.float32)).max()) > 0


def test_the_xla_forward_gives_the_kernels_values(monkeypatch):
    """`HSTU_PALLAS_NORM_FORWARD=xla` (an A/B of the step): the forwards in jnp, the same
    values up to the sums' order, the backward the same kernel."""
    from hstu_kernels.pallas import layer_norm as kn

    x, u, w, b = _inputs(150, 64, seed=6)
    y = gated_norm(x, u, w, b, EPS, x.dtype, True)
    monkeypatch.setattr(kn, "FORWARD", "xla")
    _close(gated_norm(x, u, w, b, EPS, x.dtype, True), y, jnp.bfloat16)
    _close(_kernel_residual(x, w, b)[0], _flax(x, w, b), jnp.bfloat16)
    dy = jnp.ones_like(x)
    _, vjp = jax.vjp(lambda x: gated_norm(x, u, w, b, EPS, x.dtype, True), x)
    monkeypatch.setattr(kn, "FORWARD", "kernel")
    _, want = jax.vjp(lambda x: gated_norm(x, u, w, b, EPS, x.dtype, True), x)
    _close(vjp(dy)[0], want(dy)[0], jnp.bfloat16)


def test_padding_rows_add_nothing_and_sum_in_the_same_groups():
    """Zero rows with a zero upstream gradient after the real ones (a capacity's padding)
    leave the real rows' outputs and the parameters' gradients bit for bit as without them."""
    rows, d, pad = 200, 64, 3 * ROWS_PER_PROGRAM
    x, u, w, b = _inputs(rows, d, seed=4)
    dy = jnp.asarray(np.random.default_rng(5).standard_normal((rows, d)), jnp.bfloat16)

    def grads(x, u, dy):
        _, vjp = jax.vjp(lambda x, u, w, b: gated_norm(x, u, w, b, EPS, x.dtype, True), x, u, w, b)
        return vjp(dy)

    padded = [jnp.pad(t, ((0, pad), (0, 0))) for t in (x, u, dy)]
    real, with_pad = grads(x, u, dy), grads(*padded)
    for a, p in zip(real[:2], with_pad[:2], strict=True):
        np.testing.assert_array_equal(np.asarray(p[:rows]), np.asarray(a))
        assert not np.any(np.asarray(p[rows:], np.float32))
    for a, p in zip(real[2:], with_pad[2:], strict=True):
        np.testing.assert_array_equal(np.asarray(p), np.asarray(a))


def test_bad_shapes_are_named():
    x, u, w, b = _inputs(10, 64)
    with pytest.raises(ValueError, match=r"width 48 \(a power of two from 16 to 4096\)"):
        norm_residual(x[:, :48], w[:48], b[:48], EPS, x.dtype, True)
    with pytest.raises(ValueError, match=r"u of shape \(5, 64\) for rows of shape \(10, 64\)"):
        gated_norm(x, u[:5], w, b, EPS, x.dtype, True)
    with pytest.raises(ValueError, match=r"scale of shape \(32,\)"):
        norm_residual(x, w[:32], b, EPS, x.dtype, True)
    assert supports(11264, 1024) is None
    assert "empty grid" in supports(0, 64)
    assert "int32 offsets" in supports(2**21, 1024)


@pytest.mark.gpu
def test_compiled_matches_flax():
    """Compiled on the GPU (Triton lowering) at bench_upstream's layer: 11,264 rows of 1,024,
    the last 500 padding (zero, zero upstream gradient)."""
    if jax.default_backend() != "gpu":
        pytest.skip("needs a GPU")
    rows, d = 11264, 1024
    x, u, w, b = _inputs(rows, d, seed=7)
    x, u = x.at[-500:].set(0), u.at[-500:].set(0)
    dy = jnp.asarray(np.random.default_rng(8).standard_normal((rows, d)), jnp.bfloat16)
    dy = dy.at[-500:].set(0)

    @functools.partial(jax.jit, static_argnums=(0, 1))
    def run(gated, kernel):
        if gated:
            fn = (
                (lambda x, u, w, b: gated_norm(x, u, w, b, EPS, x.dtype))
                if kernel
                else (lambda x, u, w, b: _flax(x, w, b, u))
            )
            out, vjp = jax.vjp(fn, x, u, w, b)
            return (out, *vjp(dy))
        fn = (lambda x, w, b: norm_residual(x, w, b, EPS, x.dtype)) if kernel else _flax_residual
        (out, _), vjp = jax.vjp(fn, x, w, b)
        return (out, *vjp((dy, dy)))

    for gated in (True, False):
        got, want = run(gated, True), run(gated, False)
        _close(got[0], want[0], jnp.bfloat16)  # 162 of 11.5M values a rounding apart on an H200
        for g, ref in zip(got[1:], want[1:], strict=True):
            g, ref = np.asarray(g, np.float32), np.asarray(ref, np.float32)
            assert float(np.abs(g - ref).max()) <= 2e-2 * float(np.abs(ref).max())
        assert not np.any(np.asarray(got[1][-500:], np.float32))
