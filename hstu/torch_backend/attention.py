"""The one switch `model.attention`: `reference` (plain torch, padded dense) or `kernel`
(Triton). Both live in `hstu_kernels.triton` and share the contract of `kernels/README.md`
(the kernel also as `hstu_uvqk_attention`, which takes the layer's activation unsplit);
they are imported lazily so that building a model never compiles a kernel it does not use."""

from __future__ import annotations

import contextlib
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


def get_uvqk_attention(
    name: str, device: torch.device | str, backward: str = "auto", linear: bool = False
) -> Callable[..., tuple[torch.Tensor, torch.Tensor]] | None:
    """The kernel's split-and-attention op (`hstu_uvqk_attention`: the layer's u, v, q, k
    columns in, `(u, attention)` out, its gradient built in one buffer) for `model.attention`
    = kernel; None for the reference, which the layer calls on the split columns. `linear`:
    the op from the layer's normed input to its gated norm instead (`hstu_linear_uvqk_attention`:
    the uvqk projection and its SiLU too, SiLU's backward in the kernels' epilogues)."""
    get_attention(name, device, backward)  # the same checks, the same errors
    if name != "kernel":
        return None
    from hstu_kernels.triton import hstu_linear_uvqk_attention, hstu_uvqk_attention

    op = hstu_linear_uvqk_attention if linear else hstu_uvqk_attention
    if backward == "auto":
        return op
    return functools.partial(op, backward=backward)


def shared_schedules(name: str, share: bool = True) -> contextlib.AbstractContextManager:
    """Around one step's forward and backward (or their capture into one CUDA graph): for
    `model.attention` = kernel, the kernels' schedule tables built once per step and shared by
    the layers (`hstu_kernels.triton.shared_schedules`: 3 table launches a step instead of 3
    a layer); `share=False`: none shared inside, as around separate forward and backward
    captures; a no-op for the reference."""
    if name != "kernel":
        return contextlib.nullcontext()
    from hstu_kernels.triton import shared_schedules as shared

    return shared(share)
