"""Tiles per kernel, shared by the Triton and Pallas attention (no framework imported).

Both take ``block_sizes`` as None (the defaults for the head dim), one ``BlockSizes`` for all
three kernels, a (forward, backward) pair or a (forward, dk/dv, dq) triple.
"""

from collections.abc import Callable

KERNELS = ("fwd", "dkdv", "dq")


def launch_lead(kernel: str, lead: int | None, entries: int) -> int:
    """Schedule entries whose programs / CTAs go out with their heads together before the rest
    go out head by head, for both backends' kernels (``BlockSizes.lead``, ``MosaicTiles.lead``):
    ``lead`` if set, else the measured default, the forward head by head (0) and dq / dk / dv
    every entry with its heads (kernels/README.md, "Dispatch order"); at most ``entries``."""
    if lead is None:
        lead = 0 if kernel == "fwd" else entries
    return min(lead, entries)


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
