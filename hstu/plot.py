"""`hstu plot RUN_DIR`: PNGs of a run's `metrics.jsonl` (matplotlib, no display needed).

* `loss.png`: loss over steps (and grad norm on a second axis);
* `throughput.png`: tokens/s and step time over steps (steps that built a new program marked);
* `balance.png`: per-rank load before and after balancing: the per-rank FLOPs of the median
  step as bars, and max/mean imbalance over steps.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np

from hstu.errors import HSTUError
from hstu.metrics import read_rows


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_run(run_dir: str | Path, out_dir: str | Path | None = None) -> list[Path]:
    """Write the PNGs of `run_dir/metrics.jsonl` into `out_dir` (default: the run dir)."""
    run_dir = Path(run_dir)
    rows = read_rows(run_dir / "metrics.jsonl")
    if not rows:
        raise HSTUError(f"{run_dir}/metrics.jsonl is missing or empty: not a run directory?")
    out = Path(out_dir) if out_dir else run_dir
    out.mkdir(parents=True, exist_ok=True)
    plt = _pyplot()
    steps = np.array([r["step"] for r in rows])
    written = []

    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(steps, [r["loss"] for r in rows], label="loss")
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    if any("grad_norm" in r for r in rows):
        ax2 = ax.twinx()
        ax2.plot(steps, [r.get("grad_norm", np.nan) for r in rows], color="tab:gray", lw=0.8)
        ax2.set_ylabel("grad norm", color="tab:gray")
    ax.set_title(f"loss: {run_dir.name}")
    written.append(_save(fig, out / "loss.png", plt))

    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(steps, [r["tokens_per_s"] for r in rows], label="tokens/s")
    ax.set_xlabel("step")
    ax.set_ylabel("tokens/s")
    compiled = [
        r["step"]
        for prev, r in zip(rows, rows[1:], strict=False)
        if r.get("num_compiles", 0) > prev.get("num_compiles", 0)
    ]
    for s in compiled:
        ax.axvline(s, color="tab:red", lw=0.5, alpha=0.5)
    ax2 = ax.twinx()
    ax2.plot(steps, [1e3 * r["step_time_s"] for r in rows], color="tab:orange", lw=0.8)
    ax2.set_ylabel("step time (ms)", color="tab:orange")
    ax.set_title("throughput" + (" (red: a new program was built)" if compiled else ""))
    written.append(_save(fig, out / "throughput.png", plt))

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    order = np.argsort([r["imbalance_before"] for r in rows])
    median = rows[int(order[len(order) // 2])]
    before = np.asarray(median["rank_workloads_before"]) / 1e12
    after = np.asarray(median["rank_workloads_after"]) / 1e12
    ranks = np.arange(len(before))
    left.bar(ranks - 0.2, before, 0.4, label="before")
    left.bar(ranks + 0.2, after, 0.4, label="after")
    left.axhline(before.mean(), color="k", lw=0.8, ls="--", label="mean")
    left.set_xlabel("rank")
    left.set_ylabel("TFLOP per step")
    left.set_title(f"per-rank load, step {median['step']} (median imbalance)")
    left.legend()
    right.plot(steps, [r["imbalance_before"] for r in rows], label="before")
    right.plot(steps, [r["imbalance_after"] for r in rows], label="after")
    right.set_xlabel("step")
    right.set_ylabel("max / mean rank load")
    right.set_title("imbalance")
    right.legend()
    written.append(_save(fig, out / "balance.png", plt))
    return written


def _save(fig, path: Path, plt) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="hstu plot", description=__doc__.split("\n\n")[0])
    parser.add_argument("run_dir", metavar="RUN_DIR")
    parser.add_argument("--out", default=None, help="where the PNGs go (default: RUN_DIR)")
    args = parser.parse_args(argv)
    for path in plot_run(args.run_dir, args.out):
        print(path)
    return 0
