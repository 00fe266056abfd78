"""Per-step batches addressed by a global sample position, the same for every data source.

A source maps a global sample index to one HSTU sample (`sample(i) -> dict`, the form of
`hstu.data.synthetic.make_sample`) and says how many samples an epoch holds (`num_samples`,
0 for an endless stream). The loader cuts the stream into global batches of `W * B` samples:
the batch at position `p` holds global indices `[p, p + W B)`, rank `r` the `r`-th block of
`B`. An epoch ends a global batch early: the last batch of epoch `e` stops at `(e + 1) N`, is
padded per the batch spec (trailing ranks may hold no real sample), and the next one starts the
next epoch.

The data position saved in checkpoints is this global sample count, not a batch index, so a
run resumed with another world size (or batch size) continues with exactly the next samples.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import numpy as np

from hstu.batch import HSTU_DENSE_KEYS, JaggedBatch, from_samples
from hstu.errors import HSTUError


class SampleSource(Protocol):
    num_samples: int  # per epoch; 0 = endless

    @property
    def jagged_keys(self) -> tuple[str, ...]: ...

    def sample(self, index: int) -> dict[str, np.ndarray]:
        """Global sample `index` (counting across epochs)."""


class WrappedSource:
    """Base of a `SampleSource` over another (`inner`): the epoch size and keys are the inner
    source's, and anything else a source offers (evaluation splits, specs) is read through.
    `find_source` looks through any stack of them."""

    def __init__(self, inner):
        self.inner = inner
        self.num_samples = inner.num_samples

    @property
    def jagged_keys(self) -> tuple[str, ...]:
        return tuple(self.inner.jagged_keys)

    def __getattr__(self, name: str):
        if name == "inner":  # not set yet (copy, unpickling): no recursion
            raise AttributeError(name)
        return getattr(self.inner, name)

    def sample(self, index: int) -> dict[str, np.ndarray]:
        return self.inner.sample(index)


def find_source(source, kinds):
    """The first source of type `kinds` in `source` and the sources it wraps (`.inner`), or
    None."""
    while source is not None and not isinstance(source, kinds):
        source = getattr(source, "inner", None)
    return source


def batch_ranges(position: int, batch_size: int, world_size: int, num_samples: int):
    """`([(first, last) per rank], next_position)` of the global batch at `position`."""
    if position < 0:
        raise HSTUError(f"data position must be >= 0, got {position}")
    end = position + batch_size * world_size
    if num_samples:
        end = min(end, (position // num_samples + 1) * num_samples)
    ranges = []
    for r in range(world_size):
        first = min(position + r * batch_size, end)
        ranges.append((first, min(first + batch_size, end)))
    return ranges, end


class DataLoader:
    """Iterator of this process's per-rank batches, one list per step; `position` is the
    global sample index of the next batch."""

    def __init__(
        self,
        source: SampleSource,
        batch_size: int,
        world_size: int,
        ranks: Sequence[int],
        position: int = 0,
    ):
        bad = [r for r in ranks if not 0 <= r < world_size]
        if bad:
            raise HSTUError(f"ranks {bad} outside [0, world_size={world_size})")
        self.source, self.batch_size, self.world_size = source, batch_size, world_size
        self.ranks, self.position = list(ranks), int(position)

    def batch_at(self, position: int, rank: int) -> JaggedBatch:
        ranges, _ = batch_ranges(
            position, self.batch_size, self.world_size, self.source.num_samples
        )
        first, last = ranges[rank]
        samples = [self.source.sample(i) for i in range(first, last)]
        return from_samples(samples, self.batch_size, self.source.jagged_keys, HSTU_DENSE_KEYS)

    def next_position(self, position: int) -> int:
        return batch_ranges(position, self.batch_size, self.world_size, self.source.num_samples)[1]

    def __iter__(self):
        return self

    def __next__(self) -> list[JaggedBatch]:
        out = [self.batch_at(self.position, r) for r in self.ranks]
        self.position = self.next_position(self.position)
        return out
