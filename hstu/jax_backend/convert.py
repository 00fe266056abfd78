"""This backend's half of `hstu convert` (hstu/convert.py): an Orbax `step-N` folder or a Flax
params file (`*.msgpack`) to / from the core-named portable state, on one device.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from hstu import convert as core
from hstu.errors import HSTUError
from hstu.jax_backend.checkpoint import Checkpointer, abstract_like, complete_steps
from hstu.jax_backend.state import TrainState, init_state, make_optimizer
from hstu.trainer import data_position, data_state


def _fresh_state(cfg):
    """A replicated TrainState of `cfg` on one device: the restore target and the optimizer
    state's structure."""
    from hstu.jax_backend import collectives as col
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
        data_state(data_position(data, str(folder))),
        str(folder),
    )


def write_portable(state: core.PortableState, path: Path, cfg) -> Path:
    """Write `state` as a Flax params file (`*.msgpack`) or as an Orbax `step-N` folder that
    `train.resume=true` picks up; the RNG key is the run's `PRNGKey(train.seed)`, as in a fresh
    run (the JAX backend derives every step's key from it and the step counter)."""
    import optax
    from flax import serialization

    from hstu.jax_backend.model import params_to_flax

    path = Path(path)
    if core.is_params_file(path):
        tree = jax.tree.map(np.asarray, params_to_flax(state.params))
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(serialization.msgpack_serialize({"params": tree}))
        return path
    folder = core.dest_step_dir(path, state.step)
    if folder.exists():
        raise HSTUError(f"{folder} exists already; refusing to overwrite a checkpoint")
    assert state.adam is not None and state.data is not None  # checked by hstu.convert
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
        ckpt.save(state.step, train_state.as_dict(), dict(state.data))
    finally:
        ckpt.close()
    return folder
