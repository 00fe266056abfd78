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
    source_ids,
    source_ids_reference,
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


def _segmented(c: int, d: int, sizes: tuple[int, ...], runs: tuple[tuple[int, int], ...], seed):
    """Inputs whose small sources lie in `runs` (source ranges), run k's ids in its `sizes[k]`
    rows; the other sources are item rows. The gradient holds small integers, so that every
    fp32 sum is exact in any order."""
    g = torch.Generator().manual_seed(seed)
    rows = torch.randn(c, d, generator=g)
    small = torch.randn(sum(sizes), d, generator=g)
    is_small = torch.zeros(c, dtype=torch.bool)
    small_ids = torch.zeros(c, dtype=torch.int64)
    for k, (lo, hi) in enumerate(runs):
        row0 = sum(sizes[:k])
        is_small[lo:hi] = True
        small_ids[lo:hi] = row0 + torch.randint(0, sizes[k], (hi - lo,), generator=g)
    perm = torch.randperm(c, generator=g)
    inv = torch.empty_like(perm)
    inv[perm] = torch.arange(c)
    grad = torch.randint(-8, 9, (c, d), generator=g).float()
    bounds = torch.tensor([b for run in runs for b in run], dtype=torch.int64)
    out = rows, small, small_ids.to(torch.int32), is_small, perm, inv, grad, bounds
    return [t.to(DEVICE) for t in out]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_embed_tokens_sums_the_small_tables_run_by_run(dtype):
    # a contextual-like run of many rows (two row tiles, one pass), an action-like run of few
    # rows over more sources than one program takes (its partials summed after), and an empty
    # run whose rows get zeros; 600 positions, width 48 (not a power of two)
    sizes, runs = (70, 5, 3), ((0, 20), (150, 560), (30, 30))
    *args, grad, bounds = _segmented(600, 48, sizes, runs, seed=3)
    want = _run(embed_tokens_reference, *args, grad, dtype)

    def fn(*a):
        return embed_tokens(*a, segments=(bounds, sizes))

    got = _run(fn, *args, grad, dtype)
    assert torch.equal(got[1], want[1]) and torch.equal(got[2], want[2])
    assert not got[2][75:].any() and got[2][70:75].abs().sum() > 0
    # the same bits every run: fixed tiles and orders, no atomics
    assert torch.equal(_run(fn, *args, grad, dtype)[2], got[2])
    # gradients of any values: their sums in float64 to fp32 rounding (another order)
    noisy = torch.randn(grad.shape, generator=torch.Generator().manual_seed(4)).to(DEVICE)
    got = _run(fn, *args, noisy, dtype)[2]
    small_ids, is_small, inv = args[2], args[3], args[5]
    terms = noisy.to(dtype).double()[inv[is_small]]  # what each small source adds
    exact = torch.zeros(got.shape, dtype=torch.float64, device=DEVICE)
    exact.index_add_(0, small_ids[is_small].long(), terms)
    torch.testing.assert_close(got.double(), exact, rtol=1e-5, atol=1e-5)


def test_embed_tokens_rejects_segments_that_do_not_fit():
    rows, small, small_ids, is_small, perm, inv, _ = _inputs(8, 16, 3, 0)
    bounds = torch.tensor([0, 4, 4, 8], device=DEVICE)
    with pytest.raises(ValueError, match="sum to small's 3 rows"):
        embed_tokens(
            *(rows, small, small_ids, is_small, perm, inv), torch.bfloat16, (bounds, (2, 2))
        )
    with pytest.raises(ValueError, match="2 x 3 entries"):
        embed_tokens(
            *(rows, small, small_ids, is_small, perm, inv), torch.bfloat16, (bounds, (1, 1, 1))
        )
    *args, _, bounds = _segmented(40, 16, (5, 3), ((0, 6), (20, 30)), seed=1)
    if DEVICE == "cpu":  # the runs themselves checked on the host only (on a GPU: a sync)
        with pytest.raises(ValueError, match="ids in its rows"):  # the runs' tables swapped
            embed_tokens(*args, torch.float32, (bounds, (3, 5)))
        with pytest.raises(ValueError, match="a small source lies in no run"):
            embed_tokens(*args, torch.float32, (torch.tensor([0, 6, 20, 29]), (5, 3)))
        with pytest.raises(ValueError, match="must be small"):
            embed_tokens(*args, torch.float32, (torch.tensor([0, 7, 20, 30]), (5, 3)))
    with pytest.raises(ValueError, match="int32 / int64"):
        embed_tokens(
            *(rows, small, small_ids, is_small, perm, inv), torch.bfloat16, (bounds.float(), (2, 1))
        )


@pytest.mark.gpu
@pytest.mark.skipif(not _CUDA, reason="needs CUDA")
def test_embed_tokens_segments_replay_with_new_bounds():
    # the recipe's shape at batch 32: 12,288 positions, 1,000 contextual and 16 action rows;
    # one graph replayed on two batches whose runs differ (the bounds are read on the device)
    sizes = (1000, 16)
    first = _segmented(12288, 1024, sizes, ((0, 128), (5128, 10128)), seed=5)
    second = _segmented(12288, 1024, sizes, ((0, 96), (4000, 11000)), seed=6)
    static = [t.clone() for t in first]
    rows, small = (t.clone().requires_grad_() for t in static[:2])
    ints, grad, bounds = static[2:6], static[6].bfloat16(), static[7]

    def step():
        x = embed_tokens(rows, small, *ints, torch.bfloat16, (bounds, sizes))
        x.backward(grad)
        return x

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # compiled before the capture
        step()
    torch.cuda.current_stream().wait_stream(side)
    rows.grad = small.grad = None
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        x = step()
    for batch in (first, second):
        for dst, src in zip(static[2:], batch[2:], strict=True):
            dst.copy_(src)
        grad.copy_(batch[6].bfloat16())
        graph.replay()
        torch.cuda.synchronize()
        inputs = (*first[:2], *batch[2:6])  # the tables stay the first batch's
        want = _run(embed_tokens_reference, *inputs, batch[6], torch.bfloat16)
        assert torch.equal(x, want[0])  # integer gradients: every sum exact in any order
        assert torch.equal(rows.grad, want[1]) and torch.equal(small.grad, want[2])


def _layout(c: int, runs: tuple[int, int, int, int], seed: int):
    """A capacity of `c` positions holding `runs` (contextual, item, action, candidate
    counts) then padding whose ids are garbage (the kernel must not read them as ids)."""
    g = torch.Generator().manual_seed(seed)
    n_ctx, n_item, n_act, n_cand = runs
    starts = [0, n_ctx, n_ctx + n_item, n_ctx + n_item + n_act, sum(runs), 7, 9, 0]
    src = torch.randint(0, 1000, (c,), generator=g)
    src[sum(runs) :] = -12345  # padding: whatever the buffer held
    return src.to(DEVICE), torch.tensor(starts, dtype=torch.int64, device=DEVICE)


@pytest.mark.parametrize(
    "c, runs",
    [
        (1, (0, 0, 0, 0)),  # nothing real
        (37, (4, 10, 10, 8)),  # a capacity that is no multiple of the block
        (3000, (4, 900, 900, 64)),  # more than one block, padding past 1,868
        (2048, (0, 1000, 1000, 48)),  # no contextual run, full but for the tail
        (1024, (4, 500, 500, 20)),  # a capacity that is exactly the block
    ],
)
def test_source_ids_are_the_torch_ops(c, runs):
    src, starts = _layout(c, runs, seed=c)
    for marks in (True, False):
        got = source_ids(src, starts, ctx_rows=1000, marks=marks)
        want = source_ids_reference(src, starts, ctx_rows=1000, marks=marks)
        for name, a, b in zip(("item", "lookups", "small", "small_lookups", "is_small"), got, want):
            if b is None:
                assert a is None, name
            else:
                assert a.dtype == b.dtype and torch.equal(a, b), name
    item_ids, lookups, small_ids, small_lookups, is_small = source_ids(src, starts, 1000)
    n_ctx, n_item, n_act, n_cand = runs
    tokens = sum(runs)
    host = src.cpu()
    # spelled out once: the runs' positions and what each output holds there
    ctx = slice(0, n_ctx)
    act = slice(n_ctx + n_item, n_ctx + n_item + n_act)
    items = torch.cat([torch.arange(n_ctx, n_ctx + n_item), torch.arange(tokens - n_cand, tokens)])
    assert torch.equal(small_ids[ctx].cpu().long(), host[ctx])
    assert torch.equal(small_ids[act].cpu().long(), host[act] + 1000)
    assert torch.equal(lookups.cpu()[items], host[items]) and torch.equal(
        item_ids.cpu()[items], host[items]
    )
    assert int(is_small.sum()) == n_ctx + n_act
    assert (lookups[tokens:] == -1).all() and (item_ids[tokens:] == 0).all()
    assert (small_lookups[tokens:] == -1).all() and (small_ids[tokens:] == 0).all()


def test_source_ids_rejects_what_it_cannot_read():
    src, starts = _layout(64, (4, 20, 20, 8), seed=0)
    with pytest.raises(ValueError, match="src must be"):
        source_ids(src.int(), starts, ctx_rows=10)
    with pytest.raises(ValueError, match="starts must be"):
        source_ids(src, starts[:4], ctx_rows=10)


@pytest.mark.gpu
@pytest.mark.skipif(not _CUDA, reason="CUDA graphs need a GPU")
def test_source_ids_replay_with_new_starts():
    # one graph over two batches: the starts are read on the device at every replay
    src, starts = _layout(4096, (4, 1500, 1500, 64), seed=1)
    src2, starts2 = _layout(4096, (4, 1000, 1000, 30), seed=2)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        source_ids(src, starts, ctx_rows=1000)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = source_ids(src, starts, ctx_rows=1000)
    for s, st in ((src, starts), (src2, starts2)):
        want = source_ids_reference(s, st, ctx_rows=1000)
        src.copy_(s)
        starts.copy_(st)
        graph.replay()
        torch.cuda.synchronize()
        for a, b in zip(out, want, strict=True):
            assert torch.equal(a, b)
