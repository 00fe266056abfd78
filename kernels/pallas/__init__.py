"""HSTU attention for JAX: Pallas kernels (forward + backward) and a plain-jnp reference."""

from .hstu_attention import (
    FORWARDS,
    KERNELS,
    BlockSizes,
    MosaicTiles,
    default_block_sizes,
    hstu_attention,
    mosaic_forward_problem,
)
from .reference import hstu_attention_reference, hstu_mask_reference

__all__ = [
    "FORWARDS",
    "KERNELS",
    "BlockSizes",
    "MosaicTiles",
    "default_block_sizes",
    "hstu_attention",
    "mosaic_forward_problem",
    "hstu_attention_reference",
    "hstu_mask_reference",
]
