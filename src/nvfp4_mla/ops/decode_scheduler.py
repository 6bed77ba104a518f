"""The decode scheduler: ``kernels/nvfp4_mla_scheduler.cu`` writes the work list of a
``sparse_mla_decode`` call on the GPU from the rows' live lengths, with no host synchronisation,
so it follows lengths that change between replays of a captured graph. :func:`schedule` is its CPU
model: the same integer arithmetic in plain Python, which the tests hold the device's list
against (docs/kernels/scheduler.md).

**The work.** A query row's live entries (its sliding-window table's first ``swa_live``, then its
extra table's first ``extra_live``) are cut into tiles of the attention kernel's tile size; a row
with no live entry has one (dead) tile, whose outputs are the empty row's. A row costs its tiles
plus ``segment_cost`` tile-times (what a block spends on a segment besides its tiles: its query
load and output rows). The rows' costs, row after row, are dealt into ``parts`` parts of
``ceil(total / parts)`` each; a part's blocks walk its segments (its tiles of one row) in order.
A row whose tiles fall in one part is a segment that writes the row's ``out`` and ``lse``; a row
cut between parts writes a partial output a segment, at slots the combine merges in tile order.
Where moving every boundary back to its row's start costs no part more than the cut list's bound
and the combine's cost, the list keeps rows whole (all rows of equal length and about one a part:
no partials, and the combine has nothing to merge).

**The list** (``work_ints(parts)`` int32 values): ``parts`` :class:`WorkPart` records of
:data:`PART_INTS`, then ``parts`` split rows ``(row, first_slot)``: the rows cut between parts in
row order, then ``(-1, slots)``. A part boundary cuts at most one row, so a call has at most
``parts - 1`` split rows and ``2 (parts - 1)`` slots (:func:`max_slots`).
"""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Iterator, Sequence
from itertools import accumulate, pairwise
from typing import TYPE_CHECKING, NamedTuple

import torch

from ..jit import Template, included_headers
from ..params import ParamsLayout, int64, nested, pointer

if TYPE_CHECKING:
    from ..launch import Launcher

SOURCE = "nvfp4_mla_scheduler.cu"
# The builds' threads: a thread a part boundary, and up to ROW_LOADS rows a thread, whose lengths it
# loads at once (more: in turn). Fewer threads, fewer warps through the block's barriers; a call
# takes the fewest that hold its parts and rows.
BUILD_THREADS = (256, 1024)
ROW_LOADS = 4
# The -D constants of every kernel that schedules (kernels/nvfp4_mla_schedule.cuh).
SCHEDULE_DEFINES = {"ROW_LOADS": ROW_LOADS}
MAX_PARTS = BUILD_THREADS[-1] - 1
PART_INTS = 8  # a WorkPart: begin_row, begin_tile, end_row, end_tile, begin_slot, end_slot, two zeros
SPLIT_INTS = 2  # a split row: row, first_slot

# How a list is dealt: the fields the scheduler and an attention kernel that schedules its own
# call's list share (kernels/nvfp4_mla_schedule.cuh).
SCHEDULE = ParamsLayout(
    "Schedule",
    [
        int64("parts", "parts of the work: 1 to 1023, fewer than the block's threads"),
        int64("tile_shift", "log2 of the attention kernel's tile tokens"),
        int64("segment_cost", "a segment's cost besides its tiles, in tiles"),
        int64("combine_cost", "the combine's cost, in tiles: rows are kept whole where that costs no more"),
        int64("whole_rows", "1: every boundary at a row's start, so no row is cut (batch-invariant rows)"),
    ],
)

SCHEDULER_PARAMS = ParamsLayout(
    "Params",
    [
        pointer("swa_lens", "const void*", "[rows] int32 or int64, or null (every entry is live)"),
        pointer("extra_lens", "const void*", "[rows] int32 or int64, or null"),
        int64("swa_lens_int64", "swa_lens are int64 (else int32)"),
        int64("extra_lens_int64", "extra_lens are int64 (else int32)"),
        int64("swa_k", "entries a row of the sliding-window table"),
        int64("extra_k", "entries a row of the extra table; 0: no such pool"),
        int64("rows", "query rows: batch * q_len, at least 1"),
        nested("schedule", SCHEDULE, "how the list is dealt"),
        pointer("parts_out", "struct WorkPart*", "[parts]"),
        pointer("split_rows", "struct SplitRow*", "[parts]"),
    ],
)


class SchedulerSpec(NamedTuple):
    """A build of the scheduler: its block's threads."""

    threads: int

    @property
    def template(self) -> Template:
        return Template(
            SOURCE,
            "nvfp4_mla_decode_scheduler",
            SCHEDULER_PARAMS,
            self.threads,
            0,
            included_headers(SOURCE),
            dependent_launch=True,
        )

    def defines(self) -> dict[str, int]:
        return SCHEDULE_DEFINES

    def describe(self) -> str:
        return f"decode scheduler, {self.threads} threads"


def specs() -> tuple[SchedulerSpec, ...]:
    return tuple(SchedulerSpec(threads) for threads in BUILD_THREADS)


def spec_for(rows: int, parts: int) -> SchedulerSpec:
    """The build of the fewest threads with a thread a boundary (``parts + 1``) and every row's
    lengths in one load a thread; past them all, the largest (its threads load in turn)."""
    for threads in BUILD_THREADS:
        if parts < threads and rows <= ROW_LOADS * threads:
            return SchedulerSpec(threads)
    return SchedulerSpec(BUILD_THREADS[-1])


def work_ints(parts: int) -> int:
    """int32 values of the work list of ``parts`` parts."""
    return parts * (PART_INTS + SPLIT_INTS)


def max_slots(parts: int) -> int:
    """The most partial slots a call of ``parts`` parts writes: every boundary cuts a row in two."""
    return 2 * (parts - 1)


# ---------------------------------------------------------------- the CPU model


class WorkPart(NamedTuple):
    """A part of the work (``struct WorkPart``): the tiles from ``(begin_row, begin_tile)`` up to,
    not including, ``(end_row, end_tile)``. ``begin_slot``: the slot of its first segment (-1: a
    whole row); ``end_slot``: that of its last one, where that begins a later row than
    ``begin_row`` and ends inside it (``end_tile > 0``), else -1."""

    begin_row: int
    begin_tile: int
    end_row: int
    end_tile: int
    begin_slot: int
    end_slot: int


class Schedule(NamedTuple):
    """A work list: its parts, and its split rows ``(row, first_slot)`` padded to one a part."""

    parts: tuple[WorkPart, ...]
    split_rows: tuple[tuple[int, int], ...]

    def ints(self) -> list[int]:
        """The list's int32 values as the scheduler writes them."""
        values = [v for part in self.parts for v in (*part, 0, 0)]
        return values + [v for split in self.split_rows for v in split]


class Segment(NamedTuple):
    """A part's tiles of one row: ``[tile_begin, tile_end)``, writing out at ``slot`` (-1: the
    row's ``out`` and ``lse``)."""

    row: int
    tile_begin: int
    tile_end: int
    slot: int


def live_tiles(swa_live: int, extra_live: int, tile_tokens: int) -> int:
    """A row's tiles: its live entries in tiles of ``tile_tokens``, at least one."""
    return max(-(-(swa_live + extra_live) // tile_tokens), 1)


def row_tiles(
    rows: int,
    swa_k: int,
    swa_lens: torch.Tensor | None,
    extra_k: int,
    extra_lens: torch.Tensor | None,
    tile_tokens: int,
) -> list[int]:
    """Every row's tiles, from the tables' widths and the lengths (any device; read to the host)."""

    def live(k: int, lens: torch.Tensor | None) -> list[int]:
        if lens is None or k == 0:
            return [k] * rows
        return lens.reshape(-1).to("cpu", torch.int64).clamp(0, k).tolist()

    return [live_tiles(s, e, tile_tokens) for s, e in zip(live(swa_k, swa_lens), live(extra_k, extra_lens))]


class CutBounds(NamedTuple):
    """The boundaries of a cut list (each ``(row, tile, the row's first cost)``, the last ``(rows,
    0, total)``), its ``payload`` (a part's costs) and the costliest part that moving every boundary
    back to its row's start makes (``longest``)."""

    bounds: list[tuple[int, int, int]]
    payload: int
    longest: int


def cut_bounds(tiles: Sequence[int], parts: int, segment_cost: int) -> CutBounds:
    """The :class:`CutBounds` of rows of ``tiles`` tiles each in ``parts`` parts, a segment costing
    ``segment_cost`` tiles besides its own."""
    rows = len(tiles)
    starts = list(accumulate((t + segment_cost for t in tiles), initial=0))  # row r's costs: [starts[r], starts[r + 1])
    total = starts[-1]
    payload = -(-total // parts)
    # Boundary q begins part q: at cost q * payload, in the row whose costs hold it (its tile
    # counted after the row's segment cost), or at the end, (rows, 0); with its row's first cost.
    bounds = []
    for q in range(parts + 1):
        at = q * payload
        if at >= total:
            bounds.append((rows, 0, total))
        else:
            row = bisect_right(starts, at) - 1
            bounds.append((row, max(at - starts[row] - segment_cost, 0), starts[row]))
    longest = max(after[2] - before[2] for before, after in pairwise(bounds))
    return CutBounds(bounds, payload, longest)


def schedule(
    tiles: Sequence[int], parts: int, segment_cost: int, combine_cost: int, whole_rows: bool = False
) -> Schedule:
    """The work list of rows of ``tiles`` tiles each (at least one) in ``parts`` parts, a segment
    costing ``segment_cost`` tiles besides its own, as the scheduler kernel writes it. Rows are
    kept whole (each boundary moved back to the start of its row, so no row is cut) where the
    costliest part that makes costs at most the payload, a segment and ``combine_cost`` (what the
    combine of cut rows costs), and always with ``whole_rows``."""
    bounds, payload, longest = cut_bounds(tiles, parts, segment_cost)
    whole = whole_rows or longest <= payload + segment_cost + combine_cost
    return list_of_bounds([(row, 0 if whole else tile) for row, tile, _ in bounds])


def split_schedule(rows: int, num_splits: int, tiles_per_split: int, parts: int) -> Schedule:
    """The work list of ``rows`` rows cut into ``num_splits`` splits of ``tiles_per_split`` tiles
    (the last one shorter), the (row, split) items dealt in order into ``parts`` parts whose item
    counts differ by at most one: the list of a call whose rows all have the same tiles, on the
    width split of :mod:`.decode_schedule`."""
    items = rows * num_splits
    bounds = []
    for q in range(parts + 1):
        item = q * items // parts
        bounds.append((rows, 0) if item == items else (item // num_splits, item % num_splits * tiles_per_split))
    return list_of_bounds(bounds)


def list_of_bounds(bounds: Sequence[tuple[int, int]]) -> Schedule:
    """The work list whose part q runs from boundary ``bounds[q]`` to ``bounds[q + 1]``, each a
    ``(row, tile)`` in order, the last ``(rows, 0)``: its cut rows and their slots."""
    parts = len(bounds) - 1
    # A cut: a boundary inside a row at a tile no earlier boundary took. Split row s, whose first
    # cut is cut j (both counted from 0), has the slots j + s on, one a segment.
    cuts = split = 0
    counts = []  # (cuts, split rows) up to each boundary
    split_rows = []
    for q, (row, tile) in enumerate(bounds):
        if q > 0 and tile > 0 and bounds[q - 1] != (row, tile):
            cuts += 1
            before_row, before_tile = bounds[q - 1]
            if not (before_row == row and before_tile > 0):
                split += 1
                split_rows.append((row, cuts + split - 2))
        counts.append((cuts, split))
    split_rows += [(-1, cuts + split)] * (parts - len(split_rows))
    found = []
    for q in range(parts):
        (row, tile), (next_row, next_tile) = bounds[q], bounds[q + 1]
        if tile > 0:  # past a cut: the slot after that cut's
            begin_slot = sum(counts[q]) - 1
        elif next_row == row and next_tile > 0:  # the first slot of the row whose first cut ends the part
            begin_slot = sum(counts[q])
        else:
            begin_slot = -1
        end_slot = sum(counts[q + 1]) - 2 if next_row > row and next_tile > 0 else -1
        found.append(WorkPart(row, tile, next_row, next_tile, begin_slot, end_slot))
    return Schedule(tuple(found), tuple(split_rows))


def segments(part: WorkPart, tiles: Sequence[int]) -> Iterator[Segment]:
    """A part's segments in the order its blocks walk them (rows of ``tiles`` tiles)."""
    last = part.end_row if part.end_tile > 0 else part.end_row - 1
    for row in range(part.begin_row, last + 1):
        begin = part.begin_tile if row == part.begin_row else 0
        end = part.end_tile if row == part.end_row else tiles[row]
        slot = part.begin_slot if row == part.begin_row else part.end_slot if row == part.end_row else -1
        if end > begin:
            yield Segment(row, begin, end, slot)


# ---------------------------------------------------------------- the launch


class ScheduleFields(NamedTuple):
    """The values of a :data:`SCHEDULE` block, named and ordered as its fields."""

    parts: int
    tile_shift: int
    segment_cost: int
    combine_cost: int
    whole_rows: int

    @property
    def costs(self) -> tuple[int, int]:
        """``(segment_cost, combine_cost)``, as :func:`schedule` takes them."""
        return self.segment_cost, self.combine_cost


def schedule_fields(
    parts: int, tile_tokens: int, segment_cost: int, combine_cost: int, whole_rows: bool
) -> ScheduleFields:
    """The :data:`SCHEDULE` block of a list of ``parts`` parts in tiles of ``tile_tokens`` entries."""
    return ScheduleFields(parts, tile_tokens.bit_length() - 1, segment_cost, combine_cost, int(whole_rows))


def launch(
    launcher: Launcher,
    stream: int,
    work: int,
    rows: int,
    swa_k: int,
    swa_lens: torch.Tensor | None,
    extra_k: int,
    extra_lens: torch.Tensor | None,
    schedule: ScheduleFields,
) -> None:
    """Writes the work list of ``rows`` rows at ``work`` (the address of :func:`work_ints` int32
    values) on ``stream``, as :func:`schedule` makes it; the lengths are contiguous ``[rows]`` int32
    or int64 on the GPU, or None; ``schedule``: :func:`schedule_fields`."""
    parts = schedule.parts
    launcher.launch(
        1,
        1,
        1,
        0,
        stream,
        0 if swa_lens is None else swa_lens.data_ptr(),
        0 if extra_lens is None else extra_lens.data_ptr(),
        int(swa_lens is not None and swa_lens.dtype is torch.int64),
        int(extra_lens is not None and extra_lens.dtype is torch.int64),
        swa_k,
        extra_k,
        rows,
        *schedule,
        work,
        work + parts * PART_INTS * 4,
    )
