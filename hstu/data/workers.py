"""Batches built in worker processes (`data.workers`), off the training process's interpreter.

Reading and assembling a batch is Python work (a synthetic sample is drawn sample by sample;
a prepared one is sliced out of its arrays): on the host prefetch thread it holds the GIL that
the training loop needs to dispatch the step. On the bench_upstream recipe at batch 32 that
thread held it for ~11 ms per step (jax.profiler, one H200), and the main thread waited for it
inside the step's dispatch while the GPU idled. Worker processes have interpreters of their own.

The loader's batches depend on their position alone (`DataLoader.batch_at`), so the workers
take positions in order, `ahead` of them in flight, and the batches come back in that order:
the same batches, in the same order, as the in-process loader (tests hold them equal). A
worker's error (a bad sample) is raised by `next()`, on the host, before any collective of that
batch, as the in-process loader raises it.
"""

from __future__ import annotations

import collections
import multiprocessing

from hstu.batch import JaggedBatch
from hstu.data.loader import DataLoader

_LOADER: DataLoader | None = None  # each worker's own copy


def _start(loader: DataLoader) -> None:
    global _LOADER
    _LOADER = loader


def _batches_at(position: int) -> list[JaggedBatch]:
    assert _LOADER is not None
    return [_LOADER.batch_at(position, r) for r in _LOADER.ranks]


class WorkerLoader:
    """A `DataLoader`'s iterator with its batches built by `workers` spawned processes (the
    source must pickle); `position` is, as the loader's, that of the next batch returned."""

    def __init__(self, loader: DataLoader, workers: int, ahead: int = 2):
        if workers < 1:
            raise ValueError(f"workers must be >= 1, got {workers}")
        self.loader, self.position = loader, loader.position
        # spawn: the training process holds CUDA / XLA threads that a fork would copy broken
        context = multiprocessing.get_context("spawn")
        self._pool = context.Pool(workers, initializer=_start, initargs=(loader,))
        self._ahead = max(ahead, workers)
        self._submit_at = loader.position
        self._pending: collections.deque = collections.deque()

    def __iter__(self):
        return self

    def __next__(self) -> list[JaggedBatch]:
        while len(self._pending) < self._ahead:
            result = self._pool.apply_async(_batches_at, (self._submit_at,))
            self._pending.append((self._submit_at, result))
            self._submit_at = self.loader.next_position(self._submit_at)
        position, result = self._pending.popleft()
        batches = result.get()
        self.position = self.loader.next_position(position)
        return batches

    def close(self) -> None:
        self._pool.terminate()
        self._pool.join()
