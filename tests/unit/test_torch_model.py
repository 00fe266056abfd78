"""The torch HSTU model: core parameters in and out, the math of docs/MODEL.md checked against
a per-sample float64 numpy transcription, and learning on one process."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("torchrec")

from hstu.config import load_config  # noqa: E402
from hstu.errors import HSTUError  # noqa: E402
from hstu.params import init_params, param_shapes  # noqa: E402
from hstu.testing import DEMO_CONFIG, make_global_batch  # noqa: E402
from hstu.torch_backend.batch import to_torch  # noqa: E402
from hstu.torch_backend.model import HSTUModel  # noqa: E402


def _cfg(task: str, *extra: str):
    return load_config(
        DEMO_CONFIG,
        [
            f"model.task={task}",
            "model.rab_position_buckets=6",
            "model.rab_time_buckets=5",
            "model.num_negatives=4",
            "data.max_history=6",
            "data.max_candidates=3",
            *extra,
        ],
    )


# --------------------------------------------------------------- numpy transcription of MODEL.md
def _ln(x, scale, bias):
    mu = x.mean(-1, keepdims=True)
    var = ((x - mu) ** 2).mean(-1, keepdims=True)
    return (x - mu) / np.sqrt(var + 1e-6) * scale + bias


def _silu(x):
    return x / (1 + np.exp(-x))


def _sample_loss(p, m, s) -> float:
    """Loss sum of one sample, written from docs/MODEL.md and kernels/README.md, float64."""
    p = {k: v.astype(np.float64) for k, v in p.items()}
    c, n_hist, n_cand = len(s["contextual"]), len(s["item"]), len(s["candidate"])
    rows, times = [], []
    for t in range(c):
        rows.append(p["embedding.contextual"][s["contextual"][t]])
        times.append(0)
    for i in range(n_hist):
        rows += [p["embedding.item"][s["item"][i]], p["embedding.action"][s["action"][i]]]
        times += [s["item_time"][i]] * 2
    for i in range(n_cand):
        rows.append(p["embedding.item"][s["candidate"][i]])
        times.append(s["candidate_time"][i])
    x, ts, n = np.stack(rows), np.asarray(times), len(rows)
    h, dqk, dv = m.num_heads, m.attention_dim, m.linear_dim
    for layer in range(m.num_layers):
        q_ = f"layers.{layer}."
        hid = _ln(x, p[q_ + "input_norm.scale"], p[q_ + "input_norm.bias"])
        uvqk = _silu(hid @ p[q_ + "uvqk.kernel"] + p[q_ + "uvqk.bias"])
        u, v, q, k = np.split(uvqk, np.cumsum([h * dv, h * dv, h * dqk]), axis=1)
        att = np.zeros((n, h, dv))
        for i in range(n):
            for j in range(n):
                if not (i == j or (j < n - n_cand and (j <= i or i < c))):
                    continue
                for hh in range(h):
                    z = (
                        m.resolved_alpha
                        * q[i, hh * dqk : (hh + 1) * dqk]
                        @ k[j, hh * dqk : (hh + 1) * dqk]
                    )
                    z += p[q_ + "rab_position"][hh, min(abs(i - j), m.rab_position_buckets - 1)]
                    bucket = min(
                        int(np.floor(np.log2(1 + abs(ts[i] - ts[j])))), m.rab_time_buckets - 1
                    )
                    z += p[q_ + "rab_time"][hh, bucket]
                    att[i, hh] += _silu(z) / m.normalizer * v[j, hh * dv : (hh + 1) * dv]
        y = _ln(att.reshape(n, h * dv), p[q_ + "attn_norm.scale"], p[q_ + "attn_norm.bias"]) * u
        x = x + y @ p[q_ + "output.kernel"] + p[q_ + "output.bias"]
    z = _ln(x, p["final_norm.scale"], p["final_norm.bias"])
    if m.task == "ranking":
        zc = z[c + 2 * n_hist :]
        logits = (
            _silu(zc @ p["head.hidden.kernel"] + p["head.hidden.bias"]) @ p["head.out.kernel"]
            + p["head.out.bias"]
        )
        labels = (s["label"][:, None] >> np.arange(m.num_tasks)) & 1
        return float(np.sum(np.logaddexp(0, logits) - labels * logits))
    total, r = 0.0, m.num_negatives

    def norm(a):
        return a / max(np.linalg.norm(a), 1e-6)

    for i in range(n_hist - 1):
        query = norm(z[c + 2 * i + 1])
        pos_id, negs = s["item"][i + 1], s["negative"][i * r : (i + 1) * r]
        logits = [query @ norm(p["embedding.item"][pos_id])]
        logits += [query @ norm(p["embedding.item"][g]) if g != pos_id else -np.inf for g in negs]
        logits = np.asarray(logits) / m.retrieval_temperature
        total += np.logaddexp.reduce(logits) - logits[0]
    return float(total)


@pytest.mark.parametrize("task", ["ranking", "retrieval"])
def test_forward_matches_hand_written_math(task):
    cfg = _cfg(task)
    params = init_params(cfg.model, seed=3)
    for name in params:  # non-trivial norms and biases, so every term is exercised
        if not name.startswith("embedding."):
            params[name] = params[name] + 0.05 * np.random.default_rng(len(name)).normal(
                size=params[name].shape
            ).astype(np.float32)
    batch = make_global_batch(cfg, 4, (3,), first_id=11)[0]
    model = HSTUModel(cfg.model)
    model.load_params(params)
    loss, _ = model(to_torch(batch).strip_padding(), global_loss_tokens=1)
    want = 0.0
    for b in range(batch.actual_batch_size):
        one = batch.index_select([b])
        sample = {k: one.values[k] for k in one.keys}
        want += _sample_loss(params, cfg.model, sample)
    assert float(loss.detach()) == pytest.approx(want, rel=2e-5)


@pytest.mark.parametrize("task", ["ranking", "retrieval"])
def test_one_lookup_per_table_equals_torchrecs_lookup_per_feature(task, monkeypatch):
    """The replicated tables are read one call per table (item, candidate and negative ids
    together): the same rows as EmbeddingCollection's call per feature, the same table
    gradients, and one dense gradient computed for the item table instead of one per feature."""
    cfg = _cfg(task)
    model = HSTUModel(cfg.model)
    model.load_params(init_params(cfg.model, seed=0))
    tb = to_torch(make_global_batch(cfg, 8, (5,), first_id=3)[0]).strip_padding()
    ids = tb.kjt.to_dict()
    features = [f for t in model.embedding.embedding_configs() for f in t.feature_names]
    ours = model._lookup(ids)
    assert (
        set(ours)
        == set(features)
        == (
            {"item", "candidate", "action", "contextual"}
            | ({"negative"} if task == "retrieval" else set())
        )
    )
    theirs = model.embedding(tb.kjt)
    grads = []
    for rows in (ours, {f: theirs[f].values() for f in features}):
        model.zero_grad()
        loss = sum(
            (r * torch.arange(r.numel()).reshape(r.shape).sin()).sum() for r in rows.values()
        )
        loss.backward()
        grads.append({n: p.grad.clone() for n, p in model.embedding.named_parameters()})
    for f in features:
        assert torch.equal(ours[f], theirs[f].values()), f
    for name in grads[0]:
        torch.testing.assert_close(grads[0][name], grads[1][name], rtol=1e-6, atol=1e-6)
    calls = []
    lookup = torch.nn.functional.embedding
    monkeypatch.setattr(
        torch.nn.functional,
        "embedding",
        lambda i, w, *a, **k: calls.append(w.shape) or lookup(i, w),
    )
    model._lookup(ids)
    assert len(calls) == 3  # item (with candidate / negative ids), action, contextual


def test_params_load_and_export_identically():
    for task in ("ranking", "retrieval"):
        cfg = _cfg(task)
        params = init_params(cfg.model, seed=0)
        model = HSTUModel(cfg.model)
        model.load_params(params)
        out = model.export_params()
        assert set(out) == set(param_shapes(cfg.model)) == set(params)
        for name, value in params.items():
            assert out[name].dtype == np.float32 and out[name].tobytes() == value.tobytes(), name
        assert "embedding.item" in out and "embedding.embeddings.item.weight" not in out
    bad = dict(params)
    bad["final_norm.scale"] = np.ones(3, np.float32)
    with pytest.raises(HSTUError, match="final_norm.scale"):
        model.load_params(bad)
    with pytest.raises(HSTUError, match="missing"):
        model.load_params({k: v for k, v in params.items() if k != "final_norm.bias"})


@pytest.mark.parametrize("task", ["ranking", "retrieval"])
def test_outputs_finite_and_loss_decreases(task):
    cfg = _cfg(task, "data.max_history=24")
    model = HSTUModel(cfg.model)
    model.load_params(init_params(cfg.model, seed=0))
    batch = make_global_batch(cfg, 8, (7,))[0]
    tb = to_torch(batch).strip_padding()
    x, _ = model.sequence(tb)
    assert x.shape == (batch.num_real_tokens(), cfg.model.embedding_dim)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses = []
    for _ in range(6):
        loss, metrics = model(tb, global_loss_tokens=int(batch.lengths["candidate"].sum()))
        assert torch.isfinite(loss) and all(torch.isfinite(v) for v in metrics.values())
        opt.zero_grad()
        loss.backward()
        assert all(p.grad is None or torch.isfinite(p.grad).all() for p in model.parameters())
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0]
    # an all-padding batch gives a zero loss that still back-propagates
    empty = make_global_batch(cfg, 8, (0,))[0]
    loss, _ = model(to_torch(empty), global_loss_tokens=0)
    assert loss.item() == 0.0


def test_kernel_switch_needs_cuda_or_interpreter(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(HSTUError, match="model.attention=kernel"):
        HSTUModel(_cfg("ranking", "model.attention=kernel").model, "cpu")


@pytest.mark.parametrize("bias_grads", [True, False], ids=["bias-grads", "no-bias"])
def test_the_fused_and_stored_attention_backwards_train_like_the_split_one(
    bias_grads, spy_launches
):
    """`model.attention_backward` reaches the Triton kernel (interpreted here): fused, stored
    and split give the same loss and gradients; with bias tables that need gradients the
    kernel runs split (the dq kernel reduces them), without biases the fused kernel and the
    stored backward's dq kernel."""
    import hstu_kernels.triton._launch as launch

    biases = [] if bias_grads else ["model.rab_position_buckets=0", "model.rab_time_buckets=0"]
    grads, launched = {}, []
    kernels = ("_hstu_bwd_dq_kernel", "_hstu_bwd_fused_kernel", "_hstu_bwd_dq_stored_kernel")
    for mode in ("split", "fused", "stored"):
        spies = {n: spy_launches(launch, n) for n in kernels}
        cfg = _cfg("ranking", "model.num_layers=1", "model.attention=kernel", *biases)
        cfg.model.attention_backward = mode
        model = HSTUModel(cfg.model)
        model.load_params(init_params(cfg.model, seed=0))
        loss, _ = model(to_torch(make_global_batch(cfg, 4, (4,))[0]), 10)
        loss.backward()
        grads[mode] = (float(loss), {n: p.grad.clone() for n, p in model.named_parameters()})
        launched += [n for n, spy in spies.items() if spy.grids]
    if bias_grads:
        assert launched == ["_hstu_bwd_dq_kernel"] * 3
    else:
        assert launched == list(kernels)
    for mode in ("fused", "stored"):
        assert grads[mode][0] == grads["split"][0]
        for name, g in grads["split"][1].items():
            np.testing.assert_allclose(
                grads[mode][1][name], g, rtol=1e-5, atol=1e-6, err_msg=f"{mode}: {name}"
            )


@pytest.mark.slow  # ~8 s interpreted: the default tier keeps the kernels' own tests
def test_the_fused_kernels_give_torchs_loss_and_gradients():
    """`model.fused_norm` and `model.fused_silu`'s kernels (interpreted here, as on CUDA):
    each layer's residual add in the next norm (`add_layer_norm`, the last in the final norm),
    the gated norm inside the attention op (u's gradient written in place) and the uvqk
    projection's SiLU backward with its bias gradient give eager torch's loss and gradients;
    so does `model.silu_epilogues`' op (SiLU's backward in the kernels' epilogues)."""
    from hstu.torch_backend.attention import get_uvqk_attention
    from hstu.torch_backend.model import LayerNorm

    cfg = _cfg("ranking", "model.num_layers=2", "model.attention=kernel")
    results = []
    for fused in (False, True, "epilogues"):
        model = HSTUModel(cfg.model)
        assert not any(layer.fused_silu for layer in model.layers)  # CPU: eager by default
        assert not any(layer.linear_uvqk_attention for layer in model.layers)
        model.load_params(init_params(cfg.model, seed=0))
        for m in model.modules():
            if isinstance(m, LayerNorm):
                m.fused = bool(fused)
        for layer in model.layers:
            layer.fused_silu = bool(fused)
            if fused == "epilogues":  # `model.silu_epilogues`: SiLU's backward in the kernels
                layer.linear_uvqk_attention = get_uvqk_attention("kernel", "cpu", linear=True)
        loss, _ = model(to_torch(make_global_batch(cfg, 4, (4,))[0]), 10)
        loss.backward()
        results.append((float(loss), {n: p.grad.clone() for n, p in model.named_parameters()}))
    (want_loss, want), *fused_results = results
    for got_loss, got in fused_results:
        assert got_loss == pytest.approx(want_loss, rel=1e-6)
        for name, g in want.items():
            np.testing.assert_allclose(got[name], g, rtol=1e-4, atol=1e-6, err_msg=name)
        assert any(float(g.abs().max()) > 0 for n, g in got.items() if "attn_norm" in n)
        assert all(float(g.abs().max()) > 0 for n, g in got.items() if "uvqk.bias" in n)


def test_the_tf32_head_op_has_addmms_gradients():
    """`_Tf32Addmm` (the ranking head's fp32 matmuls on CUDA) differentiates as `addmm`; on
    the CPU, where the TF32 setting means nothing, bit for bit."""
    from hstu.torch_backend.model import _Tf32Addmm

    g = torch.Generator().manual_seed(0)
    x, k, b, dy = (torch.randn(*s, generator=g) for s in ((7, 5), (5, 3), (3,), (7, 3)))
    got, want = [], []
    for fn, out in ((_Tf32Addmm.apply, got), (lambda x, k, b: torch.addmm(b, x, k), want)):
        args = [t.clone().requires_grad_() for t in (x, k, b)]
        y = fn(*args)
        y.backward(dy)
        out += [y.detach(), *(a.grad for a in args)]
    for a, e in zip(got, want, strict=True):
        assert torch.equal(a, e)
    assert torch.backends.cuda.matmul.allow_tf32 is False  # the process's setting, restored


def _linear_grads(linear, x, dy, reduced=None):
    """`(y, dx, dkernel, dbias)` of one `Linear` call."""
    x = x.clone().requires_grad_()
    linear.zero_grad(set_to_none=True)
    y = linear(x, reduced)
    y.backward(dy)
    return y.detach(), x.grad, linear.kernel.grad, linear.bias.grad


def test_a_bf16_linear_differentiates_as_its_cast_parameters():
    """A bf16 `x` through an fp32 `Linear` (`_ReducedAddmm`): the output and `dx` of
    `addmm(bias.bf16, x, kernel.bf16)` bit for bit, the kernel's gradient too on the CPU
    (there the product is rounded to bf16, then widened, as autograd of the casts does), the
    bias gradient the fp32 column sum of `dy` (autograd rounds it to bf16 first); copies made
    beforehand for a whole stack (`reduced_weights`) give the same."""
    from hstu.torch_backend.model import Linear, reduced_weights

    g = torch.Generator().manual_seed(0)
    linear = Linear(48, 40)
    with torch.no_grad():
        linear.kernel.copy_(torch.randn(48, 40, generator=g))
        linear.bias.copy_(torch.randn(40, generator=g))
    x = torch.randn(33, 48, generator=g).bfloat16()
    dy = torch.randn(33, 40, generator=g).bfloat16()
    k, b = (linear.kernel.detach().requires_grad_(), linear.bias.detach().requires_grad_())
    xw = x.clone().requires_grad_()
    want = torch.addmm(b.bfloat16(), xw, k.bfloat16())
    want.backward(dy)
    got = _linear_grads(linear, x, dy)
    assert got[0].dtype == torch.bfloat16 and got[2].dtype == got[3].dtype == torch.float32
    for a, e in zip(got[:3], (want.detach(), xw.grad, k.grad), strict=True):
        assert torch.equal(a, e)
    assert torch.equal(got[3], dy.float().sum(0))
    np.testing.assert_allclose(got[3], b.grad, rtol=2**-8)  # autograd's, rounded to bf16
    assert not torch.equal(got[3], b.grad)
    precast = _linear_grads(linear, x, dy, reduced_weights([linear], torch.bfloat16)[0])
    for a, e in zip(precast, got, strict=True):
        assert torch.equal(a, e)


def test_the_stack_casts_its_weights_once_and_trains_as_layer_by_layer():
    """A bf16 stack (`run_stack`) makes every linear's bf16 copy in one multi-tensor copy
    before its first layer (not one cast per parameter in each layer, forward and backward)
    and gives the loss and gradients of layers that cast their own."""
    from hstu.torch_backend import model as model_module

    cfg = _cfg("ranking", "model.num_layers=2", "model.dtype=bfloat16")
    batch = make_global_batch(cfg, 4, (4,))[0]
    calls, results = [], []
    real = model_module.reduced_weights

    def spy(linears, dtype):
        calls.append(len(linears))
        return real(linears, dtype)

    for per_layer in (False, True):
        model = HSTUModel(cfg.model)
        model.load_params(init_params(cfg.model, seed=0))
        x, seq = model.sequence(to_torch(batch))
        calls.clear()
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(model_module, "reduced_weights", spy)
            if per_layer:
                pending = None
                for layer in model.layers:
                    x, pending = layer(x, seq, pending)
                z = model.final_norm.add(x, pending)[1].float()
            else:
                z = model.stack(x, seq)
        assert calls == ([2, 2] if per_layer else [4])
        z.square().sum().backward()
        results.append((z.detach(), {n: p.grad for n, p in model.named_parameters()}))
    (want_z, want), (got_z, got) = results
    assert torch.equal(got_z, want_z)
    for name, grad in want.items():
        assert (grad is None) == (got[name] is None), name
        if grad is not None:
            assert got[name].dtype == torch.float32, name
            assert torch.equal(got[name], grad), name


@pytest.mark.gpu
def test_a_bf16_linears_weight_gradient_is_the_gemms_fp32_accumulator_on_cuda():
    """On CUDA the kernel's gradient of a bf16 linear is cuBLAS's fp32 accumulator
    (`out_dtype`), within fp32 summation error of float64, where rounding it to bf16 first
    would leave ~2e-3; the uvqk linear with SiLU (`linear_silu`) the same."""
    from hstu_kernels.triton.linear_silu import linear_silu

    from hstu.torch_backend.model import Linear, reduced_weights

    g = torch.Generator().manual_seed(0)
    linear = Linear(256, 512).cuda()
    with torch.no_grad():
        linear.kernel.copy_(torch.randn(256, 512, generator=g))
    x = torch.randn(1024, 256, generator=g).cuda().bfloat16()
    dy = torch.randn(1024, 512, generator=g).cuda().bfloat16()
    _, _, dkernel, dbias = _linear_grads(linear, x, dy)
    want = x.double().t() @ dy.double()
    scale = float(want.abs().max())
    assert float((dkernel.double() - want).abs().max()) / scale < 1e-5
    assert float((dbias.double() - dy.double().sum(0)).abs().max()) < 1e-3
    xs = x.clone().requires_grad_()
    reduced = reduced_weights([linear], torch.bfloat16)[0]
    linear.zero_grad(set_to_none=True)
    y = linear_silu(xs, linear.kernel, linear.bias, reduced)
    y.backward(dy)
    pre = torch.addmm(reduced[1], x, reduced[0])  # the kernel's dpre is eager torch's
    dpre = torch.ops.aten.silu_backward(dy, pre)
    want = x.double().t() @ dpre.double()
    err = float((linear.kernel.grad.double() - want).abs().max()) / float(want.abs().max())
    assert err < 1e-5, err


@pytest.mark.gpu
def test_the_ranking_head_multiplies_fp32_with_tf32_on_cuda():
    """A bf16 model's fp32 head matmuls run with TF32 math on CUDA (JAX's default precision
    there): their error against float64 is TF32's (~1e-3 relative), not fp32's (~1e-6),
    forward and backward, and the process's TF32 setting is what it was. An fp32 model's head
    stays full fp32."""
    assert not HSTUModel(_cfg("ranking").model, "cuda").head.hidden.tf32
    cfg = _cfg("ranking", "model.dtype=bfloat16")
    model = HSTUModel(cfg.model, "cuda")
    head = model.head.hidden
    assert head.tf32 and model.head.out.tf32
    g = torch.Generator().manual_seed(0)
    d = cfg.model.embedding_dim
    with torch.no_grad():
        head.kernel.copy_(torch.randn(d, d, generator=g))
    x = torch.randn(512, d, generator=g).cuda().requires_grad_()
    dy = torch.randn(512, d, generator=g).cuda()
    before = torch.backends.cuda.matmul.allow_tf32
    y = head(x)
    y.backward(dy)
    assert torch.backends.cuda.matmul.allow_tf32 == before
    x64, k64 = x.detach().double(), head.kernel.detach().double()
    for got, want in ((y, x64 @ k64 + head.bias.double()), (x.grad, dy.double() @ k64.t())):
        err = float((got.double() - want).abs().max() / want.abs().max())
        assert 1e-5 < err < 5e-3, err


@pytest.mark.gpu
@pytest.mark.parametrize("attention", ["reference", "kernel"])
def test_cuda_forward_matches_cpu(attention):
    cfg = _cfg("ranking")
    params = init_params(cfg.model, seed=0)
    batch = make_global_batch(cfg, 8, (8,))[0]
    cpu = HSTUModel(cfg.model)
    cpu.load_params(params)
    cfg.model.attention = attention
    gpu = HSTUModel(cfg.model, "cuda")
    gpu.load_params(params)
    want, _ = cpu(to_torch(batch), 10)
    got, _ = gpu(to_torch(batch).to("cuda"), 10)
    assert float(got) == pytest.approx(float(want), rel=1e-4)
