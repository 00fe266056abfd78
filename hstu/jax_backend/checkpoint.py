"""Orbax checkpoints of a JAX training run: `step-N` folders, keep-latest-k.

A checkpoint holds the train state (params, optimizer state, step counter, RNG key) and the
data state (the data position, JSON). Restoring needs an abstract state (shapes, dtypes,
shardings) to place the arrays back on the mesh.

`Checkpointer` stores any state pytree; `TrainCheckpointer` is this backend's
`hstu.trainer.Checkpointer`, bound to the live train state of a `JaxBackend`. Converting
checkpoints between backends is `convert.py`'s business.

Interrupted runs leave nothing that looks like a checkpoint: Orbax writes into a temporary
folder renamed when finished (leftovers are removed when a manager opens the directory), and
old steps are deleted by renaming them into `trash/` first, which process 0 empties on open and
close. The state is replicated and the data position a global sample count, so a checkpoint
restores on any number of devices (elastic resume); the RNG key is one replicated key. Sharded
embedding tables (`embedding.py`) are stored as trained, rows padded to a multiple of the
world size; a run of another `dist.world_size` reads them as stored and re-pads them
(`restore_regridded`), and `hstu convert --from jax --to jax SRC DST dist.world_size=W` does
the same offline.
"""

from __future__ import annotations

import contextlib
import dataclasses
import re
import shutil
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp
from etils import epath

from hstu.errors import HSTUError

_Metadata = ocp.path.step.Metadata
TRASH = "trash"


@dataclasses.dataclass(frozen=True)
class DashNameFormat(ocp.path.step.NameFormat):
    """`step-N` folder names (Orbax's standard format joins prefix and step with '_')."""

    prefix: str = "step-"

    def build_name(self, step: int) -> str:
        return f"{self.prefix}{step}"

    def _parse(self, path: epath.Path) -> int | None:
        # Orbax writes into '<name>.orbax-checkpoint-tmp-*' and renames when finalised, so a
        # full match is a finished checkpoint.
        m = re.fullmatch(re.escape(self.prefix) + r"(0|[1-9]\d*)", path.name)
        return int(m.group(1)) if m and path.is_dir() else None

    def find_all(self, base_path) -> Iterator[_Metadata]:
        base = epath.Path(base_path)
        if not base.exists():
            return iter(())
        found = [(self._parse(p), p) for p in base.iterdir()]
        return iter(
            [
                _Metadata(step=s, path=p)
                for s, p in sorted(found, key=lambda x: x[0] or 0)
                if s is not None
            ]
        )

    def find_step(self, base_path, step: int) -> _Metadata:
        path = epath.Path(base_path) / self.build_name(step)
        if self._parse(path) != step:
            raise ValueError(f"no finished checkpoint for step {step} under {base_path}")
        return _Metadata(step=step, path=path)


class Checkpointer:
    """Save / restore `(state pytree, data state dict)` under `directory/step-N`."""

    def __init__(self, directory: str | Path, keep: int = 2):
        if keep < 1:
            raise HSTUError(f"checkpoint keep must be >= 1, got {keep}")
        self.directory = Path(directory).absolute()
        options = ocp.CheckpointManagerOptions(
            max_to_keep=keep,
            create=True,
            step_name_format=DashNameFormat(),
            cleanup_tmp_directories=True,  # what a save killed before its rename left
            todelete_subdir=TRASH,  # an atomic rename, never a half-deleted step-N
        )
        self.manager = ocp.CheckpointManager(self.directory, options=options)
        self.empty_trash()

    def empty_trash(self) -> None:
        """Delete what old steps were renamed into (process 0; the folder is shared)."""
        trash = self.directory / TRASH
        if jax.process_index() == 0 and trash.is_dir():
            for leftover in trash.iterdir():
                shutil.rmtree(leftover, ignore_errors=True)
            with contextlib.suppress(OSError):
                trash.rmdir()

    def latest_step(self) -> int | None:
        return self.manager.latest_step()

    def all_steps(self) -> list[int]:
        return list(self.manager.all_steps())

    def save(self, step: int, state: Any, data_state: dict) -> None:
        """Asynchronous past the device->host copy: training continues while files are written."""
        self.manager.save(
            step,
            args=ocp.args.Composite(
                state=ocp.args.StandardSave(state), data=ocp.args.JsonSave(data_state)
            ),
        )

    def restore(self, abstract_state: Any, step: int | None = None) -> tuple[Any, dict, int]:
        """`(state, data_state, step)` of `step` (default: latest), placed like the abstract."""
        step = self.latest_step() if step is None else step
        if step is None:
            raise HSTUError(f"no checkpoint to restore under {self.directory}")
        out = self.manager.restore(
            step,
            args=ocp.args.Composite(
                state=ocp.args.StandardRestore(abstract_state), data=ocp.args.JsonRestore()
            ),
        )
        return out["state"], dict(out["data"]), step

    def wait(self) -> None:
        self.manager.wait_until_finished()
        self.empty_trash()

    def close(self) -> None:
        self.manager.wait_until_finished()
        self.manager.close()
        self.empty_trash()


def abstract_like(state: Any) -> Any:
    """Shape/dtype/sharding skeleton of a state pytree, for `Checkpointer.restore`."""
    return jax.tree.map(ocp.utils.to_shape_dtype_struct, state)


def saved_table_shapes(folder: str | Path) -> dict[tuple[str, str], tuple[int, ...]]:
    """`{(field, table): shape}` of the sharded tables a `step-N` folder holds (none: {})."""
    meta = ocp.StandardCheckpointHandler().metadata(epath.Path(Path(folder) / "state"))
    tree = getattr(meta, "item_metadata", meta)
    tables = tree.get("tables") if hasattr(tree, "get") else None
    if not tables:
        return {}
    return {
        (field, name): tuple(leaf.shape)
        for field, by_name in tables.items()
        if hasattr(by_name, "items")
        for name, leaf in by_name.items()
    }


def _table_mismatches(folder: Path, abstract: dict) -> dict[tuple[str, str], tuple[int, ...]]:
    """`{(field, table): stored shape}` where the stored rows differ from this run's (the
    checkpoint was written at another `dist.world_size`, whose padding differs)."""
    tables = abstract.get("tables")
    if not tables:
        return {}
    return {
        key: shape
        for key, shape in saved_table_shapes(folder).items()
        if tuple(tables[key[0]][key[1]].shape) != shape
    }


def restore_regridded(ckpt: Checkpointer, abstract: dict, step: int, mismatched: dict):
    """Restore tables stored for another world size: read them replicated as stored, then
    cut or zero-pad their rows to this run's padding and place them as the abstract says.
    Exact: the rows past a table's real ones are zero (never touched) in both layouts."""
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    target = {key: abstract["tables"][key[0]][key[1]] for key in mismatched}
    as_stored = jax.tree.map(lambda x: x, abstract)
    for (field, name), shape in mismatched.items():
        want = target[(field, name)]
        mesh = want.sharding.mesh
        as_stored["tables"][field][name] = jax.ShapeDtypeStruct(
            shape, want.dtype, sharding=NamedSharding(mesh, P())
        )
    tree, data, step = ckpt.restore(as_stored, step)
    for (field, name), want in target.items():
        stored = np.asarray(tree["tables"][field][name].addressable_data(0))  # a whole copy
        rows = np.zeros(want.shape, stored.dtype)
        keep = min(len(stored), len(rows))
        rows[:keep] = stored[:keep]
        tree["tables"][field][name] = jax.make_array_from_callback(
            want.shape, want.sharding, lambda index, rows=rows: rows[index]
        )
    return tree, data, step


def complete_steps(root: str | Path) -> list[int]:
    return [m.step for m in DashNameFormat().find_all(root)]


class TrainCheckpointer:
    """`hstu.trainer.Checkpointer` of a live train state: `get_state()` returns the state
    pytree (a dict) to save, `set_state(tree)` installs a restored one."""

    def __init__(
        self,
        output_dir: str | Path,
        keep: int,
        get_state: Callable[[], Any],
        set_state: Callable[[Any], None],
    ):
        self.directory = (Path(output_dir) / "checkpoints").absolute()
        self.keep, self.get_state, self.set_state = keep, get_state, set_state
        self._ckpt: Checkpointer | None = None

    @property
    def _manager(self) -> Checkpointer:
        if self._ckpt is None:  # created on first use: a run that never saves makes no folder
            self._ckpt = Checkpointer(self.directory, self.keep)
        return self._ckpt

    def latest_step(self) -> int | None:
        steps = complete_steps(self.directory)
        return steps[-1] if steps else None

    def save(self, step: int, data_state: dict) -> Path:
        self._manager.save(step, self.get_state(), dict(data_state))
        return self.directory / f"step-{step}"

    def restore(self) -> tuple[int, dict] | None:
        latest = self.latest_step()
        if latest is None:
            return None
        abstract = abstract_like(self.get_state())
        mismatched = _table_mismatches(self.directory / f"step-{latest}", abstract)
        if mismatched:  # saved at another dist.world_size: the tables' padding differs
            tree, data, step = restore_regridded(self._manager, abstract, latest, mismatched)
        else:
            tree, data, step = self._manager.restore(abstract, latest)
        self.set_state(tree)
        return step, data

    def close(self) -> None:
        if self._ckpt is None:
            return
        if sys.exc_info()[0] is not None and jax.process_count() > 1:
            # The run is failing (a process died, say): a pending save waits at a barrier for
            # every process, maybe forever. Leave it unfinished; its temporary folder is swept
            # when the folder is next opened, and the failure reaches the launcher now.
            return
        self._ckpt.close()
