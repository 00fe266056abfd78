"""When the device idles inside a training step, and what the host was doing meanwhile.

Reads a Chrome-trace JSON written by torch.profiler or jax.profiler (`scripts/profile_step.py`)
and takes the union of everything the device ran (every stream: a CUDA graph's kernels land on
streams of their own), so an idle gap is time in which no kernel or copy ran at all. Each gap
is then charged to the host: at every instant of it, the innermost event open on the thread
that dispatches the steps (the one holding the pipeline's `hstu.*` ranges, `hstu.pipeline`
marks its phases) names what kept the next launch from coming. "(python)" is time in a phase
with no traced op open: the interpreter itself.

A device that never waits has no gaps; a step whose fixed cost is host work shows it here by
name, phase by phase.
"""

from __future__ import annotations

import bisect
import collections
import gzip
import json
import re
from dataclasses import dataclass, field

PHASE_PREFIX = "hstu."
_TORCH_DEVICE_CATS = ("kernel", "gpu_memcpy", "gpu_memset")


def load(path: str) -> list[dict]:
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path) as f:
        trace = json.load(f)
    return trace["traceEvents"] if isinstance(trace, dict) else trace


def names_of(events: list[dict]) -> dict:
    """(pid, None) -> process name, (pid, tid) -> thread name, from the metadata events."""
    names = {}
    for e in events:
        if e.get("ph") == "M" and e.get("name") in ("process_name", "thread_name"):
            key = (e["pid"], e.get("tid") if e["name"] == "thread_name" else None)
            names[key] = e["args"]["name"]
    return names


def is_device_event(e: dict, names: dict) -> bool:
    """A kernel, copy or memset: torch marks them by category, jax puts them on the device's
    `Stream #N(...)` threads (its other device threads are spans derived from those)."""
    if e.get("cat") in _TORCH_DEVICE_CATS:
        return True
    process = str(names.get((e.get("pid"), None), ""))
    return process.startswith("/device:") and str(
        names.get((e.get("pid"), e.get("tid")), "")
    ).startswith("Stream")


# What a device kernel is, by its name (first match wins). Every Mosaic GPU kernel of a step
# (`entry_mosaic_gpu_kernel`) is one of our attention kernels (jax's `mosaic` lowering). JAX
# names its XLA fusions after the kind of code XLA emitted (`loop_*`: elementwise,
# `input_*reduce*`: a reduction, `fusion_N`: XLA's other fusions), which is what the `xla ...`
# classes split by: so jax's optimizer updates fall under "xla elemwise", not "optimizer".
KERNEL_CLASSES = (
    ("attention", re.compile(r"hstu_(attention|bwd|fwd)|_hstu_|mosaic_gpu", re.I)),
    ("matmul", re.compile(r"gemm|xmma|nvjet|cutlass|cublas|matmul|dot_fusion", re.I)),
    ("norm", re.compile(r"layer_norm|layernorm", re.I)),
    ("optimizer", re.compile(r"adam|multi_tensor_apply|foreach", re.I)),
    ("copy / fill", re.compile(r"memcpy|memset|fill|copy", re.I)),
    ("xla reduce", re.compile(r"^(input|loop)_\w*reduce\w*fusion")),
    ("xla scatter", re.compile(r"^(input|loop)_\w*(scatter|gather)\w*fusion")),
    ("xla elemwise", re.compile(r"^((input|loop)_\w*fusion|wrapped_)")),
    ("xla fusion", re.compile(r"^fusion(_\d+)?$")),
    ("other", re.compile(r"")),
)


def kernel_class(name: str) -> str:
    return next(cls for cls, pattern in KERNEL_CLASSES if pattern.search(name))


@dataclass
class KernelClasses:
    """Per class of device event: time, count, and how much of it came from short kernels
    (`short_us`: those under `short_us_max`, whose cost is launch and ramp, not work)."""

    steps: int
    short_us_max: float
    rows: dict  # class -> [us, count, short count, short us]

    def lines(self) -> list[str]:
        s = max(self.steps, 1)

        def row(name, us, n, ns, sus):
            return (
                f"  {name:<13} {us / 1e3 / s:8.3f} {n / s:8.1f} {ns / s:9.1f} {sus / 1e3 / s:9.3f}"
            )

        short = f"< {self.short_us_max:g} us"
        out = [f"  {'class':<13} {'ms/step':>8} {'kernels':>8} {short:>9} {'their ms':>9}"]
        for cls, r in sorted(self.rows.items(), key=lambda kv: -kv[1][0]):
            out.append(row(cls, *r))
        out.append(row("all", *(sum(r[i] for r in self.rows.values()) for i in range(4))))
        return out


def kernel_classes(events: list[dict], steps: int, short_us_max: float = 8.0) -> KernelClasses:
    """Every device event of the trace (all streams) summed by `kernel_class`."""
    names = names_of(events)
    rows: dict = collections.defaultdict(lambda: [0.0, 0, 0, 0.0])
    for e in events:
        if e.get("ph") == "X" and "dur" in e and is_device_event(e, names):
            row = rows[kernel_class(e["name"])]
            row[0] += e["dur"]
            row[1] += 1
            if e["dur"] < short_us_max:
                row[2] += 1
                row[3] += e["dur"]
    return KernelClasses(steps, short_us_max, dict(rows))


_NAME_NOISE = re.compile(
    r"^void |at::native::|\(anonymous namespace\)::|at::cuda::|c10::|std::|"
    r"::operator\(\)\(\) const|\{lambda\(\)#\d+\}"
)


def short_name(name: str) -> str:
    """A kernel name without the namespaces and lambda wrappers that make torch's elementwise
    kernels' names start alike (`void at::native::vectorized_elementwise_kernel<4,
    at::native::(anonymous namespace)::where_kernel_impl(...)...`): what tells them apart
    comes first."""
    return _NAME_NOISE.sub("", name)


def short_kernels(
    events: list[dict],
    steps: int,
    source=None,
    short_us_max: float = 8.0,
    top: int = 25,
) -> list[str]:
    """The device events under `short_us_max` (launch and ramp, not work), grouped by where
    they come from: `source(kernel name)` (e.g. the jax op an XLA fusion was made from, with
    the layer index dropped), the name itself where it gives None. Lines: ms per step, events
    per step, source; the largest `top` groups, then the total."""
    names = names_of(events)
    us: collections.Counter = collections.Counter()
    count: collections.Counter = collections.Counter()
    for e in events:
        short = e.get("ph") == "X" and "dur" in e and e["dur"] < short_us_max
        if short and is_device_event(e, names):
            key = (source(e["name"]) if source else None) or e["name"]
            us[key] += e["dur"]
            count[key] += 1
    s = max(steps, 1)
    out = [f"  {'ms/step':>8} {'kernels':>8}  source"]
    for key, t in us.most_common(top):
        out.append(f"  {t / 1e3 / s:8.3f} {count[key] / s:8.1f}  {short_name(key)[:160]}")
    total = sum(us.values())
    out.append(
        f"  {total / 1e3 / s:8.3f} {sum(count.values()) / s:8.1f}  all under {short_us_max:g} us"
    )
    return out


def kernel_sequence(events: list[dict], max_lines: int = 4000) -> list[str]:
    """Every device event of the trace in start order, one line each: its start (ms from the
    first), duration and the idle time before it (us, 0 where it overlaps the one before),
    and its short name. What a fusion would remove reads off in order: a layer's launches,
    their sizes and the gaps between them (the per-name totals of `kernel_classes` lose it)."""
    names = names_of(events)
    device = sorted(
        (float(e["ts"]), float(e["dur"]), str(e.get("name", "")))
        for e in events
        if e.get("ph") == "X" and "dur" in e and is_device_event(e, names)
    )
    if not device:
        return []
    t0, end = device[0][0], device[0][0]
    out = [f"{'ms':>9} {'us':>8} {'gap us':>7}  kernel"]
    for ts, dur, name in device[:max_lines]:
        out.append(
            f"{(ts - t0) / 1e3:9.3f} {dur:8.1f} {max(ts - end, 0.0):7.1f}  {short_name(name)[:110]}"
        )
        end = max(end, ts + dur)
    return out


def _union(spans: list[tuple[float, float, str]]) -> list[list]:
    """Merged busy intervals `[start, end, first event's name, name of the event ending last]`."""
    out: list[list] = []
    for a, b, name in sorted(spans):
        if out and a <= out[-1][1]:
            if b > out[-1][1]:
                out[-1][1], out[-1][3] = b, name
        else:
            out.append([a, b, name, name])
    return out


def device_busy_in_ranges(events: list[dict], prefix: str) -> dict[str, float]:
    """Device busy microseconds inside each host range whose name starts with `prefix`: the
    union of every device event (all streams) that started inside the range, so overlapping
    kernels count once and the device's idle time not at all. `{range name: us}`; a range
    whose work ran nowhere but the host reads 0."""
    names = names_of(events)
    ranges = sorted(
        (e["ts"], e["ts"] + e["dur"], e["name"])
        for e in events
        if e.get("ph") == "X" and "dur" in e and str(e.get("name", "")).startswith(prefix)
    )
    spans: dict[str, list] = {name: [] for _, _, name in ranges}
    starts = [r[0] for r in ranges]
    for e in events:
        if e.get("ph") != "X" or "dur" not in e or not is_device_event(e, names):
            continue
        i = bisect.bisect_right(starts, e["ts"]) - 1
        if i >= 0 and e["ts"] <= ranges[i][1]:
            spans[ranges[i][2]].append((e["ts"], e["ts"] + e["dur"], e["name"]))
    return {name: sum(b - a for a, b, *_ in _union(s)) for name, s in spans.items()}


@dataclass
class Gap:
    start: float  # us, trace clock
    end: float
    before: str  # the device's last event before the gap, and its first after
    after: str
    charged: collections.Counter = field(default_factory=collections.Counter)  # (phase, op) -> us

    @property
    def us(self) -> float:
        return self.end - self.start


@dataclass
class IdleReport:
    steps: int
    window_us: float  # first device event to the last
    busy_us: float
    gaps: list[Gap]
    host_thread: str
    min_gap_us: float

    @property
    def idle_us(self) -> float:
        return self.window_us - self.busy_us

    def charged(self) -> collections.Counter:
        total: collections.Counter = collections.Counter()
        for g in self.gaps:
            total.update(g.charged)
        return total

    def by_phase(self) -> collections.Counter:
        total: collections.Counter = collections.Counter()
        for (phase, _), us in self.charged().items():
            total[phase] += us
        return total

    def lines(self, top: int = 12) -> list[str]:
        s = max(self.steps, 1)
        small = self.idle_us - sum(g.us for g in self.gaps)
        out = [
            f"device busy {self.busy_us / 1e3 / s:.2f} ms per step, idle "
            f"{self.idle_us / 1e3 / s:.2f} ms per step ({len(self.gaps) / s:.1f} gaps >= "
            f"{self.min_gap_us:g} us per step; shorter gaps {small / 1e3 / s:.2f} ms); host "
            f"thread charged: {self.host_thread}",
            "  idle by host phase (ms per step):",
        ]
        for phase, us in self.by_phase().most_common():
            out.append(f"    {us / 1e3 / s:8.3f}  {phase}")
        out.append("  idle by host phase and innermost op (ms per step):")
        for (phase, op), us in self.charged().most_common(top):
            out.append(f"    {us / 1e3 / s:8.3f}  {phase} > {op[:80]}")
        out.append(f"  largest gaps (of {len(self.gaps)}):")
        for g in sorted(self.gaps, key=lambda g: -g.us)[:top]:
            what = ", ".join(f"{p} > {o[:40]} {us:.0f}" for (p, o), us in g.charged.most_common(2))
            out.append(
                f"    {g.us:8.1f} us  after {g.before[:40]!r} before {g.after[:40]!r}: {what}"
            )
        return out


@dataclass
class HostReport:
    """Where the dispatching thread's time goes: each event's self time (its duration less
    that of the events nested in it), by the innermost `hstu.*` phase around it."""

    steps: int
    host_thread: str
    self_us: collections.Counter  # (phase, event) -> us

    def lines(self, top: int = 25) -> list[str]:
        s = max(self.steps, 1)
        phases: collections.Counter = collections.Counter()
        for (phase, _), us in self.self_us.items():
            phases[phase] += us
        out = [f"host thread {self.host_thread}, by phase (ms per step):"]
        out += [f"    {us / 1e3 / s:8.3f}  {p}" for p, us in phases.most_common()]
        out.append("  self time by phase and event (ms per step):")
        for (phase, name), us in self.self_us.most_common(top):
            out.append(f"    {us / 1e3 / s:8.3f}  {phase} > {name[:90]}")
        return out


def _dispatch_thread(events: list[dict], names: dict):
    """The dispatching host thread's X events as sorted (start, end, name) spans, and its
    name: the thread holding the pipeline's phases, else the busiest host thread."""
    host = collections.defaultdict(list)
    for e in events:
        if e.get("ph") == "X" and "dur" in e and not is_device_event(e, names):
            span = (float(e["ts"]), float(e["ts"]) + float(e["dur"]), str(e.get("name", "")))
            host[(e["pid"], e["tid"])].append(span)
    marked = {k: v for k, v in host.items() if any(n.startswith(PHASE_PREFIX) for *_, n in v)}
    pool = marked or host
    if not pool:
        return [], "(none)"
    key = max(pool, key=lambda k: len(pool[k]))
    return sorted(host[key]), f"{names.get((key[0], None), key[0])} | {names.get(key, key[1])}"


def host_report(events: list[dict], steps: int) -> HostReport:
    """Self time of every event on the dispatching thread, charged to the `hstu.*` phase it
    falls in. Events nest on one thread (one that outlives its parent is cut at the parent's
    end); the phases are placed by time alone, since a phase can open inside a short frame
    (jax traces record Python frames: the phase's own `__enter__`) and outlive it. Phase time
    in no event is the phase's own: "(python)"."""
    thread, name = _dispatch_thread(events, names_of(events))
    phases = sorted(e for e in thread if e[2].startswith(PHASE_PREFIX))
    others = sorted(
        (e for e in thread if not e[2].startswith(PHASE_PREFIX)), key=lambda e: (e[0], -e[1])
    )
    starts = [p[0] for p in phases]
    self_us: collections.Counter = collections.Counter()

    def charge(lo: float, hi: float, label: str) -> None:
        """[lo, hi) of `label`'s self time, split over the phases it crosses."""
        i = max(bisect.bisect_right(starts, lo) - 1, 0)
        while lo < hi:
            if i < len(phases) and phases[i][0] <= lo < phases[i][1]:
                cut = min(hi, phases[i][1])
                self_us[(phases[i][2], label)] += cut - lo
                i += 1
            else:
                while i < len(phases) and phases[i][1] <= lo:
                    i += 1
                cut = min(hi, phases[i][0]) if i < len(phases) else hi
                self_us[("(between phases)", label)] += cut - lo
            lo = cut

    stack: list[list] = []  # [start, end, name, end of its last child]
    for a, b, n in others:
        while stack and stack[-1][1] <= a:
            frame = stack.pop()
            charge(frame[3], frame[1], frame[2])
        if stack:
            top = stack[-1]
            b = min(b, top[1])
            charge(top[3], a, top[2])
            top[3] = b
        stack.append([a, b, n, a])
    while stack:
        frame = stack.pop()
        charge(frame[3], frame[1], frame[2])
    covered = _union(others)
    for a, b, n in phases:  # the phase's time outside every event
        inside = sum(max(0.0, min(b, c[1]) - max(a, c[0])) for c in covered)
        self_us[(n, "(python)")] += (b - a) - inside
    return HostReport(steps, name, +self_us)


def _innermost(cover: list[tuple[float, float, str]]) -> tuple[float, float, str] | None:
    # nested events: the innermost one opened last (and, at equal starts, ends first)
    return max(cover, key=lambda e: (e[0], -e[1]), default=None)


def _charge(gap: Gap, active: list[tuple[float, float, str]]) -> None:
    """Split the gap at every boundary of the host events open in it; charge each piece to the
    innermost `hstu.*` phase and the innermost event around it."""
    cuts = sorted(
        {gap.start, gap.end} | {x for a, b, _ in active for x in (a, b) if gap.start < x < gap.end}
    )
    for lo, hi in zip(cuts, cuts[1:]):
        cover = [e for e in active if e[0] <= lo and e[1] >= hi]
        phases = [e for e in cover if e[2].startswith(PHASE_PREFIX)]
        phase = _innermost(phases)
        op = _innermost(cover)
        phase_name = phase[2] if phase else "(between phases)"
        if op is None:
            op_name = "(no event)"
        elif op is phase:
            op_name = "(python)"
        else:
            op_name = op[2]
        gap.charged[(phase_name, op_name)] += hi - lo


def idle_report(events: list[dict], steps: int, min_gap_us: float = 10.0) -> IdleReport:
    """Device idle time of the traced steps, each gap of at least `min_gap_us` charged to the
    dispatching host thread (shorter ones: launch latency, counted but not charged)."""
    names = names_of(events)
    device = [
        (float(e["ts"]), float(e["ts"]) + float(e["dur"]), str(e.get("name", "")))
        for e in events
        if e.get("ph") == "X" and "dur" in e and is_device_event(e, names)
    ]
    if not device:
        raise ValueError("the trace holds no device events (kernels, copies, memsets)")
    thread, host_name = _dispatch_thread(events, names)
    busy = _union(device)
    gaps = [
        Gap(prev[1], nxt[0], prev[3], nxt[2])
        for prev, nxt in zip(busy, busy[1:])
        if nxt[0] - prev[1] >= min_gap_us
    ]
    # sweep: host events sorted by start; keep those still open at each gap
    active: list[tuple[float, float, str]] = []
    i = 0
    for gap in gaps:
        while i < len(thread) and thread[i][0] < gap.end:
            active.append(thread[i])
            i += 1
        active = [e for e in active if e[1] > gap.start]
        _charge(gap, active)
    window = busy[-1][1] - busy[0][0]
    return IdleReport(steps, window, sum(b - a for a, b, *_ in busy), gaps, host_name, min_gap_us)


def timeline(events: list[dict], min_us: float = 50.0, max_lines: int = 120) -> list[str]:
    """One step's sequence, for reading by eye: from the second-to-last `hstu.forward_backward`
    on the dispatching thread to the last, each host event of at least `min_us` (indented by
    nesting) and each busy stretch of the device, in time order (ms from the window's start)."""
    names = names_of(events)
    thread, _ = _dispatch_thread(events, names)
    marks = [e for e in thread if e[2] == PHASE_PREFIX + "forward_backward"]
    if len(marks) < 2:
        return ["(fewer than two hstu.forward_backward ranges in the trace)"]
    t0, t1 = marks[-2][0], marks[-1][0]
    device = [
        (float(e["ts"]), float(e["ts"]) + float(e["dur"]), str(e.get("name", "")))
        for e in events
        if e.get("ph") == "X" and "dur" in e and is_device_event(e, names)
    ]
    rows = []
    for a, b, first, last in _union(device):
        if b > t0 and a < t1:
            rows.append((a, 0, f"DEVICE busy {(b - a) / 1e3:.3f} ms ({first[:30]} .. {last[:30]})"))
    stack: list[float] = []  # ends of the open host events
    for a, b, n in sorted(thread, key=lambda e: (e[0], -e[1])):
        while stack and stack[-1] <= a:
            stack.pop()
        depth = len(stack)
        stack.append(b)
        if t0 <= a < t1 and b - a >= min_us:
            rows.append((a, 1, f"{'  ' * depth}{n[:70]} {(b - a) / 1e3:.3f} ms"))
    rows.sort()
    return [f"{(a - t0) / 1e3:8.3f}  {text}" for a, _, text in rows[:max_lines]]
