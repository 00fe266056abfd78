"""HSTU attention for JAX: Pallas kernels (forward + backward) and a plain-jnp reference."""

from .hstu_attention import (
    KERNELS,
    LOWERINGS,
    BlockSizes,
    MosaicTiles,
    default_block_sizes,
    hstu_attention,
    mosaic_problem,
)
from .reference import hstu_attention_reference, hstu_mask_reference

__all__ = [
    "LOWERINGS",
    "KERNELS",
    "BlockSizes",
    "MosaicTiles",
    "default_block_sizes",
    "hstu_attention",
    "mosaic_problem",
    "hstu_attention_reference",
    "hstu_mask_reference",
]
