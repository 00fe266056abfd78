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

from collections.abc import Callable, Sequence

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
        self._active = False  # between start and finish: the hooks launch (not in a backward
        # of another owner, e.g. a step graph's, or the timing probes')

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
        self._active = True

    def _hook(self, i: int):
        def hook(param: torch.Tensor) -> None:
            if not self._active:
                return
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

    def finish(self, more: Callable[[], list[torch.Tensor]] | None = None) -> torch.Tensor:
        """After backward: the reduced gradients are in place; returns their global norm.

        `more`: further reductions (`TouchedRowsReduce.reduce`), launched after the last bucket
        so every rank issues its collectives in one order; the tensors it returns hold the rest
        of the reduced gradient and join the norm."""
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
        self._active = False
        extra = more() if more is not None else []
        for work in self._works:
            work.wait()  # the current stream waits for the reduction; the host does not
        self._works = []
        for i, p in enumerate(self.params):
            p.grad = self.views[i]  # also for a parameter autograd did not reach: zeros
        norms = torch._foreach_norm(self.buffers + extra)
        return torch.linalg.vector_norm(torch.stack(norms))


class RowMarks:
    """The rows of each replicated table that some rank looks up in this step: a float per row
    (1 = looked up), set by `mark` from the batch's ids before the forward and MAX-reduced over
    the ranks without blocking: the reduction runs beside the forward, and `wait` makes the
    compute stream (not the host) wait for it before the marks are read."""

    def __init__(
        self,
        tables: dict[str, torch.Tensor],
        features: dict[str, list[str]],
        world_size: int,
        group=None,
    ):
        sizes = [p.shape[0] for p in tables.values()]
        self.flat = torch.zeros(sum(sizes), device=next(iter(tables.values())).device)
        self.rows = dict(zip(tables, self.flat.split(sizes), strict=True))
        self.features, self.world_size, self.group = features, world_size, group
        self._work = None

    def mark(self, tb) -> None:
        """This rank's lookups of batch `tb` (every value of each table's keys), then the MAX
        over the ranks launched."""
        self.flat.zero_()
        values, keys = tb.kjt.values(), tb.keys
        bounds = tb.kjt.offset_per_key()
        for name, features in self.features.items():
            for f in features:
                if f in keys:
                    i = keys.index(f)
                    self.rows[name].index_fill_(0, values[bounds[i] : bounds[i + 1]], 1.0)
        if self.world_size > 1:
            self._work = dist.all_reduce(
                self.flat, op=dist.ReduceOp.MAX, group=self.group, async_op=True
            )

    def wait(self) -> None:
        if self._work is not None:
            self._work.wait()
            self._work = None

    def lookups(self, lengths: dict[str, int]) -> dict[str, int]:
        """Per table, the values its keys hold in `lengths` (key -> value count): over the
        global batch, an upper bound on the rows any rank marks."""
        return {n: sum(lengths.get(f, 0) for f in fs) for n, fs in self.features.items()}


ROW_GRANULE = 512  # rows a reduced slice of a table grows by (fewer distinct buffer sizes)


def reduced_rows(num_rows: int, lookups: int) -> int:
    """The rows a table's reduction carries: its lookups over the global batch (a bound on the
    rows any rank marks) rounded up to ROW_GRANULE, at most the table."""
    return min(num_rows, -(-max(lookups, 1) // ROW_GRANULE) * ROW_GRANULE)


def marked_first(name: str, marked: torch.Tensor, cap: int) -> torch.Tensor:
    """`cap` distinct rows, those `marked` (> 0) first; a device-side check (no host sync)
    that they fit, which holds by construction unless the stats are not this batch's."""
    torch._assert_async(
        (marked > 0).sum() <= cap,
        f"{name}: more rows looked up than the gathered stats allow ({cap}): the stats "
        "handed to forward_backward are not this step's batch",
    )
    return torch.argsort(marked, descending=True, stable=True)[:cap]


class TouchedRowsReduce:
    """W > 1: each replicated table's gradient all-reduced over the rows some rank looked up.

    A row no rank looked up has a zero gradient on every rank, hence a zero sum: only the rows
    `RowMarks` set need to cross the network. The host knows an upper bound on their number
    without asking the device: the values of the table's keys over the global batch (the
    gathered stats). The reduction carries `min(rows, bound)` rows rounded up to ROW_GRANULE,
    the marked rows first and unmarked (zero) rows after them, so every index is distinct and
    writing the sums back is exact; a table the bound does not shrink is reduced whole. The
    recipe's item table (100K x 1024 fp32, 400 MB) at W=4 and 32 samples per rank: about a
    quarter of its rows. The tables' gradients are the last of the backward (the lookup is the
    forward's first op), so nothing that could overlap the reduction is lost by it running
    after the buckets."""

    def __init__(self, tables: dict[str, torch.nn.Parameter], marks: RowMarks, group=None):
        self.tables, self.marks, self.group = tables, marks, group
        self.last_rows: dict[str, int] = {}  # table -> rows the last step's reduction carried
        # table -> (rows, their summed gradient) of the last step, for a table reduced in part:
        # an update of the touched rows reads them instead of the `[V, D]` gradient
        self.compact: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}

    def start(self) -> None:
        """Before backward: autograd writes each table's gradient afresh (no accumulation)."""
        for p in self.tables.values():
            p.grad = None
        self.compact = {}

    def reduce(self, lookups: dict[str, int] | None) -> list[torch.Tensor]:
        """Launch the reductions, wait for them on the stream, write the sums back into the
        tables' `.grad`; returns tensors whose norm is the tables' gradient norm.
        `lookups`: table -> the bound above (None: every table whole)."""
        self.marks.wait()
        launched = []
        for name, p in self.tables.items():
            if p.grad is None:  # this rank looked nothing up: it adds zeros
                p.grad = torch.zeros_like(p)
            g, n = p.grad, p.shape[0]
            cap = n if lookups is None else reduced_rows(n, lookups[name])
            self.last_rows[name] = cap
            if cap >= n:
                launched.append((g, g, None, self._all_reduce(g)))
                continue
            rows = marked_first(name, self.marks.rows[name], cap)
            part = g.index_select(0, rows)
            launched.append((g, part, rows, self._all_reduce(part)))
        out = []
        for name, (g, part, rows, work) in zip(self.tables, launched, strict=True):
            work.wait()
            if rows is not None:
                g.index_copy_(0, rows, part)
                self.compact[name] = (rows, part)
            out.append(part)
        return out

    def _all_reduce(self, t: torch.Tensor):
        return dist.all_reduce(t, op=dist.ReduceOp.SUM, group=self.group, async_op=True)
