"""`train(cfg)`: the JAX backend's entry point: devices, processes, and the re-exec fallback.

Single controller by default: one process drives `dist.world_size` local devices (host devices
on CPU, whose count must be set before JAX initialises; if it already has, with too few, the run
moves to a fresh interpreter). Several processes: `jax.distributed` from the `JAX_*`
environment (`init_distributed`), every process using all its local devices.
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

from hstu.errors import HSTUError
from hstu.jax_backend.train_step import run_training

_REEXEC_ENV = "HSTU_JAX_REEXEC"  # set in the fresh process: never re-execute twice


def init_distributed() -> None:
    """`jax.distributed.initialize` when JAX_COORDINATOR_ADDRESS is set (multi-process)."""
    addr = os.environ.get("JAX_COORDINATOR_ADDRESS")
    if not addr or jax.distributed.is_initialized():
        return
    num = os.environ.get("JAX_NUM_PROCESSES")
    pid = os.environ.get("JAX_PROCESS_ID")
    jax.distributed.initialize(addr, int(num) if num else None, int(pid) if pid else None)


def select_devices(world_size: int, device: str = "auto") -> list[jax.Device] | None:
    """The `world_size` devices to train on, or None when JAX already runs with too few
    host devices (the caller re-executes in a fresh process)."""
    nproc = int(os.environ.get("JAX_NUM_PROCESSES", "1") or 1)
    if device in ("auto", "cpu"):
        try:  # must precede backend initialisation; harmless when a GPU is used
            jax.config.update("jax_num_cpu_devices", max(world_size // nproc, 1))
            if nproc > 1:
                jax.config.update("jax_cpu_collectives_implementation", "gloo")
        except (RuntimeError, AttributeError):
            pass  # already initialised: checked below
    init_distributed()
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
        proc = subprocess.run(cmd, check=False, env=dict(os.environ, **{_REEXEC_ENV: "1"}))
        if proc.returncode != 0:
            raise HSTUError(f"JAX training subprocess failed (exit {proc.returncode})")
        return json.loads(rows_path.read_text())


def train(cfg, source=None, on_step: Callable[[int, dict], None] | None = None) -> list[dict]:
    """Train `cfg` (see hstu.config); per-step metrics on process 0, [] elsewhere.
    `source`: the samples (a `hstu.data.loader.SampleSource`; default: `cfg.data`'s).

    Sets up the devices first (CPU: `dist.world_size` host devices, which must happen before
    JAX initialises; if it already has, with too few, the run moves to a fresh process).
    """
    devices = select_devices(cfg.dist.world_size, cfg.dist.device)
    if devices is None:
        if on_step is not None or source is not None:
            raise HSTUError(
                f"JAX is already initialised with fewer than "
                f"dist.world_size={cfg.dist.world_size} CPU devices; start a fresh "
                "process (or set XLA_FLAGS=--xla_force_host_platform_device_count)"
            )
        return train_in_subprocess(cfg)
    return run_training(cfg, devices, on_step, source)


if __name__ == "__main__":  # re-exec entry point of train_in_subprocess
    from hstu.config import load_config

    rows = train(load_config(sys.argv[1]))
    Path(sys.argv[2]).write_text(json.dumps(rows))
