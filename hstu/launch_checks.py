"""What both launchers check and set up before any rank starts, and around each rank.

* `preflight(cfg, backend)`: the config, a prepared dataset against its manifest
  (`hstu.data.sources.check_prepared`), `output_dir` (a directory this process can write) and
  `dist.world_size` against what the machine can run; raised in the launching process, before
  a process is spawned or a device is configured.
* `die_with_parent()`: a rank process ends when its launcher does (Linux parent-death signal),
  so no rank trains on, orphaned, after the launcher was killed.
* `config_differences(...)`: what differs between two processes' configs (multi-process runs
  compare them once at start-up: a rank with another `data.batch_size` or model would
  otherwise fail in a collective, or silently train something else).
* `CheckedSource`: the samples as the loader reads them, checked before `from_samples` casts
  them to int64: a non-integral float (a timestamp in fractional seconds, a float id) is an
  error naming the sample, key and rank instead of a silent truncation.
"""

from __future__ import annotations

import ctypes
import json
import os
import signal
import sys
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

from hstu.data.loader import WrappedSource
from hstu.errors import HSTUError

# Ranks one machine runs on its CPU: gloo processes (torch) each hold a full interpreter and
# model; host devices (jax) are threads of one process. `HSTU_MAX_CPU_RANKS` overrides both.
TORCH_PROCESSES_PER_CORE, MIN_TORCH_PROCESSES = 4, 8
JAX_DEVICES_PER_CORE, MIN_JAX_DEVICES = 32, 64
TIME_KEYS = ("item_time", "candidate_time")
_PR_SET_PDEATHSIG = 1


def num_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def max_cpu_ranks(backend: str) -> int:
    """The most CPU ranks one process (jax) or machine (torch) may start."""
    override = os.environ.get("HSTU_MAX_CPU_RANKS")
    if override:
        return int(override)
    if backend == "torch":
        return max(MIN_TORCH_PROCESSES, TORCH_PROCESSES_PER_CORE * num_cores())
    return max(MIN_JAX_DEVICES, JAX_DEVICES_PER_CORE * num_cores())


def check_cpu_world_size(world_size: int, backend: str) -> None:
    """`world_size` CPU ranks on this machine (torch: gloo processes; jax: host devices)."""
    limit = max_cpu_ranks(backend)
    if world_size > limit:
        what = "gloo processes" if backend == "torch" else "host devices of one process"
        raise HSTUError(
            f"dist.world_size={world_size} is more than this machine can run as CPU ranks "
            f"({what}: at most {limit} on {num_cores()} cores; HSTU_MAX_CPU_RANKS overrides "
            "the limit)"
        )


def check_output_dir(output_dir: str | Path) -> Path:
    """`output_dir` exists (created if needed) as a directory this process can write into."""
    path = Path(output_dir)
    if path.exists() and not path.is_dir():
        raise HSTUError(f"output_dir={str(output_dir)!r} is a file, not a directory")
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise HSTUError(
            f"output_dir={str(output_dir)!r} cannot be created: {exc.strerror or exc}"
        ) from None
    for name in ("checkpoints", "tb"):
        if (path / name).exists() and not (path / name).is_dir():
            raise HSTUError(f"output_dir: {path / name} is a file; the run needs a directory")
    try:
        with tempfile.NamedTemporaryFile(dir=path, prefix=".hstu-write-check-"):
            pass
    except OSError as exc:
        raise HSTUError(
            f"output_dir={str(output_dir)!r} is not writable: {exc.strerror or exc}"
        ) from None
    return path


def preflight(cfg, backend: str, local_world_size: int | None = None) -> None:
    """Every config and output-dir error, in the launching process before any rank starts.

    `local_world_size`: the CPU ranks this process or machine would start (default: all of
    `dist.world_size`; None skips the bound, e.g. under torchrun, which decides the world)."""
    cfg.validate()
    if cfg.data.source == "prepared":
        from hstu.data.sources import check_prepared

        check_prepared(cfg)
    check_output_dir(cfg.output_dir)
    check_fresh_run(cfg)
    if local_world_size is not None and cfg.dist.device in ("auto", "cpu"):
        check_cpu_world_size(local_world_size, backend)


def check_fresh_run(cfg) -> None:
    """A fresh run that saves checkpoints refuses an `output_dir` holding another run's: its
    keep-latest-k would delete them, and a later resume would mix the two runs."""
    root = Path(cfg.output_dir) / "checkpoints"
    if cfg.train.resume or not cfg.train.checkpoint_every or not root.is_dir():
        return
    found = sorted(p.name for p in root.iterdir() if p.name.startswith("step-"))
    if found:
        raise HSTUError(
            f"output_dir={cfg.output_dir!r} holds checkpoints of an earlier run ({found[-3:]}); "
            "continue it with train.resume=true, or choose another output_dir (nothing was "
            "deleted)"
        )


def die_with_parent(expected_parent: int | None = None) -> None:
    """Have the kernel SIGKILL this process when its parent exits (Linux; elsewhere a no-op).

    SIGKILL, not SIGINT/SIGTERM: a rank started from a script (`hstu train ... &`) ignores
    SIGINT, and a rank blocked in a collective never runs a Python handler. `expected_parent`:
    the launcher's pid; if it is already gone (it died before the call), exit now."""
    if not sys.platform.startswith("linux"):
        return
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    except (OSError, AttributeError):
        return
    if expected_parent is not None and os.getppid() != expected_parent:
        os._exit(1)


# A child process started by a benchmark (`hstu bench e2e` / `tables`) finds its parent's pid
# here and dies with it (set in the child itself: code run between fork and exec, such as a
# subprocess `preexec_fn`, can deadlock in a multithreaded parent).
PARENT_PID_ENV = "HSTU_DIE_WITH_PARENT"


def child_env() -> dict[str, str]:
    """The environment of a child that must die with this process (`die_with_env_parent`)."""
    return {**os.environ, PARENT_PID_ENV: str(os.getpid())}


def die_with_env_parent() -> None:
    """`die_with_parent` of the pid in `HSTU_DIE_WITH_PARENT`, when it is set."""
    pid = os.environ.pop(PARENT_PID_ENV, "")
    if pid.isdigit():
        die_with_parent(int(pid))


# ------------------------------------------------------------------------------ configs
def _flatten(data: dict, prefix: str = "") -> dict[str, Any]:
    out = {}
    for key, value in data.items():
        if isinstance(value, dict) and key != "seqlen_params":
            out |= _flatten(value, f"{prefix}{key}.")
        else:
            out[f"{prefix}{key}"] = value
    return out


def config_differences(mine: dict, theirs: dict) -> list[str]:
    """`key: mine vs theirs` for every leaf key whose values differ."""
    a, b = _flatten(mine), _flatten(theirs)
    return [
        f"{k}={json.dumps(a.get(k))} vs {json.dumps(b.get(k))}"
        for k in sorted(set(a) | set(b))
        if a.get(k) != b.get(k)
    ]


def config_mismatch_error(me: str, other: str, differences: list[str]) -> HSTUError:
    return HSTUError(
        f"the processes of this run were started with different configs: {me} and {other} "
        f"differ in {'; '.join(differences[:8])}. Start every process with the same --config "
        "and overrides"
    )


# ------------------------------------------------------------------------------ samples
def _reading_rank() -> int | None:
    """The rank whose batch the loader is reading (`DataLoader.batch_at(position, rank)` is on
    the stack), for messages; None when called some other way."""
    frame = sys._getframe(2)
    while frame is not None:
        if frame.f_code.co_name == "batch_at" and isinstance(frame.f_locals.get("rank"), int):
            return frame.f_locals["rank"]
        frame = frame.f_back
    return None


class CheckedSource(WrappedSource):
    """A `SampleSource` whose samples are checked as they are read.

    * jagged values must be integers: floats are accepted only when integral (a float
      timestamp with a fraction, or a NaN, is an error naming sample, key and rank), since the
      batch is built in int64 and would silently truncate them;
    * `int32_time`: the backend carries timestamps in int32 (jax). With `time_used` (a time
      bias) a timestamp out of int32 range (epoch milliseconds) is an error; without it the
      model never reads timestamps, so they are passed as zeros and any range is accepted.
    """

    def __init__(self, inner, int32_time: bool = False, time_used: bool = True):
        super().__init__(inner)
        self.int32_time, self.time_used = int32_time, time_used

    def _fail(self, index: int, key: str, why: str) -> HSTUError:
        rank = _reading_rank()
        where = f" (read for rank {rank})" if rank is not None else ""
        return HSTUError(f"invalid sample {index}{where}: values['{key}'] {why}")

    def sample(self, index: int) -> dict:
        sample = self.inner.sample(index)
        changed = None
        for key in self.jagged_keys:
            if key not in sample:
                continue
            values = np.asarray(sample[key])
            if values.dtype.kind == "f":
                bad = ~np.isfinite(values) | (values != np.round(values))
                if bad.any():
                    raise self._fail(
                        index,
                        key,
                        f"must be integers; got {values.dtype} values such as "
                        f"{values[bad][:3].tolist()} (ids and timestamps are int64; give "
                        "timestamps in whole seconds)",
                    )
            elif values.dtype.kind not in "iub" and values.size:
                raise self._fail(index, key, f"must be integers, got dtype {values.dtype}")
            if self.int32_time and key in TIME_KEYS and values.size:
                if not self.time_used:
                    changed = changed or dict(sample)
                    changed[key] = np.zeros(values.shape, np.int64)
                elif values.min() < -(2**31) or values.max() >= 2**31:
                    raise self._fail(
                        index,
                        key,
                        f"hold timestamps up to {values.max()}, beyond int32, which the JAX "
                        "backend carries them in and the time bias (model.rab_time_buckets) "
                        "reads: give timestamps in seconds, not milliseconds",
                    )
        return changed if changed is not None else sample
