"""AdamW over many tensors in one launch (`hstu_kernels.triton.adamw_multi`, the torch step
graphs' update) against `torch.optim.AdamW` and the plain-torch masked Adam: parameters, both
moments, the returned squared gradient norm, rows marked for the update (the others and their
moments untouched, bit for bit), low-precision copies of the result, tensors that span blocks
and a 0-dim one, and the errors of bad arguments. CPU: the Triton interpreter; GPU (`gpu`):
the compiled kernel against the fused AdamW, eagerly and replayed from a CUDA graph."""

from __future__ import annotations

import os

import pytest

torch = pytest.importorskip("torch")
_CUDA = torch.cuda.is_available()
if not _CUDA:
    os.environ["TRITON_INTERPRET"] = "1"  # before any kernel is decorated
pytest.importorskip("triton")

from hstu_kernels.triton.adamw_multi import (  # noqa: E402
    CHUNK,
    adamw_multi_,
    adamw_multi_reference_,
    compile_adamw_multi,
)

HYPER = dict(lr=3e-3, beta1=0.9, beta2=0.98, eps=1e-8, weight_decay=0.1)
# a matrix, a vector past one program's chunk, a 0-dim scalar, a row past one chunk, a chunk
SHAPES = [(7, 5), (CHUNK + 3,), (), (1, CHUNK + 2), (CHUNK // 64, 64)]


def _tensors(device, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(s, generator=g).to(device) for s in SHAPES]


def _grads(device, steps, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [[torch.randn(s, generator=g).to(device) for s in SHAPES] for _ in range(steps)]


def _run_against_torch(device, fused, graph=False, steps=3):
    w0 = _tensors("cpu")
    ref = [torch.nn.Parameter(w.clone().to(device)) for w in w0]
    opt = torch.optim.AdamW(
        ref, lr=HYPER["lr"], betas=(HYPER["beta1"], HYPER["beta2"]), eps=HYPER["eps"],
        weight_decay=HYPER["weight_decay"], fused=fused,
    )  # fmt: skip
    params = [w.clone().to(device) for w in w0]
    ms = [torch.zeros_like(p) for p in params]
    vs = [torch.zeros_like(p) for p in params]
    steps_t = [torch.zeros(1, device=device) for _ in params]
    grads = [torch.zeros_like(p) for p in params]
    copies = [torch.empty_like(p, dtype=torch.bfloat16) for p in params]
    sqs = []
    runner = None
    if graph:
        compile_adamw_multi(params, ms, vs, copies)
        runner = torch.cuda.CUDAGraph()
        with torch.cuda.graph(runner):
            torch._foreach_add_(steps_t, 1)
            out = adamw_multi_(params, grads, ms, vs, steps_t, **HYPER, copies=copies)
    for gs in _grads("cpu", steps):
        for p, g in zip(ref, gs, strict=True):
            p.grad = g.clone().to(device)
        opt.step()
        for dst, g in zip(grads, gs, strict=True):
            dst.copy_(g)
        if graph:
            runner.replay()
            sqs.append(out.clone())
        else:
            torch._foreach_add_(steps_t, 1)
            sqs.append(adamw_multi_(params, grads, ms, vs, steps_t, **HYPER, copies=copies))
        want_sq = sum(float(g.double().square().sum()) for g in gs)
        assert float(sqs[-1]) == pytest.approx(want_sq, rel=1e-5)
    for i, p in enumerate(ref):
        st = opt.state[p]
        torch.testing.assert_close(params[i], p.detach(), rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(ms[i], st["exp_avg"], rtol=1e-6, atol=1e-7)
        torch.testing.assert_close(vs[i], st["exp_avg_sq"], rtol=1e-6, atol=1e-9)
        assert float(steps_t[i]) == float(st["step"]) == steps
        # the copy is the parameter rounded: within one bf16 step of it (the interpreter
        # rounds toward zero, CUDA to nearest)
        err = (copies[i].float() - params[i]).abs()
        assert (err <= params[i].abs() * 2.0**-7 + 1e-30).all(), i


def test_matches_torch_adamw_over_steps():
    _run_against_torch("cpu", fused=None)


def test_marked_rows_only_and_the_reference():
    """`rows`: the marked rows take the update (as `adamw_masked_`), the unmarked ones keep
    their parameter and moments bit for bit; the kernel and the torch reference agree, and
    both return every gradient's squares, marked or not."""
    params, ms, vs = _tensors("cpu", 0), _tensors("cpu", 2), _tensors("cpu", 3)
    vs = [v.abs() for v in vs]
    grads = _grads("cpu", 1)[0]
    rows = [torch.tensor([True, False, True, False, False, True, True]), None, None,
            torch.tensor([False]), torch.arange(CHUNK // 64) % 3 == 0]  # fmt: skip
    step = torch.full((1,), 2.0)
    mine = [[t.clone() for t in ts] for ts in (params, ms, vs)]
    ref = [[t.clone() for t in ts] for ts in (params, ms, vs)]
    sq = adamw_multi_(mine[0], grads, mine[1], mine[2], [step] * 5, **HYPER, rows=rows)
    sq_ref = adamw_multi_reference_(ref[0], grads, ref[1], ref[2], [step] * 5, **HYPER, rows=rows)
    assert float(sq) == pytest.approx(float(sq_ref), rel=1e-6)
    assert float(sq) == pytest.approx(sum(float(g.square().sum()) for g in grads), rel=1e-6)
    for k in range(3):
        for i, r in enumerate(rows):
            torch.testing.assert_close(mine[k][i], ref[k][i], rtol=1e-6, atol=1e-7)
            if r is None:
                assert not torch.equal(mine[k][i], (params, ms, vs)[k][i]), (k, i)
                continue
            before = (params, ms, vs)[k][i]
            assert torch.equal(mine[k][i][~r], before[~r]), (k, i)  # untouched, bit for bit
            if r.any():
                assert not torch.equal(mine[k][i][r], before[r]), (k, i)


def test_bad_arguments_are_named():
    p = [torch.zeros(4, 3)]
    ok = dict(grads=[torch.zeros(4, 3)], exp_avgs=[torch.zeros(4, 3)])
    step = [torch.zeros(1)]
    with pytest.raises(ValueError, match=r"grads\[0\] must be contiguous fp32 \(4, 3\)"):
        adamw_multi_(p, [torch.zeros(3, 4)], ok["exp_avgs"], [torch.zeros(4, 3)], step, **HYPER)
    with pytest.raises(ValueError, match="exp_avg_sqs: 0 tensors for 1 parameters"):
        adamw_multi_(p, ok["grads"], ok["exp_avgs"], [], step, **HYPER)
    with pytest.raises(ValueError, match=r"params\[0\] must be contiguous fp32"):
        adamw_multi_([torch.zeros(3, 4).t()], *([torch.zeros(4, 3)] for _ in range(3)), step,
                     **HYPER)  # fmt: skip
    with pytest.raises(ValueError, match=r"rows\[0\] must be a contiguous bool \[4\]"):
        adamw_multi_(p, ok["grads"], ok["exp_avgs"], [torch.zeros(4, 3)], step, **HYPER,
                     rows=[torch.ones(3, dtype=torch.bool)])  # fmt: skip
    with pytest.raises(ValueError, match=r"params\[0\] has both rows and a copy"):
        adamw_multi_(p, ok["grads"], ok["exp_avgs"], [torch.zeros(4, 3)], step, **HYPER,
                     rows=[torch.ones(4, dtype=torch.bool)],
                     copies=[torch.zeros(4, 3, dtype=torch.bfloat16)])  # fmt: skip
    with pytest.raises(ValueError, match=r"steps\[0\] must be a one-element fp32 tensor"):
        adamw_multi_(p, ok["grads"], ok["exp_avgs"], [torch.zeros(4, 3)], [torch.zeros(2)],
                     **HYPER)  # fmt: skip


@pytest.mark.gpu
@pytest.mark.skipif(not _CUDA, reason="needs a CUDA GPU")
@pytest.mark.parametrize("graph", [False, True], ids=["eager", "graph"])
def test_compiled_against_fused_adamw(graph):
    _run_against_torch("cuda", fused=True, graph=graph)
