"""One metrics path: a JSONL line per step, a stdout line per log step under a progress bar,
TensorBoard scalars, and a summary table at the end.

The TensorBoard writer uses the `tensorboard` package's event-file writer directly, so a JAX run
never imports torch (`torch.utils.tensorboard` is only a wrapper around the same writer).
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

# The per-step fields both backends write to metrics.jsonl (the CLI contract; a test holds
# both backends to the same set of keys).
STEP_FIELDS = (
    "step",
    "loss",
    "grad_norm",
    "global_tokens",
    "global_loss_tokens",
    "global_samples",
    "global_flops",
    "rank_workloads_before",
    "rank_workloads_after",
    "imbalance_before",
    "imbalance_after",
    "tokens_max_before",
    "tokens_max_after",
    "token_capacity",
    "padding_waste",
    "num_compiles",
    "step_time_s",
    "tokens_per_s",
    "tflops_per_device",
    "host_s",
    "balancer_s",
    "device_wait_s",
    "exposed_balancer_s",
    "perturbed",
    "fetch_lag",
    "max_memory_gib",
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


class TensorBoardWriter:
    """Scalars into a TensorBoard event file, with no deep-learning framework imported."""

    def __init__(self, log_dir: str | Path):
        from tensorboard.compat.proto import event_pb2, summary_pb2
        from tensorboard.summary.writer.event_file_writer import EventFileWriter

        self._event, self._summary = event_pb2.Event, summary_pb2.Summary
        self._writer = EventFileWriter(str(log_dir))

    def scalars(self, step: int, values: dict[str, float]) -> None:
        summary = self._summary(
            value=[self._summary.Value(tag=k, simple_value=float(v)) for k, v in values.items()]
        )
        self._writer.add_event(self._event(wall_time=time.time(), step=step, summary=summary))

    def close(self) -> None:
        self._writer.flush()
        self._writer.close()


def read_rows(path: str | Path) -> list[dict]:
    path = Path(path)
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


class MetricsLogger:
    """Process 0's metrics sink. A fresh run starts `metrics.jsonl` over; a resumed run keeps
    the lines of the steps before `start_step` and drops those it is about to train again."""

    def __init__(
        self,
        output_dir: str | Path,
        total_steps: int,
        log_every: int = 1,
        peak: float = 0.0,
        start_step: int = 0,
        tensorboard: bool = True,
        progress: bool | None = None,
        stream=None,
    ):
        self.dir = Path(output_dir)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.path = self.dir / "metrics.jsonl"
        kept = [r for r in read_rows(self.path) if r.get("step", -1) < start_step]
        with self.path.open("w") as f:
            f.writelines(json.dumps(r) + "\n" for r in kept)
        self.file = self.path.open("a")
        self.log_every, self.peak = log_every, peak
        self.stream = stream or sys.stdout
        self.rows: list[dict] = []
        self.tb = TensorBoardWriter(self.dir / "tb") if tensorboard else None
        from tqdm import tqdm

        enabled = sys.stderr.isatty() if progress is None else progress
        self.bar = tqdm(
            total=total_steps,
            initial=start_step,
            disable=not enabled,
            unit="step",
            dynamic_ncols=True,
            leave=True,
        )

    def print(self, text: str) -> None:
        """A line that stays above the progress bar."""
        self.bar.write(text, file=self.stream)
        self.stream.flush()

    def log(self, step: int, metrics: dict[str, Any]) -> None:
        if self.peak:
            metrics["mfu"] = metrics.get("tflops_per_device", 0.0) / self.peak
        self.rows.append(metrics)
        self.file.write(json.dumps(metrics) + "\n")
        self.file.flush()
        if self.tb is not None:
            scalars = {
                k: v
                for k, v in metrics.items()
                if isinstance(v, (int, float)) and not isinstance(v, bool)
            }
            self.tb.scalars(
                step, {k: v for k, v in scalars.items() if k not in ("step", "fetch_lag")}
            )
        self.bar.set_postfix_str(f"loss {metrics.get('loss', float('nan')):.4f}", refresh=False)
        self.bar.update(1)
        if step % self.log_every == 0:
            self.print(format_step(metrics))

    def close(self) -> None:
        self.bar.close()
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
    if m.get("max_memory_gib") is not None:
        parts.append(f"mem {m['max_memory_gib']:.1f} GiB")
    return " | ".join(parts)


def _compiled(rows: list[dict], i: int) -> bool:
    """Row i's time holds a build of a new program (a new JAX shape bucket, a torch graph
    capture): the count rises at row i, or at one of the next `fetch_lag` rows (1 when the row
    does not say), since a row's time is the loop iteration in which its metrics arrive, which
    dispatches (and so compiles) the step `fetch_lag` ahead."""

    def rises(j: int) -> bool:
        return 0 < j < len(rows) and rows[j].get("num_compiles", 0) > rows[j - 1].get(
            "num_compiles", 0
        )

    return any(rises(j) for j in range(i, i + 1 + int(rows[i].get("fetch_lag", 1))))


def timed_rows(rows: list[dict], skip_warmup: int = 1) -> list[dict]:
    """The steps a median is taken over: after the first `skip_warmup`, without the steps that
    built a new program or whose period holds other work (a checkpoint save, a benchmark's
    measurement: `perturbed`). Falls back to what there is when too few steps remain."""
    use = [
        r
        for i, r in enumerate(rows)
        if i >= skip_warmup and not _compiled(rows, i) and not r.get("perturbed")
    ]
    return use or rows[skip_warmup:] or rows


def build_seconds(rows: list[dict], skip_warmup: int = 1) -> float:
    """Seconds the run's steps spent building programs: over the first step and each step
    that built a new one (a JAX compile, a torch CUDA-graph capture: `num_compiles` rises),
    the time above the median of the timed steps (`timed_rows`). The same for both backends,
    from the metrics rows alone; what a run pays once, which the median step leaves out."""
    use = timed_rows(rows, skip_warmup)
    if not rows or not use:
        return 0.0
    median = statistics.median(r["step_time_s"] for r in use)
    return float(
        sum(
            max(0.0, r["step_time_s"] - median)
            for i, r in enumerate(rows)
            if i == 0 or _compiled(rows, i)
        )
    )


def summarize(rows: list[dict], skip_warmup: int = 1) -> dict[str, float]:
    """Medians over `timed_rows`; how many steps that is is `steps_timed`."""
    if not rows:
        return {}
    use = timed_rows(rows, skip_warmup)

    def med(key):
        vals = [r[key] for r in use if r.get(key) is not None]
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
    if any(r.get("max_memory_gib") is not None for r in use):
        out["max_memory_gib"] = max(r["max_memory_gib"] for r in use if r.get("max_memory_gib"))
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
        "max_memory_gib": "peak device memory (GiB)",
    }
    for key, label in labels.items():
        if key in summary:
            v = summary[key]
            text = f"{v:,.4f}" if isinstance(v, float) else str(v)
            lines.append(f"{label:<28}{text:>16}")
    return "\n".join(lines)
