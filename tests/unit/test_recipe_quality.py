"""`scripts/recipe_quality.py`: the shipped recipes on generated publisher-format samples. The
samples hold each recipe's item count; bad arguments stop before any work; end to end (slow),
both backends train a recipe in their own processes and, without dropout, report the same
test metrics."""

from __future__ import annotations

import json

import pytest

from hstu import backends
from hstu.config import load_config
from hstu.testing import load_script


@pytest.fixture(scope="module")
def rq():
    return load_script("recipe_quality")


def test_samples_hold_each_recipes_items(rq):
    for recipe in rq.RECIPES:
        dataset, spec = rq.sample_spec(recipe, 1.0)
        assert spec.num_items == load_config(recipe).model.num_items
        assert 3 * spec.max_events < spec.num_items  # a planted walk never wraps onto itself
        assert load_config(recipe).data.path.endswith(dataset)
    assert rq.sample_spec("ml1m_retrieval", 1.0)[1].num_users == 6040
    assert rq.sample_spec("ml1m_retrieval", 0.5)[1].num_users == 3020


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--recipes", "ml1m_retrieval,nope"], "unknown recipe(s) ['nope']"),
        (["--backends", "tf"], "backend 'tf' is not available"),
        (["--steps", "0"], "--steps must be >= 1"),
    ],
)
def test_bad_arguments_are_named(rq, argv, message, capsys, tmp_path):
    with pytest.raises(SystemExit) as e:
        rq.main([*argv, "--work", str(tmp_path)])
    assert e.value.code == 2
    assert message in capsys.readouterr().err
    assert not any(tmp_path.iterdir())  # nothing generated


@pytest.mark.slow
def test_both_backends_train_a_recipe_to_the_same_metrics(rq, tmp_path, capsys):
    names = [b for b in ("torch", "jax") if backends.available(b)[0]]
    if len(names) < 2:
        pytest.skip("needs both backends")
    out = tmp_path / "report.json"
    small = ["model.attention=reference", "model.dropout=0.0", "model.num_layers=1"]
    small += ["data.batch_size=8", "data.max_history=16", "eval.max_users=40"]
    argv = ["--recipes", "ml1m_retrieval", "--steps", "3", "--scale", "0.01"]
    assert rq.main([*argv, "--work", str(tmp_path), "--json", str(out), *small]) == 0
    report = json.loads(out.read_text())
    sample = report["samples"]["ml1m_retrieval"]
    assert sample["users"] == 60 and sample["items"] == 3706 and sample["events"] > 60 * 19
    assert report["failed"] == []
    runs = {r["backend"]: r for r in report["runs"]}
    assert set(runs) == {"torch", "jax"}
    for r in runs.values():
        assert r["steps"] == 3 and r["step_ms"] > 0
        assert set(r["baselines"]) == {"popularity", "random"}
        assert r["metrics"]["num_users"] == 60  # the test split: every user
    for key, value in runs["torch"]["metrics"].items():
        assert runs["jax"]["metrics"][key] == pytest.approx(value, rel=1e-3, abs=1e-3), key
    printed = capsys.readouterr().out
    assert "ml1m_retrieval     torch" in printed and "full/hr@10" in printed
