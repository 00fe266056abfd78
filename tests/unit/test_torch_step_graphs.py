"""`train.graph_scope=auto`: the whole torch step (lookups, loss, backward, norm, AdamW) over
padded static inputs gives the eager step's loss, metrics, gradients and update. On the CPU the
padded step runs eagerly (`capture=False`); on a GPU the captured graphs replay it."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("torchrec")

from test_torch_model import _cfg  # noqa: E402  (the small model with every bias)

from hstu.capacity import CapacityPolicy  # noqa: E402
from hstu.errors import HSTUError  # noqa: E402
from hstu.params import init_params  # noqa: E402
from hstu.pipeline import loss_tokens  # noqa: E402
from hstu.testing import make_global_batch  # noqa: E402
from hstu.torch_backend.batch import to_torch  # noqa: E402
from hstu.torch_backend.model import HSTUModel  # noqa: E402
from hstu.torch_backend.state import make_optimizer  # noqa: E402
from hstu.torch_backend.step_graphs import (  # noqa: E402
    HEADER_SIZE,
    StepGraphs,
    host_inputs,
    loss_rows_capacity,
)


def test_host_inputs_pad_the_layout_and_count_the_real_rows():
    lengths = {"contextual": np.array([1, 2]), "item": np.array([2, 1]), "candidate": [1, 3]}
    # sample 0: c0 | i0 a0 i1 a1 | k0 (6 tokens); sample 1: c0 c1 | i0 a0 | k0 k1 k2 (7 tokens)
    ranking = host_inputs(lengths, capacity=16, loss_rows=64, task="ranking", loss_tokens=9)
    header = ranking[:HEADER_SIZE]
    # source order: contextual (3) | items (3) | actions (3) | candidates (4)
    assert header[:7].tolist() == [0, 3, 6, 9, 13, 4, 9]
    rows = 2
    offsets = ranking[HEADER_SIZE : HEADER_SIZE + rows + 1]
    assert offsets.tolist() == [0, 6, 13]
    counts = ranking[HEADER_SIZE + rows + 1 : HEADER_SIZE + 2 * rows + 1].view(np.int32)
    assert counts.tolist() == [1, 2, 1, 3]  # num_contextual, then num_candidates
    start = HEADER_SIZE + 2 * rows + 1
    inverse = ranking[start : start + 16]
    # token 1 is sample 0's first item (source row 3), token 2 its action (source row 6)
    assert inverse[:3].tolist() == [0, 3, 6] and inverse[13:].tolist() == [13, 14, 15]
    assert sorted(inverse[:13].tolist()) == list(range(13))
    dest = ranking[start + 16 : start + 32]  # the token of each source row
    assert (inverse[dest] == np.arange(16)).all() and dest[3] == 1 and dest[6] == 2
    start += 16
    pos_cand = ranking[start + 16 : start + 16 + 64]
    assert pos_cand[:4].tolist() == [5, 10, 11, 12]
    # padding: the capacity's other tokens once each (no pile-up of gradient adds on one
    # row), zeros past them
    assert pos_cand[4:16].tolist() == [0, 1, 2, 3, 4, 6, 7, 8, 9, 13, 14, 15]
    assert not pos_cand[16:].any()
    retrieval = host_inputs(lengths, capacity=16, loss_rows=64, task="retrieval", loss_tokens=1)
    assert retrieval[5] == 1  # one target: sample 0's first event scores its second item
    query, item = retrieval[start + 16], retrieval[start + 16 + 64]
    assert (query, item) == (2, 4)  # the action token of event 0; the source row of item 1
    # the bound of the capacity and rows, whatever the batch; past it, a power of two
    assert loss_rows_capacity(1, 96, 8, "retrieval", None) == 48
    assert loss_rows_capacity(7, 96, 8, "ranking", 3) == 24
    assert loss_rows_capacity(25, 96, 8, "ranking", 3) == 32
    assert loss_rows_capacity(3, 16, 8, "ranking", 3) == 16


def _model(cfg):
    model = HSTUModel(cfg.model)
    model.load_params(init_params(cfg.model, seed=0))
    model.train()
    return model


@pytest.mark.parametrize("task", ["ranking", "retrieval"])
def test_the_padded_step_gives_the_eager_loss_metrics_and_gradients(task):
    """One static input refilled with a batch of fewer tokens than the last (stale ids, times,
    labels or negatives in the padding), every bias on: the eager model's loss, metric sums
    and gradients each time."""
    cfg = _cfg(task)
    model = _model(cfg)
    graphs = StepGraphs(model, None, list(model.parameters()), CapacityPolicy((64,)), 64, False)
    static, seen = None, []
    batches = [make_global_batch(cfg, 8, (4,), first_id=i)[0] for i in (0, 3, 9)]
    for batch in sorted(batches, key=lambda b: -int(b.seq_lengths().sum()))[::2]:
        glt = int(loss_tokens(batch, task).sum()) + 3  # a global count: other ranks' too
        tb = to_torch(batch).strip_padding()
        model.zero_grad(set_to_none=True)
        want_loss, want_sums = model(tb, glt)
        want_loss.backward()
        want = {n: p.grad.clone() for n, p in model.named_parameters()}
        model.zero_grad(set_to_none=True)
        keys = ("contextual", "item", "candidate")
        lengths = {k: tb.host_lengths[tb.keys.index(k)] for k in keys}
        static = static or graphs._static(64, tb.batch_size, 64)
        graphs._fill(static, tb, lengths, glt)
        loss, sums, (ids, rows, small) = graphs.loss(static)
        assert small is None  # the small tables' marks: data_parallel Adam only
        loss.backward()
        assert graphs.table.grad is None  # its gradient is its looked-up rows'
        keep = ids >= 0
        assert not rows.grad[~keep].any()  # what the update skips has no gradient
        graphs.table.grad = torch.zeros_like(graphs.table).index_add_(0, ids[keep], rows.grad[keep])
        seen.append(int(static.views()["tokens"]))
        assert float(loss.detach()) == pytest.approx(float(want_loss), rel=1e-6)
        assert list(sums) == list(want_sums)
        for name, value in want_sums.items():
            assert float(sums[name]) == pytest.approx(float(value), abs=1e-6), name
        for name, p in model.named_parameters():
            got = p.grad if p.grad is not None else torch.zeros_like(p)
            torch.testing.assert_close(got, want[name], rtol=1e-5, atol=1e-7, msg=name)
    assert seen[0] > seen[1], seen  # the second batch left stale values in the padding


def _backend(cfg, step_graphs: bool):
    from hstu.torch_backend.train_step import TorchBackend

    torch.manual_seed(0)
    backend = TorchBackend(cfg, 0, 1, "cpu")
    if step_graphs:
        backend.use_cuda_graphs(CapacityPolicy((48, 96)), capture=False)
    return backend


DATA_PARALLEL_ADAM = (
    "embedding.sharding=data_parallel",
    "embedding.optimizer=adam",
    "embedding.lr=0.01",
    "embedding.weight_decay=0.1",
)


@pytest.mark.parametrize(
    "task,tables",
    # retrieval's step graph (~12 s on 2 cores) runs with the end-to-end tests (make test-slow)
    [
        ("ranking", "dense"),
        ("ranking", "data_parallel_adam"),
        pytest.param("retrieval", "dense", marks=pytest.mark.slow),
        pytest.param("retrieval", "data_parallel_adam", marks=pytest.mark.slow),
    ],
)
def test_the_backend_trains_from_step_graphs_as_the_eager_step(task, tables):
    """Four steps across two capacities and a batch past the length bound (eager) through
    `TorchBackend`: the metrics, the step-graph count and the updated parameters as the eager
    backend's; `grads()` after a graphed step is a clear error. data_parallel Adam: the graph
    updates the touched rows of every table only, as the eager step."""
    extra = DATA_PARALLEL_ADAM if tables == "data_parallel_adam" else ()
    cfg = _cfg(task, "model.dropout=0.0", "train.weight_decay=0.1", *extra)
    runs = {}
    for graphed in (False, True):
        backend = _backend(cfg, graphed)
        metrics, seen = [], []
        for i, real in enumerate((2, 6, 2, 5)):
            batch = make_global_batch(cfg, cfg.data.batch_size, (real,), first_id=7 * i)[0]
            seen.append(batch)
            if i == 3 and graphed:
                backend.step_graphs.max_seqlen = 1  # every sample past the bound: eager
            glt = int(loss_tokens(batch, task).sum())
            handle = backend.forward_backward(backend.to_device([batch]), glt)
            if graphed and i == 0:
                with pytest.raises(HSTUError, match="graph_scope=stack"):
                    backend.grads()
            metrics.append(backend.fetch_metrics(backend.optimizer_step(handle)))
        runs[graphed] = (metrics, backend.model.export_params(), backend)
    (want, want_p, _), (got, got_p, backend) = runs[False], runs[True]
    assert backend.step_graphs.fused_update  # AdamW and the norm in one launch (interpreted)
    assert len(backend.step_graphs.graphs) == 2, list(backend.step_graphs.graphs)
    assert backend.step_graphs.eager_steps == 1
    # the eager step of the last batch runs the stack from its own graphs (one more)
    assert [m["num_compiles"] for m in got] == [1, 2, 2, 3]
    for w, g in zip(want, got, strict=True):
        for name, value in w.items():
            assert g[name] == pytest.approx(value, rel=1e-5, abs=1e-6), name
    # AdamW magnifies rounding-sized gradient differences of near-zero elements up to a whole
    # step (lr): held to 5 % of it per step; a stale input or a missed update moves whole steps
    for name, value in want_p.items():
        assert np.abs(got_p[name] - value).max() < 4 * 0.05 * cfg.train.lr, name
    if extra:  # rows no batch looked up, and their moments, are the init's exactly
        init = init_params(cfg.model, cfg.train.seed)
        state = backend.tables.state
        assert backend.tables.count == 4 and float(backend.tables.t) == 4
        keys = {"item": ("item", "candidate", "negative"), "contextual": ("contextual",)}
        keys["action"] = ("action",)
        for table, features in keys.items():
            name = f"embedding.{table}"
            ids = [np.asarray(b.values[f]) for b in seen for f in features if f in b.values]
            touched = np.zeros(init[name].shape[0], bool)
            touched[np.concatenate(ids)] = True
            assert touched.any() and not touched.all(), name
            # weight decay moves every touched row, nothing moves another
            np.testing.assert_array_equal(np.any(got_p[name] != init[name], axis=1), touched)
            assert not state[name]["m"].numpy()[~touched].any(), name


def test_init_state_leaves_parameters_and_moments_as_they_were():
    cfg = _cfg("ranking")
    model = _model(cfg)
    params = list(model.parameters())
    optimizer = make_optimizer(params, cfg.train)
    before = model.export_params()
    graphs = StepGraphs(model, optimizer, params, CapacityPolicy((64,)), 64, False)
    graphs._init_state()
    after = model.export_params()
    for name, value in before.items():
        np.testing.assert_array_equal(after[name], value, err_msg=name)
    for p in params:
        state = optimizer.state[p]
        assert float(state["step"]) == 0
        assert not state["exp_avg"].any() and not state["exp_avg_sq"].any()
        assert p.grad is None


@pytest.mark.gpu
@pytest.mark.parametrize(
    "task,tables,backward",
    [
        ("ranking", "dense", "auto"),
        ("retrieval", "dense", "auto"),
        ("ranking", "data_parallel_adam", "auto"),
        ("ranking", "dense", "stored"),
    ],
)
def test_captured_step_graphs_train_as_the_eager_step(task, tables, backward):
    """On a GPU: six steps alternating between two capacities (graphs sharing one pool,
    replayed out of capture order) from captured step graphs, against the eager step: the
    same losses, metrics and parameters (to rounding); also with the attention's "stored"
    backward (its dS buffer allocated inside each capture)."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU (run on the GPU machine)")
    from hstu.torch_backend.train_step import TorchBackend

    extra = DATA_PARALLEL_ADAM if tables == "data_parallel_adam" else ()
    cfg = _cfg(
        task, "model.attention=kernel", "model.dropout=0.0", "train.weight_decay=0.1",
        f"model.attention_backward={backward}", *extra,
    )  # fmt: skip
    runs = {}
    for graphed in (False, True):
        torch.manual_seed(0)
        backend = TorchBackend(cfg, 0, 1, "cuda")
        if graphed:
            backend.use_cuda_graphs(CapacityPolicy((32, 128)))
        metrics = []
        for step in range(6):
            real = (2, 8)[step % 2]
            batch = make_global_batch(cfg, cfg.data.batch_size, (real,), first_id=8 * step)[0]
            glt = int(loss_tokens(batch, task).sum())
            handle = backend.forward_backward(backend.to_device([batch]), glt)
            metrics.append(backend.fetch_metrics(backend.optimizer_step(handle)))
        runs[graphed] = (metrics, backend.model.export_params(), backend)
    (want, want_p, _), (got, got_p, backend) = runs[False], runs[True]
    assert backend.step_graphs.num_graphs == 2 and backend.step_graphs.eager_steps == 0
    for w, g in zip(want, got, strict=True):
        for name, value in w.items():
            assert g[name] == pytest.approx(value, rel=1e-4, abs=1e-5), name
    for name, value in want_p.items():
        assert np.abs(got_p[name] - value).max() < 6 * 0.05 * cfg.train.lr, name


def test_the_update_keeps_the_stack_copies_in_the_compute_dtype():
    """bf16 with the one-launch update: the stack's linears read copies of their parameters
    in bf16 that the update writes with them (no copy made per step); a parameter written
    outside the update (a load) is copied again before the next step reads it, so that step
    has the eager backend's loss."""
    cfg = _cfg("ranking", "model.dtype=bfloat16", "model.dropout=0.0", *DATA_PARALLEL_ADAM)
    graphed, eager = _backend(cfg, True), _backend(cfg, False)
    sg = graphed.step_graphs
    assert sg.fused_update and sg.copies is not None

    def marks():
        return [(p._version, p.data_ptr()) for p in sg.copy_params]

    def step(backend, i, real):
        batch = make_global_batch(cfg, cfg.data.batch_size, (real,), first_id=7 * i)[0]
        glt = int(loss_tokens(batch, "ranking").sum())
        handle = backend.forward_backward(backend.to_device([batch]), glt)
        return backend.fetch_metrics(backend.optimizer_step(handle))

    for i, real in enumerate((2, 6)):
        step(graphed, i, real)
        assert sg._copied == marks()  # written by the update: nothing to copy again
        for p, c in zip(sg.copy_params, sg.copies, strict=True):
            # the parameter rounded (the interpreter rounds toward zero, CUDA to nearest)
            assert ((c.float() - p.detach()).abs() <= p.detach().abs() * 2.0**-7).all()
    loaded = {
        n: (2.0 * v if n.startswith("layers.") and ".uvqk." in n else v)
        for n, v in graphed.model.export_params().items()
    }
    for backend in (graphed, eager):
        backend.model.load_params(loaded)
    assert sg._copied != marks()
    got, want = step(graphed, 2, 4), step(eager, 2, 4)
    assert got["loss"] == pytest.approx(want["loss"], rel=2e-2)
