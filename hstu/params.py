"""Parameter layout and seeded initialisation, defined once for both backends.

Names are dotted paths; linear kernels are `[in, out]` (x @ kernel + bias). The torch backend
holds exactly these tensors (same names, same shapes) and the Flax model's flattened params map
to them one to one, so a checkpoint converts by renaming nothing.

Each tensor draws from its own generator seeded by `(seed, crc32(name))`: adding a parameter
never changes the values of the others.
"""

from __future__ import annotations

import os
import zlib
from concurrent.futures import ThreadPoolExecutor

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


# An embedding table is initialised in blocks of this many rows, block b from its own seed, so
# a rank that holds rows [a, b) of a sharded table draws those rows alone (`init_table_rows`).
# Block 0's seed is the table's own, so a table of up to this many rows is one draw.
TABLE_INIT_BLOCK = 1 << 17


def _rng(seed: int, name: str, *extra: int) -> np.random.Generator:
    return np.random.default_rng([seed, zlib.crc32(name.encode()), *extra])


def init_table_rows(
    model, seed: int, name: str, start: int, stop: int, workers: int | None = None
) -> np.ndarray:
    """Rows [start, stop) of embedding table `name` as `init_params` gives them (fp32),
    drawing only the blocks of `TABLE_INIT_BLOCK` rows that hold them.

    Blocks have generators of their own, so they are drawn on `workers` threads (default:
    the machine's cores; numpy draws without the GIL): a 100M-row shard takes seconds, not
    minutes. The values do not depend on `workers`."""
    rows, dim = param_shapes(model)[name]
    if not (name.startswith("embedding.") and 0 <= start <= stop <= rows):
        raise ValueError(f"init_table_rows: {name} rows [{start}, {stop}) of {rows}")
    out = np.empty((stop - start, dim), np.float32)

    def draw(block: int) -> None:
        lo = block * TABLE_INIT_BLOCK
        hi = min(lo + TABLE_INIT_BLOCK, rows)
        rng = _rng(seed, name) if block == 0 else _rng(seed, name, block)
        arr = rng.normal(0.0, 1.0 / np.sqrt(dim), size=(hi - lo, dim))
        a, b = max(lo, start), min(hi, stop)
        out[a - start : b - start] = arr[a - lo : b - lo]

    blocks = range(start // TABLE_INIT_BLOCK, -(-stop // TABLE_INIT_BLOCK))
    workers = min(len(blocks), workers or os.cpu_count() or 1)
    if workers <= 1:
        for block in blocks:
            draw(block)
    else:
        with ThreadPoolExecutor(workers) as pool:
            for _ in pool.map(draw, blocks):  # re-raises a failed draw
                pass
    return out


def init_params(model, seed: int, tables: bool = True) -> dict[str, np.ndarray]:
    """fp32 numpy parameters, identical on every machine for the same (config, seed);
    `tables=False` leaves the embedding tables out (sharded tables draw their own rows)."""
    out = {}
    for name, shape in param_shapes(model).items():
        if name.startswith("embedding."):
            if tables:
                out[name] = init_table_rows(model, seed, name, 0, shape[0])
            continue
        rng = _rng(seed, name)
        if name.endswith(".kernel"):
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
