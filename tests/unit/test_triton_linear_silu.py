"""`silu(x @ weight + bias)` with the fused SiLU / bias-gradient backward
(`hstu_kernels.triton.linear_silu`) against plain torch in float64: the output and the input,
weight and bias gradients in fp32 and bf16, token counts that are not a multiple of the rows
per program, widths that are not powers of two and more than one column block, only the
gradients asked for, zero padding rows (the bias gradient bit for bit) and bad inputs.
CPU: the Triton interpreter on small shapes; GPU (`gpu`): the compiled kernels on the
benchmark's shape."""

from __future__ import annotations

import os

import pytest

torch = pytest.importorskip("torch")
_CUDA = torch.cuda.is_available()
if not _CUDA:
    os.environ["TRITON_INTERPRET"] = "1"  # before any kernel is decorated
pytest.importorskip("triton")

from hstu_kernels.triton.linear_silu import (  # noqa: E402
    ROWS_PER_PROGRAM,
    _tiles,
    linear_silu,
    linear_silu_reference,
)

DEVICE = "cuda" if _CUDA else "cpu"


def _inputs(t: int, d_in: int, d_out: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(t, d_in, generator=g)
    w = torch.randn(d_in, d_out, generator=g) / d_in**0.5
    b = torch.randn(d_out, generator=g) * 0.5
    dy = torch.randn(t, d_out, generator=g)
    return x, w, b, dy


def _run(fn, x, w, b, dy):
    x, w, b = (a.clone().requires_grad_() for a in (x, w, b))
    y = fn(x, w, b)
    y.backward(dy)
    return y, x.grad, w.grad, b.grad


def _check(t: int, d_in: int, d_out: int, dtype, device: str, seed: int = 0):
    x, w, b, dy = _inputs(t, d_in, d_out, seed)
    got = _run(linear_silu, x.to(device, dtype), w.to(device), b.to(device), dy.to(device, dtype))
    want = _run(linear_silu_reference, *(a.double() for a in (x, w, b, dy)))
    y, dx, dw, db = got
    assert y.dtype == dtype and dx.dtype == dtype  # the compute dtype
    assert dw.dtype == torch.float32 and db.dtype == torch.float32  # the parameters'
    # fp32: rounding only (the bias gradient is summed in fp32 from the unrounded dpre);
    # bf16: x and w rounded to bf16 on the way in, then one rounding of each stored value
    # (pre, y, dpre, dx), the matmuls accumulating in fp32 (measured: <= 7e-3; the Triton
    # interpreter rounds fp32 -> bf16 toward zero, not to nearest even as CUDA does, so the
    # kernel's bf16 dpre is up to one ulp off torch's there)
    tol = 5e-6 if dtype == torch.float32 else 2e-2
    for name, a, e in zip(["y", "dx", "dweight", "dbias"], got, want):
        a, e = a.detach().double().cpu(), e.detach()
        scale = e.abs().max().clamp_min(1e-12)
        assert float((a - e).abs().max() / scale) < tol, name
    return got


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize(
    "t,d_in,d_out",
    [(77, 40, 48), (150, 24, 200)],  # 48: one column block; 200: four (3 x 64 + 8)
    ids=["t77_out48", "t150_out200"],
)
def test_linear_silu_matches_torch(t, d_in, d_out, dtype):
    assert t % ROWS_PER_PROGRAM != 0  # a last row group with masked rows
    assert (d_out > _tiles(d_out)[1]) == (d_out == 200)  # 48: one column block, 200: several
    _check(t, d_in, d_out, dtype, DEVICE)


@pytest.mark.parametrize(
    "needs",
    [(True, False, False), (False, True, False), (False, False, True)],
    ids=["dx", "dweight", "dbias"],
)
def test_only_the_gradients_asked_for(needs):
    # each gradient alone (the kernel then skips dpre or the partials): the same numbers as
    # with all three, None for the others
    x, w, b, dy = _inputs(70, 16, 48, seed=2)
    want = _run(linear_silu, *(a.to(DEVICE) for a in (x, w, b, dy)))[1:]
    leaves = [a.to(DEVICE).requires_grad_(need) for a, need in zip((x, w, b), needs)]
    linear_silu(*leaves).backward(dy.to(DEVICE))
    for leaf, need, e in zip(leaves, needs, want):
        if need:
            assert torch.equal(leaf.grad, e)
        else:
            assert leaf.grad is None


def test_zero_padding_rows_leave_the_bias_gradient_bit_for_bit():
    # what `train.cuda_graphs` relies on: the step padded to a token capacity (150 real rows,
    # two row groups, the second partial; then 270 rows: zero inputs, zero upstream
    # gradient; the programs' row groups and the partials' sum order stay)
    t, d_in, d_out, pad = 150, 32, 96, 120
    x, w, b, dy = _inputs(t, d_in, d_out, seed=1)
    grads = []
    for rows in (t, t + pad):
        xs, dys = (torch.cat([a, a.new_zeros(rows - t, a.shape[1])]) for a in (x, dy))
        xs, ws, bs = (a.to(DEVICE).requires_grad_() for a in (xs, w, b))
        linear_silu(xs, ws, bs).backward(dys.to(DEVICE))
        grads.append((xs.grad, ws.grad, bs.grad))
    (dx, dw, db), (dx_pad, dw_pad, db_pad) = grads
    assert torch.equal(db_pad, db)  # the kernels' fixed row groups
    assert torch.equal(dx_pad[:t], dx) and bool((dx_pad[t:] == 0).all())
    # `x.T @ dpre` is torch's GEMM over the token dim: bit for bit only where the GEMM keeps
    # its summation order whatever zero rows follow, which is the library's choice (MKL's
    # fp32 GEMM here changes it past ~128 rows), so equal up to fp32 rounding
    assert float((dw_pad - dw).abs().max() / dw.abs().max()) < 1e-6


def test_the_partials_sum_in_a_fixed_order_across_tiles():
    # more row groups than one tile of the partials' sum (64), zero partials after them (the
    # padding-only programs'): the same bits, and the float64 sum up to rounding
    from hstu_kernels.triton.linear_silu import _PARTIAL_COLS, _sum_partials_kernel

    g = torch.Generator().manual_seed(3)
    p, n = 130, 40
    parts = torch.randn(p, n, generator=g)
    sums = []
    for rows in (p, p + 70):
        padded = torch.cat([parts, parts.new_zeros(rows - p, n)]).to(DEVICE)
        out = torch.empty(n, device=DEVICE)
        _sum_partials_kernel[(-(-n // _PARTIAL_COLS),)](
            padded, out, rows, n, BLOCK_P=64, BLOCK_C=_PARTIAL_COLS
        )
        sums.append(out.cpu())
    assert torch.equal(sums[0], sums[1])
    torch.testing.assert_close(sums[0].double(), parts.double().sum(0), rtol=0, atol=1e-5)


def test_no_rows():
    x, w, b = torch.zeros(0, 8), torch.randn(8, 24), torch.randn(24)
    x, w, b = (a.to(DEVICE).requires_grad_() for a in (x, w, b))
    y = linear_silu(x, w, b)
    assert y.shape == (0, 24)
    y.backward(torch.zeros_like(y))
    assert x.grad.shape == (0, 8)
    assert bool((w.grad == 0).all()) and bool((b.grad == 0).all())


@pytest.mark.parametrize(
    "shapes,match",
    [
        (((2, 3, 4), (4, 5), (5,)), r"x must be 2-D \[T, in\], got shape \(2, 3, 4\)"),
        (((3, 4), (5, 6), (6,)), r"weight must be \[in, out\] with in = x's last dim 4"),
        (((3, 4), (4, 6), (5,)), r"bias must be \[out\] with out = weight's last dim 6"),
    ],
    ids=["x_3d", "weight_in", "bias_out"],
)
def test_bad_inputs_are_errors(shapes, match):
    x, w, b = (torch.zeros(s) for s in shapes)
    with pytest.raises(ValueError, match=match):
        linear_silu(x, w, b)


def test_tensors_on_two_devices_are_an_error():
    x, w, b = torch.zeros(3, 4), torch.zeros(4, 6, device="meta"), torch.zeros(6)
    with pytest.raises(ValueError, match=r"on one device, got cpu, meta, cpu"):
        linear_silu(x, w, b)


def test_reduced_copies_give_the_casts_results():
    # the stack's bf16 copies made beforehand (`reduced`) in place of the casts in the op: the
    # same output and gradients, still the fp32 parameters'; copies of other shapes an error
    x, w, b, dy = _inputs(70, 16, 48, seed=3)
    x = x.bfloat16()
    want = _run(linear_silu, *(a.to(DEVICE) for a in (x, w, b, dy.bfloat16())))
    reduced = (w.bfloat16().to(DEVICE), b.bfloat16().to(DEVICE))
    got = _run(
        lambda *a: linear_silu(*a, reduced=reduced),
        *(a.to(DEVICE) for a in (x, w, b, dy.bfloat16())),
    )
    for a, e in zip(got, want, strict=True):
        assert torch.equal(a, e)
    assert got[2].dtype == got[3].dtype == torch.float32
    with pytest.raises(ValueError, match=r"reduced copies of shapes \(16, 48\), \(47,\)"):
        linear_silu(x, w, b, (reduced[0], reduced[1][:47]))


@pytest.mark.gpu
def test_linear_silu_on_the_benchmark_shape():
    # bench_upstream's uvqk projection: ~12K tokens, 1024 -> 4096, bf16
    _check(12_288 - 300, 1024, 4096, torch.bfloat16, "cuda")
