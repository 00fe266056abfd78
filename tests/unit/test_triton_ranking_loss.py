"""The step graph's ranking loss in one launch each way (`hstu_kernels.triton.ranking_loss`)
against the torch ops it replaces: the loss and the logits' gradient over padded loss rows,
with the real-row count and the loss tokens read on the device. CPU: the Triton interpreter;
GPU (`gpu`): compiled, eagerly and in a CUDA graph replayed with new counts."""

from __future__ import annotations

import os

import pytest

torch = pytest.importorskip("torch")
_CUDA = torch.cuda.is_available()
if not _CUDA:
    os.environ["TRITON_INTERPRET"] = "1"  # before any kernel is decorated
pytest.importorskip("triton")

from hstu_kernels.triton.ranking_loss import (  # noqa: E402
    _INTERPRET,
    ranking_bce,
    ranking_bce_reference,
)

if not _CUDA and not _INTERPRET:
    pytest.skip(
        "no CUDA and the Triton kernels were built before TRITON_INTERPRET=1 was set",
        allow_module_level=True,
    )
DEVICE = "cuda" if _CUDA else "cpu"


def _inputs(rows: int, tasks: int, real: int, loss_tokens: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(rows, tasks, generator=g) * 4  # saturated terms too
    bits = torch.randint(0, 2**tasks, (rows,), generator=g)
    bits[real:] = -1  # padding rows: every bit set, must add nothing
    logits[real:] = float("nan") if rows > real else 0  # nor their values
    grad = torch.tensor(0.75)
    out = logits, bits, torch.tensor(real), torch.tensor(loss_tokens), grad
    return [t.to(DEVICE) for t in out]


def _loss_and_grad(fn, logits, bits, real, loss_tokens, grad):
    x = logits.clone().requires_grad_()
    loss = fn(x, bits, real, loss_tokens)
    loss.backward(grad)
    return loss.detach(), x.grad


@pytest.mark.parametrize(
    "rows, tasks, real, loss_tokens",
    [(1, 1, 1, 1), (37, 2, 30, 30), (2048, 2, 1500, 1500), (3000, 3, 3000, 0), (64, 2, 0, 5)],
)
def test_ranking_bce_is_the_torch_ops(rows, tasks, real, loss_tokens):
    inputs = _inputs(rows, tasks, real, loss_tokens, seed=rows)
    got = _loss_and_grad(ranking_bce, *inputs)
    clean = [t.clone() for t in inputs]
    clean[0][real:] = 0.0  # torch's where() would carry a NaN's gradient as 0 * NaN = NaN
    want = _loss_and_grad(ranking_bce_reference, *clean)
    torch.testing.assert_close(got[0], want[0], rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(got[1], want[1], rtol=1e-5, atol=1e-7)  # exp: an ulp or two
    assert torch.all(got[1][real:] == 0)  # padding: an exact zero gradient, NaN logits or not
    if real:  # spelled out once: the mean over real terms of (1 - y) x + log(1 + exp(-x))
        x, bits = clean[0][:real].double(), clean[1][:real]
        y = ((bits[:, None] >> torch.arange(tasks, device=x.device)) & 1).double()
        terms = (1 - y) * x + torch.log1p(torch.exp(-x))
        want_sum = float(terms.sum()) / max(loss_tokens, 1)
        assert abs(float(got[0]) - want_sum) <= 1e-6 * abs(want_sum) + 1e-6  # fp32 sum


def test_ranking_bce_rejects_what_it_cannot_read():
    logits, bits, real, tokens, _ = _inputs(8, 2, 8, 8, seed=0)
    with pytest.raises(ValueError, match="logits must be"):
        ranking_bce(logits.double(), bits, real, tokens)
    with pytest.raises(ValueError, match="label_bits must be"):
        ranking_bce(logits, bits[:4], real, tokens)
    with pytest.raises(ValueError, match="num_real must be"):
        ranking_bce(logits, bits, real.int(), tokens)


@pytest.mark.gpu
@pytest.mark.skipif(not _CUDA, reason="CUDA graphs need a GPU")
def test_ranking_bce_replays_with_new_counts():
    logits, bits, real, tokens, grad = _inputs(2048, 2, 1500, 1500, seed=1)
    logits[1500:] = 0.0
    x = logits.clone().requires_grad_()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        ranking_bce(x, bits, real, tokens).backward(grad)
    torch.cuda.current_stream().wait_stream(side)
    x.grad = None
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        loss = ranking_bce(x, bits, real, tokens)
        loss.backward(grad)
    for n_real, n_tokens in ((1500, 1500), (700, 900)):
        real.fill_(n_real)
        tokens.fill_(n_tokens)
        graph.replay()
        torch.cuda.synchronize()
        want = _loss_and_grad(ranking_bce_reference, logits, bits, real, tokens, grad)
        torch.testing.assert_close(loss, want[0], rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(x.grad, want[1], rtol=1e-5, atol=1e-7)
