"""HSTU attention for torch: Triton kernel (``hstu_attention``) and plain-torch reference.

The kernel module is imported on first use of ``hstu_attention`` / ``BlockSizes``: Triton
decides at decoration time whether kernels run compiled or in the CPU interpreter
(``TRITON_INTERPRET=1``), so importing ``hstu_kernels.triton.reference`` must not decorate them.
"""

import importlib

from .reference import hstu_attention_reference, hstu_mask_reference

__all__ = [
    "BlockSizes",
    "hstu_attention",
    "hstu_attention_reference",
    "hstu_mask_reference",
    "hstu_uvqk_attention",
]

_LAZY = ("BlockSizes", "hstu_attention", "hstu_uvqk_attention")


def __getattr__(name: str):
    if name in _LAZY:
        _module = importlib.import_module(f"{__name__}.hstu_attention")

        # the submodule import bound the package attribute `hstu_attention` to the module;
        # rebind the public names to the objects
        for attr in _LAZY:
            globals()[attr] = getattr(_module, attr)
        return globals()[name]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
