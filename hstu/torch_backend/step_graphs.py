"""The whole torch training step as CUDA graphs (`train.cuda_graphs`, `train.graph_scope=auto`
with replicated tables: `embedding.sharding=none`, or `data_parallel` with Adam; at W > 1 all
but the collectives and the update, below).

With the HSTU stack alone in graphs (graphs.py) the batch-8 step of `bench_upstream` was still
bound by the host: ~7.5 ms per step of Python dispatch around the stack (the lookups and the
token layout, the loss, autograd walking ~100 nodes, the gradient norm, AdamW) against ~6.5 ms
of kernels (docs/BENCHMARKS.md, "the host's share of the batch-8 step"). Here everything from
the embedding lookups to the optimizer update is one graph per shape: a step is a few copies
into the graph's static inputs and one replay.

Static shapes:

* tokens: padded to a capacity of the run's `hstu.capacity` policy, as graphs.py pads them.
  The lookups read the ids in source order (`cat(contextual, item, action, candidate)`, which
  holds exactly one id per token) at every position of the capacity: each position reads the
  item table and the small tables (contextual and action, concatenated) and keeps the row of
  its own (the other lookup reads row 0, and the `where` gives it no gradient). The token
  layout's `inverse` then places them; padding positions map to themselves and lie past
  `offsets[-1]`, so no sample and no loss reads them, and their gradient is exactly zero.
* loss rows (ranking: candidates; retrieval: targets), masked by the real count: a bound fixed
  by the token capacity and the rows (`loss_rows_capacity`), so that the loss adds no shapes
  of its own: retrieval scores at most one target per two tokens (an item and its action),
  ranking at most `data.max_candidates` per row. A batch past that bound (a source whose
  samples exceed the config's) pads to the next power of two instead.
* one graph per (token capacity, rows, loss rows); MAX_GRAPHS at most, then eager steps.

The sizes that change from step to step (the key boundaries in source order, the real token
and loss-row counts, the global loss-token count) are int64 device scalars in a header of the
static input: the graph computes its masks and the loss's denominator from them.

The update: AdamW with the run's optimizer's state and hyperparameters (its step counts on the
device, as torch's capturable AdamW keeps them), for every parameter but the item table, as one
`hstu_kernels.triton.adamw_multi` launch that also sums the gradients' squares for the norm
(`fused_update`; torch's fused AdamW and a norm pass where that kernel cannot run). The table
is read as a leaf of rows (`W[ids]`, detached) whose gradient the graph keeps as it is, and
`hstu_kernels.triton.adamw_rows` applies the same AdamW to it from those rows, with the
optimizer's own state: no dense `[V, D]` gradient is filled, scattered, read by the norm and by
AdamW (about 0.65 ms of every `bench_upstream` step, docs/BENCHMARKS.md). AdamW's state is
initialised before the first capture (`_init_state`: a step at learning rate 0 on zero
gradients, then the count reset, which leaves every parameter and moment as it was). Every
parameter is updated every step as in the eager step: a parameter the loss does not reach gets
a zero gradient inside the graph (`GradBuckets.finish` does the same eagerly), the table's rows
nobody looked up too.

`data_parallel` tables with Adam (sharding.ReplicatedTables) are updated on their touched
rows only, with their own state and `embedding.*` hyperparameters, t advanced once per
replay on the device: the item table by the same kernels in their sparse mode, the
contextual and action tables from their dense gradients where the step's ids mark them.

Memory: the graphs share one pool. Everything a replay produces is consumed inside it (the
gradients by the norm and AdamW) except its scalars, which the backend copies out before the
next replay on the same stream; the parameters, the optimizer state and the static inputs
are allocated outside the pool. So a capture may reuse what another graph freed, and the
gradients are not kept between steps (`.grad` is None after a replayed step).

At W > 1 the graph holds what one rank computes alone, and the collectives run after its
replay, eagerly (a collective's sizes must agree over the ranks, and balanced ranks replay
graphs of different capacities). The graph writes into one static buffer: every gradient but
the item table's (autograd accumulates into views of it), the loss and metric sums, and a
float per table row this rank looked up. One SUM all-reduce of that buffer, then the item
table's gradient reduced over the rows some rank looked up, as `grad_sync.TouchedRowsReduce`
does for the eager step: `cap` rows, bounded on the host by the table's lookups over the global
batch (the gathered stats), the marked rows first; each rank adds its rows' gradients into
those positions (no `[V, D]` gradient is built) and they are all-reduced. The norm and the
updates (fused AdamW, the table's kernels from the reduced rows) follow, eagerly. Which path a
step takes is decided from the gathered stats, the same on every rank: a rank whose shape has
no graph (past MAX_GRAPHS, no tokens) runs the same padded step uncaptured, so every rank
issues the same collectives. With the stack's graphs alone, rank 0 of a balanced W=4 step
dispatched for 11-15 ms against 15.3 ms of device work (docs/BENCHMARKS.md).

The warm-up before a capture runs forward and backward on a side stream with the first batch
of its shape (compiles the Triton kernels, the table update's without running them, sizes
cuBLAS's workspace) and discards the gradients: it never updates the parameters. Without
CUDA (`capture=False`, the CPU tests) the same padded step runs eagerly, which checks the
padding and masks against the eager model.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist

from hstu.capacity import CapacityPolicy
from hstu.pipeline import gathered_lengths
from hstu.torch_backend import grad_sync
from hstu.torch_backend.attention import shared_schedules
from hstu.torch_backend.batch import TorchBatch
from hstu.torch_backend.graphs import MAX_GRAPHS  # beyond it, a new shape runs the eager step
from hstu.torch_backend.layout import layout_arrays, select_distinct_rows
from hstu.torch_backend.model import TOP_K
from hstu.torch_backend.sharding import EMBEDDING_PREFIX, table_features
from hstu.torch_backend.staging import staging

log = logging.getLogger(__name__)

TOKEN_KEYS = ("contextual", "item", "action", "candidate")  # a sample's tokens, by key

# the header of the static input: int64 scalars the graph reads. Its first four are also the
# small tables' runs of sources (`embed_tokens`' segments): the contextual ids at
# [context_start = 0, item_start), the action ids at [action_start, candidate_start).
HEADER = (
    "context_start", "item_start", "action_start", "candidate_start", "tokens", "loss_rows",
    "loss_tokens",
)  # fmt: skip
HEADER_SIZE = 8


def loss_rows_capacity(
    real: int, capacity: int, rows: int, task: str, max_candidates: int | None
) -> int:
    """The loss rows a graph holds for `real` ones at a token capacity and row count: the
    task's bound (module docstring), or the next power of two past `real` beyond it."""
    bound = capacity // 2 if task == "retrieval" else min(capacity, rows * (max_candidates or 0))
    if real <= bound:
        return max(bound, 1)
    return 1 << max(int(real) - 1, 0).bit_length()


def _pad_distinct(idx: np.ndarray, size: int, bound: int) -> np.ndarray:
    """`idx` (distinct) padded to `size` with indices of `[0, bound)` it does not hold, each
    once while there are such, then zeros. The graph reads rows at these indices and its
    backward writes the rows' gradients back there where all are distinct (`size <= bound`:
    `layout.select_distinct_rows`), else adds them (`index_select`'s backward, atomically):
    padding rows all at row 0 put hundreds of zero adds onto one row, which atomics
    serialize."""
    pad = size - idx.size
    if pad <= 0:
        return idx
    free = np.ones(bound, bool)
    free[idx] = False
    spare = np.flatnonzero(free)[:pad]
    return np.concatenate([idx, spare, np.zeros(pad - spare.size, np.int64)])


def host_inputs(
    lengths: dict[str, np.ndarray], capacity: int, loss_rows: int, task: str, loss_tokens: int
) -> np.ndarray:
    """The host-known part of a graph's static input (int64, one transfer): `header [8] |
    offsets [R + 1] | num_contextual, num_candidates as int32 [2R] | inverse [C] | dest [C] |
    loss_a [Lc] | loss_b [Lc]`, from each row's contextual / item / candidate counts; `dest`
    is `inverse`'s inverse (the token of each source row), for the gradient of the rows'
    placement (`layout.permute_rows`).

    Ranking: `loss_a` is each candidate's token. Retrieval: `loss_a` is each target's query
    token (the action token of event l), `loss_b` the source position of the item it scores
    (event l + 1). Padding (masked by the header): tokens and positions that exist, each row
    another one while the capacity has them (`_pad_distinct`), then zeros."""
    c, n, k = (np.asarray(lengths[key], np.int64) for key in ("contextual", "item", "candidate"))
    a = layout_arrays(c, n, k)
    tokens = int(a["offsets"][-1])
    n_ctx, n_item = int(c.sum()), int(n.sum())
    if task == "ranking":
        loss_a, loss_b = a["pos_cand"], np.zeros(0, np.int64)
    else:
        loss_a = a["pos_item"][a["target_item"]] + 1
        loss_b = n_ctx + a["target_item"] + 1
    real = loss_a.size
    header = np.zeros(HEADER_SIZE, np.int64)
    header[: len(HEADER)] = (
        0,
        n_ctx,
        n_ctx + n_item,
        n_ctx + 2 * n_item,
        tokens,
        real,
        loss_tokens,
    )
    counts = np.concatenate([a["num_contextual"], a["num_candidates"]]).view(np.int64)
    tail = np.arange(tokens, capacity, dtype=np.int64)  # padding tokens: their own rows
    inverse, dest = (np.concatenate([a[k], tail]) for k in ("inverse", "dest"))
    return np.concatenate(
        [
            header,
            a["offsets"],
            counts,
            inverse,
            dest,
            _pad_distinct(loss_a, loss_rows, capacity),
            _pad_distinct(loss_b, loss_rows, capacity),
        ]
    )


@dataclass
class _Static:
    """One graph's static inputs (allocated outside the graph pool)."""

    ints: torch.Tensor  # host_inputs' layout
    src: torch.Tensor  # [C] ids in source order
    time: torch.Tensor | None  # [C] timestamps in source order (time bias only)
    extra: torch.Tensor  # ranking: label bits [Lc]; retrieval: negative ids [Lc * R]
    rows: int
    loss_rows: int

    @property
    def capacity(self) -> int:
        return self.src.numel()

    def views(self) -> dict[str, torch.Tensor]:
        r, c, lc = self.rows, self.capacity, self.loss_rows
        sizes = [HEADER_SIZE, r + 1, r, c, c, lc, lc]
        header, offsets, counts, inverse, dest, loss_a, loss_b = torch.split(self.ints, sizes)
        counts = counts.view(torch.int32)
        return {
            **dict(zip(HEADER, header.unbind(), strict=False)),
            "small_runs": header[:4],
            "offsets": offsets,
            "num_contextual": counts[:r],
            "num_candidates": counts[r:],
            "inverse": inverse,
            "dest": dest,
            "loss_a": loss_a,
            "loss_b": loss_b,
        }


@dataclass
class _Graph:
    graph: object  # torch.cuda.CUDAGraph, or None: the padded step runs eagerly (no CUDA)
    static: _Static
    out: torch.Tensor | None  # the replay's scalars: loss, metric sums, gradient norm


class StepGraphs:
    """`step(tb, global_loss_tokens) -> (scalars, names)` or None (run the eager step)."""

    def __init__(
        self,
        model,
        optimizer: torch.optim.Optimizer,
        params: list[torch.nn.Parameter],
        policy: CapacityPolicy,
        max_seqlen: int,
        capture: bool = True,
        warmup: int = 3,
        max_candidates: int | None = None,
        tables=None,
        world_size: int = 1,
        group=None,
    ):
        """`max_candidates`: a bound on a row's candidates (`data.max_candidates`; ranking).
        `tables`: `data_parallel` tables with Adam (sharding.ReplicatedTables), updated on
        their touched rows from their state (module docstring); None: AdamW's.
        `world_size` > 1: the collectives after each replay (module docstring), over `group`."""
        if tables is not None and not (tables.kind == "replicated" and tables.adam):
            raise ValueError("StepGraphs: only replicated tables with embedding.optimizer=adam")
        self.tables = tables
        self.model, self.optimizer, self.params = model, optimizer, list(params)
        self.max_candidates = max_candidates
        self.policy, self.max_seqlen = policy, max_seqlen
        self.capture, self.warmup = capture, warmup
        cfg = model.cfg
        self.task, self.num_negatives = cfg.task, cfg.num_negatives
        self.uses_time = any(layer.rab_time is not None for layer in model.layers)
        self.table = model.embedding.embeddings["item"].weight  # updated by `_update_table`
        if not any(p is self.table for p in self.params):
            raise ValueError("StepGraphs: the item table must be among the trained parameters")
        self.pool = torch.cuda.graph_pool_handle() if capture else None
        self.graphs: dict[tuple[int, int, int], _Graph] = {}
        self.eager_steps = 0  # steps no graph replayed (a sample past the bound, a new shape
        # past MAX_GRAPHS, an empty batch): the eager path, at W > 1 the padded step uncaptured
        # where the other ranks replay
        self.names = ["loss"] + (
            [] if self.task == "ranking" else [f"{m}@{TOP_K}" for m in ("hr", "ndcg")]
        )
        self.world_size, self.group = world_size, group
        self.fused_update = self._fusable()
        # W=1 with the fused update in a reduced precision: the stack's linears read copies of
        # their parameters in it that the update writes (`_keep_copies`)
        self.copies: list[torch.Tensor] | None = None
        if world_size == 1 and self.fused_update and model.compute_dtype != torch.float32:
            self._keep_copies()
        if world_size > 1:
            self._reduced_layout()

    def _keep_copies(self) -> None:
        """The stack's linears' parameters in the compute dtype, allocated once outside the
        graphs' pool: the forward reads them (`run_stack(reduced=...)`) where it made them by a
        multi-tensor copy every step, and the update writes them with the parameters
        (`adamw_multi_(copies=...)`). Anything else that writes a parameter (a checkpoint's
        load, an eager step's AdamW, `_init_state`) changes its version counter or its memory:
        `_refresh_copies` copies them again before the next step that reads them."""
        params = [t for linear in self.model.stack_linears() for t in (linear.kernel, linear.bias)]
        dtype = self.model.compute_dtype
        self.copy_params = params
        self.copies = [torch.empty_like(p, dtype=dtype) for p in params]
        self.copy_of = {id(p): c for p, c in zip(params, self.copies, strict=True)}
        self.reduced = list(zip(self.copies[0::2], self.copies[1::2], strict=True))
        self._copied: list[tuple[int, int]] | None = None  # (version, address) when copied

    def _refresh_copies(self) -> None:
        """The copies made again where a parameter changed outside the update since they were
        (`_keep_copies`); a host check of ~100 integers otherwise."""
        if self.copies is None:
            return
        marks = [(p._version, p.data_ptr()) for p in self.copy_params]
        if marks != self._copied:
            with torch.no_grad():
                torch._foreach_copy_(self.copies, [p.detach() for p in self.copy_params])
            self._copied = marks

    def _fusable(self) -> bool:
        """Whether the update runs as one `adamw_multi_` launch (with the gradients' squared
        norm) instead of torch's fused AdamW and a norm pass: where the Triton kernels run
        (CUDA, or the interpreter), for plain AdamW with one parameter group and a float
        learning rate, whose parameters and the data_parallel small tables are every
        gradient the norm reads."""
        from hstu_kernels.triton.adamw_multi import runs_kernel

        if not isinstance(self.optimizer, torch.optim.AdamW):  # (None: a loss-only check)
            return False
        groups = self.optimizer.param_groups
        if len(groups) != 1:
            return False
        g = groups[0]
        if g["amsgrad"] or g["maximize"] or torch.is_tensor(g["lr"]) or not runs_kernel(self.table):
            return False
        owned = {id(p) for p in g["params"]} | {id(p) for p, _ in self._small_tables()}
        return all(id(p) in owned for p in self.params if p is not self.table)

    def _reduced_layout(self) -> None:
        """W > 1: the static buffer one all-reduce sums after each replay, `[gradients of every
        parameter but the item table | loss, metric sums, graphs | item table marks (+1 sink)
        | contextual and action marks (+1 sink; data_parallel Adam only)]`."""
        table = self.table
        self.dense = [p for p in self.params if p is not table]
        self.item_features = table_features(self.model)[EMBEDDING_PREFIX + "item"]
        small = 0
        if self.tables is not None:
            tables = self.model.embedding.embeddings
            small = tables["contextual"].weight.shape[0] + tables["action"].weight.shape[0] + 1
        sizes = [p.numel() for p in self.dense]
        sizes += [len(self.names) + 1, table.shape[0] + 1] + ([small] if small else [])
        self.flat = torch.zeros(sum(sizes), dtype=torch.float32, device=table.device)
        parts = self.flat.split(sizes)
        n = len(self.dense)
        self.grad_views = [v.view_as(p) for v, p in zip(parts[:n], self.dense, strict=True)]
        self.grad_flat = self.flat[: sum(sizes[:n])]
        self.scalars, self.item_marks = parts[n], parts[n + 1]
        self.small_marks = parts[n + 2] if small else None

    @property
    def num_graphs(self) -> int:
        return len(self.graphs)

    # ------------------------------------------------------------------ per step
    def step(
        self,
        tb: TorchBatch,
        global_loss_tokens: int,
        stats: np.ndarray | None = None,
        other_graphs: int = 0,
    ) -> tuple[torch.Tensor, list] | None:
        """Replay (capturing first if new) the step of `tb`: forward, backward, gradient norm
        and AdamW. Returns the step's scalars `[loss, metric sums..., grad_norm]` and their
        names, or None when this batch must take the eager step (nothing done).

        W > 1: `stats`, the gathered stats of this step's global batch, decide for every rank
        at once (None: the eager step); the scalars then hold `num_compiles`, the graphs of
        every rank (this one's plus `other_graphs`, the stack's), summed."""
        if self.world_size > 1:
            if tb.host_lengths is None or stats is None:
                self.eager_steps += 1
                return None
            lengths = gathered_lengths(stats, tb.keys)
            per_sample = sum(v for k, v in lengths.items() if k in TOKEN_KEYS)
            if int(per_sample.max(initial=0)) > self.max_seqlen:  # some rank's sample
                self.eager_steps += 1
                return None
            lookups = sum(int(lengths[k].sum()) for k in self.item_features if k in lengths)
            return self._step_reduced(tb, global_loss_tokens, lookups, other_graphs)
        if tb.host_lengths is None or tb.max_seqlen > self.max_seqlen:
            self.eager_steps += 1
            return None
        key, lengths, tokens = self._key(tb)
        if tokens == 0 or (key not in self.graphs and len(self.graphs) >= MAX_GRAPHS):
            self.eager_steps += 1
            return None
        entry = self.graphs.get(key)
        static = entry.static if entry is not None else self._static(*key)
        self._fill(static, tb, lengths, global_loss_tokens)
        if entry is None:
            entry = self.graphs[key] = self._make(static)
        self._refresh_copies()
        if entry.graph is None:
            with shared_schedules(self.model.cfg.attention):
                return self._run(static), self.names + ["grad_norm"]
        entry.graph.replay()  # a new graph too: its capture only recorded the step
        return entry.out, self.names + ["grad_norm"]

    def _key(self, tb: TorchBatch) -> tuple[tuple[int, int, int], dict, int]:
        """The graph's key `(token capacity, rows, loss rows)` of `tb`, its lengths by key and
        its token count."""
        keys = tb.keys
        lengths = {k: tb.host_lengths[keys.index(k)] for k in ("contextual", "item", "candidate")}
        tokens = int(sum(lengths[k].sum() for k in lengths) + lengths["item"].sum())
        if self.task == "ranking":
            real = int(lengths["candidate"].sum())
        else:
            real = int(np.maximum(lengths["item"] - 1, 0).sum())
        capacity = self.policy.capacity(max(tokens, 1))
        lc = loss_rows_capacity(real, capacity, tb.batch_size, self.task, self.max_candidates)
        return (capacity, tb.batch_size, lc), lengths, tokens

    def _step_reduced(self, tb: TorchBatch, glt: int, lookups: int, other_graphs: int):
        """W > 1: this rank's graph (or, with no graph for its shape, the same padded step
        uncaptured), then the collectives and the update (module docstring)."""
        key, lengths, tokens = self._key(tb)
        entry = self.graphs.get(key)
        static = entry.static if entry is not None else self._static(*key)
        self._fill(static, tb, lengths, glt)
        if entry is None and tokens > 0 and len(self.graphs) < MAX_GRAPHS:
            entry = self.graphs[key] = self._make(static)
        if entry is not None and entry.graph is not None:
            entry.graph.replay()
            local = entry.out
        else:
            if entry is None:
                self.eager_steps += 1
                self._init_state()
            with shared_schedules(self.model.cfg.attention):
                local = self._run_local(static)
        self.scalars[-1].fill_(float(other_graphs + self.num_graphs))
        out = self._reduce_update(*local, lookups)
        return out, self.names + ["num_compiles", "grad_norm"]

    def _static(self, capacity: int, rows: int, loss_rows: int) -> _Static:
        device = self.params[0].device
        size = HEADER_SIZE + 2 * rows + 1 + 2 * capacity + 2 * loss_rows
        extra = loss_rows * (1 if self.task == "ranking" else self.num_negatives)

        def zeros(n):
            return torch.zeros(n, dtype=torch.int64, device=device)

        time = zeros(capacity) if self.uses_time else None
        return _Static(zeros(size), zeros(capacity), time, zeros(extra), rows, loss_rows)

    def _fill(self, s: _Static, tb: TorchBatch, lengths: dict, global_loss_tokens: int) -> None:
        """The batch into the static inputs: the host part in one transfer, the ids (and times,
        labels or negatives) by one device copy each."""
        host = host_inputs(lengths, s.capacity, s.loss_rows, self.task, global_loss_tokens)
        device = s.ints.device
        if device.type == "cuda":
            staging(device).copy([host], device, out=s.ints)
        else:
            s.ints.copy_(torch.from_numpy(host))
        values, keys = tb.kjt.values(), tb.keys
        bounds = tb.kjt.offset_per_key()

        def part(key):
            i = keys.index(key)
            return values[bounds[i] : bounds[i + 1]]

        src = [part(k) for k in ("contextual", "item", "action", "candidate")]
        tokens = sum(v.numel() for v in src)
        torch.cat(src, out=s.src[:tokens])
        if s.time is not None:
            n_ctx, item_time = src[0].numel(), part("item_time")
            s.time[:n_ctx].zero_()
            torch.cat([item_time, item_time, part("candidate_time")], out=s.time[n_ctx:tokens])
        extra = part("label") if self.task == "ranking" else part("negative")
        s.extra[: extra.numel()].copy_(extra)

    # ------------------------------------------------------------------ the padded step
    def loss(self, s: _Static) -> tuple[torch.Tensor, dict[str, torch.Tensor], tuple]:
        """The loss of the static inputs (local sum / global loss tokens), the metric sums (the
        eager model's, model.py, over padded shapes), and the item table's lookup `(ids,
        rows)`: `rows` is a leaf whose gradient, summed by id, is the table's (id -1: a
        position that is no item lookup, its gradient zero)."""
        model, v = self.model, s.views()
        cap, device = s.capacity, s.src.device
        tables = model.embedding.embeddings
        ctx_table = tables["contextual"].weight
        # every position's ids in one launch (`source_ids`): the item table's row (0 where
        # none), its lookups for the update (-1: contextual, action and padding tokens, which
        # read row 0 with a zero gradient), the small tables' row (the contextual and action
        # tables read as one: a second source over the capacity, not two) and, with
        # data_parallel tables, its marks
        from hstu_kernels.triton.embed_tokens import embed_tokens, source_ids

        item_ids, lookups, small_ids, small_lookups, is_small = source_ids(
            s.src, s.ints[:HEADER_SIZE], ctx_table.shape[0], marks=self.tables is not None
        )
        looked = item_ids
        if self.task == "retrieval":  # the negatives from the same lookup (padded: -1)
            real_rows = torch.arange(s.loss_rows, device=device) < v["loss_rows"]
            real_neg = real_rows[:, None].expand(-1, self.num_negatives).reshape(-1)
            neg_ids = torch.where(real_neg, s.extra, 0)
            looked = torch.cat([item_ids, neg_ids])
            lookups = torch.cat([lookups, torch.where(real_neg, s.extra, -1)])
        # the item table's rows as a leaf of their own: the table takes no dense gradient,
        # its update reads theirs (`_update_table`)
        rows = tables["item"].weight.detach().index_select(0, looked).requires_grad_()
        # ranking looks up the capacity's rows only: no split, whose backward would copy the
        # whole [C, D] gradient into a new buffer (a cat of it and the negatives' empty part)
        e_item, e_neg = (
            (rows, None) if looked.numel() == cap else rows.split([cap, looked.numel() - cap])
        )
        small = torch.cat([ctx_table, tables["action"].weight])
        inverse = v["inverse"]
        # the rows in the stack's dtype and token order, from the item rows or the small
        # tables, one kernel each way (`embed_tokens`); the small tables' gradient summed over
        # their two runs of sources (the header's), not sorted by id over the whole capacity
        runs = (v["small_runs"], (ctx_table.shape[0], tables["action"].weight.shape[0]))
        x = embed_tokens(
            e_item, small, small_ids, is_small, inverse, v["dest"], model.compute_dtype, runs
        )
        seq = {
            "offsets": v["offsets"],
            "max_seqlen": self.max_seqlen,
            "num_contextual": v["num_contextual"],
            "num_candidates": v["num_candidates"],
            "timestamps": None if s.time is None else s.time.index_select(0, inverse),
        }
        # the final norm on the rows the loss reads only (row-wise: the same values); their
        # padding is distinct rows where the capacity has enough (`_pad_distinct`)
        z = model.stack(
            x, seq, rows=v["loss_a"], distinct=s.loss_rows <= cap,
            reduced=self.reduced if self.copies is not None else None,
        )  # fmt: skip
        if self.task == "ranking":  # the BCE over the real rows, one launch each way
            from hstu_kernels.triton.ranking_loss import ranking_bce

            logits = model.ranking_head(z)
            loss = ranking_bce(logits, s.extra, v["loss_rows"], v["loss_tokens"])
            return loss, {}, (lookups, rows, small_lookups)
        denom = v["loss_tokens"].clamp(min=1).to(torch.float32)
        r, item_src = self.num_negatives, v["loss_b"]
        pos_rows = (
            select_distinct_rows(e_item, item_src)
            if s.loss_rows <= cap
            else e_item.index_select(0, item_src)
        )
        loss, hit, ndcg = model.retrieval_terms(
            z,
            pos_rows,
            e_neg.reshape(s.loss_rows, r, -1),
            item_ids.index_select(0, item_src),  # item positions: their ids
            neg_ids.reshape(s.loss_rows, r),
        )
        loss = torch.where(real_rows, loss, 0.0).sum() / denom
        sums = [torch.where(real_rows, m, 0.0).sum() for m in (hit, ndcg)]
        return loss, dict(zip(self.names[1:], sums, strict=True)), (lookups, rows, small_lookups)

    def _run(self, s: _Static) -> torch.Tensor:
        """Forward, backward, the gradient norm and the update; the scalars `[loss, sums...,
        norm]` (what a graph captures)."""
        loss, sums, (ids, rows, small_ids) = self.loss(s)
        loss.backward()
        table = self.table
        for p in self.params:
            if p.grad is None and p is not table:  # not reached by the loss: a zero gradient,
                p.grad = torch.zeros_like(p)  # as the eager step
        sq = self._update_table(ids, rows.grad)
        if self.tables is not None:
            ctx, act = (self.model.embedding.embeddings[k].weight for k in ("contextual", "action"))
            sink = ctx.shape[0] + act.shape[0]  # one more row: where -1 marks
            marks = torch.zeros(sink + 1, dtype=torch.bool, device=ctx.device)
            marks.index_fill_(0, torch.where(small_ids >= 0, small_ids, sink), True)
            sq = sq + self._update_small_tables(marks[:sink])
        if self.fused_update:  # AdamW and the norm's squares in one launch
            norm = torch.sqrt(self._update_dense() + sq)
        else:  # the small tables' squares are counted above
            small = {id(p) for p, _ in self._small_tables()}
            grads = [p.grad for p in self.params if p is not table and id(p) not in small]
            norm = torch.sqrt(torch.stack(torch._foreach_norm(grads)).square().sum() + sq)
            self.optimizer.step()  # AdamW's parameters but the item table (no .grad: skipped)
        parts = [loss.detach(), *sums.values(), norm]
        out = torch.stack([t.float() for t in parts])
        # captured: the graph's gradients live in the shared pool (see the docstring)
        for p in self.params:
            p.grad = None
        return out

    def _run_local(self, s: _Static) -> tuple[torch.Tensor, torch.Tensor]:
        """W > 1, what a graph captures: forward and backward into the static buffer (module
        docstring); returns the item table's lookups and their rows' gradient."""
        self.flat.zero_()
        for p, view in zip(self.dense, self.grad_views, strict=True):
            p.grad = view  # autograd adds into the buffer
        loss, sums, (ids, rows, small_ids) = self.loss(s)
        loss.backward()
        for p, view in zip(self.dense, self.grad_views, strict=True):
            if p.grad.data_ptr() != view.data_ptr():  # a host check, at capture: not replayed
                raise RuntimeError(f"autograd replaced the gradient view of {tuple(p.shape)}")
        sink = self.item_marks.numel() - 1
        self.item_marks.index_fill_(0, torch.where(ids >= 0, ids, sink), 1.0)
        if self.small_marks is not None:
            sink = self.small_marks.numel() - 1
            self.small_marks.index_fill_(0, torch.where(small_ids >= 0, small_ids, sink), 1.0)
        local = torch.stack([loss.detach(), *sums.values()]).float()
        self.scalars[: len(self.names)].copy_(local)
        return ids, rows.grad

    def _reduce_update(self, ids: torch.Tensor, grad_rows: torch.Tensor, lookups: int):
        """W > 1, after the local step: the buffer's all-reduce, the item table's gradient
        over the rows some rank looked up, the norm and the updates; `[loss, sums...,
        num_compiles, grad_norm]`. `lookups`: the item table's lookups over the global batch."""
        dist.all_reduce(self.flat, op=dist.ReduceOp.SUM, group=self.group)
        for p, view in zip(self.dense, self.grad_views, strict=True):
            p.grad = view  # the reduced gradients, for the updates below
        table = self.table
        num_rows, device = table.shape[0], table.device
        cap = grad_sync.reduced_rows(num_rows, lookups)
        marks = self.item_marks[:num_rows]  # how many ranks looked each row up
        rows = grad_sync.marked_first(EMBEDDING_PREFIX + "item", marks, cap)
        # each looked-up id's position among `rows` (the sink, `cap`, for -1)
        where = torch.full((num_rows + 1,), cap, dtype=torch.int64, device=device)
        where.index_copy_(0, rows, torch.arange(cap, device=device))
        part = torch.zeros((cap + 1, table.shape[1]), dtype=grad_rows.dtype, device=device)
        part.index_add_(0, where[torch.where(ids >= 0, ids, num_rows)], grad_rows)
        part = part[:cap]
        dist.all_reduce(part, op=dist.ReduceOp.SUM, group=self.group)
        touched = torch.where(marks.index_select(0, rows) > 0, rows, -1)
        table_sq = self._update_table(touched, part)
        if self.fused_update:  # the small tables' squares, AdamW and the others' squares
            sq = table_sq
            if self.small_marks is not None:
                sq = sq + self._update_small_tables(self.small_marks[:-1] > 0)
            norm = torch.sqrt(self._update_dense() + sq)
        else:
            if self.small_marks is not None:
                self._update_small_tables(self.small_marks[:-1] > 0)
            norm = torch.sqrt(torch.linalg.vector_norm(self.grad_flat).square() + table_sq)
            self.optimizer.step()  # AdamW's parameters but the item table (no .grad: skipped)
        for p in self.dense:
            p.grad = None
        return torch.cat([self.scalars, norm.reshape(1)])

    # ------------------------------------------------------------------ capture
    def _make(self, s: _Static) -> _Graph:
        if not self.capture:
            self._init_state()  # the item table's update reads AdamW's state
            return _Graph(None, s, None)
        log.info(
            "capturing the training step: %d tokens, %d rows, %d loss rows",
            s.capacity,
            s.rows,
            s.loss_rows,
        )
        self._init_state()
        self._refresh_copies()  # what the warm-up's forward reads
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(self.warmup):
                for p in self.params:
                    p.grad = None
                with shared_schedules(self.model.cfg.attention):
                    loss, _, (ids, rows, _) = self.loss(s)
                    loss.backward()
                del loss
            self._update_table(ids, rows.grad, run=False)  # its kernels built, not run
            if self.fused_update:  # the update's kernel too
                from hstu_kernels.triton.adamw_multi import compile_adamw_multi

                group, state = self.optimizer.param_groups[0], self.optimizer.state
                dense = [p for p in group["params"] if p is not self.table]
                compile_adamw_multi(
                    [p.detach() for p in dense], [state[p]["exp_avg"] for p in dense],
                    [state[p]["exp_avg_sq"] for p in dense],
                    [self.copy_of.get(id(p)) for p in dense] if self.copies else None,
                )  # fmt: skip
                if self.tables is not None:
                    small = self._small_tables()
                    compile_adamw_multi(
                        [p.detach() for p, _ in small], [st["m"] for _, st in small],
                        [st["v"] for _, st in small], rows=True,
                    )  # fmt: skip
            del ids, rows
        torch.cuda.current_stream().wait_stream(side)
        for p in self.params:
            p.grad = None
        if self.world_size == 1:  # AdamW in the graph (W > 1: after the collectives)
            for group in self.optimizer.param_groups:
                group["capturable"] = True  # the step count stays on the device
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool), shared_schedules(self.model.cfg.attention):
            out = self._run(s) if self.world_size == 1 else self._run_local(s)
        return _Graph(graph, s, out)

    def _update_table(self, ids: torch.Tensor, grad_rows: torch.Tensor, run: bool = True):
        """AdamW on the item table from its looked-up rows' gradient, with the optimizer's own
        state and hyperparameters (so that eager steps and checkpoints see one optimizer);
        the gradient's squared norm. `run=False`: only build its kernels (before a capture)."""
        # imported on first use, as the attention kernels: Triton decides at decoration time
        # whether its kernels run compiled or in the interpreter (TRITON_INTERPRET=1)
        from hstu_kernels.triton.adamw_rows import adamw_rows_, compile_adamw_rows

        table = self.table
        if self.tables is not None:  # data_parallel Adam: the touched rows, one shared t
            e, state = self.tables.cfg, self.tables.state["embedding.item"]
            tensors = (table.detach(), state["m"], state["v"], self.tables.t, ids)
            if not run:
                return compile_adamw_rows(*tensors, grad_rows, sparse=True)
            self.tables.t.add_(1)
            with torch.no_grad():
                return adamw_rows_(
                    *tensors, grad_rows, lr=e.lr, beta1=e.beta1, beta2=e.beta2, eps=e.eps,
                    weight_decay=e.weight_decay, sparse=True, advance_step=False,
                )  # fmt: skip
        state = self.optimizer.state[table]
        tensors = (table.detach(), state["exp_avg"], state["exp_avg_sq"], state["step"], ids)
        if not run:
            return compile_adamw_rows(*tensors, grad_rows)
        group = next(g for g in self.optimizer.param_groups if any(p is table for p in g["params"]))
        beta1, beta2 = group["betas"]
        with torch.no_grad():
            return adamw_rows_(
                *tensors, grad_rows, lr=group["lr"], beta1=beta1, beta2=beta2, eps=group["eps"],
                weight_decay=group["weight_decay"],
            )  # fmt: skip

    def _small_tables(self) -> list[tuple[torch.nn.Parameter, dict]]:
        """The data_parallel small tables (contextual, then action) with their Adam state, as
        `_update_small_tables` updates them; none without data_parallel Adam."""
        if self.tables is None:
            return []
        tables = self.model.embedding.embeddings
        return [(tables[k].weight, self.tables.state["embedding." + k])
                for k in ("contextual", "action")]  # fmt: skip

    def _update_small_tables(self, marks: torch.Tensor) -> torch.Tensor:
        """data_parallel Adam on the contextual and action tables (small: from their dense
        gradients) where the step looked them up: `marks` (bool) over the two concatenated
        tables' rows, both tables in one launch. After `_update_table` (which advanced t).
        Returns their gradients' squared norm."""
        from hstu_kernels.triton.adamw_multi import adamw_multi_

        e, small = self.tables.cfg, self._small_tables()
        n_ctx = small[0][0].shape[0]
        with torch.no_grad():
            return adamw_multi_(
                [p.detach() for p, _ in small], [p.grad for p, _ in small],
                [st["m"] for _, st in small], [st["v"] for _, st in small], [self.tables.t] * 2,
                lr=e.lr, beta1=e.beta1, beta2=e.beta2, eps=e.eps, weight_decay=e.weight_decay,
                rows=[marks[:n_ctx], marks[n_ctx:]],
            )  # fmt: skip

    def _update_dense(self) -> torch.Tensor:
        """AdamW on the optimizer's parameters that have a gradient (every one but the item
        table's, which `_update_table` updates), with its own state and hyperparameters, in
        one launch (`fused_update`); returns their gradients' squared norm."""
        from hstu_kernels.triton.adamw_multi import adamw_multi_

        group, state = self.optimizer.param_groups[0], self.optimizer.state
        params = [p for p in group["params"] if p.grad is not None]
        steps = [state[p]["step"] for p in params]
        beta1, beta2 = group["betas"]
        with torch.no_grad():
            torch._foreach_add_(steps, 1)  # as torch's capturable AdamW counts
            return adamw_multi_(
                [p.detach() for p in params], [p.grad for p in params],
                [state[p]["exp_avg"] for p in params], [state[p]["exp_avg_sq"] for p in params],
                steps, lr=group["lr"], beta1=beta1, beta2=beta2, eps=group["eps"],
                weight_decay=group["weight_decay"],
                copies=[self.copy_of.get(id(p)) for p in params] if self.copies else None,
            )  # fmt: skip

    def _init_state(self) -> None:
        """AdamW's state for every parameter that has none, created outside the graph (a
        capture would record its zero fills, resetting the moments at every replay): a step
        at learning rate 0 on zero gradients of those parameters only, then their step count
        back to 0. Parameters and moments stay exactly as they were (0 * anything, plus zero
        moments); parameters with state (a resumed run, eager steps) are not touched."""
        state = self.optimizer.state
        owned = {id(p) for g in self.optimizer.param_groups for p in g["params"]}
        fresh = [p for p in self.params if id(p) in owned and not state.get(p)]
        if not fresh:
            return
        lrs = [g["lr"] for g in self.optimizer.param_groups]
        for group in self.optimizer.param_groups:
            group["lr"] = 0.0
        for p in self.params:
            p.grad = None
        for p in fresh:
            p.grad = torch.zeros_like(p)
        self.optimizer.step()
        for group, lr in zip(self.optimizer.param_groups, lrs, strict=True):
            group["lr"] = lr
        for p in fresh:
            p.grad = None
            if torch.is_tensor(state[p]["step"]):
                state[p]["step"].zero_()
            else:
                state[p]["step"] = 0
