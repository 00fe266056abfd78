"""`train(cfg)`: the JAX backend's entry point: devices, processes, and the re-exec fallback.

Single controller by default: one process drives `dist.world_size` local devices (host devices
on CPU, whose count must be set before JAX initialises; if it already has, with too few, the run
moves to a fresh interpreter, which dies with this one). Several processes: `jax.distributed`
from the `JAX_*` environment (`init_distributed`), every process using all its local devices.

Failure handling (docs/robustness.md has the whole table): config, `output_dir` and world-size
errors are raised before JAX configures a device; `jax.distributed` runs with `dist.timeout_s`
(initialisation, shutdown) and `dist.heartbeat_s` (a silent process is declared dead); the
processes compare configs once at start-up; and a process that fails tells the others through
the distributed store and ends, the others end within a second with its message (`peers.py`).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

import jax

from hstu import watchdog
from hstu.config import DistConfig
from hstu.data import source_from_config
from hstu.errors import HSTUError
from hstu.jax_backend.peers import PeerMonitor
from hstu.jax_backend.train_step import run_training
from hstu.launch_checks import CheckedSource, die_with_parent, preflight

_REEXEC_ENV = "HSTU_JAX_REEXEC"  # set in the fresh process: never re-execute twice
_PARENT_ENV = "HSTU_JAX_PARENT"  # the re-executing process: the child dies with it


def _num_processes() -> int:
    return int(os.environ.get("JAX_NUM_PROCESSES", "1") or 1)


def init_distributed(dist: DistConfig | None = None) -> None:
    """`jax.distributed.initialize` when JAX_COORDINATOR_ADDRESS is set (multi-process), with
    the run's timeouts: `dist.timeout_s` to connect and to shut down, `dist.heartbeat_s` after
    which a silent process is declared dead (JAX's default is 100 s)."""
    addr = os.environ.get("JAX_COORDINATOR_ADDRESS")
    if not addr or jax.distributed.is_initialized():
        return
    dist = dist or DistConfig()
    num = os.environ.get("JAX_NUM_PROCESSES")
    pid = os.environ.get("JAX_PROCESS_ID")
    jax.distributed.initialize(
        addr,
        int(num) if num else None,
        int(pid) if pid else None,
        initialization_timeout=int(dist.timeout_s),
        heartbeat_timeout_seconds=int(dist.heartbeat_s),
        shutdown_timeout_seconds=int(dist.timeout_s),
    )


def select_devices(
    world_size: int, device: str = "auto", dist: DistConfig | None = None
) -> list[jax.Device] | None:
    """The `world_size` devices to train on, or None when JAX already runs with too few
    host devices (the caller re-executes in a fresh process)."""
    nproc = _num_processes()
    if device in ("auto", "cpu"):
        try:  # must precede backend initialisation; harmless when a GPU is used
            jax.config.update("jax_num_cpu_devices", max(world_size // nproc, 1))
            if nproc > 1:
                jax.config.update("jax_cpu_collectives_implementation", "gloo")
        except (RuntimeError, AttributeError):
            pass  # already initialised: checked below
    init_distributed(dist)
    platform = {"auto": None, "cpu": "cpu", "cuda": "gpu", "gpu": "gpu"}[device]
    try:
        devices = jax.devices(platform) if platform else jax.devices()
    except RuntimeError as exc:
        raise HSTUError(f"dist.device={device!r}: no such JAX devices ({exc})") from exc
    if len(devices) < world_size:
        if (
            devices[0].platform == "cpu"
            and jax.process_count() == 1
            and not os.environ.get(_REEXEC_ENV)
        ):
            return None
        raise HSTUError(
            f"dist.world_size={world_size} but only {len(devices)} "
            f"{devices[0].platform} devices are visible to JAX"
        )
    if jax.process_count() > 1 and len(devices) != world_size:
        raise HSTUError(
            f"multi-process runs use every device: dist.world_size must be "
            f"{len(devices)}, got {world_size}"
        )
    return sorted(devices, key=lambda d: (d.process_index, d.id))[:world_size]


def train_in_subprocess(cfg) -> list[dict]:
    """Run `train(cfg)` in a fresh interpreter (this one initialised JAX with too few CPU
    devices, and the count cannot change after initialisation)."""
    with tempfile.TemporaryDirectory() as tmp:
        cfg_path, rows_path = Path(tmp) / "config.yaml", Path(tmp) / "rows.json"
        cfg.save(cfg_path)
        cmd = [sys.executable, "-m", "hstu.jax_backend.launch", str(cfg_path), str(rows_path)]
        env = dict(os.environ, **{_REEXEC_ENV: "1", _PARENT_ENV: str(os.getpid())})
        proc = subprocess.run(cmd, check=False, env=env)
        if proc.returncode != 0:
            raise HSTUError(f"JAX training subprocess failed (exit {proc.returncode})")
        return json.loads(rows_path.read_text())


def _train_processes(cfg, devices, on_step, source) -> list[dict]:
    """Several processes: any failure here reaches the others at once, then ends this one."""
    monitor = PeerMonitor(jax.process_index(), jax.process_count()).start()

    def tell_the_others(message: str) -> None:  # every abort here (the watchdog too)
        monitor.report(f"(process {monitor.pid}) {message}")
        monitor.linger()

    watchdog.add_abort_hook(tell_the_others)
    try:
        monitor.check_same_config(cfg, cfg.dist.timeout_s)
        rows = run_training(cfg, devices, on_step, source)
    except (Exception, KeyboardInterrupt) as exc:
        monitor.fail(exc, cfg.dist.heartbeat_s)
    watchdog.remove_abort_hook(tell_the_others)
    monitor.stop()
    return rows


def train(cfg, source=None, on_step: Callable[[int, dict], None] | None = None) -> list[dict]:
    """Train `cfg` (see hstu.config); per-step metrics on process 0, [] elsewhere.
    `source`: the samples (a `hstu.data.loader.SampleSource`; default: `cfg.data`'s).

    Sets up the devices first (CPU: `dist.world_size` host devices, which must happen before
    JAX initialises; if it already has, with too few, the run moves to a fresh process).
    Multi-process: a failure ends the process (`hstu: error: ...` on stderr, exit 2 for an
    input error, 1 otherwise) after telling the other processes, which end too.
    """
    cfg.validate()
    preflight(cfg, "jax", max(cfg.dist.world_size // _num_processes(), 1))
    devices = select_devices(cfg.dist.world_size, cfg.dist.device, cfg.dist)
    if devices is None:
        if on_step is not None or source is not None:
            raise HSTUError(
                f"JAX is already initialised with fewer than "
                f"dist.world_size={cfg.dist.world_size} CPU devices; start a fresh "
                "process (or set XLA_FLAGS=--xla_force_host_platform_device_count)"
            )
        return train_in_subprocess(cfg)
    # Timestamps ride in int32 on device: checked when the time bias reads them, else zeroed.
    source = CheckedSource(
        source if source is not None else source_from_config(cfg),
        int32_time=True,
        time_used=cfg.model.rab_time_buckets > 0,
    )
    if jax.process_count() > 1:
        return _train_processes(cfg, devices, on_step, source)
    return run_training(cfg, devices, on_step, source)


if __name__ == "__main__":  # re-exec entry point of train_in_subprocess
    from hstu.config import load_config

    if os.environ.get(_PARENT_ENV):
        die_with_parent(int(os.environ[_PARENT_ENV]))
    rows = train(load_config(sys.argv[1]))
    Path(sys.argv[2]).write_text(json.dumps(rows))
