"""SiLU's backward with the bias gradient in one Pallas kernel (``kernels/pallas/silu_bwd.py``)
against its jnp reference, in the Pallas interpreter (on a GPU the model's tests compile it
through ``scripts/gpu_check.sh``)."""

from __future__ import annotations

import numpy as np
import pytest

jax = pytest.importorskip("jax")
jnp = pytest.importorskip("jax.numpy")

from hstu_kernels.pallas.silu_bwd import (  # noqa: E402
    ROWS_PER_PROGRAM,
    silu_backward,
    silu_backward_reference,
    supports,
)


def _inputs(rows, widths, dtype=jnp.bfloat16, seed=0):
    rng = np.random.default_rng(seed)
    pre = jnp.asarray(rng.standard_normal((rows, sum(widths))) * 3, dtype)
    grads = [jnp.asarray(rng.standard_normal((rows, w)), dtype) for w in widths]
    return grads, pre


@pytest.mark.parametrize(
    ("rows", "widths", "dtype"),
    [
        (300, (64, 64, 128, 64), jnp.bfloat16),  # rows past the last program's: masked
        (2 * ROWS_PER_PROGRAM, (128,), jnp.float32),
        (5, (64, 64), jnp.bfloat16),  # fewer rows than a slice
    ],
)
def test_matches_the_reference(rows, widths, dtype):
    grads, pre = _inputs(rows, widths, dtype, seed=rows)
    dpre, dbias = silu_backward(grads, pre, interpret=True)
    want, want_bias = silu_backward_reference(grads, pre)
    assert dpre.dtype == pre.dtype and dbias.dtype == jnp.float32
    # the same fp32 arithmetic, rounded once into pre's dtype
    np.testing.assert_allclose(
        np.asarray(dpre, np.float32), np.asarray(want, np.float32), rtol=1e-6, atol=1e-6
    )
    # fp32 column sums of the unrounded gradient, in another order
    np.testing.assert_allclose(np.asarray(dbias), np.asarray(want_bias), rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_the_bias_is_added_in_the_kernel_as_the_forward_adds_it(dtype):
    """With `bias`, `pre` is the GEMM's output z and the kernel forms z + b rounded to z's
    dtype: the same dpre as the kernel given that rounded sum, bit for bit."""
    grads, z = _inputs(300, (64, 128), dtype, seed=3)
    bias = jnp.asarray(np.random.default_rng(4).standard_normal(192) * 2, jnp.float32)
    pre = (z.astype(jnp.float32) + bias.astype(dtype).astype(jnp.float32)).astype(dtype)
    dpre, dbias = silu_backward(grads, z, bias.astype(dtype), interpret=True)
    want, want_bias = silu_backward(grads, pre, interpret=True)
    np.testing.assert_array_equal(np.asarray(dpre, np.float32), np.asarray(want, np.float32))
    np.testing.assert_array_equal(np.asarray(dbias), np.asarray(want_bias))
    ref, _ = silu_backward_reference(grads, z, bias.astype(dtype))  # its own sigmoid: rounding
    np.testing.assert_allclose(
        np.asarray(ref, np.float32), np.asarray(want, np.float32), rtol=1e-5, atol=1e-6
    )
    assert (
        float(
            np.abs(
                np.asarray(dpre, np.float32)
                - np.asarray(silu_backward(grads, z, interpret=True)[0], np.float32)
            ).max()
        )
        > 0
    )  # the bias counts
    with pytest.raises(ValueError, match=r"bias of shape \(5,\) for 192 columns"):
        silu_backward(grads, z, bias[:5], interpret=True)


def test_padding_rows_add_nothing_and_sum_in_the_same_groups():
    """Rows of zero gradient after the real ones (a capacity's padding) leave dpre's real rows
    and the bias gradient bit for bit as without them: the rows per program are fixed."""
    grads, pre = _inputs(200, (64, 64), seed=1)
    pad = 3 * ROWS_PER_PROGRAM
    padded = [jnp.pad(g, ((0, pad), (0, 0))) for g in grads]
    pre_padded = jnp.pad(pre, ((0, pad), (0, 0)), constant_values=1.5)
    dpre, dbias = silu_backward(grads, pre, interpret=True)
    dpre_p, dbias_p = silu_backward(padded, pre_padded, interpret=True)
    np.testing.assert_array_equal(np.asarray(dpre_p[:200]), np.asarray(dpre))
    assert not np.any(np.asarray(dpre_p[200:], np.float32))
    np.testing.assert_array_equal(np.asarray(dbias_p), np.asarray(dbias))


def test_bad_shapes_are_named():
    grads, pre = _inputs(10, (64, 64))
    with pytest.raises(ValueError, match=r"column blocks \(64, 64\) for 192 columns"):
        silu_backward(grads, jnp.concatenate([pre, pre[:, :64]], axis=1), interpret=True)
    with pytest.raises(ValueError, match="each a positive multiple of 64"):
        silu_backward([pre[:, :96], pre[:, 96:]], pre, interpret=True)
    with pytest.raises(ValueError, match="row counts"):
        silu_backward([grads[0], grads[1][:5]], pre, interpret=True)
    assert supports((1024,) * 4, 12288) is None
    assert "int32 offsets" in supports((1024,) * 4, 2**20)
    assert "empty grid" in supports((64,), 0)
    with pytest.raises(ValueError, match="0 rows"):
        silu_backward([pre[:0, :64]], pre[:0, :64], interpret=True)


@pytest.mark.gpu
def test_compiled_matches_the_reference():
    """Compiled on the GPU (Triton lowering), at bench_upstream's layer: 4 column blocks of
    1,024, a capacity of 11,264 rows with the last 500 padding."""
    if jax.default_backend() != "gpu":
        pytest.skip("needs a GPU")
    grads, pre = _inputs(11264, (1024,) * 4, seed=7)
    grads = [g.at[-500:].set(0) for g in grads]
    bias = jnp.asarray(np.random.default_rng(8).standard_normal(4096), jnp.bfloat16)
    dpre, dbias = jax.jit(silu_backward)(grads, pre, bias)
    want, want_bias = silu_backward_reference(grads, pre, bias)
    np.testing.assert_allclose(
        np.asarray(dpre, np.float32), np.asarray(want, np.float32), rtol=1e-2, atol=1e-2
    )
    np.testing.assert_allclose(np.asarray(dbias), np.asarray(want_bias), rtol=1e-4, atol=1e-2)
    assert not np.any(np.asarray(dpre[-500:], np.float32))


def test_the_tile_sweep_checks_each_tiling_and_names_the_best():
    """``scripts/silu_tiles.py`` (what ``gpu_check.sh silu`` reads its tiles from), in the
    interpreter at a small size: every tiling checked, the fastest printed as BEST_TILES."""
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    args = ["--interpret", "--tokens", "64", "--rows", "64", "--block-r", "16", "32"]
    args += ["--block-n", "256", "--warps", "4", "--calls", "1", "--rounds", "1"]
    out = subprocess.run(
        [sys.executable, str(root / "scripts" / "silu_tiles.py"), *args],
        capture_output=True,
        text=True,
        cwd=root,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert "failed" not in out.stdout, out.stdout
    best = [line for line in out.stdout.splitlines() if line.startswith("BEST_TILES=")]
    assert len(best) == 1, out.stdout
    tiles = tuple(int(v) for v in best[0].split("=")[1].split(","))
    default = _module_tiles()
    assert tiles in {(64, 16, 256, 4), (64, 32, 256, 4), default}


def _module_tiles():
    from hstu_kernels.pallas import silu_bwd

    return silu_bwd.ROWS_PER_PROGRAM, silu_bwd.BLOCK_R, silu_bwd.BLOCK_N, silu_bwd.WARPS
