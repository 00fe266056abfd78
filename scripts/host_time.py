"""Where the torch step's host time goes, without a profiler: wall-clock wrappers on its parts.

    python scripts/host_time.py --config bench_upstream [--steps 40] [--skip 10] [--world W]
        [key=value ...]

A profiler inflates every launch (the host of a batch-8 step took ~18 ms under torch.profiler
against ~9 ms without), so the host timeline of `scripts/profile_step.py` cannot say what the
step costs the host when nobody watches. Here the same one-GPU training (`run_rank`, graphs as
configured) runs with `time.perf_counter` wrappers on the functions named in `TARGETS`; each
prints its median host time per step (calls nest: `forward_backward` holds `sequence`, the
graphed stack and `backward`), next to the median step. Medians, since a step that captures
a graph (one in a few, each new token capacity) takes a hundred times the host time. Without
CUDA it runs on the CPU (gloo; pass train.cuda_graphs=false). `--world W`: W ranks, rank 0
in this process (the one timed), the others spawned, one GPU each (or gloo processes on the
CPU): the host's share of a data-parallel step.
Measurement aid for docs/BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import collections
import functools
import importlib
import statistics
import sys
import tempfile
import time

# module, attribute path: the host calls timed (nested calls are timed inside their callers)
TARGETS = [
    ("hstu.torch_backend.shuffler", "TorchShuffler.to_device"),
    ("hstu.torch_backend.batch", "TorchBatch.pin_memory"),  # trees before staging.py
    ("hstu.torch_backend.staging", "PinnedStaging.copy"),
    ("hstu.torch_backend.train_step", "TorchBackend.forward_backward"),
    ("hstu.torch_backend.shuffler", "TorchShuffler.ready"),
    ("hstu.torch_backend.model", "HSTUModel.sequence"),
    ("hstu.torch_backend.graphs", "GraphedStack.__call__"),
    ("hstu.torch_backend.model", "HSTUModel._ranking_loss"),
    ("hstu.torch_backend.model", "HSTUModel._retrieval_loss"),
    ("torch", "Tensor.backward"),
    ("hstu.torch_backend.grad_sync", "GradBuckets.start"),
    ("hstu.torch_backend.grad_sync", "GradBuckets.finish"),
    ("hstu.torch_backend.grad_sync", "RowMarks.mark"),
    ("hstu.torch_backend.grad_sync", "TouchedRowsReduce.reduce"),
    ("hstu.torch_backend.step_graphs", "StepGraphs._fill"),
    ("hstu.torch_backend.step_graphs", "StepGraphs._reduce_update"),
    ("torch.cuda", "CUDAGraph.replay"),
    ("hstu.torch_backend.train_step", "TorchBackend.optimizer_step"),
    ("torch.optim", "AdamW.step"),
    ("hstu.torch_backend.train_step", "TorchBackend.fetch_metrics"),
]


class Timers:
    def __init__(self):
        self.total = collections.Counter()
        self.calls = collections.Counter()
        self.on = False

    def wrap(self, owner, name: str, label: str) -> None:
        fn = getattr(owner, name)

        @functools.wraps(fn)
        def timed(*args, **kwargs):
            if not self.on:
                return fn(*args, **kwargs)
            t = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.total[label] += time.perf_counter() - t
                self.calls[label] += 1

        setattr(owner, name, timed)


def install(timers: Timers) -> None:
    """Wrap every target this tree has (the script also times older trees: `gpu_check host`)."""
    for module, path in TARGETS:
        try:
            owner = importlib.import_module(module)
            *parents, name = path.split(".")
            for p in parents:
                owner = getattr(owner, p)
            getattr(owner, name)
        except (ImportError, AttributeError):
            continue
        timers.wrap(owner, name, path)


def main(argv=None):
    from _ranks import train_rank0

    from hstu.config import load_config

    p = argparse.ArgumentParser()
    p.add_argument("--config", required=True)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--skip", type=int, default=10, help="steps left out at the start")
    p.add_argument(
        "--switch-interval",
        type=float,
        default=None,
        help="sys.setswitchinterval (s) for the run: how long a thread holding the GIL keeps it "
        "while another waits (Python's default 0.005)",
    )
    p.add_argument("--world", type=int, default=1, help="ranks; rank 0's calls are timed")
    p.add_argument("overrides", nargs="*")
    args = p.parse_args(argv)
    cfg = load_config(
        args.config,
        [
            *args.overrides,
            f"dist.world_size={args.world}",
            f"train.steps={args.steps}",
            f"output_dir={tempfile.mkdtemp(prefix='hstu-host-')}",
        ],
    )
    if args.switch_interval is not None:
        sys.setswitchinterval(args.switch_interval)
    timers = Timers()
    install(timers)
    counted, per_step = [], []

    def on_step(step, metrics):  # one loop iteration: the host time of one step period
        if timers.on:
            counted.append(1e3 * metrics["step_time_s"])
            per_step.append(dict(timers.total))
        timers.total.clear()
        timers.on = step + 1 >= args.skip

    train_rank0(cfg, args.world, on_step, port=29534)
    n = max(len(counted), 1)
    print(
        f"W={args.world}, rank 0: steps timed: {len(counted)}; "
        f"median step {statistics.median(counted):.2f} ms"
    )
    print(f"{'host call':40s} {'median ms':>10s} {'p90 ms':>8s} {'calls / step':>13s}")
    for _module, path in TARGETS:
        if timers.calls[path]:
            ms = sorted(1e3 * s.get(path, 0.0) for s in per_step)
            p90 = ms[min(len(ms) - 1, int(0.9 * len(ms)))]
            print(
                f"{path:40s} {statistics.median(ms):10.3f} {p90:8.3f} "
                f"{timers.calls[path] / n:13.1f}"
            )


if __name__ == "__main__":
    main()
