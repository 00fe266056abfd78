"""The training schedule both backends run, over a small Backend protocol.

Step i overlaps the balancer work of batch i+1 with the compute of batch i (and the host
side of later batches — reading, validation, per-sample stats — runs ahead on a prefetch
thread, `HostPrefetcher`):

1. host->device copy of batch i+1 (torch: side stream; jax: async dispatch);
2. phase 1 of i+1: per-sample stats (FLOPs, tokens, loss targets) computed on the host from
   the batch, gathered across ranks (one collective), partitioning submitted to a worker
   thread, so the host-side algorithm never sits on the critical path;
3. forward/backward of batch i, loss normalised by the global loss-token count (known from
   the gathered stats before the forward, so no rank's gradient depends on where a sample
   landed);
4. phase 2 of i+1: wait for the plan, exchange (allgather or all2all), padding last;
5. optimizer step, dispatched; the metrics of step i-1 are fetched only now, so the host
   never waits for the device between steps.

Collective order is the same on every rank: stats gather (i+1), the backend's
forward/backward collectives (i), exchange (i+1). Every rank computes the same plan from the
same gathered stats, so it issues the same exchange. Only this file decides that order.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from hstu.batch import JaggedBatch
from hstu.partition import imbalance
from hstu.shuffle_plan import ShufflePlan, identity_plan, make_plan
from hstu.workload import HSTUCost

# Columns of the per-sample stats every rank gathers in phase 1; the per-key jagged lengths
# follow (in the batch's key order), so every process knows every sample's sizes after the
# gather: static-shape backends size their exchange buffers from them with no extra collective.
STAT_WORKLOAD, STAT_TOKENS, STAT_LOSS_TOKENS, STAT_REAL = range(4)
NUM_FIXED_STATS = 4


def loss_tokens(batch: JaggedBatch, task: str) -> np.ndarray:
    """Per-sample loss targets: candidates (ranking) or next-item targets (retrieval)."""
    if task == "ranking":
        return batch.lengths["candidate"].astype(np.int64)
    return np.maximum(batch.lengths["item"].astype(np.int64) - 1, 0)


def sample_stats(batches: Sequence[JaggedBatch], cost: HSTUCost, task: str) -> np.ndarray:
    """[sum batch_size, 4 + num_keys] int64 for this process's ranks, rank-major."""
    rows = []
    for b in batches:
        real = np.arange(b.batch_size) < b.actual_batch_size
        cols = [cost.batch_flops(b), b.seq_lengths(), loss_tokens(b, task), real.astype(np.int64)]
        cols += [b.lengths[k] for k in b.keys]
        rows.append(np.stack(cols, axis=1))
    return np.concatenate(rows).astype(np.int64)


def gathered_lengths(stats: np.ndarray, keys: Sequence[str]) -> dict[str, np.ndarray]:
    """Per-key lengths of every global sample, from the gathered stats."""
    return {k: stats[:, NUM_FIXED_STATS + i] for i, k in enumerate(keys)}


class Backend(Protocol):
    """What a backend supplies; the schedule and its ordering live here, once."""

    world_size: int
    local_ranks: Sequence[int]  # data-parallel ranks this process drives (torch: one)

    def to_device(self, batches: Sequence[JaggedBatch]) -> Any:
        """Start the host->device copy of this process's batches; must not block on it.

        The pipeline calls `allgather_stats` for this same batch right after, so a static-shape
        backend may defer the copy until the gathered sizes fix its buffer shapes."""

    def allgather_stats(self, local_stats: np.ndarray) -> np.ndarray:
        """Collective: [len(local_ranks) * B, S] int64 -> [world_size * B, S] on every process."""

    def exchange(self, device_batch: Any, plan: ShufflePlan, stats: np.ndarray) -> Any:
        """Collective: this process's batches after the plan (padded, real rows first).

        `stats` are the gathered stats of this very batch: every buffer size of the exchange
        follows from them, so no size-exchanging collective is needed."""

    def forward_backward(self, device_batch: Any, global_loss_tokens: int) -> Any:
        """Dispatch forward + backward (+ gradient reduction); returns a handle."""

    def optimizer_step(self, handle: Any) -> Any:
        """Dispatch the update; return the step's metrics as a handle, without waiting for
        the device (the pipeline fetches them one step late)."""

    def fetch_metrics(self, pending: Any) -> dict[str, float]:
        """Host scalars of a dispatched step (at least 'loss', the global mean loss; static-
        shape backends add 'token_capacity' and 'num_compiles'). Waits for that step only."""


@dataclass
class Prepared:
    """A batch after both phases, plus what the step metrics need to know about it."""

    device_batch: Any
    stats: np.ndarray  # gathered [W * B, S]
    plan: ShufflePlan


class Balancer:
    """Phase 1 / phase 2 of the shuffle around a backend; identity when not balancing."""

    def __init__(
        self,
        backend: Backend,
        shuffler: str = "balanced",
        method: str = "auto",
        overlap: bool = True,
    ):
        self.backend, self.shuffler, self.method = backend, shuffler, method
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="partition") if overlap else None

    def phase1(
        self, device_batch: Any, local_stats: np.ndarray
    ) -> tuple[Any, np.ndarray, Future | ShufflePlan]:
        stats = self.backend.allgather_stats(local_stats)
        real = stats[:, STAT_REAL].astype(bool)
        w = self.backend.world_size
        if self.shuffler == "identity":
            return device_batch, stats, identity_plan(real, w)
        args = (stats[:, STAT_WORKLOAD], real, w, self.method)
        plan = self._pool.submit(make_plan, *args) if self._pool else make_plan(*args)
        return device_batch, stats, plan

    def phase2(self, device_batch: Any, stats: np.ndarray, plan: Future | ShufflePlan) -> Prepared:
        if isinstance(plan, Future):
            plan = plan.result()
        if self.shuffler != "identity":
            device_batch = self.backend.exchange(device_batch, plan, stats)
        return Prepared(device_batch, stats, plan)

    def close(self) -> None:
        if self._pool:
            self._pool.shutdown(wait=True)


def step_metrics(prepared: Prepared, world_size: int) -> dict[str, Any]:
    """Balance and token figures of one step, from the gathered stats and the plan."""
    stats, plan = prepared.stats, prepared.plan
    w = stats[:, STAT_WORKLOAD].astype(np.float64)
    tokens = stats[:, STAT_TOKENS]
    before = w.reshape(world_size, -1).sum(axis=1)
    after = w[plan.indices].sum(axis=1)
    return {
        "global_tokens": int(tokens.sum()),
        "global_loss_tokens": int(stats[:, STAT_LOSS_TOKENS].sum()),
        "global_samples": int(stats[:, STAT_REAL].sum()),
        "global_flops": float(w.sum()),
        "rank_workloads_before": before.tolist(),
        "rank_workloads_after": after.tolist(),
        "imbalance_before": imbalance_of(before),
        "imbalance_after": imbalance_of(after),
        "tokens_max_before": int(tokens.reshape(world_size, -1).sum(axis=1).max(initial=0)),
        "tokens_max_after": int(tokens[plan.indices].sum(axis=1).max(initial=0)),
    }


def imbalance_of(per_rank: np.ndarray) -> float:
    return imbalance(per_rank, [np.array([i]) for i in range(len(per_rank))])


class HostPrefetcher:
    """Reads, validates and measures the next batches on a background thread.

    Data generation, `validate()` and the per-sample stats are host work; done here, ahead of
    the step that needs them, they stay off the critical path. At most `depth` batches wait in
    the queue and at most `limit` are read in all, so a finite iterator is never over-read. An
    exception (a bad batch) is re-raised in the consumer, still before any collective of that
    batch.
    """

    _DONE = object()

    def __init__(
        self,
        batches: Iterator[Sequence[JaggedBatch]],
        prepare: Callable,
        limit: int,
        depth: int = 2,
    ):
        self._queue: queue.Queue = queue.Queue(maxsize=max(depth, 1))
        self._stop = threading.Event()
        self._thread = threading.Thread(
            target=self._fill, args=(batches, prepare, limit), name="host-prefetch", daemon=True
        )
        self._thread.start()

    def _fill(self, batches, prepare, limit) -> None:
        try:
            for _ in range(limit):
                item = prepare(next(batches))
                while not self._stop.is_set():
                    try:
                        self._queue.put(item, timeout=0.1)
                        break
                    except queue.Full:
                        continue
                if self._stop.is_set():
                    return
        except BaseException as exc:  # noqa: BLE001 - handed to the consumer as is
            self._queue.put(exc)
            return
        self._queue.put(self._DONE)

    def __next__(self):
        item = self._queue.get()
        if item is self._DONE:
            raise StopIteration
        if isinstance(item, BaseException):
            raise item
        return item

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)


def run(
    backend: Backend,
    batches: Iterator[Sequence[JaggedBatch]],
    num_steps: int,
    cost: HSTUCost,
    task: str,
    shuffler: str = "balanced",
    method: str = "auto",
    overlap: bool = True,
    on_step: Callable[[int, dict], None] | None = None,
    validate: bool = True,
    start_step: int = 0,
    prefetch: int = 2,
    check: Callable[[JaggedBatch, int], None] | None = None,
    after_dispatch: Callable[[int], None] | None = None,
) -> list[dict]:
    """Train `num_steps` steps numbered from `start_step` (a resumed run goes on counting);
    `batches` yields this process's per-rank batches per step.

    Host side: with `prefetch` > 0 reading, `validate()`, `check(batch, rank)` (the model's
    input checks) and the per-sample stats of the next batches run that many batches ahead on
    a thread; all of it before any collective of that batch.

    Metrics are fetched one step late: step i's are read after step i+1 is dispatched, so the
    host never waits for the device between steps. `step_time_s` is therefore the interval
    between consecutive steps' completions as seen by the host, i.e. the steady-state step
    period (step 0's includes start-up). `after_dispatch(step)` runs right after a step's
    update is dispatched and before the next step touches the state (checkpoints go there);
    `on_step(step, metrics)` when its metrics arrive.
    """
    balancer = Balancer(backend, shuffler, method, overlap)

    def prepare(host: Sequence[JaggedBatch]):
        if validate:  # before any collective: a bad batch fails here, on its own rank
            for r, b in zip(backend.local_ranks, host, strict=True):
                b.validate(rank=r)
                if check is not None:
                    check(b, r)
        return host, sample_stats(host, cost, task)

    source = (
        HostPrefetcher(batches, prepare, num_steps, prefetch)
        if prefetch
        else (prepare(b) for b in batches)
    )

    def start(prepared):
        host, local_stats = prepared
        dev = backend.to_device(host)
        return balancer.phase1(dev, local_stats)

    history: list[dict] = []
    last_done = time.perf_counter()

    def emit(step: int, pending: Any, prepared: Prepared) -> None:
        nonlocal last_done
        out = backend.fetch_metrics(pending)
        now = time.perf_counter()
        elapsed, last_done = now - last_done, now
        metrics = {"step": step, **out, **step_metrics(prepared, backend.world_size)}
        metrics.setdefault("token_capacity", metrics["tokens_max_after"])
        metrics.setdefault("num_compiles", 0)
        tokens, w = metrics["global_tokens"], backend.world_size
        metrics["padding_waste"] = w * metrics["token_capacity"] / tokens - 1 if tokens else 0.0
        metrics["step_time_s"] = elapsed
        metrics["tokens_per_s"] = tokens / elapsed if elapsed else 0.0
        metrics["tflops_per_device"] = (
            metrics["global_flops"] / elapsed / 1e12 / w if elapsed else 0.0
        )
        history.append(metrics)
        if on_step:
            on_step(step, metrics)

    try:
        current = balancer.phase2(*start(next(source)))
        last_done = time.perf_counter()
        pending = None
        for i in range(num_steps):
            step = start_step + i
            following = start(next(source)) if i + 1 < num_steps else None
            loss_tokens_ = int(current.stats[:, STAT_LOSS_TOKENS].sum())
            handle = backend.forward_backward(current.device_batch, loss_tokens_)
            following = balancer.phase2(*following) if following is not None else None
            out = backend.optimizer_step(handle)
            if pending is not None:
                emit(*pending)
            if after_dispatch:
                after_dispatch(step)
            pending = (step, out, current)
            current = following
        if pending is not None:
            emit(*pending)
    finally:
        if isinstance(source, HostPrefetcher):
            source.close()
        balancer.close()
    return history
