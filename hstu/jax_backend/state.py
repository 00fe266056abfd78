"""The JAX backend's training state: `TrainState` (params, optimizer state, step, RNG key) and
the optimizer.

Kept apart from `train_step.py` (which runs steps) and `checkpoint.py` / `convert.py` (which
store and convert this state), so that none of those import each other in a circle.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from hstu.config import TrainConfig


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class TrainState:
    params: Any
    opt_state: Any
    step: jax.Array  # int32 scalar: optimizer steps taken
    rng: jax.Array  # uint32 [2]: base key; dropout uses fold_in(rng, step, rank)

    def as_dict(self) -> dict:
        return {
            "params": self.params,
            "opt_state": self.opt_state,
            "step": self.step,
            "rng": self.rng,
        }

    @classmethod
    def from_dict(cls, d: dict) -> TrainState:
        return cls(d["params"], d["opt_state"], d["step"], d["rng"])


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
