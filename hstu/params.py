"""Parameter layout and seeded initialisation, defined once for both backends.

Names are dotted paths; linear kernels are `[in, out]` (x @ kernel + bias). The torch backend
holds exactly these tensors (same names, same shapes) and the Flax model's flattened params map
to them one to one, so a checkpoint converts by renaming nothing.

Each tensor draws from its own generator seeded by `(seed, crc32(name))`: adding a parameter
never changes the values of the others.
"""

from __future__ import annotations

import zlib

import numpy as np


def param_shapes(model) -> dict[str, tuple[int, ...]]:
    d, h = model.embedding_dim, model.num_heads
    dqk, dv = model.attention_dim, model.linear_dim
    shapes: dict[str, tuple[int, ...]] = {
        "embedding.item": (model.num_items, d),
        "embedding.action": (model.num_actions, d),
        "embedding.contextual": (model.num_contextual_ids, d),
    }
    for i in range(model.num_layers):
        p = f"layers.{i}."
        shapes |= {
            p + "input_norm.scale": (d,),
            p + "input_norm.bias": (d,),
            p + "uvqk.kernel": (d, h * (2 * dv + 2 * dqk)),
            p + "uvqk.bias": (h * (2 * dv + 2 * dqk),),
            p + "attn_norm.scale": (h * dv,),
            p + "attn_norm.bias": (h * dv,),
            p + "output.kernel": (h * dv, d),
            p + "output.bias": (d,),
        }
        if model.rab_position_buckets:
            shapes[p + "rab_position"] = (h, model.rab_position_buckets)
        if model.rab_time_buckets:
            shapes[p + "rab_time"] = (h, model.rab_time_buckets)
    shapes |= {"final_norm.scale": (d,), "final_norm.bias": (d,)}
    if model.task == "ranking":
        shapes |= {
            "head.hidden.kernel": (d, d),
            "head.hidden.bias": (d,),
            "head.out.kernel": (d, model.num_tasks),
            "head.out.bias": (model.num_tasks,),
        }
    return shapes


def init_params(model, seed: int) -> dict[str, np.ndarray]:
    """fp32 numpy parameters, identical on every machine for the same (config, seed)."""
    out = {}
    for name, shape in param_shapes(model).items():
        rng = np.random.default_rng([seed, zlib.crc32(name.encode())])
        if name.startswith("embedding."):
            arr = rng.normal(0.0, 1.0 / np.sqrt(shape[1]), size=shape)
        elif name.endswith(".kernel"):
            limit = np.sqrt(6.0 / (shape[0] + shape[1]))  # Glorot uniform
            arr = rng.uniform(-limit, limit, size=shape)
        elif name.endswith(".scale"):
            arr = np.ones(shape)
        elif ".rab_" in name:
            arr = rng.normal(0.0, 0.02, size=shape)
        else:  # biases
            arr = np.zeros(shape)
        out[name] = arr.astype(np.float32)
    return out


def num_params(model) -> int:
    return int(sum(np.prod(s) for s in param_shapes(model).values()))
