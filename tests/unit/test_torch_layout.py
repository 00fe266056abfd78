"""The token layout built on the host (hstu/torch_backend/layout.py): the model's token table
(docs/MODEL.md) sample by sample, the same loss as the layout read back from the device, and no
layout kernels in the step."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("torchrec")

from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

from hstu.config import load_config  # noqa: E402
from hstu.testing import DEMO_CONFIG, make_global_batch  # noqa: E402
from hstu.torch_backend.batch import to_torch  # noqa: E402
from hstu.torch_backend.layout import (  # noqa: E402
    TokenLayout,
    permute_rows,
    select_distinct_rows,
)
from hstu.torch_backend.model import HSTUModel  # noqa: E402


def _reference(c, n, k):
    """Token by token, sample by sample: (offsets, source row of every token, the item and
    candidate tokens, the retrieval targets' item rows)."""
    rows, pos_item, pos_cand, targets, offsets = [], [], [], [], [0]
    seen = {"contextual": 0, "item": 0, "action": 0, "candidate": 0}
    base = {"contextual": 0, "item": c.sum(), "action": c.sum() + n.sum()}
    base["candidate"] = base["action"] + n.sum()
    for b in range(c.size):
        for _ in range(c[b]):
            rows.append(base["contextual"] + seen["contextual"])
            seen["contextual"] += 1
        for item in range(n[b]):
            pos_item.append(len(rows))
            if item < n[b] - 1:
                targets.append(seen["item"])
            rows.append(base["item"] + seen["item"])
            rows.append(base["action"] + seen["action"])
            seen["item"] += 1
            seen["action"] += 1
        for _ in range(k[b]):
            pos_cand.append(len(rows))
            rows.append(base["candidate"] + seen["candidate"])
            seen["candidate"] += 1
        offsets.append(len(rows))
    return offsets, rows, pos_item, pos_cand, targets


@pytest.mark.parametrize("seed", range(4))
def test_the_host_layout_is_the_token_table_sample_by_sample(seed):
    rng = np.random.default_rng(seed)
    b, real = 9, 6  # padding rows at the tail: no tokens
    c, n, k = (np.where(np.arange(b) < real, rng.integers(0, hi, b), 0) for hi in (3, 6, 4))
    n[1] = 0  # a sample with no history
    got = TokenLayout.from_lengths(c, n, k).views()
    offsets, rows, pos_item, pos_cand, targets = _reference(c, n, k)
    assert got["offsets"].tolist() == offsets
    assert got["inverse"].tolist() == rows
    assert got["pos_item"].tolist() == pos_item
    assert got["pos_cand"].tolist() == pos_cand
    assert got["target_item"].tolist() == targets
    inverse, dest = np.asarray(rows), got["dest"].numpy()
    assert (dest[inverse] == np.arange(inverse.size)).all()  # the inverse permutation
    assert got["num_contextual"].dtype == got["num_candidates"].dtype == torch.int32
    assert got["num_contextual"].tolist() == c.tolist()
    assert got["num_candidates"].tolist() == k.tolist()
    stripped = TokenLayout.from_lengths(c, n, k).strip(real).views()
    assert stripped["offsets"].tolist() == offsets[: real + 1]
    assert stripped["num_candidates"].tolist() == k[:real].tolist()
    assert stripped["inverse"].tolist() == rows


def _model_and_batch(task: str):
    cfg = load_config(DEMO_CONFIG, [f"model.task={task}", "model.attention=reference"])
    torch.manual_seed(0)
    model = HSTUModel(cfg.model)
    batch = to_torch(make_global_batch(cfg, 6, (6, 4))[0])
    return model, batch


@pytest.mark.parametrize("task", ["retrieval", "ranking"])
def test_the_host_layout_and_the_one_read_back_give_the_same_loss(task):
    model, batch = _model_and_batch(task)
    assert batch.host_lengths is not None
    sent, sent_sums = model(batch.strip_padding(), 100)
    batch.host_lengths = None  # library use: the model reads the lengths back
    read, read_sums = model(batch.strip_padding(), 100)
    assert torch.equal(sent, read)
    assert all(torch.equal(sent_sums[m], read_sums[m]) for m in sent_sums)


# no kernel: views, and `lift_fresh` (the host-built layout wrapped as a tensor)
_VIEWS = {
    "view",
    "slice",
    "split_with_sizes",
    "unbind",
    "detach",
    "select",
    "unsqueeze",
    "lift_fresh",
}


class _Ops(TorchDispatchMode):
    """The ops a block dispatches, views (no kernel) left out."""

    def __init__(self):
        super().__init__()
        self.names: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket.__name__ not in _VIEWS:
            self.names.append(func.overloadpacket.__name__)
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("task", ["retrieval", "ranking"])
def test_the_step_builds_no_layout_on_the_device(task):
    """Built on the device, laying out the tokens took 62 ops before the stack (cumsums,
    segment expansions, gathers, the inverse scatter), each a kernel launched from Python;
    with the layout built on the host: the lookups, the two gathers through it and TorchRec's
    offsets."""
    model, batch = _model_and_batch(task)
    batch = batch.strip_padding()
    with _Ops() as ops:
        model.sequence(batch)
    assert len(ops.names) <= 12, ops.names
    assert not {"repeat_interleave", "scatter_", "arange", "index"} & set(ops.names), ops.names
    assert ops.names.count("index_select") == 2  # tokens and timestamps, through `inverse`


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_permute_rows_is_index_select_with_a_gather_for_its_gradient(dtype):
    """`permute_rows` gives `index_select`'s values and gradient, bit for bit, and its
    backward launches a gather where `index_select`'s adds every row into a zero buffer."""
    g = torch.Generator().manual_seed(0)
    perm = torch.randperm(50, generator=g)
    inv = torch.empty_like(perm)
    inv[perm] = torch.arange(50)
    x = torch.randn(50, 7, generator=g).to(dtype).requires_grad_()
    up = torch.randn(50, 7, generator=g).to(dtype)
    want = x.index_select(0, perm)
    (want_grad,) = torch.autograd.grad(want, x, up)
    got = permute_rows(x, perm, inv)
    assert torch.equal(got, want)

    class Ops(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.names = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.names.append(func.__name__)
            return func(*args, **(kwargs or {}))

    with Ops() as ops:
        (grad,) = torch.autograd.grad(got, x, up)
    assert torch.equal(grad, want_grad)
    assert not any("index_add" in n for n in ops.names), ops.names


def _eager_grads_and_adds(task: str) -> tuple[dict, int]:
    """One eager step's parameter gradients and the `index_add`s its backward ran."""
    model, batch = _model_and_batch(task)
    loss, _ = model(batch.strip_padding(), 100)
    with _Ops() as ops:
        loss.backward()
    grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    return grads, ops.names.count("index_add")


def _assert_same_grads(got: dict, want: dict) -> None:
    assert got.keys() == want.keys() and got
    differ = [n for n in want if not torch.equal(got[n], want[n])]
    assert not differ, differ


@pytest.mark.parametrize("task", ["retrieval", "ranking"])
def test_the_eager_step_differentiates_the_tokens_placement_by_a_gather(task, monkeypatch):
    """`model.sequence` (the eager path, e.g. with TorchRec-sharded tables) places the looked-up
    rows with `permute_rows`: every gradient bit for bit as through `index_select`, with one
    `index_add` (the placement's backward) fewer."""
    import hstu.torch_backend.model as model_module

    got, got_adds = _eager_grads_and_adds(task)
    monkeypatch.setattr(model_module, "permute_rows", lambda x, perm, inv: x.index_select(0, perm))
    want, want_adds = _eager_grads_and_adds(task)
    _assert_same_grads(got, want)
    assert got_adds == want_adds - 1, (got_adds, want_adds)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_select_distinct_rows_is_index_select_with_its_gradient_written_not_added(dtype):
    """`select_distinct_rows` gives `index_select`'s values and gradient for distinct rows,
    bit for bit, the gradient written into zeros (`index_copy_`) instead of added."""
    g = torch.Generator().manual_seed(1)
    rows = torch.randperm(40, generator=g)[:13]
    x = torch.randn(40, 5, generator=g).to(dtype).requires_grad_()
    up = torch.randn(13, 5, generator=g).to(dtype)
    want = x.index_select(0, rows)
    (want_grad,) = torch.autograd.grad(want, x, up)
    got = select_distinct_rows(x, rows)
    assert torch.equal(got, want)
    with _Ops() as ops:
        (grad,) = torch.autograd.grad(got, x, up)
    assert torch.equal(grad, want_grad)
    others = torch.ones(40, dtype=torch.bool)
    others[rows] = False
    assert torch.equal(grad[rows], up) and not grad[others].any()
    assert ops.names == ["new_zeros", "index_copy_"], ops.names


@pytest.mark.parametrize("task", ["retrieval", "ranking"])
def test_the_eager_step_writes_the_loss_rows_gradient(task, monkeypatch):
    """The stack's last residual stream and its pending residual read at the loss's rows
    (distinct): every gradient bit for bit as through `index_select`, with two `index_add`s
    (their backward) fewer."""
    import hstu.torch_backend.model as model_module

    got, got_adds = _eager_grads_and_adds(task)
    monkeypatch.setattr(model_module, "select_distinct_rows", lambda x, i: x.index_select(0, i))
    want, want_adds = _eager_grads_and_adds(task)
    _assert_same_grads(got, want)
    assert got_adds == want_adds - 2, (got_adds, want_adds)
