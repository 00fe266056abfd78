"""`train(cfg)`: the torch backend's entry point, and its Backend for `hstu.pipeline.run`.

Launch: under torchrun (RANK / WORLD_SIZE / MASTER_ADDR in the environment) every process runs
its rank directly; otherwise `train` starts `dist.world_size` processes itself (gloo on CPU,
NCCL with one GPU per rank), or runs in-process when the world is one rank.

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

from hstu import pipeline
from hstu.config import config_from_dict
from hstu.data import dataset_from_config
from hstu.errors import HSTUError
from hstu.metrics import MetricsLogger, peak_tflops
from hstu.params import init_params
from hstu.torch_backend import checkpoint
from hstu.torch_backend.model import HSTUModel, check_batch
from hstu.torch_backend.shuffler import TorchShuffler, check_shuffler
from hstu.workload import HSTUCost


def make_optimizer(params, tc) -> torch.optim.AdamW:
    """AdamW on every parameter, decoupled weight decay (== optax.adamw of the JAX backend)."""
    return torch.optim.AdamW(
        params, lr=tc.lr, betas=(tc.beta1, tc.beta2), eps=tc.eps, weight_decay=tc.weight_decay
    )


class TorchBackend(TorchShuffler):
    """The Backend protocol of `hstu.pipeline` for one data-parallel rank."""

    def __init__(self, cfg, rank: int, world_size: int, device: torch.device | str, group=None):
        super().__init__(
            rank,
            world_size,
            device,
            cfg.data.batch_size,
            cfg.balance.exchange,
            group,
            check=lambda batch, r: check_batch(batch, cfg.model, r),
        )
        self.cfg = cfg
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
        return {
            "scalars": bucket[offset:],
            "names": ["loss", *sums],
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

    def optimizer_step(self, handle: dict) -> dict[str, float]:
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        values = dict(zip(handle["names"], handle["scalars"].tolist(), strict=True))
        denom = max(int(handle["global_loss_tokens"]), 1)
        return {name: (v if name == "loss" else v / denom) for name, v in values.items()}


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


def _reset_metrics(cfg) -> int:
    """Start a fresh metrics.jsonl unless resuming; returns where this run's lines begin."""
    path = Path(cfg.output_dir) / "metrics.jsonl"
    if not cfg.train.resume and path.exists():
        path.unlink()
    return path.stat().st_size if path.exists() else 0


class _RecordingIterator:
    """Yields `[batch]` per step and remembers the data state before each fetch, so that a
    checkpoint after step s resumes at batch s + 1 although the pipeline has read ahead."""

    def __init__(self, dataset):
        self.dataset, self.states = dataset, []

    def __iter__(self):
        return self

    def __next__(self):
        self.states.append(self.dataset.state_dict())
        return [next(self.dataset)]

    def state_after(self, step: int) -> dict:
        """Data state to resume from once step `step` (of this run) is trained."""
        if step + 1 < len(self.states):
            return self.states[step + 1]
        return self.dataset.state_dict()


def run_rank(cfg, rank: int, world_size: int, device: torch.device, group=None) -> list[dict]:
    """One rank's training (process group already initialised); rank 0 returns the rows."""
    out_dir = Path(cfg.output_dir)
    # TorchRec's modules trip a one-time torch.fx deprecation notice on every rank: noise here.
    logging.getLogger("torch.fx._symbolic_trace").setLevel(logging.ERROR)
    torch.manual_seed(checkpoint.rank_seed(cfg.train.seed, rank))
    backend = TorchBackend(cfg, rank, world_size, device, group)
    dataset = dataset_from_config(cfg, world_size, rank)
    root, start_step = checkpoint.checkpoint_root(out_dir), 0
    if cfg.train.resume:
        restored = checkpoint.load(root, backend.model, backend.optimizer, rank, group)
        if restored is not None:
            start_step, extra = restored
            dataset.load_state_dict(extra["data"])
            checkpoint.set_rng_state(extra["rng"], device)
    num_steps = cfg.train.steps - start_step
    if num_steps <= 0:
        return []
    logger = None
    if rank == 0:
        cfg.save(out_dir / "config.yaml")
        name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
        logger = MetricsLogger(
            out_dir,
            cfg.train.steps,
            cfg.train.log_every,
            peak=peak_tflops(name, cfg.train.peak_tflops),
        )
    batches = _RecordingIterator(dataset)
    every = cfg.train.checkpoint_every

    def on_step(global_step: int, metrics: dict) -> None:
        if device.type == "cuda":
            metrics["max_memory_gib"] = torch.cuda.max_memory_allocated(device) / 2**30
        if logger is not None:
            logger.log(global_step, metrics)
        if every and (global_step + 1) % every == 0:
            extra = {
                "step": global_step + 1,
                "data": batches.state_after(global_step - start_step),
                "rng": checkpoint.rng_state(device),
            }
            checkpoint.save(
                root,
                global_step + 1,
                backend.model,
                backend.optimizer,
                extra,
                rank,
                cfg.train.keep_checkpoints,
                group,
            )

    b = cfg.balance
    try:
        rows = pipeline.run(
            backend,
            batches,
            num_steps,
            HSTUCost.from_model_config(cfg.model),
            cfg.model.task,
            shuffler=check_shuffler(b.shuffler),
            method=b.method,
            overlap=b.overlap,
            on_step=on_step,
            start_step=start_step,
            prefetch=cfg.data.prefetch,
        )
    finally:
        if logger is not None:
            logger.close()
    return rows if rank == 0 else []


def _init_and_run(
    cfg, rank: int, world_size: int, local_rank: int, device_type: str, init_method: str
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
        return run_rank(cfg, rank, world_size, device)
    finally:
        dist.destroy_process_group()


def _spawned(
    rank: int, world_size: int, cfg_dict: dict, device_type: str, port: int, error_dir: str
) -> None:
    try:
        if device_type == "cpu":  # ranks share the cores: do not oversubscribe them
            torch.set_num_threads(max(1, (os.cpu_count() or 1) // world_size))
        _init_and_run(
            config_from_dict(cfg_dict),
            rank,
            world_size,
            rank,
            device_type,
            f"tcp://127.0.0.1:{port}",
        )
    except HSTUError as exc:
        Path(error_dir, f"rank{rank}.txt").write_text(str(exc))
        raise


def _read_rows(path: Path, offset: int) -> list[dict]:
    if not path.exists():
        return []
    with path.open() as f:
        f.seek(offset)
        return [json.loads(line) for line in f if line.strip()]


def train(cfg) -> list[dict]:
    """Train `cfg`; the launching process (or rank 0 under torchrun) gets the metric rows."""
    cfg.validate()
    env = _torchrun_env()
    if env is not None:
        rank, world_size, local_rank = env
        cfg.dist.world_size = world_size  # the launcher decides; config.yaml records it
        if rank == 0:
            _reset_metrics(cfg)
        device_type = resolve_device(cfg.dist.device, local_rank + 1)
        return _init_and_run(cfg, rank, world_size, local_rank, device_type, "env://")

    world_size = cfg.dist.world_size
    device_type = resolve_device(cfg.dist.device, world_size)
    offset = _reset_metrics(cfg)
    port = cfg.dist.master_port or _free_port()
    if world_size == 1 and not dist.is_initialized():
        return _init_and_run(cfg, 0, 1, 0, device_type, f"tcp://127.0.0.1:{port}")
    import torch.multiprocessing as mp

    error_dir = tempfile.mkdtemp(prefix="hstu-torch-")
    try:
        mp.start_processes(
            _spawned,
            args=(world_size, cfg.to_dict(), device_type, port, error_dir),
            nprocs=world_size,
            join=True,
            start_method="spawn",
        )
    except Exception as exc:
        messages = sorted(Path(error_dir).glob("rank*.txt"))
        if messages:
            raise HSTUError(messages[0].read_text()) from exc
        raise
    finally:
        with contextlib.suppress(OSError):
            shutil.rmtree(error_dir)
    return _read_rows(Path(cfg.output_dir) / "metrics.jsonl", offset)
