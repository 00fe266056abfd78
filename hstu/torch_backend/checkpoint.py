"""Checkpoints through torch.distributed.checkpoint: `<output_dir>/checkpoints/step-N`.

Each folder holds the DCP shards of model + optimizer (replicated over the data-parallel ranks,
so DCP's planner writes one copy), one `extra-rank<r>.pt` per rank (data position, step and RNG
states: the RNG differs per rank) and a `COMPLETE` marker written last, after a barrier: a run
killed mid-save leaves a folder without the marker, which `latest_step` ignores. Rank 0 keeps
the newest `keep` complete folders; a folder is deleted by renaming it into `trash/` first, so
a kill mid-deletion leaves nothing that looks like a checkpoint, and rank 0 sweeps `trash/` and
unfinished folders at every save and restore.

Elastic resume: the data position is a global sample count (the same in every rank's extra),
the model and optimizer are replicated, so a checkpoint of W ranks loads on any world size. A
rank that has no `extra-rank<r>.pt` (more ranks than saved) keeps the RNG it was seeded with
(`state.rank_seed`); with fewer ranks, ranks beyond the new world's are not read.

`TrainCheckpointer` is this backend's `hstu.trainer.Checkpointer`. Converting checkpoints
between backends is `convert.py`'s business.
"""

from __future__ import annotations

import contextlib
import re
import shutil
import uuid
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
TRASH = "trash"


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


def empty_trash(root: str | Path) -> None:
    trash = Path(root) / TRASH
    if trash.is_dir():
        for leftover in trash.iterdir():
            shutil.rmtree(leftover, ignore_errors=True)
        with contextlib.suppress(OSError):
            trash.rmdir()


def discard(root: str | Path, folder: Path) -> None:
    """Delete a checkpoint folder: an atomic rename into `trash/` first, so an interrupted
    deletion never leaves a half-deleted `step-N`; then empty `trash/`."""
    trash = Path(root) / TRASH
    trash.mkdir(exist_ok=True)
    if folder.exists():
        folder.rename(trash / f"{folder.name}-{uuid.uuid4().hex[:8]}")
    empty_trash(root)


def sweep(root: str | Path, keep_step: int | None = None) -> None:
    """Rank 0: remove what interrupted runs left: `trash/` contents and `step-N` folders that
    never got their marker (except `keep_step`, the one being written)."""
    root = Path(root)
    if not root.is_dir():
        return
    for child in root.iterdir():
        match = _STEP_DIR.match(child.name)
        if match and int(match.group(1)) != keep_step and not (child / MARKER).is_file():
            discard(root, child)
    empty_trash(root)


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
    if rank == 0 and path.exists():  # a killed save (or another run) left files there
        discard(root, path)
    dist.barrier(group=group)
    model_state, optim_state = get_state_dict(model, optimizer)
    dcp.save({"model": model_state, "optim": optim_state}, checkpoint_id=path, process_group=group)
    torch.save(extra, path / f"extra-rank{rank}.pt")
    dist.barrier(group=group)
    if rank == 0:
        (path / MARKER).write_text(f"{step}\n")
        for old in complete_steps(root)[:-keep]:
            discard(root, step_dir(Path(root), old))
        sweep(root, keep_step=step)
    return path


def saved_world_size(path: Path) -> int:
    return len(list(path.glob("extra-rank*.pt")))


def load(
    root: str | Path,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    rank: int,
    group=None,
) -> tuple[int, dict[str, Any], bool] | None:
    """Collective: restore the newest complete checkpoint; `(step, extra, own)` or None.

    `extra` is this rank's, or rank 0's when the checkpoint has none for this rank (it was
    saved by fewer ranks; `own` is False then: its RNG state is not this rank's)."""
    if rank == 0:
        sweep(root)
    step = latest_step(root)
    if step is None:
        return None
    path = step_dir(Path(root), step)
    extra_path = path / f"extra-rank{rank}.pt"
    own = extra_path.is_file()
    if not own:
        extra_path = path / "extra-rank0.pt"
        if not extra_path.is_file():
            raise HSTUError(f"checkpoint {path} has no extra-rank0.pt (data position)")
    model_state, optim_state = get_state_dict(model, optimizer)
    state = {"model": model_state, "optim": optim_state}
    dcp.load(state, checkpoint_id=path, process_group=group)
    set_state_dict(
        model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"]
    )
    return step, torch.load(extra_path, weights_only=True), own


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
        extra = {
            "step": step,
            "data": dict(data_state),
            "rng": rng_state(self.device),
            "world_size": dist.get_world_size(self.group),
        }
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
        step, extra, own = restored
        if own:
            set_rng_state(extra["rng"], self.device)
        world = dist.get_world_size(self.group)
        saved = saved_world_size(step_dir(self.directory, step))
        if self.rank == 0 and saved != world:
            print(
                f"checkpoint step-{step} was saved by {saved} ranks, resuming on {world}: the "
                "data continues at its global sample position; "
                + (
                    f"ranks {saved}-{world - 1} start from their seeded RNG"
                    if world > saved
                    else f"the RNG streams of ranks {world}-{saved - 1} are not used"
                ),
                flush=True,
            )
        return step, dict(extra["data"])

    def close(self) -> None:
        pass  # DCP saves synchronously: nothing is pending
