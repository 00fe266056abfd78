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

Sharded tables (`embedding.sharding` != none, sharding.py) change what the DCP shards hold,
not the folder: `model` (every parameter by torch name; a sharded table is a ShardedTensor, each
rank writing its rows), `optim` (AdamW of the dense parameters: `<name>.exp_avg`,
`<name>.exp_avg_sq`, `step`) and `tables_opt` (the tables' optimizer by core name:
`embedding.<table>.sum`, or `.m` and `.v` for adam, and `count`, the steps taken). DCP reads
any sharding into any other and any world size into any other, so elastic resume holds for
them too. `checkpoint_layout` tells the two layouts apart.

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


def _newest(root, rank: int, sharded: bool) -> tuple[int, Path, Path, bool] | None:
    """`(step, folder, extra file, own)` of the newest complete checkpoint (rank 0 sweeps
    unfinished ones first), its layout checked; `own` is False when the checkpoint has no
    extra file for `rank` (saved by fewer ranks) and rank 0's is read instead."""
    if rank == 0:
        sweep(root)
    step = latest_step(root)
    if step is None:
        return None
    path = step_dir(Path(root), step)
    check_layout(path, sharded=sharded)
    extra_path = path / f"extra-rank{rank}.pt"
    own = extra_path.is_file()
    if not own:
        extra_path = path / "extra-rank0.pt"
        if not extra_path.is_file():
            raise HSTUError(f"checkpoint {path} has no extra-rank0.pt (data position)")
    return step, path, extra_path, own


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
    found = _newest(root, rank, sharded=False)
    if found is None:
        return None
    step, path, extra_path, own = found
    model_state, optim_state = get_state_dict(model, optimizer)
    state = {"model": model_state, "optim": optim_state}
    dcp.load(state, checkpoint_id=path, process_group=group)
    set_state_dict(
        model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"]
    )
    return step, torch.load(extra_path, weights_only=True), own


SHARDED_KEY = "tables_opt"  # a top-level key only checkpoints of sharded tables have


def checkpoint_layout(path: Path) -> str:
    """`"sharded"` (embedding.sharding != none) or `"replicated"`, from the DCP metadata."""
    keys = dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata
    return "sharded" if any(k.startswith(SHARDED_KEY + ".") for k in keys) else "replicated"


def check_layout(path: Path, sharded: bool) -> None:
    layout = checkpoint_layout(path)
    if (layout == "sharded") != sharded:
        raise HSTUError(
            f"checkpoint {path} holds {'sharded' if layout == 'sharded' else 'replicated'} "
            f"embedding tables, the config has embedding.sharding="
            f"{'none' if not sharded else 'a sharding'}: resume with the sharding it was "
            "written with (`hstu convert` reads either)"
        )


def adam_entries(named: dict[str, torch.Tensor], optimizer) -> dict[str, torch.Tensor]:
    """AdamW state of `named` parameters as flat `<name>.exp_avg` / `.exp_avg_sq` / `step`
    tensors for DCP (zeros where no step was taken yet); `set_adam_entries` puts them back."""
    out, step = {}, 0.0
    for name, p in named.items():
        state = optimizer.state.get(p, {})
        out[f"{name}.exp_avg"] = state.get("exp_avg", torch.zeros_like(p))
        out[f"{name}.exp_avg_sq"] = state.get("exp_avg_sq", torch.zeros_like(p))
        step = float(state["step"]) if "step" in state else step
    out["step"] = torch.tensor([step], dtype=torch.float32)
    return out


def set_adam_entries(named: dict[str, torch.Tensor], optimizer, entries: dict) -> None:
    step = float(entries["step"][0])
    for name, p in named.items():
        old = optimizer.state.get(p, {}).get("step")
        device = old.device if isinstance(old, torch.Tensor) else torch.device("cpu")
        if device.type == "cpu" and p.is_cuda and optimizer.defaults.get("fused"):
            device = p.device
        optimizer.state[p] = {
            "step": torch.tensor(step, dtype=torch.float32, device=device),
            "exp_avg": entries[f"{name}.exp_avg"].to(p.device).clone(),
            "exp_avg_sq": entries[f"{name}.exp_avg_sq"].to(p.device).clone(),
        }


def _sharded_state(model, optimizer, tables) -> dict:
    weights, table_opt = tables.checkpoint_state()
    # dense parameters keep their torch names (only the tables are renamed in core names)
    model_state = {n: p.detach() for n, p in tables.dense.items()} | weights
    count = torch.tensor([tables.count], dtype=torch.int64)
    return {
        "model": model_state,
        "optim": adam_entries(tables.dense, optimizer),
        SHARDED_KEY: table_opt | {"count": count},
    }


def save_sharded(root, step, model, optimizer, tables, extra, rank, keep, group=None) -> Path:
    """`save` for sharded tables (collective)."""
    path = step_dir(Path(root), step)
    if rank == 0 and path.exists():
        discard(root, path)
    dist.barrier(group=group)
    dcp.save(_sharded_state(model, optimizer, tables), checkpoint_id=path, process_group=group)
    torch.save(extra, path / f"extra-rank{rank}.pt")
    dist.barrier(group=group)
    if rank == 0:
        (path / MARKER).write_text(f"{step}\n")
        for old in complete_steps(root)[:-keep]:
            discard(root, step_dir(Path(root), old))
        sweep(root, keep_step=step)
    return path


def load_sharded(root, model, optimizer, tables, rank, group=None):
    """`load` for sharded tables (collective): DCP writes straight into the live shards."""
    found = _newest(root, rank, sharded=True)
    if found is None:
        return None
    step, path, extra_path, own = found
    state = _sharded_state(model, optimizer, tables)
    dcp.load(state, checkpoint_id=path, process_group=group)
    with torch.no_grad():
        live = dict(model.named_parameters())
        for name, value in state["model"].items():
            if name in tables.dense:  # DCP may have replaced a plain tensor: copy it in
                live[name].copy_(value)
    set_adam_entries(tables.dense, optimizer, state["optim"])
    if tables.kind == "replicated":
        for name, value in tables.checkpoint_state()[1].items():
            value.copy_(state[SHARDED_KEY][name])
        for name, p in tables.tables.items():
            with torch.no_grad():
                p.copy_(state["model"][_torch_table(name)])
    tables.after_load(int(state[SHARDED_KEY]["count"][0]))
    return step, torch.load(extra_path, weights_only=True), own


def _torch_table(core: str) -> str:
    return "embedding.embeddings." + core.removeprefix("embedding.") + ".weight"


class TrainCheckpointer:
    """`hstu.trainer.Checkpointer` over `save` / `load`: model, optimizer, this rank's RNG
    streams and the data position, under `<output_dir>/checkpoints/step-N`."""

    def __init__(
        self, output_dir, model, optimizer, rank: int, keep: int, device, group=None, tables=None
    ):
        self.directory = checkpoint_root(output_dir)
        self.model, self.optimizer, self.rank, self.keep = model, optimizer, rank, keep
        self.device, self.group = torch.device(device), group
        self.tables = tables  # sharding.py's handler, None for embedding.sharding=none

    def latest_step(self) -> int | None:
        return latest_step(self.directory)

    def save(self, step: int, data_state: dict) -> Path:
        extra = {
            "step": step,
            "data": dict(data_state),
            "rng": rng_state(self.device),
            "world_size": dist.get_world_size(self.group),
        }
        if self.tables is not None:
            return save_sharded(
                self.directory,
                step,
                self.model,
                self.optimizer,
                self.tables,
                extra,
                self.rank,
                self.keep,
                self.group,
            )
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
        if self.tables is not None:
            restored = load_sharded(
                self.directory, self.model, self.optimizer, self.tables, self.rank, self.group
            )
        else:
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
