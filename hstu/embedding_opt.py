"""The optimizer of sharded embedding tables (`embedding.optimizer`), in numpy.

The reference both backends are tested against; docs/MODEL.md ("Sharded embedding tables and
their optimizer") defines it. Only the rows a step touches change: `apply` takes the step's
distinct ids and each one's gradient `g_r` (the gradient of the global loss with respect to
row r: the sum over every lookup of r on every rank; `row_gradients` sums per-lookup
gradients that way). Arithmetic in float32, like the kernels.

* `row_wise_adagrad`: `s_r += mean_d(g_r,d^2)`; `w_r -= lr * g_r / (sqrt(s_r) + eps)`.
* `adam` (fbgemm's `EmbOptimType.ADAM`): `t` counts optimizer steps (every step, touched or
  not, from 1); `m_r = b1 m_r + (1 - b1) g_r`, `v_r = b2 v_r + (1 - b2) g_r^2`,
  `w_r -= lr * ((m_r / (1 - b1^t)) / (sqrt(v_r / (1 - b2^t)) + eps) + weight_decay * w_r)`.
"""

from __future__ import annotations

import numpy as np

from hstu.errors import HSTUError

OPTIMIZERS = ("row_wise_adagrad", "adam")
# Batch keys whose values each table is read at: every value is a touched row (docs/MODEL.md).
TABLE_KEYS = {
    "item": ("item", "candidate", "negative"),
    "action": ("action",),
    "contextual": ("contextual",),
}


def touched_rows(batches) -> dict[str, np.ndarray]:
    """table -> the distinct rows (ascending, int64) that host batches (`JaggedBatch`es, every
    rank's) look up: the rows one step's update moves."""
    out = {}
    for name, keys in TABLE_KEYS.items():
        vals = [np.asarray(b.values[k]).reshape(-1) for b in batches for k in keys if k in b.values]
        out[name] = (
            np.unique(np.concatenate(vals)).astype(np.int64) if vals else np.zeros(0, np.int64)
        )
    return out


def init_state(optimizer: str, num_rows: int, dim: int) -> dict:
    """The state of a fresh table: zero accumulators, no step taken."""
    if optimizer == "row_wise_adagrad":
        return {"count": 0, "sum": np.zeros(num_rows, np.float32)}
    if optimizer == "adam":
        zeros = np.zeros((num_rows, dim), np.float32)
        return {"count": 0, "m": zeros, "v": zeros.copy()}
    raise HSTUError(f"embedding.optimizer: unknown {optimizer!r}; choose from {list(OPTIMIZERS)}")


def row_gradients(ids: np.ndarray, lookup_grads: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """`(distinct ids, g_r [len, D])` from every lookup's id and gradient (all ranks')."""
    ids = np.asarray(ids, np.int64).reshape(-1)
    lookup_grads = np.asarray(lookup_grads, np.float32)
    lookup_grads = lookup_grads.reshape(ids.size, lookup_grads.shape[-1])
    rows, inverse = np.unique(ids, return_inverse=True)
    g = np.zeros((rows.size, lookup_grads.shape[1]), np.float32)
    np.add.at(g, inverse, lookup_grads)
    return rows, g


def apply(
    optimizer: str, state: dict, table: np.ndarray, ids: np.ndarray, grads: np.ndarray, cfg
) -> tuple[np.ndarray, dict]:
    """One step: `(new table, new state)`; the inputs are not modified.

    `ids`: the step's touched rows, distinct; `grads[i]` is `g_r` of row `ids[i]`. `cfg` has
    `lr`, `eps`, `beta1`, `beta2`, `weight_decay` (`hstu.config.EmbeddingConfig`)."""
    ids = np.asarray(ids, np.int64).reshape(-1)
    table = np.array(table, np.float32)
    grads = np.asarray(grads, np.float32).reshape(ids.size, table.shape[1])
    if np.unique(ids).size != ids.size:
        raise HSTUError("embedding_opt.apply: ids must be distinct (see row_gradients)")
    if ids.size and (ids.min() < 0 or ids.max() >= table.shape[0]):
        raise HSTUError(f"embedding_opt.apply: ids outside the table's {table.shape[0]} rows")
    lr, eps = np.float32(cfg.lr), np.float32(cfg.eps)
    out = {k: (np.array(v) if isinstance(v, np.ndarray) else v) for k, v in state.items()}
    out["count"] = int(state["count"]) + 1
    w = table[ids]
    if optimizer == "row_wise_adagrad":
        s = out["sum"][ids] + (grads * grads).mean(axis=1, dtype=np.float32)
        out["sum"][ids] = s
        table[ids] = w - grads * (lr / (np.sqrt(s) + eps))[:, None]
        return table, out
    if optimizer == "adam":
        b1, b2, t = np.float32(cfg.beta1), np.float32(cfg.beta2), out["count"]
        m = b1 * out["m"][ids] + (np.float32(1) - b1) * grads
        v = b2 * out["v"][ids] + (np.float32(1) - b2) * grads * grads
        out["m"][ids], out["v"][ids] = m, v
        m_hat = m / np.float32(1 - float(b1) ** t)
        v_hat = v / np.float32(1 - float(b2) ** t)
        table[ids] = w - lr * (m_hat / (np.sqrt(v_hat) + eps) + np.float32(cfg.weight_decay) * w)
        return table, out
    raise HSTUError(f"embedding.optimizer: unknown {optimizer!r}; choose from {list(OPTIMIZERS)}")
