"""`train(cfg)`: the torch backend's entry point, and its Backend for the core trainer.

Launch: under torchrun (RANK / WORLD_SIZE / MASTER_ADDR in the environment) every process runs
its rank directly; otherwise `train` starts `dist.world_size` processes itself (gloo on CPU,
NCCL with one GPU per rank), or runs in-process when the world is one rank. Each rank then runs
the core loop, `hstu.trainer.train` (resume, checkpoints, metrics, the pipeline).

Data parallelism is applied here, in this order: every rank holds the full model (replicated,
same init); the shuffle moves samples between ranks (shuffler.py); the loss of each rank is its
sum over targets divided by the *global* target count; gradients plus the loss and metric sums
are all-reduced (SUM) in one flat bucket, so every rank applies the same AdamW update.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import socket
import tempfile
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from hstu import trainer
from hstu.config import config_from_dict
from hstu.data import source_from_config
from hstu.errors import HSTUError
from hstu.params import init_params
from hstu.torch_backend.checkpoint import TrainCheckpointer
from hstu.torch_backend.model import HSTUModel
from hstu.torch_backend.shuffler import TorchShuffler, check_shuffler
from hstu.torch_backend.state import make_optimizer, rank_seed


class TorchBackend(TorchShuffler):
    """The core trainer's Backend for one data-parallel rank."""

    def __init__(self, cfg, rank: int, world_size: int, device: torch.device | str, group=None):
        super().__init__(rank, world_size, device, cfg.data.batch_size, cfg.balance.exchange, group)
        self.cfg = cfg
        self.is_main = rank == 0
        self.device_name = (
            torch.cuda.get_device_name(self.device) if self.device.type == "cuda" else "cpu"
        )
        self.model = HSTUModel(cfg.model, self.device)
        self.model.load_params(init_params(cfg.model, cfg.train.seed))
        self.params = list(self.model.parameters())  # fixed order: the gradient bucket layout
        self.optimizer = make_optimizer(self.params, cfg.train)

    def forward_backward(self, device_batch, global_loss_tokens: int) -> dict:
        batch = self.ready(device_batch)
        if batch.actual_batch_size:  # an all-padding batch keeps its zero-length rows
            batch = batch.strip_padding()
        self.model.train()
        loss, sums = self.model(batch, global_loss_tokens)
        if loss.requires_grad:
            loss.backward()
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in self.params]
        scalars = [loss.detach().float().reshape(1)] + [
            v.detach().float().reshape(1) for v in sums.values()
        ]
        bucket = torch.cat([g.reshape(-1) for g in grads] + scalars)
        dist.all_reduce(bucket, op=dist.ReduceOp.SUM, group=self.group)
        offset = 0
        for p in self.params:
            p.grad = bucket[offset : offset + p.numel()].view_as(p)
            offset += p.numel()
        grad_norm = torch.linalg.vector_norm(bucket[:offset]).reshape(1)
        return {
            "scalars": torch.cat([bucket[offset:], grad_norm]),
            "names": ["loss", *sums, "grad_norm"],
            "global_loss_tokens": global_loss_tokens,
        }

    def grads(self) -> dict[str, np.ndarray]:
        """Reduced gradients by core parameter name (between forward_backward and the step)."""
        return {
            name: (p.grad if p.grad is not None else torch.zeros_like(p))
            .detach()
            .cpu()
            .numpy()
            .copy()
            for name, p in self.model.named_core_parameters().items()
        }

    def optimizer_step(self, handle: dict) -> dict:
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        scalars = handle["scalars"]
        if self.device.type == "cuda":
            # Copy into pinned memory and mark the point: `fetch_metrics` waits for this step
            # only, while later steps keep the GPU busy (a plain .tolist() would wait for all).
            host = torch.empty(scalars.shape, dtype=scalars.dtype, pin_memory=True)
            host.copy_(scalars, non_blocking=True)
            done = torch.cuda.Event()
            done.record()
            return {**handle, "scalars": host, "done": done}
        return {**handle, "done": None}

    def fetch_metrics(self, pending: dict) -> dict[str, float]:
        if pending["done"] is not None:
            pending["done"].synchronize()
        values = dict(zip(pending["names"], pending["scalars"].tolist(), strict=True))
        denom = max(int(pending["global_loss_tokens"]), 1)
        per_target = set(pending["names"]) - {"loss", "grad_norm"}
        return {k: (v / denom if k in per_target else v) for k, v in values.items()}

    def memory_gib(self) -> float | None:
        if self.device.type != "cuda":
            return None
        return torch.cuda.max_memory_allocated(self.device) / 2**30


# ---------------------------------------------------------------------------- launching
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


def run_rank(
    cfg, rank: int, world_size: int, device: torch.device, group=None, source=None
) -> list[dict]:
    """One rank's training (process group already initialised); rank 0 returns the rows.
    `source`: the samples (a `hstu.data.loader.SampleSource`; default: `cfg.data`'s)."""
    # TorchRec's modules trip a one-time torch.fx deprecation notice on every rank: noise here.
    logging.getLogger("torch.fx._symbolic_trace").setLevel(logging.ERROR)
    torch.manual_seed(rank_seed(cfg.train.seed, rank))
    backend = TorchBackend(cfg, rank, world_size, device, group)
    checkpointer = TrainCheckpointer(
        cfg.output_dir,
        backend.model,
        backend.optimizer,
        rank,
        cfg.train.keep_checkpoints,
        device,
        group,
    )
    check_shuffler(cfg.balance.shuffler)
    source = source if source is not None else source_from_config(cfg)
    return trainer.train(cfg, backend, checkpointer, source, "torch")


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
