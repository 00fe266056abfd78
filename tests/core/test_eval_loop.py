"""The backend-neutral evaluation (`hstu.eval_loop`) against brute force, early stopping, and
the checks a prepared dataset puts on a config before any rank starts (numpy only)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from hstu import baselines, capacity
from hstu.cli import main
from hstu.config import load_config
from hstu.data.prepared import PreparedDataset, PreparedSpec
from hstu.data.sources import check_prepared, open_prepared, source_from_config
from hstu.errors import HSTUError
from hstu.eval_loop import TrainingEvaluation, evaluate
from hstu.launch_checks import CheckedSource
from hstu.testing import prepared_overrides


def _cfg(path, task="retrieval", *extra):
    return load_config("demo", [*prepared_overrides(path, task), *extra])


class OracleScorer:
    """Per-user query vectors and an item table drawn from a seed (the item table has spare
    rows past the dataset's items, as a model's may)."""

    def __init__(self, num_users, num_items, dim=8, seed=0):
        rng = np.random.default_rng(seed)
        self.query = rng.normal(size=(num_users, dim)).astype(np.float32)
        self.items = rng.normal(size=(num_items + 5, dim)).astype(np.float32)
        self.batches = []

    def query_embeddings(self, batch):
        self.batches.append(batch)
        return self.query[batch.dense["sample_id"][: batch.actual_batch_size]]

    def item_embeddings(self):
        return self.items

    def __call__(self, users, items):  # the same scores as a baselines.Scorer
        return np.einsum("...d,...d->...", self.query[users], self.items[items])


@pytest.mark.parametrize("batch_size", [7, 64])
def test_retrieval_metrics_match_brute_force(prepared_data, batch_size):
    cfg = _cfg(prepared_data["ml-1m"], "retrieval", "eval.metrics=[full,sampled]")
    cfg.eval.batch_size, cfg.eval.ks = batch_size, [1, 10, 50]
    ds = open_prepared(cfg)
    scorer = OracleScorer(ds.num_users, ds.num_items)
    got = evaluate(scorer, ds, cfg, "test", max_users=150)
    # brute force: every user's whole score row, the target's rank among unseen items
    ranks = []
    for ex in ds.eval_samples("test", 150):
        scores = scorer.query[ex["user"]] @ scorer.items[: ds.num_items].T
        competing = np.ones(ds.num_items, bool)
        competing[ex["seen"]] = False
        competing[ex["target"]] = False
        ranks.append(int((scores[competing] >= scores[ex["target"]]).sum()))
    ranks = np.asarray(ranks)
    assert got["num_users"] == 150
    assert got["full/hr@10"] == pytest.approx(np.mean(ranks < 10))
    assert got["full/mrr"] == pytest.approx(np.mean(1.0 / (ranks + 1)))
    sampled = baselines.evaluate_sampled(ds, "test", scorer, 100, [1, 10, 50], max_users=150)
    for key in ("hr@1", "hr@10", "ndcg@50", "mrr"):
        assert got[f"sampled/{key}"] == pytest.approx(sampled[key])
    # the model never sees the target: no candidate, the history ends before it
    batch = scorer.batches[0]
    assert batch.lengths["candidate"].sum() == 0 and batch.lengths["negative"].sum() == 0
    first = next(ds.eval_samples("test", 1))
    n = len(first["item"])
    np.testing.assert_array_equal(batch.values["item"][:n], first["item"])
    assert (batch.values["item_time"] == 0).all()  # no time bias: timestamps not carried


def test_ranking_metrics_are_the_ranking_drivers(prepared_data):
    cfg = _cfg(prepared_data["kuairand-pure"], "ranking")
    ds = open_prepared(cfg)
    rate = baselines.ItemRateBaseline(ds)

    class RateScorer:
        def candidate_logits(self, batch):
            return rate.logits[batch.values["candidate"]][:, :2]

    got = evaluate(RateScorer(), ds, cfg, "valid")
    want = baselines.evaluate_ranking(ds, "valid", lambda e: rate(e)[:2])
    assert set(got) == {"auc/is_click", "ne/is_click", "auc/long_view", "ne/long_view"} | {
        "num_users"
    }
    for key in ("auc/is_click", "ne/long_view"):
        assert got[key] == pytest.approx(want[key])
    assert got["num_users"] == ds.manifest.num_eval_users


class FakeBackend:
    is_main = True

    def __init__(self, scorer):
        self.scorer, self.flags, self.prepared = scorer, [], 0

    def evaluator(self):
        return self.scorer

    def prepare_evaluation(self):
        self.prepared += 1

    def broadcast_flag(self, flag):
        self.flags.append(flag)
        return flag


class SteppedScorer(OracleScorer):
    """Gets better or worse on command: its query is the target's item row times `quality`
    plus noise, and its 'parameters' are the quality."""

    def __init__(self, ds):
        super().__init__(ds.num_users, ds.num_items)
        self.ds, self.quality, self.loaded = ds, 0.0, []
        targets = {u: ds.eval_sample("valid", u)["target"] for u in ds.eval_users("valid")}
        self.target_row = np.zeros_like(self.query)
        for u, t in targets.items():
            self.target_row[u] = self.items[t]

    def query_embeddings(self, batch):
        users = batch.dense["sample_id"][: batch.actual_batch_size]
        return self.query[users] + self.quality * self.target_row[users]

    def export_params(self):
        return {"quality": np.float32(self.quality)}

    def load_params(self, params):
        self.loaded.append(float(params["quality"]))
        self.quality = float(params["quality"])


def test_early_stopping_keeps_the_best_parameters(prepared_data, tmp_path):
    cfg = _cfg(
        prepared_data["ml-1m"],
        "retrieval",
        "eval.metrics=[full]",
        "eval.early_stop_metric=full/ndcg@10",
        "eval.patience=2",
        "eval.baselines=false",
        "train.eval_every=10",
    )
    ds = open_prepared(cfg)
    scorer = SteppedScorer(ds)
    backend, said = FakeBackend(scorer), []
    ev = TrainingEvaluation(cfg, ds, backend, tmp_path, 0, said.append)
    stops = []
    for done, quality in ((10, 1.0), (20, 5.0), (30, 2.0), (40, 5.0)):
        scorer.quality = quality
        stops.append(ev.after_step(done, lambda: None))
    assert stops == [False, False, False, True] and backend.flags == stops
    assert (ev.best_step, ev.bad) == (20, 2)  # 5.0 again is no gain
    assert any("early stopping: full/ndcg@10 did not improve" in s for s in said)
    ev.finish(40, lambda: None)
    assert scorer.loaded == [5.0]  # the test evaluates the best step's parameters
    report = json.loads((tmp_path / "eval_test.json").read_text())
    assert report["params_step"] == 20 and report["step"] == 40
    lines = [json.loads(x) for x in (tmp_path / "eval.jsonl").read_text().splitlines()]
    assert [(r["step"], r["split"]) for r in lines] == [
        (10, "valid"),
        (20, "valid"),
        (30, "valid"),
        (40, "valid"),
        (40, "test"),
    ]
    # a run resumed from step 30 keeps the lines up to it and replays the counters
    cfg.train.resume = True
    ev2 = TrainingEvaluation(cfg, ds, backend, tmp_path, 30, said.append)
    assert (ev2.best, ev2.best_step, ev2.bad) == (ev.best, 20, 1)
    assert len((tmp_path / "eval.jsonl").read_text().splitlines()) == 3


def test_normalized_entropy_stops_when_it_rises(prepared_data, tmp_path):
    cfg = _cfg(
        prepared_data["kuairand-pure"],
        "ranking",
        "eval.early_stop_metric=ne/is_click",
        "eval.patience=1",
        "eval.final_test=false",
        "train.eval_every=1",
    )
    ds = open_prepared(cfg)

    class Scaled:
        scale = 1.0

        def candidate_logits(self, batch):
            rate = np.log1p(batch.values["candidate"][:, None] % 7) - 1.0
            return np.repeat(rate * self.scale, 2, axis=1)

    scorer = Scaled()
    ev = TrainingEvaluation(cfg, ds, FakeBackend(scorer), tmp_path, 0, lambda s: None)
    scorer.scale = 0.0  # logit 0 everywhere: NE of predicting 1/2
    assert not ev.after_step(1, lambda: None)
    scorer.scale = 25.0  # confident and mostly wrong: a higher NE ends the run
    assert ev.after_step(2, lambda: None) and ev.best_step == 1


def test_the_config_is_held_against_the_manifest(prepared_data, capsys):
    ml, kr = prepared_data["ml-1m"], prepared_data["kuairand-pure"]
    manifest = f"manifest {ml / 'manifest.json'}"
    with pytest.raises(
        HSTUError, match="model.num_items=10 but it has 300 items: set model.num_items=300.*"
    ) as e:
        check_prepared(_cfg(ml, "retrieval", "model.num_items=10", "model.num_actions=4"))
    assert manifest in str(e.value) and "set model.num_actions=10" in str(e.value)
    with pytest.raises(HSTUError, match=r"data.num_contextual=2 but it has 8 contextual"):
        check_prepared(_cfg(kr, "ranking", "data.num_contextual=2"))
    with pytest.raises(HSTUError, match=r"model.num_contextual_ids=4 but .* take 18 ids"):
        check_prepared(_cfg(kr, "ranking", "model.num_contextual_ids=4"))
    with pytest.raises(HSTUError, match=r"model.num_tasks=9 but it labels 8 tasks"):
        check_prepared(_cfg(kr, "ranking", "model.num_tasks=9"))
    with pytest.raises(HSTUError, match=r"eval.early_stop_metric='auc/is_like'"):
        check_prepared(_cfg(kr, "ranking", "eval.early_stop_metric=auc/is_like"))
    check_prepared(_cfg(kr, "ranking", "data.num_contextual=0"))  # 0: ignore the features
    # the CLI raises it before any framework or rank starts
    code = main(["train", "--backend", "torch", *prepared_overrides(ml), "model.num_items=10"])
    assert code == 2 and "set model.num_items=300" in capsys.readouterr().err


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["train.eval_every=5"], "train.eval_every=5 is invalid: evaluation needs held-out"),
        (["model.task=retrieval", "eval.metrics=[auc]"], "auc needs a ranking model"),
        (["eval.early_stop_metric=full/hr@10"], "a family of \\['auc', 'ne'\\]"),
        (
            ["model.task=retrieval", "eval.early_stop_metric=full/hr@7", "eval.ks=[10]"],
            "after 'full/' must come one of",
        ),
        (["data.source=prepared"], "data.source=prepared needs a path"),
        (["eval.ks=[0]"], "must hold integers > 0"),
    ],
)
def test_eval_config_errors_name_the_key(overrides, message):
    with pytest.raises(HSTUError, match=message):
        load_config("demo", overrides)


def test_sources_route_and_capacities_follow_the_dataset(prepared_data):
    cfg = _cfg(prepared_data["kuairand-pure"], "ranking", "data.max_candidates=3")
    ds = source_from_config(cfg)
    assert isinstance(ds, PreparedDataset) and ds.spec == PreparedSpec.from_config(cfg)
    hist, cand = ds.sample_sizes()
    for s in range(0, ds.num_samples, 7):
        _, start, first, end = ds.window(s)
        assert (hist[s], cand[s]) == (first - start, end - first)
    policy = capacity.for_source(cfg, CheckedSource(ds))
    assert policy == capacity.from_prepared(cfg, ds)
    tokens = ds.num_contextual + 2 * hist + cand
    assert policy.capacities[-1] >= tokens.mean() * cfg.data.batch_size  # a typical batch fits
    ret = _cfg(prepared_data["ml-1m"])
    hist, cand = source_from_config(ret).sample_sizes()
    assert (cand == 0).all() and hist.min() >= 1 and hist.max() <= 30


def test_data_prepare_command(tmp_path, capsys):
    from hstu.testing_data import write_dataset

    src = write_dataset("seq-txt", tmp_path / "src")
    assert (
        main(
            [
                "data",
                "prepare",
                "--dataset",
                "seq-txt",
                "--src",
                str(src),
                "--out",
                str(tmp_path / "out"),
            ]
        )
        == 0
    )
    assert "seq-txt: 150 users" in capsys.readouterr().out
    assert (tmp_path / "out" / "manifest.json").is_file()
    assert (
        main(
            [
                "data",
                "prepare",
                "--dataset",
                "ml-1m",
                "--src",
                str(tmp_path / "none"),
                "--out",
                str(tmp_path / "o2"),
            ]
        )
        == 2
    )
    assert "no such file or directory" in capsys.readouterr().err
