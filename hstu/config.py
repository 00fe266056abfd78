"""One config tree: dataclasses that validate themselves, YAML recipes, `key.sub=value` overrides.

Every key is a dataclass field whose metadata carries its one-line description (`doc`), so
`hstu config show` and the docs read from the same place as the code. An unknown key (in a
YAML file, an override, or inside `data.seqlen_params`) is an error naming the key and the
accepted ones, so a typo never silently falls back to a default.

Recipes are YAML files; `--config demo` names one of the packaged recipes (`configs/` in the
source tree, installed as the `hstu_recipes` package) from any directory.
"""

from __future__ import annotations

import dataclasses
import importlib.resources
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, get_type_hints

import yaml

from hstu.errors import HSTUError

# `train.capacity_buckets` at most: room for the growth past them under torch's graph limit
# (`torch_backend.graphs.MAX_GRAPHS`), so a run's shapes all replay
MAX_CAPACITY_BUCKETS = 48


def _opt(default: Any, doc: str) -> Any:
    """A config field with its one-line description."""
    if isinstance(default, dict):
        return field(default_factory=lambda: dict(default), metadata={"doc": doc})
    if isinstance(default, list):
        return field(default_factory=lambda: list(default), metadata={"doc": doc})
    return field(default=default, metadata={"doc": doc})


def _check(cond: bool, name: str, value: Any, why: str) -> None:
    if not cond:
        raise HSTUError(f"config: {name}={value!r} is invalid: {why}")


def _one_of(name: str, value: Any, choices: tuple) -> None:
    _check(value in choices, name, value, f"must be one of {list(choices)}")


def _positive(obj: Any, prefix: str, *names: str, allow_zero: bool = False) -> None:
    for name in names:
        value = getattr(obj, name)
        ok = value >= 0 if allow_zero else value > 0
        _check(ok, prefix + name, value, "must be >= 0" if allow_zero else "must be > 0")


@dataclass
class ModelConfig:
    embedding_dim: int = _opt(64, "hidden size D of the HSTU stack and the embedding tables")
    num_layers: int = _opt(2, "HSTU layers")
    num_heads: int = _opt(2, "attention heads H")
    attention_dim: int = _opt(32, "query/key size per head (Dqk)")
    linear_dim: int = _opt(32, "value size per head (Dv)")
    alpha: float | None = _opt(None, "scale inside the attention SiLU; null: 1/sqrt(attention_dim)")
    normalizer: float = _opt(
        128.0, "fixed attention normaliser N (never the batch's max length, which a shuffle moves)"
    )
    dropout: float = _opt(0.0, "dropout after the attention gating, in [0, 1)")
    num_items: int = _opt(2000, "rows of the item table (item and candidate ids)")
    num_actions: int = _opt(8, "rows of the action table")
    num_contextual_ids: int = _opt(100, "rows of the contextual-feature table")
    rab_position_buckets: int = _opt(0, "relative position bias buckets (0: no position bias)")
    rab_time_buckets: int = _opt(0, "relative time bias buckets, log2 of the gap (0: none)")
    attention: str = _opt(
        "reference",
        "reference (padded dense) | kernel: the backend's fused kernel, also triton / pallas",
    )
    fused_norm: bool = _opt(
        True,
        "on a GPU: each LayerNorm (and the attention gating `attn_norm(a) * u`, or the "
        "residual add's gradient) as one kernel forward and one backward, Triton in torch, "
        "Pallas in jax (kernels/pallas/layer_norm.py); on CPU no effect (XLA's, torch's ops)",
    )
    fused_silu: bool = _opt(
        True,
        "torch on CUDA: the uvqk projection's SiLU backward and its bias gradient in one "
        "Triton kernel (kernels/triton/linear_silu.py); elsewhere autodiff's; jax: no effect "
        "(XLA fuses autodiff's; the Pallas kernel of it timed slower, docs/BENCHMARKS.md)",
    )
    silu_epilogues: bool = _opt(
        False,
        "torch on CUDA with model.attention=kernel, fused_norm and fused_silu: SiLU's backward "
        "and the uvqk bias gradient in the epilogues of the kernels that write the gradients "
        "(the attention's dk/dv and dq, the gated norm's; hstu_linear_uvqk_attention), no "
        "SiLU-backward pass of its own; off: the epilogues cost more than the pass they "
        "replace (+6 percent step time on an H200, docs/BENCHMARKS.md); jax: no effect",
    )
    pallas_lowering: str = _opt(
        "triton",
        "jax kernel: the Pallas lowering of the attention kernels (forward, dq, dk/dv), triton "
        "| mosaic (Mosaic GPU on Hopper, jax >= 0.11, no biases; an error says what rules it "
        "out) | auto (mosaic where it can run, else triton); torch: no effect",
    )
    attention_backward: str = _opt(
        "auto",
        "torch kernel: the Triton attention backward, split (a dk/dv and a dq kernel; "
        "deterministic) | fused (one kernel, dq added with fp32 atomics: 5 matmuls per tile "
        "pair instead of 7, sums in a run-dependent order) | stored (the dk/dv kernel stores dS "
        "in 16 bits, dq is one matmul per tile pair from it: 5 instead of 7, deterministic, a "
        "transient [heads, rows, max_seqlen] buffer) | auto (the kernels' choice per head dim); "
        "jax: no effect (its Pallas backward is split)",
    )
    task: str = _opt("ranking", "ranking (multi-task BCE on candidates) | retrieval")
    num_tasks: int = _opt(2, "ranking tasks, encoded as the bits of each candidate's label")
    num_negatives: int = _opt(16, "retrieval: sampled negatives per target")
    retrieval_temperature: float = _opt(0.05, "retrieval: softmax temperature")
    dtype: str = _opt("float32", "compute dtype of the HSTU stack: float32 | bfloat16 | float16")

    def validate(self) -> None:
        p = "model."
        _positive(self, p, "embedding_dim", "num_layers", "num_heads", "attention_dim")
        _positive(self, p, "linear_dim", "num_items", "num_actions", "num_contextual_ids")
        _positive(self, p, "num_tasks", "num_negatives", "normalizer", "retrieval_temperature")
        _positive(self, p, "rab_position_buckets", "rab_time_buckets", allow_zero=True)
        _check(0.0 <= self.dropout < 1.0, p + "dropout", self.dropout, "must be in [0, 1)")
        if self.alpha is not None:
            _check(math.isfinite(self.alpha), p + "alpha", self.alpha, "must be finite")
        _one_of(p + "attention", self.attention, ("reference", "kernel", "triton", "pallas"))
        _one_of(p + "pallas_lowering", self.pallas_lowering, ("triton", "mosaic", "auto"))
        _one_of(
            p + "attention_backward", self.attention_backward, ("auto", "split", "fused", "stored")
        )
        _one_of(p + "task", self.task, ("ranking", "retrieval"))
        _one_of(p + "dtype", self.dtype, ("float32", "bfloat16", "float16"))

    def attention_impl(self, backend: str) -> str:
        """`reference` or `kernel` for this backend; `triton`/`pallas` name a backend's kernel."""
        kernel_of = {"torch": "triton", "jax": "pallas"}
        if self.attention in ("reference", "kernel"):
            return self.attention
        if self.attention == kernel_of[backend]:
            return "kernel"
        raise HSTUError(
            f"model.attention={self.attention} is the other backend's kernel; with the "
            f"{backend} backend use 'kernel' (= {kernel_of[backend]}) or 'reference'"
        )

    @property
    def resolved_alpha(self) -> float:
        return self.alpha if self.alpha is not None else 1.0 / self.attention_dim**0.5


@dataclass
class DataConfig:
    source: str = _opt(
        "synthetic", "where samples come from: synthetic | prepared (`hstu data prepare` output)"
    )
    path: str = _opt("", "data.source=prepared: the prepared dataset's directory")
    seed: int = _opt(0, "seed of the data (sample s is drawn from (seed, s))")
    batch_size: int = _opt(8, "samples per rank and step (padded)")
    num_samples: int = _opt(
        0, "samples per epoch (0: endless); a short last global batch is padded"
    )
    seqlen_dist: str = _opt(
        "lognormal", "history lengths: uniform | normal | lognormal | zipf | pareto | fixed"
    )
    seqlen_params: dict = _opt({}, "parameters of seqlen_dist, e.g. {sigma: 1.5}")
    min_history: int = _opt(1, "fewest item (+ action) events per sample")
    max_history: int = _opt(64, "most item (+ action) events per sample")
    num_contextual: int = _opt(2, "contextual tokens per sample")
    min_candidates: int = _opt(1, "fewest candidate tokens per sample")
    max_candidates: int = _opt(4, "most candidate tokens per sample")
    time_step: int = _opt(60, "mean seconds between events (synthetic timestamps)")
    prefetch: int = _opt(2, "batches read, validated and measured ahead on a host thread")
    workers: int = _opt(
        0,
        "processes that build the batches (0: the prefetch thread builds them, holding the GIL "
        "the training loop needs; >= 1: spawned worker processes, the source must pickle)",
    )
    pack_window: int = _opt(
        0,
        "static-shape steps (jax; torch with train.cuda_graphs): reorder the samples inside "
        "windows of this many so that each batch fills a token capacity (hstu/data/packing.py); "
        "a multiple of batch_size, at least two batches; 0: the stream's order",
    )

    def validate(self) -> None:
        p = "data."
        _one_of(p + "source", self.source, ("synthetic", "prepared"))
        if self.source == "prepared":
            _check(bool(self.path), p + "path", self.path, "data.source=prepared needs a path")
        _positive(self, p, "batch_size")
        _positive(self, p, "num_samples", "num_contextual", "prefetch", "workers", allow_zero=True)
        _check(
            0 <= self.min_history <= self.max_history,
            p + "min_history",
            self.min_history,
            f"must be in [0, max_history={self.max_history}]",
        )
        _check(
            0 <= self.min_candidates <= self.max_candidates,
            p + "min_candidates",
            self.min_candidates,
            f"must be in [0, max_candidates={self.max_candidates}]",
        )
        _positive(self, p, "time_step", allow_zero=True)
        _check(
            self.pack_window == 0
            or (
                self.pack_window >= 2 * self.batch_size and self.pack_window % self.batch_size == 0
            ),
            p + "pack_window",
            self.pack_window,
            f"must be 0 or a multiple of data.batch_size={self.batch_size} holding at least two "
            "batches",
        )
        from hstu.data.distributions import DISTRIBUTIONS, check_params

        _one_of(p + "seqlen_dist", self.seqlen_dist, tuple(DISTRIBUTIONS))
        check_params(self.seqlen_dist, self.seqlen_params, p + "seqlen_params")

    @property
    def max_seqlen(self) -> int:
        """Longest sample in tokens: contextual + item/action pairs + candidates."""
        return self.num_contextual + 2 * self.max_history + self.max_candidates


@dataclass
class TrainConfig:
    steps: int = _opt(20, "optimizer steps of the run (a resumed run goes on to this count)")
    lr: float = _opt(1e-3, "AdamW learning rate")
    weight_decay: float = _opt(0.01, "AdamW decoupled weight decay")
    beta1: float = _opt(0.9, "AdamW beta1")
    beta2: float = _opt(0.98, "AdamW beta2")
    eps: float = _opt(1e-8, "AdamW epsilon")
    seed: int = _opt(0, "seed of the parameter initialisation and dropout")
    log_every: int = _opt(1, "print a metrics line every N steps (every step goes to the files)")
    checkpoint_every: int = _opt(
        0, "save a checkpoint every N steps and at the last step (0: never)"
    )
    keep_checkpoints: int = _opt(2, "complete checkpoints kept (the newest)")
    resume: bool = _opt(False, "continue from the newest checkpoint under output_dir")
    peak_tflops: float = _opt(
        0.0, "device peak for MFU (0: detected; unknown devices and CPUs report no MFU)"
    )
    tensorboard: bool = _opt(True, "also write the step metrics as TensorBoard scalars")
    watchdog_s: float = _opt(
        600.0,
        "no step finished for this long: dump every thread's stack and stop the run (0: off)",
    )
    eval_every: int = _opt(
        0, "evaluate on the validation split every N steps (data.source=prepared; 0: never)"
    )
    cuda_graphs: bool = _opt(
        False,
        "torch on CUDA: replay the step from CUDA graphs, one per token capacity (what: "
        "train.graph_scope; no effect in jax, whose step is one compiled program already)",
    )
    build_ahead: bool = _opt(
        False,
        "jax: build the step program of every token capacity of the capacity policy at the "
        "first step, compiled in parallel threads, instead of each at its capacity's first "
        "step (the run pays the longest compile, not their sum; no effect in torch)",
    )
    capacity_buckets: int = _opt(
        0,
        "token capacities a run's static-shape steps pad to (jax: one compiled step program "
        "each; torch with train.cuda_graphs: one graph each), fitted to the batches the data "
        "config draws (hstu/capacity.py): more pad less and build more programs; 2 to 48, or "
        "0: the backend's own, 8 in jax (a program is a compile of seconds), 48 in torch (a "
        "graph is a capture of ~0.2 s; 1.9 percent padding at bench_upstream's batch 32, against "
        "3.0 with 32 and 12.5 with 8: +0.5 and +4.5 percent TFLOP/s on an H200, "
        "docs/BENCHMARKS.md); packed batches (data.pack_window) fill 8",
    )
    metrics_lag: int = _opt(
        1,
        "steps dispatched past the one whose metrics the host reads (1 to 3): the device's "
        "queue holds this many steps, so a host hiccup shorter than lag - 1 step times leaves "
        "it busy; each step's metrics arrive that many steps late",
    )
    graph_scope: str = _opt(
        "auto",
        "with train.cuda_graphs: auto = the whole step (lookups, loss, backward, AdamW) in one "
        "graph per shape where the ranks hold replicated tables (embedding.sharding=none, or "
        "data_parallel with adam; at W > 1 the collectives and the update follow the graph), "
        "else the HSTU stack; stack = the stack only",
    )
    cublas_workspace: str = _opt(
        "auto",
        "torch on CUDA: cuBLAS's workspace (CUBLAS_WORKSPACE_CONFIG, which cuBLAS reads once "
        "per process, at its first GEMM; a value already in the environment wins): none = no "
        "workspace, so cuBLAS picks GEMM kernels that need no zeroed scratch and a captured "
        "step loses the memset node it held before every bf16-output GEMM (the GEMMs as fast, "
        "docs/BENCHMARKS.md); torch = torch's default; auto = none with train.cuda_graphs, "
        "else torch's (no effect in jax)",
    )

    def validate(self) -> None:
        p = "train."
        _positive(self, p, "steps", "lr", "log_every", "keep_checkpoints", "eps")
        _positive(self, p, "checkpoint_every", "weight_decay", "peak_tflops", allow_zero=True)
        _positive(self, p, "watchdog_s", "eval_every", allow_zero=True)
        _one_of(p + "graph_scope", self.graph_scope, ("auto", "stack"))
        _one_of(p + "cublas_workspace", self.cublas_workspace, ("auto", "none", "torch"))
        _check(
            isinstance(self.metrics_lag, int) and 1 <= self.metrics_lag <= 3,
            p + "metrics_lag", self.metrics_lag, "must be an int from 1 to 3",
        )  # fmt: skip
        _check(
            isinstance(self.capacity_buckets, int)
            and (self.capacity_buckets == 0 or 2 <= self.capacity_buckets <= MAX_CAPACITY_BUCKETS),
            p + "capacity_buckets", self.capacity_buckets,
            f"must be 0 (the backend's own) or an int from 2 to {MAX_CAPACITY_BUCKETS}",
        )  # fmt: skip
        for name in ("beta1", "beta2"):
            value = getattr(self, name)
            _check(0.0 <= value < 1.0, p + name, value, "must be in [0, 1)")


@dataclass
class DistConfig:
    world_size: int = _opt(
        1, "data-parallel ranks (CPU: gloo processes / host devices; torchrun decides its own)"
    )
    device: str = _opt("auto", "auto | cpu | cuda | gpu")
    master_port: int = _opt(0, "torch rendezvous port of spawned ranks (0: a free port)")
    timeout_s: float = _opt(
        600.0, "longest wait in one collective or rendezvous before the run fails (s)"
    )
    heartbeat_s: int = _opt(
        10, "jax multi-process: a process silent this long is declared dead, ending the run (s)"
    )

    def validate(self) -> None:
        _positive(self, "dist.", "world_size", "timeout_s", "heartbeat_s")
        _one_of("dist.device", self.device, ("auto", "cpu", "cuda", "gpu"))
        _check(
            0 <= self.master_port < 65536, "dist.master_port", self.master_port, "not a TCP port"
        )


@dataclass
class BalanceConfig:
    shuffler: str = _opt("balanced", "identity (no exchange) | balanced")
    exchange: str = _opt("allgather", "how samples move: allgather | all2all")
    method: str = _opt("auto", "partition method: auto | kk | greedy")
    overlap: bool = _opt(True, "partition on a worker thread while the device runs the step")

    def validate(self) -> None:
        _one_of("balance.shuffler", self.shuffler, ("identity", "balanced"))
        _one_of("balance.exchange", self.exchange, ("allgather", "all2all"))
        _one_of("balance.method", self.method, ("auto", "kk", "greedy"))


@dataclass
class BenchConfig:
    probe_every: int = _opt(
        0,
        "every N steps, time each rank's forward+backward alone (as loaded and as balanced) "
        "and the step's device phases; the next step is left out of the medians (0: never)",
    )
    probe_after: int = _opt(3, "steps of warm-up before the first probe")
    probe_phases: bool = _opt(
        True, "probes also time the step's device phases (forward, backward, reduction, update)"
    )
    probe_repeats: int = _opt(3, "timed repeats per probe measurement (median)")

    def validate(self) -> None:
        _positive(self, "bench.", "probe_every", "probe_after", allow_zero=True)
        _positive(self, "bench.", "probe_repeats")


SHARDINGS = ("none", "auto", "table_wise", "row_wise", "data_parallel")
EMBEDDING_OPTIMIZERS = ("row_wise_adagrad", "adam")


@dataclass
class EmbeddingConfig:
    sharding: str = _opt(
        "none",
        "none: the tables are dense parameters, replicated, updated by train.* AdamW with the "
        "rest of the model; auto | table_wise | row_wise | data_parallel: sharded tables "
        "(torch: TorchRec DistributedModelParallel; jax: rows sharded over the devices) with "
        "embedding.optimizer applied to the rows a step touches (docs/MODEL.md)",
    )
    optimizer: str = _opt(
        "row_wise_adagrad",
        "sharded tables: row_wise_adagrad (one accumulator per row) | adam (sparse: touched rows)",
    )
    lr: float = _opt(0.01, "sharded tables: learning rate of embedding.optimizer")
    eps: float = _opt(1e-8, "sharded tables: epsilon of embedding.optimizer")
    beta1: float = _opt(0.9, "sharded tables, adam: beta1")
    beta2: float = _opt(0.999, "sharded tables, adam: beta2")
    weight_decay: float = _opt(
        0.0, "sharded tables, adam: decoupled weight decay of the touched rows"
    )

    def validate(self) -> None:
        p = "embedding."
        _one_of(p + "sharding", self.sharding, SHARDINGS)
        _one_of(p + "optimizer", self.optimizer, EMBEDDING_OPTIMIZERS)
        _positive(self, p, "lr", "eps")
        _positive(self, p, "weight_decay", allow_zero=True)
        for name in ("beta1", "beta2"):
            value = getattr(self, name)
            _check(0.0 <= value < 1.0, p + name, value, "must be in [0, 1)")
        _check(
            self.optimizer == "adam" or self.weight_decay == 0.0,
            p + "weight_decay",
            self.weight_decay,
            "row_wise_adagrad has no weight decay (docs/MODEL.md): set it to 0 or use adam",
        )

    @property
    def sharded(self) -> bool:
        return self.sharding != "none"


EVAL_FAMILIES = {  # eval.metrics entry -> the model task it needs
    "full": "retrieval",  # HR/NDCG@K, MRR over every item, the user's seen items filtered
    "sampled": "retrieval",  # the same against eval.num_negatives sampled unseen items
    "auc": "ranking",  # ROC AUC per task of the ranking head's logits
    "ne": "ranking",  # normalized entropy per task
}


@dataclass
class EvalConfig:
    metrics: list = _opt(
        [],
        "families to compute: full, sampled (retrieval), auc, ne (ranking); []: by model.task",
    )
    ks: list = _opt([1, 10, 50, 200], "cut-offs K of HR@K and NDCG@K")
    num_negatives: int = _opt(100, "sampled: unseen items the target competes with (SASRec)")
    max_users: int = _opt(0, "validation during training: the first N evaluation users (0: all)")
    test_max_users: int = _opt(0, "the final test and `hstu eval`: the first N users (0: all)")
    batch_size: int = _opt(128, "evaluation users per forward pass")
    early_stop_metric: str = _opt(
        "", "stop on this validation metric, e.g. full/ndcg@10 or auc/is_click ('': never)"
    )
    patience: int = _opt(3, "early stopping: evaluations without improvement before stopping")
    final_test: bool = _opt(
        True, "data.source=prepared: evaluate the test split at the end (eval_test.json)"
    )
    baselines: bool = _opt(True, "also report popularity and random baselines on the test split")

    def validate(self) -> None:
        p = "eval."
        _positive(self, p, "num_negatives", "batch_size", "patience")
        _positive(self, p, "max_users", "test_max_users", allow_zero=True)
        for name, choices in (("metrics", tuple(EVAL_FAMILIES)), ("ks", None)):
            value = getattr(self, name)
            _check(isinstance(value, list), p + name, value, "must be a list")
            for item in value:
                if choices:
                    _one_of(p + name, item, choices)
                else:
                    ok = isinstance(item, int) and not isinstance(item, bool) and item > 0
                    _check(ok, p + name, value, "must hold integers > 0")
        _check(bool(self.ks), p + "ks", self.ks, "must not be empty")

    def families(self, task: str) -> list[str]:
        """The metric families evaluated for a model of `task`."""
        return list(self.metrics) or [f for f, t in EVAL_FAMILIES.items() if t == task]

    def check_task(self, task: str) -> None:
        for family in self.families(task):
            need = EVAL_FAMILIES[family]
            _check(
                need == task,
                "eval.metrics",
                self.metrics,
                f"{family} needs a {need} model (model.task={task})",
            )
        metric = self.early_stop_metric
        if metric:
            family = metric.split("/")[0]
            _check(
                family in self.families(task),
                "eval.early_stop_metric",
                metric,
                f"must be <family>/<name> with a family of {self.families(task)}",
            )
            if family in ("full", "sampled"):
                names = [f"{m}@{k}" for m in ("hr", "ndcg") for k in self.ks] + ["mrr"]
                _check(
                    metric.split("/", 1)[1] in names,
                    "eval.early_stop_metric",
                    metric,
                    f"after '{family}/' must come one of {names}",
                )


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig, metadata={"doc": "the HSTU model"})
    data: DataConfig = field(default_factory=DataConfig, metadata={"doc": "the samples"})
    train: TrainConfig = field(default_factory=TrainConfig, metadata={"doc": "the optimisation"})
    dist: DistConfig = field(default_factory=DistConfig, metadata={"doc": "ranks and devices"})
    balance: BalanceConfig = field(
        default_factory=BalanceConfig, metadata={"doc": "the balanced shuffler"}
    )
    bench: BenchConfig = field(
        default_factory=BenchConfig, metadata={"doc": "measurements for hstu bench e2e"}
    )
    embedding: EmbeddingConfig = field(
        default_factory=EmbeddingConfig,
        metadata={"doc": "embedding tables: sharding and their optimizer"},
    )
    eval: EvalConfig = field(
        default_factory=EvalConfig, metadata={"doc": "offline evaluation (prepared data)"}
    )
    output_dir: str = _opt("runs/demo", "where config.yaml, metrics and checkpoints go")

    def validate(self) -> Config:
        subs = (self.model, self.data, self.train, self.dist, self.balance, self.bench, self.eval)
        subs += (self.embedding,)
        for sub in subs:
            sub.validate()
        self.eval.check_task(self.model.task)
        if self.data.source != "prepared":
            _check(
                not self.train.eval_every,
                "train.eval_every",
                self.train.eval_every,
                "evaluation needs held-out data: data.source=prepared",
            )
            _check(
                not self.eval.early_stop_metric,
                "eval.early_stop_metric",
                self.eval.early_stop_metric,
                "evaluation needs held-out data: data.source=prepared",
            )
        return self

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.to_dict(), sort_keys=False)

    def save(self, path: str | Path) -> None:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(self.to_yaml())


# ------------------------------------------------------------------------------ loading
def _coerce(value: Any, typ: Any, name: str) -> Any:
    args = getattr(typ, "__args__", None)
    if args and type(None) in args:  # `float | None`: null keeps the default meaning
        if value is None:
            return None
        typ = next(a for a in args if a is not type(None))
    if typ is float:
        if isinstance(value, str):  # YAML reads `1e-3` (no dot) as a string
            try:
                value = float(value.strip())
            except ValueError:
                raise HSTUError(f"config: {name} expects a number, got {value!r}") from None
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise HSTUError(f"config: {name} expects a number, got {value!r}")
        if not math.isfinite(value):
            raise HSTUError(f"config: {name}={value!r} is invalid: must be a finite number")
        return float(value)
    expected = {
        bool: "true/false",
        int: "an integer",
        str: "a string",
        dict: "a mapping",
        list: "a list",
    }
    if typ in expected:
        ok = isinstance(value, typ) and not (typ is int and isinstance(value, bool))
        if not ok:
            raise HSTUError(f"config: {name} expects {expected[typ]}, got {value!r}")
    return value


def _apply(obj: Any, data: dict, prefix: str = "") -> None:
    hints = get_type_hints(type(obj))
    names = {f.name for f in dataclasses.fields(obj)}
    for key, value in data.items():
        name = f"{prefix}{key}"
        if key not in names:
            raise HSTUError(f"config: unknown key '{name}' (known: {sorted(names)})")
        current = getattr(obj, key)
        if dataclasses.is_dataclass(current):
            if not isinstance(value, dict):
                raise HSTUError(f"config: '{name}' is a section, got {value!r}")
            _apply(current, value, name + ".")
        else:
            setattr(obj, key, _coerce(value, hints[key], name))


def parse_override(text: str) -> tuple[list[str], Any]:
    if "=" not in text:
        raise HSTUError(f"override {text!r} must look like key.sub=value")
    key, raw = text.split("=", 1)
    if not key:
        raise HSTUError(f"override {text!r} has an empty key")
    try:
        value = yaml.safe_load(raw) if raw != "" else ""
    except yaml.YAMLError as exc:
        raise HSTUError(f"override {text!r}: the value is not valid YAML ({exc})") from None
    return key.split("."), value


def _recipes():
    """The packaged recipes: the installed `hstu_recipes`, or `configs/` of a source tree that
    runs uninstalled (PYTHONPATH=.)."""
    try:
        return importlib.resources.files("hstu_recipes")
    except ModuleNotFoundError:
        return Path(__file__).resolve().parents[1] / "configs"


def recipe_names() -> list[str]:
    """Names of the packaged recipes (`--config NAME`)."""
    return sorted(p.name[: -len(".yaml")] for p in _recipes().iterdir() if p.name.endswith(".yaml"))


def resolve_recipe(spec: str | Path) -> Path:
    """A config file path, or the packaged recipe named `spec` (`demo`, `gpu`, ...)."""
    path = Path(spec)
    if path.is_file():
        return path
    name = str(spec)
    if "/" not in name and not name.endswith((".yaml", ".yml")):
        candidate = _recipes() / f"{name}.yaml"
        if candidate.is_file():
            return Path(str(candidate))
        raise HSTUError(f"no recipe named {name!r}; packaged recipes: {recipe_names()}")
    raise HSTUError(
        f"config file {name!r} does not exist (packaged recipes, usable by name from any "
        f"directory: {recipe_names()})"
    )


def read_recipe(spec: str | Path) -> dict:
    path = resolve_recipe(spec)
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as exc:
        raise HSTUError(f"config file {str(path)!r} is not valid YAML: {exc}") from None
    if not isinstance(data, dict):
        raise HSTUError(f"config file {str(path)!r} must hold a mapping at the top level")
    return data


def load_config(path: str | Path | None = None, overrides: list[str] | tuple = ()) -> Config:
    """Defaults <- YAML recipe (a path or a packaged recipe's name) <- overrides, validated."""
    cfg = Config()
    if path is not None:
        _apply(cfg, read_recipe(path))
    for text in overrides:
        parts, value = parse_override(text)
        nested: dict = value
        for part in reversed(parts):
            nested = {part: nested}
        _apply(cfg, nested)
    return cfg.validate()


def config_from_dict(data: dict) -> Config:
    cfg = Config()
    _apply(cfg, data)
    return cfg.validate()


def config_json(cfg: Config) -> str:
    return json.dumps(cfg.to_dict(), sort_keys=True)


# ------------------------------------------------------------------------------ describing
@dataclass(frozen=True)
class KeyInfo:
    key: str
    type: str
    default: Any
    value: Any
    doc: str


def _type_name(typ: Any) -> str:
    args = getattr(typ, "__args__", None)
    if args:
        return " | ".join("null" if a is type(None) else a.__name__ for a in args)
    return typ.__name__


def describe(cfg: Config | None = None) -> list[KeyInfo]:
    """Every leaf key of the tree: type, default, value in `cfg` (default: the defaults)."""
    cfg = cfg or Config()
    out: list[KeyInfo] = []

    def walk(obj: Any, default: Any, prefix: str) -> None:
        hints = get_type_hints(type(obj))
        for f in dataclasses.fields(obj):
            value, dflt = getattr(obj, f.name), getattr(default, f.name)
            if dataclasses.is_dataclass(value):
                walk(value, dflt, f"{prefix}{f.name}.")
            else:
                doc = f.metadata.get("doc", "")
                out.append(KeyInfo(prefix + f.name, _type_name(hints[f.name]), dflt, value, doc))

    walk(cfg, Config(), "")
    return out


def format_keys(cfg: Config | None = None) -> str:
    """The `hstu config show` table; a value that differs from its default is marked `*`."""
    rows = describe(cfg)

    def show(v: Any) -> str:
        return json.dumps(v) if isinstance(v, (dict, str)) or v is None else str(v)

    width = max(len(r.key) for r in rows)
    lines = [f"{'key':<{width}}  {'type':<12} {'value':<14} {'default':<14} description"]
    for r in rows:
        mark = "*" if r.value != r.default else " "
        lines.append(
            f"{r.key:<{width}}  {r.type:<12} {show(r.value):<13}{mark} "
            f"{show(r.default):<14} {r.doc}"
        )
    return "\n".join(lines)
