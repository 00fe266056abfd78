"""The torch backend's Backend for the core trainer, and `run_rank`: one rank's training.

`launch.py` starts the ranks (`train(cfg)`); each runs `run_rank`, i.e. the core loop
`hstu.trainer.train` (resume, checkpoints, metrics, the pipeline) over a `TorchBackend`.

Data parallelism is applied here, in this order: every rank holds the full model (replicated,
same init); the shuffle moves samples between ranks (shuffler.py); the loss of each rank is its
sum over targets divided by the *global* target count; gradients are all-reduced (SUM) in
fixed buckets overlapped with the backward pass (grad_sync.py), the replicated tables' over the
rows some rank looked up (bounded on the host from the gathered stats), the loss and metric
sums in one small reduction after the backward, so every rank applies the same AdamW update.

With `embedding.sharding` != none the tables are then sharded (sharding.py, right after the
replicated init): their all-to-alls run inside forward and backward, their optimizer is fused
into the backward (or, data_parallel, row-wise Adagrad after AdamW), and the buckets and
AdamW hold the dense parameters only (data_parallel: the tables' gradients too).
"""

from __future__ import annotations

import contextlib
import logging

import numpy as np
import torch
import torch.distributed as dist

from hstu import capacity, trainer
from hstu.capacity import CapacityPolicy
from hstu.data import source_from_config
from hstu.errors import HSTUError
from hstu.params import init_params
from hstu.pipeline import STAT_LOSS_TOKENS, gathered_lengths
from hstu.torch_backend import collectives
from hstu.torch_backend.attention import shared_schedules
from hstu.torch_backend.checkpoint import TrainCheckpointer
from hstu.torch_backend.grad_sync import GradBuckets, RowMarks, TouchedRowsReduce
from hstu.torch_backend.graphs import GraphedStack, check_cuda_graphs, set_cublas_workspace
from hstu.torch_backend.model import HSTUModel
from hstu.torch_backend.sharding import EMBEDDING_PREFIX, shard_tables, table_features
from hstu.torch_backend.shuffler import TorchShuffler, check_shuffler
from hstu.torch_backend.state import make_optimizer, rank_seed
from hstu.torch_backend.step_graphs import StepGraphs
from hstu.torch_backend.timing import time_forward_backward

METRIC_SLOTS = 4  # page-locked buffers for the scalars of steps not yet fetched (lag <= 3)


class TorchBackend(TorchShuffler):
    """The core trainer's Backend for one data-parallel rank."""

    def __init__(self, cfg, rank: int, world_size: int, device: torch.device | str, group=None):
        super().__init__(
            rank, world_size, device, cfg.data.batch_size, cfg.balance.exchange, group,
            timeout_s=cfg.dist.timeout_s,
        )  # fmt: skip
        self.cfg = cfg
        self.is_main = rank == 0
        self.device_name = (
            torch.cuda.get_device_name(self.device) if self.device.type == "cuda" else "cpu"
        )
        # table_wise / row_wise / auto: the tables stay on the meta device until sharded, and
        # each rank then draws its own rows (sharding.py): no rank ever holds a whole table
        fused = cfg.embedding.sharding not in ("none", "data_parallel")
        self.model = HSTUModel(cfg.model, self.device, meta_tables=fused)
        self.model.load_params(init_params(cfg.model, cfg.train.seed, not fused), not fused)
        # embedding.sharding != none: the tables leave AdamW (sharding.py)
        self.tables = shard_tables(self.model, cfg, world_size, self.device, group)
        if self.is_main and getattr(self.tables, "kind", "") == "fused":
            # TorchRec's planner chose these (jax always holds its row shards in device memory)
            plan = self.tables.sharding_types()
            kernels = self.tables.compute_kernels()
            print("embedding plan: " + ", ".join(f"{t} {plan[t]}/{kernels[t]}" for t in plan))
        if self.tables is None:
            self.params = list(self.model.parameters())  # fixed order: the bucket layout
            self.optimizer = make_optimizer(self.params, cfg.train)
            self.reduced = self.model.named_core_parameters()
        else:
            self.params = self.tables.reduced_params
            self.optimizer = make_optimizer(list(self.tables.dense.values()), cfg.train)
            ids = {id(p) for p in self.params}
            self.reduced = {
                n: p for n, p in self.model.named_core_parameters().items() if id(p) in ids
            }
        # Tables with dense gradients (sharding none / data_parallel): the rows each step looks
        # up are marked (Adam's update, and at W > 1 the rows their gradients are reduced over)
        replicated = self.tables is None or self.tables.kind == "replicated"
        self.row_marks = self.tables.row_marks if replicated and self.tables is not None else None
        self.row_reduce = None
        bucketed = self.params
        if world_size > 1 and replicated:
            tables = {n: p for n, p in self.reduced.items() if n.startswith(EMBEDDING_PREFIX)}
            if self.row_marks is None:
                self.row_marks = RowMarks(tables, table_features(self.model), world_size, group)
            self.row_reduce = TouchedRowsReduce(tables, self.row_marks, group)
            ids = {id(p) for p in tables.values()}
            bucketed = [p for p in self.params if id(p) not in ids]
        self.buckets = GradBuckets(bucketed, world_size, group)
        self._eval_model: HSTUModel | None = None  # fused tables: rank 0's evaluation copy
        self._metric_slots: list[torch.Tensor | None] = [None] * METRIC_SLOTS
        self._metric_next = 0
        self.step_graphs: StepGraphs | None = None
        self._graphed_step = False  # the last step ran from a step graph

    def use_cuda_graphs(self, policy: CapacityPolicy, capture: bool = True) -> None:
        """`train.cuda_graphs`: the stack replayed from graphs over `policy`'s capacities, and
        with `train.graph_scope=auto` and replicated tables the whole step (step_graphs.py; at
        W > 1 the collectives and the update after the replay; the stack's graphs then serve
        the steps it leaves to the eager path and the probes). `capture=False`: the padded
        steps run eagerly (CPU tests)."""
        if capture:
            check_cuda_graphs(self.cfg, self.device.type)
        bound = self.cfg.data.max_seqlen
        self.model.graphed = GraphedStack(self.model, policy, bound, capture=capture)
        tables = self.tables
        # data_parallel tables with Adam: their touched rows updated by the step graphs
        graphable = tables is None or (tables.kind == "replicated" and tables.adam)
        if self.cfg.train.graph_scope == "auto" and graphable:
            self.step_graphs = StepGraphs(
                self.model, self.optimizer, self.params, policy, bound, capture=capture,
                max_candidates=self.cfg.data.max_candidates, tables=tables,
                world_size=self.world_size, group=self.group,
            )  # fmt: skip

    def capacity_of(self, num_tokens: int) -> int:
        """The tokens a rank holding `num_tokens` computes (its graph's capacity)."""
        graphed = self.model.graphed
        return graphed.policy.capacity(max(num_tokens, 1)) if graphed is not None else num_tokens

    def _num_graphs(self) -> int:
        stack = self.model.graphed.num_graphs if self.model.graphed is not None else 0
        return stack + (self.step_graphs.num_graphs if self.step_graphs is not None else 0)

    def annotate(self, name: str):
        """A named host range in a torch.profiler trace; nothing (not even the ~6 us of a
        `record_function`) when no profiler runs."""
        if torch.autograd.profiler._is_profiler_enabled:
            return torch.profiler.record_function(name)
        return contextlib.nullcontext()

    def _mark(self, marks: list | None) -> None:
        """Record a device event at a phase boundary (CUDA only; `probe` reads them)."""
        if marks is not None:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            marks.append(event)

    def forward_backward(
        self, device_batch, global_loss_tokens: int, stats: np.ndarray | None = None
    ) -> dict:
        batch = self.ready(device_batch)
        if batch.actual_batch_size:  # an all-padding batch keeps its zero-length rows
            batch = batch.strip_padding()
        marks = [] if self.device.type == "cuda" else None
        self._mark(marks)
        self.model.train()
        if self.step_graphs is not None:
            stack = self.model.graphed.num_graphs
            done = self.step_graphs.step(batch, global_loss_tokens, stats, stack)
            self._graphed_step = done is not None
            if done is not None:  # forward, backward and the update, replayed from a graph
                self._mark(marks)
                scalars, names = done
                return {
                    "scalars": scalars,
                    "names": names,
                    "global_loss_tokens": global_loss_tokens,
                    "marks": marks,
                    "phases": ("step",),
                    "updated": True,
                    "num_compiles": self._num_graphs(),  # one rank's (W > 1: in the scalars)
                }
        if self.row_marks is not None:
            self.row_marks.mark(batch)  # the rows Adam updates and W > 1 reduces
        self.buckets.start()
        more = None
        if self.row_reduce is not None:
            self.row_reduce.start()
            # each table's lookups over the global batch bound the rows any rank marked
            lookups = None
            if stats is not None:
                lengths = gathered_lengths(stats, batch.keys)
                lookups = self.row_marks.lookups({k: int(v.sum()) for k, v in lengths.items()})

            def more():
                return self.row_reduce.reduce(lookups)

        with shared_schedules(self.model.cfg.attention):
            loss, sums = self.model(batch, global_loss_tokens)
            self._mark(marks)
            if loss.requires_grad:
                loss.backward()  # launches the bucket reductions as their gradients finish
            self._mark(marks)
        parts = [loss.detach().float().reshape(1)]
        parts += [v.detach().float().reshape(1) for v in sums.values()]
        names = ["loss", *sums]
        if self.model.graphed is not None:
            # graphs captured by this rank so far, summed over ranks by the same all-reduce: a
            # step in which any rank captures waits for it on every rank, so every rank's
            # metrics must see the count rise (`hstu.metrics.timed_rows` leaves such steps out)
            graphs = float(self._num_graphs())
            parts.append(torch.full((1,), graphs, device=loss.device))
            names.append("num_compiles")
        scalars = torch.cat(parts)
        if self.world_size > 1:
            dist.all_reduce(scalars, op=dist.ReduceOp.SUM, group=self.group, async_op=True).wait()
        grad_norm = self.buckets.finish(more)
        self._mark(marks)
        return {
            "scalars": torch.cat([scalars, grad_norm.reshape(1)]),
            "names": [*names, "grad_norm"],
            "global_loss_tokens": global_loss_tokens,
            "marks": marks,
            "phases": ("forward", "backward", "grad_reduce", "optimizer"),
        }

    def grads(self) -> dict[str, np.ndarray]:
        """Reduced gradients by core parameter name (between forward_backward and the step);
        sharded tables (updated inside backward) have none."""
        if self._graphed_step:
            raise HSTUError(
                "grads(): the last step ran from a step graph, which consumes its gradients "
                "inside the graph; set train.graph_scope=stack to read them"
            )
        return {
            name: (p.grad if p.grad is not None else torch.zeros_like(p))
            .detach()
            .cpu()
            .numpy()
            .copy()
            for name, p in self.reduced.items()
        }

    def optimizer_step(self, handle: dict) -> dict:
        if not handle.get("updated"):  # a step graph has applied the update already
            self.optimizer.step()
            if self.tables is not None and self.tables.kind == "replicated":
                self.tables.step(self.row_reduce.compact if self.row_reduce else None)
            elif self.tables is not None:
                self.tables.step()
            self._mark(handle["marks"])
            self.optimizer.zero_grad(set_to_none=True)
        elif self.tables is not None:
            self.tables.stepped()
        scalars = handle["scalars"]
        if self.device.type == "cuda":
            # Copy into pinned memory and mark the point: `fetch_metrics` waits for this step
            # only, while later steps keep the GPU busy (a plain .tolist() would wait for all).
            host = self._metrics_slot(scalars)
            host.copy_(scalars, non_blocking=True)
            done = torch.cuda.Event()
            done.record()
            return {**handle, "scalars": host, "done": done}
        return {**handle, "done": None}

    def _metrics_slot(self, scalars: torch.Tensor) -> torch.Tensor:
        """A page-locked host buffer for one step's scalars, from a ring of METRIC_SLOTS
        allocated once (a page-locked allocation per step cost host time: staging.py). A slot
        comes round again METRIC_SLOTS steps later; the pipeline has fetched its step's
        metrics `train.metrics_lag` <= 3 steps after dispatching it, so by then."""
        i = self._metric_next
        self._metric_next = (i + 1) % METRIC_SLOTS
        buf = self._metric_slots[i]
        if buf is None or buf.numel() < scalars.numel():
            buf = torch.empty(scalars.numel() + 8, dtype=scalars.dtype, pin_memory=True)
            self._metric_slots[i] = buf
        return buf[: scalars.numel()]

    def fetch_metrics(self, pending: dict) -> dict[str, float]:
        if pending["done"] is not None:
            pending["done"].synchronize()
        self._last_marks = pending["marks"], pending["phases"]
        values = dict(zip(pending["names"], pending["scalars"].tolist(), strict=True))
        # over all ranks (JAX: programs compiled); a step graph's count is the host's (one rank)
        graphs = values.pop("num_compiles", pending.get("num_compiles"))
        denom = max(int(pending["global_loss_tokens"]), 1)
        per_target = set(values) - {"loss", "grad_norm"}
        out = {k: (v / denom if k in per_target else v) for k, v in values.items()}
        if graphs is not None:
            out["num_compiles"] = int(round(graphs))
        return out

    def probe(self, prepared, repeats: int = 3, phases: bool = True) -> dict:
        """Device timing of the step just fetched (`hstu bench e2e`). Collective: every rank.

        `device_s`: this rank's forward, backward, gradient reduction and update, from the
        events recorded inside the step. `compute_s_before` / `_after`: every rank's forward +
        backward of its batch as loaded and as balanced, each run alone on its device; with
        `embedding.sharding` != none from the rows looked up first (a collective with fused
        tables, which the backward must not update), as the JAX backend times them."""
        marks, names = getattr(self, "_last_marks", (None, ()))
        device_s = (
            {n: a.elapsed_time(b) / 1e3 for n, a, b in zip(names, marks, marks[1:], strict=False)}
            if marks and phases
            else {}
        )
        glt = int(prepared.stats[:, STAT_LOSS_TOKENS].sum())
        times = []
        for loaded in (prepared.loaded_batch, prepared.device_batch):
            batch = self.ready(loaded)
            if batch.actual_batch_size:
                batch = batch.strip_padding()
            rows = None
            if self.tables is not None:
                with torch.no_grad():
                    rows = self.model.looked_up(batch)
            times.append(time_forward_backward(self.model, batch, glt, repeats, rows=rows))
        ns = np.tile(np.rint(np.array(times) * 1e9).astype(np.int64), (self.batch_size, 1))
        gathered = collectives.allgather_stats(ns, self.world_size, self.device, self.group)
        every = gathered[:: self.batch_size] / 1e9  # [W, 2]
        return {
            "device_s": device_s,
            "compute_s_before": every[:, 0].tolist(),
            "compute_s_after": every[:, 1].tolist(),
        }

    def evaluator(self):
        """The live model; with table_wise / row_wise / auto tables, whose lookups are
        collectives, a replicated copy on rank 0 that `prepare_evaluation` refreshes."""
        from hstu.torch_backend.evaluate import TorchEvaluator

        if getattr(self.tables, "kind", None) != "fused":
            return TorchEvaluator(self.model, self.device)
        if self._eval_model is None:
            self._eval_model = HSTUModel(self.cfg.model, self.device)
        return TorchEvaluator(self._eval_model, self.device)

    def prepare_evaluation(self) -> None:
        """Collective with fused sharded tables: every rank's shards to rank 0, which loads
        them and the live dense parameters into its evaluation copy (whole tables on rank 0)."""
        if getattr(self.tables, "kind", None) != "fused":
            return
        tables = self.tables.gather_weights()
        if not self.is_main:
            return
        if self._eval_model is None:
            self._eval_model = HSTUModel(self.cfg.model, self.device)
        dense = {
            n: p.detach().cpu().numpy()
            for n, p in self.model.named_core_parameters().items()
            if not n.startswith("embedding.")
        }
        self._eval_model.load_params(dense | tables)

    def broadcast_flag(self, flag: bool) -> bool:
        if self.world_size == 1:
            return bool(flag)
        value = torch.tensor([int(flag)], dtype=torch.int32, device=self.device)
        dist.broadcast(value, src=0, group=self.group)
        return bool(value.item())

    def memory_gib(self) -> float | None:
        if self.device.type != "cuda":
            return None
        return torch.cuda.max_memory_allocated(self.device) / 2**30


def run_rank(
    cfg,
    rank: int,
    world_size: int,
    device: torch.device,
    group=None,
    source=None,
    on_step=None,
) -> list[dict]:
    """One rank's training (process group already initialised); rank 0 returns the rows.
    `source`: the samples (a `hstu.data.loader.SampleSource`; default: `cfg.data`'s);
    `on_step(step, metrics)`: called on each logged step's metrics (`hstu.trainer.train`)."""
    # TorchRec's modules trip a one-time torch.fx deprecation notice on every rank: noise here.
    logging.getLogger("torch.fx._symbolic_trace").setLevel(logging.ERROR)
    set_cublas_workspace(cfg, torch.device(device).type)  # before the rank's first GEMM
    torch.manual_seed(rank_seed(cfg.train.seed, rank))
    backend = TorchBackend(cfg, rank, world_size, device, group)
    checkpointer = TrainCheckpointer(
        cfg.output_dir,
        backend.model,
        backend.optimizer,
        rank,
        cfg.train.keep_checkpoints,
        device,
        group,
        backend.tables,
    )
    check_shuffler(cfg.balance.shuffler)
    source = source if source is not None else source_from_config(cfg)
    if cfg.train.cuda_graphs:
        backend.use_cuda_graphs(capacity.for_source(cfg, source, "torch"))
    return trainer.train(cfg, backend, checkpointer, source, "torch", on_step)
