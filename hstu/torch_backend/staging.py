"""Host -> device copies of small int64 arrays through reused page-locked buffers.

Every step copies a few host-built int64 arrays to the GPU: the batch's ids and lengths, its
token layout, the exchange's segment indices. A `non_blocking` copy needs page-locked memory,
and pinning the batch's tensors one by one (`TorchBatch.pin_memory`, before) took 0.6 to 0.9
ms of host time per step on the GPU machine (`scripts/host_time.py`, one H200, batch 8 and
32), where the host bounds the batch-8 step (docs/BENCHMARKS.md). Here a ring of page-locked buffers
is allocated once and reused: the arrays of one call are packed into one slot, copied in one
transfer, and handed back as views of the device copy. A slot is reused only after the copy
that last read it has finished (an event recorded on the stream that issued it; by then it
is several copies old, so the wait is a formality).

One ring per device, used from the thread that dispatches the step. Without CUDA the arrays
are plain tensors moved with `.to(device)`.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

SLOTS = 16  # copies in flight before a slot comes round again (a step makes 2 to 5)


class PinnedStaging:
    def __init__(self, slots: int = SLOTS):
        self.buffers: list[torch.Tensor | None] = [None] * slots
        self.events: list[torch.cuda.Event | None] = [None] * slots
        self.next = 0
        self.allocations = 0  # page-locked allocations so far (tests: reuse after warm-up)

    def _slot(self, numel: int) -> tuple[int, torch.Tensor]:
        i = self.next
        self.next = (i + 1) % len(self.buffers)
        if self.events[i] is not None:
            self.events[i].synchronize()  # the last copy out of this slot has finished
        buf = self.buffers[i]
        if buf is None or buf.numel() < numel:
            # headroom, so that a slightly larger batch later reuses the slot
            buf = torch.empty(max(numel + numel // 2, 1024), dtype=torch.int64, pin_memory=True)
            self.buffers[i] = buf
            self.allocations += 1
        return i, buf

    def copy(
        self, arrays: Sequence[np.ndarray], device: torch.device, out: torch.Tensor | None = None
    ) -> list[torch.Tensor]:
        """`arrays` (int64-castable) on `device`, each a view of one transfer, issued on the
        current stream without blocking the host; into `out` (int64 on `device`, exactly
        their total size) when given, e.g. a CUDA graph's static input."""
        sizes = [int(np.size(a)) for a in arrays]
        total = sum(sizes)
        i, buf = self._slot(total)
        host = buf[:total]
        pack(arrays, host.numpy())
        if out is None:
            flat = host.to(device, non_blocking=True)
        else:
            flat = out.copy_(host, non_blocking=True)
        event = torch.cuda.Event()
        event.record()
        self.events[i] = event
        return list(torch.split(flat, sizes))


def pack(arrays: Sequence[np.ndarray], out: np.ndarray) -> np.ndarray:
    """The arrays' values one after another in `out` (int64, exactly their total size)."""
    if arrays:
        np.concatenate([np.ravel(a) for a in arrays], out=out)
    return out


_RINGS: dict[torch.device, PinnedStaging] = {}


def staging(device: torch.device) -> PinnedStaging:
    """The process's ring for `device` (created on first use)."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    ring = _RINGS.get(device)
    if ring is None:
        ring = _RINGS[device] = PinnedStaging()
    return ring


def to_device_int64(arrays: Sequence[np.ndarray], device: torch.device) -> list[torch.Tensor]:
    """Host int64 arrays on `device`: through the staging ring on CUDA (one transfer, no host
    wait), plain `.to` elsewhere."""
    device = torch.device(device)
    if device.type != "cuda":
        return [
            torch.from_numpy(np.ascontiguousarray(a, dtype=np.int64)).to(device) for a in arrays
        ]
    return staging(device).copy(arrays, device)
