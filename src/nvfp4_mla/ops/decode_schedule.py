"""The width split of ``sparse_mla_decode``: how a call's rows, all at the tables' widths, are cut
into (row, split) items, and the parts of a row's output dims. The planner
(:mod:`.decode_planner`) takes the dim parts from it for every call, and for a call without
length tensors deals its items into the work list's parts (``decode_scheduler.split_schedule``).
Pure functions of the shapes and the device's block counts (never of the data), so equal inputs
give equal bits on every run. The constants of the cost model were measured on the H200
(docs/performance.md#split-cost-model)."""

from __future__ import annotations

from .. import abi

MAX_SPLITS = abi.HEAD_DIM // 4  # the most splits of a row (within the combine's MAX_PARTIALS)
# The cost model of a plan, in tile-times of one block (a whole row's tile): what a block costs
# besides its tiles (its query load and its output rows), what the combine launch costs, and what
# a split's partial row costs (512 fp32 written by the attention and read by the combine).
_BLOCK_COST = 1
COMBINE_COST = 1
_PARTIAL_ROW_COST = 1.6e-4
# A tile of a row's half when the two halves run as a pair that shares each dequantized tile (see
# choose_split_and_parts): less than a whole row's tile, more than half of it.
_PAIRED_HALF_TILE_COST = 0.68
# The share of a launch's blocks that half rows may fill: past it, whole rows were as fast.
HALF_ROWS_SHARE = 0.8
# With length tensors, half rows where a whole-rows block would take at most this many tiles of
# the rows' full-width work: the list deals a call's live tiles into every part the GPU holds, so
# a few rows are cut into many short pieces, each writing a partial output; half rows halve the
# parts and each piece's partial bytes (docs/performance.md#decode-backend-rule).
LENGTHS_HALF_ROWS_TILES = 3
# Without length tensors, where the width split keeps whole rows and a whole-rows block would take
# at most this many tiles of the call's work: half rows dealt as a call with lengths is (fewer,
# longer parts than the width split's, at half the partial bytes a piece), where full rows broke
# even (docs/performance.md#split-cost-model).
DEALT_HALF_ROWS_TILES = 2.25
# ... unless the width split's whole rows already fill this share of the launch's blocks, two tiles
# a block or more (few rows over long selections): there half rows add tile work, no idle SM.
WIDTH_FILLS_SHARE = 0.95


def cheapest_split(
    items: int, num_tiles: int, concurrent_blocks: int, head_rows: int, tile_cost: float = 1
) -> tuple[float, int, int]:
    """``(cost, num_splits, tiles_per_split)`` for ``items`` blocks' worth of work (query row, head
    tile and part) of ``head_rows`` head rows in all over ``num_tiles`` tiles of selected tokens
    (both tables' widths) when ``concurrent_blocks`` blocks fit the GPU at once: the split with the
    fewest tile-times (waves x (the tiles of a block at ``tile_cost`` each, plus a block's fixed
    cost), plus the combine's and the partial rows'), the smaller split on ties. Depends on shapes
    only, so runs are reproducible."""
    best = (0.0, 0, 0)
    for splits in range(1, min(num_tiles, MAX_SPLITS) + 1):
        per_split = -(-num_tiles // splits)
        if -(-num_tiles // per_split) != splits:  # some split would get no tile
            continue
        cost = -(-items * splits // concurrent_blocks) * (per_split * tile_cost + _BLOCK_COST)
        if splits > 1:
            cost += COMBINE_COST + _PARTIAL_ROW_COST * head_rows * splits
        if splits == 1 or cost < best[0]:
            best = (cost, splits, per_split)
    return best


def choose_dim_parts(parts: tuple[int, ...], items: int, max_blocks: int) -> int:
    """The parts of a row's 512 output dims, an item each, for ``items`` (query row, head tile,
    split) items: two where the backend has them (``parts``) and twice the items fill at most
    :data:`HALF_ROWS_SHARE` of its launch's ``max_blocks`` (1-4 query rows: there a block's output
    rows, not its tiles, take most of its time, and other SMs would idle), else whole rows."""
    return 2 if 2 in parts and 2 * items <= HALF_ROWS_SHARE * max_blocks else 1


def _little_work(parts: tuple[int, ...], items: int, num_tiles: int, max_blocks: int, most_tiles: float) -> bool:
    """The backend has half rows (``parts``) and a block of whole rows would take at most
    ``most_tiles`` of the ``items`` (query row, head tile) times ``num_tiles`` tiles (the tables'
    widths), spread over ``max_blocks``."""
    return 2 in parts and items * num_tiles <= most_tiles * max_blocks


def deals_half_rows(
    parts: tuple[int, ...], items: int, num_tiles: int, max_blocks: int, num_splits: int, tiles_per_split: int
) -> bool:
    """Whether a call without length tensors, whose width split keeps whole rows (``num_splits``
    splits of ``tiles_per_split`` tiles an item), deals its rows as a call with lengths is dealt
    (every part the GPU holds), in half rows: where a whole-rows block would have
    :data:`DEALT_HALF_ROWS_TILES` tiles or fewer (``_little_work``), unless the split's blocks
    fill :data:`WIDTH_FILLS_SHARE` of ``max_blocks`` with two tiles or more each."""
    fills = items * num_splits >= WIDTH_FILLS_SHARE * max_blocks and tiles_per_split >= 2
    return not fills and _little_work(parts, items, num_tiles, max_blocks, DEALT_HALF_ROWS_TILES)


def lengths_dim_parts(parts: tuple[int, ...], items: int, num_tiles: int, max_blocks: int, width_dim_parts: int) -> int:
    """The dim parts of a call with length tensors whose width split takes ``width_dim_parts``:
    two where a whole-rows block would have :data:`LENGTHS_HALF_ROWS_TILES` tiles or fewer
    (``_little_work``), else the width split's."""
    return 2 if _little_work(parts, items, num_tiles, max_blocks, LENGTHS_HALF_ROWS_TILES) else width_dim_parts


def choose_split_and_parts(
    parts: tuple[int, ...],
    blocks: int,
    num_tiles: int,
    concurrent_blocks: int,
    max_blocks: int,
    head_rows: int,
    halves_pair: bool = False,
) -> tuple[int, int, int]:
    """``(num_splits, tiles_per_split, dim_parts)``: :func:`cheapest_split` of whole rows, in half rows
    where :func:`choose_dim_parts` takes them. Splits of one tile too many for half rows become
    splits of two tiles in half rows where those fit. Where the kernel runs a row's two halves as a
    pair that shares each dequantized tile (``halves_pair``), whole rows still give way to the
    pairs' cheapest split when the cost model says it is cheaper: fewer splits, so fewer partial
    rows and a combine over fewer (docs/performance.md#split-cost-model)."""
    whole_cost, num_splits, tiles_per_split = cheapest_split(blocks, num_tiles, concurrent_blocks, head_rows)
    dim_parts = choose_dim_parts(parts, blocks * num_splits, max_blocks)
    if tiles_per_split == 1 and dim_parts == 1:
        wider = -(-num_tiles // 2)
        if choose_dim_parts(parts, blocks * wider, max_blocks) == 2:
            return wider, 2, 2
    if halves_pair and 2 in parts and dim_parts == 1:
        pairs_cost, pair_splits, pair_tiles = cheapest_split(
            2 * blocks, num_tiles, concurrent_blocks, head_rows, _PAIRED_HALF_TILE_COST
        )
        if pairs_cost < whole_cost:
            return pair_splits, pair_tiles, 2
    return num_splits, tiles_per_split, dim_parts
