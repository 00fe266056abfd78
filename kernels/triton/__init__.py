"""HSTU attention for torch: Triton kernel (``hstu_attention``) and plain-torch reference.

The kernel module is imported on first use of ``hstu_attention`` / ``BlockSizes``: Triton
decides at decoration time whether kernels run compiled or in the CPU interpreter
(``TRITON_INTERPRET=1``), so importing ``hstu_kernels.triton.reference`` must not decorate them.
"""

import importlib
import sys
import types

from .reference import hstu_attention_reference, hstu_mask_reference

__all__ = [
    "BlockSizes",
    "hstu_attention",
    "hstu_attention_reference",
    "hstu_linear_uvqk_attention",
    "hstu_mask_reference",
    "hstu_uvqk_attention",
    "shared_schedules",
]

_LAZY = (
    "BlockSizes",
    "hstu_attention",
    "hstu_linear_uvqk_attention",
    "hstu_uvqk_attention",
    "shared_schedules",
)


def __getattr__(name: str):
    if name in _LAZY:
        importlib.import_module(f"{__name__}.hstu_attention")  # binds _LAZY (_Package)
        return globals()[name]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


class _Package(types.ModuleType):
    """The first import of the submodule ``hstu_attention``, from here or from a sibling
    (``bench``, ``tune``), binds it as this package's attribute of the same name; the public
    names stay the function and the classes."""

    def __setattr__(self, name: str, value) -> None:
        if name == "hstu_attention" and isinstance(value, types.ModuleType):
            for attr in _LAZY:
                super().__setattr__(attr, getattr(value, attr))
            return
        super().__setattr__(name, value)


sys.modules[__name__].__class__ = _Package
