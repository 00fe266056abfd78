"""The one switch `model.attention`: `reference` (plain torch, padded dense) or `kernel`
(Triton). Both live in `hstu_kernels.triton` and share the contract of `kernels/README.md`;
they are imported lazily so that building a model never compiles a kernel it does not use."""

from __future__ import annotations

import functools
import os
from collections.abc import Callable

import torch

from hstu.errors import HSTUError

ATTENTION_IMPLS = ("reference", "kernel")


def get_attention(
    name: str, device: torch.device | str, backward: str = "auto"
) -> Callable[..., torch.Tensor]:
    """The attention function for `model.attention`, checked against the device up front
    (a kernel that cannot run here must fail before any collective, not inside the step).
    `backward` (`model.attention_backward`): the kernel's backward mode; auto: its default."""
    device = torch.device(device)
    if name == "reference":
        from hstu_kernels.triton.reference import hstu_attention_reference

        return hstu_attention_reference
    if name == "kernel":
        interpret = os.environ.get("TRITON_INTERPRET", "0") == "1"
        if device.type != "cuda" and not interpret:
            raise HSTUError(
                "model.attention=kernel needs a CUDA device (or TRITON_INTERPRET=1 set before "
                f"starting, to interpret the Triton kernel on CPU); this run uses {device}. "
                "Use model.attention=reference on CPU."
            )
        if device.type == "cuda" and interpret:
            raise HSTUError(
                "model.attention=kernel: TRITON_INTERPRET=1 is set but the device "
                "is CUDA; unset it to run the compiled kernel"
            )
        from hstu_kernels.triton import hstu_attention

        if backward == "auto":
            return hstu_attention
        return functools.partial(hstu_attention, backward=backward)
    raise HSTUError(f"model.attention={name!r} is not one of {list(ATTENTION_IMPLS)}")
