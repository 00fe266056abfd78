"""The torch backend's training state besides the model: the optimizer and the RNG streams.

Kept apart from `train_step.py` (which runs steps) and `checkpoint.py` / `convert.py` (which
store and convert this state), so that none of those import each other in a circle.
"""

from __future__ import annotations

import torch


def make_optimizer(params, tc) -> torch.optim.AdamW:
    """AdamW on every parameter, decoupled weight decay (== optax.adamw of the JAX backend).

    On CUDA the fused implementation: the whole update in a couple of kernels instead of a
    dozen multi-tensor launches per step (the same arithmetic)."""
    params = list(params)
    fused = bool(params) and all(p.is_cuda for p in params)
    return torch.optim.AdamW(
        params,
        lr=tc.lr,
        betas=(tc.beta1, tc.beta2),
        eps=tc.eps,
        weight_decay=tc.weight_decay,
        fused=True if fused else None,
    )


def rank_seed(seed: int, rank: int) -> int:
    """Seed of rank `rank`'s torch generator at the start of a run."""
    return seed * 100_003 + rank


def rng_state(device: torch.device) -> dict[str, torch.Tensor]:
    state = {"torch": torch.get_rng_state()}
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


def set_rng_state(state: dict[str, torch.Tensor], device: torch.device) -> None:
    torch.set_rng_state(state["torch"])
    if device.type == "cuda" and "cuda" in state:
        torch.cuda.set_rng_state(state["cuda"], device)
