"""Batches built in worker processes (`data.workers`), off the training process's interpreter.

Reading and assembling a batch is Python work (a synthetic sample is drawn sample by sample;
a prepared one is sliced out of its arrays): on the host prefetch thread it holds the GIL that
the training loop needs to dispatch the step. On the bench_upstream recipe at batch 32 that
thread held it for ~11 ms per step (jax.profiler, one H200), and the main thread waited for it
inside the step's dispatch while the GPU idled. Worker processes have interpreters of their own.
What the host does next to a batch before the step (validation, the model's input checks, the
per-sample stats: `hstu.pipeline.BatchPrep`) runs there too, for the same reason: on the
prefetch thread it cost the torch step's dispatching thread about 1 ms of waiting for the GIL
per step at batch 8 (`scripts/host_time.py`, one H200).

The loader's batches depend on their position alone (`DataLoader.batch_at`), so the workers
take positions in order, `ahead` of them in flight, and the batches come back in that order:
the same batches, in the same order, as the in-process loader (tests hold them equal). A
worker's error (a bad sample) is raised by `next()`, on the host, before any collective of that
batch, as the in-process loader raises it. So is a worker's death (killed by the OOM killer, a
signal, a crash in native code): the pool then fails every batch in flight at once, and
`next()` names the dead process and the position, instead of waiting for a result that no
process will deliver.
"""

from __future__ import annotations

import collections
import multiprocessing
import signal
import time
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool

from hstu.data.loader import DataLoader
from hstu.errors import HSTUError

_LOADER: DataLoader | None = None  # each worker's own copy
_PREPARE: Callable | None = None


def _start(loader: DataLoader, prepare: Callable | None = None) -> None:
    global _LOADER, _PREPARE
    _LOADER, _PREPARE = loader, prepare


def _batches_at(position: int):
    assert _LOADER is not None
    batches = [_LOADER.batch_at(position, r) for r in _LOADER.ranks]
    return batches if _PREPARE is None else _PREPARE(batches)


class WorkerLoader:
    """A `DataLoader`'s iterator with its batches built by `workers` spawned processes (the
    source must pickle); `position` is, as the loader's, that of the next batch returned.
    `prepare` (picklable, e.g. `hstu.pipeline.BatchPrep`): applied to each step's batches in
    the worker, which then returns what it returns."""

    def __init__(
        self, loader: DataLoader, workers: int, ahead: int = 2, prepare: Callable | None = None
    ):
        if workers < 1:
            raise ValueError(f"workers must be >= 1, got {workers}")
        self.loader, self.position, self.workers = loader, loader.position, workers
        # spawn: the training process holds CUDA / XLA threads that a fork would copy broken
        context = multiprocessing.get_context("spawn")
        self._pool = ProcessPoolExecutor(
            workers, mp_context=context, initializer=_start, initargs=(loader, prepare)
        )
        self._ahead = max(ahead, workers)
        self._submit_at = loader.position
        self._pending: collections.deque = collections.deque()

    def __iter__(self):
        return self

    def __next__(self):
        try:
            while len(self._pending) < self._ahead:
                future = self._pool.submit(_batches_at, self._submit_at)
                self._pending.append((self._submit_at, future))
                self._submit_at = self.loader.next_position(self._submit_at)
            position, future = self._pending[0]
            batches = future.result()
        except BrokenProcessPool as exc:
            at = self._pending[0][0] if self._pending else self._submit_at
            raise HSTUError(
                f"a data worker process ended abruptly ({self._dead()}) before the batch at "
                f"sample position {at} was built (data.workers={self.workers}; killed for "
                "memory? fewer workers or a lower data.prefetch hold fewer batches at once)"
            ) from exc
        self._pending.popleft()
        self.position = self.loader.next_position(position)
        return batches

    def _dead(self) -> str:
        """The pool's processes that have ended, with their exit codes (negative: the signal),
        those the pool stopped itself once broken (SIGTERM) left out where another is known.
        The pool's own thread is reaping them meanwhile: a code can read as unknown for a moment,
        so this looks again for up to a second."""
        processes = list((getattr(self._pool, "_processes", None) or {}).values())
        deadline = time.monotonic() + 1.0
        while True:
            ended = [p for p in processes if p.exitcode is not None]
            first = [p for p in ended if p.exitcode != -signal.SIGTERM]
            if first or time.monotonic() > deadline:
                break
            time.sleep(0.02)
        codes = ", ".join(f"pid {p.pid}, exit code {p.exitcode}" for p in first or ended)
        return codes or "exit code unknown"

    def close(self) -> None:
        # batches not yet started are dropped; one being built finishes (a few ms) first
        self._pool.shutdown(wait=True, cancel_futures=True)
