"""Gradient reduction overlapped with the backward pass: fixed buckets, all-reduced (SUM) as
soon as their gradients are complete, in the same order on every rank.

What DistributedDataParallel does, kept small and explicit because the loss is already divided
by the *global* target count (hstu.pipeline): the gradient of the global batch is the SUM over
ranks, not DDP's mean, and every parameter is updated every step (one without a gradient on a
rank, e.g. a table no sample of that rank touches, contributes zeros), as in the JAX backend.

* Before backward, every parameter's `.grad` is set to a zeroed view into its bucket's flat
  buffer, so autograd accumulates straight into the buffer: no copy, no concatenation.
* A post-accumulate-grad hook counts a bucket's finished parameters; a full bucket is launched
  (`all_reduce(async_op=True)`) once every bucket before it is launched, so the collective order
  is the bucket order on every rank, whatever order its gradients finish in.
* `finish()` launches what is left in order and makes the compute stream wait for the
  reductions (no host sync on NCCL). With one rank nothing is launched, and autograd keeps
  its own gradients (accumulating into views costs a kernel per parameter).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist


class GradBuckets:
    def __init__(
        self,
        params: Sequence[torch.nn.Parameter],
        world_size: int,
        group=None,
        bucket_mb: float = 25.0,
    ):
        self.params, self.world_size, self.group = list(params), world_size, group
        limit = max(1, int(bucket_mb * 2**20 / 4))
        # Reverse registration order: roughly the order backward produces the gradients.
        self.buckets: list[list[int]] = [[]]
        size = 0
        for i in reversed(range(len(self.params))):
            n = self.params[i].numel()
            if self.buckets[-1] and size + n > limit:
                self.buckets.append([])
                size = 0
            self.buckets[-1].append(i)
            size += n
        self.bucket_of = {i: b for b, members in enumerate(self.buckets) for i in members}
        device = self.params[0].device if self.params else torch.device("cpu")
        self.buffers = [
            torch.zeros(sum(self.params[i].numel() for i in m), device=device, dtype=torch.float32)
            for m in self.buckets
        ]
        self.views = {}
        for b, members in enumerate(self.buckets):
            offset = 0
            for i in members:
                p = self.params[i]
                self.views[i] = self.buffers[b][offset : offset + p.numel()].view_as(p)
                offset += p.numel()
        # One rank reduces nothing: autograd keeps its own gradients (no accumulation into
        # views, no hooks), and `finish` only fills in the gradients it did not produce.
        self.hooks = (
            [p.register_post_accumulate_grad_hook(self._hook(i)) for i, p in enumerate(self.params)]
            if world_size > 1
            else []
        )
        self._remaining: list[int] = []
        self._next = 0
        self._works: list = []

    def start(self) -> None:
        """Before backward: zeroed gradient views, nothing launched."""
        if self.world_size == 1:
            for p in self.params:
                p.grad = None
            return
        for buf in self.buffers:
            buf.zero_()
        for i, p in enumerate(self.params):
            p.grad = self.views[i]
        self._remaining = [len(m) for m in self.buckets]
        self._next, self._works = 0, []

    def _hook(self, i: int):
        def hook(param: torch.Tensor) -> None:
            view = self.views[i]
            if param.grad is not None and param.grad.data_ptr() != view.data_ptr():
                view.copy_(param.grad)  # autograd replaced the view instead of adding into it
                param.grad = view
            b = self.bucket_of[i]
            self._remaining[b] -= 1
            self._launch_ready()

        return hook

    def _launch_ready(self, force: bool = False) -> None:
        while self._next < len(self.buckets) and (force or self._remaining[self._next] == 0):
            if self.world_size > 1:
                work = dist.all_reduce(
                    self.buffers[self._next], op=dist.ReduceOp.SUM, group=self.group, async_op=True
                )
                self._works.append(work)
            self._next += 1

    def finish(self) -> torch.Tensor:
        """After backward: the reduced gradients are in place; returns their global norm."""
        if self.world_size == 1:
            grads = [
                p.grad if p.grad is not None else self.views[i] for i, p in enumerate(self.params)
            ]
            for i, p in enumerate(self.params):
                if p.grad is None:  # not reached by autograd: a zero gradient, as with W ranks
                    self.views[i].zero_()
                    p.grad = self.views[i]
            return torch.linalg.vector_norm(torch.stack(torch._foreach_norm(grads)))
        self._launch_ready(force=True)
        for work in self._works:
            work.wait()  # the current stream waits for the reduction; the host does not
        self._works = []
        for i, p in enumerate(self.params):
            p.grad = self.views[i]  # also for a parameter autograd did not reach: zeros
        norms = torch._foreach_norm(self.buffers)
        return torch.linalg.vector_norm(torch.stack(norms))
