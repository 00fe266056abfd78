"""This backend's half of `hstu convert` (hstu/convert.py): an Orbax `step-N` folder or a Flax
params file (`*.msgpack`) to / from the core-named portable state, on one device.

With sharded tables (`embedding.sharding` != none) a checkpoint's tables are stored padded to a
multiple of the world size it was trained on (embedding.py): the portable state holds them
whole (`params`) with their optimizer's state (`tables`, cut to the real rows), and AdamW's
moments of the dense parameters only. A checkpoint written here is padded for the config's
`dist.world_size`, so `--from jax --to jax ... dist.world_size=W` re-pads one for W devices.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from hstu import convert as core
from hstu.errors import HSTUError
from hstu.jax_backend.checkpoint import (
    Checkpointer,
    abstract_like,
    complete_steps,
    saved_table_shapes,
)
from hstu.jax_backend.embedding import EmbeddingSetup, pad_rows
from hstu.jax_backend.state import TrainState, init_sharded_state, init_state, make_optimizer
from hstu.trainer import carried_data_state


def _fresh_state(cfg):
    """A replicated TrainState of `cfg` on one device: the restore target and the optimizer
    state's structure."""
    from hstu.jax_backend import collectives as col
    from hstu.params import init_params

    mesh = col.make_mesh(jax.devices()[:1])
    optimizer = make_optimizer(cfg.train)
    params, seed = init_params(cfg.model, cfg.train.seed), cfg.train.seed
    setup = _setup(cfg)
    if setup is None:
        return init_state(params, optimizer, mesh, seed)
    return init_sharded_state(params, optimizer, setup, mesh, seed)


def _setup(cfg) -> EmbeddingSetup | None:
    """The tables' layout of the run `cfg` describes (padded for its `dist.world_size`: what
    a checkpoint written here stores; one read is taken as it was stored)."""
    if not cfg.embedding.sharded:
        return None
    return EmbeddingSetup.from_config(cfg, cfg.dist.world_size)


def _read_tables(tables, setup: EmbeddingSetup) -> tuple[dict, core.TableOptState]:
    """`(core-named whole tables, their optimizer state)` from a restored tables tree."""
    host = jax.device_get(tables)  # rows padded for the source's world size: cut to the real
    params, state = {}, {"sum": {}, "m": {}, "v": {}}
    for lay in setup.layouts:
        name, rows = f"embedding.{lay.name}", lay.num_rows
        params[name] = np.array(host["weights"][lay.name][:rows])
        for f in setup.state_fields:
            state[f][name] = np.array(host[f][lay.name][:rows])
    count = int(host["count"])
    return params, core.TableOptState(setup.optimizer, count, **state)


def _write_tables(state: core.PortableState, setup: EmbeddingSetup, cfg) -> dict:
    """The tables tree of `state` (padded to `setup`'s rows), checked against the config."""
    tables = state.tables
    if tables is None:
        raise HSTUError(
            f"embedding.sharding={cfg.embedding.sharding}: {state.source or 'the source'} holds "
            "no sharded-table optimizer state (it was trained with embedding.sharding=none)"
        )
    if tables.optimizer != setup.optimizer:
        raise HSTUError(
            f"embedding.optimizer={setup.optimizer} but the source's tables were trained with "
            f"{tables.optimizer}"
        )
    tree: dict = {"weights": {}, "count": jnp.asarray(tables.count, jnp.int32)}
    for f in setup.state_fields:
        tree[f] = {}
    for lay in setup.layouts:
        name = f"embedding.{lay.name}"
        tree["weights"][lay.name] = pad_rows(state.params[name], lay)
        for f in setup.state_fields:
            held = getattr(tables, f)
            if name not in held:
                raise HSTUError(f"sharded-table state {f!r} of {state.source}: no {name}")
            tree[f][lay.name] = pad_rows(held[name], lay)
    return tree


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
    abstract = abstract_like(_fresh_state(cfg).as_dict())
    if "tables" in abstract:  # stored padded for the source run's world size: read as stored
        for (field, name), shape in saved_table_shapes(folder).items():
            leaf = abstract["tables"][field][name]
            abstract["tables"][field][name] = jax.ShapeDtypeStruct(
                shape, leaf.dtype, sharding=leaf.sharding
            )
    ckpt = Checkpointer(folder.parent)
    try:
        restored, data, _ = ckpt.restore(abstract, step)
    finally:
        ckpt.close()
    count, mu, nu = _adam_fields(restored["opt_state"])
    adam = core.AdamState(int(count), _host(mu), _host(nu))
    params, tables = _host(restored["params"]), None
    setup = _setup(cfg)
    if setup is not None:
        table_params, tables = _read_tables(restored["tables"], setup)
        params.update(table_params)
    return core.PortableState(
        step,
        params,
        adam,
        carried_data_state(data, str(folder)),
        str(folder),
        tables,
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
    fresh, setup = _fresh_state(cfg), _setup(cfg)
    if setup is None and state.tables is not None:
        raise HSTUError(
            "embedding.sharding=none but the source's tables are sharded, with their own "
            f"optimizer ({state.tables.optimizer}); set embedding.sharding (and "
            "embedding.optimizer) as the source run did"
        )
    dense = state.params
    tables = None
    if setup is not None:
        tables = _write_tables(state, setup, cfg)
        dense = {k: v for k, v in dense.items() if not k.startswith("embedding.")}
    opt_state = optax.tree_utils.tree_set(
        fresh.opt_state,
        count=jnp.asarray(state.adam.count, jnp.int32),
        mu=params_to_flax({k: state.adam.mu[k] for k in dense}),
        nu=params_to_flax({k: state.adam.nu[k] for k in dense}),
    )
    train_state = TrainState(
        params_to_flax(dense),
        opt_state,
        jnp.asarray(state.step, jnp.int32),
        fresh.rng,
        tables,
    )
    ckpt = Checkpointer(folder.parent, cfg.train.keep_checkpoints)
    try:
        ckpt.save(state.step, train_state.as_dict(), dict(state.data))
    finally:
        ckpt.close()
    return folder
