"""Orbax checkpoints of a JAX training run: `step-N` folders, keep-latest-k.

A checkpoint holds the train state (params, optimizer state, step counter, RNG key) and the
data iterator state (the index of the next global batch, JSON). Restoring needs an abstract
state (shapes, dtypes, shardings) to place the arrays back on the mesh.

`read_portable` / `write_portable` are this backend's half of `hstu convert` (hstu/checkpoint.py):
an Orbax `step-N` folder or a Flax params file (`*.msgpack`) to / from the core-named portable
state, on one device.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from etils import epath

from hstu import checkpoint as core
from hstu.errors import HSTUError

_Metadata = ocp.path.step.Metadata


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
            max_to_keep=keep, create=True, step_name_format=DashNameFormat()
        )
        self.manager = ocp.CheckpointManager(self.directory, options=options)

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

    def close(self) -> None:
        self.manager.wait_until_finished()
        self.manager.close()


def abstract_like(state: Any) -> Any:
    """Shape/dtype/sharding skeleton of a state pytree, for `Checkpointer.restore`."""
    return jax.tree.map(ocp.utils.to_shape_dtype_struct, state)


# ------------------------------------------------------------------ portable state (convert)
def complete_steps(root: str | Path) -> list[int]:
    return [m.step for m in DashNameFormat().find_all(root)]


def _fresh_state(cfg):
    """A replicated TrainState of `cfg` on one device: the restore target and the optimizer
    state's structure."""
    from hstu.jax_backend import collectives as col
    from hstu.jax_backend.train_step import init_state, make_optimizer
    from hstu.params import init_params

    mesh = col.make_mesh(jax.devices()[:1])
    optimizer = make_optimizer(cfg.train)
    return init_state(init_params(cfg.model, cfg.train.seed), optimizer, mesh, cfg.train.seed)


def _host(tree) -> dict[str, np.ndarray]:
    from hstu.jax_backend.model import flax_to_params

    return {k: np.array(v) for k, v in flax_to_params(tree).items()}  # owned, writable


def _adam_fields(opt_state) -> tuple[Any, Any, Any]:
    import optax

    return tuple(optax.tree_utils.tree_get(opt_state, k) for k in ("count", "mu", "nu"))


def read_portable(path: Path, cfg) -> core.PortableState:
    """A Flax params file or an Orbax `step-N` folder (the newest finished one under a run or
    checkpoints directory) as a core-named portable state."""
    from flax import serialization

    path = Path(path)
    if core.is_params_file(path):
        if not path.is_file():
            raise HSTUError(f"checkpoint source {str(path)!r} does not exist")
        tree = serialization.msgpack_restore(path.read_bytes())
        return core.PortableState(0, _host(tree.get("params", tree)), source=str(path))
    folder = core.source_step_dir(path, complete_steps)
    step = core.step_of(folder)
    ckpt = Checkpointer(folder.parent)
    try:
        restored, data, _ = ckpt.restore(abstract_like(_fresh_state(cfg).as_dict()), step)
    finally:
        ckpt.close()
    count, mu, nu = _adam_fields(restored["opt_state"])
    adam = core.AdamState(int(count), _host(mu), _host(nu))
    return core.PortableState(
        step,
        _host(restored["params"]),
        adam,
        {"next_batch": int(data["next_batch"])},
        str(folder),
    )


def write_portable(state: core.PortableState, path: Path, cfg) -> Path:
    """Write `state` as a Flax params file (`*.msgpack`) or as an Orbax `step-N` folder that
    `train.resume=true` picks up; the RNG key is the run's `PRNGKey(train.seed)`, as in a fresh
    run (the JAX backend derives every step's key from it and the step counter)."""
    import optax
    from flax import serialization

    from hstu.jax_backend.model import params_to_flax
    from hstu.jax_backend.train_step import TrainState

    path = Path(path)
    if core.is_params_file(path):
        tree = jax.tree.map(np.asarray, params_to_flax(state.params))
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(serialization.msgpack_serialize({"params": tree}))
        return path
    folder = core.dest_step_dir(path, state.step)
    if folder.exists():
        raise HSTUError(f"{folder} exists already; refusing to overwrite a checkpoint")
    assert state.adam is not None and state.data is not None  # checked by hstu.checkpoint
    fresh = _fresh_state(cfg)
    opt_state = optax.tree_utils.tree_set(
        fresh.opt_state,
        count=jnp.asarray(state.adam.count, jnp.int32),
        mu=params_to_flax(state.adam.mu),
        nu=params_to_flax(state.adam.nu),
    )
    train_state = TrainState(
        params_to_flax(state.params), opt_state, jnp.asarray(state.step, jnp.int32), fresh.rng
    )
    ckpt = Checkpointer(folder.parent, cfg.train.keep_checkpoints)
    try:
        ckpt.save(state.step, train_state.as_dict(), {"next_batch": int(state.data["next_batch"])})
    finally:
        ckpt.close()
    return folder
