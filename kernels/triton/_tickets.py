"""Arrival counters for kernels whose last programs finish a reduction themselves.

A kernel that sums per-program partials into a gradient used to take a second launch for the
sum (a few microseconds, plus the gap before it, for a few hundred KB). With a counter the
programs take a ticket once their partial is stored: the last to arrive (or the last few, each
summing a slice of the columns once every partial is in) do the sum in the same launch, in the
same fixed order as a separate kernel would (deterministic run to run), and put the counter
back to zero for the next launch.

The counters live in one int32 buffer per (device, stream), zeroed once and left zeroed by
every launch that uses them: launches on one stream run one after another, so they can share
it; two streams get two buffers. A buffer first used inside a CUDA-graph capture is allocated
there (its zero fill becomes a node of that graph, which re-zeroes zeros at each replay).
"""

from __future__ import annotations

import torch

SLOTS = 256  # counters per buffer: enough for every column block of a 16K-wide sum

_BUFFERS: dict[tuple[torch.device, int], torch.Tensor] = {}


def counters(device: torch.device, n: int) -> torch.Tensor:
    """`n` <= SLOTS zeroed int32 counters for a launch on `device`'s current stream."""
    if n > SLOTS:
        raise ValueError(f"{n} counters asked, a buffer holds {SLOTS}")
    stream = torch.cuda.current_stream(device).cuda_stream if device.type == "cuda" else 0
    key = (device, stream)
    buf = _BUFFERS.get(key)
    if buf is None:
        buf = _BUFFERS[key] = torch.zeros(SLOTS, dtype=torch.int32, device=device)
    return buf[:n]
