"""Checkpoints through torch.distributed.checkpoint: `<output_dir>/checkpoints/step-N`.

Each folder holds the DCP shards of model + optimizer (replicated over the data-parallel ranks,
so DCP's planner writes one copy), one `extra-rank<r>.pt` per rank (data-iterator state and
RNG states: those differ per rank) and a `COMPLETE` marker written last, after a barrier: a run
killed mid-save leaves a folder without the marker, which `latest_step` ignores. Rank 0 keeps
the newest `keep` complete folders and deletes the rest.

`TrainCheckpointer` is this backend's `hstu.trainer.Checkpointer`. Converting checkpoints
between backends is `convert.py`'s business.
"""

from __future__ import annotations

import re
import shutil
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from hstu.errors import HSTUError
from hstu.torch_backend.state import rng_state, set_rng_state

_STEP_DIR = re.compile(r"^step-(\d+)$")
MARKER = "COMPLETE"


def checkpoint_root(output_dir: str | Path) -> Path:
    return Path(output_dir) / "checkpoints"


def step_dir(root: Path, step: int) -> Path:
    return Path(root) / f"step-{step}"


def complete_steps(root: str | Path) -> list[int]:
    root = Path(root)
    if not root.is_dir():
        return []
    steps = []
    for child in root.iterdir():
        match = _STEP_DIR.match(child.name)
        if match and (child / MARKER).is_file():
            steps.append(int(match.group(1)))
    return sorted(steps)


def latest_step(root: str | Path) -> int | None:
    steps = complete_steps(root)
    return steps[-1] if steps else None


def save(
    root: str | Path,
    step: int,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    extra: dict[str, Any],
    rank: int,
    keep: int,
    group=None,
) -> Path:
    """Collective (every rank calls it at the same step): write checkpoint `step-<step>`."""
    path = step_dir(Path(root), step)
    model_state, optim_state = get_state_dict(model, optimizer)
    dcp.save({"model": model_state, "optim": optim_state}, checkpoint_id=path, process_group=group)
    torch.save(extra, path / f"extra-rank{rank}.pt")
    dist.barrier(group=group)
    if rank == 0:
        (path / MARKER).write_text(f"{step}\n")
        for old in complete_steps(root)[:-keep]:
            shutil.rmtree(step_dir(Path(root), old), ignore_errors=True)
    return path


def load(
    root: str | Path,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    rank: int,
    group=None,
) -> tuple[int, dict[str, Any]] | None:
    """Collective: restore the newest complete checkpoint; (step, this rank's extra) or None."""
    step = latest_step(root)
    if step is None:
        return None
    path = step_dir(Path(root), step)
    extra_path = path / f"extra-rank{rank}.pt"
    if not extra_path.is_file():
        raise HSTUError(
            f"checkpoint {path} has no state for rank {rank}: it was written by a "
            "run with a different dist.world_size"
        )
    model_state, optim_state = get_state_dict(model, optimizer)
    state = {"model": model_state, "optim": optim_state}
    dcp.load(state, checkpoint_id=path, process_group=group)
    set_state_dict(
        model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"]
    )
    return step, torch.load(extra_path, weights_only=True)


class TrainCheckpointer:
    """`hstu.trainer.Checkpointer` over `save` / `load`: model, optimizer, this rank's RNG
    streams and the data position, under `<output_dir>/checkpoints/step-N`."""

    def __init__(self, output_dir, model, optimizer, rank: int, keep: int, device, group=None):
        self.directory = checkpoint_root(output_dir)
        self.model, self.optimizer, self.rank, self.keep = model, optimizer, rank, keep
        self.device, self.group = torch.device(device), group

    def latest_step(self) -> int | None:
        return latest_step(self.directory)

    def save(self, step: int, data_state: dict) -> Path:
        extra = {"step": step, "data": dict(data_state), "rng": rng_state(self.device)}
        return save(
            self.directory,
            step,
            self.model,
            self.optimizer,
            extra,
            self.rank,
            self.keep,
            self.group,
        )

    def restore(self) -> tuple[int, dict] | None:
        restored = load(self.directory, self.model, self.optimizer, self.rank, self.group)
        if restored is None:
            return None
        step, extra = restored
        set_rng_state(extra["rng"], self.device)
        return step, dict(extra["data"])

    def close(self) -> None:
        pass  # DCP saves synchronously: nothing is pending
