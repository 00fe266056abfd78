"""The torch backend's Backend for the core trainer, and `run_rank`: one rank's training.

`launch.py` starts the ranks (`train(cfg)`); each runs `run_rank`, i.e. the core loop
`hstu.trainer.train` (resume, checkpoints, metrics, the pipeline) over a `TorchBackend`.

Data parallelism is applied here, in this order: every rank holds the full model (replicated,
same init); the shuffle moves samples between ranks (shuffler.py); the loss of each rank is its
sum over targets divided by the *global* target count; gradients plus the loss and metric sums
are all-reduced (SUM) in one flat bucket, so every rank applies the same AdamW update.
"""

from __future__ import annotations

import logging

import numpy as np
import torch
import torch.distributed as dist

from hstu import trainer
from hstu.data import source_from_config
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
