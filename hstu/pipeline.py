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
5. optimizer step, dispatched; the metrics of step i-1 (i-L with `train.metrics_lag` L) are
   fetched only now, so the host never waits for the device between steps.

Collective order is the same on every rank: stats gather (i+1), the backend's
forward/backward collectives (i), exchange (i+1). Every rank computes the same plan from the
same gathered stats, so it issues the same exchange. Only this file decides that order.

Sharded embedding tables (`embedding.sharding`: table_wise / row_wise / auto) add collectives
inside step 3, i.e. after batch i's exchange (the previous iteration's step 4) and before the
exchange of i+1: in the forward, the id all-to-alls (lengths, then values) and the row
all-to-all back to the samples' ranks; in the backward, the row-gradient all-to-all to the
rows' owners (whose fused optimizer updates the touched rows right there); then, as without
sharding, the dense gradient buckets and the metrics reduction. Every rank runs the same
forward and backward on its own batch, so it issues the same embedding collectives in the same
order (an empty batch still exchanges its zero ids). The torch backend gives them a process
group of their own, so their interleaving with the gradient buckets (launched from backward
hooks) can never cross ranks' orders; tests/multirank/test_sharded_torch.py records every
collective call per rank and compares the sequences.
"""

from __future__ import annotations

import collections
import contextlib
import queue
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from hstu import signature
from hstu.batch import JaggedBatch
from hstu.partition import imbalance
from hstu.shuffle_plan import ShufflePlan, identity_plan, make_plan
from hstu.workload import HSTUCost

# Columns of the per-sample stats every rank gathers in phase 1: four stats, the batch signature
# (`hstu.signature`: the rank's batch layout, checked on every rank right after the gather),
# then the per-key jagged lengths (in the batch's key order), so every process knows every
# sample's sizes after the gather: static-shape backends size their exchange buffers from them
# with no extra collective.
STAT_WORKLOAD, STAT_TOKENS, STAT_LOSS_TOKENS, STAT_REAL, STAT_SIGNATURE = range(5)
NUM_FIXED_STATS = STAT_SIGNATURE + signature.NUM_SIGNATURE


def loss_tokens(batch: JaggedBatch, task: str) -> np.ndarray:
    """Per-sample loss targets: candidates (ranking) or next-item targets (retrieval)."""
    if task == "ranking":
        return batch.lengths["candidate"].astype(np.int64)
    return np.maximum(batch.lengths["item"].astype(np.int64) - 1, 0)


def sample_stats(batches: Sequence[JaggedBatch], cost: HSTUCost, task: str) -> np.ndarray:
    """[sum batch_size, NUM_FIXED_STATS + num_keys] int64 for this process's ranks, rank-major.

    Each length column carries its key's name-and-dtype tag in bits 32-62 (`gathered_lengths`
    masks it off). Local batches of different key counts are zero-padded to the widest, so the
    signature check after the gather names the odd rank instead of a shape error here."""
    rows = []
    for b in batches:
        real = np.arange(b.batch_size) < b.actual_batch_size
        cols = [cost.batch_flops(b), b.seq_lengths(), loss_tokens(b, task), real.astype(np.int64)]
        sig = np.broadcast_to(signature.signature(b), (b.batch_size, signature.NUM_SIGNATURE))
        tags = signature.key_tags(b)
        lens = [np.asarray(b.lengths[k]).astype(np.int64) | t for k, t in zip(b.keys, tags)]
        lens_bk = np.stack(lens, axis=1) if lens else np.zeros((b.batch_size, 0), np.int64)
        rows.append(np.concatenate([np.stack(cols, axis=1), sig, lens_bk], axis=1))
    width = max(r.shape[1] for r in rows)
    rows = [np.pad(r, ((0, 0), (0, width - r.shape[1]))) for r in rows]
    return np.concatenate(rows).astype(np.int64)


@dataclass(frozen=True)
class BatchPrep:
    """What the host does to a step's batches before any collective: `validate()`, the model's
    input checks (`check(batch, rank)`), the per-sample stats. `(host batches) -> (host
    batches, stats)`; picklable, so that with `data.workers` it runs in the worker processes
    (hstu.data.workers): on the prefetch thread it held the GIL the dispatching thread needs."""

    ranks: tuple[int, ...]
    cost: HSTUCost
    task: str
    validate: bool = True
    check: Callable[[JaggedBatch, int], None] | None = None

    def __call__(self, host: Sequence[JaggedBatch]) -> tuple[Sequence[JaggedBatch], np.ndarray]:
        if self.validate:  # before any collective: a bad batch fails here, on its own rank
            for r, b in zip(self.ranks, host, strict=True):
                b.validate(rank=r)
                if self.check is not None:
                    self.check(b, r)
        return host, sample_stats(host, self.cost, self.task)


def gathered_lengths(stats: np.ndarray, keys: Sequence[str]) -> dict[str, np.ndarray]:
    """Per-key lengths of every global sample, from the gathered stats."""
    return {k: stats[:, NUM_FIXED_STATS + i] & signature.LENGTH_MASK for i, k in enumerate(keys)}


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

    def forward_backward(
        self, device_batch: Any, global_loss_tokens: int, stats: np.ndarray
    ) -> Any:
        """Dispatch forward + backward (+ gradient reduction); returns a handle. `stats`: this
        batch's gathered stats, the host's knowledge of every rank's batch (torch bounds the
        table rows its gradient reduction carries by them, without asking the device)."""

    def optimizer_step(self, handle: Any) -> Any:
        """Dispatch the update; return the step's metrics as a handle, without waiting for
        the device (the pipeline fetches them one step late)."""

    def fetch_metrics(self, pending: Any) -> dict[str, float]:
        """Host scalars of a dispatched step (at least 'loss', the global mean loss; static-
        shape backends add 'token_capacity' and 'num_compiles'). Waits for that step only."""

    # Optional: `annotate(name)`, a context manager naming a host range in the backend's
    # profiler trace (torch.profiler / jax.profiler); the pipeline marks its phases with it.


@dataclass
class Prepared:
    """A batch after both phases, plus what the step metrics need to know about it."""

    device_batch: Any
    stats: np.ndarray  # gathered [W * B, S]
    plan: ShufflePlan
    loaded_batch: Any = None  # the batch as loaded, before the exchange (the identity split)
    partition_wait_s: float = 0.0  # host time phase 2 waited for the partitioning thread
    exchange_s: float = 0.0  # host time of the exchange call


class Balancer:
    """Phase 1 / phase 2 of the shuffle around a backend; identity when not balancing, and at
    one rank, where there is nothing to balance (no partition, no exchange)."""

    def __init__(
        self,
        backend: Backend,
        shuffler: str = "balanced",
        method: str = "auto",
        overlap: bool = True,
    ):
        self.backend, self.shuffler, self.method = backend, shuffler, method
        self.moves = shuffler != "identity" and backend.world_size > 1
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="partition") if overlap else None

    def phase1(
        self, device_batch: Any, local_stats: np.ndarray
    ) -> tuple[Any, np.ndarray, Future | ShufflePlan]:
        # A fixed gathered width whatever this rank's keys, so the gather itself cannot fail
        # on a layout mismatch; then every rank compares all signatures and raises the same
        # error, naming the odd rank and field, before any exchange.
        padded = signature.pad_for_gather(local_stats, NUM_FIXED_STATS)
        stats = self.backend.allgather_stats(padded)
        signature.check_gathered(stats, self.backend.world_size, NUM_FIXED_STATS)
        stats = signature.trim_after_check(stats, NUM_FIXED_STATS)
        real = stats[:, STAT_REAL].astype(bool)
        w = self.backend.world_size
        if not self.moves:
            return device_batch, stats, identity_plan(real, w)
        args = (stats[:, STAT_WORKLOAD], real, w, self.method)
        plan = self._pool.submit(make_plan, *args) if self._pool else make_plan(*args)
        return device_batch, stats, plan

    def phase2(self, device_batch: Any, stats: np.ndarray, plan: Future | ShufflePlan) -> Prepared:
        t0 = time.perf_counter()
        if isinstance(plan, Future):
            plan = plan.result()
        t1 = time.perf_counter()
        loaded = device_batch
        if self.moves:
            device_batch = self.backend.exchange(device_batch, plan, stats)
        t2 = time.perf_counter()
        return Prepared(device_batch, stats, plan, loaded, t1 - t0, t2 - t1)

    def close(self) -> None:
        if self._pool:
            self._pool.shutdown(wait=True)


def step_metrics(
    prepared: Prepared,
    world_size: int,
    capacity_of: Callable[[int], int] | None = None,
    shared_capacity: int | None = None,
) -> dict[str, Any]:
    """Balance, token and padding figures of one step, from the gathered stats and the plan.

    `token_capacity` is the largest rank's token buffer and `padding_waste` the tokens
    computed beyond the real ones, over the real ones: a backend that reports one capacity
    (`shared_capacity`: JAX, whose single program every rank runs) pads every rank to it; one
    with `capacity_of` (torch with CUDA graphs) pads each rank's own tokens to that rank's
    capacity; any other computes exactly its real tokens.
    """
    stats, plan = prepared.stats, prepared.plan
    w = stats[:, STAT_WORKLOAD].astype(np.float64)
    tokens = stats[:, STAT_TOKENS]
    before = w.reshape(world_size, -1).sum(axis=1)
    after = w[plan.indices].sum(axis=1)
    tokens_after = tokens[plan.indices].sum(axis=1)
    real = int(tokens.sum())
    if shared_capacity is not None:
        capacity, padded = int(shared_capacity), int(shared_capacity) * len(tokens_after)
    else:
        buffers = [int((capacity_of or int)(int(n))) for n in tokens_after]
        capacity, padded = max(buffers, default=0), sum(buffers)
    return {
        "global_tokens": real,
        "global_loss_tokens": int(stats[:, STAT_LOSS_TOKENS].sum()),
        "global_samples": int(stats[:, STAT_REAL].sum()),
        "global_flops": float(w.sum()),
        "rank_workloads_before": before.tolist(),
        "rank_workloads_after": after.tolist(),
        "imbalance_before": imbalance_of(before),
        "imbalance_after": imbalance_of(after),
        "tokens_max_before": int(tokens.reshape(world_size, -1).sum(axis=1).max(initial=0)),
        "tokens_max_after": int(tokens_after.max(initial=0)),
        "token_capacity": capacity,
        "padding_waste": padded / real - 1 if real else 0.0,
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


# Host phases of one pipeline iteration, all on the main thread: together they are the step
# period the host sees (`hstu bench e2e --breakdown` checks the sum against the step time).
HOST_PHASES = (
    "data_wait",  # waiting for the prefetch thread (read + validate + stats run there)
    "to_device",  # starting the host->device copy of the next batch
    "stats_gather",  # phase 1: the stats collective (the host needs its result)
    "dispatch",  # forward/backward and the update, dispatched
    "partition_wait",  # phase 2: waiting for the partitioning thread
    "exchange",  # phase 2: the exchange call
    "fetch_wait",  # waiting for the device to finish the previous step
    "checkpoint",  # after_dispatch (checkpoint saves)
    "probe_and_log",  # the metrics line, and the measurements of `probe` steps (benchmarks)
)


class _Clock:
    """Splits the main thread's time into HOST_PHASES, and records how much of the dispatch
    phase the thread spent blocked rather than running (`blocked_dispatch`: wall minus thread
    CPU time), since a backend whose device is behind blocks in its dispatch calls (JAX does,
    when the device queue is full) rather than in `fetch_wait`."""

    def __init__(self):
        self.last, self.last_cpu = time.perf_counter(), time.thread_time()
        self.spent = dict.fromkeys(HOST_PHASES, 0.0)
        self.blocked_dispatch = 0.0

    def lap(self, phase: str) -> None:
        now, cpu = time.perf_counter(), time.thread_time()
        self.spent[phase] += now - self.last
        if phase == "dispatch":
            self.blocked_dispatch += max(0.0, (now - self.last) - (cpu - self.last_cpu))
        self.last, self.last_cpu = now, cpu

    def take(self) -> tuple[dict[str, float], float]:
        out, blocked = self.spent, self.blocked_dispatch
        self.spent, self.blocked_dispatch = dict.fromkeys(HOST_PHASES, 0.0), 0.0
        return out, blocked


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
    after_dispatch: Callable[[int], bool | None] | None = None,
    probe: Callable[[int, Prepared], dict | None] | None = None,
    should_stop: Callable[[int], bool] | None = None,
    prepared: bool = False,
    lag: int = 1,
) -> list[dict]:
    """Train `num_steps` steps numbered from `start_step` (a resumed run goes on counting);
    `batches` yields this process's per-rank batches per step.

    Host side: with `prefetch` > 0 reading, `validate()`, `check(batch, rank)` (the model's
    input checks) and the per-sample stats of the next batches (`BatchPrep`) run that many
    batches ahead on a thread; all of it before any collective of that batch. `prepared`:
    `batches` yields what `BatchPrep(backend.local_ranks, cost, task, validate, check)`
    returns, already done elsewhere (the data worker processes); the thread only reads.

    Metrics are fetched `lag` steps late: step i's are read after step i+lag is dispatched, so
    the host never waits for the device between steps, and with lag > 1 a host hiccup longer
    than one step's device time (a log flush, a slow batch) does not leave the device idle:
    the device's queue then holds `lag` steps. Step i's `step_time_s` is the main thread's
    time over the loop iteration in which its metrics arrive (dispatching step i+lag, preparing
    the batch after it, waiting for step i): in steady state one step period (step 0's holds
    the start-up, the last ones only their waits). `host_s` splits it into HOST_PHASES exactly;
    each row carries `fetch_lag`. `after_dispatch(step)` runs right after a step's update is
    dispatched and before the next step touches the state (checkpoints go there; returning
    True marks the row whose time holds it, step - lag's, as `perturbed`); `on_step(step,
    metrics)` when its metrics arrive. `probe(step, prepared)` (benchmarks) may measure a
    finished step on the devices; what it returns joins that step's metrics, and the `lag`
    steps after it, whose periods hold the measurement and the refill of the device's queue,
    are `perturbed`.
    `should_stop(step)`, asked after `after_dispatch`: True ends the run after that step (its
    metrics still arrive; the batch already prepared for the next step is dropped).
    Every rank must make the same `after_dispatch` and `probe` calls (they may be collective)
    and get the same `should_stop` answers.
    """
    if not isinstance(lag, int) or lag < 1:
        raise ValueError(f"pipeline.run: lag must be an int >= 1, got {lag!r}")
    balancer = Balancer(backend, shuffler, method, overlap)

    prep = BatchPrep(tuple(backend.local_ranks), cost, task, validate, check)

    def prepare(item):
        return item if prepared else prep(item)

    source = (
        HostPrefetcher(batches, prepare, num_steps, prefetch)
        if prefetch
        else (prepare(b) for b in batches)
    )
    clock = _Clock()
    annotate = getattr(backend, "annotate", None) or (lambda name: contextlib.nullcontext())

    def start():
        with annotate("hstu.data_wait"):
            host, local_stats = next(source)
        clock.lap("data_wait")
        with annotate("hstu.to_device"):
            dev = backend.to_device(host)
        clock.lap("to_device")
        with annotate("hstu.stats_gather"):
            out = balancer.phase1(dev, local_stats)
        clock.lap("stats_gather")
        return out

    def finish(phase1) -> Prepared:
        with annotate("hstu.exchange"):
            prepared = balancer.phase2(*phase1)
        clock.spent["partition_wait"] += prepared.partition_wait_s
        clock.spent["exchange"] += prepared.exchange_s
        clock.last = time.perf_counter()
        return prepared

    history: list[dict] = []
    perturbed: set[int] = set()

    def fetch(step: int, pending: Any, prepared: Prepared) -> dict:
        with annotate("hstu.fetch_wait"):
            metrics = {"step": step, **backend.fetch_metrics(pending)}
        clock.lap("fetch_wait")
        return metrics

    def emit(metrics: dict, prepared: Prepared, laps: tuple[dict, float]) -> None:
        """Finish step `metrics["step"]`'s row with the host time of the iteration in which
        its metrics arrived (in steady state, one step period)."""
        host_s, blocked_dispatch_s = laps
        step, w = metrics["step"], backend.world_size
        capacity_of = getattr(backend, "capacity_of", None)
        metrics |= step_metrics(prepared, w, capacity_of, metrics.get("token_capacity"))
        metrics.setdefault("num_compiles", 0)
        elapsed, tokens = sum(host_s.values()), metrics["global_tokens"]
        metrics["step_time_s"] = elapsed
        metrics["tokens_per_s"] = tokens / elapsed if elapsed else 0.0
        metrics["tflops_per_device"] = (
            metrics["global_flops"] / elapsed / 1e12 / w if elapsed else 0.0
        )
        metrics["host_s"] = host_s
        balancer_s = host_s["stats_gather"] + host_s["partition_wait"] + host_s["exchange"]
        metrics["balancer_s"] = balancer_s
        # What the host's wait for the device (fetching, or blocked in a dispatch call) could
        # not absorb is on the critical path.
        metrics["device_wait_s"] = host_s["fetch_wait"] + blocked_dispatch_s
        metrics["exposed_balancer_s"] = max(0.0, balancer_s - metrics["device_wait_s"])
        metrics["perturbed"] = step in perturbed
        metrics["fetch_lag"] = lag
        if probe is not None:
            found = probe(step, prepared)
            if found:
                metrics.update(found)
                perturbed.update(range(step + 1, step + 1 + lag))
        history.append(metrics)
        if on_step:
            on_step(step, metrics)
        clock.lap("probe_and_log")

    try:
        current = finish(start())
        clock.take()  # the prologue belongs to no step
        fetched = None  # (metrics, prepared) of the step whose metrics arrived this iteration
        pending: collections.deque = collections.deque()  # (step, handle, prepared), oldest first
        for i in range(num_steps):
            step = start_step + i
            following = start() if i + 1 < num_steps else None
            loss_tokens_ = int(current.stats[:, STAT_LOSS_TOKENS].sum())
            with annotate("hstu.forward_backward"):
                handle = backend.forward_backward(current.device_batch, loss_tokens_, current.stats)
            clock.lap("dispatch")
            following = finish(following) if following is not None else None
            with annotate("hstu.optimizer_step"):
                out = backend.optimizer_step(handle)
            clock.lap("dispatch")
            if len(pending) == lag:
                oldest = pending.popleft()
                fetched = (fetch(*oldest), oldest[2])
            with annotate("hstu.checkpoint"):
                if after_dispatch and after_dispatch(step):
                    perturbed.add(step - lag)  # this iteration's time is step - lag's row
            clock.lap("checkpoint")
            if fetched is not None:
                with annotate("hstu.log"):
                    emit(*fetched, clock.take())
                fetched = None
            pending.append((step, out, current))
            current = following
            if should_stop is not None and should_stop(step):
                break
        while pending:
            oldest = pending.popleft()
            metrics = fetch(*oldest)
            emit(metrics, oldest[2], clock.take())
    finally:
        if isinstance(source, HostPrefetcher):
            source.close()
        balancer.close()
    return history
