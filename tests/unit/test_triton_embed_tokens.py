"""The tokens' embedding rows in one kernel each way (`hstu_kernels.triton.embed_tokens`, the
torch step graphs' input) against the torch ops it replaces: the rows and both sources'
gradients bit for bit, in bf16 and fp32, with every position's source chosen by the mask, a
permutation of the positions, repeated small-table ids and widths that are and are not powers
of two. CPU: the Triton interpreter; GPU (`gpu`): compiled, eagerly and in a CUDA graph."""

from __future__ import annotations

import os

import pytest

torch = pytest.importorskip("torch")
_CUDA = torch.cuda.is_available()
if not _CUDA:
    os.environ["TRITON_INTERPRET"] = "1"  # before any kernel is decorated
pytest.importorskip("triton")

from hstu_kernels.triton.embed_tokens import (  # noqa: E402
    _INTERPRET,
    embed_tokens,
    embed_tokens_reference,
)

if not _CUDA and not _INTERPRET:
    pytest.skip(
        "no CUDA and the Triton kernels were built before TRITON_INTERPRET=1 was set",
        allow_module_level=True,
    )
DEVICE = "cuda" if _CUDA else "cpu"


def _inputs(c: int, d: int, num_small: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    rows = torch.randn(c, d, generator=g)
    small = torch.randn(num_small, d, generator=g)
    is_small = torch.rand(c, generator=g) < 0.4
    small_ids = torch.where(is_small, torch.randint(0, num_small, (c,), generator=g), 0)
    perm = torch.randperm(c, generator=g)
    inv = torch.empty_like(perm)
    inv[perm] = torch.arange(c)
    grad = torch.randn(c, d, generator=g)
    out = rows, small, small_ids.to(torch.int32), is_small, perm, inv, grad
    return [t.to(DEVICE) for t in out]


def _run(fn, rows, small, small_ids, is_small, perm, inv, grad, dtype):
    rows, small = rows.clone().requires_grad_(), small.clone().requires_grad_()
    x = fn(rows, small, small_ids, is_small, perm, inv, dtype)
    x.backward(grad.to(dtype))
    return x.detach(), rows.grad, small.grad


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("c, d", [(37, 48), (64, 128)])
def test_embed_tokens_is_the_torch_ops_bit_for_bit(dtype, c, d):
    args = _inputs(c, d, num_small=5, seed=c + d)
    got = _run(embed_tokens, *args, dtype)
    want = _run(embed_tokens_reference, *args, dtype)
    assert got[0].dtype == dtype
    if _INTERPRET and dtype == torch.bfloat16:
        # the interpreter rounds fp32 -> bf16 toward zero, CUDA (and torch) to nearest even:
        # the same rows, truncated
        exact = _run(embed_tokens_reference, *args, torch.float32)[0]
        want = ((exact.view(torch.int32) & ~0xFFFF).view(torch.float32).to(dtype), *want[1:])
    for name, g, w in zip(("x", "rows' gradient", "small's gradient"), got, want, strict=True):
        assert torch.equal(g, w), name
    rows, small, small_ids, is_small, perm = args[:5]
    src = perm[3]  # token 3 holds source row perm[3]
    expect = small[small_ids[src]] if is_small[src] else rows[src]
    assert torch.equal(got[0][3].float(), expect) or dtype != torch.float32
    assert not got[1][is_small].any()  # a small position gives the item rows nothing


def test_embed_tokens_rejects_what_it_cannot_read():
    rows, small, small_ids, is_small, perm, inv, _ = _inputs(8, 16, 3, 0)
    with pytest.raises(ValueError, match="small must be fp32"):
        embed_tokens(rows, small.half(), small_ids, is_small, perm, inv, torch.bfloat16)
    with pytest.raises(ValueError, match="do not agree"):
        embed_tokens(rows, small, small_ids[:4], is_small, perm, inv, torch.bfloat16)
    with pytest.raises(ValueError, match="is_small must be bool"):
        embed_tokens(rows, small, small_ids, is_small.int(), perm, inv, torch.bfloat16)


@pytest.mark.gpu
@pytest.mark.skipif(not _CUDA, reason="needs CUDA")
def test_embed_tokens_replays_in_a_cuda_graph():
    args = _inputs(3000, 1024, num_small=1016, seed=1)
    want = _run(embed_tokens_reference, *args, torch.bfloat16)
    rows, small = (t.clone().requires_grad_() for t in args[:2])
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # compiled before the capture
        embed_tokens(rows, small, *args[2:6], torch.bfloat16).backward(args[6].bfloat16())
    torch.cuda.current_stream().wait_stream(side)
    rows.grad = small.grad = None
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        x = embed_tokens(rows, small, *args[2:6], torch.bfloat16)
        x.backward(args[6].bfloat16())
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(x, want[0])
    assert torch.equal(rows.grad, want[1]) and torch.equal(small.grad, want[2])
