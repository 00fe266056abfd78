"""Length-aware sample order (`data.pack_window`): batches that fill their token capacity.

A static-shape step (jax; torch with `train.cuda_graphs`) pads a rank's tokens to one of a few
capacities (`hstu.capacity`). With at most 8 of them, batches of 32 samples of Zipf lengths
pad 12.5 % of their tokens on average: a batch's total varies too much for 8 sizes to follow
it. Packing changes the batches instead of the sizes. The sample stream is reordered inside
windows of `P = data.pack_window` samples so that each block of `B = data.batch_size`
consecutive samples, a rank's batch under the identity split, sums to just under a capacity:

* the windows are fixed in the stream: window `w` of epoch `e` holds samples
  `[e N + w P, e N + (w + 1) P)`, clipped at the epoch's end (`N` samples per epoch);
* inside a window the samples start in stream order, cut into blocks of `B` (a remainder of
  fewer than `B` keeps its order at the end); then, while some swap of two samples between
  two blocks lowers the window's summed relative padding, the best such swap is made
  (deterministic: the first best in block and sample order);
* `PackedSource.sample(i)` is the sample at position `i` of the reordered stream.

Kept: every sample is read exactly once per epoch, inside the window that holds its
place in the stream; the reordered stream depends only on the samples, `B`, `P` and the
capacities, not on the world size, so the data position (a count of samples) still resumes a
run on any number of ranks. A checkpoint records the packing (`state()`); resuming inside a
window with another batch size, window or capacities would read another order of it, and
`check_resume` refuses that, naming what changed.

Changed: which samples train together, inside a window. The balanced shuffler re-partitions
every global batch by cost, so with it (W > 1) the blocks no longer decide a rank's tokens and
the run keeps the capacities fitted to the balancer's splits (`hstu.capacity.for_source`).
"""

from __future__ import annotations

import threading
from collections import OrderedDict

import numpy as np

from hstu.batch import sample_tokens
from hstu.capacity import CapacityPolicy
from hstu.data.loader import WrappedSource, find_source
from hstu.errors import HSTUError

MAX_SWAPS_PER_SAMPLE = 4  # the search stops after 4 * P swaps (in practice far fewer)


def _padding(policy: CapacityPolicy, sums: np.ndarray) -> np.ndarray:
    sums = np.maximum(sums, 1)
    return policy.capacity_of(sums) / sums - 1.0


def pack_order(tokens: np.ndarray, block: int, policy: CapacityPolicy) -> np.ndarray:
    """A permutation of `range(len(tokens))`: blocks of `block` consecutive entries whose
    token sums pad less to `policy`'s capacities than the given order's blocks (module doc)."""
    tokens = np.asarray(tokens, np.int64)
    n = len(tokens)
    k = n // block
    order = np.arange(n)
    if k < 2:
        return order
    groups = order[: k * block].reshape(k, block).copy()
    upper = np.triu(np.ones((k, k), bool), 1)[:, :, None, None]  # pairs of blocks a < b
    for _ in range(MAX_SWAPS_PER_SAMPLE * n):
        t = tokens[groups]  # [k, block]
        sums = t.sum(axis=1)
        pad = _padding(policy, sums)
        # d[a, b, i, j]: what swapping sample i of block a with sample j of block b moves into a
        d = t[None, :, None, :] - t[:, None, :, None]
        new = _padding(policy, sums[:, None, None, None] + d)
        new += _padding(policy, sums[None, :, None, None] - d)
        gain = np.where(upper, (pad[:, None] + pad[None, :])[:, :, None, None] - new, 0.0)
        best = int(np.argmax(gain))
        if gain.flat[best] <= 1e-12:
            break
        a, b, i, j = np.unravel_index(best, gain.shape)
        groups[a, i], groups[b, j] = groups[b, j], groups[a, i]
    order[: k * block] = groups.reshape(-1)
    return order


class PackedSource(WrappedSource):
    """A `SampleSource` whose stream is reordered window by window (module doc). `policy`: the
    capacities of one rank's block of `batch_size` samples (`hstu.capacity.block_policy`)."""

    def __init__(self, inner, window: int, batch_size: int, policy: CapacityPolicy):
        if window < 2 * batch_size or window % batch_size:
            raise HSTUError(
                f"data.pack_window={window} must be a multiple of data.batch_size="
                f"{batch_size} holding at least two batches (or 0: no packing)"
            )
        super().__init__(inner)
        self.window, self.batch_size, self.policy = window, batch_size, policy
        self._windows: OrderedDict[int, list] = OrderedDict()  # start -> samples, reordered
        self._lock = threading.Lock()

    def __getstate__(self) -> dict:  # pickled for worker processes: no lock, no cache
        state = self.__dict__.copy()
        state["_windows"], state["_lock"] = OrderedDict(), None
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._lock = threading.Lock()

    def window_of(self, index: int) -> tuple[int, int]:
        """`(first, end)` sample positions of the window holding position `index`."""
        return window_bounds(index, self.window, self.num_samples)

    def state(self) -> dict:
        """What decides the order (saved with the data position of a checkpoint)."""
        return {
            "window": self.window,
            "batch_size": self.batch_size,
            "capacities": list(self.policy.capacities),
        }

    def sample(self, index: int) -> dict:
        first, end = self.window_of(index)
        with self._lock:
            samples = self._windows.get(first)
            if samples is None:
                samples = [self.inner.sample(i) for i in range(first, end)]
                tokens = np.array([sample_tokens(s) for s in samples])
                samples = [samples[i] for i in pack_order(tokens, self.batch_size, self.policy)]
                self._windows[first] = samples
                while len(self._windows) > 3:  # the loader reads ahead by one window at most
                    self._windows.popitem(last=False)
        return samples[index - first]


def window_bounds(index: int, window: int, num_samples: int) -> tuple[int, int]:
    """`(first, end)` of the window of `window` samples holding stream position `index`
    (windows restart at each epoch of `num_samples`, 0: endless)."""
    if not num_samples:
        first = index // window * window
        return first, first + window
    epoch = index // num_samples * num_samples
    first = epoch + (index - epoch) // window * window
    return first, min(first + window, epoch + num_samples)


def find_packed(source) -> PackedSource | None:
    """The `PackedSource` under `source`'s wrappers (each keeps the one below as `.inner`)."""
    return find_source(source, PackedSource)


def check_resume(source, position: int, saved: dict | None, where: str) -> None:
    """Raise HSTUError when resuming at `position` would read a window in another order than
    the run that saved it (`saved`: its `state()`, None when it did not pack)."""
    packed = find_packed(source)
    current = packed.state() if packed is not None else None
    if saved == current:
        return
    inside = []
    if packed is not None and packed.window_of(position)[0] != position:
        inside.append(f"inside a window of this run (data.pack_window={packed.window})")
    if saved is not None:
        w = int(saved["window"])
        if window_bounds(position, w, getattr(source, "num_samples", 0))[0] != position:
            inside.append(f"inside a window of the saved run (data.pack_window={w})")
    if not inside:
        return
    raise HSTUError(
        f"{where}: the data position {position} is {' and '.join(inside)}, and the packing "
        f"changed (saved {saved}, now {current}): the rest of that window would be read in "
        "another order, repeating some samples and skipping others. Resume with the saved "
        "data.pack_window and data.batch_size (the capacities follow from the data config)"
    )
