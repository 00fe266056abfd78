"""Device timing of the torch backend's compute, for `hstu bench e2e`.

* `time_forward_backward`: one local batch's forward + backward alone on its device (no
  collective, no update), timed with CUDA events (CPU: the host clock), median of repeats.
  Gradients and RNG state are left exactly as found, so a probe never changes training.
* `LocalTimer`: a model on one device that times the local batches of W simulated ranks
  (`hstu bench e2e --simulate-ranks W`) and the optimizer update.
"""

from __future__ import annotations

import contextlib
import statistics
import time
from collections.abc import Callable, Sequence

import torch

from hstu.batch import JaggedBatch
from hstu.capacity import for_source
from hstu.params import init_params
from hstu.pipeline import loss_tokens
from hstu.torch_backend.batch import TorchBatch, to_torch
from hstu.torch_backend.model import HSTUModel
from hstu.torch_backend.state import make_optimizer


class DeviceClock:
    """Elapsed device time of a region: CUDA events on GPUs, the host clock on CPUs."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        if self.cuda:
            self.start, self.end = torch.cuda.Event(True), torch.cuda.Event(True)

    def __enter__(self):
        if self.cuda:
            self.start.record()
        else:
            self.t0 = time.perf_counter()
        return self

    def __exit__(self, *exc):
        if self.cuda:
            self.end.record()
        else:
            self.seconds_ = time.perf_counter() - self.t0

    def seconds(self) -> float:
        if self.cuda:
            self.end.synchronize()
            return self.start.elapsed_time(self.end) / 1e3
        return self.seconds_


@contextlib.contextmanager
def _untouched(model: torch.nn.Module, device: torch.device):
    """Run work on `model` and leave its gradients and the RNG streams as they were."""
    params = list(model.parameters())
    grads = [p.grad for p in params]
    cpu_rng = torch.get_rng_state()
    cuda_rng = torch.cuda.get_rng_state(device) if device.type == "cuda" else None
    try:
        yield
    finally:
        for p, g in zip(params, grads, strict=True):
            p.grad = g
        torch.set_rng_state(cpu_rng)
        if cuda_rng is not None:
            torch.cuda.set_rng_state(cuda_rng, device)


def median_time(run: Callable[[], None], device: torch.device, repeats: int, warmup: int = 1):
    times = []
    for i in range(warmup + repeats):
        clock = DeviceClock(device)
        with clock:
            run()
        if i >= warmup:
            times.append(clock)
    return statistics.median(c.seconds() for c in times)


def time_forward_backward(
    model: HSTUModel,
    batch: TorchBatch,
    global_loss_tokens: int,
    repeats: int = 3,
    forward_only: bool = False,
    rows: dict[str, torch.Tensor] | None = None,
) -> float:
    """Median device seconds of forward (+ backward) of `batch` alone; nothing is updated.

    `rows`: the batch's looked-up embedding rows (`HSTUModel.looked_up`, of the batch with
    its padding stripped), leaves the backward ends at: sharded tables are then neither read
    nor updated (TorchRec's fused backward would update them), and their collective lookup is
    not in the time."""
    device = batch.device
    if batch.actual_batch_size:
        batch = batch.strip_padding()
    params = list(model.parameters())
    if rows is not None:
        rows = {k: v.detach().requires_grad_(not forward_only) for k, v in rows.items()}

    def run():
        for p in params:
            p.grad = None
        for r in (rows or {}).values():
            r.grad = None
        loss, _ = model(batch, global_loss_tokens, emb=rows)
        if not forward_only and loss.requires_grad:
            loss.backward()

    with _untouched(model, device):
        return median_time(run, device, repeats)


class LocalTimer:
    """One device standing in for W ranks: times each rank's local batch and the update."""

    def __init__(self, cfg, device: str | torch.device | None = None, repeats: int = 3):
        if device is None:
            device = "cuda" if torch.cuda.is_available() and cfg.dist.device != "cpu" else "cpu"
        self.device = torch.device(device)
        self.cfg, self.repeats = cfg, repeats
        self.model = HSTUModel(cfg.model, self.device)
        self.model.load_params(init_params(cfg.model, cfg.train.seed))
        self.model.train()
        self.policy = for_source(cfg)  # the token capacities a run of `cfg` pads to
        if cfg.train.cuda_graphs and self.device.type == "cuda":  # time what the run replays
            from hstu.torch_backend.graphs import GraphedStack

            self.model.graphed = GraphedStack(self.model, self.policy, cfg.data.max_seqlen)
        self.optimizer = make_optimizer(self.model.parameters(), cfg.train)
        self.device_name = (
            torch.cuda.get_device_name(self.device) if self.device.type == "cuda" else "cpu"
        )

    def time_ranks(
        self, local: Sequence[JaggedBatch], forward_only: bool = False, policy=None
    ) -> list[float]:
        """Forward (+ backward) seconds of every rank's local batch, each alone; with graphs,
        padded to the capacities of `policy` (`hstu.capacity.CapacityPolicy`, default: the
        config's), as the run that `policy` was fitted for pads them."""
        if self.model.graphed is not None:
            self.model.graphed.policy = policy or self.policy
        total = int(sum(loss_tokens(b, self.cfg.model.task).sum() for b in local))
        out = []
        for b in local:
            tb = to_torch(b).to(self.device)
            out.append(
                time_forward_backward(self.model, tb, total, self.repeats, forward_only)
                if b.actual_batch_size
                else 0.0
            )
        return out

    def time_optimizer(self) -> float:
        """The AdamW update of every parameter (on zero gradients; the cost is the same)."""
        for p in self.model.parameters():
            p.grad = torch.zeros_like(p)
        with _untouched(self.model, self.device):
            return median_time(self.optimizer.step, self.device, self.repeats)
