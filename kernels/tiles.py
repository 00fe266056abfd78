"""Tiles per kernel, shared by the Triton and Pallas attention (no framework imported).

Both take ``block_sizes`` as None (the defaults for the head dim), one ``BlockSizes`` for all
three kernels, a (forward, backward) pair or a (forward, dk/dv, dq) triple.
"""

from collections.abc import Callable

KERNELS = ("fwd", "dkdv", "dq")


def resolve_tiles(block_sizes, block_type: type, default: Callable[[str], object]) -> tuple:
    """(forward, dk/dv, dq) tiles of ``block_sizes``; ``default(kernel)`` fills a None."""
    if block_sizes is None:
        return tuple(default(kernel) for kernel in KERNELS)
    if isinstance(block_sizes, block_type):
        return block_sizes, block_sizes, block_sizes
    if isinstance(block_sizes, tuple) and all(isinstance(b, block_type) for b in block_sizes):
        if len(block_sizes) == 2:
            return block_sizes[0], block_sizes[1], block_sizes[1]
        if len(block_sizes) == 3:
            return block_sizes
    raise ValueError(
        "block_sizes: expected None, a BlockSizes, a (forward, backward) pair or a (forward, "
        f"dk/dv, dq) triple of them, got {block_sizes!r}"
    )
