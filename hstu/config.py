"""One config tree: dataclasses that validate themselves, YAML recipes, `key.sub=value` overrides.

An unknown key (in a YAML file or an override) is an error naming the key, so a typo never
silently falls back to a default.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, get_type_hints

import yaml

from hstu.errors import HSTUError


def _check(cond: bool, name: str, value: Any, why: str) -> None:
    if not cond:
        raise HSTUError(f"config: {name}={value!r} is invalid: {why}")


def _one_of(name: str, value: Any, choices: tuple) -> None:
    _check(value in choices, name, value, f"must be one of {list(choices)}")


@dataclass
class ModelConfig:
    embedding_dim: int = 64
    num_layers: int = 2
    num_heads: int = 2
    attention_dim: int = 32  # Dqk per head
    linear_dim: int = 32  # Dv per head
    alpha: float | None = None  # None -> 1 / sqrt(attention_dim)
    # Fixed attention normaliser N; never the batch's max length, which a shuffle changes.
    normalizer: float = 128.0
    dropout: float = 0.0
    num_items: int = 2000
    num_actions: int = 8
    num_contextual_ids: int = 100
    rab_position_buckets: int = 0  # 0 disables the relative position bias
    rab_time_buckets: int = 0  # 0 disables the relative time bias
    # reference (padded dense) | kernel = the backend's fused kernel: triton (torch) or
    # pallas (jax); naming the other backend's kernel is an error when the model is built.
    attention: str = "reference"
    task: str = "ranking"  # ranking | retrieval
    num_tasks: int = 2  # ranking: tasks encoded as label bits
    num_negatives: int = 16  # retrieval: sampled negatives per target
    retrieval_temperature: float = 0.05
    dtype: str = "float32"  # float32 | bfloat16 | float16 (compute dtype of the HSTU stack)

    def validate(self) -> None:
        p = "model."
        for name in (
            "embedding_dim",
            "num_layers",
            "num_heads",
            "attention_dim",
            "linear_dim",
            "num_items",
            "num_actions",
            "num_contextual_ids",
            "num_tasks",
        ):
            _check(getattr(self, name) > 0, p + name, getattr(self, name), "must be > 0")
        _check(self.normalizer > 0, p + "normalizer", self.normalizer, "must be > 0")
        _check(0.0 <= self.dropout < 1.0, p + "dropout", self.dropout, "must be in [0, 1)")
        _check(
            self.rab_position_buckets >= 0,
            p + "rab_position_buckets",
            self.rab_position_buckets,
            "must be >= 0",
        )
        _check(
            self.rab_time_buckets >= 0,
            p + "rab_time_buckets",
            self.rab_time_buckets,
            "must be >= 0",
        )
        _check(self.num_negatives > 0, p + "num_negatives", self.num_negatives, "must be > 0")
        _one_of(p + "attention", self.attention, ("reference", "kernel", "triton", "pallas"))
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
    source: str = "synthetic"
    seed: int = 0
    batch_size: int = 8  # per rank, padded
    num_samples: int = 0  # samples per epoch; 0 = endless. The last global batch may be
    # incomplete: it is padded per the batch spec (trailing ranks may hold no real sample).
    seqlen_dist: str = "lognormal"  # uniform | normal | lognormal | zipf | pareto | fixed
    seqlen_params: dict = field(default_factory=dict)  # e.g. {sigma: 1.5}
    min_history: int = 1
    max_history: int = 64  # item (+ action) events per sample
    num_contextual: int = 2  # contextual tokens per sample
    min_candidates: int = 1
    max_candidates: int = 4
    time_step: int = 60  # mean seconds between events (synthetic timestamps)
    prefetch: int = 2  # batches read + validated ahead on a host thread (0: inline)

    def validate(self) -> None:
        p = "data."
        _one_of(p + "source", self.source, ("synthetic",))
        _check(self.batch_size > 0, p + "batch_size", self.batch_size, "must be > 0")
        _check(self.num_samples >= 0, p + "num_samples", self.num_samples, "must be >= 0")
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
        _check(self.num_contextual >= 0, p + "num_contextual", self.num_contextual, "must be >= 0")
        _check(self.prefetch >= 0, p + "prefetch", self.prefetch, "must be >= 0")
        from hstu.data.distributions import DISTRIBUTIONS

        _one_of(p + "seqlen_dist", self.seqlen_dist, tuple(DISTRIBUTIONS))

    @property
    def max_seqlen(self) -> int:
        return self.num_contextual + 2 * self.max_history + self.max_candidates


@dataclass
class TrainConfig:
    steps: int = 20
    lr: float = 1e-3
    weight_decay: float = 0.01
    beta1: float = 0.9
    beta2: float = 0.98
    eps: float = 1e-8
    seed: int = 0  # parameter initialisation
    log_every: int = 1
    checkpoint_every: int = 0  # 0 disables
    keep_checkpoints: int = 2
    resume: bool = False
    peak_tflops: float = 0.0  # for MFU; 0 -> detected from the device (CPU: MFU not reported)

    def validate(self) -> None:
        p = "train."
        _check(self.steps > 0, p + "steps", self.steps, "must be > 0")
        _check(self.lr > 0, p + "lr", self.lr, "must be > 0")
        _check(self.log_every > 0, p + "log_every", self.log_every, "must be > 0")
        _check(
            self.checkpoint_every >= 0,
            p + "checkpoint_every",
            self.checkpoint_every,
            "must be >= 0",
        )
        _check(
            self.keep_checkpoints > 0, p + "keep_checkpoints", self.keep_checkpoints, "must be > 0"
        )


@dataclass
class DistConfig:
    world_size: int = 1  # data-parallel ranks; on CPU simulated (gloo processes / host devices)
    device: str = "auto"  # auto | cpu | cuda | gpu
    master_port: int = 0  # 0 -> a free port (torch, spawned ranks)

    def validate(self) -> None:
        _check(self.world_size > 0, "dist.world_size", self.world_size, "must be > 0")
        _one_of("dist.device", self.device, ("auto", "cpu", "cuda", "gpu"))


@dataclass
class BalanceConfig:
    shuffler: str = "balanced"  # identity | balanced
    exchange: str = "allgather"  # allgather | all2all
    method: str = "auto"  # partition method: auto | kk | greedy
    overlap: bool = True  # partition on a worker thread while the device runs the step

    def validate(self) -> None:
        _one_of("balance.shuffler", self.shuffler, ("identity", "balanced"))
        _one_of("balance.exchange", self.exchange, ("allgather", "all2all"))
        _one_of("balance.method", self.method, ("auto", "kk", "greedy"))


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    dist: DistConfig = field(default_factory=DistConfig)
    balance: BalanceConfig = field(default_factory=BalanceConfig)
    output_dir: str = "runs/demo"

    def validate(self) -> Config:
        for sub in (self.model, self.data, self.train, self.dist, self.balance):
            sub.validate()
        return self

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.to_dict(), sort_keys=False)

    def save(self, path: str | Path) -> None:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(self.to_yaml())


def _coerce(value: Any, typ: Any, name: str) -> Any:
    origin = getattr(typ, "__args__", None)
    if typ is float or (origin and float in origin and value is not None):
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise HSTUError(f"config: {name} expects a number, got {value!r}")
        return float(value)
    if typ is bool:
        if not isinstance(value, bool):
            raise HSTUError(f"config: {name} expects true/false, got {value!r}")
        return value
    if typ is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise HSTUError(f"config: {name} expects an integer, got {value!r}")
        return value
    if typ is str:
        if not isinstance(value, str):
            raise HSTUError(f"config: {name} expects a string, got {value!r}")
        return value
    if typ is dict:
        if not isinstance(value, dict):
            raise HSTUError(f"config: {name} expects a mapping, got {value!r}")
        return value
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
    return key.split("."), yaml.safe_load(raw) if raw != "" else ""


def load_config(path: str | Path | None = None, overrides: list[str] | tuple = ()) -> Config:
    """Defaults <- YAML recipe <- overrides, then validate."""
    cfg = Config()
    if path is not None:
        p = Path(path)
        if not p.is_file():
            raise HSTUError(f"config file {str(p)!r} does not exist")
        data = yaml.safe_load(p.read_text()) or {}
        if not isinstance(data, dict):
            raise HSTUError(f"config file {str(p)!r} must hold a mapping at the top level")
        _apply(cfg, data)
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
