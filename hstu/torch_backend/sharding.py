"""Embedding-table sharding (`embedding.sharding` != none), applied here and nowhere else.

`shard_tables(model, cfg, ...)` turns the model's replicated `EmbeddingCollection` into one of:

* `FusedTables` (`table_wise`, `row_wise`, `auto`): TorchRec `DistributedModelParallel` over
  the model with a plan from `EmbeddingShardingPlanner` (constraints force the sharding type;
  `auto` lets the planner choose among table_wise, row_wise and table_row_wise: column-wise
  sharding is left out because a row-wise optimizer on a column shard would average over part
  of the row only). The tables' optimizer is fused into the TBE backward (fbgemm
  `EXACT_ROWWISE_ADAGRAD` / `ADAM`): it updates the touched rows while backward runs, so the
  tables have no `.grad` and no AdamW state. DMP wraps nothing in DDP (`_no_data_parallel`):
  the dense parameters stay with `grad_sync.GradBuckets` and AdamW. The embedding all-to-alls
  run on a process group of their own, so their order and the gradient buckets' order are
  each fixed on every rank whatever the other does (hstu/pipeline.py).
* `ReplicatedTables` (`data_parallel`): the tables stay replicated parameters, their gradients
  are all-reduced over the rows some rank looked up (`grad_sync.TouchedRowsReduce`), and
  `embedding.optimizer` updates those rows (row-wise Adagrad: every row, which leaves the
  untouched ones exactly as they are; Adam: where the ranks' marks of their lookups are set).
  TorchRec's own data_parallel sharding of an EmbeddingCollection pools the sequences on a
  CPU (a TBE dense-kernel limitation in 1.8), hence this implementation.

docs/MODEL.md ("Sharded embedding tables and their optimizer") defines the update;
`hstu/embedding_opt.py` is its numpy reference.
"""

from __future__ import annotations

import logging
import os
import warnings

import numpy as np
import torch
import torch.distributed as dist

from hstu.errors import HSTUError
from hstu.torch_backend.grad_sync import RowMarks

TABLES = ("item", "action", "contextual")
EMBEDDING_PREFIX = "embedding."
# embedding.sharding -> TorchRec sharding types the planner may use
PLANNED = {
    "table_wise": ("table_wise",),
    "row_wise": ("row_wise",),
    "auto": ("table_wise", "row_wise", "table_row_wise"),
}


def check_sharding(cfg, device_type: str) -> None:
    """What this backend cannot run, as a config error before any rank or collective."""
    e = cfg.embedding
    if not e.sharded:
        return
    if e.optimizer == "adam" and e.sharding != "data_parallel" and device_type != "cuda":
        raise HSTUError(
            "embedding.optimizer=adam runs on CUDA only in the torch backend: fbgemm's CPU "
            "table-batched-embedding kernels have no Adam (use embedding.optimizer="
            "row_wise_adagrad, or dist.device=cuda)"
        )


def embedding_features(model) -> list[str]:
    """The embedding collection's feature names, table by table."""
    return [f for c in model.embedding.embedding_configs() for f in c.feature_names]


def table_features(model) -> dict[str, list[str]]:
    """Core table name -> the batch keys it is looked up at (docs/MODEL.md token table)."""
    return {
        EMBEDDING_PREFIX + c.name: list(c.feature_names)
        for c in model.embedding.embedding_configs()
    }


class ReplicatedTables:
    """`data_parallel`: replicated tables, their gradients all-reduced (at W > 1 over the rows
    some rank looked up), the touched-rows update.

    Row-wise Adagrad runs on every row from the dense gradient: a row no rank touched has a
    zero gradient, which it leaves exactly unchanged. Adam would move such a row (its moments
    decay), so it takes the touched rows `T` explicitly: each rank marks the ids it looks up
    (`row_marks.mark`, before its forward), the marks are combined over the ranks (one MAX
    all-reduce of a float per row, beside the forward) and the update applies where they are
    set. At W > 1 the same marks bound the gradients' reduction (`TouchedRowsReduce`)."""

    kind = "replicated"

    def __init__(self, model, cfg, world_size: int = 1, group=None):
        self.cfg, self.model = cfg.embedding, model
        self.world_size, self.group = world_size, group
        named = model.named_core_parameters()
        self.tables = {n: p for n, p in named.items() if n.startswith(EMBEDDING_PREFIX)}
        self.dense = {n: p for n, p in named.items() if not n.startswith(EMBEDDING_PREFIX)}
        self.reduced_params = list(model.parameters())  # the bucket layout of sharding=none
        self.adam = self.cfg.optimizer == "adam"
        device = next(iter(self.tables.values())).device
        self.features = table_features(model)
        # the rows some rank looks up: Adam updates them, and at W > 1 the gradients are
        # reduced over them (grad_sync.TouchedRowsReduce); one all-reduce per step
        self.row_marks = (
            RowMarks(self.tables, self.features, world_size, group)
            if self.adam or world_size > 1
            else None
        )
        if self.adam:
            self.state = {
                n: {"m": torch.zeros_like(p), "v": torch.zeros_like(p)}
                for n, p in self.tables.items()
            }
        else:
            self.state = {n: {"sum": torch.zeros(p.shape[0], device=p.device)}
                          for n, p in self.tables.items()}  # fmt: skip
        # the update's t on the device (Adam's bias correction; a step graph advances it too)
        self.t = torch.zeros((), dtype=torch.float32, device=device)
        self.count = 0

    @torch.no_grad()
    def step(self, compact: dict | None = None) -> None:
        """The update. `compact`: table -> (rows, their gradient) where the step's reduction
        carried part of a table (`TouchedRowsReduce.compact`, W > 1): Adam then reads and writes
        those rows only (every marked row is among them; the others are left as they are),
        the same arithmetic on the same values as the dense masked pass, which streams the
        whole table, both moments and the gradient through a dozen elementwise kernels."""
        from hstu_kernels.triton.adamw_multi import adamw_multi_

        e = self.cfg
        compact = compact or {}
        self.count += 1
        self.t.add_(1)
        if self.adam:
            self.row_marks.wait()  # launched when the step's batch was marked
        hyper = dict(lr=e.lr, beta1=e.beta1, beta2=e.beta2, eps=e.eps, weight_decay=e.weight_decay)
        whole: list[tuple] = []  # Adam over a whole table, masked: one launch for all of them
        for name, p in self.tables.items():
            g = p.grad if p.grad is not None else torch.zeros_like(p)
            st = self.state[name]
            if self.adam and name in compact:
                rows, g_rows = compact[name]  # distinct rows: the writes back are exact
                state = [x.index_select(0, rows) for x in (p, st["m"], st["v"])]
                touched = self.row_marks.rows[name].index_select(0, rows) > 0
                adamw_multi_([state[0]], [g_rows.contiguous()], [state[1]], [state[2]], [self.t],
                             **hyper, rows=[touched])  # fmt: skip
                for x, new in zip((p, st["m"], st["v"]), state, strict=True):
                    x.index_copy_(0, rows, new)
                continue
            if self.adam:
                whole.append((p.detach(), g, st["m"], st["v"], self.row_marks.rows[name] > 0))
                continue
            s = st["sum"]
            s.add_((g * g).mean(dim=1))
            p.sub_(g * (e.lr / (s.sqrt() + e.eps))[:, None])
        if whole:
            ps, gs, ms, vs, marks = (list(x) for x in zip(*whole, strict=True))
            adamw_multi_(ps, gs, ms, vs, [self.t] * len(ps), **hyper, rows=marks)

    def stepped(self) -> None:
        """A step graph applied the update (step_graphs.py): count it."""
        self.count += 1

    def checkpoint_state(self) -> tuple[dict, dict]:
        """(`{torch name: table}`, `{core name.sum|.m|.v: state}`) for DCP, in place."""
        weights = {_torch_name(n): p.detach() for n, p in self.tables.items()}
        return weights, {f"{n}.{f}": x for n, st in self.state.items() for f, x in st.items()}

    def after_load(self, count: int) -> None:
        self.count = count
        self.t.fill_(count)

    def local_shards(self) -> dict:
        out = {}
        for n, p in self.tables.items():
            st = [x.cpu().numpy() for x in self.state[n].values()]  # sum, or m then v
            st = np.concatenate([x[:, None] if x.ndim == 1 else x for x in st], axis=1)
            out[n] = [(0, 0, p.detach().cpu().numpy(), st)]
        return out


def _no_data_parallel():
    """DMP's data-parallel wrapper that wraps nothing: GradBuckets reduce the dense part."""
    from torchrec.distributed.model_parallel import DataParallelWrapper

    class NoDataParallel(DataParallelWrapper):
        def wrap(self, dmp, env, device) -> None:
            pass

    return NoDataParallel()


class FusedTables:
    """`table_wise` / `row_wise` / `auto`: TorchRec DMP with the optimizer fused into TBE."""

    kind = "fused"

    def __init__(self, model, cfg, world_size: int, device: torch.device, group=None):
        from fbgemm_gpu.split_embedding_configs import EmbOptimType
        from torchrec.distributed import comm_ops
        from torchrec.distributed.embedding import EmbeddingCollectionSharder
        from torchrec.distributed.model_parallel import DistributedModelParallel
        from torchrec.distributed.planner import (
            EmbeddingShardingPlanner,
            ParameterConstraints,
            Topology,
        )
        from torchrec.distributed.types import ShardingEnv

        e = self.cfg = cfg.embedding
        # TorchRec divides the gradients its all-to-alls carry back by the world size (it
        # assumes DDP's per-rank mean loss); our loss is already normalised globally, so the
        # sum over ranks is the gradient (hstu/pipeline.py). Process-wide, like the setting.
        comm_ops.set_gradient_division(False)
        model.embedding_keys = embedding_features(model)
        fused = {"optimizer": EmbOptimType.EXACT_ROWWISE_ADAGRAD, "learning_rate": e.lr}
        fused["eps"] = e.eps
        if e.optimizer == "adam":
            fused |= {
                "optimizer": EmbOptimType.ADAM,
                "beta1": e.beta1,
                "beta2": e.beta2,
                "weight_decay": e.weight_decay,
            }
        sharder = EmbeddingCollectionSharder(fused_params=fused)
        ranks = dist.get_process_group_ranks(group) if group is not None else range(world_size)
        # the embedding all-to-alls get their own group: see the module docstring
        self.group = dist.new_group(ranks=list(ranks))
        constraints = {
            t: ParameterConstraints(sharding_types=list(PLANNED[e.sharding])) for t in TABLES
        }
        local = int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
        planner_log = logging.getLogger("torchrec.distributed.planner")
        level = planner_log.level
        planner_log.setLevel(logging.ERROR)  # notes on dry runs and topology factories: noise
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", FutureWarning)
                # the GPU's own memory: TorchRec's default is 32 GB, under which a 51 GB shard
                # of a 200M x 128 table was planned into host memory (UVM caching)
                hbm = {}
                if device.type == "cuda":
                    hbm["hbm_cap"] = torch.cuda.get_device_properties(device).total_memory
                topology = Topology(
                    world_size=world_size, compute_device=device.type, local_world_size=local, **hbm
                )
                planner = EmbeddingShardingPlanner(topology=topology, constraints=constraints)
                self.plan = planner.collective_plan(model, [sharder], self.group)
        finally:
            planner_log.setLevel(level)
        self.dmp = DistributedModelParallel(
            model,
            env=ShardingEnv.from_process_group(self.group),
            device=device,
            plan=self.plan,
            sharders=[sharder],
            data_parallel_wrapper=_no_data_parallel(),
        )
        self.model = model
        named = dict(model.named_parameters())
        self.dense = {
            model.core_name(n): p for n, p in named.items() if not n.startswith(EMBEDDING_PREFIX)
        }
        self.reduced_params = list(self.dense.values())
        self.count = 0
        self._init_shards(cfg.model, cfg.train.seed)

    def sharding_types(self) -> dict[str, str]:
        plan = self.plan.get_plan_for_module("embedding") or {}
        return {t: plan[t].sharding_type for t in TABLES if t in plan}

    def compute_kernels(self) -> dict[str, str]:
        """Where the planner put each table: `fused` (GPU memory), `fused_uvm_caching` (host
        memory behind a GPU cache), ..."""
        plan = self.plan.get_plan_for_module("embedding") or {}
        return {t: plan[t].compute_kernel for t in TABLES if t in plan}

    @torch.no_grad()
    def _init_shards(self, model_cfg, seed: int) -> None:
        """Each shard drawn from the core init (`hstu.params.init_table_rows`, its rows only):
        the same model as sharding=none, and no rank ever holds a whole table."""
        from hstu.params import init_table_rows

        weights, _ = self.checkpoint_state()
        for name, st in weights.items():
            core = "embedding." + name.split(".")[2]
            for shard in st.local_shards():
                (r0, c0), (nr, nc) = shard.metadata.shard_offsets, shard.metadata.shard_sizes
                rows = init_table_rows(model_cfg, seed, core, r0, r0 + nr)[:, c0 : c0 + nc]
                shard.tensor.copy_(torch.from_numpy(np.ascontiguousarray(rows)))

    def step(self) -> None:
        self.count += 1  # the rows were updated inside backward

    def _tbe_modules(self):
        from fbgemm_gpu.split_table_batched_embeddings_ops_training import (
            SplitTableBatchedEmbeddingBagsCodegen,
        )

        return [
            m for m in self.model.modules() if isinstance(m, SplitTableBatchedEmbeddingBagsCodegen)
        ]

    def checkpoint_state(self) -> tuple[dict, dict]:
        """(`{torch name: ShardedTensor}`, `{core name.sum|.m|.v: ShardedTensor}`): views of
        the live TBE weights and optimizer state, so DCP reads and writes them in place."""
        model_state = self.model.embedding.state_dict(prefix="embedding.")
        weights = {n: t for n, t in model_state.items() if n.endswith(".weight")}
        states = self.dmp.fused_optimizer.state_dict()["state"]
        # TorchRec names a table's first state `momentum1` and the others by the TBE's own
        # keys (fbgemm Adam: `exp_avg_sq`; `momentum2` in the TBE's buffers)
        names = {"momentum1": "m", "exp_avg_sq": "v", "momentum2": "v"}
        if self.cfg.optimizer == "row_wise_adagrad":
            names = {"momentum1": "sum"}
        opt = {}
        for t in TABLES:
            # (a rank that holds no shard of a table has no optimizer state for it)
            per_table = states.get(f"embedding.embeddings.{t}.weight", {})
            for key, ours in names.items():
                if f"{t}.{key}" in per_table:
                    opt[f"embedding.{t}.{ours}"] = per_table[f"{t}.{key}"]
            found = {k for k in opt if k.startswith(f"embedding.{t}.")}
            if per_table and len(found) != len(set(names.values())):
                raise HSTUError(
                    f"embedding.{t}: the fused optimizer's state is {sorted(per_table)}; "
                    f"expected {sorted(set(names.values()))} of {self.cfg.optimizer} (a TorchRec "
                    "version that names them otherwise: checkpoints would lose state)"
                )
        return weights, opt

    def after_load(self, count: int) -> None:
        self.count = count
        for m in self._tbe_modules():  # the Adam bias correction's t, counted per forward
            if hasattr(m, "iter"):
                m.iter.fill_(count)
                m.iter_cpu.fill_(count)

    def gather_weights(self) -> dict[str, np.ndarray] | None:
        """Collective (every rank of the tables' group): the whole tables, fp32 numpy by core
        name, on the group's rank 0 (None elsewhere). Evaluation only: that rank then holds
        every table whole."""
        weights, _ = self.checkpoint_state()
        mine = {
            "embedding." + name.split(".")[2]: [
                (*s.metadata.shard_offsets, s.tensor.detach().cpu().numpy())
                for s in st.local_shards()
            ]
            for name, st in weights.items()
        }
        first = dist.get_rank(self.group) == 0
        everyone = [None] * dist.get_world_size(self.group) if first else None
        dst = dist.get_global_rank(self.group, 0)
        dist.gather_object(mine, everyone, dst=dst, group=self.group)
        if not first:
            return None
        shapes = {n: tuple(st.size()) for n, st in weights.items()}
        out = {}
        for name, shape in shapes.items():
            core = "embedding." + name.split(".")[2]
            out[core] = np.zeros(shape, np.float32)
            for shards in everyone:
                for r0, c0, w in shards.get(core, []):
                    out[core][r0 : r0 + w.shape[0], c0 : c0 + w.shape[1]] = w
        return out

    def local_shards(self) -> dict:
        """`{core name: [(row offset, col offset, weights, state)]}` of this rank (tests)."""
        weights, opt = self.checkpoint_state()
        out = {}
        for name, st in weights.items():
            core = "embedding." + name.split(".")[2]
            states = [opt[k] for k in sorted(opt) if k.startswith(core + ".")]
            rows = []
            for i, shard in enumerate(st.local_shards()):
                (r0, c0) = shard.metadata.shard_offsets
                extra = [s.local_shards()[i].tensor.detach().cpu().numpy() for s in states]
                extra = [x[:, None] if x.ndim == 1 else x for x in extra]
                rows.append((r0, c0, shard.tensor.detach().cpu().numpy(), np.concatenate(extra, 1)))
            out[core] = rows
        return out


def _torch_name(core: str) -> str:
    return "embedding.embeddings." + core.removeprefix(EMBEDDING_PREFIX) + ".weight"


def shard_tables(model, cfg, world_size: int, device, group=None):
    """`None` for sharding=none (today's replicated model), else the tables' handler."""
    sharding = cfg.embedding.sharding
    if sharding == "none":
        return None
    check_sharding(cfg, torch.device(device).type)
    if sharding == "data_parallel":
        return ReplicatedTables(model, cfg, world_size, group)
    return FusedTables(model, cfg, world_size, torch.device(device), group)


def gather_tables(tables, shapes: dict[str, tuple[int, int]], group=None) -> dict:
    """Collective (tests, small tables): `{core: (weights [rows, D], state [rows, k])}`, whole,
    from every rank's shards."""
    mine = tables.local_shards()
    everyone: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(everyone, mine, group=group)
    out = {}
    for name, (rows, dim) in shapes.items():
        width = None
        for shards in everyone:
            for r0, c0, w, s in shards.get(name, []):
                if width is None:
                    width = s.shape[1]
                    out[name] = (np.zeros((rows, dim), np.float32), np.zeros((rows, width)))
                out[name][0][r0 : r0 + w.shape[0], c0 : c0 + w.shape[1]] = w
                out[name][1][r0 : r0 + s.shape[0]] = s
    return out
