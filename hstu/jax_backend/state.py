"""The JAX backend's training state: `TrainState` (params, optimizer state, step, RNG key, and
with `embedding.sharding` != none the sharded tables) and the optimizer.

Kept apart from `train_step.py` (which runs steps) and `checkpoint.py` / `convert.py` (which
store and convert this state), so that none of those import each other in a circle.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from hstu.config import TrainConfig
from hstu.errors import HSTUError


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class TrainState:
    params: Any
    opt_state: Any
    step: jax.Array  # int32 scalar: optimizer steps taken
    rng: jax.Array  # uint32 [2]: base key; dropout uses fold_in(rng, step, rank)
    # Sharded tables (embedding.py's `device_tables` tree: weights, their optimizer's state and
    # count), rows over the mesh; None when the tables are dense params (embedding.sharding=none)
    tables: Any = None
    # The HSTU layers' linear kernels in the compute dtype (`model.weight_copies`), written by
    # each step's update for the next step's forward; None: the forward casts them. Derived
    # from `params`: not checkpointed (`with_copies` makes them again after a restore)
    copies: Any = None

    def as_dict(self) -> dict:
        out = {
            "params": self.params,
            "opt_state": self.opt_state,
            "step": self.step,
            "rng": self.rng,
        }
        if self.tables is not None:
            out["tables"] = self.tables
        return out

    @classmethod
    def from_dict(cls, d: dict) -> TrainState:
        return cls(d["params"], d["opt_state"], d["step"], d["rng"], d.get("tables"))


def copies_wanted(model_dtype: str) -> bool:
    """Whether a run keeps `TrainState.copies`: a reduced-precision model, unless
    `HSTU_JAX_WEIGHT_COPIES=0` in the environment (the forward then casts the fp32 kernels
    itself, as before 2026-12-05). Measured on an H200 together with the Mosaic forward's
    rows mode and its work table from one kernel: 1.018x / 1.016x over the same bench_upstream
    steps in two calls (docs/BENCHMARKS.md, "jax: the forward at its rows"); the same losses
    bit for bit either way."""
    flag = os.environ.get("HSTU_JAX_WEIGHT_COPIES", "1")
    if flag not in ("0", "1"):
        raise HSTUError(f"HSTU_JAX_WEIGHT_COPIES: expected 0 or 1, got {flag!r}")
    return flag == "1" and model_dtype != "float32"


def with_copies(state: TrainState, dtype) -> TrainState:
    """`state` with its weight copies in `dtype` made from its params (replicated as they are)."""
    from hstu.jax_backend.model import weight_copies

    copies = jax.jit(weight_copies, static_argnums=1)(state.params, jnp.dtype(dtype))
    return dataclasses.replace(state, copies=copies)


@jax.jit
def copy_state(state):
    """A copy of every array of `state` (same shardings), in one program: something to donate
    that leaves `state` alone (eager copies would compile one program per shape)."""
    return jax.tree.map(jnp.copy, state)


def make_optimizer(tc: TrainConfig) -> optax.GradientTransformation:
    """AdamW on every parameter, decoupled weight decay (== torch.optim.AdamW)."""
    return optax.adamw(tc.lr, b1=tc.beta1, b2=tc.beta2, eps=tc.eps, weight_decay=tc.weight_decay)


def init_state(
    params: dict[str, np.ndarray],
    optimizer: optax.GradientTransformation,
    mesh: Mesh,
    seed: int = 0,
) -> TrainState:
    """Replicated state from core-layout params (`hstu.params.init_params`)."""
    from hstu.jax_backend.model import params_to_flax

    tree = params_to_flax(params)
    state = TrainState(
        tree, optimizer.init(tree), jnp.zeros((), jnp.int32), jax.random.PRNGKey(seed)
    )
    return jax.device_put(state, NamedSharding(mesh, P()))


def dense_params(params: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Core-named params without the embedding tables (sharded: held apart, `tables`)."""
    return {k: v for k, v in params.items() if not k.startswith("embedding.")}


def init_sharded_state(
    params: dict[str, np.ndarray],
    optimizer: optax.GradientTransformation,
    setup,
    mesh: Mesh,
    seed: int = 0,
    table_rows=None,
) -> TrainState:
    """Sharded tables (`setup`: an `embedding.EmbeddingSetup`) over `mesh`'s rows, their
    optimizer state zero; the dense params and their AdamW state replicated. The tables come
    from `params` when it holds them, else from `table_rows(name, start, stop)`, asked for
    each device's rows only (`hstu.params.init_table_rows`: no whole table on the host)."""
    from hstu.jax_backend.collectives import DATA_AXIS
    from hstu.jax_backend.embedding import device_tables
    from hstu.jax_backend.model import params_to_flax

    tree = params_to_flax(dense_params(params))
    state = TrainState(
        tree, optimizer.init(tree), jnp.zeros((), jnp.int32), jax.random.PRNGKey(seed)
    )
    state = jax.device_put(state, NamedSharding(mesh, P()))

    def rows_of(name: str, start: int, stop: int) -> np.ndarray:
        whole = params.get(f"embedding.{name}")
        if whole is not None:
            return np.asarray(whole[start:stop], np.float32)
        if table_rows is None:
            raise HSTUError(f"init_sharded_state: no embedding.{name} and no table_rows")
        return table_rows(name, start, stop)

    tables = device_tables(setup, mesh, DATA_AXIS, rows_of)
    return dataclasses.replace(state, tables=tables)
