"""Where a training step's time goes: torch.profiler / jax.profiler over a few steps.

    python scripts/profile_step.py --backend {torch,jax} --config bench_upstream \
        [--steps 14] [--profile-at 10] [--profile-steps 2] [--world W] [--sequence FILE] \
        [key=value ...]

Trains through the core trainer (`hstu.trainer.train`, the backend's own Backend), traces steps
`profile-at ... profile-at + profile-steps - 1`, and prints: the per-step host times, the top
device kernels, the host timeline (busy time per thread) and the device's idle gaps, each
charged to what the dispatching thread was doing (`hstu.bench.trace`). The trace goes to $OUT
(default /tmp). Torch `--world W`: W ranks, one GPU each (gloo processes without CUDA), rank 0
traced and the others training beside it, so the trace shows what a data-parallel step waits
for (the collectives, the next batch's copy and exchange); jax `--world W`: a mesh of W devices
of this one process, every device traced. Measurement aid for docs/BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import collections
import glob
import gzip
import os
import re
import statistics
import tempfile


def summarize_trace(path: str, steps: int, top: int = 25, hlo_dir: str | None = None) -> None:
    """Device kernels by total time, and every host thread's busy time (Chrome-trace JSON).
    `hlo_dir`: XLA's dump of the optimized modules (jax, `--hlo`); each top kernel that is an XLA
    fusion is followed by the fusion's instruction (operand and result shapes) and its root."""
    from hstu.bench import trace as tr

    events = tr.load(path)
    names = tr.names_of(events)
    groups = collections.defaultdict(list)
    modules = {}  # kernel name -> the HLO module that ran it (jax traces carry it)
    for e in events:
        args = e.get("args") or {}
        if "hlo_module" in args:
            # the program id tells apart the modules of one name (jax: one per token capacity)
            # (the instruction: `hlo_op`; the event's name is the kernel, which XLA may share)
            op = args.get("hlo_op", e["name"])
            if op.startswith("command_buffer"):  # a kernel replayed from a command buffer:
                op = re.sub(r"_(\d+)$", r".\1", e["name"])  # named after its fusion
            modules[e["name"]] = (args["hlo_module"], args.get("program_id"), op)
    hlo = _HloIndex(hlo_dir) if hlo_dir else None
    for e in events:
        if e.get("ph") == "X" and "dur" in e:
            process = names.get((e["pid"], None), e["pid"])
            groups[f"{process} | {names.get((e['pid'], e['tid']), e['tid'])}"].append(e)
    for where, evs in sorted(groups.items(), key=lambda kv: -sum(e["dur"] for e in kv[1])):
        total = collections.Counter()
        count = collections.Counter()
        for e in evs:
            total[e["name"]] += e["dur"]
            count[e["name"]] += 1
        # busy time: the union of this thread's intervals (nested events counted once)
        spans = sorted((e["ts"], e["ts"] + e["dur"]) for e in evs)
        busy, end = 0.0, -1e30
        for a, b in spans:
            if b > end:
                busy += b - max(a, end)
                end = b
        print(f"\n== {where}: busy {busy / 1e3 / steps:.2f} ms per step")
        for name, us in total.most_common(top):
            print(f"  {us / 1e3 / steps:9.3f} ms/step  x{count[name] / steps:<6.1f} {name[:90]}")
            if hlo is not None and name in modules:
                for line in hlo.describe(*modules[name]):
                    print(f"      {line[:200]}")
    print("\n== device kernels by class (every stream together)")
    for line in tr.kernel_classes(events, steps).lines():
        print(line)

    def source(name: str) -> str | None:  # jax with --hlo: the op the fusion was made from
        if hlo is None or name not in modules:
            return None
        found = [x[6:] for x in hlo.describe(*modules[name]) if x.startswith("from: ")]
        return re.sub(r"layers_\d+", "layers_N", found[0]) if found else None

    print("\n== kernels under 8 us by source (every stream together; jax --hlo: the jax op)")
    for line in tr.short_kernels(events, steps, source):
        print(line)
    print("\n== device idle (every stream together)")
    try:
        for line in tr.idle_report(events, steps).lines():
            print(line)
    except ValueError as exc:  # a CPU run: no device events to look at
        print(f"  {exc}")
    print("\n== host: the dispatching thread's time by phase")
    for line in tr.host_report(events, steps).lines(top=40):
        print(line)
    print("\n== one step in time order (host events >= 50 us, nested; device busy stretches)")
    for line in tr.timeline(events):
        print(line)


class _HloIndex:
    """Fusion instructions of the optimized modules XLA dumped (`--xla_dump_hlo_as_text`)."""

    def __init__(self, root: str):
        self.files = sorted(glob.glob(os.path.join(root, "*after_optimizations.txt")))
        self.cache = {}

    def _module(self, module: str, program_id) -> str:
        key = (module, program_id)
        if key not in self.cache:
            # file names: module_NNNN.<module name>.sm_90_gpu_after_optimizations.txt
            hits = [f for f in self.files if f".{module}." in os.path.basename(f)]
            prefix = f"module_{str(program_id):0>4}."
            exact = [f for f in hits if os.path.basename(f).startswith(prefix)]
            hits = exact or hits  # without the id: the largest module of the name
            self.cache[key] = ""
            if hits:
                with open(max(hits, key=os.path.getsize)) as f:
                    self.cache[key] = f.read()
        return self.cache[key]

    def describe(self, module: str, program_id, op: str) -> list[str]:
        text = self._module(module, program_id)
        m = re.search(rf"^\s*(?:ROOT )?%?{re.escape(op)} = (.*)$", text, re.M)
        if not m:
            return []
        inst = m.group(1).strip()
        lines = [inst.split(", metadata=")[0]]
        op_name = re.search(r'op_name="([^"]*)"', inst)
        if op_name:  # the jax source of the fusion: its outermost op names the model part
            lines.append("from: " + op_name.group(1)[-150:])
        calls = re.search(r"calls=%?([\w.\-]+)", inst)
        if calls:
            body = re.search(
                rf"^%?{re.escape(calls.group(1))} .*?\{{\n(.*?)^\}}", text, re.M | re.S
            )
            if body:
                ops = re.findall(r"= \S+ (\w[\w-]*)\(", body.group(1))
                root = re.search(r"ROOT .*", body.group(1))
                lines.append(
                    "ops: "
                    + " ".join(f"{k}x{v}" for k, v in collections.Counter(ops).most_common(8))
                )
                if root:
                    lines.append(root.group(0).strip().split(", metadata=")[0])
        return lines


def main(argv=None):
    from hstu import backends
    from hstu.config import load_config

    p = argparse.ArgumentParser()
    p.add_argument("--backend", required=True, choices=["torch", "jax"])
    p.add_argument("--config", required=True)
    p.add_argument("--steps", type=int, default=14)
    p.add_argument("--profile-at", type=int, default=10)
    p.add_argument("--profile-steps", type=int, default=2)
    p.add_argument("--top", type=int, default=25, help="kernels listed per stream group")
    p.add_argument(
        "--hlo",
        action="store_true",
        help="jax: dump the optimized HLO (a temporary folder) and name each top kernel's fusion",
    )
    p.add_argument(
        "--world",
        type=int,
        default=1,
        help="ranks, one GPU each (torch: W processes, rank 0 traced, the others training "
        "beside it; jax: a mesh of W devices in this process, all traced)",
    )
    p.add_argument(
        "--sequence",
        help="write every device event of the traced steps in order to this file "
        "(`hstu.bench.trace.kernel_sequence`: start, duration, idle before, name)",
    )
    p.add_argument(
        "--no-python-trace",
        action="store_true",
        help="jax: leave Python calls out of the trace (`python_tracer_level=0`): the tracer "
        "slows the host's Python by an order of magnitude (pack_host 1.9 ms a step traced on "
        "an H200's host, 0.1 ms untraced on a 2-core CPU machine), so the device's idle in a "
        "traced step is partly the tracer's; the pipeline's phase annotations stay (torch's "
        "profiler records no Python calls here)",
    )
    p.add_argument("overrides", nargs="*")
    args = p.parse_args(argv)
    out_dir = os.environ.get("OUT", "/tmp")
    os.makedirs(out_dir, exist_ok=True)
    hlo_dir = None
    if args.hlo and args.backend == "jax":  # before jax starts its backend
        hlo_dir = tempfile.mkdtemp(prefix="hstu-hlo-")
        os.environ["XLA_FLAGS"] = (
            os.environ.get("XLA_FLAGS", "") + f" --xla_dump_to={hlo_dir} --xla_dump_hlo_as_text"
        ).strip()
    run_dir = tempfile.mkdtemp(prefix="hstu-profile-")
    cfg = load_config(
        args.config,
        [
            *args.overrides,
            f"dist.world_size={args.world}",
            f"train.steps={args.steps}",
            f"output_dir={run_dir}",
        ],
    )
    first, last = args.profile_at, args.profile_at + args.profile_steps - 1
    if args.backend == "torch":
        import torch

        activities = [torch.profiler.ProfilerActivity.CPU]
        if torch.cuda.is_available():  # (without: the host's side only, e.g. gloo ranks)
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        prof = torch.profiler.profile(activities=activities)

        def hook(step, metrics):  # metrics arrive one step late: step+1 is dispatched already
            if step == first - 2:
                prof.start()
            elif step == last:
                if torch.cuda.is_available():
                    torch.cuda.synchronize()
                prof.stop()

        trace = os.path.join(out_dir, "torch_trace.json")
        rows = _train_torch(cfg, hook, args.world)
        prof.export_chrome_trace(trace)
        with open(trace, "rb") as src, gzip.open(trace + ".gz", "wb") as dst:
            dst.write(src.read())
        os.remove(trace)
        trace += ".gz"
    else:
        import jax

        trace_dir = os.path.join(out_dir, "jax_trace")

        options = jax.profiler.ProfileOptions()
        if args.no_python_trace:
            options.python_tracer_level = 0

        def hook(step, metrics):
            if step == first - 2:
                jax.profiler.start_trace(
                    trace_dir, create_perfetto_trace=True, profiler_options=options
                )
            elif step == last:
                jax.effects_barrier()
                jax.profiler.stop_trace()

        rows = backends.get_train("jax")(cfg, on_step=hook)
        trace = sorted(glob.glob(os.path.join(trace_dir, "**", "*.json.gz"), recursive=True))[-1]
    times = [1e3 * r["step_time_s"] for r in rows]
    print("step ms:", " ".join(f"{t:.1f}" for t in times))
    print(f"median after 3: {statistics.median(times[3:]):.2f} ms; profiled {first}..{last}")
    summarize_trace(trace, last - first + 2, top=args.top, hlo_dir=hlo_dir)
    if args.sequence:
        from hstu.bench import trace as tr

        with open(args.sequence, "w") as f:
            f.write("\n".join(tr.kernel_sequence(tr.load(trace))) + "\n")
        print(f"kernel sequence: {args.sequence}")


def _train_torch(cfg, hook, world: int = 1):
    """Rank 0 in this process, set up as `hstu train` sets it up (graphs included), with `hook`
    on every step's metrics; at W > 1 the other ranks spawned beside it."""
    from _ranks import train_rank0

    return train_rank0(cfg, world, hook, port=29533)


if __name__ == "__main__":
    main()
