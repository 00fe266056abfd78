"""Offline evaluation of a model on a prepared dataset's held-out events, for both backends.

A backend supplies a `Scorer` (`hstu/<backend>_backend/evaluate.py`): the model in eval mode
(no dropout, no gradient, no RNG draw) turned into three host arrays,

* `query_embeddings(batch)`: the encoder output at each sample's last history position (the
  action token of its last event, the position whose output the retrieval loss scores the
  next item with), L2-normalised as in that loss: `[n, D]`;
* `item_embeddings()`: the item table, L2-normalised the same way: `[num_items, D]`;
* `candidate_logits(batch)`: the ranking head's logits of every candidate: `[sum K, tasks]`.

Everything after that is here, in numpy, the same for both backends, so the two give the same
numbers up to the rounding of those arrays:

* retrieval, `full` (HSTU): score = query . item over the whole corpus, in blocks of users x
  items (`hstu.evaluation.retrieval_ranks_chunked`), the user's seen items filtered;
* retrieval, `sampled` (SASRec): the target against `eval.num_negatives` unseen items drawn
  per user from a generator seeded by (dataset seed, split, user);
* ranking, `auc` and `ne`: per task, on the held-out event as the one candidate.

Ties are `hstu.evaluation`'s: an item scoring exactly the target's score ranks before it (a
collapsed model gets the worst rank, never the best); AUC counts ties one half.

The model's input is the user's history before the held-out event (the last
`data.max_history` events; for the test split it includes the validation event). A retrieval
input holds no candidate, so the target never enters the model; a ranking input holds the
held-out item as its one candidate (the model sees its id, not its action).

`TrainingEvaluation` runs inside `hstu.trainer.train`: see its docstring for where it runs.
"""

from __future__ import annotations

import json
import math
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Protocol

import numpy as np

from hstu.batch import HSTU_DENSE_KEYS, HSTU_JAGGED_KEYS, JaggedBatch, from_samples
from hstu.errors import HSTUError
from hstu.evaluation import (
    RankingAccumulator,
    retrieval_ranks_chunked,
    sampled_ranks,
    topk_metrics,
)

EVAL_LOG = "eval.jsonl"
TEST_FILE = "eval_test.json"
_TIME_KEYS = ("item_time", "candidate_time")


class Scorer(Protocol):
    def query_embeddings(self, batch: JaggedBatch) -> np.ndarray:
        """`[actual_batch_size, D]` float32, L2-normalised."""

    def item_embeddings(self) -> np.ndarray:
        """`[model.num_items, D]` float32, L2-normalised."""

    def candidate_logits(self, batch: JaggedBatch) -> np.ndarray:
        """`[number of candidates, model.num_tasks]` float32, candidates in batch order."""

    def export_params(self) -> dict[str, np.ndarray]:
        """The parameters evaluated now, by core name (host copies)."""

    def load_params(self, params: dict[str, np.ndarray]) -> None:
        """Evaluate these parameters from now on."""


# ------------------------------------------------------------------------------ inputs
def model_input(example: dict, task: str, use_time: bool) -> dict:
    """An evaluation example (`PreparedDataset.eval_sample`) as the model's input sample."""
    sample = {k: example[k] for k in HSTU_JAGGED_KEYS}
    sample["sample_id"] = example["sample_id"]
    if task == "retrieval":
        empty = np.zeros(0, np.int64)
        sample |= {"candidate": empty, "candidate_time": empty, "label": empty}
        sample["negative"] = empty
    if not use_time:  # the model reads no timestamp (no time bias): zeros fit any device dtype
        sample |= {k: np.zeros(len(sample[k]), np.int64) for k in _TIME_KEYS}
    return sample


def eval_batches(
    dataset, model_cfg, split: str, max_users: int | None, batch_size: int, num_negatives: int
) -> Iterator[tuple[list[dict], JaggedBatch]]:
    """(examples, the model's input batch) for the evaluation users of `split`, in id order."""
    keys = HSTU_JAGGED_KEYS + (("negative",) if model_cfg.task == "retrieval" else ())
    use_time = model_cfg.rab_time_buckets > 0
    examples = dataset.eval_samples(split, max_users or None, num_negatives)
    while True:
        chunk = [e for _, e in zip(range(batch_size), examples)]
        if not chunk:
            return
        samples = [model_input(e, model_cfg.task, use_time) for e in chunk]
        yield chunk, from_samples(samples, batch_size, keys, HSTU_DENSE_KEYS)


# ------------------------------------------------------------------------------ metrics
def evaluate(
    scorer: Scorer,
    dataset,
    cfg,
    split: str,
    max_users: int | None = None,
    heartbeat: Callable[[], None] | None = None,
) -> dict[str, float]:
    """The metrics of `cfg.eval.families(task)` on `split`'s first `max_users` users (None or
    0: all), as `{"<family>/<metric>": value, "num_users": n}`."""
    ec, mc = cfg.eval, cfg.model
    families = ec.families(mc.task)
    beat = heartbeat or (lambda: None)
    sampled = "sampled" in families
    if mc.task == "ranking":
        acc = RankingAccumulator(dataset.task_names[: mc.num_tasks])
        for _, batch in eval_batches(dataset, mc, split, max_users, ec.batch_size, 0):
            acc.add(batch.values["label"], scorer.candidate_logits(batch))
            beat()
        found = acc.result()
        out = {k: v for k, v in found.items() if k.split("/")[0] in families}
        return out | {"num_users": found["num_examples"]}
    queries, targets, seen, negatives = [], [], [], []
    num_neg = ec.num_negatives if sampled else 0
    for chunk, batch in eval_batches(dataset, mc, split, max_users, ec.batch_size, num_neg):
        queries.append(np.asarray(scorer.query_embeddings(batch), np.float32))
        targets += [e["target"] for e in chunk]
        seen += [e["seen"] for e in chunk]
        negatives += [e["negatives"] for e in chunk] if sampled else []
        beat()
    if not targets:
        return {"num_users": 0}
    query_UD = np.concatenate(queries)
    # Only the dataset's items compete (the table may have spare rows).
    item_ID = np.asarray(scorer.item_embeddings(), np.float32)[: dataset.num_items]
    targets_U = np.asarray(targets, np.int64)
    out: dict[str, float] = {}
    if "full" in families:

        def score(rows, items):
            beat()
            return query_UD[rows] @ item_ID[items].T

        ranks = retrieval_ranks_chunked(score, len(item_ID), targets_U, seen)
        out |= prefixed("full", topk_metrics(ranks, ec.ks))
    if sampled:
        # Target and negatives scored by one operation, so they round alike.
        cands_UN = np.concatenate([targets_U[:, None], np.stack(negatives)], axis=1)
        scores_UN = np.einsum("ud,und->un", query_UD, item_ID[cands_UN])
        ks = [k for k in ec.ks if k <= ec.num_negatives]
        ranks = sampled_ranks(scores_UN[:, 0], scores_UN[:, 1:])
        out |= prefixed("sampled", topk_metrics(ranks, ks))
    return out | {"num_users": len(targets_U)}


def prefixed(family: str, metrics: dict) -> dict:
    return {f"{family}/{k}": v for k, v in metrics.items() if k != "num_users"}


def baseline_metrics(dataset, cfg, split: str, max_users: int | None = None) -> dict[str, dict]:
    """The reference scorers of `hstu.baselines` under the same protocols: popularity and
    random (retrieval), the item's train positive rate and random (ranking)."""
    from hstu import baselines

    ec, task = cfg.eval, cfg.model.task
    families, users = ec.families(task), max_users or None
    if task == "ranking":
        num_tasks = cfg.model.num_tasks
        rate = baselines.ItemRateBaseline(dataset)
        pop = baselines.PopularityBaseline(dataset, dataset.seed)
        rand = baselines.RandomBaseline(dataset.seed)
        logit_fns = {
            "item_rate": lambda e: rate(e)[:num_tasks],
            # train counts are no probabilities: only the AUC of this one is meaningful
            "popularity": lambda e: np.full(num_tasks, pop.scores[int(e["candidate"][0])]),
            "random": lambda e: rand(np.full(num_tasks, e["user"]), np.arange(num_tasks)) - 0.5,
        }
        out = {}
        for name, fn in logit_fns.items():
            found = baselines.evaluate_ranking(dataset, split, fn, users)
            keep = [f for f in families if f != "ne" or name != "popularity"]
            out[name] = {k: v for k, v in found.items() if k.split("/")[0] in keep}
        return out
    out = {}
    for name, scorer in (
        ("popularity", baselines.PopularityBaseline(dataset, dataset.seed)),
        ("random", baselines.RandomBaseline(dataset.seed)),
    ):
        found: dict = {}
        if "full" in families:
            full = baselines.evaluate_full(dataset, split, scorer, ec.ks, users)
            found |= prefixed("full", full)
        if "sampled" in families:
            ks = [k for k in ec.ks if k <= ec.num_negatives]
            sampled = baselines.evaluate_sampled(
                dataset, split, scorer, ec.num_negatives, ks, users
            )
            found |= prefixed("sampled", sampled)
        out[name] = found
    return out


def higher_is_better(metric: str) -> bool:
    return not metric.startswith("ne/")


def format_table(results: dict, title: str, baselines: dict | None = None) -> str:
    """Metric rows; one column for the model, one per baseline."""
    baselines = baselines or {}
    names = [k for k in results if "/" in k]
    width = max([len(n) for n in names] + [6])
    head = f"{'metric':<{width}}  {'model':>9}" + "".join(f"  {b:>10}" for b in baselines)
    lines = [title, head, "-" * len(head)]
    for name in names:
        row = f"{name:<{width}}  {results[name]:>9.4f}"
        for found in baselines.values():
            value = found.get(name)
            row += f"  {value:>10.4f}" if value is not None else f"  {'-':>10}"
        lines.append(row)
    lines.append(f"{'users':<{width}}  {results.get('num_users', 0):>9}")
    return "\n".join(lines)


# ------------------------------------------------------------------------------ in training
def _beating(fn: Callable[[], bool], beat: Callable[[], None]) -> bool:
    """Run the collective `fn` on a helper thread while this one beats the watchdog: the
    ranks that do not evaluate wait here for the one that does."""
    result: dict = {}

    def call():
        try:
            result["value"] = fn()
        except BaseException as exc:  # noqa: BLE001 - re-raised on the caller's thread
            result["error"] = exc

    thread = threading.Thread(target=call, name="eval-wait", daemon=True)
    thread.start()
    while thread.is_alive():
        beat()
        thread.join(timeout=1.0)
    if "error" in result:
        raise result["error"]
    return bool(result["value"])


class TrainingEvaluation:
    """Evaluation inside a training run (`hstu.trainer.train`), for both backends.

    Where it runs: on the logging process only (rank 0 / JAX process 0), on its own device,
    with the model in eval mode, right after the update of every `train.eval_every`-th step
    is dispatched and before the next step touches the parameters. It draws from no RNG
    stream of the run (evaluation negatives come from generators seeded per user), so
    training continues exactly as it would without it. Every rank calls
    `backend.prepare_evaluation()` first (torch gathers sharded tables to rank 0 there) and
    one collective after, `backend.broadcast_flag(stop)`, at every evaluation point (the ranks
    know the cadence from the config, so none skips it): the others wait there for the
    evaluating process, beating their watchdogs, and all learn together whether early
    stopping ends the run. An
    evaluation must end within `dist.timeout_s` (the wait is a collective): bound it with
    `eval.max_users`.

    Early stopping (`eval.early_stop_metric`, `eval.patience`): the run ends after `patience`
    evaluations in a row without a strict improvement (NE: lower is better; every other metric
    higher). A resumed run replays its counters from the `eval.jsonl` lines up to its
    checkpoint (only the logging process needs them). The parameters of the best evaluation
    are kept on the host (a resumed run has those of its own evaluations only), and the final test
    (`eval.final_test`) evaluates them (else the last step's) on the test split:
    `<output_dir>/eval_test.json`, an `eval.jsonl` line, TensorBoard scalars and a table.
    """

    def __init__(self, cfg, dataset, backend, out_dir: Path, start: int, say):
        self.cfg, self.dataset, self.backend = cfg, dataset, backend
        self.ec, self.every = cfg.eval, cfg.train.eval_every
        self.out_dir, self.say, self.main = Path(out_dir), say, backend.is_main
        self.metric = self.ec.early_stop_metric
        self.best: float | None = None
        self.best_step: int | None = None
        self.bad = 0
        self.best_params: dict | None = None
        self._scorer = None
        self.tb = None  # MetricsLogger's TensorBoard writer, set by the trainer
        if self.main:
            log = self.out_dir / EVAL_LOG
            kept = []
            if log.is_file() and cfg.train.resume:
                lines = [json.loads(x) for x in log.read_text().splitlines() if x.strip()]
                kept = [r for r in lines if r.get("split") == "valid" and r["step"] <= start]
            log.write_text("".join(json.dumps(r) + "\n" for r in kept))
            for row in kept:
                if self.metric in row:
                    self._update(row["step"], float(row[self.metric]))

    @property
    def scorer(self):
        if self._scorer is None:
            self._scorer = self.backend.evaluator()
        return self._scorer

    def due(self, done: int) -> bool:
        return bool(self.every) and done % self.every == 0

    def after_step(self, done: int, beat: Callable[[], None]) -> bool:
        """Every rank, at every due step: evaluate (logging process), then agree on stopping."""
        stop = False
        _beating(lambda: self.backend.prepare_evaluation() or True, beat)
        if self.main:
            results, seconds = self._run("valid", self.ec.max_users, beat)
            stop = self._early_stop(done, results)
            self._log(done, "valid", results, seconds)
            if stop:
                self.say(
                    f"early stopping: {self.metric} did not improve on {self.best:.6g} (step "
                    f"{self.best_step}) for {self.bad} evaluations (eval.patience="
                    f"{self.ec.patience}); the run ends after step {done}"
                )
        return _beating(lambda: self.backend.broadcast_flag(stop), beat)

    def _run(self, split: str, max_users: int, beat) -> tuple[dict, float]:
        t0 = time.perf_counter()
        results = evaluate(self.scorer, self.dataset, self.cfg, split, max_users, beat)
        return results, time.perf_counter() - t0

    def _early_stop(self, done: int, results: dict) -> bool:
        if not self.metric:
            return False
        if self.metric not in results:
            raise HSTUError(
                f"eval.early_stop_metric={self.metric!r} is not among the evaluated metrics "
                f"{sorted(k for k in results if '/' in k)}"
            )
        if self._update(done, float(results[self.metric])) and self.ec.final_test:
            self.best_params = self.scorer.export_params()
        return self.bad >= self.ec.patience

    def _update(self, done: int, value: float) -> bool:
        """Count one evaluation of the early-stopping metric; True when it improved."""
        better = higher_is_better(self.metric)
        improved = not math.isnan(value) and (
            self.best is None or (value > self.best if better else value < self.best)
        )
        if improved:
            self.best, self.best_step, self.bad = value, done, 0
        else:
            self.bad += 1
        return improved

    def _log(self, done: int, split: str, results: dict, seconds: float, **extra) -> dict:
        row = {"step": done, "split": split, **results, "eval_s": seconds, **extra}
        if self.metric and split == "valid":
            row |= {"best": self.best, "best_step": self.best_step}
        with (self.out_dir / EVAL_LOG).open("a") as f:
            f.write(json.dumps(row) + "\n")
        if self.tb is not None:
            scalars = {f"eval/{split}/{k}": v for k, v in results.items() if "/" in k}
            self.tb.scalars(done, scalars)
        names = [k for k in results if "/" in k]
        brief = [k for k in names if k.endswith(("@10", "/mrr")) or k == self.metric]
        brief = [k for k in names if k in brief or k.split("/")[0] in ("auc", "ne")]
        shown = ", ".join(f"{k} {results[k]:.4f}" for k in brief or names)
        self.say(
            f"eval {split} @ step {done} ({results.get('num_users', 0)} users, "
            f"{seconds:.1f} s): {shown}"
        )
        return row

    def finish(self, done: int, beat: Callable[[], None]) -> dict | None:
        """The final test (logging process only, after one collective on every rank,
        `prepare_evaluation`): the best evaluation's parameters when early stopping tracked
        one, else the current ones."""
        if not self.ec.final_test:
            return None
        _beating(lambda: self.backend.prepare_evaluation() or True, beat)
        if not self.main:
            return None
        params_step = done
        if self.best_params is not None:
            self.scorer.load_params(self.best_params)
            params_step = self.best_step
        results, seconds = self._run("test", self.ec.test_max_users, beat)
        base = (
            baseline_metrics(self.dataset, self.cfg, "test", self.ec.test_max_users)
            if self.ec.baselines
            else {}
        )
        self._log(done, "test", results, seconds, params_step=params_step)
        report = {
            "split": "test",
            "step": done,
            "params_step": params_step,
            "dataset": self.dataset.manifest.dataset,
            "metrics": results,
            "baselines": base,
            "eval_s": seconds,
        }
        (self.out_dir / TEST_FILE).write_text(json.dumps(report, indent=2) + "\n")
        title = f"test metrics (parameters of step {params_step}, {self.dataset.path})"
        self.say(format_table(results, title, base))
        self.say(f"test metrics: {self.out_dir / TEST_FILE}")
        return report
