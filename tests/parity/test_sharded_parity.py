"""Sharded embedding tables, both backends: 30 steps of a small ranking model at 2 ranks (fp32,
row-wise Adagrad for the tables, AdamW for the rest) give one loss curve per sharding, the same
in torch (TorchRec DMP, fused TBE) and jax (rows over the devices, all_to_all lookups) within
rel 1e-4, and the same as the replicated-table baseline at step 0."""

from __future__ import annotations

import pytest

pytest.importorskip("torchrec")
pytest.importorskip("jax")

from parity_workers import (  # noqa: E402
    SHARDED_STEPS,
    SHARDINGS,
    jax_sharded_curves,
    jax_test_env,
    run_subprocess_worker,
)
from torch_workers import run_on_ranks  # noqa: E402

from hstu.parity import rel_diff  # noqa: E402

RTOL = 1e-4
pytestmark = [pytest.mark.multirank, pytest.mark.slow]  # ~20 s: `make test-slow`


@pytest.fixture(scope="module")
def curves(tmp_path_factory):
    from parity_workers import torch_sharded_curves

    out = tmp_path_factory.mktemp("sharded_parity")
    torch_curves = run_on_ranks(torch_sharded_curves, 2, str(out))[0]
    jax_curves = run_subprocess_worker(
        jax_sharded_curves.__name__, jax_test_env(devices=2), out_dir=str(out)
    )
    return {"torch": torch_curves, "jax": jax_curves}


@pytest.mark.parametrize("sharding", SHARDINGS)
def test_torch_and_jax_train_the_same_curve(curves, sharding):
    a, b = curves["torch"][sharding], curves["jax"][sharding]
    assert len(a) == len(b) == SHARDED_STEPS
    worst = max(range(SHARDED_STEPS), key=lambda i: rel_diff(a[i], b[i]))
    assert rel_diff(a[worst], b[worst]) <= RTOL, (sharding, worst, a[worst], b[worst])
    assert a[-1] < a[0]  # it trains


def test_every_sharding_starts_from_the_same_model(curves):
    """Same init (each rank draws its own rows of the one seeded table): one step-0 loss."""
    first = {(backend, s): c[s][0] for backend, c in curves.items() for s in SHARDINGS}
    ref = first[("torch", "row_wise")]
    assert all(rel_diff(v, ref) <= 1e-6 for v in first.values()), first
