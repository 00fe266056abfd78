"""`hstu bench attention`: the HSTU attention kernel of a backend over a grid of shapes.

    hstu bench attention --backend {torch,jax} [--batches 1,2,...,128] [--seqlens 64,...,8192]
        [--dims 64,128,256] [--heads 4] [--dtype bf16] [--jagged zipf] [--rab] [--no-sdpa]
        [--lowerings triton,mosaic] [--max-tokens N] [--warmup W] [--repeats R] [--out DIR]
        [--resume]

For every (batch B, seqlen S, head dim D) of the grid with B * S <= `--max-tokens`:

* **correctness first**: the kernel's output and its gradients (q, k, v, and the bias tables
  with `--rab`) against the backend's dense fp32 reference on a slice of the same case (one
  sample of length S, or the first samples of a jagged batch up to S tokens); a point that
  fails is reported and not timed, and the command exits 1;
* **timing**: forward and forward + backward, medians over `--repeats` after `--warmup` (torch:
  CUDA events around a CUDA-graph replay of the call, i.e. device time as in the graphed
  training step, for the kernel and SDPA alike; eager, and noted, where a call cannot be
  captured; jax: the device's busy time in a `jax.profiler` trace of 10 calls dispatched
  back to back, divided by 10, `hstu.jax_backend.device_time`: the host's clock read the
  Mosaic kernels up to 1.3x slow, its dispatch and wait included; on a CPU, the host's
  clock); TFLOP/s on the unmasked (query, key) pairs only: forward = 4 *
  pairs * H * D (Q K^T and P V), forward + backward = 3.5 x forward (the flash-attention
  convention);
* `--jagged zipf`: besides the equal-length batch, a batch of Zipf(1.2) lengths in [16, S] with
  the same token count, so the cost of raggedness reads off one table (`jagged / equal`);
* torch also times `scaled_dot_product_attention` (causal softmax, the flash kernel on a GPU)
  on the equal-length batches, the yardstick of the kernel targets (`--no-sdpa` skips it);
* jax runs the grid once per `--lowerings` entry (the attention kernels' Pallas lowering:
  `triton`, kernel `pallas`; `mosaic`, kernel `mosaic`, which needs a Hopper GPU, jax >= 0.11,
  16-bit inputs and no `--rab`: a lowering that cannot run the grid is named before any work).

Writes `attention_<backend>.json` (every point, with the check's errors; rewritten after every
point, so a run cut short keeps what it measured) and one heatmap PNG per kernel and head dim
(forward + backward TFLOP/s over batch x seqlen) under `--out`. `--resume` keeps the points
of the report already there (same backend and device) and times only the grid's others: a
grid too long for one sitting is run in parts, and the table and heatmaps cover them all. On a
CPU the kernels run in interpret mode: the check is meaningful, the timings are not.

The per-backend halves are `hstu.<backend>_backend.bench_attention` (`Runner`); this
module is the grid, the check verdict, the table and the files, and imports neither framework.
A half needs its framework and kernel language only (torch and Triton; jax), not the training
stack: the torch kernels are benchmarked where TorchRec / fbgemm are not installed.
"""

from __future__ import annotations

import argparse
import functools
import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from hstu.data.distributions import sample_lengths
from hstu.errors import HSTUError

DEFAULT_BATCHES = (1, 2, 4, 8, 16, 32, 64, 128)
DEFAULT_SEQLENS = (64, 128, 256, 512, 1024, 2048, 4096, 8192)
DEFAULT_DIMS = (64, 128, 256)
FWD_BWD_FACTOR = 3.5  # forward + backward FLOPs as a multiple of the forward's
# Max |kernel - reference| / max |reference|, per input dtype: bf16 keeps 8 bits of mantissa
# and the kernel rounds P to it before P V; fp32 accumulates in another order only.
TOLERANCE = {"bf16": 3e-2, "fp16": 1e-2, "fp32": 1e-4}
MIN_JAGGED_LEN = 16

# The kernel's half of each backend: it needs the framework and its kernel language (torch +
# Triton; jax + Pallas), not the training stack (TorchRec / fbgemm, Flax / Optax / Orbax).
RUNNERS = {"torch": ("torch", "triton"), "jax": ("jax",)}


@dataclass(frozen=True)
class Case:
    """One grid point: `lengths` are the samples' lengths (all `seqlen` when equal)."""

    batch: int
    seqlen: int
    dim: int
    heads: int
    dtype: str
    layout: str  # "equal" | "zipf"
    lengths: tuple[int, ...]
    rab: bool = False

    @property
    def tokens(self) -> int:
        return int(sum(self.lengths))

    @property
    def pairs(self) -> int:
        """Unmasked (query, key) pairs of the causal mask."""
        return int(sum(n * (n + 1) // 2 for n in self.lengths))

    @property
    def fwd_flops(self) -> float:
        return 4.0 * self.pairs * self.heads * self.dim

    def check_slice(self) -> Case:
        """The part of the case the dense reference checks: one sample of length `seqlen`
        (equal) or the first samples up to `seqlen` tokens (jagged)."""
        if self.layout == "equal":
            lengths = (self.seqlen,)
        else:
            total, keep = 0, []
            for n in self.lengths:
                if keep and total + n > self.seqlen:
                    break
                keep.append(n)
                total += n
            lengths = tuple(keep)
        return Case(
            1, self.seqlen, self.dim, self.heads, self.dtype, self.layout, lengths, self.rab
        )


def zipf_lengths(tokens: int, seqlen: int, seed: int) -> tuple[int, ...]:
    """Zipf(1.2) lengths in [16, seqlen] summing to exactly `tokens` (the last one trimmed)."""
    rng = np.random.default_rng(seed)
    lo = min(MIN_JAGGED_LEN, seqlen)
    out: list[int] = []
    while sum(out) < tokens:
        out += sample_lengths("zipf", rng, 64, lo, seqlen, a=1.2).tolist()
    total, keep = 0, []
    for n in out:
        n = min(int(n), tokens - total)
        keep.append(n)
        total += n
        if total == tokens:
            break
    return tuple(keep)


def grid(args) -> list[Case]:
    cases = []
    for dim in args.dims:
        for seqlen in args.seqlens:
            for batch in args.batches:
                tokens = batch * seqlen
                if tokens > args.max_tokens:
                    continue
                equal = (seqlen,) * batch
                cases.append(
                    Case(batch, seqlen, dim, args.heads, args.dtype, "equal", equal, args.rab)
                )
                if args.jagged == "zipf":
                    lengths = zipf_lengths(tokens, seqlen, seed=hash((batch, seqlen)) % 2**31)
                    cases.append(
                        Case(batch, seqlen, dim, args.heads, args.dtype, "zipf", lengths, args.rab)
                    )
    if not cases:
        raise HSTUError(
            f"the grid is empty: every batch x seqlen exceeds --max-tokens={args.max_tokens}"
        )
    return cases


@dataclass
class Point:
    kernel: str  # "triton" / "pallas" / "sdpa"
    case: Case
    check: dict = field(default_factory=dict)  # {"ok": bool, "errors": {name: rel err}}
    fwd_ms: float = math.nan
    fwd_bwd_ms: float = math.nan
    note: str = ""

    @property
    def fwd_tflops(self) -> float:
        return self.case.fwd_flops / self.fwd_ms / 1e9

    @property
    def fwd_bwd_tflops(self) -> float:
        return FWD_BWD_FACTOR * self.case.fwd_flops / self.fwd_bwd_ms / 1e9

    def as_dict(self) -> dict:
        d = asdict(self)
        d["case"] = {k: v for k, v in d["case"].items() if k != "lengths"}
        d["case"] |= {"tokens": self.case.tokens, "pairs": self.case.pairs}
        d["case"]["num_samples"] = len(self.case.lengths)
        d |= {"fwd_tflops": self.fwd_tflops, "fwd_bwd_tflops": self.fwd_bwd_tflops}
        return d


def verdict(errors: dict[str, float], dtype: str) -> dict:
    tol = TOLERANCE[dtype]
    bad = {k: v for k, v in errors.items() if not v <= tol}  # NaN fails too
    return {"ok": not bad, "tolerance": tol, "errors": errors, "failed": sorted(bad)}


def run(
    runner, cases: list[Case], warmup: int, repeats: int, say=print, on_case=None
) -> list[Point]:
    """Check, then time, every case with the runner's kernel (and its extra kernels);
    `on_case(points)` after each case, with the points so far (the report is saved so, and a
    run cut short keeps what it measured)."""
    points, checked = [], {}
    for i, case in enumerate(cases):
        key = (case.seqlen, case.dim, case.layout)
        if key not in checked:  # one check per (S, D, layout): the batch only repeats samples
            errors = runner.check(case.check_slice())
            checked[key] = verdict(errors, case.dtype)
        point = Point(runner.kernel, case, checked[key])
        if point.check["ok"]:
            point.fwd_ms, point.fwd_bwd_ms, point.note = runner.time(case, warmup, repeats)
        else:
            point.note = f"check failed: {point.check['failed']}"
        points.append(point)
        extras = runner.extra_kernels(case)
        for extra in extras:  # yardsticks (their own library's kernels): timed, not checked
            fwd, fwd_bwd, note = runner.time_extra(extra, case, warmup, repeats)
            points.append(Point(extra, case, {"ok": True, "yardstick": True}, fwd, fwd_bwd, note))
        say(f"[{i + 1}/{len(cases)}] {_row_label(case)}: {_brief(points[-1 - len(extras) :])}")
        if on_case is not None:
            on_case(points)
    return points


def case_of(d: dict) -> Case:
    """The `Case` of a report's point (`Point.as_dict`): its lengths, which the report leaves
    out, are the grid's (`zipf_lengths` is seeded by batch and seqlen)."""
    b, s = d["batch"], d["seqlen"]
    lengths = (s,) * b if d["layout"] == "equal" else zipf_lengths(b * s, s, hash((b, s)) % 2**31)
    return Case(b, s, d["dim"], d["heads"], d["dtype"], d["layout"], lengths, d["rab"])


def point_of(d: dict) -> Point:
    return Point(d["kernel"], case_of(d["case"]), d["check"], d["fwd_ms"], d["fwd_bwd_ms"],
                 d["note"])  # fmt: skip


def load_report(path: Path, backend: str, device: str, interpret: bool) -> list[Point]:
    """The points of an earlier report at `path` (`--resume`), which must come from the same
    backend on the same kind of device (figures of two GPUs do not belong in one table)."""
    try:
        report = json.loads(path.read_text())
    except FileNotFoundError:
        return []
    except (OSError, ValueError) as exc:
        raise HSTUError(f"--resume: cannot read {path}: {exc}") from exc
    theirs = (report.get("backend"), report.get("device"), report.get("interpret"))
    if theirs != (backend, device, interpret):
        raise HSTUError(
            f"--resume: {path} holds backend {theirs[0]!r} on {theirs[1]!r} (interpret "
            f"{theirs[2]}); this run is {backend!r} on {device!r} (interpret {interpret}): "
            "give another --out"
        )
    return [point_of(d) for d in report["points"]]


def _row_label(case: Case) -> str:
    return f"B={case.batch} S={case.seqlen} D={case.dim} {case.layout}"


def _brief(points: list[Point]) -> str:
    return ", ".join(
        f"{p.kernel} {p.fwd_tflops:.1f}/{p.fwd_bwd_tflops:.1f} TF/s"
        if p.check.get("ok")
        else f"{p.kernel} {p.note}"
        for p in points
    )


def table(points: list[Point]) -> str:
    head = (
        f"{'kernel':>7} {'D':>4} {'S':>5} {'B':>4} {'layout':>6} {'tokens':>8} | {'check':>9} | "
        f"{'fwd ms':>9} {'TF/s':>7} | {'f+b ms':>9} {'TF/s':>7}"
    )
    lines = [head, "-" * len(head)]
    for p in points:
        c = p.case
        err = max(p.check.get("errors", {}).values(), default=math.nan)
        if p.check.get("yardstick"):
            check = "-"
        else:
            check = ("ok " if p.check.get("ok") else "FAIL ") + (f"{err:.0e}" if err == err else "")
        lines.append(
            f"{p.kernel:>7} {c.dim:>4} {c.seqlen:>5} {c.batch:>4} {c.layout:>6} {c.tokens:>8} | "
            f"{check:>9} | {p.fwd_ms:>9.3f} {p.fwd_tflops:>7.1f} | {p.fwd_bwd_ms:>9.3f} "
            f"{p.fwd_bwd_tflops:>7.1f}"
        )
    ratios = jagged_ratios(points)
    if ratios:
        lines.append("")
        lines.append("jagged (zipf) / equal, forward+backward TFLOP/s at the same tokens:")
        for (kernel, dim, seqlen, batch), r in sorted(ratios.items()):
            lines.append(f"  {kernel} D={dim} S={seqlen} B={batch}: {r:.2f}")
    return "\n".join(lines)


def jagged_ratios(points: list[Point]) -> dict[tuple, float]:
    equal = {}
    for p in points:
        if p.case.layout == "equal":
            equal[(p.kernel, p.case.dim, p.case.seqlen, p.case.batch)] = p.fwd_bwd_tflops
    out = {}
    for p in points:
        key = (p.kernel, p.case.dim, p.case.seqlen, p.case.batch)
        if p.case.layout == "zipf" and key in equal and equal[key] > 0:
            out[key] = p.fwd_bwd_tflops / equal[key]
    return out


def heatmaps(points: list[Point], out_dir: Path, title: str) -> list[Path]:
    """One PNG per (kernel, head dim): forward+backward TFLOP/s of the equal-length batches."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written = []
    groups: dict[tuple[str, int], list[Point]] = {}
    for p in points:
        if p.case.layout == "equal":
            groups.setdefault((p.kernel, p.case.dim), []).append(p)
    for (kernel, dim), group in sorted(groups.items()):
        batches = sorted({p.case.batch for p in group})
        seqlens = sorted({p.case.seqlen for p in group})
        grid_ = np.full((len(batches), len(seqlens)), np.nan)
        for p in group:
            grid_[batches.index(p.case.batch), seqlens.index(p.case.seqlen)] = p.fwd_bwd_tflops
        fig, ax = plt.subplots(figsize=(1.1 * len(seqlens) + 2, 0.6 * len(batches) + 1.6))
        img = ax.imshow(grid_, origin="lower", aspect="auto", cmap="viridis")
        ax.set_xticks(range(len(seqlens)), [str(s) for s in seqlens])
        ax.set_yticks(range(len(batches)), [str(b) for b in batches])
        ax.set_xlabel("seqlen")
        ax.set_ylabel("batch")
        for (i, j), v in np.ndenumerate(grid_):
            if v == v:
                ax.text(j, i, f"{v:.0f}" if v >= 10 else f"{v:.2g}", ha="center", va="center",
                        fontsize=7, color="white")  # fmt: skip
        fig.colorbar(img, ax=ax, label="forward+backward TFLOP/s")
        ax.set_title(f"{title}: {kernel}, head dim {dim}", fontsize=9)
        fig.tight_layout()
        path = out_dir / f"attention_{kernel}_d{dim}.png"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        written.append(path)
    return written


def _ints(text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated integers, got {text!r}"
        ) from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected integers >= 1, got {text!r}")
    return values


def _lowerings(text: str) -> tuple[str, ...]:
    values = tuple(dict.fromkeys(v.strip() for v in text.split(",") if v.strip()))
    if not values or not set(values) <= {"triton", "mosaic"}:
        raise argparse.ArgumentTypeError(f"expected a list of triton, mosaic; got {text!r}")
    return values


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="hstu bench attention",
        description="The backend's HSTU attention kernel over batch x seqlen x head dim: "
        "checked against the reference, then timed (table, JSON, TFLOP/s heatmaps).",
    )
    ap.add_argument("--backend", required=True, choices=sorted(RUNNERS))
    ap.add_argument("--batches", type=_ints, default=DEFAULT_BATCHES)
    ap.add_argument("--seqlens", type=_ints, default=DEFAULT_SEQLENS)
    ap.add_argument("--dims", type=_ints, default=DEFAULT_DIMS, help="head dims (Dqk = Dv)")
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--dtype", choices=sorted(TOLERANCE), default="bf16")
    ap.add_argument("--jagged", choices=["none", "zipf"], default="zipf")
    ap.add_argument("--rab", action="store_true", help="relative position and time biases")
    ap.add_argument("--no-sdpa", action="store_true", help="torch: skip the SDPA yardstick")
    ap.add_argument(
        "--lowerings",
        type=_lowerings,
        default=("triton",),
        help="jax: the Pallas lowerings of the forward / dq kernels to run, of triton,mosaic",
    )
    ap.add_argument(
        "--max-tokens", type=int, default=1 << 18, help="skip points with B * S above this"
    )
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--out", default="runs/bench_attention")
    ap.add_argument(
        "--resume",
        action="store_true",
        help="keep the points of --out's report (same backend and device) and time only the "
        "grid's others; the report is rewritten after every point either way",
    )
    return ap


def _runner_class(backend: str):
    """`hstu.<backend>_backend.bench_attention.Runner`, or an error naming the missing package."""
    import importlib

    try:
        module = importlib.import_module(f"hstu.{backend}_backend.bench_attention")
    except ModuleNotFoundError as exc:
        if exc.name and exc.name.split(".")[0] in RUNNERS[backend]:
            raise HSTUError(
                f"--backend {backend}: the kernel benchmark needs the package {exc.name!r}; "
                f"run `make setup` (or pip install -e '.[{backend}]')"
            ) from exc
        raise
    return module.Runner


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    if args.heads < 1 or args.warmup < 0 or args.repeats < 1 or args.max_tokens < 1:
        raise HSTUError("--heads, --repeats and --max-tokens must be >= 1, --warmup >= 0")
    cases = grid(args)
    if args.backend == "torch" and args.lowerings != ("triton",):
        raise HSTUError("--lowerings is for --backend jax (the torch kernel is Triton's)")
    Runner = _runner_class(args.backend)
    if args.backend == "torch":
        runners = [Runner(sdpa=not args.no_sdpa)]
    else:
        runners = [Runner(lowering=lowering) for lowering in args.lowerings]
        for runner in runners:
            why = runner.problem(args.dims, args.dtype, args.rab)
            if why:
                raise HSTUError(f"--lowerings {runner.lowering}: {why}")
    out = Path(args.out)
    path = out / f"attention_{args.backend}.json"
    device, interpret = runners[0].device, runners[0].interpret
    points = load_report(path, args.backend, device, interpret) if args.resume else []
    out.mkdir(parents=True, exist_ok=True)

    def save(points: list[Point]) -> None:
        report = {
            "backend": args.backend,
            "kernels": sorted({p.kernel for p in points}),
            "device": device,
            "interpret": interpret,
            "args": {k: list(v) if isinstance(v, tuple) else v for k, v in vars(args).items()},
            "fwd_bwd_factor": FWD_BWD_FACTOR,
            "points": [p.as_dict() for p in points],
        }
        tmp = path.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(report, indent=1, allow_nan=True) + "\n")
        tmp.replace(path)  # a run killed mid-write leaves the last whole report

    for runner in runners:
        have = {p.case for p in points if p.kernel == runner.kernel}
        todo = [c for c in cases if c not in have]
        kept = f" ({len(cases) - len(todo)} kept from {path})" if len(todo) < len(cases) else ""
        print(f"# {runner.kernel} HSTU attention on {device}: {len(todo)} cases{kept}")
        before = list(points)
        saving = functools.partial(lambda done, new: save(done + new), before)
        points = before + run(runner, todo, args.warmup, args.repeats, on_case=saving)
    save(points)
    print(table(points))
    pngs = heatmaps(points, out, f"{runners[0].device}, {args.dtype}, H={args.heads}")
    print(f"wrote {path} and {len(pngs)} heatmap(s) under {out}")
    failed = [p for p in points if not p.check.get("ok")]
    if failed:
        print(f"{len(failed)} point(s) failed the check against the reference")
        return 1
    return 0
