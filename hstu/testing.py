"""Helpers for tests and parity checks (numpy only): build global batches with chosen padding,
find out whether a GPU is there, block the frameworks to prove the core needs none, and load
the repository's scripts as modules."""

from __future__ import annotations

import importlib.abc
import importlib.util
import os
import shutil
import sys
from collections.abc import Sequence
from pathlib import Path

from hstu.batch import JaggedBatch, from_samples
from hstu.data import SampleSpec, make_sample

REPO_ROOT = Path(__file__).resolve().parents[1]
DEMO_CONFIG = REPO_ROOT / "configs" / "demo.yaml"

# Global batches every exchange test covers: (task, real samples per rank) at 6 per rank: full,
# incomplete, a rank with none, all padding, a single sample, uneven.
EXCHANGE_CASES = (
    ("ranking", (6, 6, 6, 6)),
    ("ranking", (6, 6, 6, 3)),
    ("retrieval", (6, 4, 0, 2)),
    ("ranking", (0, 0, 0, 0)),
    ("retrieval", (1, 0, 0, 0)),
    ("retrieval", (5, 6, 2, 6)),
)


def make_global_batch(
    cfg, batch_size: int, real_per_rank: Sequence[int], first_id: int = 0
) -> list[JaggedBatch]:
    """One batch per rank; rank r holds `real_per_rank[r]` real samples, the rest padding.

    `real_per_rank` of zeros gives an all-padding global batch; a single zero entry gives a rank
    with no real sample (what an incomplete last batch produces).
    """
    spec = SampleSpec.from_config(cfg)
    out, sid = [], first_id
    for n in real_per_rank:
        samples = [make_sample(spec, sid + i) for i in range(n)]
        sid += n
        out.append(from_samples(samples, batch_size, spec.jagged_keys))
    return out


# What "a framework" means for the core tier: importing any of these is an error there.
BACKEND_MODULES = (
    "torch",
    "torchrec",
    "fbgemm_gpu",
    "triton",
    "jax",
    "jaxlib",
    "flax",
    "optax",
    "orbax",
)


class _BackendBlocker(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in BACKEND_MODULES:
            raise ModuleNotFoundError(
                f"{name} is blocked: the core must import no framework (HSTU_BLOCK_BACKENDS)",
                name=name,
            )
        return None


def block_backends() -> None:
    """Make every framework import fail in this process (idempotent)."""
    loaded = [m for m in BACKEND_MODULES if m in sys.modules]
    if loaded:
        raise RuntimeError(f"cannot block frameworks that are already imported: {loaded}")
    if not any(isinstance(f, _BackendBlocker) for f in sys.meta_path):
        sys.meta_path.insert(0, _BackendBlocker())


def load_script(name: str):
    """`scripts/<name>.py` as a module (the scripts are not a package), for its tests."""
    spec = importlib.util.spec_from_file_location(name, REPO_ROOT / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def has_nvidia_gpu() -> bool:
    """An NVIDIA GPU is there (decided without importing a framework)."""
    return os.path.exists("/dev/nvidia0") or shutil.which("nvidia-smi") is not None


def prepared_overrides(path: str | Path, task: str = "retrieval", out: str | Path = "") -> list:
    """Overrides that train a tiny model on a generated prepared dataset (the tests' sample,
    `tests/conftest.py::prepared_data`): one layer, d = 32, histories of up to 30 events."""
    common = [
        "data.source=prepared",
        f"data.path={path}",
        "dist.world_size=1",
        "data.batch_size=32",
        "data.max_history=30",
        "model.num_layers=1",
        "model.embedding_dim=32",
        "model.num_items=300",
        "train.log_every=1000",
        "train.tensorboard=false",
        "eval.max_users=200",
    ] + ([f"output_dir={out}"] if out else [])
    if task == "retrieval":  # ml-1m: ratings as actions, no user features
        return common + [
            "model.task=retrieval",
            "model.num_actions=10",
            "model.num_negatives=32",
            "data.num_contextual=0",
            "train.lr=0.01",
            "eval.ks=[10]",
        ]
    return common + [  # kuairand-pure: flag bitmasks as actions, 8 user features
        "model.task=ranking",
        "model.num_tasks=2",
        "model.num_actions=256",
        "model.num_contextual_ids=64",
        "data.num_contextual=8",
        "data.max_candidates=4",
        "train.lr=0.003",
    ]
