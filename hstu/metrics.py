"""One metrics path: a JSONL line per step, a stdout line per log step, a progress bar, a
summary table at the end, and TensorBoard when a writer is installed."""

from __future__ import annotations

import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

# The per-step fields every backend writes to metrics.jsonl (the CLI contract).
STEP_FIELDS = (
    "step",
    "loss",
    "global_tokens",
    "rank_workloads_before",
    "rank_workloads_after",
    "imbalance_before",
    "imbalance_after",
    "step_time_s",
    "tokens_per_s",
)

# Dense bf16 peak of the accelerators we report MFU against (TFLOP/s, no sparsity).
PEAK_TFLOPS = {"H100": 989.0, "H200": 989.0, "A100": 312.0}


def peak_tflops(device_name: str, override: float = 0.0) -> float:
    if override:
        return override
    for key, value in PEAK_TFLOPS.items():
        if key in device_name:
            return value
    return 0.0  # unknown (CPU): MFU is not reported


class ProgressBar:
    """A one-line bar on stderr when it is a terminal; silent otherwise (CI logs stay clean)."""

    def __init__(self, total: int, enabled: bool | None = None, stream=None):
        self.total, self.stream = total, stream or sys.stderr
        self.enabled = self.stream.isatty() if enabled is None else enabled
        self.t0 = time.perf_counter()

    def update(self, done: int, text: str = "") -> None:
        if not self.enabled:
            return
        width = 30
        filled = int(width * done / max(self.total, 1))
        rate = done / max(time.perf_counter() - self.t0, 1e-9)
        self.stream.write(
            f"\r[{'#' * filled}{'.' * (width - filled)}] {done}/{self.total} {rate:.2f} it/s {text}"
        )
        self.stream.flush()
        if done >= self.total:
            self.stream.write("\n")


class MetricsLogger:
    def __init__(
        self,
        output_dir: str | Path,
        total_steps: int,
        log_every: int = 1,
        peak: float = 0.0,
        verbose: bool = True,
        tensorboard: bool = True,
    ):
        self.dir = Path(output_dir)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.path = self.dir / "metrics.jsonl"
        self.file = self.path.open("a")
        self.log_every, self.peak, self.verbose = log_every, peak, verbose
        self.bar = ProgressBar(total_steps)
        self.rows: list[dict] = []
        self.tb = None
        if tensorboard:
            try:  # optional: only when the user installed a writer
                from torch.utils.tensorboard import SummaryWriter

                self.tb = SummaryWriter(str(self.dir / "tb"))
            except Exception:  # noqa: BLE001 - any import/runtime failure just disables it
                self.tb = None

    def log(self, step: int, metrics: dict[str, Any]) -> None:
        if self.peak:
            metrics["mfu"] = metrics.get("tflops_per_device", 0.0) / self.peak
        self.rows.append(metrics)
        self.file.write(json.dumps(metrics) + "\n")
        self.file.flush()
        if self.tb is not None:
            for k, v in metrics.items():
                if isinstance(v, (int, float)):
                    self.tb.add_scalar(k, v, step)
        self.bar.update(step + 1, f"loss {metrics.get('loss', float('nan')):.4f}")
        if self.verbose and (step % self.log_every == 0) and not self.bar.enabled:
            print(format_step(metrics), flush=True)

    def close(self) -> None:
        self.file.close()
        if self.tb is not None:
            self.tb.close()


def format_step(m: dict[str, Any]) -> str:
    parts = [
        f"step {m['step']:>4}",
        f"loss {m.get('loss', float('nan')):.5f}",
        f"imbalance {m['imbalance_before']:.3f} -> {m['imbalance_after']:.3f}",
        f"tokens {m['global_tokens']}",
        f"{m['tokens_per_s']:,.0f} tok/s",
        f"{m['step_time_s'] * 1e3:.1f} ms",
    ]
    if "mfu" in m:
        parts.append(f"{m['tflops_per_device']:.1f} TFLOP/s MFU {100 * m['mfu']:.1f}%")
    return " | ".join(parts)


def _compiled(rows: list[dict], i: int) -> bool:
    """Step i built a new program (the JAX backend logs its running count of shape buckets)."""
    return i > 0 and rows[i].get("num_compiles", 0) > rows[i - 1].get("num_compiles", 0)


def summarize(rows: list[dict], skip_warmup: int = 1) -> dict[str, float]:
    """Medians over the steps after warm-up: the first `skip_warmup` steps and every later step
    that compiled a new program (a new shape bucket in the JAX backend) are left out; how many
    steps remain is `steps_timed`."""
    if not rows:
        return {}
    use = [r for i, r in enumerate(rows) if i >= skip_warmup and not _compiled(rows, i)]
    if not use:  # too few steps to leave any out
        use = rows[skip_warmup:] or rows

    def med(key):
        vals = [r[key] for r in use if key in r]
        return statistics.median(vals) if vals else float("nan")

    out = {
        "steps": len(rows),
        "steps_timed": len(use),
        "first_loss": rows[0].get("loss", float("nan")),
        "last_loss": rows[-1].get("loss", float("nan")),
        "imbalance_before": med("imbalance_before"),
        "imbalance_after": med("imbalance_after"),
        "step_time_s": med("step_time_s"),
        "tokens_per_s": med("tokens_per_s"),
        "tflops_per_device": med("tflops_per_device"),
    }
    if any("mfu" in r for r in use):
        out["mfu"] = med("mfu")
    return out


def format_summary(summary: dict[str, float], title: str = "summary") -> str:
    lines = [f"{title} (medians after warm-up)", "-" * 44]
    labels = {
        "steps": "steps",
        "steps_timed": "steps timed (no compile)",
        "first_loss": "loss (first step)",
        "last_loss": "loss (last step)",
        "imbalance_before": "imbalance before shuffle",
        "imbalance_after": "imbalance after",
        "step_time_s": "step time (s)",
        "tokens_per_s": "tokens/s",
        "tflops_per_device": "TFLOP/s per device",
        "mfu": "MFU",
    }
    for key, label in labels.items():
        if key in summary:
            v = summary[key]
            text = f"{v:,.4f}" if isinstance(v, float) else str(v)
            lines.append(f"{label:<28}{text:>16}")
    return "\n".join(lines)
