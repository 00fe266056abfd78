"""W ranks for the measurement scripts: rank 0 in the calling process (the one measured), the
others spawned, one GPU each (NCCL), or gloo processes on a machine without CUDA."""

from __future__ import annotations

import multiprocessing


def device_and_group(rank: int):
    import torch

    if torch.cuda.is_available():
        device = torch.device("cuda", rank)
        torch.cuda.set_device(device)
        return device, dict(backend="nccl", device_id=device)
    return torch.device("cpu"), dict(backend="gloo")


def _other_rank(rank: int, world: int, cfg, port: int) -> None:
    """A rank that trains unmeasured beside rank 0 (a spawned process)."""
    import torch.distributed as dist

    from hstu.torch_backend.train_step import run_rank

    device, group = device_and_group(rank)
    dist.init_process_group(
        init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world, **group
    )
    try:
        run_rank(cfg, rank, world, device)
    finally:
        dist.destroy_process_group()


def train_rank0(cfg, world: int, on_step, port: int) -> list[dict]:
    """`run_rank` of rank 0 here with `on_step`, ranks 1..W-1 spawned; rank 0's rows."""
    import torch.distributed as dist

    from hstu.torch_backend.train_step import run_rank

    spawn = multiprocessing.get_context("spawn")
    others = [
        spawn.Process(target=_other_rank, args=(r, world, cfg, port)) for r in range(1, world)
    ]
    for proc in others:
        proc.start()
    device, group = device_and_group(0)
    dist.init_process_group(
        init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=world, **group
    )
    try:
        rows = run_rank(cfg, 0, world, device, on_step=on_step)
    finally:
        dist.destroy_process_group()
        for proc in others:
            proc.join(timeout=60)
    if any(proc.exitcode != 0 for proc in others):
        raise SystemExit(f"a rank failed: exit codes {[proc.exitcode for proc in others]}")
    return rows
