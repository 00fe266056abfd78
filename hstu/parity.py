"""`hstu parity`: train one recipe with both backends and compare the loss curves step by step.

Each backend trains in its own process (`python -m hstu.cli train --backend ...`, so neither
framework's import or device set-up touches the other) into `<output_dir>/<backend>`; the
table lists every step's loss of both, the absolute and relative difference, and each
backend's tokens/s. The command fails when the largest relative difference exceeds the
tolerance.

Tolerances (`DEFAULT_RTOL`, by `model.dtype`):

* float32: 1e-4. fp32 rounds at 2^-24 ~ 6e-8 relative; the backends sum in different orders
  (XLA vs ATen reductions, gradient all-reduce order), which after 30 AdamW steps moves the
  demo loss by 7e-6 at most (measured on CPU). 1e-4 leaves a 10x margin and still catches any
  real mismatch (a wrong mask, bias bucket or normaliser shifts the loss by ~1e-2 at once).
* float16: 5e-3. 11-bit significand: ~4.9e-4 per rounding, ten roundings of headroom (the
  demo measures 1.3e-3 over 30 steps).
* bfloat16: 3e-2. 8-bit significand: one rounding is already ~4e-3 relative (2^-8), and the
  stack rounds activations at every layer boundary, in different places per backend (ATen
  and XLA fuse differently), so the losses differ by about one rounding from the first steps
  (the demo measures 4.2e-3 over 30 steps on CPU, 3.1e-3 to 4.0e-3 on an H200 with the
  reference attention and with the kernels) and AdamW, whose early updates are sign-like,
  carries the differences forward; 3e-2 is ~7 roundings.

fp32 runs set `JAX_DEFAULT_MATMUL_PRECISION=highest` and `NVIDIA_TF32_OVERRIDE=0` for the
training processes: on GPUs JAX otherwise multiplies fp32 matrices in TF32 (10-bit
significand), which is not the fp32 math being compared.

Golden files (`--write-golden`, `--golden`) store the recipe, its overrides and the agreed
curve (the mean of the two backends, which the parity check has just shown to agree); a
backend that drifts from it by more than the tolerance fails the check.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from hstu.errors import HSTUError

BACKENDS = ("torch", "jax")
DEFAULT_RTOL = {"float32": 1e-4, "float16": 5e-3, "bfloat16": 3e-2}
FP32_ENV = {"JAX_DEFAULT_MATMUL_PRECISION": "highest", "NVIDIA_TF32_OVERRIDE": "0"}
GOLDEN_FORMAT = 1


def run_backend(
    backend: str,
    config: str | Path,
    overrides: Sequence[str],
    output_dir: str | Path,
    env: dict[str, str] | None = None,
) -> list[dict]:
    """Train with one backend in a fresh process; its per-step metric rows."""
    out = Path(output_dir)
    metrics = out / "metrics.jsonl"
    metrics.unlink(missing_ok=True)  # a logger appends: start this run's file afresh
    cmd = [
        sys.executable,
        "-m",
        "hstu.cli",
        "train",
        "--backend",
        backend,
        "--config",
        str(config),
        *overrides,
        f"output_dir={out}",
    ]
    proc = subprocess.run(
        cmd, capture_output=True, text=True, env=dict(os.environ, **(env or {})), check=False
    )
    if proc.returncode != 0 or not metrics.is_file():
        raise HSTUError(
            f"{backend} training failed (exit {proc.returncode}): {' '.join(cmd)}\n"
            f"{proc.stderr[-3000:]}"
        )
    return [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]


def rel_diff(a: float, b: float) -> float:
    return abs(a - b) / max(abs(a), abs(b), 1e-30)


@dataclass
class Comparison:
    steps: list[int]
    losses: dict[str, list[float]]  # backend -> loss per step
    tokens_per_s: dict[str, list[float]]

    @property
    def abs_diff(self) -> list[float]:
        return [abs(a - b) for a, b in zip(*self.losses.values(), strict=True)]

    @property
    def rel_diff(self) -> list[float]:
        return [rel_diff(a, b) for a, b in zip(*self.losses.values(), strict=True)]

    @property
    def max_abs(self) -> float:
        return max(self.abs_diff, default=0.0)

    @property
    def max_rel(self) -> float:
        return max(self.rel_diff, default=0.0)

    def mean_curve(self) -> list[float]:
        return [sum(v) / len(v) for v in zip(*self.losses.values(), strict=True)]


def compare(rows: dict[str, list[dict]]) -> Comparison:
    """Line up both backends' rows step by step (they must cover the same steps)."""
    steps = {b: [r["step"] for r in rows[b]] for b in BACKENDS}
    if steps["torch"] != steps["jax"] or not steps["torch"]:
        raise HSTUError(f"the runs logged different steps: {steps}")
    return Comparison(
        steps["torch"],
        {b: [float(r["loss"]) for r in rows[b]] for b in BACKENDS},
        {b: [float(r.get("tokens_per_s", 0.0)) for r in rows[b]] for b in BACKENDS},
    )


def _median(values: Sequence[float]) -> float:
    vals = sorted(values[1:] if len(values) > 1 else values)  # the first step compiles
    mid = len(vals) // 2
    return vals[mid] if len(vals) % 2 else (vals[mid - 1] + vals[mid]) / 2


def format_table(cmp: Comparison, title: str) -> str:
    head = (
        f"{'step':>5} {'loss torch':>12} {'loss jax':>12} {'abs diff':>10} {'rel diff':>10} "
        f"{'torch tok/s':>12} {'jax tok/s':>12}"
    )
    lines = [title, head, "-" * len(head)]
    for i, step in enumerate(cmp.steps):
        t, j = cmp.losses["torch"][i], cmp.losses["jax"][i]
        lines.append(
            f"{step:>5} {t:>12.7f} {j:>12.7f} {cmp.abs_diff[i]:>10.2e} {cmp.rel_diff[i]:>10.2e} "
            f"{cmp.tokens_per_s['torch'][i]:>12,.0f} {cmp.tokens_per_s['jax'][i]:>12,.0f}"
        )
    lines.append("-" * len(head))
    lines.append(
        f"{'max':>5} {'':>12} {'':>12} {cmp.max_abs:>10.2e} {cmp.max_rel:>10.2e} "
        f"{_median(cmp.tokens_per_s['torch']):>12,.0f} {_median(cmp.tokens_per_s['jax']):>12,.0f}"
        "  (tok/s: median after the first step)"
    )
    return "\n".join(lines)


# ------------------------------------------------------------------------------ golden files
def golden_payload(
    cmp: Comparison, config: str, overrides: Sequence[str], dtype: str, path: str | Path
) -> dict:
    argv = " ".join(["hstu parity --config", str(config), *overrides, "--write-golden", str(path)])
    return {
        "format": GOLDEN_FORMAT,
        "config": str(config),
        "overrides": list(overrides),
        "dtype": dtype,
        "command": argv,
        "steps": cmp.steps,
        "losses": cmp.mean_curve(),
        "backends": cmp.losses,
    }


def write_golden(path: str | Path, payload: dict) -> None:
    """One line per field (curves stay on one line each, so a diff shows what moved)."""
    items = []
    for key, value in payload.items():
        if isinstance(value, dict):
            inner = ",\n".join(f"  {json.dumps(k)}: {json.dumps(v)}" for k, v in value.items())
            items.append(f" {json.dumps(key)}: {{\n{inner}\n }}")
        else:
            items.append(f" {json.dumps(key)}: {json.dumps(value)}")
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text("{\n" + ",\n".join(items) + "\n}\n")


def load_golden(path: str | Path) -> dict:
    p = Path(path)
    if not p.is_file():
        raise HSTUError(f"golden file {str(p)!r} does not exist")
    data = json.loads(p.read_text())
    if data.get("format") != GOLDEN_FORMAT or len(data.get("losses", ())) != len(data["steps"]):
        raise HSTUError(f"{p} is not a golden loss file of format {GOLDEN_FORMAT}")
    return data


def golden_drift(losses: Sequence[float], golden: dict) -> tuple[float, int]:
    """(largest relative difference from the golden curve, the step where it occurs)."""
    want = golden["losses"]
    if len(losses) != len(want):
        raise HSTUError(
            f"the run has {len(losses)} steps, the golden curve {len(want)}: train with the "
            f"golden file's recipe ({golden['config']} {' '.join(golden['overrides'])})"
        )
    diffs = [abs(a - g) / abs(g) for a, g in zip(losses, want, strict=True)]
    worst = max(range(len(diffs)), key=diffs.__getitem__)
    return diffs[worst], golden["steps"][worst]


# ------------------------------------------------------------------------------ command
def main(args, runner: Callable[..., list[dict]] | None = None) -> int:
    """`hstu parity` (args from hstu.cli); 0 when the curves agree, 1 when they do not.
    `runner` trains one backend (default `run_backend`)."""
    from hstu.config import load_config

    runner = runner or run_backend
    cfg = load_config(args.config, args.overrides)  # fail on a bad override before training
    dtype = cfg.model.dtype
    rtol = DEFAULT_RTOL[dtype] if args.rtol is None else args.rtol
    out = Path(args.output_dir) if args.output_dir else Path(cfg.output_dir) / "parity"
    env = FP32_ENV if dtype == "float32" else {}
    rows = {b: runner(b, args.config, args.overrides, out / b, env) for b in BACKENDS}
    cmp = compare(rows)
    title = (
        f"hstu parity: {args.config} {' '.join(args.overrides)}".rstrip()
        + f" | {cfg.dist.world_size} rank(s), {dtype}, shuffler={cfg.balance.shuffler}, "
        f"exchange={cfg.balance.exchange} | runs in {out}"
    )
    print(format_table(cmp, title))
    ok = cmp.max_rel <= rtol
    verdict = "PASS" if ok else "FAIL"
    print(f"{verdict}: largest relative loss difference {cmp.max_rel:.2e} (rtol {rtol:.0e})")
    if args.golden:
        golden = load_golden(args.golden)
        for b in BACKENDS:
            drift, step = golden_drift(cmp.losses[b], golden)
            good = drift <= rtol
            ok &= good
            print(
                f"{'PASS' if good else 'FAIL'}: {b} vs golden {args.golden}: largest relative "
                f"difference {drift:.2e} at step {step} (rtol {rtol:.0e})"
            )
    if args.write_golden:
        if not ok:
            raise HSTUError("the backends disagree: no golden file written")
        payload = golden_payload(cmp, args.config, args.overrides, dtype, args.write_golden)
        write_golden(args.write_golden, payload)
        print(f"golden curve written to {args.write_golden}")
    return 0 if ok else 1
