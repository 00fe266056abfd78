"""Flax HSTU model against a float64 numpy transcription of docs/MODEL.md; params, optimizer,
checkpoints (single device)."""

from __future__ import annotations

import contextlib
import dataclasses
import re

import numpy as np
import pytest

jax = pytest.importorskip("jax")

import jax.numpy as jnp  # noqa: E402

from hstu.config import load_config  # noqa: E402
from hstu.data.synthetic import dataset_from_config  # noqa: E402
from hstu.errors import HSTUError  # noqa: E402
from hstu.jax_backend import batch as jb  # noqa: E402
from hstu.jax_backend import collectives as col  # noqa: E402
from hstu.jax_backend.checkpoint import Checkpointer, abstract_like  # noqa: E402
from hstu.jax_backend.model import build_model, flax_to_params, params_to_flax  # noqa: E402
from hstu.jax_backend.shuffler import JaxShuffler  # noqa: E402
from hstu.jax_backend.train_step import (  # noqa: E402
    JaxBackend,
    init_state,
    make_optimizer,
    make_train_step,
)
from hstu.params import init_params, param_shapes  # noqa: E402
from hstu.pipeline import STAT_LOSS_TOKENS, STAT_REAL, Prepared, sample_stats  # noqa: E402
from hstu.shuffle_plan import identity_plan  # noqa: E402
from hstu.workload import HSTUCost  # noqa: E402

SMALL = [
    "model.embedding_dim=16",
    "model.num_heads=2",
    "model.attention_dim=8",
    "model.linear_dim=8",
    "model.num_items=60",
    "model.num_negatives=5",
    "model.rab_position_buckets=6",
    "model.rab_time_buckets=7",
    "model.normalizer=20.0",
    "data.batch_size=4",
    "data.max_history=10",
    "data.num_samples=3",
]


def _cfg(task: str, *extra: str):
    return load_config("configs/demo.yaml", [*SMALL, f"model.task={task}", *extra])


# ------------------------------------------------------------------ numpy reference
def _ln(x, p, name):
    mu = x.mean(-1, keepdims=True)
    var = ((x - mu) ** 2).mean(-1, keepdims=True)
    return (x - mu) / np.sqrt(var + 1e-6) * p[name + ".scale"] + p[name + ".bias"]


def _silu(x):
    return x / (1.0 + np.exp(-x))


def _normalize(x):
    return x / np.maximum(np.linalg.norm(x, axis=-1, keepdims=True), 1e-6)


def reference_loss(cfg, params, batch, global_targets):
    """Sample by sample, dense, float64: MODEL.md literally."""
    m = cfg.model
    p = {k: v.astype(np.float64) for k, v in params.items()}
    h, dqk, dv = m.num_heads, m.attention_dim, m.linear_dim
    off = {k: batch.offsets(k) for k in batch.keys}
    total = 0.0
    for b in range(batch.actual_batch_size):
        seg = {k: batch.values[k][off[k][b] : off[k][b + 1]] for k in batch.keys}
        c, n_hist, k_cand = len(seg["contextual"]), len(seg["item"]), len(seg["candidate"])
        n = c + 2 * n_hist + k_cand
        hist = np.stack(
            [p["embedding.item"][seg["item"]], p["embedding.action"][seg["action"]]], axis=1
        ).reshape(2 * n_hist, -1)
        x = np.concatenate(
            [
                p["embedding.contextual"][seg["contextual"]],
                hist,
                p["embedding.item"][seg["candidate"]],
            ]
        )
        ts = np.concatenate(
            [np.zeros(c, np.int64), np.repeat(seg["item_time"], 2), seg["candidate_time"]]
        )
        i, j = np.arange(n)[:, None], np.arange(n)[None, :]
        mask = (i == j) | ((j < n - k_cand) & ((j <= i) | (i < c)))
        for layer in range(m.num_layers):
            pre = f"layers.{layer}."
            uvqk = _silu(
                _ln(x, p, pre + "input_norm") @ p[pre + "uvqk.kernel"] + p[pre + "uvqk.bias"]
            )
            u, v, q, kk = np.split(uvqk, [h * dv, 2 * h * dv, 2 * h * dv + h * dqk], axis=1)
            s = m.resolved_alpha * np.einsum(
                "ihd,jhd->hij", q.reshape(n, h, dqk), kk.reshape(n, h, dqk)
            )
            s += p[pre + "rab_position"][:, np.minimum(np.abs(i - j), m.rab_position_buckets - 1)]
            _, expo = np.frexp(1.0 + np.abs(ts[:, None] - ts[None, :]))
            s += p[pre + "rab_time"][:, np.minimum(expo - 1, m.rab_time_buckets - 1)]
            att = np.einsum("hij,jhd->ihd", _silu(s) * mask / m.normalizer, v.reshape(n, h, dv))
            y = _ln(att.reshape(n, h * dv), p, pre + "attn_norm") * u
            x = x + y @ p[pre + "output.kernel"] + p[pre + "output.bias"]
        z = _ln(x, p, "final_norm")
        if m.task == "ranking":
            zc = z[c + 2 * n_hist :]
            logits = (
                _silu(zc @ p["head.hidden.kernel"] + p["head.hidden.bias"]) @ p["head.out.kernel"]
                + p["head.out.bias"]
            )
            y = (seg["label"][:, None] >> np.arange(m.num_tasks)) & 1
            total += np.sum(np.maximum(logits, 0) - logits * y + np.log1p(np.exp(-np.abs(logits))))
        else:
            r, table = m.num_negatives, p["embedding.item"]
            for t in range(n_hist - 1):
                query = _normalize(z[c + 2 * t + 1])
                pos, neg = seg["item"][t + 1], seg["negative"][t * r : (t + 1) * r]
                logits = np.concatenate(
                    [[query @ _normalize(table[pos])], _normalize(table[neg]) @ query]
                )
                logits /= m.retrieval_temperature
                logits[1:][neg == pos] = -np.inf
                top = logits.max()
                total += top + np.log(np.exp(logits - top).sum()) - logits[0]
    return total / global_targets


# ------------------------------------------------------------------ tests
@pytest.fixture(scope="module")
def sharding():
    return col.rank_sharding(col.make_mesh(jax.devices()[:1]))


def _loss(cfg, params, host, sharding, spec=None, impl=None, global_targets=11.0):
    if impl:
        cfg.model.attention = impl
    model = build_model(cfg.model, cfg.data.max_seqlen, interpret=True)
    dev = jb.local_view(jb.to_device([host], sharding, spec))
    fn = jax.jit(lambda prm, b: model.apply({"params": prm}, b, global_targets))
    return fn(params_to_flax(params), dev)


@pytest.mark.parametrize("task", ["ranking", "retrieval"])
def test_model_matches_numpy_reference(task, sharding):
    cfg = _cfg(task)
    params = init_params(cfg.model, seed=3)
    # A non-trivial point: perturb norms and biases away from their 1 / 0 initial values.
    rng = np.random.default_rng(0)
    params = {
        k: v
        + (
            0.1 * rng.normal(size=v.shape).astype(np.float32)
            if k.endswith(("bias", "scale"))
            else 0
        )
        for k, v in params.items()
    }
    ds = dataset_from_config(cfg, 1, 0)
    host = ds.batch(0)  # 3 real samples of 4: includes a padding row
    assert host.actual_batch_size == 3
    loss, aux = _loss(cfg, params, host, sharding)
    expect = reference_loss(cfg, params, host, 11.0)
    np.testing.assert_allclose(float(loss), expect, rtol=2e-5)
    if task == "retrieval":
        assert 0.0 <= float(aux["hr@10"]) <= float(aux["ndcg@10"]) * 10


def test_ranking_with_the_candidate_bound_matches_the_reference(sharding):
    """Candidate keys sized `B * data.max_candidates` instead of T (`jb.candidate_bound`, as
    training and evaluation size them): the same loss as the reference, and the evaluator's
    logits equal to those of candidate keys sized T."""
    from hstu.jax_backend.evaluate import from_params

    cfg = _cfg("ranking")
    params = init_params(cfg.model, seed=3)
    host = dataset_from_config(cfg, 1, 0).batch(0)
    lengths = {k: np.asarray(host.lengths[k])[None] for k in host.keys}
    bounded = jb.spec_for(host, lengths, jb.bucket_capacity, jb.candidate_bound(cfg))
    wide = jb.spec_for(host, lengths)
    assert bounded.capacity("candidate") == 4 * cfg.data.max_candidates
    assert wide.capacity("candidate") == wide.token_capacity > bounded.capacity("candidate")
    loss, _ = _loss(cfg, params, host, sharding, bounded)
    np.testing.assert_allclose(float(loss), reference_loss(cfg, params, host, 11.0), rtol=2e-5)
    evaluator = from_params(cfg, params, "cpu")
    assert evaluator.candidates_per_sample == cfg.data.max_candidates
    logits = evaluator.candidate_logits(host)
    assert logits.shape == (int(host.lengths["candidate"].sum()), cfg.model.num_tasks)
    evaluator.candidates_per_sample = 0
    np.testing.assert_allclose(evaluator.candidate_logits(host), logits, rtol=1e-5, atol=1e-6)


# retrieval's in the slow tier (~6 s on 2 cores); its loss and gradients meet the numpy
# reference in `make test` (test_model_matches_numpy_reference)
@pytest.mark.parametrize("task", ["ranking", pytest.param("retrieval", marks=pytest.mark.slow)])
def test_gradients_are_finite_with_padding(task, sharding):
    # Fresh init: zero norm biases make capacity-padding rows of z exactly zero, where a naive
    # normalisation has a NaN gradient even though the row is masked out of the loss.
    cfg = _cfg(task)
    model = build_model(cfg.model, cfg.data.max_seqlen)
    host = dataset_from_config(cfg, 1, 0).batch(0)
    dev = jb.local_view(jb.to_device([host], sharding))
    grads = jax.jit(jax.grad(lambda prm: model.apply({"params": prm}, dev, 11.0)[0]))(
        params_to_flax(init_params(cfg.model, seed=0))
    )
    bad = [k for k, g in flax_to_params(grads).items() if not np.isfinite(g).all()]
    assert bad == []


def _assert_close_loss_and_grads(got, want, tol: float) -> None:
    """`(loss, core-named grads)` pairs: the loss within `tol` relative, each gradient within
    `tol` of the largest entry of `want`'s."""
    (loss, grads), (want_loss, want_grads) = got, want
    np.testing.assert_allclose(loss, want_loss, rtol=tol)
    assert grads.keys() == want_grads.keys()
    for name, g in grads.items():
        w = want_grads[name]
        scale = max(float(np.abs(w).max()), 1e-6)
        assert float(np.abs(g - w).max()) <= tol * scale, name


# bf16 (~12 s interpreted on 2 cores) in the slow tier; fp32, the tighter check, in `make test`
@pytest.mark.parametrize("dtype", ["float32", pytest.param("bfloat16", marks=pytest.mark.slow)])
def test_uvqk_silu_kernel_matches_autodiff(dtype, sharding):
    """`model.fused_silu`'s kernel (the uvqk SiLU's and bias's gradients in one Pallas kernel,
    interpreted here) gives autodiff's loss and gradients: fp32 to rounding, bf16 within its
    rounding (the kernel computes in fp32 and rounds once). The layer needs column blocks of
    multiples of 64: 2 heads x 32."""
    cfg = _cfg("ranking", f"model.dtype={dtype}", "model.attention_dim=32", "model.linear_dim=32")
    host = dataset_from_config(cfg, 1, 0).batch(0)
    dev = jb.local_view(jb.to_device([host], sharding))
    params = params_to_flax(init_params(cfg.model, seed=0))

    def run(silu_kernel):
        model = build_model(cfg.model, cfg.data.max_seqlen, silu_kernel=silu_kernel)
        assert model.silu_kernel == silu_kernel
        fn = jax.value_and_grad(lambda prm: model.apply({"params": prm}, dev, 11.0)[0])
        loss, grads = jax.jit(fn)(params)
        return float(loss), flax_to_params(grads)

    got = run("interpret")
    _assert_close_loss_and_grads(got, run(None), 1e-5 if dtype == "float32" else 2e-2)
    assert float(np.abs(got[1]["layers.0.uvqk.bias"]).max()) > 0  # the check reads real values


# bf16 in the slow tier (the interpreted step, ~10 s on 2 cores); fp32 in `make test`
@pytest.mark.parametrize("dtype", ["float32", pytest.param("bfloat16", marks=pytest.mark.slow)])
def test_norm_kernels_match_autodiff(dtype, sharding):
    """`norm_kernel`: each layer's input norm and gated norm as Pallas kernels (interpreted
    here) give flax's and autodiff's loss and gradients in fp32, to rounding; the parameter
    tree is the same (checkpoints and conversion unchanged). In bf16 the two paths round in
    different places (the kernel rounds the residual stream's gradient once, autodiff the
    norm's part and then the sum), so each is held to the fp32 model's gradients instead,
    within the same band (both ~2-5 % of a gradient's largest entry here)."""
    cfg = _cfg("ranking", f"model.dtype={dtype}")
    host = dataset_from_config(cfg, 1, 0).batch(0)
    dev = jb.local_view(jb.to_device([host], sharding))
    params = params_to_flax(init_params(cfg.model, seed=0))

    def run(norm_kernel, model_cfg=cfg.model):
        model = build_model(model_cfg, cfg.data.max_seqlen, norm_kernel=norm_kernel)
        assert model.norm_kernel == norm_kernel
        init = model.init(jax.random.PRNGKey(0), dev, 11.0)["params"]
        assert jax.tree.structure(init) == jax.tree.structure(params)
        fn = jax.value_and_grad(lambda prm: model.apply({"params": prm}, dev, 11.0)[0])
        kernels = _norm_kernels_in(fn, params)
        assert kernels == ({"layer_norm_fwd", "gated_norm_fwd"} if norm_kernel else set())
        loss, grads = jax.jit(fn)(params)
        return float(loss), flax_to_params(grads)

    got = run("interpret")
    if dtype == "float32":
        _assert_close_loss_and_grads(got, run(None), 1e-5)
    else:
        fp32 = run(None, _cfg("ranking", "model.dtype=float32").model)
        _assert_close_loss_and_grads(got, fp32, 6e-2)
        _assert_close_loss_and_grads(run(None), fp32, 6e-2)  # autodiff's bf16, the same band
    for name in ("layers.0.input_norm.scale", "layers.1.attn_norm.bias"):
        assert float(np.abs(got[1][name]).max()) > 0  # the check reads real values


def _norm_kernels_in(fn, *args) -> set[str]:
    """The norm kernels' forward names among `fn`'s Pallas calls (its jaxpr, backward
    included: the custom rules' forward kernels appear there)."""
    text = str(jax.make_jaxpr(fn)(*args))
    return {name for name in ("layer_norm_fwd", "gated_norm_fwd") if name in text}


def test_norm_kernel_choice(monkeypatch, sharding):
    """The compiled norm kernels by default on a GPU only (`model.fused_norm`), where they
    are faster than XLA's fusions; any other choice through the environment (a process of its
    own) or the argument; a width they cannot take falls back to flax's norm."""
    cfg = _cfg("ranking")
    assert build_model(cfg.model, 8).norm_kernel is None
    assert build_model(cfg.model, 8, interpret=False).norm_kernel is None  # a CPU: XLA's
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    assert build_model(cfg.model, 8, interpret=False).norm_kernel == "compiled"
    assert build_model(cfg.model, 8, interpret=True).norm_kernel is None
    off = _cfg("ranking", "model.fused_norm=false")
    assert build_model(off.model, 8, interpret=False).norm_kernel is None
    monkeypatch.undo()
    with pytest.raises(ValueError, match="norm_kernel: expected compiled, interpret or None"):
        build_model(cfg.model, 8, norm_kernel="triton")
    monkeypatch.setenv("HSTU_JAX_NORM_KERNEL", "compiled")
    assert build_model(cfg.model, 8).norm_kernel == "compiled"
    assert build_model(cfg.model, 8, norm_kernel="interpret").norm_kernel == "interpret"
    monkeypatch.delenv("HSTU_JAX_NORM_KERNEL")
    # a width of 24: not a power of two, so flax's LayerNorm runs and the loss is autodiff's
    odd = _cfg("ranking", "model.embedding_dim=24")
    host = dataset_from_config(odd, 1, 0).batch(0)
    dev = jb.local_view(jb.to_device([host], sharding))
    params = params_to_flax(init_params(odd.model, seed=0))
    models = [
        build_model(odd.model, odd.data.max_seqlen, norm_kernel=k) for k in (None, "interpret")
    ]
    losses = [float(m.apply({"params": params}, dev, 11.0)[0]) for m in models]
    assert losses[0] == losses[1]
    assert _norm_kernels_in(lambda p: models[1].apply({"params": p}, dev, 11.0), params) == set()


def test_silu_kernel_choice(monkeypatch):
    """The kernel runs only when asked for (by default autodiff's backward, on a GPU too: the
    kernel timed slower there); the layer falls back to autodiff where its column blocks do
    not fit the kernel's tiles; anything else is refused."""
    cfg = _cfg("ranking")
    assert build_model(cfg.model, cfg.data.max_seqlen).silu_kernel is None
    assert build_model(cfg.model, 8, interpret=False).silu_kernel is None
    assert build_model(cfg.model, 8, silu_kernel="compiled").silu_kernel == "compiled"
    with pytest.raises(ValueError, match="silu_kernel: expected compiled, interpret or None"):
        build_model(cfg.model, 8, silu_kernel="triton")
    # the environment's choice (an A/B in processes of their own) where None was asked for
    monkeypatch.setenv("HSTU_JAX_SILU_KERNEL", "compiled")
    assert build_model(cfg.model, 8).silu_kernel == "compiled"
    assert build_model(cfg.model, 8, silu_kernel="interpret").silu_kernel == "interpret"
    monkeypatch.setenv("HSTU_JAX_SILU_KERNEL", "on")
    with pytest.raises(ValueError, match="got 'on'"):
        build_model(cfg.model, 8)
    from hstu_kernels.pallas.silu_bwd import supports

    m = cfg.model  # SMALL: 2 heads x 8 columns, below the kernel's 64-column blocks
    assert supports((m.num_heads * m.linear_dim,) * 4, 16) is not None


def _gradient_program(task, sharding):
    """`(cfg, device batch, StableHLO text)` of the loss's gradient, reference attention."""
    cfg = _cfg(task, "model.attention=reference")
    model = build_model(cfg.model, cfg.data.max_seqlen)
    host = dataset_from_config(cfg, 1, 0).batch(0)
    dev = jb.local_view(jb.to_device([host], sharding))
    fn = jax.jit(jax.grad(lambda prm: model.apply({"params": prm}, dev, 11.0)[0]))
    return cfg, dev, fn.lower(params_to_flax(init_params(cfg.model, seed=0))).as_text()


@pytest.mark.parametrize("task", ["ranking", "retrieval"])
def test_step_program_has_no_device_loops(task, sharding):
    """The loss and its gradient lower to straight-line XLA: no `while` (a binary search written
    as a loop runs as a loop of small kernels on a GPU, inside every step). With the reference
    attention: the Pallas interpreter's own loops are not the step's."""
    _, _, text = _gradient_program(task, sharding)
    assert "stablehlo.while" not in text
    assert "stablehlo.dot_general" in text  # the check reads the real program


@pytest.mark.parametrize("task", ["ranking", "retrieval"])
def test_gradients_into_token_rows_are_scatters_of_distinct_rows(task, sharding):
    """The loss's rows of the stack output are read at distinct indices that say so, so the
    gradient into the `[T, D]` stack output is a scatter of plain stores: with repeats
    possible XLA adds atomically, and that bf16 scatter-add took 0.6 ms of a batch-32 step on
    an H200. The tables' gradients (ids that do repeat) stay adds."""
    cfg, dev, text = _gradient_program(task, sharding)
    scatters = []  # (unique_indices, operand type) of every scatter in the program
    for m in re.finditer(r'"stablehlo.scatter"', text):
        rest = text[m.start() :]
        unique = re.search(r"unique_indices = (\w+)", rest).group(1) == "true"
        scatters.append((unique, re.search(r"\}\) : \((tensor<[^>]*>)", rest).group(1)))
    d, t = cfg.model.embedding_dim, dev.spec.token_capacity
    into_tokens = [u for u, ty in scatters if ty.startswith(f"tensor<{t}x{d}x")]
    into_rows = [u for u, ty in scatters if re.match(rf"tensor<\d+x{d}x", ty)]
    assert into_tokens and all(into_tokens), scatters
    assert not all(into_rows), scatters  # the tables' adds: the check tells them apart


def test_each_table_is_read_in_range_only_at_the_tokens_it_serves(sharding, monkeypatch):
    """Every table is looked up at all T tokens; the tokens it does not serve (other tables',
    capacity padding) read id `num_rows`, past the table, so that their zero gradients are
    dropped rather than added onto a few rows (T atomic adds onto the contextual table's
    handful of rows took 0.08 ms of a batch-32 step on an H200)."""
    from hstu.jax_backend import model as jm

    cfg = _cfg("ranking", "model.attention=reference")
    model = build_model(cfg.model, cfg.data.max_seqlen)
    host = dataset_from_config(cfg, 1, 0).batch(0)
    dev = jb.local_view(jb.to_device([host], sharding))
    seen = {}
    lookup = jm.Embeddings.lookup

    def spy(self, name, ids, tables):
        seen[name] = ids
        return lookup(self, name, ids, tables)

    monkeypatch.setattr(jm.Embeddings, "lookup", spy)
    _, lay = model.apply(
        {"params": params_to_flax(init_params(cfg.model, seed=0))},
        dev,
        method=lambda m, b: m.stack(b),
    )
    lay = {k: np.asarray(v) for k, v in lay.items() if k.startswith("is_")}
    served = {
        "item": (lay["is_hist"] & ~lay["is_action"]) | lay["is_cand"],
        "action": lay["is_action"],
        "contextual": lay["is_ctx"],
    }
    rows = {
        "item": cfg.model.num_items,
        "action": cfg.model.num_actions,
        "contextual": cfg.model.num_contextual_ids,
    }
    for name, mask in served.items():
        ids = np.asarray(seen[name])
        assert mask.any() and (~mask).any(), name
        assert ((ids[mask] >= 0) & (ids[mask] < rows[name])).all(), name
        assert (ids[~mask] == rows[name]).all(), name


def test_loss_does_not_depend_on_capacity(sharding):
    cfg = _cfg("ranking")
    params = init_params(cfg.model, seed=1)
    host = dataset_from_config(cfg, 1, 0).batch(0)
    small = jb.spec_from_batches([host])
    big = small.with_capacities([4 * c for c in small.capacities], 4 * small.token_capacity)
    a, _ = _loss(cfg, params, host, sharding, small)
    b, _ = _loss(cfg, params, host, sharding, big)
    np.testing.assert_allclose(float(a), float(b), rtol=1e-6)


def test_kernel_attention_matches_reference(sharding):
    cfg = _cfg("ranking", "model.num_layers=1")
    params = init_params(cfg.model, seed=2)
    host = dataset_from_config(cfg, 1, 0).batch(0)
    ref, _ = _loss(cfg, params, host, sharding, impl="reference")
    ker, _ = _loss(cfg, params, host, sharding, impl="kernel")
    np.testing.assert_allclose(float(ker), float(ref), rtol=1e-5)


def test_pallas_lowering_reaches_the_kernel(sharding):
    """`model.pallas_lowering=mosaic` runs the Mosaic GPU kernels, or fails naming why they
    cannot here (this fp32 model without biases: its dtype, before any other limit)."""
    no_bias = ("model.rab_position_buckets=0", "model.rab_time_buckets=0")
    cfg = _cfg("ranking", "model.num_layers=1", "model.pallas_lowering=mosaic", *no_bias)
    params = init_params(cfg.model, seed=2)
    host = dataset_from_config(cfg, 1, 0).batch(0)
    with pytest.raises(ValueError, match="Mosaic GPU kernels cannot run this call: dtype float32"):
        _loss(cfg, params, host, sharding, impl="kernel")
    cfg = _cfg("ranking", "model.num_layers=1", "model.pallas_lowering=auto", *no_bias)
    ker, _ = _loss(cfg, params, host, sharding, impl="kernel")  # auto: triton here
    ref, _ = _loss(cfg, params, host, sharding, impl="reference")
    np.testing.assert_allclose(float(ker), float(ref), rtol=1e-5)


@pytest.mark.parametrize("task", ["ranking", "retrieval"])
def test_params_map_one_to_one(task, sharding):
    cfg = _cfg(task)
    model = build_model(cfg.model, cfg.data.max_seqlen)
    host = dataset_from_config(cfg, 1, 0).batch(0)
    dev = jb.local_view(jb.to_device([host], sharding))
    shapes = jax.eval_shape(lambda: model.init(jax.random.PRNGKey(0), dev, 1.0))["params"]
    names = flax_to_params(jax.tree.map(lambda s: np.zeros(s.shape, s.dtype), shapes))
    assert {k: v.shape for k, v in names.items()} == param_shapes(cfg.model)
    params = init_params(cfg.model, seed=0)
    back = flax_to_params(params_to_flax(params))
    assert set(back) == set(params)
    assert all(np.array_equal(back[k], params[k]) for k in params)


def test_adamw_matches_decoupled_formula():
    cfg = _cfg("ranking", "train.lr=0.1", "train.weight_decay=0.5")
    tc = cfg.train
    opt = make_optimizer(tc)
    p = {"w": jnp.array([1.0, -2.0, 3.0])}
    state = opt.init(p)
    ref, m, v = np.array([1.0, -2.0, 3.0]), np.zeros(3), np.zeros(3)
    for t, g in enumerate([np.array([0.5, -1.0, 2.0]), np.array([-0.3, 0.2, 1.0])], start=1):
        upd, state = opt.update({"w": jnp.asarray(g, jnp.float32)}, state, p)
        p = {"w": p["w"] + upd["w"]}
        m = tc.beta1 * m + (1 - tc.beta1) * g
        v = tc.beta2 * v + (1 - tc.beta2) * g * g
        mh, vh = m / (1 - tc.beta1**t), v / (1 - tc.beta2**t)
        ref = ref - tc.lr * (mh / (np.sqrt(vh) + tc.eps) + tc.weight_decay * ref)
    np.testing.assert_allclose(np.asarray(p["w"]), ref, rtol=1e-5)


def test_checkpoint_step_names_keep_latest_and_restore(tmp_path):
    opt = make_optimizer(_cfg("ranking").train)
    params = {"a": {"kernel": jnp.arange(6.0).reshape(2, 3)}, "b": jnp.ones(3)}
    state = {
        "params": params,
        "opt_state": opt.init(params),
        "step": jnp.int32(0),
        "rng": jax.random.PRNGKey(7),
    }
    ckpt = Checkpointer(tmp_path / "ckpt", keep=2)
    for step in (1, 2, 3):
        state["step"] = jnp.int32(step)
        ckpt.save(step, state, {"next_sample": 10 + step})
    ckpt.wait()
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == ["step-2", "step-3"]
    reopened = Checkpointer(tmp_path / "ckpt", keep=2)
    restored, data, step = reopened.restore(abstract_like(state))
    assert step == 3 and data == {"next_sample": 13}
    assert jax.tree.structure(restored) == jax.tree.structure(state)
    for a, b in zip(jax.tree.leaves(restored), jax.tree.leaves(state), strict=True):
        assert a.dtype == b.dtype and np.array_equal(np.asarray(a), np.asarray(b))
    ckpt.close()
    reopened.close()


# ------------------------------------------------------------------ the backend's step
def _backend(cfg, table_rows: bool = True, policy=None, donate: bool = False) -> JaxBackend:
    mesh = col.make_mesh(jax.devices()[:1])
    model = build_model(cfg.model, cfg.data.max_seqlen, interpret=True)
    opt = make_optimizer(cfg.train)
    state = init_state(init_params(cfg.model, seed=0), opt, mesh, cfg.train.seed)
    step = make_train_step(model, opt, mesh, donate=donate, table_rows=table_rows)
    if policy is None:
        return JaxBackend(JaxShuffler(mesh), step, state, model, opt)
    shuffler = JaxShuffler(mesh, capacity=policy.capacity)
    return JaxBackend(shuffler, step, state, model, opt, build_ahead=policy.capacities)


def _placed(backend: JaxBackend, cfg, host, gather: bool = True):
    """(Placed, its global loss-token count): after the stats gather, or without it."""
    stats = sample_stats(host, HSTUCost.from_model_config(cfg.model), cfg.model.task)
    placed = backend.to_device(host)
    if gather:
        backend.allgather_stats(stats)
    else:
        placed = backend.shuffler.ensure(placed)
        assert placed.loss_tokens_device is None
    return placed, int(stats[:, STAT_LOSS_TOKENS].sum())


@pytest.mark.slow  # ~11 s: two programs compiled
def test_step_takes_the_placed_loss_tokens_unchanged():
    """The count placed with the batch (a replicated device scalar) trains exactly like the
    host scalar of a batch that skipped the stats gather, and the step compiles once for it
    (the scalar arrives in the sharding its in_spec expects, step after step)."""
    cfg = _cfg("ranking", "model.num_layers=1", "data.num_samples=8")
    ds = dataset_from_config(cfg, 1, 0)
    placed, host = _backend(cfg), _backend(cfg)
    losses = {"placed": [], "host": []}
    for i in range(2):
        for name, backend in (("placed", placed), ("host", host)):
            p, count = _placed(backend, cfg, [ds.batch(i)], gather=name == "placed")
            metrics, p = backend.forward_backward(p, count)
            assert (p.loss_tokens_device is not None) == (name == "placed")
            losses[name].append(float(metrics["loss"]))
    assert losses["placed"] == losses["host"] and len(set(losses["placed"])) == 2
    assert placed.step_fn._cache_size() == 1


@pytest.mark.slow  # ~20 s: two steps of two models compiled
def test_steps_with_the_silu_kernel_train_as_autodiffs():
    """The training step (shard_map, varying-axes checks off once a Pallas kernel runs: its
    outputs carry no such type) with the uvqk SiLU's backward kernel, interpreted: the same
    losses as autodiff's step over two steps, fp32."""
    cfg = _cfg("ranking", "model.dtype=float32", "model.attention_dim=32", "model.linear_dim=32",
               "model.attention=reference", "data.num_samples=8")  # fmt: skip
    ds = dataset_from_config(cfg, 1, 0)
    losses = {}
    for silu_kernel in (None, "interpret"):
        mesh = col.make_mesh(jax.devices()[:1])
        model = build_model(cfg.model, cfg.data.max_seqlen, silu_kernel=silu_kernel)
        opt = make_optimizer(cfg.train)
        state = init_state(init_params(cfg.model, seed=0), opt, mesh, cfg.train.seed)
        backend = JaxBackend(
            JaxShuffler(mesh), make_train_step(model, opt, mesh), state, model, opt
        )
        losses[silu_kernel] = []
        for i in range(2):
            p, count = _placed(backend, cfg, [ds.batch(i)])
            metrics, _ = backend.forward_backward(p, count)
            losses[silu_kernel].append(float(metrics["loss"]))
    np.testing.assert_allclose(losses["interpret"], losses[None], rtol=1e-5)
    assert losses[None][0] != losses[None][1]


def test_a_mismatching_loss_token_count_raises():
    cfg = _cfg("ranking", "model.num_layers=1")
    backend = _backend(cfg)
    p, count = _placed(backend, cfg, [dataset_from_config(cfg, 1, 0).batch(0)])
    with pytest.raises(HSTUError, match=f"placed with {count} .* given {count + 1}"):
        backend.forward_backward(p, count + 1)
    assert int(backend.state.step) == 0  # nothing dispatched


@pytest.mark.slow
@pytest.mark.parametrize("task", ["ranking", "retrieval"])
def test_item_table_gradient_from_its_rows_trains_as_the_dense_one(task):
    """The one-device step's item-table gradient built from the rows the batch reads
    (`table_rows`, the default) against the dense gradient of the parameter: the same
    losses, norms and parameters over three steps (every row moves: AdamW's decay)."""
    cfg = _cfg(task, "model.num_layers=1", "data.num_samples=8", "data.min_history=4",
               "train.weight_decay=0.1")  # fmt: skip
    ds = dataset_from_config(cfg, 1, 0)
    runs = {}
    for table_rows in (False, True):
        backend = _backend(cfg, table_rows=table_rows)
        metrics = []
        for i in range(3):
            placed, count = _placed(backend, cfg, [ds.batch(i)])
            assert count > 0
            m, _ = backend.forward_backward(placed, count)
            metrics.append({k: float(v) for k, v in m.items()})
        runs[table_rows] = metrics, jax.tree.map(np.asarray, backend.state.params)
    (want, want_p), (got, got_p) = runs[False], runs[True]
    for w, g in zip(want, got, strict=True):
        assert g == pytest.approx(w, rel=1e-6, abs=1e-7)
    for a, b in zip(jax.tree.leaves(got_p), jax.tree.leaves(want_p), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)
    init = init_params(cfg.model, seed=0)["embedding.item"]
    assert (np.abs(got_p["embedding"]["item"] - init).max(axis=1) > 0).all()


def test_residual_stream_runs_in_the_compute_dtype():
    """A bf16 model carries its residual stream (every layer's output) in bf16, as torch
    does; the norms compute in fp32 and the encoder's output is fp32."""
    cfg = _cfg("ranking", "model.num_layers=2", "model.dtype=bfloat16", "model.attention=reference")
    model = build_model(cfg.model, cfg.data.max_seqlen)
    host = dataset_from_config(cfg, 1, 0).batch(0)
    mesh = col.make_mesh(jax.devices()[:1])
    dev = jb.local_view(jb.to_device([host], col.rank_sharding(mesh)))
    tree = params_to_flax(init_params(cfg.model, seed=0))
    z, state = jax.eval_shape(  # dtypes only: nothing runs
        lambda p: model.apply({"params": p}, dev, method=model.encode, capture_intermediates=True),
        tree,
    )
    layers = state["intermediates"]
    assert [layers[f"layers_{i}"]["__call__"][0].dtype for i in range(2)] == [jnp.bfloat16] * 2
    assert z[0].dtype == jnp.float32


def _real_item_ids(batch) -> np.ndarray:
    """The distinct item ids of `batch`'s samples (no padding), sorted: numpy, per rank."""
    out = []
    for key in ("item", "candidate", "negative"):
        if key in batch.values:
            v = np.asarray(batch.values[key]).reshape(-1, batch.spec.capacity(key))
            n = np.asarray(batch.lengths[key]).reshape(v.shape[0], -1).sum(axis=1)
            out += [row[:k] for row, k in zip(v, n, strict=True)]
    return np.unique(np.concatenate(out))


@pytest.mark.parametrize("task", ["ranking", "retrieval"])
def test_read_rows_hold_the_real_ids_in_a_bound_of_the_token_capacity(task):
    """The rows the step differentiates the item table through: the batch's real ids, sorted
    and distinct, then the filler `V` with zero rows, `read_capacity` of them: per rank the
    token capacity (items + candidates fit in T) plus the negatives' slots, fewer than the
    batch's id slots (padding is left out)."""
    from hstu.jax_backend.train_step import item_ids, read_capacity, read_rows

    cfg = _cfg(task, "data.num_samples=8", "model.num_items=20000")
    backend = _backend(cfg)
    placed, _ = _placed(backend, cfg, [dataset_from_config(cfg, 1, 0).batch(0)])
    batch = backend.shuffler.ensure(placed).batch
    spec = batch.spec
    neg = spec.capacity("negative") if task == "retrieval" else 0
    assert read_capacity(batch) == spec.token_capacity + neg
    assert read_capacity(batch) < np.asarray(item_ids(batch)).size
    table = backend.state.params["embedding"]["item"]
    ids, rows = map(np.asarray, read_rows(table, batch))
    real = _real_item_ids(batch)
    assert ids.shape == (read_capacity(batch),) and rows.shape == (ids.size, table.shape[1])
    np.testing.assert_array_equal(ids[: real.size], real)
    assert (ids[real.size :] == cfg.model.num_items).all() and real.size < ids.size
    np.testing.assert_array_equal(rows[: real.size], np.asarray(table)[real])
    assert not rows[real.size :].any()


@pytest.mark.slow  # ~18 s: two gradient programs compiled
def test_rank_timer_differentiates_the_item_table_as_the_step_does():
    """The probes' and the simulation's per-rank forward + backward takes the item table's
    gradient from the rows the shard reads, as the step does: the same loss, the same
    gradients of the other parameters, and the rows' gradients those of the dense table
    gradient (zero on every row the shard does not read)."""
    from hstu.jax_backend.timing import RankTimer
    from hstu.jax_backend.train_step import item_ids, read_capacity

    cfg = _cfg("ranking", "model.num_layers=1", "data.num_samples=8", "model.num_items=2000")
    backend = _backend(cfg)
    placed, count = _placed(backend, cfg, [dataset_from_config(cfg, 1, 0).batch(0)])
    batch = backend.shuffler.ensure(placed).batch
    params, glt = backend.state.params, np.float32(count)
    loss, (grads, g_rows) = RankTimer(backend.model)._forward_backward(params, batch, glt)

    def dense_loss(p):
        return backend.model.apply({"params": p}, jb.local_view(batch), glt)[0]

    want_loss, want = jax.value_and_grad(dense_loss)(params)
    assert float(loss) == pytest.approx(float(want_loss), rel=1e-6)
    assert "item" not in grads["embedding"]  # no [V, D] gradient is built
    want_item = np.asarray(want["embedding"].pop("item"))
    for a, b in zip(jax.tree.leaves(grads), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7)
    real = _real_item_ids(batch)
    g_rows = np.asarray(g_rows)[0]
    assert g_rows.shape[0] == read_capacity(batch) < np.asarray(item_ids(batch)).size
    num_items = cfg.model.num_items
    np.testing.assert_allclose(g_rows[: real.size], want_item[real], rtol=1e-5, atol=1e-7)
    assert np.abs(g_rows[: real.size]).max() > 0
    others = np.setdiff1d(np.arange(num_items), real)
    assert not want_item[others].any()  # the dense gradient holds nothing more


@pytest.mark.slow  # ~28 s: six programs compiled
def test_programs_built_ahead_train_as_the_jitted_step():
    """`train.build_ahead`: at the first step every capacity's program is built (compiled in
    threads), the later steps run them: the same losses as the step compiled at each
    capacity's first use, every program counted from the first step on, and nothing
    compiled by the jitted step itself (donated state, as in training)."""
    from hstu.capacity import CapacityPolicy

    cfg = _cfg("ranking", "model.num_layers=1", "data.num_samples=24")
    ds = dataset_from_config(cfg, 1, 0)
    tokens = [ds.batch(i).num_real_tokens() for i in range(4)]
    fits = {-(-t // 8) * 8 for t in tokens}  # a capacity per batch, and one none takes
    policy = CapacityPolicy(tuple(sorted(fits | {max(fits) + 64})))
    ahead, plain = _backend(cfg, policy=policy, donate=True), _backend(cfg, donate=True)
    plain.shuffler.capacity = policy.capacity
    losses, counts = {"ahead": [], "plain": []}, []
    for i in range(4):
        for name, backend in (("ahead", ahead), ("plain", plain)):
            p, count = _placed(backend, cfg, [ds.batch(i)])
            metrics = backend.fetch_metrics(
                backend.optimizer_step(backend.forward_backward(p, count))
            )
            losses[name].append(metrics["loss"])
            if name == "ahead":
                counts.append(metrics["num_compiles"])
    assert len(fits) >= 2  # the batches span capacities
    assert losses["ahead"] == losses["plain"]
    assert counts == [len(policy.capacities)] * 4 and len(ahead._built) == len(policy.capacities)
    assert ahead.step_fn._cache_size() == 0 and plain.step_fn._cache_size() >= 2

    # `hstu bench e2e`'s probe times the whole step with the step's own program (built or
    # jitted), compiling none, and copies the state for it in one program; the state trains
    # on unchanged
    host = [ds.batch(3)]
    stats = sample_stats(host, HSTUCost.from_model_config(cfg.model), cfg.model.task)
    plan = identity_plan(stats[:, STAT_REAL].astype(bool), 1)
    for backend in (ahead, plain):
        cached = backend.step_fn._cache_size()
        p, _ = _placed(backend, cfg, host)
        params = jax.tree.map(np.asarray, backend.state.params)
        with _compiles() as compiled:
            found = backend.probe(Prepared(p, stats, plan, loaded_batch=p), repeats=1)
        assert "jit(step)" not in compiled and "jit(copy)" not in compiled, compiled
        assert found["device_s"]["step"] > 0 and found["compute_s_after"][0] > 0
        assert backend.step_fn._cache_size() == cached
        after = jax.tree.map(np.asarray, backend.state.params)
        assert all(jax.tree.leaves(jax.tree.map(np.array_equal, params, after)))


def test_programs_run_ahead_only_where_a_copy_of_the_state_fits():
    """`build_ahead` runs its programs once on a copy of the state: only where twice the
    state's bytes on the device fit in what the device reports free."""
    from hstu.jax_backend.train_step import bytes_on, copy_fits

    device = jax.devices()[0]
    state = {"w": jax.device_put(np.zeros((4, 8), np.float32), device), "n": 3}
    assert bytes_on(state, device) == 4 * 8 * 4  # arrays only
    assert bytes_on(state, object()) == 0  # none of it on another device
    assert copy_fits(128, None) and copy_fits(128, {})  # no report (the CPU): run
    assert copy_fits(128, {"bytes_limit": 1000, "bytes_in_use": 744})  # 256 free
    assert not copy_fits(128, {"bytes_limit": 1000, "bytes_in_use": 745})


@contextlib.contextmanager
def _compiles():
    """The names of the programs XLA compiles inside the block (`jit(name)`)."""
    from jax import monitoring
    from jax._src import monitoring as _monitoring

    seen = []

    def listen(event, _secs, fun_name="?", **_):
        if event == "/jax/core/compile/backend_compile_duration":
            seen.append(fun_name)

    monitoring.register_event_duration_secs_listener(listen)
    try:
        yield seen
    finally:
        _monitoring.unregister_event_duration_listener(listen)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_linear_computes_as_dense_with_fp32_parameter_gradients(dtype):
    """The layers' `Linear`: `nn.Dense(dtype=...)`'s parameters and forward, bit for bit, and
    its input gradient; the parameters' gradients in fp32 from the GEMM (within fp32 roundings
    of the exact product of the compute-dtype operands), where `nn.Dense`'s bf16 ones are
    rounded to bf16 first."""
    import flax.linen as nn

    from hstu.jax_backend.model import Linear

    kx, kg = jax.random.split(jax.random.key(0))
    x = jax.random.normal(kx, (300, 64), jnp.float32)
    g = jax.random.normal(kg, (300, 48), jnp.float32).astype(dtype)
    ours, dense = Linear(48, dtype), nn.Dense(48, dtype=dtype)
    params = dense.init(jax.random.key(1), x)
    params = jax.tree.map(lambda p: p + 0.1, params)  # a bias that is not zero
    assert jax.tree.map(jnp.shape, ours.init(jax.random.key(1), x)) == jax.tree.map(
        jnp.shape, params
    )
    outs, vjps = {}, {}
    for name, mod in (("ours", ours), ("dense", dense)):
        outs[name], vjp = jax.vjp(lambda p, x, m=mod: m.apply(p, x), params, x)
        vjps[name] = vjp(g)
    assert outs["ours"].dtype == dtype
    np.testing.assert_array_equal(np.asarray(outs["ours"]), np.asarray(outs["dense"]))
    (p_ours, x_ours), (p_dense, x_dense) = vjps["ours"], vjps["dense"]
    np.testing.assert_array_equal(np.asarray(x_ours), np.asarray(x_dense))
    xc = np.asarray(x.astype(dtype), np.float64)
    want_w = xc.T @ np.asarray(g, np.float64)
    want_b = np.asarray(g, np.float64).sum(axis=0)
    got_w, got_b = (np.asarray(p_ours["params"][k], np.float64) for k in ("kernel", "bias"))
    assert p_ours["params"]["kernel"].dtype == jnp.float32
    np.testing.assert_allclose(got_w, want_w, rtol=1e-5, atol=1e-4)
    np.testing.assert_allclose(got_b, want_b, rtol=1e-5, atol=1e-4)
    dense_w = np.asarray(p_dense["params"]["kernel"], np.float64)
    if dtype == jnp.float32:
        np.testing.assert_allclose(got_w, dense_w, rtol=1e-5, atol=1e-4)
    else:  # nn.Dense's went through bf16: about 2^-9 of each entry off
        assert np.abs(dense_w - want_w).max() > 10 * np.abs(got_w - want_w).max()


def test_grad_norm_reduces_small_leaves_together():
    """`grad_norm` is `optax.tree.norm`'s value, with the leaves under `SMALL_LEAF` elements
    in one reduction (their optimizer updates are then free of reductions, faster kernels)
    and each large leaf in its own."""
    import optax

    from hstu.jax_backend.train_step import SMALL_LEAF, grad_norm

    rng = np.random.default_rng(0)
    tree = {
        "big": jnp.asarray(rng.normal(size=(SMALL_LEAF // 128, 128)), jnp.float32),
        "layers": [
            {"bias": jnp.asarray(rng.normal(size=(n,)), jnp.float32), "scale": jnp.ones((n,))}
            for n in (3, 64, 1000)
        ],
    }
    np.testing.assert_allclose(float(grad_norm(tree)), float(optax.tree.norm(tree)), rtol=1e-6)
    text = jax.jit(grad_norm).lower(tree).as_text()
    assert text.count("stablehlo.reduce") == 2  # the large leaf; the six small ones together
    assert "stablehlo.concatenate" in text
    assert float(grad_norm({"b": jnp.zeros((4,))})) == 0.0


@pytest.mark.slow  # ~40 s: three short runs compiled
def test_weight_copies_train_as_the_casts_and_resume(tmp_path, monkeypatch):
    """`HSTU_JAX_WEIGHT_COPIES=1` (bf16): the linears' bf16 kernels written by each step's
    update for the next step's forward give the same losses, bit for bit, as the forward's own
    casts (the same values reach the same GEMMs); the copies are not checkpointed, and a
    resumed run makes them again from the restored params and goes on as the run without."""
    from hstu.jax_backend.model import COPIES, weight_copies
    from hstu.jax_backend.state import copies_wanted, with_copies
    from hstu.jax_backend.train_step import run_training

    common = ["model.dtype=bfloat16", "model.num_layers=2", "train.steps=4", "train.log_every=100"]

    def run(flag, out, *extra):
        monkeypatch.setenv("HSTU_JAX_WEIGHT_COPIES", flag)
        cfg = _cfg("ranking", *common, f"output_dir={tmp_path / out}", *extra)
        return [r["loss"] for r in run_training(cfg, jax.devices()[:1])]

    plain = run("0", "plain")
    assert run("1", "copies", "train.checkpoint_every=2") == plain
    ckpt = tmp_path / "copies" / "checkpoints"
    assert sorted(p.name for p in ckpt.iterdir()) == ["step-2", "step-4"]
    assert not list(ckpt.rglob(f"*{COPIES}*"))  # derived, not stored
    import shutil

    shutil.rmtree(ckpt / "step-4")
    resumed = run("1", "copies", "train.checkpoint_every=2", "train.resume=true")
    assert resumed == plain[2:]

    params = params_to_flax(init_params(_cfg("ranking").model, seed=0))
    copies = weight_copies(params, jnp.bfloat16)
    assert set(copies) == {"layers_0", "layers_1"}
    assert {k: set(v) for k, v in copies.items()} == {
        "layers_0": {"uvqk", "output"},
        "layers_1": {"uvqk", "output"},
    }
    assert copies["layers_0"]["uvqk"]["kernel"].dtype == jnp.bfloat16
    monkeypatch.setenv("HSTU_JAX_WEIGHT_COPIES", "yes")
    with pytest.raises(HSTUError, match="HSTU_JAX_WEIGHT_COPIES: expected 0 or 1, got 'yes'"):
        copies_wanted("bfloat16")
    monkeypatch.setenv("HSTU_JAX_WEIGHT_COPIES", "1")
    assert copies_wanted("bfloat16") and not copies_wanted("float32")
    mesh = col.make_mesh(jax.devices()[:1])
    cfg = _cfg("ranking")
    state = init_state(init_params(cfg.model, seed=0), make_optimizer(cfg.train), mesh)
    state = with_copies(state, jnp.bfloat16)
    assert "copies" not in state.as_dict()
    model = build_model(cfg.model, cfg.data.max_seqlen)
    host = dataset_from_config(cfg, 1, 0).batch(0)
    dev = jb.local_view(jb.to_device([host], col.rank_sharding(mesh)))
    # the step's forward reads the copies (zeroed ones change the loss), and hands on the
    # updated params' copies
    bf16 = _cfg("ranking", "model.dtype=bfloat16")
    state16 = with_copies(
        init_state(init_params(bf16.model, seed=0), make_optimizer(bf16.train), mesh),
        jnp.bfloat16,
    )
    model16 = build_model(bf16.model, bf16.data.max_seqlen)
    step = make_train_step(model16, make_optimizer(bf16.train), mesh, donate=False)
    batch = jb.to_device([dataset_from_config(bf16, 1, 0).batch(0)], col.rank_sharding(mesh))
    after, metrics = step(state16, batch, 11.0)
    zeroed = jax.tree.map(jnp.zeros_like, state16.copies)
    _, metrics0 = step(dataclasses.replace(state16, copies=zeroed), batch, 11.0)
    assert float(metrics0["loss"]) != float(metrics["loss"])
    want = weight_copies(after.params, jnp.bfloat16)
    assert jax.tree.all(jax.tree.map(lambda a, b: bool((a == b).all()), after.copies, want))
    wrong = jax.tree.map(lambda c: c.astype(jnp.float16), state.copies)
    with pytest.raises(
        ValueError, match=r"uvqk: weight copy float16\[16, 64\], expected float32\[16, 64\]"
    ):
        model.apply({"params": state.params, COPIES: wrong}, dev, 11.0)
