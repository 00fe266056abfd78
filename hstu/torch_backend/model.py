"""The HSTU model of docs/MODEL.md in torch: TorchRec embeddings, HSTU layers, two heads.

Single-device code: data parallelism (shuffle, gradient reduction) is applied by the backend.
Parameters are exactly `hstu.params.param_shapes` (same names, linear kernels `[in, out]`);
`load_params` / `export_params` convert from / to the core's numpy dict. The one renaming is
TorchRec's table weight `embedding.embeddings.<table>.weight` <-> `embedding.<table>`.
"""

from __future__ import annotations

import contextlib

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from torch.autograd.function import once_differentiable
from torchrec.modules.embedding_configs import EmbeddingConfig
from torchrec.modules.embedding_modules import EmbeddingCollection

from hstu.errors import HSTUError
from hstu.params import param_shapes
from hstu.torch_backend.attention import get_attention, get_uvqk_attention
from hstu.torch_backend.batch import TorchBatch
from hstu.torch_backend.layout import permute_rows, select_distinct_rows

LN_EPS = 1e-6
TOP_K = 10  # retrieval metrics: HR@10, NDCG@10
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class LayerNorm(nn.Module):
    """LayerNorm over the last dim, times `gate` when given (HSTU's `attn_norm(a) * u`).
    `fused` (`model.fused_norm` on CUDA): one Triton kernel forward and one backward
    (`hstu_kernels.triton.layer_norm`) instead of eager torch's norm, casts and multiplies."""

    def __init__(self, dim: int):
        super().__init__()
        self.scale = nn.Parameter(torch.ones(dim))
        self.bias = nn.Parameter(torch.zeros(dim))
        self.fused = False

    def forward(self, x: torch.Tensor, gate: torch.Tensor | None = None) -> torch.Tensor:
        if self.fused:
            from hstu_kernels.triton.layer_norm import layer_norm

            return layer_norm(x, self.scale, self.bias, LN_EPS, gate)
        y = F.layer_norm(x, x.shape[-1:], self.scale.to(x.dtype), self.bias.to(x.dtype), eps=LN_EPS)
        return y if gate is None else y * gate

    def add(self, x: torch.Tensor, pending: tuple | None) -> tuple[torch.Tensor, torch.Tensor]:
        """`(h, norm(h))` with `h = x + residual (+ bias)` for `pending = (residual, bias or
        None)` (`h = x` when `pending` is None): the residual stream's add and this norm, one
        kernel each way when fused (`add_layer_norm`, which also sums the bias's gradient). A
        bias is added in fp32 and `h` rounded once, as the kernel does."""
        if pending is None:
            return x, self(x)
        residual, bias = pending
        if self.fused:
            from hstu_kernels.triton.layer_norm import add_layer_norm

            return add_layer_norm(x, residual, self.scale, self.bias, LN_EPS, bias)
        if bias is None:
            h = x + residual
        else:
            h = (x.float() + residual.float() + bias.float()).to(x.dtype)
        return h, self(h)


@contextlib.contextmanager
def _tf32_matmuls():
    matmul = torch.backends.cuda.matmul
    before, matmul.allow_tf32 = matmul.allow_tf32, True
    try:
        yield
    finally:
        matmul.allow_tf32 = before


class _Tf32Addmm(torch.autograd.Function):
    """`bias + x @ kernel` for fp32 `x` with cuBLAS's TF32 math in forward and backward, the
    precision JAX gives an fp32 dot on an Ampere or later GPU by default (torch's default is
    full fp32, 8x slower on CUDA cores). Scoped to the op: the process's setting is restored."""

    @staticmethod
    def forward(ctx, x, kernel, bias):
        ctx.save_for_backward(x, kernel)
        with _tf32_matmuls():
            return torch.addmm(bias, x, kernel)

    @staticmethod
    def backward(ctx, dy):
        x, kernel = ctx.saved_tensors
        need = ctx.needs_input_grad
        with _tf32_matmuls():
            dx = dy @ kernel.t() if need[0] else None
            dkernel = x.t() @ dy if need[1] else None
        return dx, dkernel, dy.sum(0) if need[2] else None


def widened_mm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """`a @ b` of reduced-precision operands in fp32: on CUDA cuBLAS's fp32 accumulator
    written as is (`out_dtype`), elsewhere the product rounded to the operands' dtype and
    widened (what autograd of `kernel.to(bf16)` gives: CPU torch has no `out_dtype` GEMM)."""
    if a.is_cuda and a.dtype != torch.float32:
        return torch.mm(a, b, out_dtype=torch.float32)
    return (a @ b).float()


def reduced_weights(linears, dtype: torch.dtype) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """`(kernel, bias)` of every linear in `dtype`, copied outside autograd by one multi-tensor
    copy (on CUDA a launch or two for the whole stack, where a cast per tensor took one each,
    forward and backward): `Linear` / `linear_silu` take them as the operands of their GEMMs
    and return the fp32 parameters' gradients themselves (`_ReducedAddmm`)."""
    src = [t for linear in linears for t in (linear.kernel, linear.bias)]
    with torch.no_grad():
        dst = [torch.empty_like(t, dtype=dtype) for t in src]
        torch._foreach_copy_(dst, src)
    return list(zip(dst[0::2], dst[1::2], strict=True))


class _ReducedAddmm(torch.autograd.Function):
    """`bias + x @ kernel` of a bf16 / fp16 `x` with fp32 parameters, the GEMM's operands their
    copies in x's dtype (`reduced_weights`). Backward: the parameters' gradients in fp32 from
    the GEMM's accumulator and an fp32 column sum (`widened_mm`), where autograd of
    `kernel.to(x.dtype)` rounds them to x's dtype and launches a cast back per parameter."""

    @staticmethod
    def forward(ctx, x, kernel, bias, kernel_lp, bias_lp):
        """`bias` / `bias_lp` None: `x @ kernel` (a bias added elsewhere)."""
        ctx.save_for_backward(x, kernel_lp)
        return torch.mm(x, kernel_lp) if bias_lp is None else torch.addmm(bias_lp, x, kernel_lp)

    @staticmethod
    @once_differentiable
    def backward(ctx, dy):
        x, kernel_lp = ctx.saved_tensors
        need = ctx.needs_input_grad
        dx = dy @ kernel_lp.t() if need[0] else None
        dkernel = widened_mm(x.t(), dy) if need[1] else None
        dbias = dy.sum(0, dtype=torch.float32) if need[2] else None
        return dx, dkernel, dbias, None, None


class Linear(nn.Module):
    """x @ kernel + bias with the kernel stored `[in, out]` like the core. `tf32` (the ranking
    head on CUDA): an fp32 `x` is multiplied with TF32 math, as JAX does (`_Tf32Addmm`). A
    reduced-precision `x` multiplies the parameters' copies in its dtype (`reduced`: those
    `reduced_weights` made for the whole stack, else made here) and gets fp32 gradients for
    them (`_ReducedAddmm`). `bias=False`: `x @ kernel`, the caller adds the bias (a layer's
    output projection, whose bias the next fused norm adds: `LayerNorm.add`)."""

    def __init__(self, dim_in: int, dim_out: int):
        super().__init__()
        self.kernel = nn.Parameter(torch.zeros(dim_in, dim_out))
        self.bias = nn.Parameter(torch.zeros(dim_out))
        self.tf32 = False

    def forward(
        self, x: torch.Tensor, reduced: tuple | None = None, bias: bool = True
    ) -> torch.Tensor:
        if x.dtype != self.kernel.dtype:
            kernel_lp, bias_lp = reduced or reduced_weights([self], x.dtype)[0]
            if not bias:
                return _ReducedAddmm.apply(x, self.kernel, None, kernel_lp, None)
            return _ReducedAddmm.apply(x, self.kernel, self.bias, kernel_lp, bias_lp)
        if not bias:
            return x @ self.kernel
        if self.tf32 and x.is_cuda:
            return _Tf32Addmm.apply(x, self.kernel, self.bias)
        return torch.addmm(self.bias, x, self.kernel)


class HSTULayer(nn.Module):
    def __init__(self, cfg, attention, uvqk_attention=None):
        """`uvqk_attention`: the kernel's split-and-attention op (attention.py), or None: the
        layer splits its activation and calls `attention` (the same values and gradients)."""
        super().__init__()
        h, dqk, dv, d = cfg.num_heads, cfg.attention_dim, cfg.linear_dim, cfg.embedding_dim
        self.num_heads, self.dqk, self.dv = h, dqk, dv
        self.input_norm = LayerNorm(d)
        self.uvqk = Linear(d, h * (2 * dv + 2 * dqk))
        self.attn_norm = LayerNorm(h * dv)
        self.output = Linear(h * dv, d)
        pos, tim = cfg.rab_position_buckets, cfg.rab_time_buckets
        self.rab_position = nn.Parameter(torch.zeros(h, pos)) if pos else None
        self.rab_time = nn.Parameter(torch.zeros(h, tim)) if tim else None
        self.attention, self.uvqk_attention = attention, uvqk_attention
        self.alpha = cfg.resolved_alpha
        self.normalizer, self.dropout = cfg.normalizer, cfg.dropout
        self.fused_silu = False  # `model.fused_silu` on CUDA (HSTUModel sets it)
        # `model.silu_epilogues` on CUDA (HSTUModel sets it): the kernel op from the normed
        # input to the gated norm (`get_uvqk_attention(linear=True)`), used with fused_silu
        # and the fused norms
        self.linear_uvqk_attention = None

    def forward(
        self,
        x: torch.Tensor,
        seq: dict,
        pending: tuple | None = None,
        reduced: list | None = None,
    ) -> tuple[torch.Tensor, tuple]:
        """`(x + pending, this layer's residual branch)`: the stream's add is left to the next
        layer's input norm (`LayerNorm.add`, fused with it) or the final norm (`run_stack`).
        A branch is `(output, bias or None)`: with fused norms the output projection's bias
        is added (and its gradient summed) by the next norm's kernel. `pending`: the previous
        layer's branch (None for the first layer); `reduced`: the uvqk and output linears'
        parameters in x's dtype (`reduced_weights`), else made here."""
        x, normed = self.input_norm.add(x, pending)
        h, dqk, dv = self.num_heads, self.dqk, self.dv
        if reduced is None and x.dtype != self.uvqk.kernel.dtype:
            reduced = reduced_weights([self.uvqk, self.output], x.dtype)
        uvqk_lp, output_lp = reduced or (None, None)
        kw = dict(
            max_seqlen=seq["max_seqlen"],
            alpha=self.alpha,
            normalizer=self.normalizer,
            num_contextual=seq["num_contextual"],
            num_candidates=seq["num_candidates"],
            timestamps=seq["timestamps"] if self.rab_time is not None else None,
            rab_pos=self.rab_position.to(x.dtype) if self.rab_position is not None else None,
            rab_time=self.rab_time.to(x.dtype) if self.rab_time is not None else None,
        )
        dims = dict(num_heads=h, linear_dim=dv, attention_dim=dqk)
        norm = (self.attn_norm.scale, self.attn_norm.bias, LN_EPS)
        if self.linear_uvqk_attention is not None and self.fused_silu and self.attn_norm.fused:
            # the projection, SiLU, attention and gated norm in one op: SiLU's backward and
            # the bias gradient in the kernels that write the gradients
            y = self.linear_uvqk_attention(
                normed, self.uvqk.kernel, self.uvqk.bias, seq["offsets"], **dims, **kw,
                norm=norm, reduced=uvqk_lp,
            )  # fmt: skip
            return self._output(x, y, output_lp)
        if self.fused_silu:  # SiLU's backward and the bias gradient in one kernel
            from hstu_kernels.triton.linear_silu import linear_silu

            uvqk = linear_silu(normed, self.uvqk.kernel, self.uvqk.bias, uvqk_lp)
        else:
            uvqk = F.silu(self.uvqk(normed, uvqk_lp))
        if self.uvqk_attention is not None and self.attn_norm.fused:
            # the gated norm inside the op: u's gradient written in place
            y = self.uvqk_attention(uvqk, seq["offsets"], **dims, **kw, norm=norm)
        else:
            if self.uvqk_attention is not None:
                u, a = self.uvqk_attention(uvqk, seq["offsets"], **dims, **kw)
            else:
                u, v, q, k = torch.split(uvqk, [h * dv, h * dv, h * dqk, h * dqk], dim=-1)
                unflat = (h, -1)
                a = self.attention(
                    q.unflatten(-1, unflat),
                    k.unflatten(-1, unflat),
                    v.unflatten(-1, unflat),
                    seq["offsets"],
                    **kw,
                )
            y = self.attn_norm(a.reshape(-1, h * dv), gate=u)
        return self._output(x, y, output_lp)

    def _output(self, x, y, output_lp):
        """`(x, branch)` from the gated norm's output `y`: dropout and the output projection."""
        y = F.dropout(y, self.dropout, self.training)
        if self.input_norm.fused:  # the next norms are too (`model.fused_norm`)
            return x, (self.output(y, output_lp, bias=False), self.output.bias)
        return x, (self.output(y, output_lp), None)


def run_stack(
    layers,
    final_norm: LayerNorm,
    x: torch.Tensor,
    seq: dict,
    rows: torch.Tensor | None = None,
    distinct: bool = True,
    reduced: list | None = None,
) -> torch.Tensor:
    """The HSTU layers and the final norm: `z [T, D]` in fp32, or only its rows `rows` (the
    ones a loss reads: the last residual add and the norm are row-wise, so the same values
    without the `[T, D]` pass each way). Each layer's residual add happens in the next norm
    (`HSTULayer.forward`); a reduced-precision stack's linears get their parameters' copies
    in x's dtype from one multi-tensor copy (`reduced_weights`). `distinct`: `rows` holds
    no row twice, so their gradients are written, not added (`select_distinct_rows`).
    `reduced`: those copies, kept up to date by the caller (`(kernel, bias)` per linear, each
    layer's uvqk then output projection), in place of the copy made here."""
    linears = [linear for layer in layers for linear in (layer.uvqk, layer.output)]
    if reduced is None and linears and x.dtype != linears[0].kernel.dtype:
        reduced = reduced_weights(linears, x.dtype)
    pending = None
    for i, layer in enumerate(layers):
        x, pending = layer(x, seq, pending, reduced[2 * i : 2 * i + 2] if reduced else None)
    if rows is not None and rows.numel() == 0:  # no row to read (a rank without targets):
        # the whole stream's norm, so that every parameter still gets a (zero) gradient
        return final_norm.add(x, pending)[1].float().index_select(0, rows)
    if rows is not None:
        select = select_distinct_rows if distinct else lambda t, i: t.index_select(0, i)
        x = select(x, rows)
        if pending is not None:
            pending = (select(pending[0], rows), pending[1])
    return final_norm.add(x, pending)[1].float()


class HSTUModel(nn.Module):
    def __init__(self, cfg, device: torch.device | str = "cpu", meta_tables: bool = False):
        """`meta_tables`: the embedding tables are built on the meta device, holding no memory
        (TorchRec's sharding then allocates each rank's shards: hstu/torch_backend/sharding.py);
        everything else on `device`."""
        super().__init__()
        self.cfg = cfg
        d = cfg.embedding_dim
        item_features = ["item", "candidate"] + (["negative"] if cfg.task == "retrieval" else [])
        self.embedding = EmbeddingCollection(
            tables=[
                EmbeddingConfig(cfg.num_items, d, name="item", feature_names=item_features),
                EmbeddingConfig(cfg.num_actions, d, name="action", feature_names=["action"]),
                EmbeddingConfig(
                    cfg.num_contextual_ids, d, name="contextual", feature_names=["contextual"]
                ),
            ],
            device=torch.device("meta") if meta_tables else None,
        )
        impl = cfg.attention_impl("torch")
        attention = get_attention(impl, device, cfg.attention_backward)
        uvqk_attention = get_uvqk_attention(impl, device, cfg.attention_backward)
        self.layers = nn.ModuleList(
            HSTULayer(cfg, attention, uvqk_attention) for _ in range(cfg.num_layers)
        )
        self.final_norm = LayerNorm(d)
        if cfg.task == "ranking":
            self.head = nn.Module()
            self.head.hidden = Linear(d, d)
            self.head.out = Linear(d, cfg.num_tasks)
        self.compute_dtype = _DTYPES[cfg.dtype]
        # Set when the tables are sharded (sharding.py): the features the sharded collection
        # looks up, so its all-to-alls carry ids only (not timestamps or labels).
        self.embedding_keys: list[str] | None = None
        self.graphed = None  # train.cuda_graphs: a graphs.GraphedStack over this model
        cuda = torch.device(device).type == "cuda"
        for module in self.modules():
            if isinstance(module, LayerNorm):
                module.fused = cfg.fused_norm and cuda
        linear_op = None
        if cfg.silu_epilogues and cuda:
            linear_op = get_uvqk_attention(impl, device, cfg.attention_backward, linear=True)
        for layer in self.layers:
            layer.fused_silu = cfg.fused_silu and cuda
            layer.linear_uvqk_attention = linear_op
        # a reduced-precision model's fp32 head on CUDA with TF32 math; an fp32 model keeps it
        # full fp32, so its GPU run stays within fp32 rounding of the CPU's
        self.use_tf32_head(cuda and self.compute_dtype != torch.float32)
        for name, child in self.named_children():
            if not (meta_tables and name == "embedding"):
                child.to(device)

    def use_tf32_head(self, enabled: bool) -> None:
        """The ranking head's fp32 matmuls with TF32 math (the default on CUDA for bf16 / fp16
        models, as JAX runs an fp32 dot there) or in full fp32 (fp32 models, CPU). TF32 rounds
        the head's inputs to 10 bits: a change in z's 7th digit can move the head's output in
        its 4th, so two runs that agree to fp32 rounding elsewhere drift by ~1e-4 with it."""
        if self.cfg.task == "ranking":
            self.head.hidden.tf32 = self.head.out.tf32 = enabled

    # ------------------------------------------------------------------ parameters
    @staticmethod
    def core_name(torch_name: str) -> str:
        if torch_name.startswith("embedding.embeddings."):
            return "embedding." + torch_name[len("embedding.embeddings.") :].removesuffix(".weight")
        return torch_name

    def named_core_parameters(self) -> dict[str, nn.Parameter]:
        return {self.core_name(n): p for n, p in self.named_parameters()}

    def load_params(self, params: dict[str, np.ndarray], tables: bool = True) -> None:
        """Every parameter by core name; `tables=False`: all but the embedding tables."""
        mine = self.named_core_parameters()
        expected = param_shapes(self.cfg)
        if not tables:
            expected = {n: s for n, s in expected.items() if not n.startswith("embedding.")}
        if set(params) != set(expected):
            raise HSTUError(
                f"load_params: missing {sorted(set(expected) - set(params))}, "
                f"unexpected {sorted(set(params) - set(expected))}"
            )
        with torch.no_grad():
            for name, value in params.items():
                if tuple(np.shape(value)) != expected[name]:
                    raise HSTUError(
                        f"load_params: {name} has shape {list(np.shape(value))}, "
                        f"expected {list(expected[name])}"
                    )
                mine[name].copy_(torch.as_tensor(np.asarray(value, dtype=np.float32)))

    def export_params(self) -> dict[str, np.ndarray]:
        return {n: p.detach().cpu().numpy().copy() for n, p in self.named_core_parameters().items()}

    # ------------------------------------------------------------------ forward
    def _lookup(self, ids: dict) -> dict[str, torch.Tensor]:
        """feature -> its rows `[N, D]` from the replicated tables, one lookup per table: the
        features that share a table (item, candidate, negative) are read in one call, so the
        backward builds one dense gradient per table, not one per feature plus their sum
        (`EmbeddingCollection.forward`; 0.4 GB more written and read per step at 100K x 1024)."""
        rows = {}
        for table in self.embedding.embedding_configs():
            values = [ids[f].values() for f in table.feature_names]
            weight = self.embedding.embeddings[table.name].weight
            out = F.embedding(torch.cat(values) if len(values) > 1 else values[0], weight)
            rows.update(zip(table.feature_names, out.split([v.numel() for v in values])))
        return rows

    def looked_up(self, tb: TorchBatch) -> dict[str, torch.Tensor]:
        """feature -> its rows `[N, D]`; with sharded tables (`embedding_keys` set) a
        collective (TorchRec's lookup), which every rank calls for a batch of its own."""
        if self.embedding_keys is None:
            return self._lookup(tb.kjt.to_dict())
        sharded = self.embedding(tb.kjt.permute([tb.keys.index(k) for k in self.embedding_keys]))
        return {name: jt.values() for name, jt in sharded.items()}

    def sequence(self, tb: TorchBatch, emb: dict | None = None) -> tuple[torch.Tensor, dict]:
        """Embed and lay out the tokens of every sample (docs/MODEL.md token table); `emb`:
        the rows `looked_up` gives, where the caller looked them up already."""
        ids = tb.kjt.to_dict()
        if emb is None:
            emb = self.looked_up(tb)
        lengths = dict(zip(tb.keys, tb.lengths_KB().to(torch.int64), strict=True))
        totals = dict(zip(tb.keys, tb.length_per_key(), strict=True))
        where = tb.token_layout().views()
        inverse = where["inverse"]
        src = torch.cat(
            [
                emb["contextual"],
                emb["item"],
                emb["action"],
                emb["candidate"],
            ]
        )
        # a permutation of the rows: its gradient is one gather (`permute_rows`)
        x = permute_rows(src, inverse, where["dest"]).to(self.compute_dtype)
        item_time = ids["item_time"].values()
        times = torch.cat(
            [
                item_time.new_zeros(totals["contextual"]),
                item_time,
                item_time,
                ids["candidate_time"].values(),
            ]
        ).index_select(0, inverse)
        seq = {
            "offsets": where["offsets"],
            "max_seqlen": tb.max_seqlen,
            # int32, what the kernel reads (else every layer casts, forward and backward)
            "num_contextual": where["num_contextual"],
            "num_candidates": where["num_candidates"],
            "timestamps": times,
            "pos_item": where["pos_item"],
            "pos_cand": where["pos_cand"],
            "target_item": where["target_item"],
            "emb": emb,
            "ids": ids,
            "lengths": lengths,
            "totals": totals,
        }
        return x, seq

    def stack(
        self,
        x: torch.Tensor,
        seq: dict,
        rows: torch.Tensor | None = None,
        distinct: bool = True,
        reduced: list | None = None,
    ) -> torch.Tensor:
        """The HSTU layers and the final norm: `z [T, D]` in fp32, or its rows `rows`
        (`distinct`: no row twice, as every loss row and query token is). `reduced`: the
        linears' parameters in x's dtype, kept by the caller (`run_stack`)."""
        return run_stack(self.layers, self.final_norm, x, seq, rows, distinct, reduced)

    def stack_linears(self) -> list:
        """The stack's linears in `run_stack`'s order of `reduced`: each layer's uvqk and
        output projections."""
        return [linear for layer in self.layers for linear in (layer.uvqk, layer.output)]

    def loss_rows(self, seq: dict) -> torch.Tensor:
        """The tokens whose output the loss reads: each candidate (ranking), each target's
        query, the action token of the event before it (retrieval)."""
        if self.cfg.task == "ranking":
            return seq["pos_cand"]
        return seq["pos_item"][seq["target_item"]] + 1

    def encode(self, tb: TorchBatch, emb: dict | None = None) -> tuple[torch.Tensor, dict]:
        """The HSTU stack's output `z [T, D]` (fp32, final norm applied) and the layout.
        Training with `graphed` set (graphs.py), the stack is replayed from a CUDA graph."""
        x, seq = self.sequence(tb, emb)
        if self.graphed is not None and self.training and torch.is_grad_enabled():
            return self.graphed(x, seq), seq
        return self.stack(x, seq), seq

    def forward(
        self, tb: TorchBatch, global_loss_tokens: int, emb: dict | None = None
    ) -> tuple[torch.Tensor, dict]:
        """(local loss sum / global target count, {metric: local sum}) for one batch; `emb`:
        its rows looked up already (`looked_up`), else the model looks them up."""
        x, seq = self.sequence(tb, emb)
        rows = self.loss_rows(seq)
        if self.graphed is not None and self.training and torch.is_grad_enabled():
            z = self.graphed(x, seq).index_select(0, rows)  # the graphed stack: all T rows
        else:
            z = self.stack(x, seq, rows)
        denom = float(max(int(global_loss_tokens), 1))
        if self.cfg.task == "ranking":
            return self._ranking_loss(z, seq, denom)
        return self._retrieval_loss(z, seq, denom)

    # ------------------------------------------------------------------ scoring (evaluation)
    def query_embeddings(self, tb: TorchBatch) -> torch.Tensor:
        """`[B, D]`: each sample's encoder output at its last history event's action token,
        the position whose output the retrieval loss scores the next item with, normalised as
        there. Every sample needs at least one history event."""
        x, seq = self.sequence(tb)
        last = torch.cumsum(seq["lengths"]["item"], 0) - 1  # each sample's last event
        return F.normalize(self.stack(x, seq, seq["pos_item"][last] + 1), dim=-1, eps=1e-6)

    def item_embeddings(self) -> torch.Tensor:
        """`[num_items, D]`: the item table normalised as the retrieval loss normalises it."""
        table = self.embedding.embeddings["item"].weight
        return F.normalize(table.float(), dim=-1, eps=1e-6)

    def candidate_logits(self, tb: TorchBatch) -> torch.Tensor:
        """`[sum K, num_tasks]`: the ranking head's logits of every candidate."""
        x, seq = self.sequence(tb)
        return self.ranking_head(self.stack(x, seq, seq["pos_cand"]))

    def ranking_head(self, zc: torch.Tensor) -> torch.Tensor:
        """`[rows, num_tasks]` logits of the encoder's rows `zc` (the candidates')."""
        return self.head.out(F.silu(self.head.hidden(zc)))

    def _ranking_loss(self, zc, seq, denom):
        """`zc`: the candidates' rows (`loss_rows`)."""
        logits = self.ranking_head(zc)
        bce = self.ranking_terms(logits, seq["ids"]["label"].values())
        return bce.sum() / denom, {}

    def ranking_terms(self, logits: torch.Tensor, label_bits: torch.Tensor) -> torch.Tensor:
        """`[rows, num_tasks]` binary cross-entropy of each candidate's logits against the
        task bits of its label (bit t: task t)."""
        bits = torch.arange(self.cfg.num_tasks, device=logits.device)
        labels = ((label_bits[:, None] >> bits) & 1).to(logits.dtype)
        return F.binary_cross_entropy_with_logits(logits, labels, reduction="none")

    def _retrieval_loss(self, zq, seq, denom):
        """`zq`: each target's query row (`loss_rows`)."""
        r = self.cfg.num_negatives
        item_idx = seq["target_item"]  # event l of its sample, for l < L - 1 (layout.py)
        num_targets = item_idx.numel()  # negatives: (L - 1) * R per sample (checked)
        emb, ids = seq["emb"], seq["ids"]
        loss, hit, ndcg = self.retrieval_terms(
            zq,
            emb["item"].index_select(0, item_idx + 1),
            emb["negative"].reshape(num_targets, r, zq.shape[1]),
            ids["item"].values().index_select(0, item_idx + 1),
            ids["negative"].values().reshape(num_targets, r),
        )
        return loss.sum() / denom, {f"hr@{TOP_K}": hit.sum(), f"ndcg@{TOP_K}": ndcg.sum()}

    def retrieval_terms(self, z_query, pos, neg, pos_ids, neg_ids):
        """Per target: (sampled-softmax loss, hit@TOP_K, NDCG@TOP_K), from the encoder output
        at its query token `[N, D]`, the positive item's and the negatives' rows `[N, D]`,
        `[N, R, D]` and their ids `[N]`, `[N, R]` (a negative equal to the positive is
        masked out)."""
        query = F.normalize(z_query, dim=-1, eps=1e-6)
        pos = F.normalize(pos, dim=-1, eps=1e-6)
        neg = F.normalize(neg, dim=-1, eps=1e-6)
        temp = self.cfg.retrieval_temperature
        pos_logit = (query * pos).sum(-1, keepdim=True) / temp
        neg_logits = torch.einsum("td,trd->tr", query, neg) / temp
        neg_logits = neg_logits.masked_fill(neg_ids == pos_ids[:, None], float("-inf"))
        logits = torch.cat([pos_logit, neg_logits], dim=1)
        loss = torch.logsumexp(logits, dim=1) - logits[:, 0]
        with torch.no_grad():
            rank = (neg_logits > pos_logit).sum(dim=1)
            hit = rank < TOP_K
            ndcg = torch.where(hit, 1.0 / torch.log2(rank.to(z_query.dtype) + 2.0), 0.0)
        return loss, hit.to(z_query.dtype), ndcg
