"""How ``sparse_mla_decode`` divides a call's work into items: the split of the selected tokens
across blocks and the parts of a row's output dims. Pure functions of the shapes and the device's
block counts (never of the data), so equal inputs give equal bits on every run; ``ops.decode.plan``
applies them."""

from __future__ import annotations

from .. import abi

MAX_SPLITS = abi.HEAD_DIM // 4  # the combine kernel's threads: it takes a split a thread
# When choosing the split, in tile-times of one block: what a block costs besides its tiles (its
# query load and its output rows), and what the combine launch costs.
_BLOCK_COST = 1
_COMBINE_COST = 1
# The share of a launch's blocks that half rows may fill (H200, against whole rows at the same
# split: 1.06-1.19x up to 80 blocks of 132, 1.03-1.07x at 88-104, 0.94x at 130).
HALF_ROWS_SHARE = 0.8


def choose_split(blocks: int, num_tiles: int, concurrent_blocks: int) -> tuple[int, int]:
    """``(num_splits, tiles_per_split)`` for ``blocks`` (query row, head tile) pairs over
    ``num_tiles`` tiles of selected tokens (both tables' widths) when ``concurrent_blocks`` blocks
    fit the GPU at once: the split with the fewest tile-times (waves x the tiles of a block, plus a
    block's fixed cost), plus the combine's, the smaller split on ties. Depends on shapes only, so
    runs are reproducible."""
    best = ((num_tiles + _BLOCK_COST) * -(-blocks // concurrent_blocks), 1, num_tiles)
    for splits in range(2, min(num_tiles, MAX_SPLITS) + 1):
        per_split = -(-num_tiles // splits)
        used = -(-num_tiles // per_split)  # splits that get tiles
        if used != splits:
            continue
        cost = -(-blocks * splits // concurrent_blocks) * (per_split + _BLOCK_COST) + _COMBINE_COST
        best = min(best, (cost, splits, per_split))
    return best[1], best[2]


def choose_dim_parts(parts: tuple[int, ...], items: int, max_blocks: int) -> int:
    """The parts of a row's 512 output dims, an item each, for ``items`` (query row, head tile,
    split) items: two where the backend has them (``parts``) and twice the items fill at most
    :data:`HALF_ROWS_SHARE` of its launch's ``max_blocks`` (1-4 query rows: there a block's output
    rows, not its tiles, take most of its time, and other SMs would idle), else whole rows."""
    return 2 if 2 in parts and 2 * items <= HALF_ROWS_SHARE * max_blocks else 1


def choose_split_and_parts(
    parts: tuple[int, ...], blocks: int, num_tiles: int, concurrent_blocks: int, max_blocks: int
) -> tuple[int, int, int]:
    """``(num_splits, tiles_per_split, dim_parts)``: :func:`choose_split`'s split, in half rows
    where :func:`choose_dim_parts` takes them. Splits of one tile too many for half rows become
    splits of two tiles in half rows where those fit (H200, 2-4 query rows: 1.07-1.09x at 128
    heads, 1.00-1.02x at 64)."""
    num_splits, tiles_per_split = choose_split(blocks, num_tiles, concurrent_blocks)
    dim_parts = choose_dim_parts(parts, blocks * num_splits, max_blocks)
    if tiles_per_split == 1 and dim_parts == 1:
        wider = -(-num_tiles // 2)
        if choose_dim_parts(parts, blocks * wider, max_blocks) == 2:
            return wider, 2, 2
    return num_splits, tiles_per_split, dim_parts
