"""The fused Triton LayerNorm (`model.fused_norm`) against plain torch in float64: outputs and
every gradient (input, weight, bias, gate), with and without the gate, a gate that is a strided
view (HSTU's `u`, a slice of the uvqk projection), widths that are and are not powers of two,
and zero padding rows; the residual add with the norm (`add_layer_norm`) the same way. CPU:
the Triton interpreter on small shapes; GPU (`gpu`): the compiled kernel on the recipe's
shapes, and the HSTU model with and without it."""

from __future__ import annotations

import os

import numpy as np
import pytest

torch = pytest.importorskip("torch")
_CUDA = torch.cuda.is_available()
if not _CUDA:
    os.environ["TRITON_INTERPRET"] = "1"  # before any kernel is decorated
pytest.importorskip("triton")

from hstu_kernels.triton.layer_norm import (  # noqa: E402
    add_layer_norm,
    add_layer_norm_reference,
    layer_norm,
    layer_norm_reference,
)

EPS = 1e-6


def _check(t: int, d: int, dtype, gated: bool, device: str, pad_rows: int = 0, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(t, d, generator=g) * 2 + 0.5
    x[t - pad_rows :] = 0.0  # a token capacity's padding: zero rows, zero upstream gradient
    uvqk = torch.randn(t, 3 * d, generator=g)  # the gate is the middle third: a strided view
    w = torch.randn(d, generator=g) * 0.3 + 1
    b = torch.randn(d, generator=g) * 0.1
    dy = torch.randn(t, d, generator=g)
    dy[t - pad_rows :] = 0.0

    def run(x, uvqk, w, b, dy, fn):
        x, uvqk, w, b = (a.clone().requires_grad_() for a in (x, uvqk, w, b))
        y = fn(x, w, b, EPS, uvqk[:, d : 2 * d] if gated else None)
        y.backward(dy)
        return [y, x.grad, w.grad, b.grad] + ([uvqk.grad] if gated else [])

    got = run(*(a.to(device, dtype) for a in (x, uvqk)), w.to(device), b.to(device),
              dy.to(device, dtype), layer_norm)  # fmt: skip
    want = run(*(a.double() for a in (x, uvqk, w, b, dy)), layer_norm_reference)
    assert got[0].dtype == dtype and got[2].dtype == torch.float32  # weight grads in fp32
    # fp32: rounding only; bf16: one rounding of each stored value (the kernel rounds once
    # where eager torch rounds the norm and then the product)
    tol = 2e-5 if dtype == torch.float32 else 1e-2
    names = ["y", "dx", "dweight", "dbias", "dgate"]
    for name, a, e in zip(names, got, want):
        a, e = a.detach().double().cpu(), e.detach()
        scale = e.abs().max().clamp_min(1e-12)
        assert float((a - e).abs().max() / scale) < tol, name
    if pad_rows:  # padding rows: nothing out, nothing back
        assert bool((got[1][t - pad_rows :] == 0).all())
    if gated:
        assert got[4][:, :d].abs().sum() == 0 and got[4][:, 2 * d :].abs().sum() == 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("gated", [False, True], ids=["norm", "norm_gate"])
@pytest.mark.parametrize("t,d,pad", [(37, 48, 0), (130, 256, 9)])
def test_fused_layer_norm_matches_torch(t, d, pad, gated, dtype):
    device = "cuda" if _CUDA else "cpu"
    _check(t, d, dtype, gated, device, pad_rows=pad)


@pytest.mark.parametrize("gated", [False, True], ids=["norm", "norm_gate"])
def test_zero_padding_rows_leave_every_gradient_bit_for_bit(gated):
    # what `train.cuda_graphs` relies on: the step padded to a token capacity (here 45 real
    # rows, 45 + 83 padded: the programs' row groups and the partials' sum order stay)
    device = "cuda" if _CUDA else "cpu"
    g = torch.Generator().manual_seed(1)
    t, d, pad = 45, 96, 83
    x, u, dy = (torch.randn(t, d, generator=g) for _ in range(3))
    w, b = torch.randn(d, generator=g), torch.randn(d, generator=g)
    grads = []
    for rows in (t, t + pad):
        xs, us, dys = (torch.cat([a, a.new_zeros(rows - t, d)]).to(device) for a in (x, u, dy))
        xs, us, ws, bs = (a.to(device).requires_grad_() for a in (xs, us, w, b))
        y = layer_norm(xs, ws, bs, EPS, us if gated else None)
        y.backward(dys)
        grads.append([xs.grad[:t], ws.grad, bs.grad] + ([us.grad[:t]] if gated else []))
    for a, e in zip(*grads):
        assert torch.equal(a, e)


def _check_add(
    t: int, d: int, dtype, device: str, pad_rows: int = 0, used: str = "both", rbias=False
):
    """`add_layer_norm` against the reference; `used`: which outputs the loss reads (`both`,
    or `h` alone: the norm's backward then does not run); `rbias`: with a residual bias (fp32,
    its gradient the column sum of h's whole gradient)."""
    g = torch.Generator().manual_seed(3)
    x, r = torch.randn(t, d, generator=g) * 2 + 0.5, torch.randn(t, d, generator=g)
    x[t - pad_rows :] = 0.0
    r[t - pad_rows :] = 0.0
    w, b = torch.randn(d, generator=g) * 0.3 + 1, torch.randn(d, generator=g) * 0.1
    dh, dy = torch.randn(t, d, generator=g), torch.randn(t, d, generator=g)
    dh[t - pad_rows :] = 0.0
    dy[t - pad_rows :] = 0.0
    c = torch.randn(d, generator=g) * 0.5

    def run(args, fn):
        x, r, w, b, c, dh, dy = args
        x, r, w, b, c = (a.clone().requires_grad_() for a in (x, r, w, b, c))
        h, y = fn(x, r, w, b, EPS, c if rbias else None)
        outs, grads = ((h, y), (dh, dy)) if used == "both" else ((h,), (dh,))
        torch.autograd.backward(outs, grads)
        return [h, y, x.grad, r.grad, w.grad, b.grad, c.grad]

    got = run([x.to(device, dtype), r.to(device, dtype), w.to(device), b.to(device),
               c.to(device), dh.to(device, dtype), dy.to(device, dtype)],
              add_layer_norm)  # fmt: skip
    want = run([a.double() for a in (x, r, w, b, c, dh, dy)], add_layer_norm_reference)
    assert got[0].dtype == got[1].dtype == dtype
    tol = 2e-5 if dtype == torch.float32 else 1e-2
    names = ["h", "y", "dx", "dresidual"] + (["dweight", "dbias"] if used == "both" else [])
    if rbias:
        assert got[6].dtype == torch.float32
        for name, a, e in (("dresidual_bias", got[6], want[6]),):
            a = a.double().cpu()
            assert float((a - e).abs().max() / e.abs().max()) < tol, name
        if dtype == torch.float32:  # the column sum of the gradient both summands get
            np.testing.assert_allclose(got[6].cpu(), got[2].sum(0).cpu(), rtol=1e-5, atol=1e-5)
    else:
        assert got[6] is None
    for name, a, e in zip(names, got, want):
        a, e = a.detach().double().cpu(), e.detach()
        scale = e.abs().max().clamp_min(1e-12)
        assert float((a - e).abs().max() / scale) < tol, name
    assert torch.equal(got[2], got[3])  # one gradient for both summands
    if used == "h":
        assert got[4] is None and got[5] is None
    if pad_rows:
        assert bool((got[2][t - pad_rows :] == 0).all())


@pytest.mark.parametrize("rbias", [False, True], ids=["add", "add_bias"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("t,d,pad", [(37, 48, 0), (130, 256, 9)])
def test_residual_add_and_norm_match_torch(t, d, pad, dtype, rbias):
    _check_add(t, d, dtype, "cuda" if _CUDA else "cpu", pad_rows=pad, rbias=rbias)


@pytest.mark.parametrize("rbias", [False, True], ids=["add", "add_bias"])
def test_residual_add_and_norm_when_only_the_sum_is_used(rbias):
    _check_add(21, 32, torch.float32, "cuda" if _CUDA else "cpu", used="h", rbias=rbias)


def test_zero_padding_rows_leave_the_residual_bias_gradient_bit_for_bit():
    # the residual bias's gradient is summed over fixed row groups like the norm's: a step
    # padded to a token capacity gets it bit for bit (padding rows: zero upstream gradients)
    device = "cuda" if _CUDA else "cpu"
    g = torch.Generator().manual_seed(4)
    t, d, pad = 45, 64, 83
    x, r, dh, dy = (torch.randn(t, d, generator=g) for _ in range(4))
    w, b, c = (torch.randn(d, generator=g) for _ in range(3))
    grads = []
    for rows in (t, t + pad):
        xs, rs, dhs, dys = (
            torch.cat([a, a.new_zeros(rows - t, d)]).to(device) for a in (x, r, dh, dy)
        )
        xs, rs, ws, bs, cs = (a.to(device).requires_grad_() for a in (xs, rs, w, b, c))
        h, y = add_layer_norm(xs, rs, ws, bs, EPS, cs)
        torch.autograd.backward((h, y), (dhs, dys))
        grads.append([xs.grad[:t], ws.grad, bs.grad, cs.grad])
    for a, e in zip(*grads, strict=True):
        assert torch.equal(a, e)


@pytest.mark.parametrize("prefetch,stages", [(True, 0), (False, 2)], ids=["prefetch", "stages2"])
def test_the_backward_load_orders_give_the_same_bits(monkeypatch, prefetch, stages):
    # `BWD_PREFETCH` / `BWD_STAGES` move the backward's loads, not its arithmetic: every output
    # of the gated (SiLU gate) and the residual form equals the plain loop's bit for bit, also
    # where the last program's rows end inside a slice (t = 70: 32 + 32 + 6)
    from hstu_kernels.triton import layer_norm as ln

    device = "cuda" if _CUDA else "cpu"
    g = torch.Generator().manual_seed(5)
    t, d = 70, 64
    x, p, dy, dh = (torch.randn(t, d, generator=g).to(device, torch.bfloat16) for _ in range(4))
    w, b, rb = (torch.randn(d, generator=g).to(device) for _ in range(3))
    _, h, mean_h, rstd_h = ln.forward(x, w, b, EPS, r2=p, rb=rb)
    _, _, mean, rstd = ln.forward(x, w, b, EPS, g2=torch.nn.functional.silu(p))

    def both():
        gated = ln.backward(x, w, b, mean, rstd, dy, gate_pre=p)
        add = ln.backward(h, w, b, mean_h, rstd_h, dy, dh2=dh, rb=rb)
        return [a for a in (*gated, *add) if a is not None]

    want = both()
    monkeypatch.setattr(ln, "BWD_PREFETCH", prefetch)
    monkeypatch.setattr(ln, "BWD_STAGES", stages)
    got = both()
    assert len(got) == len(want) == 9
    for a, e in zip(got, want, strict=True):
        assert torch.equal(a, e)


def test_a_residual_of_another_shape_or_dtype_is_an_error():
    x = torch.zeros(4, 8)
    w, b = torch.ones(8), torch.zeros(8)
    with pytest.raises(ValueError, match=r"residual \(4, 4\) torch.float32 must have"):
        add_layer_norm(x, torch.zeros(4, 4), w, b, EPS)
    with pytest.raises(ValueError, match=r"residual \(4, 8\) torch.bfloat16 must have"):
        add_layer_norm(x, torch.zeros(4, 8, dtype=torch.bfloat16), w, b, EPS)
    with pytest.raises(ValueError, match=r"residual_bias \(7,\) must be \[D\] = \[8\]"):
        add_layer_norm(x, torch.zeros(4, 8), w, b, EPS, torch.zeros(7))


def test_a_gate_of_another_shape_is_an_error():
    x = torch.zeros(4, 8)
    with pytest.raises(ValueError, match=r"gate \(4, 4\) must have the shape of x \(4, 8\)"):
        layer_norm(x, torch.ones(8), torch.zeros(8), EPS, torch.zeros(4, 4))


@pytest.mark.gpu
@pytest.mark.parametrize("gated", [False, True], ids=["norm", "norm_gate"])
def test_fused_layer_norm_on_the_recipe_shapes(gated):
    # bench_upstream: 1024 wide, ~11K tokens of a batch-32 capacity, the last 700 padding
    _check(11_264, 1024, torch.bfloat16, gated, "cuda", pad_rows=700)


@pytest.mark.gpu
@pytest.mark.parametrize("attention", ["reference", "kernel"])
def test_the_model_with_and_without_the_fused_norm(attention):
    pytest.importorskip("torchrec")
    from test_torch_model import _cfg

    from hstu.params import init_params
    from hstu.testing import make_global_batch
    from hstu.torch_backend.batch import to_torch
    from hstu.torch_backend.model import HSTUModel

    results = []
    for fused in (False, True):
        flag = str(fused).lower()
        cfg = _cfg(
            "ranking",
            f"model.fused_norm={flag}",
            f"model.fused_silu={flag}",
            f"model.attention={attention}",
        )
        model = HSTUModel(cfg.model, device="cuda")
        model.load_params(init_params(cfg.model, seed=0))
        assert all(m.fused == fused for m in model.modules() if hasattr(m, "fused"))
        assert all(layer.fused_silu == fused for layer in model.layers)
        tb = to_torch(make_global_batch(cfg, 8, (8,))[0]).strip_padding().to("cuda")
        loss, _ = model(tb, 10)
        loss.backward()
        results.append((float(loss), {n: p.grad.clone() for n, p in model.named_parameters()}))
    (want_loss, want), (got_loss, got) = results
    assert got_loss == pytest.approx(want_loss, rel=1e-5)
    for name, g in want.items():
        torch.testing.assert_close(got[name], g, rtol=1e-4, atol=1e-5, msg=name)
