"""Where every token of a batch goes, computed on the host from the lengths.

A sample becomes `C + 2L + K` tokens: its contextual ids, its L items and L actions
interleaved, then its K candidates (docs/MODEL.md). Where each token lands, which sample it
belongs to and which targets the retrieval loss scores depend on the per-sample lengths alone,
and the host holds those before the batch is copied to the device: the lengths of a batch as
loaded, and, after a balanced exchange, the gathered stats and the plan.

Built on the device instead, the layout took some 50 small ops per step (cumsums, segment
expansions, gathers, an inverse permutation; 62 ops before the stack in all, 12 now), each a
kernel launched from Python by the dispatching thread before the graphed HSTU stack could
start: on the bench_upstream recipe (one H200, batch 32) the GPU ran dry in that window, 3.9 ms
of idle per step charged to it (docs/BENCHMARKS.md). Here it is numpy, packed into one int64
buffer and copied in one transfer (through the page-locked ring of staging.py); on the device
it is only sliced (views, no kernels). A batch keeps the lengths the host knows
(`TorchBatch.host_lengths`) and builds its layout the first time a step needs it, so a batch
a balanced exchange replaces builds none.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np
import torch

# The jagged keys the layout is built from (the model's token table).
LAYOUT_KEYS = ("contextual", "item", "candidate")


def _segments(lengths: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """For a jagged key: (sample of each value, position of the value inside its sample)."""
    sample = np.repeat(np.arange(lengths.size, dtype=np.int64), lengths)
    starts = np.cumsum(lengths) - lengths
    return sample, np.arange(sample.size, dtype=np.int64) - starts[sample]


def layout_arrays(contextual, items, candidates) -> dict[str, np.ndarray]:
    """The layout's parts as host arrays (int64; the two counts int32) from each sample's
    contextual, item and candidate counts (`[B]` each): see `TokenLayout`."""
    c, n, k = (np.asarray(x, np.int64) for x in (contextual, items, candidates))
    offsets = np.zeros(c.size + 1, np.int64)
    np.cumsum(c + 2 * n + k, out=offsets[1:])
    start = offsets[:-1]
    s_c, p_c = _segments(c)
    s_i, p_i = _segments(n)
    s_k, p_k = _segments(k)
    pos_item = start[s_i] + c[s_i] + 2 * p_i
    pos_cand = start[s_k] + c[s_k] + 2 * n[s_k] + p_k
    dest = np.concatenate([start[s_c] + p_c, pos_item, pos_item + 1, pos_cand])
    inverse = np.empty_like(dest)
    inverse[dest] = np.arange(dest.size, dtype=np.int64)  # one source row per token
    s_t, p_t = _segments(np.maximum(n - 1, 0))
    target_item = (np.cumsum(n) - n)[s_t] + p_t
    return {
        "offsets": offsets,
        "pos_item": pos_item,
        "pos_cand": pos_cand,
        "inverse": inverse,
        "dest": dest,
        "target_item": target_item,
        "num_contextual": c.astype(np.int32),
        "num_candidates": k.astype(np.int32),
    }


@dataclass(frozen=True)
class TokenLayout:
    """One int64 buffer: `offsets [B + 1] | pos_item [L] | pos_cand [K] | inverse [T] |
    dest [T] | target_item [N] | num_contextual, num_candidates as int32 [2B]` (host sizes
    alongside).

    * `offsets`: token offsets of the samples (the attention kernel's jagged layout);
    * `pos_item` / `pos_cand`: the token of each item / candidate value (an item's action token
      is the next one);
    * `inverse`: for each token, its row in `cat(contextual, item, action, candidate)` values;
    * `dest`: the inverse permutation, each such row's token (`permute_rows`' gradient);
    * `target_item`: for each retrieval target (every item but a sample's last), the item
      value it is scored at.

    `rows` <= `batch_size`: padding rows sit at the tail with no tokens, so dropping them
    (`strip`) only shortens the per-row views.
    """

    buffer: torch.Tensor
    batch_size: int
    num_items: int
    num_candidates: int
    num_tokens: int
    num_targets: int
    rows: int

    @classmethod
    def from_lengths(
        cls, contextual: np.ndarray, items: np.ndarray, candidates: np.ndarray
    ) -> TokenLayout:
        """From each sample's contextual, item and candidate counts (host ints, `[B]` each)."""
        a = layout_arrays(contextual, items, candidates)
        counts = np.concatenate([a["num_contextual"], a["num_candidates"]]).view(np.int64)
        names = ("offsets", "pos_item", "pos_cand", "inverse", "dest", "target_item")
        buffer = torch.from_numpy(np.concatenate([*(a[n] for n in names), counts]))
        sizes = (a["pos_item"].size, a["pos_cand"].size, a["inverse"].size, a["target_item"].size)
        return cls(buffer, a["offsets"].size - 1, *sizes, rows=a["offsets"].size - 1)

    @classmethod
    def of_lengths_KB(cls, keys: list[str], lengths_KB: np.ndarray) -> TokenLayout | None:
        """From `[num_keys, B]` host lengths; None when a key of the token table is missing
        (a batch the HSTU model does not read, e.g. in exchange tests)."""
        if not all(key in keys for key in LAYOUT_KEYS):
            return None
        return cls.from_lengths(*(lengths_KB[keys.index(key)] for key in LAYOUT_KEYS))

    def to(self, device: torch.device, non_blocking: bool = False) -> TokenLayout:
        return replace(self, buffer=self.buffer.to(device, non_blocking=non_blocking))

    def strip(self, rows: int) -> TokenLayout:
        return replace(self, rows=rows)

    def views(self) -> dict[str, torch.Tensor]:
        """The parts, as views of the buffer (no copies, no kernels)."""
        b, r = self.batch_size, self.rows
        t = self.num_tokens
        sizes = [b + 1, self.num_items, self.num_candidates, t, t, self.num_targets]
        parts = list(torch.split(self.buffer, [*sizes, b]))
        counts = parts.pop().view(torch.int32)
        names = ("offsets", "pos_item", "pos_cand", "inverse", "dest", "target_item")
        out = dict(zip(names, parts, strict=True))
        out["offsets"] = out["offsets"][: r + 1]
        out["num_contextual"], out["num_candidates"] = counts[:b][:r], counts[b:][:r]
        return out


class _PermuteRows(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, perm: torch.Tensor, inv: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(inv)
        return x.index_select(0, perm)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (inv,) = ctx.saved_tensors
        return grad.index_select(0, inv), None, None


def permute_rows(x: torch.Tensor, perm: torch.Tensor, inv: torch.Tensor) -> torch.Tensor:
    """`x[perm]` for a permutation `perm` of `x`'s rows, `inv` its inverse (`perm[inv] ==
    arange`). The gradient is `grad[inv]`, one gather: `index_select`'s own backward fills a
    zero `x`-sized buffer and adds every row into it atomically (`index_add`), which for a
    permutation gives the same values, each added to a zero once."""
    return _PermuteRows.apply(x, perm, inv)


class _SelectDistinctRows(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(rows)
        ctx.num_rows = x.shape[0]
        return x.index_select(0, rows)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (rows,) = ctx.saved_tensors
        out = grad.new_zeros((ctx.num_rows, *grad.shape[1:]))
        return out.index_copy_(0, rows, grad), None


def select_distinct_rows(x: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """`x[rows]` for distinct `rows`. The gradient is the rows written into zeros
    (`index_copy_`, plain stores): `index_select`'s own backward adds them atomically
    (`index_add`), which for distinct rows gives the same values, each added to a zero once.
    Repeated rows would keep one of their gradients: callers promise distinct ones."""
    return _SelectDistinctRows.apply(x, rows)
