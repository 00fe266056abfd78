"""The shuffle half of the torch Backend: host->device copy, stats gather, exchange.

The schedule (two phases, worker-thread partitioning, collective order) is the core's
`hstu.pipeline.Balancer`; this class supplies its device primitives. Shufflers are named
`identity` | `balanced` (the pipeline skips the exchange for identity) and exchanges
`allgather` | `all2all` (registry below).

On CUDA the copy and the exchange run on a side stream: `to_device` writes the host batch's ids
and lengths into one pinned buffer and copies it there with `non_blocking=True`, the
collectives of phase 1 and 2 are issued under the same stream, and `ready()` makes the compute
stream wait for it and records the batch's tensors on the compute stream so the allocator does
not recycle them early. Collectives are issued from the host in the pipeline's order, the
same on every rank, whatever the stream.
"""

from __future__ import annotations

import contextlib
import datetime
from collections.abc import Callable, Sequence

import numpy as np
import torch
import torch.distributed as dist

from hstu.batch import JaggedBatch
from hstu.errors import HSTUError
from hstu.pipeline import STAT_REAL
from hstu.shuffle_plan import ShufflePlan
from hstu.torch_backend import collectives
from hstu.torch_backend.batch import TorchBatch, to_device
from hstu.workload import HSTUCost

SHUFFLERS = ("identity", "balanced")
EXCHANGES: dict[str, Callable[..., TorchBatch]] = {
    "allgather": collectives.allgather_exchange,
    "all2all": collectives.all2all_exchange,
}


def check_shuffler(name: str) -> str:
    if name not in SHUFFLERS:
        raise HSTUError(f"balance.shuffler={name!r} is not one of {list(SHUFFLERS)}")
    return name


def get_exchange(name: str) -> Callable[..., TorchBatch]:
    if name not in EXCHANGES:
        raise HSTUError(f"balance.exchange={name!r} is not one of {sorted(EXCHANGES)}")
    return EXCHANGES[name]


def local_workloads(batch: TorchBatch, cost: HSTUCost) -> np.ndarray:
    """Per-sample FLOPs `[batch_size]` (int64) of this rank's batch, from its KJT lengths.

    The same formula as `HSTUCost.batch_flops` (see hstu/workload.py), evaluated with torch on
    the batch's own device tensors; the parity suite checks that both give identical numbers.
    """
    lengths = dict(zip(batch.keys, batch.lengths_KB().to(torch.int64), strict=True))
    zeros = torch.zeros(batch.batch_size, dtype=torch.int64, device=batch.device)
    c = lengths.get("contextual", zeros)
    k = lengths.get("candidate", zeros)
    n = c + 2 * lengths.get("item", zeros) + k
    h = n - k  # contextual + history tokens
    pairs = c * h + (h * (h + 1) - c * (c + 1)) // 2 + k * (h + 1)
    per_layer = n * cost.linear_flops_per_token() + pairs * cost.attention_flops_per_pair()
    flops = per_layer * (cost.num_layers * (3 if cost.backward else 1))
    return flops.cpu().numpy()


class TorchShuffler:
    """`to_device`, `allgather_stats`, `exchange` of the Backend protocol, for one rank."""

    def __init__(
        self,
        rank: int,
        world_size: int,
        device: torch.device | str,
        batch_size: int,
        exchange: str = "allgather",
        group=None,
        timeout_s: float | None = None,
    ):
        self.rank, self.world_size = rank, world_size
        self.local_ranks: Sequence[int] = [rank]
        self.device = torch.device(device)
        self.batch_size, self.group = batch_size, group
        self.exchange_name = exchange
        self._exchange = get_exchange(exchange)
        self.copy_stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        self._keys: tuple[list[str], list[str]] | None = None
        # Phase-1 stats are host numbers: they are gathered over a gloo group of their own.
        # Through NCCL the gather would queue behind the device's work (a communicator runs its
        # collectives in order, so it waited for the previous step's gradient reduction, and
        # the host with it: 22 to 32 ms per step at W=2 with the stack replayed from graphs).
        self.host_group = None
        if world_size > 1 and dist.is_initialized():
            ranks = None if group is None else dist.get_process_group_ranks(group)
            timeout = None if timeout_s is None else datetime.timedelta(seconds=timeout_s)
            self.host_group = dist.new_group(ranks, timeout=timeout, backend="gloo")

    def _side(self):
        if self.copy_stream is None:
            return contextlib.nullcontext()
        return torch.cuda.stream(self.copy_stream)

    def _validate(self, batch: JaggedBatch) -> None:
        """What would make the collectives mismatch across ranks; checked before any of them.
        (The pipeline has already run `batch.validate()` and the model's input checks.)"""
        where = f"invalid batch on rank {self.rank}"
        if batch.batch_size != self.batch_size:
            raise HSTUError(
                f"{where}: batch_size {batch.batch_size} != configured "
                f"data.batch_size {self.batch_size} (every rank must agree)"
            )
        keys = (batch.keys, list(batch.dense))
        if self._keys is None:
            self._keys = keys
        elif keys != self._keys:
            raise HSTUError(f"{where}: keys {keys} differ from the first batch's {self._keys}")

    # ------------------------------------------------------------------ Backend protocol
    def to_device(self, batches: Sequence[JaggedBatch]) -> TorchBatch:
        if len(batches) != 1:
            raise HSTUError(f"torch backend drives one rank per process, got {len(batches)}")
        batch = batches[0]
        self._validate(batch)
        with self._side():
            return to_device(batch, self.device)

    def allgather_stats(self, local_stats: np.ndarray) -> np.ndarray:
        if self.host_group is not None:
            return collectives.allgather_stats(
                local_stats, self.world_size, torch.device("cpu"), self.host_group
            )
        with self._side():
            return collectives.allgather_stats(
                local_stats, self.world_size, self.device, self.group
            )

    def exchange(
        self, device_batch: TorchBatch, plan: ShufflePlan, stats: np.ndarray
    ) -> TorchBatch:
        b = self.batch_size
        # Internal invariant: the pipeline hands the stats gathered for this very batch.
        assert int(stats[self.rank * b : (self.rank + 1) * b, STAT_REAL].sum()) == (
            device_batch.actual_batch_size
        ), "exchange: stats do not belong to this batch"
        with self._side():
            return self._exchange(device_batch, plan, stats, self.rank, self.group)

    def ready(self, device_batch: TorchBatch) -> TorchBatch:
        """The batch, usable on the current (compute) stream."""
        if self.copy_stream is not None:
            current = torch.cuda.current_stream(self.device)
            current.wait_stream(self.copy_stream)
            device_batch.record_stream(current)
        return device_batch
