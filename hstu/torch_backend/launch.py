"""`train(cfg)`: the torch backend's entry point, which starts the ranks.

Under torchrun (RANK / WORLD_SIZE / MASTER_ADDR in the environment) every process runs its rank
directly and torchrun's world size wins over `dist.world_size`; otherwise `train` starts
`dist.world_size` processes itself (gloo on CPU, NCCL with one GPU per rank), or runs in-process
when the world is one rank. Each rank runs `train_step.run_rank`.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import socket
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist

from hstu.config import config_from_dict
from hstu.errors import HSTUError
from hstu.torch_backend.train_step import run_rank


def _torchrun_env() -> tuple[int, int, int] | None:
    env = os.environ
    if all(k in env for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")):
        return int(env["RANK"]), int(env["WORLD_SIZE"]), int(env.get("LOCAL_RANK", 0))
    return None


def resolve_device(name: str, num_local_ranks: int) -> str:
    """`dist.device` -> "cuda" | "cpu"; errors here, before any process or collective."""
    has_cuda = torch.cuda.is_available()
    if name in ("cuda", "gpu"):
        if not has_cuda:
            raise HSTUError(f"dist.device={name} but no CUDA device is available")
        if torch.cuda.device_count() < num_local_ranks:
            raise HSTUError(
                f"{num_local_ranks} ranks need one GPU each; found {torch.cuda.device_count()}"
            )
        return "cuda"
    if name == "auto" and has_cuda and torch.cuda.device_count() >= num_local_ranks:
        return "cuda"
    return "cpu"


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _init_and_run(
    cfg,
    rank: int,
    world_size: int,
    local_rank: int,
    device_type: str,
    init_method: str,
    source=None,
) -> list[dict]:
    device = torch.device("cuda", local_rank) if device_type == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    kwargs = {"device_id": device} if device.type == "cuda" else {}  # NCCL: bind eagerly
    dist.init_process_group(
        "nccl" if device.type == "cuda" else "gloo",
        init_method=init_method,
        rank=rank,
        world_size=world_size,
        **kwargs,
    )
    try:
        return run_rank(cfg, rank, world_size, device, source=source)
    finally:
        dist.destroy_process_group()


def _spawned(
    rank: int,
    world_size: int,
    cfg_dict: dict,
    device_type: str,
    port: int,
    out_dir: str,
    source,
) -> None:
    try:
        if device_type == "cpu":  # ranks share the cores: do not oversubscribe them
            torch.set_num_threads(max(1, (os.cpu_count() or 1) // world_size))
        rows = _init_and_run(
            config_from_dict(cfg_dict),
            rank,
            world_size,
            rank,
            device_type,
            f"tcp://127.0.0.1:{port}",
            source,
        )
        if rank == 0:
            Path(out_dir, "rows.json").write_text(json.dumps(rows))
    except HSTUError as exc:
        Path(out_dir, f"rank{rank}.txt").write_text(str(exc))
        raise


def train(cfg, source=None) -> list[dict]:
    """Train `cfg`; the launching process (or rank 0 under torchrun) gets the metric rows.
    `source`: the samples (a picklable `hstu.data.loader.SampleSource`; default: `cfg.data`'s)."""
    cfg.validate()
    env = _torchrun_env()
    if env is not None:
        rank, world_size, local_rank = env
        cfg.dist.world_size = world_size  # the launcher decides; config.yaml records it
        device_type = resolve_device(cfg.dist.device, local_rank + 1)
        return _init_and_run(cfg, rank, world_size, local_rank, device_type, "env://", source)

    world_size = cfg.dist.world_size
    device_type = resolve_device(cfg.dist.device, world_size)
    port = cfg.dist.master_port or _free_port()
    if world_size == 1 and not dist.is_initialized():
        return _init_and_run(cfg, 0, 1, 0, device_type, f"tcp://127.0.0.1:{port}", source)
    import torch.multiprocessing as mp

    out_dir = tempfile.mkdtemp(prefix="hstu-torch-")
    try:
        mp.start_processes(
            _spawned,
            args=(world_size, cfg.to_dict(), device_type, port, out_dir, source),
            nprocs=world_size,
            join=True,
            start_method="spawn",
        )
        rows_path = Path(out_dir, "rows.json")
        return json.loads(rows_path.read_text()) if rows_path.is_file() else []
    except Exception as exc:
        messages = sorted(Path(out_dir).glob("rank*.txt"))
        if messages:
            raise HSTUError(messages[0].read_text()) from exc
        raise
    finally:
        with contextlib.suppress(OSError):
            shutil.rmtree(out_dir)
