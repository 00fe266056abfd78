"""torch (4 gloo ranks) vs jax (4 host devices) on the same global batches: per-sample workloads
computed by each backend from its own tensors, the partitions, and the exchanged batch of every
rank (allgather and all2all), all identical to each other and to the core."""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("torchrec")
pytest.importorskip("jax")

from parity_workers import (  # noqa: E402
    WORLD,
    exchange_cases,
    jax_exchange,
    jax_test_env,
    run_subprocess_worker,
    torch_exchange,
)
from torch_workers import run_on_ranks  # noqa: E402

from hstu.pipeline import STAT_REAL, STAT_WORKLOAD, sample_stats  # noqa: E402
from hstu.shuffle_plan import exchange_reference, make_plan  # noqa: E402
from hstu.workload import HSTUCost  # noqa: E402

EXCHANGES = ("allgather", "all2all")
pytestmark = pytest.mark.multirank


@pytest.fixture(scope="module")
def results():
    torch_out = run_on_ranks(torch_exchange, WORLD)  # [rank][case]
    jax_out = run_subprocess_worker(jax_exchange.__name__, jax_test_env(WORLD))  # [case]
    core = []
    for task, cfg, batches in exchange_cases():
        cost = HSTUCost.from_model_config(cfg.model)
        stats = sample_stats(batches, cost, task)
        plan = make_plan(stats[:, STAT_WORKLOAD], stats[:, STAT_REAL].astype(bool), WORLD)
        core.append(
            {
                "batches": batches,
                "cost": cost,
                "stats": stats,
                "plan": plan,
                "exchanged": exchange_reference(batches, plan),
            }
        )
    return torch_out, jax_out, core


def test_cases_move_samples(results):
    _, _, core = results
    # the demo and retrieval batches must really move samples, or the exchange is not tested
    assert all(c["plan"].num_moved() > 0 for c in core[:3])
    assert core[3]["plan"].num_moved() == 0  # all padding


def test_workloads_from_each_backends_tensors_equal_the_core(results):
    torch_out, jax_out, core = results
    for i, c in enumerate(core):
        want = [c["cost"].batch_flops(b) for b in c["batches"]]
        np.testing.assert_array_equal(jax_out[i]["workloads"], np.stack(want), err_msg=f"case {i}")
        assert jax_out[i]["workloads"].dtype == np.int64
        for rank in range(WORLD):
            got = torch_out[rank][i]["workloads"]
            assert got.dtype == np.int64
            np.testing.assert_array_equal(got, want[rank], err_msg=f"case {i} rank {rank}")
        for kind in EXCHANGES:  # and after the exchange, from the exchanged tensors
            after = [c["cost"].batch_flops(b) for b in c["exchanged"]]
            np.testing.assert_array_equal(jax_out[i][kind]["workloads_after"], np.stack(after))
            for rank in range(WORLD):
                np.testing.assert_array_equal(
                    torch_out[rank][i][kind]["workloads_after"], after[rank]
                )


def test_gathered_stats_and_partitions_are_identical(results):
    torch_out, jax_out, core = results
    for i, c in enumerate(core):
        for kind in EXCHANGES:
            sides = [("jax", jax_out[i][kind])] + [
                (f"torch rank {r}", torch_out[r][i][kind]) for r in range(WORLD)
            ]
            for who, got in sides:
                what = f"case {i} {kind} {who}"
                np.testing.assert_array_equal(got["stats"], c["stats"], err_msg=what)
                np.testing.assert_array_equal(got["indices"], c["plan"].indices, err_msg=what)
                np.testing.assert_array_equal(got["num_real"], c["plan"].num_real, err_msg=what)


def test_exchanged_batches_are_identical_on_every_rank(results):
    torch_out, jax_out, core = results
    for i, c in enumerate(core):
        for kind in EXCHANGES:
            for rank in range(WORLD):
                want = c["exchanged"][rank]
                torch_batch = torch_out[rank][i][kind]["batch"]
                jax_batch = jax_out[i][kind]["batches"][rank]
                where = f"case {i} {kind} rank {rank}"
                assert torch_batch.diff(want) == [], f"{where}: torch vs reference"
                assert jax_batch.diff(want) == [], f"{where}: jax vs reference"
                assert torch_batch.diff(jax_batch) == [], f"{where}: torch vs jax"
