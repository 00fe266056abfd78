"""The shipped recipes (`configs/ml1m_retrieval.yaml`, `ml20m_retrieval.yaml`,
`kuairand_ranking.yaml`) on generated samples in their publishers' file formats: generate,
`hstu data prepare`, open, train the recipe's model as configured for `--steps` steps, evaluate
on the test split against the popularity and random baselines; one table at the end.

    python scripts/recipe_quality.py [--recipes ml1m_retrieval,...] [--backends torch,jax]
        [--steps 300] [--scale 1.0] [--work DIR] [--json FILE] [key=value ...]

The samples are `hstu.testing_data`'s planted walk (the next item 1-3 ids after the last in 80 %
of events, the rest from a small popular set; ratings and clicks follow a hidden per-item
quality), sized like the real datasets' users and items at `--scale 1` (ML-1M: 6,040 users over
3,706 items; the ML-20M and KuaiRand-Pure samples keep the recipes' item counts with 20,000 and
5,000 users). Their metrics say the recipe trains and evaluates end to end at its real shapes;
they are not the published anchors, which need the published files (README, "Real datasets").
Only the model, optimizer and data shapes come from the recipe: `--steps` replaces the step
count and the evaluation runs once, at the end. Extra `key=value` overrides go to every run (on
a CPU: `model.attention=reference`).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

from hstu import backends
from hstu.config import load_config
from hstu.data.prepare import prepare
from hstu.data.prepared import PreparedDataset, PreparedSpec
from hstu.metrics import read_rows, timed_rows
from hstu.testing_data import PlantedSpec, write_dataset

# recipe -> (dataset, users, min / max events per user); items: the recipe's model.num_items
RECIPES = {
    "ml1m_retrieval": ("ml-1m", 6040, 20, 400),
    "ml20m_retrieval": ("ml-20m", 20000, 20, 270),
    "kuairand_ranking": ("kuairand-pure", 5000, 20, 300),
}
SHOWN = {  # the metrics in the table (eval_test.json holds them all)
    "retrieval": ("full/hr@10", "full/ndcg@10", "full/mrr", "sampled/hr@10"),
    "ranking": ("auc/is_click", "auc/long_view", "ne/is_click"),
}


def sample_spec(recipe: str, scale: float) -> tuple[str, PlantedSpec]:
    dataset, users, lo, hi = RECIPES[recipe]
    items = load_config(recipe).model.num_items
    users = max(8, round(users * scale))
    hi = max(lo, min(hi, (items - 1) // 3))  # a walk may not wrap onto its own items
    return dataset, PlantedSpec(num_users=users, num_items=items, min_events=lo, max_events=hi)


def prepare_sample(recipe: str, work: Path, scale: float) -> dict:
    """Generate the publisher-format files, prepare them, open the result; times in seconds."""
    dataset, spec = sample_spec(recipe, scale)
    src, out = work / recipe / "src", work / recipe / "prepared"
    t = time.perf_counter()
    write_dataset(dataset, src, spec)
    write_s = time.perf_counter() - t
    t = time.perf_counter()
    prepare(dataset, src, out)
    prepare_s = time.perf_counter() - t
    t = time.perf_counter()
    ds = PreparedDataset(out, PreparedSpec.from_config(load_config(recipe)))
    ds.sample(0)
    load_s = time.perf_counter() - t
    return {
        "dataset": dataset,
        "path": str(out),
        "users": spec.num_users,
        "items": spec.num_items,
        "events": ds.manifest.num_events,
        "samples": ds.num_samples,
        "write_s": write_s,
        "prepare_s": prepare_s,
        "open_s": load_s,  # open + first sample (memory-mapped)
    }


def train_and_evaluate(recipe: str, backend: str, data: dict, out: Path, steps: int, extra):
    argv = [
        "train",
        "--backend",
        backend,
        "--config",
        recipe,
        f"data.path={data['path']}",
        f"output_dir={out}",
        f"train.steps={steps}",
        f"train.eval_every={steps}",
        f"train.checkpoint_every={steps}",
        f"train.log_every={max(1, steps // 4)}",
        "train.tensorboard=false",
        *extra,
    ]
    t = time.perf_counter()
    # one process per run, as a user runs it: a backend's device memory (torch's cache, JAX's
    # preallocated pool) is not left to the next run
    rc = subprocess.run([sys.executable, "-m", "hstu.cli", *argv]).returncode
    wall = time.perf_counter() - t
    if rc != 0:
        raise RuntimeError(f"hstu train exited {rc} ({' '.join(argv)})")
    rows = [r for r in read_rows(out / "metrics.jsonl") if "step_time_s" in r]
    timed = [r["step_time_s"] for r in timed_rows(rows, skip_warmup=1)]
    report = json.loads((out / "eval_test.json").read_text())
    return {
        "recipe": recipe,
        "backend": backend,
        "steps": steps,
        "step_ms": 1e3 * statistics.median(timed),
        "wall_s": wall,
        "loss_first": rows[0].get("loss") if rows else None,
        "loss_last": rows[-1].get("loss") if rows else None,
        "metrics": report["metrics"],
        "baselines": report.get("baselines", {}),
    }


def table(prepared: dict, results: list[dict]) -> str:
    lines = ["sample (generated, publisher format)     users   items     events  prepare  open"]
    for recipe, d in prepared.items():
        lines.append(
            f"{recipe:<18} {d['dataset']:<19} {d['users']:>7,} {d['items']:>7,} "
            f"{d['events']:>10,} {d['prepare_s']:>7.1f}s {1e3 * d['open_s']:>4.0f}ms"
        )
    head = "recipe             backend steps  step ms  metric            model    pop   rand"
    lines += ["", head]
    for r in results:
        task = load_config(r["recipe"]).model.task
        head = f"{r['recipe']:<18} {r['backend']:<7} {r['steps']:>5} {r['step_ms']:>8.1f}"
        for i, key in enumerate(SHOWN[task]):
            base = [r["baselines"].get(n, {}).get(key) for n in ("popularity", "random")]
            cells = " ".join(f"{b:>6.4f}" if b is not None else "     -" for b in base)
            lead = head if i == 0 else " " * len(head)
            lines.append(f"{lead}  {key:<16} {r['metrics'].get(key, float('nan')):>6.4f} {cells}")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--recipes", default=",".join(RECIPES))
    p.add_argument("--backends", default="torch,jax")
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--scale", type=float, default=1.0, help="users relative to the real dataset")
    p.add_argument("--work", default="", help="where samples and runs go (default: a temp dir)")
    p.add_argument("--json", default="", help="also write the figures here")
    p.add_argument("overrides", nargs="*", help="key=value for every training run")
    args = p.parse_args(argv)
    recipes = [r for r in args.recipes.split(",") if r]
    unknown = sorted(set(recipes) - set(RECIPES))
    if unknown:
        p.error(f"unknown recipe(s) {unknown}; known: {sorted(RECIPES)}")
    names = [b for b in args.backends.split(",") if b]
    for name in names:
        ok, why = backends.available(name)
        if not ok:
            p.error(f"backend {name!r} is not available: {why}")
    if args.steps < 1:
        p.error(f"--steps must be >= 1, got {args.steps}")
    work = Path(args.work or tempfile.mkdtemp(prefix="hstu-recipes-"))
    prepared, results, failed = {}, [], []
    for recipe in recipes:
        prepared[recipe] = prepare_sample(recipe, work, args.scale)
        for name in names:
            out = work / recipe / f"run_{name}"
            try:
                results.append(
                    train_and_evaluate(
                        recipe, name, prepared[recipe], out, args.steps, args.overrides
                    )
                )
            except Exception as e:  # one failed run must not hide the others' figures
                traceback.print_exc()
                failed.append(f"{recipe} / {name}: {type(e).__name__}: {e}")
    text = table(prepared, results)
    print("\n" + text)
    for line in failed:
        print(f"FAILED {line}")
    if args.json:
        report = {"samples": prepared, "runs": results, "failed": failed}
        Path(args.json).write_text(json.dumps(report, indent=1))
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
