"""Two trees' `hstu bench e2e` runs compared over the same batches, round by round.

    python scripts/ab_paired.py --before DIR [DIR ...] --after DIR [DIR ...]

Each DIR holds one run's `e2e.json` (`hstu bench e2e --out DIR`); the i-th `--before` and the
i-th `--after` are one round of an alternating A/B (`gpu_check.sh tab`). Both trees read the
same batches (same config and seed), so step k of one run is step k of the other: for every
combination both ran (`torch/identity/-`, ...) this prints the total time of the steps both
timed in each round (`paired_totals`, as the bench pairs balanced with identity) and their
ratio, before over after (> 1: the after tree is faster), then over all rounds, and the median
and quartiles of the per-step ratios.

Why: the table's median step is whichever step lands in the middle of ~25 steps whose
lengths vary ~6x, and it moved 3 % between two runs of one tree on an H200 (docs/
BENCHMARKS.md); changes of 1-2 % need the same steps on both sides.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

from hstu.bench.e2e import paired_totals


def _runs(dirs: list[str]) -> list[dict]:
    out = []
    for d in dirs:
        path = Path(d) / "e2e.json"
        if not path.exists():
            raise SystemExit(f"ab_paired: {path} not found (a run's --out directory?)")
        out.append(json.loads(path.read_text())["runs"])
    return out


def compare(before: list[dict], after: list[dict]) -> dict[str, dict]:
    """Per combination: each round's (steps, total before s, total after s), the totals over
    all rounds and the per-step ratios' quartiles."""
    if len(before) != len(after):
        raise ValueError(f"{len(before)} before runs against {len(after)} after runs")
    keys = sorted(set.intersection(*(set(r) for r in before + after))) if before else []
    out = {}
    for key in keys:
        rounds, ratios = [], []
        for b, a in zip(before, after, strict=True):
            tb, ta, steps = paired_totals(b[key]["step_s_runs"], a[key]["step_s_runs"])
            rounds.append((len(steps), tb, ta))
            for rb, ra in zip(b[key]["step_s_runs"], a[key]["step_s_runs"], strict=True):
                sa = dict((int(k), v) for k, v in ra)
                ratios += [v / sa[int(k)] for k, v in rb if int(k) in sa and sa[int(k)] > 0]
        tb, ta = sum(r[1] for r in rounds), sum(r[2] for r in rounds)
        q = np.percentile(ratios, [25, 50, 75]).tolist() if ratios else [float("nan")] * 3
        out[key] = {"rounds": rounds, "before_s": tb, "after_s": ta, "step_ratio_q": q}
    return out


def format_table(result: dict[str, dict]) -> str:
    lines = [
        f"{'combination':<24}{'round':>6}{'steps':>7}{'before s':>10}{'after s':>10}"
        f"{'before/after':>14}",
    ]
    for key, r in result.items():
        for i, (n, tb, ta) in enumerate(r["rounds"]):
            ratio = tb / ta if ta > 0 else float("nan")
            lines.append(f"{key:<24}{i + 1:>6}{n:>7}{tb:>10.4f}{ta:>10.4f}{ratio:>14.4f}")
        n = sum(x[0] for x in r["rounds"])
        total = r["before_s"] / r["after_s"] if r["after_s"] > 0 else float("nan")
        q25, q50, q75 = r["step_ratio_q"]
        lines.append(
            f"{key:<24}{'all':>6}{n:>7}{r['before_s']:>10.4f}{r['after_s']:>10.4f}"
            f"{total:>14.4f}   per step: median {q50:.4f} (quartiles {q25:.4f} / {q75:.4f})"
        )
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--before", nargs="+", required=True, help="one run's --out dir per round")
    p.add_argument("--after", nargs="+", required=True, help="the same rounds' other tree")
    args = p.parse_args(argv)
    result = compare(_runs(args.before), _runs(args.after))
    if not result:
        print("ab_paired: no combination in every run", file=sys.stderr)
        return 1
    print(format_table(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
