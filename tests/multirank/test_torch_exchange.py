"""4 gloo ranks: the allgather and all2all exchanges equal `exchange_reference` byte for byte,
and the fused allgather issues a fixed number of collectives whatever the number of keys."""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("torchrec")

from torch_workers import run_on_ranks  # noqa: E402

from hstu.batch import JaggedBatch  # noqa: E402
from hstu.testing import EXCHANGE_CASES  # noqa: E402

WORLD = 4
BATCH = 6
CASES = list(EXCHANGE_CASES)
COLLECTIVES = (
    "all_gather",
    "all_gather_into_tensor",
    "all_gather_single",
    "all_to_all",
    "all_to_all_single",
    "all_reduce",
    "broadcast",
    "gather",
    "scatter",
    "reduce",
    "reduce_scatter",
    "reduce_scatter_tensor",
    "all_gather_object",
    "barrier",
    "send",
    "recv",
    "isend",
    "irecv",
)


def _with_extra_dtypes(batches: list[JaggedBatch], seed: int) -> list[JaggedBatch]:
    """Add dense fields of other dtypes/shapes and an int32 key: bytes must survive too."""
    rng = np.random.default_rng(seed)
    for b in batches:
        real = np.arange(b.batch_size) < b.actual_batch_size
        score = rng.normal(size=(b.batch_size, 3)).astype(np.float32)
        b.dense["score"] = np.where(real[:, None], score, 0).astype(np.float32)
        b.dense["flag"] = real & (rng.random(b.batch_size) < 0.5)
        b.values["label"] = b.values["label"].astype(np.int32)
    return batches


def _global_batch(task: str, real: tuple[int, ...], seed: int) -> list[JaggedBatch]:
    from hstu.config import load_config
    from hstu.testing import DEMO_CONFIG, make_global_batch

    cfg = load_config(
        DEMO_CONFIG, [f"model.task={task}", f"data.seed={seed}", "data.max_history=24"]
    )
    return _with_extra_dtypes(make_global_batch(cfg, BATCH, real, first_id=100 * seed), seed)


def _random_keys_batch(num_keys: int, real: int, seed: int) -> JaggedBatch:
    rng = np.random.default_rng(seed)
    lengths, values = {}, {}
    for i in range(num_keys):
        lens = np.where(np.arange(BATCH) < real, rng.integers(0, 5, BATCH), 0).astype(np.int64)
        lengths[f"k{i}"], values[f"k{i}"] = lens, rng.integers(0, 1000, int(lens.sum()))
    dense = {"sample_id": np.where(np.arange(BATCH) < real, np.arange(BATCH) + 1, 0)}
    return JaggedBatch(BATCH, real, lengths, values, dense)


def _exchange_worker(rank: int, world: int, device: str) -> dict:
    import torch
    import torch.distributed as dist

    from hstu.config import load_config
    from hstu.pipeline import STAT_REAL, STAT_WORKLOAD, sample_stats
    from hstu.shuffle_plan import exchange_reference, identity_plan, make_plan
    from hstu.signature import NUM_SIGNATURE
    from hstu.testing import DEMO_CONFIG
    from hstu.torch_backend.batch import to_jagged, to_torch
    from hstu.torch_backend.collectives import all2all_exchange, allgather_exchange, allgather_stats
    from hstu.workload import HSTUCost

    cost = HSTUCost.from_model_config(load_config(DEMO_CONFIG).model)
    failures = []
    for seed, (task, real) in enumerate(CASES):
        batches = _global_batch(task, real[:world], seed)
        stats = allgather_stats(sample_stats([batches[rank]], cost, task), world, device)
        if not np.array_equal(stats, sample_stats(batches, cost, task)):
            failures.append(f"case {seed}: gathered stats differ")
        is_real = stats[:, STAT_REAL].astype(bool)
        plans = {
            "balanced": make_plan(stats[:, STAT_WORKLOAD], is_real, world),
            "identity": identity_plan(is_real, world),
        }
        for plan_name, plan in plans.items():
            want = exchange_reference(batches, plan)[rank]
            for name, fn in (("allgather", allgather_exchange), ("all2all", all2all_exchange)):
                moved = fn(to_torch(batches[rank]).to(device), plan, stats, rank)
                got = to_jagged(moved)
                for d in got.diff(want):
                    failures.append(f"case {seed} {task} {real} {plan_name}/{name}: {d}")
                # the token layout built on the host from the plan's lengths is the one of the
                # batch this rank received
                here = {k: v.cpu() for k, v in moved.token_layout().views().items()}
                for k, v in to_torch(want).token_layout().views().items():
                    if not torch.equal(here[k], v):
                        failures.append(f"case {seed} {plan_name}/{name}: layout {k}")
                if got.actual_batch_size != int(plan.num_real[rank]):
                    failures.append(f"case {seed} {name}: actual_batch_size")

    # Count collectives (every torch.distributed entry point) for 2 keys vs 9 keys.
    counts = {}
    originals = {n: getattr(dist, n) for n in COLLECTIVES if hasattr(dist, n)}
    calls = []

    def wrap(name, fn):
        def counted(*args, **kwargs):
            calls.append(name)
            return fn(*args, **kwargs)

        return counted

    for num_keys in (2, 9):
        batches = [
            _random_keys_batch(num_keys, real, 7 * r + num_keys)
            for r, real in enumerate((6, 3, 0, 5)[:world])
        ]
        local = batches[rank]
        stats = np.concatenate(
            [
                np.stack(
                    [
                        np.arange(BATCH) * (np.arange(BATCH) < b.actual_batch_size) + 1,
                        np.ones(BATCH),
                        np.ones(BATCH),
                        (np.arange(BATCH) < b.actual_batch_size),
                    ]
                    + [np.zeros(BATCH)] * NUM_SIGNATURE  # the batch signature's columns
                    + [b.lengths[k] for k in b.keys],
                    axis=1,
                )
                for b in batches
            ]
        ).astype(np.int64)
        stats[:, STAT_WORKLOAD] *= stats[:, STAT_REAL]
        plan = make_plan(stats[:, STAT_WORKLOAD], stats[:, STAT_REAL].astype(bool), world)
        want = exchange_reference(batches, plan)[rank]
        for name, fn in (("allgather", allgather_exchange), ("all2all", all2all_exchange)):
            calls.clear()
            for n, f in originals.items():
                setattr(dist, n, wrap(n, f))
            try:
                got = to_jagged(fn(to_torch(local).to(device), plan, stats, rank))
            finally:
                for n, f in originals.items():
                    setattr(dist, n, f)
            counts[(name, num_keys)] = list(calls)
            failures += [f"{num_keys} keys {name}: {d}" for d in got.diff(want)]
    return {"failures": failures, "counts": counts}


@pytest.mark.multirank
def test_exchanges_match_reference_and_fixed_collective_count():
    results = run_on_ranks(_exchange_worker, WORLD)
    for rank, res in enumerate(results):
        assert not res["failures"], f"rank {rank}: " + "\n".join(res["failures"][:20])
    counts = results[0]["counts"]
    # lengths, values, dense: 3 collectives whatever the number of keys
    assert len(counts[("allgather", 2)]) == len(counts[("allgather", 9)]) == 3, counts
    # all2all: values + dense only (lengths and sizes come from the gathered stats)
    assert counts[("all2all", 2)] == counts[("all2all", 9)] == ["all_to_all_single"] * 2, counts


@pytest.mark.gpu
@pytest.mark.multirank
def test_nccl_exchanges_match_reference():
    import torch

    world = min(WORLD, torch.cuda.device_count())
    if world < 2:
        pytest.skip("needs 2 GPUs for NCCL ranks")
    results = run_on_ranks(_exchange_worker, world, device="cuda")
    for rank, res in enumerate(results):
        assert not res["failures"], f"rank {rank}: " + "\n".join(res["failures"][:20])
