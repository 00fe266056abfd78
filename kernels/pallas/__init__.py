"""HSTU attention for JAX: Pallas kernels (forward + backward) and a plain-jnp reference."""

from .hstu_attention import KERNELS, BlockSizes, default_block_sizes, hstu_attention
from .reference import hstu_attention_reference, hstu_mask_reference

__all__ = [
    "KERNELS",
    "BlockSizes",
    "default_block_sizes",
    "hstu_attention",
    "hstu_attention_reference",
    "hstu_mask_reference",
]
