"""Run a function on W ranks (spawned processes, free port) and collect what each returns:
gloo on CPU, or NCCL with one GPU per rank (`device="cuda"`).

The function must be importable by name (module level) so that spawned processes find it; it
is called as `fn(rank, world_size, device, *args)`.

A rank writes its result, destroys its process group, then leaves with `os._exit`: once in
a CI run (2 cores, loaded) a rank that had finished its work aborted at interpreter exit
("terminate called without an active exception", SIGABRT), the signature of gloo's C++
threads being torn down during Python's finalization (pytorch/pytorch#179291). What these
tests examine ends with the result; the exit code still reports any failure before it.
"""

from __future__ import annotations

import os
import pickle
import socket
import sys
import tempfile
from pathlib import Path


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _entry(
    rank: int, fn, world_size: int, device: str, port: int, out_dir: str, args: tuple
) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    kwargs = {}
    if device == "cuda":
        torch.cuda.set_device(rank)
        kwargs["device_id"] = torch.device("cuda", rank)
    dist.init_process_group(
        "nccl" if device == "cuda" else "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world_size,
        **kwargs,
    )
    try:
        result = fn(rank, world_size, f"cuda:{rank}" if device == "cuda" else "cpu", *args)
        Path(out_dir, f"{rank}.pkl").write_bytes(pickle.dumps(result))
    finally:
        dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


# What every CPU rank imports (~7 s of one core each: torch, TorchRec, fbgemm, the backend):
# imported once by a fork server, which forks the ranks of every later call already holding
# them. A GPU rank is spawned fresh (CUDA and fork do not mix).
PRELOAD = ["torch", "torch.distributed", "torchrec", "hstu.torch_backend.train_step"]


def run_on_ranks(fn, world_size: int, *args, device: str = "cpu") -> list:
    """`[fn(rank, world_size, device, *args) for every rank]`, each in its own process. The
    ranks see the environment of the first call (the fork server's), not later changes."""
    import multiprocessing

    import torch.multiprocessing as mp

    method = "spawn" if device == "cuda" else "forkserver"
    if method == "forkserver":
        multiprocessing.set_forkserver_preload(PRELOAD)
    with tempfile.TemporaryDirectory(prefix="hstu-ranks-") as out_dir:
        mp.start_processes(
            _entry,
            args=(fn, world_size, device, _free_port(), out_dir, args),
            nprocs=world_size,
            join=True,
            start_method=method,
        )
        return [pickle.loads(Path(out_dir, f"{r}.pkl").read_bytes()) for r in range(world_size)]
