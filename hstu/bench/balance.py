"""Partitioner benchmark: quality (excess over the lower bound) and time of kk, greedy and auto.

    python -m hstu.bench.balance [--dists ...] [--ranks ...] [--per-rank ...] [--seeds N]

For every cell (distribution, ranks W, samples per rank c) and seed it draws `W * c` sequence
lengths, turns them into workloads `L**2 + 512 L` (attention + linear FLOPs of a length-L
sequence, up to a constant), partitions them with every method and reports the excess of the
largest part sum over `hstu.partition.lower_bound` (median and worst over the seeds) and the
median time per call. A last block times all methods on 2048 samples over 16 ranks.
"""

from __future__ import annotations

import argparse
import sys
import time

import numpy as np

from hstu.partition import lower_bound, part_sums, partition

DISTS = ("lognormal", "zipf", "pareto", "uniform")
METHODS = ("kk", "greedy", "auto")
LINEAR = 512  # workload = L**2 + LINEAR * L


def seqlens(dist: str, n: int, rng: np.random.Generator, max_seqlen: int = 4096) -> np.ndarray:
    """`n` sequence lengths in [1, max_seqlen]; heavy-tail parameters drawn from `rng` too.

    lognormal: sigma ~ U(1, 2), median max_seqlen / 32; zipf: a ~ U(1.2, 2), lengths
    max_seqlen / 256 * k; pareto: alpha ~ U(1.1, 2), minimum max_seqlen / 128; uniform.
    """
    if dist == "lognormal":
        x = rng.lognormal(np.log(max_seqlen / 32), rng.uniform(1.0, 2.0), n)
    elif dist == "zipf":
        x = rng.zipf(rng.uniform(1.2, 2.0), n).astype(np.float64) * (max_seqlen / 256)
    elif dist == "pareto":
        x = (rng.pareto(rng.uniform(1.1, 2.0), n) + 1.0) * (max_seqlen / 128)
    elif dist == "uniform":
        x = rng.uniform(1, max_seqlen, n)
    else:
        raise ValueError(f"unknown distribution {dist!r}; known: {', '.join(DISTS)}")
    return np.clip(np.rint(x), 1, max_seqlen).astype(np.int64)


def workloads(lengths: np.ndarray) -> np.ndarray:
    lengths = np.asarray(lengths, dtype=np.int64)
    return lengths * lengths + LINEAR * lengths


def _time_call(fn, repeats: int) -> float:
    """Median seconds of `repeats` calls after one warm-up call."""
    fn()
    times = []
    for _ in range(max(1, repeats)):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return float(np.median(times))


def _instance(dist: str, ranks: int, per_rank: int, seed: int, max_seqlen: int) -> np.ndarray:
    rng = np.random.default_rng([seed, ranks, per_rank, DISTS.index(dist)])
    return workloads(seqlens(dist, ranks * per_rank, rng, max_seqlen))


def run_grid(
    dists=DISTS,
    ranks=(4, 8, 16, 32, 64),
    per_rank=(2, 8, 32, 128, 256),
    seeds: int = 5,
    repeats: int = 3,
    max_seqlen: int = 4096,
    methods=METHODS,
    kk_time_max_n: int = 4096,
) -> list[dict]:
    """One dict per (dist, ranks, per_rank, method) with the excesses over the lower bound.

    Keys: dist, ranks, per_rank, method, excess (list over seeds), excess_median, excess_worst,
    excess_basic_worst (over the pigeonhole-only bound), time_ms (median over seeds of the
    median of `repeats` calls; NaN for kk above `kk_time_max_n` samples, which is only run once
    there: pure-Python kk is slow).
    """
    rows = []
    for dist in dists:
        for w_ in ranks:
            for c in per_rank:
                acc = {m: ([], [], []) for m in methods}
                for seed in range(seeds):
                    w = _instance(dist, w_, c, seed, max_seqlen)
                    lb = lower_bound(w, w_)
                    lb_basic = lower_bound(w, w_, strong=False)
                    for m in methods:
                        parts = partition(w, w_, method=m)
                        top = float(part_sums(w, parts).max())
                        excess, basic, times = acc[m]
                        excess.append(top / lb - 1.0 if lb > 0 else 0.0)
                        basic.append(top / lb_basic - 1.0 if lb_basic > 0 else 0.0)
                        if m == "kk" and w_ * c > kk_time_max_n:
                            times.append(float("nan"))
                        else:
                            call = lambda w=w, m=m, k=w_: partition(w, k, method=m)
                            times.append(_time_call(call, repeats))
                for m in methods:
                    excess, basic, times = acc[m]
                    rows.append(
                        {
                            "dist": dist,
                            "ranks": w_,
                            "per_rank": c,
                            "method": m,
                            "excess": excess,
                            "excess_median": float(np.median(excess)),
                            "excess_worst": float(np.max(excess)),
                            "excess_basic_worst": float(np.max(basic)),
                            "time_ms": float(np.median(times)) * 1e3,
                        }
                    )
    return rows


def time_2048x16(methods=METHODS, repeats: int = 50, seeds: int = 5) -> dict[str, float]:
    """Median ms of `partition(w, 16)` on 2048 lognormal-length workloads (median over seeds)."""
    out = {}
    for m in methods:
        per_seed = []
        for seed in range(seeds):
            w = _instance("lognormal", 16, 128, seed, 4096)
            per_seed.append(_time_call(lambda w=w, m=m: partition(w, 16, method=m), repeats))
        out[m] = float(np.median(per_seed)) * 1e3
    return out


def _pct(x: float) -> str:
    return f"{100 * x:.4f}" if x < 0.1 else f"{100 * x:.2f}"


def format_table(rows: list[dict], methods=METHODS) -> str:
    cells: dict[tuple, dict] = {}
    for r in rows:
        cells.setdefault((r["dist"], r["ranks"], r["per_rank"]), {})[r["method"]] = r
    head = f"{'dist':<10}{'W':>4}{'c':>5} |"
    head += "".join(f" {m + ' med/worst %':>24}" for m in methods) + " |"
    head += "".join(f" {m + ' ms':>9}" for m in methods)
    lines = [head, "-" * len(head)]
    for (dist, w_, c), by in cells.items():
        line = f"{dist:<10}{w_:>4}{c:>5} |"
        for m in methods:
            r = by[m]
            line += f" {_pct(r['excess_median']) + ' / ' + _pct(r['excess_worst']):>24}"
        line += " |" + "".join(f" {by[m]['time_ms']:>9.3f}" for m in methods)
        lines.append(line)
    return "\n".join(lines)


def summary(rows: list[dict], timing: dict[str, float], methods=METHODS) -> list[str]:
    lines = []
    for m in methods:
        ex = np.concatenate([r["excess"] for r in rows if r["method"] == m])
        basic = max(r["excess_basic_worst"] for r in rows if r["method"] == m)
        lines.append(
            f"{m:<7} excess over LB: median {_pct(float(np.median(ex)))} %, "
            f"worst {_pct(float(ex.max()))} % (worst over the pigeonhole-only LB "
            f"{_pct(basic)} %); 2048x16: {timing[m]:.3f} ms"
        )
    return lines


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m hstu.bench.balance", description=__doc__)
    csv = lambda f: lambda s: tuple(f(x) for x in s.split(",") if x)
    ap.add_argument("--dists", type=csv(str), default=DISTS)
    ap.add_argument("--ranks", type=csv(int), default=(4, 8, 16, 32, 64))
    ap.add_argument("--per-rank", type=csv(int), default=(2, 8, 32, 128, 256))
    ap.add_argument("--seeds", type=int, default=5)
    ap.add_argument("--repeats", type=int, default=3, help="timed calls per instance")
    ap.add_argument("--max-seqlen", type=int, default=4096)
    ap.add_argument("--methods", type=csv(str), default=METHODS)
    ap.add_argument(
        "--kk-time-max-n",
        type=int,
        default=4096,
        help="time kk only up to this many samples (pure Python: slow)",
    )
    ap.add_argument("--timing-repeats", type=int, default=50, help="calls for the 2048x16 timing")
    args = ap.parse_args(argv)
    for d in args.dists:
        if d not in DISTS:
            ap.error(f"--dists: unknown distribution {d!r}; known: {', '.join(DISTS)}")
    t0 = time.perf_counter()
    rows = run_grid(
        args.dists,
        args.ranks,
        args.per_rank,
        args.seeds,
        args.repeats,
        args.max_seqlen,
        args.methods,
        args.kk_time_max_n,
    )
    timing = time_2048x16(args.methods, args.timing_repeats)
    print(format_table(rows, args.methods))
    print()
    for line in summary(rows, timing, args.methods):
        print(line)
    print(f"({time.perf_counter() - t0:.1f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
