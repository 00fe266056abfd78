"""The HSTU stack as CUDA graphs (`train.cuda_graphs`): the torch step without its launches.

Eager, the torch step is bound by the host: at 8 layers it launches ~570 kernels (forward on
the main thread, backward on autograd's), ~25 ms of host time whatever the batch holds, while
the GPU is busy for half of that (docs/BENCHMARKS.md, "Where the time goes now"). Here the
layers and the final norm, forward and backward, are captured once per shape and replayed:
two graph launches per step instead of hundreds of kernel launches.

A graph has static shapes, so the step's tokens are padded to a token capacity from the same
policy the JAX backend compiles for (`hstu.capacity`: a few capacities fitted to the run's
lengths), and the attention kernel is given the config's bound on a sample's length as its
`max_seqlen` (it only sizes the grid; programs past a sample's end return at once). One graph
per (capacity, batch rows): about 8 in practice (6 to 7 in 30 steps of `bench_upstream`).
Padding tokens belong to no sample (they lie past `offsets[-1]`), so the attention never reads
them and the loss never sees them: their gradient is exactly zero, and so is what they add to
every parameter's gradient. What is outside the stack stays eager: the embedding lookups
(TorchRec, sharded or not, with their all-to-alls), the layout of the tokens, the loss and the
optimizer.

Memory: the graphs share one pool. That is safe because one graph's forward and backward run
at a time, and everything a replay produces (its output, the input and parameter gradients,
which autograd hands over as `.grad` and the optimizer consumes) is used up before the next
replay of any graph. Each graph keeps its own static input and gradient buffers (about the
stack's parameter count in fp32 per graph).

`torch.cuda.make_graphed_callables` does the capture (warm-up on a side stream, forward and
backward graphs, an autograd function that replays them). Without CUDA (`capture=False`, the
CPU tests) the same padded stack runs eagerly, which checks the padding.
"""

from __future__ import annotations

import logging
import os

import torch
import torch.nn.functional as F
from torch import nn

from hstu.capacity import CapacityPolicy
from hstu.errors import HSTUError
from hstu.torch_backend.attention import shared_schedules
from hstu.torch_backend.model import run_stack

log = logging.getLogger(__name__)

MAX_GRAPHS = 64  # beyond this, a new shape runs eagerly (the policy gives up to 48 capacities)


def check_cuda_graphs(cfg, device_type: str) -> None:
    """`train.cuda_graphs` on a run without CUDA: a config error before any rank starts."""
    if cfg.train.cuda_graphs and device_type != "cuda":
        raise HSTUError(
            f"train.cuda_graphs=true needs CUDA devices; this run uses {device_type} "
            "(set train.cuda_graphs=false)"
        )


CUBLAS_WORKSPACE_ENV = "CUBLAS_WORKSPACE_CONFIG"
NO_WORKSPACE = ":0:0"  # no bytes, no buffers: cuBLAS's kernels that need no scratch


def set_cublas_workspace(cfg, device_type: str) -> str | None:
    """`train.cublas_workspace` for this process, before its first GEMM (cuBLAS reads the
    variable once, when torch makes its first workspace). With a workspace cuBLAS runs the
    recipe's bf16-output GEMMs as kernels whose scheduler needs zeroed scratch: in a CUDA graph
    each follows a ~1 us memset node and starts 2-4 us after it; without one it picks kernels
    of the same speed that need none (`scripts/gemm_memsets.py`). A value the environment
    already holds is left alone. Returns the variable's value after (None: unset)."""
    choice = cfg.train.cublas_workspace
    if choice == "auto":
        choice = "none" if cfg.train.cuda_graphs else "torch"
    if device_type == "cuda" and choice == "none":
        os.environ.setdefault(CUBLAS_WORKSPACE_ENV, NO_WORKSPACE)
    return os.environ.get(CUBLAS_WORKSPACE_ENV)


class _Stack(nn.Module):
    """The layers and final norm of an `HSTUModel` over tensors only (what a graph captures);
    the sample-length bound is fixed, as a graph needs."""

    def __init__(self, model: nn.Module, max_seqlen: int):
        super().__init__()
        self.layers, self.final_norm = model.layers, model.final_norm  # shared, not copied
        self.max_seqlen = max_seqlen

    def forward(self, x, offsets, num_contextual, num_candidates, timestamps=None):
        seq = {
            "offsets": offsets,
            "max_seqlen": self.max_seqlen,
            "num_contextual": num_contextual,
            "num_candidates": num_candidates,
            "timestamps": timestamps,
        }
        return run_stack(self.layers, self.final_norm, x, seq)


class GraphedStack:
    """`stack(x, seq) -> z [T, D]`, padded to a token capacity and replayed from a graph."""

    def __init__(
        self,
        model: nn.Module,
        policy: CapacityPolicy,
        max_seqlen: int,
        capture: bool = True,
        warmup: int = 3,
    ):
        self.model = model
        self.eager = model.stack  # the unpadded stack with the batch's own max_seqlen
        self.policy, self.max_seqlen = policy, max_seqlen
        self.capture, self.warmup = capture, warmup
        self.uses_time = any(layer.rab_time is not None for layer in model.layers)
        self.pool = torch.cuda.graph_pool_handle() if capture else None
        self.graphs: dict[tuple[int, int], object] = {}
        self.eager_steps = 0  # stacks run eagerly (a sample past the bound, or too many shapes)

    @property
    def num_graphs(self) -> int:
        return len(self.graphs)

    def _args(self, x: torch.Tensor, seq: dict, capacity: int) -> tuple[torch.Tensor, ...]:
        pad = capacity - x.shape[0]
        args = [F.pad(x, (0, 0, 0, pad)), seq["offsets"]]
        args += [seq["num_contextual"], seq["num_candidates"]]
        if self.uses_time:
            args.append(F.pad(seq["timestamps"], (0, pad)))
        return tuple(args)

    def __call__(self, x: torch.Tensor, seq: dict) -> torch.Tensor:
        num_tokens, rows = x.shape[0], seq["offsets"].numel() - 1
        key = (self.policy.capacity(max(num_tokens, 1)), rows)
        fits = seq["max_seqlen"] <= self.max_seqlen
        if not fits or (key not in self.graphs and len(self.graphs) >= MAX_GRAPHS):
            self.eager_steps += 1
            return self.eager(x, seq)
        args = self._args(x, seq, key[0])
        fn = self.graphs.get(key)
        if fn is None:
            fn = self.graphs[key] = self._make(args)
        return fn(*args)[:num_tokens]

    def _make(self, args: tuple[torch.Tensor, ...]):
        # one module per graph: capturing replaces the module's forward with the replay
        stack = _Stack(self.model, self.max_seqlen)
        if not self.capture:
            return stack
        log.info("capturing the HSTU stack: %d tokens, %d rows", args[0].shape[0], len(args[1]) - 1)
        # the first batch of this shape is the capture's sample: real lengths, so the warm-up
        # runs the kernels on valid offsets (its gradients are discarded)
        sample = tuple(a.detach().clone().requires_grad_(a.requires_grad) for a in args)
        # forward and backward are captured as two graphs: the backward's attention must not
        # read a schedule table the forward's graph built (`shared_schedules`)
        with shared_schedules(self.model.cfg.attention, share=False):
            return torch.cuda.make_graphed_callables(
                stack, sample, num_warmup_iters=self.warmup, pool=self.pool
            )
