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
from hstu.embedding_opt import touched_rows
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
        self.policy = for_source(cfg, backend="torch")  # the capacities a run of `cfg` pads to
        if cfg.train.cuda_graphs and self.device.type == "cuda":  # time what the run replays
            from hstu.torch_backend.graphs import GraphedStack

            self.model.graphed = GraphedStack(self.model, self.policy, cfg.data.max_seqlen)
        named = self.model.named_core_parameters()
        # sharded tables leave AdamW: the touched-rows update of `time_optimizer` takes them
        self.tables = (
            {n[len("embedding.") :]: p for n, p in named.items() if n.startswith("embedding.")}
            if cfg.embedding.sharded
            else {}
        )
        dense = [p for n, p in named.items() if not (self.tables and n.startswith("embedding."))]
        self.optimizer = make_optimizer(dense, cfg.train)
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
            if not b.actual_batch_size:
                out.append(0.0)
                continue
            tb = to_torch(b).to(self.device).strip_padding()
            rows = None
            if self.tables:  # from the looked-up rows, as the run's probes time them
                with torch.no_grad():
                    rows = self.model.looked_up(tb)
            out.append(
                time_forward_backward(self.model, tb, total, self.repeats, forward_only, rows)
            )
        return out

    def time_optimizer(self, batches: Sequence[JaggedBatch] = ()) -> float:
        """The AdamW update of every dense parameter (on zero gradients; the cost is the
        same); with sharded tables also their update on the rows `batches` (one step's, every
        rank's) touch, as a replica of `data_parallel` tables runs it (a row-wise owner moves
        its share of them): Adam by `adamw_rows_` on the touched rows, row-wise Adagrad by
        gathering and scattering them. The parameters move: time it last."""
        params = [p for group in self.optimizer.param_groups for p in group["params"]]
        for p in params:
            p.grad = torch.zeros_like(p)
        update = self._tables_update(batches) if self.tables else None

        def step():
            self.optimizer.step()
            if update is not None:
                update()

        with _untouched(self.model, self.device):
            return median_time(step, self.device, self.repeats)

    def _tables_update(self, batches: Sequence[JaggedBatch]) -> Callable[[], None]:
        from hstu_kernels.triton.adamw_rows import adamw_rows_

        e = self.cfg.embedding
        hyper = dict(lr=e.lr, beta1=e.beta1, beta2=e.beta2, eps=e.eps, weight_decay=e.weight_decay)
        rows = {n: torch.from_numpy(r).to(self.device) for n, r in touched_rows(batches).items()}
        steps = []
        for name, table in self.tables.items():
            ids, dim = rows[name], table.shape[1]
            g = torch.zeros(ids.numel(), dim, device=self.device)
            if e.optimizer == "adam":
                m, v = torch.zeros_like(table), torch.zeros_like(table)
                t = torch.zeros(1, device=self.device)
                steps.append(
                    lambda p=table, m=m, v=v, t=t, ids=ids, g=g: adamw_rows_(
                        p, m, v, t, ids, g, **hyper, sparse=True
                    )
                )
            else:
                acc = torch.zeros(table.shape[0], device=self.device)

                def adagrad(p=table, acc=acc, ids=ids, g=g):
                    s = acc.index_select(0, ids) + (g * g).mean(dim=1)
                    acc.index_copy_(0, ids, s)
                    w = p.index_select(0, ids) - g * (e.lr / (s.sqrt() + e.eps))[:, None]
                    p.index_copy_(0, ids, w)

                steps.append(adagrad)

        @torch.no_grad()
        def update():
            for run in steps:
                run()

        return update
