"""AdamW on a table from its looked-up rows' gradient (`hstu_kernels.triton.adamw_rows`, the
item table's update in the torch step graphs) against `torch.optim.AdamW` on the dense
gradient: parameters, both moments, the step count and the gradient's squared norm, over
several steps with repeated ids, untouched rows, an empty lookup and widths that are and are
not powers of two. CPU: the Triton interpreter; GPU (`gpu`): the compiled kernels against the
fused AdamW, eagerly and replayed from a CUDA graph."""

from __future__ import annotations

import os

import pytest

torch = pytest.importorskip("torch")
_CUDA = torch.cuda.is_available()
if not _CUDA:
    os.environ["TRITON_INTERPRET"] = "1"  # before any kernel is decorated
pytest.importorskip("triton")

from hstu_kernels.triton.adamw_rows import (  # noqa: E402
    CHUNK,
    adamw_rows_,
    adamw_rows_reference_,
    compile_adamw_rows,
)

HYPER = dict(lr=3e-3, beta1=0.9, beta2=0.98, eps=1e-8, weight_decay=0.1)


def _lookups(num_rows, d, steps, n, device, seed=0):
    """Per step: ids (a hot row repeated past one chunk, most rows never looked up, positions
    that are no lookup: id -1, a gradient that must be ignored) and their gradients."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(steps):
        k = 0 if i == 1 else n  # step 1 looks nothing up: every row decays only
        ids = torch.randint(0, num_rows // 2, (k,), generator=g)
        ids[: k // 4] = 3
        ids[k // 4 : k // 4 + k // 10] = -1
        out.append((ids[torch.randperm(k, generator=g)].to(device),
                    torch.randn(k, d, generator=g).to(device)))  # fmt: skip
    return out


def _state(w0, device):
    return [w0.clone().to(device), torch.zeros_like(w0, device=device),
            torch.zeros_like(w0, device=device), torch.zeros((), device=device)]  # fmt: skip


def _check_against_torch(
    num_rows, d, device, fused, update=adamw_rows_, steps=4, n=150, atol=1e-6
):  # fmt: skip
    assert n // 4 > CHUNK  # the hot row's run spans chunks
    w0 = torch.randn(num_rows, d, generator=torch.Generator().manual_seed(1))
    ref = torch.nn.Parameter(w0.clone().to(device))
    opt = torch.optim.AdamW(
        [ref], lr=HYPER["lr"], betas=(HYPER["beta1"], HYPER["beta2"]), eps=HYPER["eps"],
        weight_decay=HYPER["weight_decay"], fused=fused,
    )  # fmt: skip
    state = _state(w0, device)
    for ids, rows in _lookups(num_rows, d, steps, n, device):
        keep = ids >= 0
        dense = torch.zeros_like(ref).index_add_(0, ids[keep], rows[keep])
        ref.grad = dense
        opt.step()
        sq = update(*state, ids, rows, **HYPER)
        torch.testing.assert_close(sq, dense.square().sum(), rtol=1e-5, atol=1e-6)
    want = [ref.detach(), opt.state[ref]["exp_avg"], opt.state[ref]["exp_avg_sq"]]
    # the hot row sums its gradients in sorted order here, in index_add_'s atomic order in
    # the reference (GPU): its moments differ by the sums' rounding (`atol`)
    for name, got, exp in zip(("param", "exp_avg", "exp_avg_sq"), state, want):
        torch.testing.assert_close(
            got, exp, rtol=1e-5, atol=atol, msg=lambda m, n=name: f"{n}: {m}"
        )
    assert float(state[3]) == steps
    # the rows never looked up moved too: decay and the moments' decay, as dense AdamW
    assert not torch.equal(state[0][-1], w0[-1].to(device))


@pytest.mark.parametrize("d", [24, 32])
@pytest.mark.parametrize("update", [adamw_rows_, adamw_rows_reference_])
def test_rows_update_is_dense_adamw(d, update):
    if _CUDA:
        pytest.skip("the CPU interpreter's case; the GPU tests below run the compiled kernels")
    _check_against_torch(37, d, "cpu", fused=None, update=update)


def _check_sparse_against_reference(num_rows, d, device, update, n=150, atol=1e-6):
    """`sparse=True` against the touched-rows Adam of sharded tables (`hstu.embedding_opt`,
    numpy): the looked-up rows move, the others and their moments are left bit-identical; the
    count advanced by the caller (`advance_step=False`)."""
    from types import SimpleNamespace

    from hstu import embedding_opt

    w0 = torch.randn(num_rows, d, generator=torch.Generator().manual_seed(1))
    state = _state(w0, device)
    want, want_state = w0.numpy().copy(), embedding_opt.init_state("adam", num_rows, d)
    cfg = SimpleNamespace(**{k: v for k, v in HYPER.items()})
    touched = torch.zeros(num_rows, dtype=torch.bool)
    for ids, rows in _lookups(num_rows, d, 4, n, device):
        keep = (ids >= 0).cpu()
        uniq, g = embedding_opt.row_gradients(ids.cpu()[keep].numpy(), rows.cpu()[keep].numpy())
        want, want_state = embedding_opt.apply("adam", want_state, want, uniq, g, cfg)
        touched[uniq] = True
        state[3].add_(1)
        sq = update(*state, ids, rows, **HYPER, sparse=True, advance_step=False)
        torch.testing.assert_close(sq.cpu(), torch.tensor(float((g * g).sum())), rtol=1e-5, atol=0)
    for name, got, exp in zip(("param", "m", "v"), state, (want, want_state["m"], want_state["v"])):
        torch.testing.assert_close(
            got.cpu(),
            torch.from_numpy(exp),
            rtol=1e-5,
            atol=atol,
            msg=lambda m, n=name: f"{n}: {m}",
        )
    assert float(state[3]) == 4 and touched.any() and not touched.all()
    untouched = ~touched
    assert torch.equal(state[0].cpu()[untouched], w0[untouched])  # bit-identical
    assert not state[1].cpu()[untouched].any() and not state[2].cpu()[untouched].any()


@pytest.mark.parametrize("update", [adamw_rows_, adamw_rows_reference_])
def test_sparse_rows_update_is_the_touched_rows_adam(update):
    if _CUDA:
        pytest.skip("the CPU interpreter's case; the GPU test below runs the compiled kernels")
    _check_sparse_against_reference(37, 24, "cpu", update)


@pytest.mark.gpu
def test_compiled_sparse_rows_update_is_the_touched_rows_adam():
    if not _CUDA:
        pytest.skip("needs a CUDA GPU (run on the GPU machine)")
    _check_sparse_against_reference(5000, 1024, "cuda", adamw_rows_, n=3000, atol=2e-5)


def test_bad_input_is_named():
    p = torch.zeros(4, 3)
    with pytest.raises(ValueError, match="grad_rows"):
        ids = torch.zeros(2, dtype=torch.int64)
        adamw_rows_(*_state(p, "cpu"), ids, torch.zeros(3, 3), **HYPER)
    with pytest.raises(ValueError, match="exp_avg must"):
        adamw_rows_(p, torch.zeros(4, 2), p.clone(), torch.zeros(()),
                    torch.zeros(0, dtype=torch.int64), torch.zeros(0, 3), **HYPER)  # fmt: skip
    with pytest.raises(ValueError, match="fp32"):
        adamw_rows_(*_state(p.double(), "cpu"), torch.zeros(0, dtype=torch.int64),
                    torch.zeros(0, 3), **HYPER)  # fmt: skip


@pytest.mark.gpu
def test_compiled_rows_update_is_fused_adamw():
    if not _CUDA:
        pytest.skip("needs a CUDA GPU (run on the GPU machine)")
    for num_rows, d in ((5000, 1024), (999, 48)):
        # a hot row of 750 gradients of ~1: its fp32 sum's rounding, times 1 - beta1
        _check_against_torch(num_rows, d, "cuda", fused=True, n=3000, atol=2e-5)


@pytest.mark.gpu
def test_rows_update_replays_from_a_cuda_graph():
    if not _CUDA:
        pytest.skip("needs a CUDA GPU (run on the GPU machine)")
    num_rows, d, n = 4096, 256, 512
    w0 = torch.randn(num_rows, d)
    eager, graphed = _state(w0, "cuda"), _state(w0, "cuda")
    ids = torch.zeros(n, dtype=torch.int64, device="cuda")
    rows = torch.zeros(n, d, device="cuda")
    compile_adamw_rows(*graphed, ids, rows)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        sq = adamw_rows_(*graphed, ids, rows, **HYPER)
    for got, exp in zip(graphed, eager):  # a capture records, runs nothing: as they were
        torch.testing.assert_close(got, exp, rtol=0, atol=0)
    for new_ids, new_rows in _lookups(num_rows, d, 3, n, "cuda", seed=2)[::2]:
        ids.copy_(new_ids)
        rows.copy_(new_rows)
        graph.replay()
        want = adamw_rows_(*eager, new_ids, new_rows, **HYPER)
        torch.testing.assert_close(sq, want)
    for got, exp in zip(graphed, eager):
        torch.testing.assert_close(got, exp, rtol=0, atol=0)
