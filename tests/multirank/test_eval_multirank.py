"""Evaluation in a multi-rank run: rank 0 evaluates, every rank meets at one collective per
evaluation, and early stopping ends all of them after the same step (torch, 2 gloo ranks);
sharded tables are gathered whole for it (torch and jax, 2 ranks)."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("torchrec")

from hstu.cli import main  # noqa: E402
from hstu.metrics import read_rows  # noqa: E402
from hstu.testing import prepared_overrides  # noqa: E402

pytestmark = pytest.mark.multirank


def test_early_stopping_ends_every_rank_after_the_same_step(prepared_data, tmp_path, capfd):
    out = tmp_path / "run"
    argv = [
        "train",
        "--backend",
        "torch",
        *prepared_overrides(prepared_data["ml-1m"], "retrieval", out),
        "dist.world_size=2",
        "data.batch_size=16",
        "train.steps=50",
        "train.lr=1e-9",  # the metric cannot improve: the run stops after `patience` more evals
        "train.eval_every=5",
        "train.checkpoint_every=100",
        "eval.early_stop_metric=full/ndcg@10",
        "eval.patience=2",
        "eval.max_users=100",
        "eval.baselines=false",
    ]
    assert main(argv) == 0
    printed = capfd.readouterr().out  # the ranks are processes of their own
    assert "early stopping: full/ndcg@10 did not improve" in printed
    assert "the run ends after step 15" in printed
    # the stop is a last step: checkpointed, with the early-stopping state in its data state
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step-15"]
    assert [r["step"] for r in read_rows(out / "metrics.jsonl")] == list(range(15))
    report = json.loads((out / "eval_test.json").read_text())
    assert (report["step"], report["params_step"]) == (15, 5)  # the best evaluation's params
    lines = [json.loads(x) for x in (out / "eval.jsonl").read_text().splitlines()]
    assert [(r["step"], r["split"]) for r in lines] == [
        (5, "valid"),
        (10, "valid"),
        (15, "valid"),
        (15, "test"),
    ]


# 13 (torch) to 26 s (jax) on 2 cores: in the slow tier (CI runs it after `make test`)
@pytest.mark.slow
@pytest.mark.parametrize("backend", ["torch", "jax"])
def test_sharded_tables_are_gathered_for_evaluation(backend, prepared_data, tmp_path):
    """row_wise tables (each rank holds half the rows: TorchRec DMP / rows over the devices)
    evaluate like data_parallel ones (every rank holds them whole): the same update, so the
    same metrics."""
    if backend == "jax":
        pytest.importorskip("jax")
    reports = {}
    for sharding in ("row_wise", "data_parallel"):
        out = tmp_path / sharding
        argv = [
            "train",
            "--backend",
            backend,
            *prepared_overrides(prepared_data["ml-1m"], "retrieval", out),
            "dist.world_size=2",
            "data.batch_size=16",
            "train.steps=6",
            "train.eval_every=3",
            f"embedding.sharding={sharding}",
            "eval.max_users=100",
            "eval.test_max_users=100",
            "eval.baselines=false",
        ]
        assert main(argv) == 0
        reports[sharding] = json.loads((out / "eval_test.json").read_text())["metrics"]
        lines = (out / "eval.jsonl").read_text().splitlines()
        assert [json.loads(x)["step"] for x in lines] == [3, 6, 6]
    row_wise, replicated = reports["row_wise"], reports["data_parallel"]
    assert set(row_wise) == set(replicated) and "full/ndcg@10" in row_wise
    for key, value in replicated.items():
        assert row_wise[key] == pytest.approx(value, rel=1e-4, abs=1e-6), key
