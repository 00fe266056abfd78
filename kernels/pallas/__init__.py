"""HSTU attention for JAX: Pallas kernels (forward + backward) and a plain-jnp reference."""

from .hstu_attention import BlockSizes, hstu_attention
from .reference import hstu_attention_reference, hstu_mask_reference

__all__ = ["BlockSizes", "hstu_attention", "hstu_attention_reference", "hstu_mask_reference"]
