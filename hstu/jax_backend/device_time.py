"""Device time of jitted calls, from a `jax.profiler` trace: what the device ran, not what the
host waited for.

JAX has no device events to read a stream's clock with, and a call timed on the host's clock
is its dispatch's time wherever dispatching takes longer than the device work (a jagged
attention call's wrapper dispatches a dozen small programs besides its kernels), or pays the
host's wait on a short burst. So the kernels' own durations are read from the profiler:
`device_ms` traces bursts of calls, each inside a host range of its own, and sums the union
of the device events each range started (`hstu.bench.trace.device_busy_in_ranges`).
"""

from __future__ import annotations

import glob
import os
import statistics
import tempfile
import time
from collections.abc import Callable

import jax

from hstu.bench import trace

RANGE = "hstu.timed/"


def device_ms(
    runs: dict[str, tuple[Callable, tuple]], calls: int, rounds: int, warmup: int = 1
) -> dict[str, float] | None:
    """`{name: ms}`: the device time of one call `fn(*args)` of each `runs[name]`, the median
    over `rounds` rounds of `calls` calls dispatched back to back, after `warmup` calls each
    (at least one: the first compiles).

    Device work only, as torch's CUDA-graph replays of a kernel time it (no dispatch, no wait,
    no idle between calls; unlike a graph replay, not the ~1-2 us gaps between one call's
    kernels either). None where the trace holds no device events (a CPU backend: its
    programs run on host threads) or where a trace is already running (the caller's
    profiler; one trace at a time): time them on the host's clock then."""
    for fn, args in runs.values():
        for _ in range(max(warmup, 1)):
            jax.block_until_ready(fn(*args))
    options = jax.profiler.ProfileOptions()
    options.python_tracer_level = 0  # ranges and device events only: a small, fast trace
    with tempfile.TemporaryDirectory(prefix="hstu-device-time-") as tmp:
        try:
            jax.profiler.start_trace(tmp, create_perfetto_trace=True, profiler_options=options)
        except RuntimeError:  # a trace of the caller's is running: one trace at a time
            return None
        try:
            for r in range(rounds):
                for name, (fn, args) in runs.items():
                    with jax.profiler.TraceAnnotation(f"{RANGE}{name}/{r}"):
                        jax.block_until_ready([fn(*args) for _ in range(calls)])
        finally:
            jax.profiler.stop_trace()
        files = sorted(glob.glob(os.path.join(tmp, "**", "*.json.gz"), recursive=True))
        events = trace.load(files[-1])
    busy = trace.device_busy_in_ranges(events, RANGE)
    if not any(busy.values()):
        return None
    return {
        name: statistics.median(busy[f"{RANGE}{name}/{r}"] for r in range(rounds)) / calls / 1e3
        for name in runs
    }


def host_ms(fn: Callable, args: tuple, calls: int, rounds: int, warmup: int = 1) -> float:
    """Host-clock ms of one call `fn(*args)`: `calls` calls dispatched back to back, then one
    wait, divided by `calls`, median over `rounds`, after `warmup` calls (at least one). JAX
    dispatches asynchronously, so this is device time only where a call's device work
    outlasts its dispatch, and each round pays one wait. (A loop of calls inside one jitted
    program, tried, dispatches once, but XLA's GPU while loop reads its condition on the host
    every iteration: on an H200 it timed 0.2-0.7 ms a call.)"""
    for _ in range(max(warmup, 1)):
        jax.block_until_ready(fn(*args))
    times = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        jax.block_until_ready([fn(*args) for _ in range(calls)])
        times.append((time.perf_counter() - t0) * 1e3 / calls)
    return statistics.median(times)


def time_ms(
    runs: dict[str, tuple[Callable, tuple]],
    calls: int,
    rounds: int,
    warmup: int = 1,
    trace: bool = True,
) -> dict[str, float]:
    """`device_ms` where the device's time can be read, else `host_ms` of each run; `trace`
    False: the host's clock without trying (interpreted kernels, whose trace is all host)."""
    ms = device_ms(runs, calls, rounds, warmup) if trace else None
    if ms is None:
        ms = {name: host_ms(fn, args, calls, rounds, warmup) for name, (fn, args) in runs.items()}
    return ms
