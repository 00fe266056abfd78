"""The HSTU model in Flax linen: docs/MODEL.md implemented literally, single-rank code.

The model reads one rank's `DeviceBatch` (no rank dim: `batch.local_view` inside shard_map),
lays its samples out as `T = spec.token_capacity` jagged tokens (`token_layout`), runs the
HSTU layers and returns the rank's loss, already divided by the step's global target count.

Parameters: the tree maps 1:1 to `hstu.params` names (`params_to_flax` / `flax_to_params`);
Flax's `layers_<i>` is the core's `layers.<i>`. Training initialises from
`hstu.params.init_params` (identical in both backends); `model.init` also works (same shapes).
"""

from __future__ import annotations

import functools
import importlib
import os
import re

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax

from hstu.config import ModelConfig
from hstu.jax_backend.attention import AttentionConfig, hstu_attention
from hstu.jax_backend.batch import DeviceBatch
from hstu.jax_backend.collectives import segment_ids
from hstu.jax_backend.embedding import cached_lookup

LN_EPS = 1e-6
DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}
TOP_K = 10  # retrieval HR@K / NDCG@K


def _norm(name: str) -> nn.LayerNorm:
    return nn.LayerNorm(epsilon=LN_EPS, use_fast_variance=False, dtype=jnp.float32, name=name)


def _excl(x: jax.Array) -> jax.Array:
    return jnp.cumsum(x) - x


def _owner(lengths: jax.Array, size: int) -> tuple[jax.Array, jax.Array]:
    """For each packed position `0 .. size - 1`: the sample owning it, and the position's index
    inside that sample."""
    ends = jnp.cumsum(lengths)
    sample = segment_ids(ends, size)
    return sample, jnp.arange(size, dtype=ends.dtype) - (ends[sample] - lengths[sample])


def token_layout(batch: DeviceBatch) -> dict[str, jax.Array]:
    """Where each of the T token slots comes from (MODEL.md's table), plus sample offsets."""
    b, t_cap = batch.spec.batch_size, batch.spec.token_capacity
    zeros = jnp.zeros((b,), jnp.int32)
    c = batch.lengths.get("contextual", zeros)
    length, k = batch.lengths["item"], batch.lengths["candidate"]
    n = c + 2 * length + k
    offsets = jnp.concatenate([jnp.zeros((1,), jnp.int32), jnp.cumsum(n)])
    sample, p = _owner(n, t_cap)
    valid = jnp.arange(t_cap) < offsets[-1]
    hist_pos = p - c[sample]
    is_ctx = valid & (p < c[sample])
    is_hist = valid & ~is_ctx & (hist_pos < 2 * length[sample])
    return {
        "offsets": offsets,
        "n": n,
        "num_contextual": c,
        "num_candidates": k,
        "is_ctx": is_ctx,
        "is_hist": is_hist,
        "is_cand": valid & ~is_ctx & ~is_hist,
        "is_action": is_hist & (hist_pos % 2 == 1),
        "ctx_idx": _excl(c)[sample] + p,
        "item_idx": _excl(length)[sample] + hist_pos // 2,
        "cand_idx": _excl(k)[sample] + hist_pos - 2 * length[sample],
    }


def _take(values: jax.Array, idx: jax.Array) -> jax.Array:
    """Read a packed value buffer at token-slot positions; slots past the real values (capacity
    padding) read some in-buffer entry and are masked by the caller."""
    return jnp.take(values, jnp.clip(idx, 0, values.shape[0] - 1))


def _take_rows(x: jax.Array, idx: jax.Array) -> jax.Array:
    """`x[idx]` for distinct `idx` (rows past `x` read zeros). The promise that no index
    repeats makes the gradient a scatter of plain stores: with repeats possible XLA adds
    atomically, and the bf16 `[T, D]` scatter-add of the loss's rows so took 0.60 ms of a
    batch-32 step on an H200 (docs/BENCHMARKS.md)."""
    return x.at[idx].get(mode="fill", fill_value=0, unique_indices=True)


def _lookup(table: jax.Array, ids: jax.Array) -> jax.Array:
    """Embedding rows of `ids`. Ids are checked on the host before any collective
    (`hstu.batch.check_model_inputs`); one that slips past (a caller skipping the check)
    reads NaN rows, so the loss says so, instead of a clamped, silently wrong row."""
    return jnp.take(table, ids, axis=0, mode="fill", fill_value=jnp.nan)


class Embeddings(nn.Module):
    """The three tables. `external`: they are not parameters of the model but sharded tables
    (`embedding.py`), whose rows each call receives as `tables[name] = (ids [U], rows [U, D])`
    (the rank's cache: every id the batch reads)."""

    cfg: ModelConfig
    external: bool = False

    def setup(self):
        if self.external:
            return
        d = self.cfg.embedding_dim
        init = nn.initializers.normal(1.0 / np.sqrt(d))
        self.item = self.param("item", init, (self.cfg.num_items, d))
        self.action = self.param("action", init, (self.cfg.num_actions, d))
        self.contextual = self.param("contextual", init, (self.cfg.num_contextual_ids, d))

    def lookup(self, name: str, ids: jax.Array, tables: dict | None) -> jax.Array:
        """Rows of `ids` from table `name`: from `tables[name]` where the call passes it (the
        sharded tables; the item table's rows in the one-device step), else the parameter."""
        if tables is None or name not in tables:
            return _lookup(getattr(self, name), ids)
        rows = {
            "item": self.cfg.num_items,
            "action": self.cfg.num_actions,
            "contextual": self.cfg.num_contextual_ids,
        }
        return cached_lookup(*tables[name], ids, rows[name])

    def __call__(
        self, batch: DeviceBatch, lay: dict, tables: dict | None = None
    ) -> tuple[jax.Array, jax.Array]:
        """Token embeddings `[T, D]` (zero in capacity padding) and timestamps `[T]`.

        Each table is looked up at every token, and the tokens another table serves read id
        `num_rows` (past the table: a row the `where`s below drop, whose gradient is dropped
        too). Had they read some real id (their zero gradients adding onto it), the tables'
        gradients would pile T rows of zeros onto a few rows, atomically: the contextual
        table's took 0.08 ms of a batch-32 step on an H200 so."""
        v = batch.values
        hist, cand, ctx = lay["is_hist"], lay["is_cand"], lay["is_ctx"]
        act = lay["is_action"]
        c = self.cfg
        item_id = jnp.where(
            hist & ~act,
            _take(v["item"], lay["item_idx"]),
            jnp.where(cand, _take(v["candidate"], lay["cand_idx"]), c.num_items),
        )
        act_id = jnp.where(act, _take(v["action"], lay["item_idx"]), c.num_actions)
        ctx_vals = v.get("contextual", jnp.zeros((1,), jnp.int32))
        ctx_id = jnp.where(ctx, _take(ctx_vals, lay["ctx_idx"]), c.num_contextual_ids)
        e_item = self.lookup("item", item_id, tables)
        e_act = self.lookup("action", act_id, tables)
        e_ctx = self.lookup("contextual", ctx_id, tables)
        x = jnp.where(act[:, None], e_act, e_item)
        x = jnp.where(ctx[:, None], e_ctx, x)
        x = jnp.where((hist | cand | ctx)[:, None], x, 0.0)
        ts = jnp.where(
            hist,
            _take(v["item_time"], lay["item_idx"]),
            jnp.where(cand, _take(v["candidate_time"], lay["cand_idx"]), 0),
        )
        return x, ts


def _varying(x: jax.Array) -> frozenset:
    """The mesh axes `x` varies over inside shard_map (empty outside, or unchecked)."""
    aval = jax.typeof(x)
    mat = getattr(aval, "mat", None)  # jax >= 0.11; 0.10 names the set `vma`
    return mat.varying if mat is not None else aval.vma


@jax.custom_vjp
def _linear(x: jax.Array, kernel: jax.Array, bias: jax.Array) -> jax.Array:
    return _linear_fwd(x, kernel, bias)[0]


def _linear_fwd(x, kernel, bias):
    w = kernel.astype(x.dtype)
    return jnp.matmul(x, w) + bias.astype(x.dtype), (x, w)


def _linear_bwd(res, g):
    x, w = res
    f32 = jnp.float32
    dx = jnp.matmul(g, w.T)
    dw = jax.lax.dot_general(x, g, (((0,), (0,)), ((), ())), preferred_element_type=f32)
    return dx, dw, jnp.sum(g, axis=0, dtype=f32)


_linear.defvjp(_linear_fwd, _linear_bwd)

# The flax collection of the linears' weights in the compute dtype, written by the previous
# step's optimizer update (`weight_copies`), so that a step does not cast its fp32 kernels again
COPIES = "copies"


@jax.custom_vjp
def _linear_copied(x: jax.Array, kernel: jax.Array, copy: jax.Array, bias: jax.Array):
    """`_linear` with `copy` (`kernel` in `x`'s dtype) as the forward's weight: the same
    values, fp32 gradients for `kernel`, none for `copy` (a copy, not a parameter)."""
    return _linear_copied_fwd(x, kernel, copy, bias)[0]


def _linear_copied_fwd(x, kernel, copy, bias):
    return jnp.matmul(x, copy) + bias.astype(x.dtype), (x, copy)


def _linear_copied_bwd(res, g):
    dx, dw, db = _linear_bwd(res, g)
    return dx, dw, jnp.zeros_like(res[1]), db


_linear_copied.defvjp(_linear_copied_fwd, _linear_copied_bwd)


def weight_copies(params: dict, dtype) -> dict:
    """The `COPIES` collection for `params` (a Flax params tree): every HSTU layer's linear
    kernels in `dtype`, nested as the params are. Each step's update writes them for the next
    step (`TrainState.copies`), as torch's `adamw_multi_` writes its bf16 copies: the cast
    joins the optimizer's pass over the weights instead of a pass of its own in the forward."""
    return {
        name: {
            sub: {"kernel": leaf["kernel"].astype(dtype)}
            for sub, leaf in layer.items()
            if isinstance(leaf, dict) and "kernel" in leaf
        }
        for name, layer in params.items()
        if _LAYER.match(name)
    }


def _silu_kernel():
    return importlib.import_module("hstu_kernels.pallas.silu_bwd")


def _norm_kernel():
    return importlib.import_module("hstu_kernels.pallas.layer_norm")


class _NormParams(nn.Module):
    """`nn.LayerNorm`'s parameters (same names, shapes, dtype and init: the parameter tree and
    checkpoints are the same) for the Pallas norm kernels to apply."""

    features: int

    @nn.compact
    def __call__(self, like: jax.Array) -> tuple[jax.Array, jax.Array]:
        scale = self.param("scale", nn.initializers.ones, (self.features,), jnp.float32)
        bias = self.param("bias", nn.initializers.zeros, (self.features,), jnp.float32)
        vary = tuple(sorted(_varying(like) - _varying(scale)))  # as `Linear`'s parameters
        if vary:
            scale, bias = (jax.lax.pcast(p, vary, to="varying") for p in (scale, bias))
        return scale, bias


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def _linear_silu_split(x, kernel, bias, sizes: tuple[int, ...], interpret: bool):
    """`silu(x @ kernel + bias)` split into column blocks of `sizes`: `_linear`, `nn.silu` and
    `jnp.split`'s values, with one backward kernel for SiLU's gradient and the bias's
    (`hstu_kernels.pallas.silu_bwd`, as torch's `linear_silu` runs it): autodiff's backward
    reads the `[T, N]` gradient once more for the bias (0.21 ms of a batch-32 bench_upstream
    step on an H200). In fp32 as that kernel computes it, the bias gradient from the unrounded
    SiLU gradient; the GEMMs as `_linear`'s."""
    return _linear_silu_split_fwd(x, kernel, bias, sizes, interpret)[0]


def _linear_silu_split_fwd(x, kernel, bias, sizes, interpret):
    w, b = kernel.astype(x.dtype), bias.astype(x.dtype)
    z = jnp.matmul(x, w)  # `_linear_fwd`'s values: `z + b`
    ends = np.cumsum(sizes)[:-1].tolist()
    # The residual is the GEMM's output, not `z + b`: a biased copy as residual is a [T, N]
    # array XLA would write in a kernel of its own; the backward kernel adds `b` itself.
    return tuple(jnp.split(nn.silu(z + b), ends, axis=-1)), (x, w, z, b)


def _linear_silu_split_bwd(sizes, interpret, res, grads):
    x, w, z, b = res
    dpre, dbias = _silu_kernel().silu_backward(grads, z, b, interpret=interpret)
    dx, dw, _ = _linear_bwd((x, w), dpre)
    return dx, dw, dbias


_linear_silu_split.defvjp(_linear_silu_split_fwd, _linear_silu_split_bwd)


class Linear(nn.Module):
    """`x @ kernel + bias` in `dtype` with fp32 parameters, as `nn.Dense(dtype=...)` computes
    it (same parameters, same forward), but the parameters' gradients come out of the GEMM
    and the reduction in fp32, as torch's do: `nn.Dense`'s are the compute dtype's (a bf16
    GEMM output, then converted), one rounding more and a conversion kernel per weight."""

    features: int
    dtype: jnp.dtype
    kernel_init: nn.initializers.Initializer = nn.initializers.glorot_uniform()
    # set: `silu(x @ kernel + bias)` split into column blocks of these sizes, its backward one
    # kernel (`_linear_silu_split`; `silu_interpret`: in the Pallas interpreter)
    silu_split: tuple[int, ...] | None = None
    silu_interpret: bool = False

    @nn.compact
    def __call__(self, x: jax.Array):
        kernel = self.param("kernel", self.kernel_init, (x.shape[-1], self.features), jnp.float32)
        bias = self.param("bias", nn.initializers.zeros_init(), (self.features,), jnp.float32)
        # under shard_map's type check the parameters (replicated) enter as varying like `x`:
        # a custom rule's gradient must have its input's type, and this cast's transpose is
        # the sum over ranks that autodiff adds for a replicated input
        copy = self.get_variable(COPIES, "kernel") if self.has_variable(COPIES, "kernel") else None
        vary = tuple(sorted(_varying(x) - _varying(kernel)))
        if vary:
            kernel, bias = (jax.lax.pcast(p, vary, to="varying") for p in (kernel, bias))
            if copy is not None:
                copy = jax.lax.pcast(copy, vary, to="varying")
        # (the uvqk SiLU kernel's path casts its own: its copy, if any, goes unread)
        if copy is not None and self.silu_split is None:
            if copy.dtype != self.dtype or copy.shape != kernel.shape:
                raise ValueError(
                    f"{self.name}: weight copy {copy.dtype}{list(copy.shape)}, expected "
                    f"{jnp.dtype(self.dtype)}{list(kernel.shape)}"
                )
            return _linear_copied(x.astype(self.dtype), kernel, copy, bias)
        if self.silu_split is not None:
            return _linear_silu_split(
                x.astype(self.dtype), kernel, bias, self.silu_split, self.silu_interpret
            )
        return _linear(x.astype(self.dtype), kernel, bias)


class HSTULayer(nn.Module):
    cfg: ModelConfig
    attn: AttentionConfig
    silu_kernel: str | None = None  # HSTUModel's
    norm_kernel: str | None = None  # HSTUModel's

    @nn.compact
    def __call__(self, x, lay: dict, timestamps, deterministic: bool = True):
        c = self.cfg
        h, dqk, dv, dtype = c.num_heads, c.attention_dim, c.linear_dim, DTYPES[c.dtype]
        t = x.shape[0]
        glorot = nn.initializers.glorot_uniform()
        # the norms as Pallas kernels (`HSTUModel.norm_kernel`) where their widths fit them
        kernel = self.norm_kernel is not None and all(
            _norm_kernel().supports(t, width) is None for width in (x.shape[1], h * dv)
        )
        interpret_norm = self.norm_kernel == "interpret"
        if kernel:  # y in the GEMM's dtype; x passed through, its skip gradient added in-kernel
            scale, bias = _NormParams(x.shape[1], name="input_norm")(x)
            y, x = _norm_kernel().norm_residual(x, scale, bias, LN_EPS, dtype, interpret_norm)
        else:
            y = _norm("input_norm")(x)
        sizes = (h * dv, h * dv, h * dqk, h * dqk)
        width = sum(sizes)
        if self.silu_kernel and _silu_kernel().supports(sizes, t) is None:
            interpret = self.silu_kernel == "interpret"
            uvqk = Linear(width, dtype, glorot, sizes, interpret, name="uvqk")
            u, v, q, k = uvqk(y)
        else:
            uvqk = nn.silu(Linear(width, dtype, kernel_init=glorot, name="uvqk")(y))
            u, v, q, k = jnp.split(uvqk, np.cumsum(sizes)[:-1].tolist(), axis=-1)
        bias_init = nn.initializers.normal(0.02)
        rab_pos = (
            self.param("rab_position", bias_init, (h, c.rab_position_buckets))
            if c.rab_position_buckets
            else None
        )
        rab_time = (
            self.param("rab_time", bias_init, (h, c.rab_time_buckets))
            if c.rab_time_buckets
            else None
        )
        a = hstu_attention(
            self.attn,
            q.reshape(t, h, dqk),
            k.reshape(t, h, dqk),
            v.reshape(t, h, dv),
            lay["offsets"],
            lay["num_contextual"],
            lay["num_candidates"],
            timestamps,
            rab_pos,
            rab_time,
        )
        if kernel:
            scale, bias = _NormParams(h * dv, name="attn_norm")(u)
            y = _norm_kernel().gated_norm(
                a.reshape(t, h * dv), u, scale, bias, LN_EPS, dtype, interpret_norm
            )
        else:
            y = _norm("attn_norm")(a.reshape(t, h * dv)) * u
        y = nn.Dropout(c.dropout)(y, deterministic=deterministic or c.dropout == 0.0)
        return x + Linear(c.embedding_dim, dtype, kernel_init=glorot, name="output")(y)


class RankingHead(nn.Module):
    cfg: ModelConfig

    @nn.compact
    def __call__(self, z):
        glorot = nn.initializers.glorot_uniform()
        hid = nn.silu(nn.Dense(self.cfg.embedding_dim, kernel_init=glorot, name="hidden")(z))
        return nn.Dense(self.cfg.num_tasks, kernel_init=glorot, name="out")(hid)


def _normalize(x: jax.Array) -> jax.Array:
    """`x / max(||x||, 1e-6)`, written so that a zero row (capacity padding) has a zero
    gradient instead of NaN (the gradient of a norm at 0 is 0/0)."""
    return x / jnp.sqrt(jnp.maximum(jnp.sum(x * x, axis=-1, keepdims=True), 1e-12))


class HSTUModel(nn.Module):
    """`apply(vars, batch, global_loss_tokens) -> (loss, aux)`; `encode` gives `z [T, D]`.

    `external_tables`: the embedding tables are sharded outside the model (`embedding.py`);
    training calls pass their rows as `tables` (`Embeddings`)."""

    cfg: ModelConfig
    attn: AttentionConfig
    external_tables: bool = False
    # the uvqk projection's SiLU and bias gradients in one Pallas kernel (`build_model`'s
    # `silu_kernel`): "compiled", "interpret" (the Pallas interpreter: tests) or None (autodiff)
    silu_kernel: str | None = None
    # each layer's two LayerNorms as Pallas kernels (`build_model`'s `norm_kernel`), the same
    # choices; None: flax's LayerNorm, autodiff's backward
    norm_kernel: str | None = None

    def setup(self):
        self.embedding = Embeddings(self.cfg, self.external_tables)
        self.layers = [
            HSTULayer(self.cfg, self.attn, self.silu_kernel, self.norm_kernel)
            for _ in range(self.cfg.num_layers)
        ]
        self.final_norm = _norm(None)
        if self.cfg.task == "ranking":
            self.head = RankingHead(self.cfg)

    def stack(self, batch: DeviceBatch, deterministic: bool = True, tables: dict | None = None):
        """The HSTU layers' output `[T, D]` before the final norm (the residual stream, in the
        compute dtype), and the token layout."""
        lay = token_layout(batch)
        x, ts = self.embedding(batch, lay, tables)
        # the residual stream in the compute dtype, as torch runs it (the norms compute in fp32)
        x = x.astype(DTYPES[self.cfg.dtype])
        for layer in self.layers:
            x = layer(x, lay, ts, deterministic)
        return x, lay

    def encode(self, batch: DeviceBatch, deterministic: bool = True, tables: dict | None = None):
        """`z [T, D]`: every token's output, final norm applied (fp32), and the token layout."""
        x, lay = self.stack(batch, deterministic, tables)
        return self.final_norm(x), lay

    def _rows(self, x: jax.Array, tok: jax.Array, valid: jax.Array | None = None) -> jax.Array:
        """The final norm of the stack's rows `tok` (fp32): the norm is row-wise, so this is
        `encode`'s `z[tok]`, without a `[T, D]` fp32 pass for the few rows a loss reads.
        `valid`: the rows a loss reads (distinct tokens); the others read a zero row, each
        from its own index past `x`, so the backward scatters distinct rows (`_take_rows`).
        Without it (no gradient taken): any rows, clipped into `x`."""
        if valid is None:
            return self.final_norm(x[jnp.clip(tok, 0, x.shape[0] - 1)])
        pad = x.shape[0] + jnp.arange(tok.shape[0], dtype=tok.dtype)
        return self.final_norm(_take_rows(x, jnp.where(valid, tok, pad)))

    def __call__(
        self,
        batch: DeviceBatch,
        global_loss_tokens,
        deterministic: bool = True,
        tables: dict | None = None,
    ):
        x, lay = self.stack(batch, deterministic, tables)
        denom = jnp.maximum(jnp.asarray(global_loss_tokens, jnp.float32), 1.0)
        if self.cfg.task == "ranking":
            return self._ranking(batch, x, lay, denom)
        return self._retrieval(batch, x, lay, denom, tables)

    # ------------------------------------------------------------------ scoring (evaluation)
    def query_embeddings(self, batch: DeviceBatch) -> jax.Array:
        """`[B, D]`: each sample's encoder output at its last history event's action token,
        the position whose output the retrieval loss scores the next item with, normalised as
        there (padding samples: an arbitrary row)."""
        x, lay = self.stack(batch)
        last = jnp.maximum(batch.lengths["item"] - 1, 0)
        tok = lay["offsets"][:-1] + lay["num_contextual"] + 2 * last + 1
        return _normalize(self._rows(x, tok).astype(jnp.float32))

    def item_embeddings(self) -> jax.Array:
        """`[num_items, D]`: the item table normalised as the retrieval loss normalises it."""
        return _normalize(self.embedding.item.astype(jnp.float32))

    def candidate_logits(self, batch: DeviceBatch) -> jax.Array:
        """`[candidate capacity, num_tasks]`: the ranking head's logits, candidates packed at
        the front (rows past `sum(lengths["candidate"])` are padding)."""
        x, lay = self.stack(batch)
        return self._candidate_logits(batch, x, lay)

    def _candidate_logits(self, batch, x, lay):
        k = batch.lengths["candidate"]
        sample, j = _owner(k, batch.spec.capacity("candidate"))
        tok = (
            lay["offsets"][sample]
            + lay["num_contextual"][sample]
            + 2 * batch.lengths["item"][sample]
            + j
        )
        valid = jnp.arange(tok.shape[0], dtype=jnp.int32) < jnp.sum(k)
        return self.head(self._rows(x, tok, valid)).astype(jnp.float32)

    def _ranking(self, batch, x, lay, denom):
        k = batch.lengths["candidate"]
        cpos = jnp.arange(batch.spec.capacity("candidate"), dtype=jnp.int32)
        logits = self._candidate_logits(batch, x, lay)
        bits = jnp.arange(self.cfg.num_tasks, dtype=jnp.int32)
        labels = ((batch.values["label"][:, None] >> bits) & 1).astype(jnp.float32)
        per = optax.sigmoid_binary_cross_entropy(logits, labels).sum(axis=1)
        valid = cpos < jnp.sum(k)
        return jnp.sum(jnp.where(valid, per, 0.0)) / denom, {}

    def _retrieval(self, batch, x, lay, denom, tables=None):
        length, r = batch.lengths["item"], self.cfg.num_negatives
        epos = jnp.arange(batch.spec.capacity("item"), dtype=jnp.int32)
        sample, l_ = _owner(length, epos.shape[0])
        valid = (epos < jnp.sum(length)) & (l_ < length[sample] - 1)
        tok = lay["offsets"][sample] + lay["num_contextual"][sample] + 2 * l_ + 1
        query = _normalize(self._rows(x, tok, valid).astype(jnp.float32))
        pos_id = _take(batch.values["item"], epos + 1)
        neg_start = _excl(batch.lengths["negative"])[sample] + l_ * r
        neg_id = _take(
            batch.values["negative"], neg_start[:, None] + jnp.arange(r, dtype=jnp.int32)
        )  # [E, R]
        cand = jnp.concatenate([pos_id[:, None], neg_id], axis=1)  # [E, 1 + R]
        emb = _normalize(self.embedding.lookup("item", cand, tables))
        logits = jnp.einsum("ed,erd->er", query, emb) / self.cfg.retrieval_temperature
        dup = jnp.concatenate(
            [jnp.zeros_like(pos_id[:, None], bool), neg_id == pos_id[:, None]], axis=1
        )
        logits = jnp.where(dup, -jnp.inf, logits)
        per = jax.nn.logsumexp(logits, axis=1) - logits[:, 0]
        rank = jnp.sum(logits[:, 1:] > logits[:, :1], axis=1)
        hit = rank < TOP_K
        ndcg = jnp.where(hit, 1.0 / jnp.log2(rank.astype(jnp.float32) + 2.0), 0.0)
        aux = {
            f"hr@{TOP_K}": jnp.sum(jnp.where(valid, hit, 0.0)) / denom,
            f"ndcg@{TOP_K}": jnp.sum(jnp.where(valid, ndcg, 0.0)) / denom,
        }
        return jnp.sum(jnp.where(valid, per, 0.0)) / denom, aux


def build_model(
    cfg: ModelConfig,
    max_seqlen: int,
    interpret: bool | None = None,
    external_tables: bool = False,
    silu_kernel: str | None = None,
    norm_kernel: str | None = None,
) -> HSTUModel:
    """`silu_kernel`: "compiled" or "interpret" runs the uvqk SiLU's backward as one Pallas
    kernel (`HSTUModel.silu_kernel`, as torch runs its Triton one on CUDA); None (default)
    leaves it to autodiff, which XLA fuses well enough that the kernel does not pay: on an H200
    at bench_upstream batch 32 the kernel made jax's step 1 % slower (3 % before its residual
    was the GEMM's output; docs/BENCHMARKS.md). `HSTU_JAX_SILU_KERNEL=compiled` in the
    environment takes it where None was asked for (an A/B of the step in processes of their
    own: `bash scripts/gpu_check.sh silu`).

    `norm_kernel`: the same choices for each layer's input norm and gated norm as Pallas
    kernels, one pass each way (`hstu_kernels.pallas.layer_norm`, the twin of torch's
    `model.fused_norm` kernels), where XLA makes two to four; None leaves them to flax and
    autodiff. Where None is asked for, `HSTU_JAX_NORM_KERNEL` in the environment chooses (an
    A/B in processes of their own), else `model.fused_norm` on a GPU (`interpret=False`)
    takes the compiled kernels: on an H200 at bench_upstream batch 32 they made jax's step
    5.7 % faster (docs/BENCHMARKS.md, "jax: the norms as Pallas kernels")."""
    if silu_kernel is None and os.environ.get("HSTU_JAX_SILU_KERNEL"):
        silu_kernel = os.environ["HSTU_JAX_SILU_KERNEL"]
    if norm_kernel is None and os.environ.get("HSTU_JAX_NORM_KERNEL"):
        norm_kernel = os.environ["HSTU_JAX_NORM_KERNEL"]
    elif norm_kernel is None and cfg.fused_norm and interpret is False:
        norm_kernel = "compiled" if jax.default_backend() == "gpu" else None
    for name, value in (("silu_kernel", silu_kernel), ("norm_kernel", norm_kernel)):
        if value not in (None, "compiled", "interpret"):
            raise ValueError(f"{name}: expected compiled, interpret or None, got {value!r}")
    attn = AttentionConfig(
        cfg.attention_impl("jax"),
        max_seqlen,
        cfg.resolved_alpha,
        cfg.normalizer,
        interpret,
        cfg.pallas_lowering,
    )
    return HSTUModel(cfg, attn, external_tables, silu_kernel, norm_kernel)


_LAYER = re.compile(r"^layers_(\d+)$")


def params_to_flax(params: dict[str, np.ndarray]) -> dict:
    """Core dotted names (`layers.0.uvqk.kernel`) -> the Flax `params` tree."""
    tree: dict = {}
    for name, value in params.items():
        parts = name.split(".")
        if parts[0] == "layers":
            parts = [f"layers_{parts[1]}", *parts[2:]]
        node = tree
        for part in parts[:-1]:
            node = node.setdefault(part, {})
        node[parts[-1]] = jnp.asarray(value)
    return tree


def flax_to_params(tree) -> dict[str, np.ndarray]:
    """Inverse of `params_to_flax` (host numpy arrays)."""
    out = {}
    for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
        parts = [str(getattr(p, "key", p)) for p in path]
        m = _LAYER.match(parts[0])
        if m:
            parts = ["layers", m.group(1), *parts[1:]]
        out[".".join(parts)] = np.asarray(leaf)
    return out
