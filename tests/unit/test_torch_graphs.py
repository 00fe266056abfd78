"""`train.cuda_graphs`: the HSTU stack padded to a token capacity gives the eager loss and
gradients (CPU: the padded stack run eagerly); on a GPU, the captured graphs replayed across
alternating capacities train as the eager model does."""

from __future__ import annotations

import os

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("torchrec")

from test_torch_model import _cfg  # noqa: E402  (the same small model with every bias)

from hstu.capacity import CapacityPolicy  # noqa: E402
from hstu.config import load_config  # noqa: E402
from hstu.errors import HSTUError  # noqa: E402
from hstu.params import init_params  # noqa: E402
from hstu.testing import DEMO_CONFIG, make_global_batch  # noqa: E402
from hstu.torch_backend.batch import to_torch  # noqa: E402
from hstu.torch_backend.graphs import GraphedStack  # noqa: E402
from hstu.torch_backend.model import HSTUModel, LayerNorm  # noqa: E402


def _loss_and_grads(model, tb, glt: int = 10):
    model.zero_grad(set_to_none=True)
    loss, _ = model(tb, glt)
    loss.backward()
    return float(loss.detach()), {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("fused_norm", [False, True], ids=["torch_norm", "fused_norm"])
@pytest.mark.parametrize("task", ["ranking", "retrieval"])
def test_padded_stack_gives_the_eager_loss_and_gradients(task, fused_norm):
    cfg = _cfg(task)
    model = HSTUModel(cfg.model)
    model.load_params(init_params(cfg.model, seed=0))
    if fused_norm:  # the Triton norms (interpreted on CPU), as `model.fused_norm` on CUDA
        for m in model.modules():
            if isinstance(m, LayerNorm):
                m.fused = True
    # the batches hold 13, 38 and 59 tokens: each is padded, the last past every capacity
    policy = CapacityPolicy((16, 40))
    graphed = GraphedStack(model, policy, cfg.data.max_seqlen, capture=False)
    for i, real in enumerate((2, 5, 8)):
        tb = to_torch(make_global_batch(cfg, 8, (real,), first_id=10 * i)[0]).strip_padding()
        model.graphed = None
        want_loss, want = _loss_and_grads(model, tb)
        model.graphed = graphed
        got_loss, got = _loss_and_grads(model, tb)
        assert got_loss == pytest.approx(want_loss, rel=1e-6)
        for name, g in want.items():
            torch.testing.assert_close(got[name], g, rtol=1e-5, atol=1e-6, msg=name)
    assert sorted(c for c, _ in graphed.graphs) == [16, 40, 256] and graphed.eager_steps == 0


def test_a_sample_past_the_bound_runs_eagerly_with_the_same_numbers():
    cfg = _cfg("ranking")
    model = HSTUModel(cfg.model)
    model.load_params(init_params(cfg.model, seed=0))
    tb = to_torch(make_global_batch(cfg, 4, (4,))[0]).strip_padding()
    want_loss, want = _loss_and_grads(model, tb)
    model.graphed = GraphedStack(model, CapacityPolicy((256,)), max_seqlen=3, capture=False)
    got_loss, got = _loss_and_grads(model, tb)
    assert got_loss == want_loss
    assert model.graphed.eager_steps == 1 and model.graphed.num_graphs == 0
    with torch.no_grad():  # evaluation never replays a graph
        model.eval()
        model(tb, 10)
    assert model.graphed.eager_steps == 1 and model.graphed.num_graphs == 0


def test_cuda_graphs_without_cuda_is_a_config_error(tmp_path):
    from hstu.torch_backend.launch import train

    cfg = load_config(
        DEMO_CONFIG,
        ["train.cuda_graphs=true", "dist.device=cpu", "train.steps=1", f"output_dir={tmp_path}"],
    )
    with pytest.raises(HSTUError, match="train.cuda_graphs=true needs CUDA"):
        train(cfg)


@pytest.mark.parametrize(
    ("choice", "graphs", "device", "before", "after"),
    [
        ("auto", True, "cuda", None, ":0:0"),  # graphs: no workspace
        ("auto", False, "cuda", None, None),  # eager: torch's default
        ("none", False, "cuda", None, ":0:0"),
        ("torch", True, "cuda", None, None),
        ("auto", True, "cpu", None, None),  # no cuBLAS: nothing set
        ("none", True, "cuda", ":4096:8", ":4096:8"),  # the environment's value wins
    ],
)
def test_cublas_workspace_is_set_for_graphed_runs_unless_the_environment_has_one(
    monkeypatch, choice, graphs, device, before, after
):
    from hstu.torch_backend.graphs import CUBLAS_WORKSPACE_ENV, set_cublas_workspace

    if before is None:
        monkeypatch.delenv(CUBLAS_WORKSPACE_ENV, raising=False)
    else:
        monkeypatch.setenv(CUBLAS_WORKSPACE_ENV, before)
    cfg = load_config(
        DEMO_CONFIG, [f"train.cublas_workspace={choice}", f"train.cuda_graphs={graphs}"]
    )
    assert set_cublas_workspace(cfg, device) == after
    assert os.environ.get(CUBLAS_WORKSPACE_ENV) == after


def test_cublas_workspace_takes_auto_none_or_torch():
    with pytest.raises(HSTUError, match="cublas_workspace"):
        load_config(DEMO_CONFIG, ["train.cublas_workspace=small"])


def _grads(model):
    return {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.gpu
def test_graphs_train_as_the_eager_model_across_capacities():
    """Six steps whose batches alternate between two capacities (so graphs share their pool
    and replay out of capture order): every replayed step's gradients as the eager model's on
    the same parameters, and the losses and updated parameters as the eager run's."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU (run on the GPU machine)")
    from hstu.torch_backend.state import make_optimizer

    cfg = _cfg("ranking", "model.attention=kernel")
    runs = {}
    for graphs in (False, True):
        torch.manual_seed(0)
        model = HSTUModel(cfg.model, "cuda")
        model.load_params(init_params(cfg.model, seed=0))
        opt = make_optimizer(list(model.parameters()), cfg.train)
        policy = CapacityPolicy((32, 128))  # 2 samples: < 32 tokens; 8: 32 to 128
        graphed = GraphedStack(model, policy, cfg.data.max_seqlen) if graphs else None
        losses = []
        for step in range(6):
            real = (2, 8)[step % 2]
            tb = to_torch(make_global_batch(cfg, 8, (real,), first_id=8 * step)[0])
            tokens = sum(tb.length_per_key()[tb.keys.index(k)] for k in ("contextual", "candidate"))
            tokens += 2 * tb.length_per_key()[tb.keys.index("item")]
            assert policy.capacity(tokens) == (32, 128)[step % 2]
            tb = tb.to("cuda").strip_padding()
            if graphs:  # the eager gradients at these parameters, then the replay's
                model.graphed = None
                model(tb, 10)[0].backward()
                eager = _grads(model)
                opt.zero_grad(set_to_none=True)
                model.graphed = graphed
            loss, _ = model(tb, 10)
            loss.backward()
            if graphs:
                # rounding only: the padded matmuls reduce over more (zero) tokens, and cuBLAS
                # may pick other kernels for them
                for name, g in _grads(model).items():
                    torch.testing.assert_close(
                        g, eager[name], rtol=1e-4, atol=1e-6, msg=f"step {step}: {name}"
                    )
            opt.step()
            opt.zero_grad(set_to_none=True)
            losses.append(float(loss.detach()))
            del loss  # the step's autograd graph ends here, as in training
        runs[graphs] = (losses, model.export_params(), graphed)
    (want, want_p, _), (got, got_p, graphed) = runs[False], runs[True]
    assert graphed.num_graphs == 2 and graphed.eager_steps == 0
    assert got == pytest.approx(want, rel=1e-5)
    # AdamW turns a rounding-sized change of a near-zero gradient element into up to a whole
    # step (lr * g / (|g| + eps)): the runs' parameters are held to 5 % of one step. A replay
    # of stale inputs or a clobbered pool moves them by whole steps (and fails the gradients).
    for name, value in want_p.items():
        assert abs(got_p[name] - value).max() < 0.05 * cfg.train.lr, name
