"""The core schedule, driven by a single-process numpy backend that simulates W ranks."""

import threading
import time

import numpy as np
import pytest

import hstu.pipeline as pipeline
from hstu.batch import concat
from hstu.data import dataset_from_config
from hstu.partition import imbalance
from hstu.shuffle_plan import exchange_reference
from hstu.workload import HSTUCost


class NumpyBackend:
    """The Backend protocol over the core's numpy reference ops (one process, all ranks)."""

    def __init__(self, world_size):
        self.world_size = world_size
        self.local_ranks = list(range(world_size))
        self.calls, self.seen = [], []

    def to_device(self, batches):
        self.calls.append("to_device")
        return list(batches)

    def allgather_stats(self, local_stats):
        self.calls.append("allgather_stats")
        return local_stats.copy()

    def exchange(self, batches, plan, stats):
        self.calls.append("exchange")
        return exchange_reference(batches, plan)

    def forward_backward(self, batches, global_loss_tokens, stats):
        self.calls.append("forward_backward")
        self.seen.append(batches)
        # the stats handed over are this very step's: they count the tokens being stepped
        assert int(stats[:, pipeline.STAT_TOKENS].sum()) == sum(
            b.num_real_tokens() for b in batches
        )
        assert int(stats[:, pipeline.STAT_LOSS_TOKENS].sum()) == global_loss_tokens
        # a loss that depends on every real sample, normalised by the global target count
        local = [b.lengths["candidate"][: b.actual_batch_size].sum() for b in batches]
        return sum(local) / global_loss_tokens

    def optimizer_step(self, handle):
        self.calls.append("optimizer_step")
        return {"loss": float(handle)}

    def fetch_metrics(self, pending):
        self.calls.append("fetch_metrics")
        return pending


def batches_of(cfg, world):
    ranks = [dataset_from_config(cfg, world, r) for r in range(world)]
    while True:
        yield [next(ds) for ds in ranks]


@pytest.mark.parametrize("shuffler", ["identity", "balanced"])
def test_schedule_order_and_metrics(demo_cfg, shuffler):
    backend = NumpyBackend(4)
    cost = HSTUCost.from_model_config(demo_cfg.model)
    rows = pipeline.run(backend, batches_of(demo_cfg, 4), 3, cost, "ranking", shuffler=shuffler)
    assert [r["step"] for r in rows] == [0, 1, 2]
    # prologue for batch 0, then per step: phase 1 (i+1), fwd/bwd (i), phase 2 (i+1), update,
    # and only then the metrics of step i - 1: the host never waits for the step it dispatched
    ex = ["exchange"] if shuffler == "balanced" else []
    step = ["to_device", "allgather_stats", "forward_backward", *ex, "optimizer_step"]
    last = ["forward_backward", "optimizer_step", "fetch_metrics", "fetch_metrics"]
    assert backend.calls == [
        *("to_device", "allgather_stats", *ex),
        *step,
        *step,
        "fetch_metrics",
        *last,
    ]
    for r in rows:
        assert r["loss"] == pytest.approx(1.0)  # every candidate counted once, globally
        assert len(r["rank_workloads_before"]) == 4
        assert sum(r["rank_workloads_before"]) == pytest.approx(sum(r["rank_workloads_after"]))
        assert r["imbalance_after"] <= r["imbalance_before"] + 1e-12
        for key in ("global_tokens", "step_time_s", "tokens_per_s", "imbalance_before"):
            assert key in r
        # no padded buffer (a dynamic-shape backend): capacity = the busiest rank, no padding
        assert r["token_capacity"] == r["tokens_max_after"] <= r["tokens_max_before"] or (
            shuffler == "identity" and r["tokens_max_after"] == r["tokens_max_before"]
        )
        assert r["padding_waste"] == 0.0
        assert r["num_compiles"] == 0
    if shuffler == "identity":
        assert all(r["imbalance_after"] == r["imbalance_before"] for r in rows)
    else:
        assert np.median([r["imbalance_after"] for r in rows]) < np.median(
            [r["imbalance_before"] for r in rows]
        )


class PerRankCapacityBackend(NumpyBackend):
    """Pads each rank's tokens to its own buffer, a multiple of 64 (torch's graphs)."""

    def __init__(self, world_size):
        super().__init__(world_size)
        self.asked = []

    def capacity_of(self, num_tokens):
        self.asked.append(num_tokens)
        return -(-num_tokens // 64) * 64


class SharedCapacityBackend(NumpyBackend):
    """Pads every rank to one reported capacity (JAX's single program)."""

    def optimizer_step(self, handle):
        return {"loss": float(handle), "token_capacity": 4096}


def test_padding_counts_each_ranks_own_buffer_or_the_shared_one(demo_cfg):
    cost = HSTUCost.from_model_config(demo_cfg.model)
    own = PerRankCapacityBackend(4)
    rows = pipeline.run(own, batches_of(demo_cfg, 4), 3, cost, "ranking", shuffler="identity")
    assert len(own.asked) == 4 * len(rows)  # each rank's tokens, once per step
    for i, r in enumerate(rows):
        ranks = own.asked[4 * i : 4 * i + 4]
        assert sum(ranks) == r["global_tokens"] and max(ranks) == r["tokens_max_after"]
        padded = sum(-(-n // 64) * 64 for n in ranks)
        assert r["padding_waste"] == pytest.approx(padded / r["global_tokens"] - 1)
        assert r["token_capacity"] == -(-max(ranks) // 64) * 64
        # the ranks differ, so one buffer for all would have counted more padding
        assert r["padding_waste"] < 4 * r["token_capacity"] / r["global_tokens"] - 1
    shared = SharedCapacityBackend(4)
    rows = pipeline.run(shared, batches_of(demo_cfg, 4), 2, cost, "ranking", shuffler="identity")
    for r in rows:
        assert r["token_capacity"] == 4096
        assert r["padding_waste"] == pytest.approx(4 * 4096 / r["global_tokens"] - 1)


def test_balanced_run_trains_on_the_same_samples(demo_cfg):
    cost = HSTUCost.from_model_config(demo_cfg.model)
    ids = {}
    for shuffler in ("identity", "balanced"):
        backend = NumpyBackend(4)
        pipeline.run(backend, batches_of(demo_cfg, 4), 2, cost, "ranking", shuffler=shuffler)
        ids[shuffler] = [
            np.sort(concat([b.strip_padding() for b in step]).dense["sample_id"])
            for step in backend.seen
        ]
    for a, b in zip(ids["identity"], ids["balanced"], strict=True):
        np.testing.assert_array_equal(a, b)


def test_one_rank_has_nothing_to_balance_so_nothing_is_exchanged(demo_cfg):
    cost = HSTUCost.from_model_config(demo_cfg.model)
    rows = {}
    for shuffler in ("identity", "balanced"):
        backend = NumpyBackend(1)
        rows[shuffler] = pipeline.run(
            backend, batches_of(demo_cfg, 1), 3, cost, "ranking", shuffler=shuffler
        )
        assert "exchange" not in backend.calls
    assert [r["loss"] for r in rows["balanced"]] == [r["loss"] for r in rows["identity"]]
    assert all(r["imbalance_after"] == 1.0 for r in rows["balanced"])


def test_partition_runs_on_the_worker_thread(demo_cfg, monkeypatch):
    threads = []
    real = pipeline.make_plan

    def spy(*args):
        threads.append(threading.current_thread().name)
        return real(*args)

    monkeypatch.setattr(pipeline, "make_plan", spy)
    cost = HSTUCost.from_model_config(demo_cfg.model)
    pipeline.run(NumpyBackend(2), batches_of(demo_cfg, 2), 2, cost, "ranking")
    assert threads and all(t.startswith("partition") for t in threads)


def test_bad_batch_fails_before_any_collective(demo_cfg):
    backend = NumpyBackend(2)

    def bad():
        parts = next(batches_of(demo_cfg, 2))
        parts[1].lengths["item"][0] += 1
        yield parts

    with pytest.raises(ValueError, match="rank 1"):
        pipeline.run(backend, bad(), 1, HSTUCost.from_model_config(demo_cfg.model), "ranking")
    assert backend.calls == []


def test_stats_carry_per_key_lengths(demo_cfg):
    parts = next(batches_of(demo_cfg, 2))
    stats = pipeline.sample_stats(parts, HSTUCost.from_model_config(demo_cfg.model), "ranking")
    lens = pipeline.gathered_lengths(stats, parts[0].keys)
    np.testing.assert_array_equal(lens["item"], concat(parts).lengths["item"])
    per_rank = stats[:, pipeline.STAT_WORKLOAD].reshape(2, -1).sum(1)
    m = pipeline.step_metrics(
        pipeline.Prepared(None, stats, pipeline.identity_plan(stats[:, 3] > 0, 2)), 2
    )
    assert m["imbalance_before"] == pytest.approx(per_rank.max() / per_rank.mean())
    assert m["imbalance_before"] == pytest.approx(
        imbalance(stats[:, 0], [np.arange(8), np.arange(8, 16)])
    )


def test_prefetcher_reads_ahead_on_its_thread_and_never_past_the_limit():
    readers = []

    def source():
        for i in range(100):
            readers.append(threading.current_thread().name)
            yield i

    fetch = pipeline.HostPrefetcher(source(), lambda x: x * 10, limit=5, depth=2)
    assert [next(fetch) for _ in range(5)] == [0, 10, 20, 30, 40]
    with pytest.raises(StopIteration):
        next(fetch)
    fetch.close()
    assert len(readers) == 5 and set(readers) == {"host-prefetch"}


def test_prefetcher_hands_errors_to_the_consumer():
    def source():
        yield 1
        raise ValueError("bad batch on rank 2")

    fetch = pipeline.HostPrefetcher(source(), lambda x: x, limit=3)
    assert next(fetch) == 1
    with pytest.raises(ValueError, match="rank 2"):
        next(fetch)
    fetch.close()


@pytest.mark.parametrize("prefetch", [0, 3])
def test_prefetch_depth_does_not_change_the_run(demo_cfg, prefetch):
    cost = HSTUCost.from_model_config(demo_cfg.model)
    rows = pipeline.run(
        NumpyBackend(2), batches_of(demo_cfg, 2), 4, cost, "ranking", prefetch=prefetch
    )
    base = pipeline.run(NumpyBackend(2), batches_of(demo_cfg, 2), 4, cost, "ranking")
    assert [r["rank_workloads_after"] for r in rows] == [r["rank_workloads_after"] for r in base]


def test_checkpoint_hook_sees_each_step_before_the_next_is_dispatched(demo_cfg):
    backend = NumpyBackend(2)
    seen = []

    def after_dispatch(step):
        seen.append((step, len(backend.seen), backend.calls[-1]))

    cost = HSTUCost.from_model_config(demo_cfg.model)
    pipeline.run(
        backend, batches_of(demo_cfg, 2), 3, cost, "ranking", after_dispatch=after_dispatch
    )
    # step s's update is dispatched (s + 1 forward passes so far), the next forward is not
    assert [(s, n) for s, n, _ in seen] == [(0, 1), (1, 2), (2, 3)]


def test_model_checks_run_on_the_host_before_any_collective(demo_cfg):
    backend = NumpyBackend(2)
    checked = []

    def check(batch, rank):
        checked.append(rank)
        if rank == 1:
            raise ValueError(f"bad ids on rank {rank}")

    with pytest.raises(ValueError, match="rank 1"):
        pipeline.run(
            backend,
            batches_of(demo_cfg, 2),
            1,
            HSTUCost.from_model_config(demo_cfg.model),
            "ranking",
            check=check,
        )
    assert checked == [0, 1] and backend.calls == []


class _FetchOrderBackend(NumpyBackend):
    """Records, at each fetch, how many steps had been dispatched (forward passes so far)."""

    def __init__(self, world_size):
        super().__init__(world_size)
        self.fetched_at = []

    def optimizer_step(self, handle):
        return {**super().optimizer_step(handle), "step_index": len(self.seen) - 1}

    def fetch_metrics(self, pending):
        self.fetched_at.append((pending["step_index"], len(self.seen)))
        return super().fetch_metrics({"loss": pending["loss"]})


@pytest.mark.parametrize("lag", [1, 2, 3])
def test_metrics_arrive_lag_steps_late_and_every_row_is_kept(demo_cfg, lag):
    """Step i's metrics are read once step i + lag is dispatched (the device's queue holds lag
    steps), the run's last steps drain in order, and what the rows say does not depend on the
    lag (the same steps, losses and host phases)."""
    cost = HSTUCost.from_model_config(demo_cfg.model)
    backend = _FetchOrderBackend(2)
    rows = pipeline.run(backend, batches_of(demo_cfg, 2), 6, cost, "ranking", lag=lag)
    steps = 6
    expect = [(i, min(i + lag, steps - 1) + 1) for i in range(steps)]
    assert backend.fetched_at == expect
    assert [r["step"] for r in rows] == list(range(steps))
    assert all(r["fetch_lag"] == lag for r in rows)
    base = pipeline.run(NumpyBackend(2), batches_of(demo_cfg, 2), steps, cost, "ranking")
    assert [r["loss"] for r in rows] == [r["loss"] for r in base]
    assert [r["global_tokens"] for r in rows] == [r["global_tokens"] for r in base]
    for r in rows:
        assert set(r["host_s"]) == set(pipeline.HOST_PHASES)
        assert r["step_time_s"] == pytest.approx(sum(r["host_s"].values()))


@pytest.mark.parametrize(
    ("lag", "save_after", "marked"), [(1, 4, [2, 3]), (2, 5, [2, 3]), (2, 6, [2, 3, 4])]
)
def test_rows_whose_time_holds_a_save_or_a_probe_are_marked(demo_cfg, lag, save_after, marked):
    """A row's time is the iteration in which its metrics arrive: a save after dispatching
    step s lands in row s - lag; a probe of row 1 drains the device's queue, so the lag rows
    after it (its time, then the refill) are marked."""
    cost = HSTUCost.from_model_config(demo_cfg.model)
    rows = pipeline.run(
        NumpyBackend(2),
        batches_of(demo_cfg, 2),
        7,
        cost,
        "ranking",
        after_dispatch=lambda step: step == save_after,
        probe=lambda step, prepared: {"probed": True} if step == 1 else None,
        lag=lag,
    )
    assert [r["step"] for r in rows if r["perturbed"]] == marked
    assert rows[1]["probed"] and all(set(r["host_s"]) == set(pipeline.HOST_PHASES) for r in rows)
    for r in rows:
        assert r["step_time_s"] == pytest.approx(sum(r["host_s"].values()))


@pytest.mark.parametrize("lag", [0, -1, 1.5])
def test_a_lag_below_one_is_refused_before_anything_runs(demo_cfg, lag):
    backend = NumpyBackend(2)
    cost = HSTUCost.from_model_config(demo_cfg.model)
    with pytest.raises(ValueError, match="lag must be an int >= 1"):
        pipeline.run(backend, batches_of(demo_cfg, 2), 2, cost, "ranking", lag=lag)
    assert backend.calls == []


class _TimedBackend(NumpyBackend):
    """The numpy backend with a device that is `behind` (dispatch blocks, as JAX's does when
    the device queue is full) or a host that is the bottleneck (dispatch burns the CPU), and an
    exchange that burns `exchange_s` of host CPU."""

    def __init__(self, world_size, behind: bool, exchange_s: float = 0.004):
        super().__init__(world_size)
        self.behind, self.exchange_s = behind, exchange_s

    @staticmethod
    def _spin(seconds):
        end = time.thread_time() + seconds
        while time.thread_time() < end:
            pass

    def exchange(self, batches, plan, stats):
        self._spin(self.exchange_s)
        return super().exchange(batches, plan, stats)

    def forward_backward(self, batches, global_loss_tokens, stats):
        time.sleep(0.02) if self.behind else self._spin(0.02)
        return super().forward_backward(batches, global_loss_tokens, stats)


@pytest.mark.parametrize("behind", [True, False])
def test_exposed_balancer_time_counts_a_dispatch_blocked_on_the_device(demo_cfg, behind):
    """A host blocked in dispatch is waiting for the device: balancer work fits in that wait
    (exposed 0); a host busy dispatching has no wait to hide it in (exposed = its time)."""
    backend = _TimedBackend(4, behind)
    cost = HSTUCost.from_model_config(demo_cfg.model)
    rows = pipeline.run(backend, batches_of(demo_cfg, 4), 5, cost, "ranking", prefetch=0)
    for r in rows[1:-2]:  # steady state: one dispatch and one exchange per period
        assert r["balancer_s"] >= 0.004
        if behind:
            assert r["device_wait_s"] >= 0.015 and r["exposed_balancer_s"] == 0.0
        else:
            # The 20 ms the dispatch spun are CPU time, never read as waiting; only a
            # preemption of the thread (any length on a loaded machine) may be.
            waited_in = r["host_s"]["dispatch"] + r["host_s"]["fetch_wait"]
            assert waited_in - r["device_wait_s"] >= 0.02 * 0.99
            want = max(0.0, r["balancer_s"] - r["device_wait_s"])
            assert r["exposed_balancer_s"] == pytest.approx(want)
