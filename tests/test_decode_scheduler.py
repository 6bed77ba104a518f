"""The decode scheduler: its CPU model holds the properties a work list promises, and on the GPU
the kernel writes the model's list bit for bit (also from a captured graph whose lengths change
between replays, and after a kernel that writes the lengths while the list is dealt), and nothing
past it."""

import random

import pytest
import torch

from nvfp4_mla import KernelLibrary
from nvfp4_mla.launch import current_raw_stream
from nvfp4_mla.ops import decode_scheduler as ds

TILE = 64


def check(tiles, parts, segment_cost, found, exact=True, whole_rows=False, combine_cost=0):
    """Every tile of every row in exactly one segment, in order; a row in one segment writes out,
    a split row's segments take its slots in tile order; no part's cost past the mean by more
    than one tile and one segment's cost (``exact``: the scheduler's payload rule), and
    ``combine_cost`` more where no row is cut; with ``whole_rows`` no row cut, and no part past
    the mean by more than one row's cost."""
    assert len(found.parts) == parts and len(found.split_rows) == parts
    walked: dict[int, list[ds.Segment]] = {}
    mean = sum(tiles) / parts + segment_cost * len(tiles) / parts
    for part in found.parts:
        share = 0
        for seg in ds.segments(part, tiles):
            walked.setdefault(seg.row, []).append(seg)
            share += seg.tile_end - seg.tile_begin + segment_cost
        if whole_rows:
            assert share <= mean + max(tiles) + segment_cost + 1
        elif exact:
            cut = any(row >= 0 for row, _ in found.split_rows)
            assert share <= mean + segment_cost + 1 + (0 if cut else combine_cost)
    if whole_rows:
        assert all(len(segs) == 1 for segs in walked.values())
    assert sorted(walked) == list(range(len(tiles)))
    split = [(row, segs[0].slot) for row, segs in sorted(walked.items()) if len(segs) > 1]
    slots = 0
    for row, segs in walked.items():
        assert [s.tile_begin for s in segs] == [0] + [s.tile_end for s in segs[:-1]]
        assert segs[-1].tile_end == tiles[row]
        if len(segs) == 1:
            assert segs[0].slot == -1
        else:
            assert [s.slot for s in segs] == list(range(segs[0].slot, segs[0].slot + len(segs)))
            slots += len(segs)
    assert slots <= ds.max_slots(parts)
    assert list(found.split_rows) == split + [(-1, slots)] * (parts - len(split))
    assert [row for row, first in split] == sorted(row for row, _ in split)
    assert [first for _, first in split] == sorted(first for _, first in split)
    if split:
        assert split[0][1] == 0


def distributions(rng, rows, k):
    yield "zeros", [0] * rows
    yield "full", [k] * rows
    yield "one long", [k if r == rows // 2 else 1 for r in range(rows)]
    yield "short", [rng.randrange(0, 65) for _ in range(rows)]
    yield "uniform", [rng.randrange(0, k + 1) for _ in range(rows)]
    yield "one in eight long", [k if r % 8 == 0 else 128 for r in range(rows)]


@pytest.mark.parametrize("rows", [1, 2, 3, 31, 256, 1000, 16384])
def test_model_partitions_and_balances(rows, seed):
    rng = random.Random(seed)
    for parts in (1, 2, 7, 66, 132, ds.MAX_PARTS):
        for segment_cost in (0, 1, 4):
            for name, lens in distributions(rng, rows, 2048):
                tiles = [ds.live_tiles(n, 0, TILE) for n in lens]
                for combine_cost, whole_rows in ((0, False), (3, False), (0, True)):
                    found = ds.schedule(tiles, parts, segment_cost, combine_cost, whole_rows)
                    check(tiles, parts, segment_cost, found, whole_rows=whole_rows, combine_cost=combine_cost)
                    assert ds.schedule(tiles, parts, segment_cost, combine_cost, whole_rows) == found, name


def test_schedule_fields_follow_the_layout():
    """The launch passes a ScheduleFields as the SCHEDULE block: the same names in the same order."""
    assert ds.ScheduleFields._fields == tuple(field.name for field in ds.SCHEDULE.fields)
    assert ds.schedule_fields(66, 64, 1, 2, True) == ds.ScheduleFields(66, 6, 1, 2, 1)


def test_cut_bounds_by_hand():
    # Costs 4, 4, 4 (3 tiles and a segment each) in two parts of 6: boundary 1 at cost 6, inside
    # row 1 (costs 4..8) at its tile 1; moved back to row 1's start, the second part costs 8.
    found = ds.cut_bounds([3, 3, 3], 2, 1)
    assert found == ds.CutBounds([(0, 0, 0), (1, 1, 4), (3, 0, 12)], 6, 8)
    assert ds.schedule([3, 3, 3], 2, 1, 0).split_rows[0] == (1, 0)  # 8 > 6 + 1 + 0: cut
    assert ds.schedule([3, 3, 3], 2, 1, 1).split_rows[0] == (-1, 0)  # 8 <= 6 + 1 + 1: whole


def test_model_by_hand():
    # Costs 4, 1, 1 in two parts of 3: row 0 is cut at its tile 3.
    found = ds.schedule([4, 1, 1], 2, 0, 0)
    assert found.parts == (ds.WorkPart(0, 0, 0, 3, 0, -1), ds.WorkPart(0, 3, 3, 0, 1, -1))
    assert found.split_rows == ((0, 0), (-1, 2))
    # With a segment cost of 2: costs 6, 3, 3 in two parts of 6: no row is cut.
    found = ds.schedule([4, 1, 1], 2, 2, 0)
    assert found.parts == (ds.WorkPart(0, 0, 1, 0, -1, -1), ds.WorkPart(1, 0, 3, 0, -1, -1))
    assert found.split_rows == ((-1, 0), (-1, 0))
    # Costs 1, 5 in three parts of 2: row 1 cut at tiles 1 and 3; the first part ends inside it.
    # Whole rows would make a part of 5, past the payload and a combine's cost of 2.
    found = ds.schedule([1, 5], 3, 0, 2)
    assert found.parts == (
        ds.WorkPart(0, 0, 1, 1, -1, 0),
        ds.WorkPart(1, 1, 1, 3, 1, -1),
        ds.WorkPart(1, 3, 2, 0, 2, -1),
    )
    assert found.split_rows == ((1, 0), (-1, 3), (-1, 3))
    # The same with whole rows: the boundaries inside row 1 move back to its start. A combine's
    # cost of 3 keeps them whole too: that part of 5 is then within the payload and the combine.
    whole = (ds.WorkPart(0, 0, 1, 0, -1, -1), ds.WorkPart(1, 0, 1, 0, -1, -1), ds.WorkPart(1, 0, 2, 0, -1, -1))
    for found in (ds.schedule([1, 5], 3, 0, 0, whole_rows=True), ds.schedule([1, 5], 3, 0, 3)):
        assert found.parts == whole
        assert found.split_rows == ((-1, 0), (-1, 0), (-1, 0))
    # Four rows of 10 tiles and a segment cost of 1 in five parts of 9: cut, each part's cost at
    # most 10. Whole, a row a part (and one empty) costs 11: within the payload, a segment and a
    # combine's cost of 1, so the rows stay whole, and the combine has nothing to merge.
    assert ds.schedule([10] * 4, 5, 1, 0).split_rows[0] == (0, 0)
    found = ds.schedule([10] * 4, 5, 1, 1)
    assert [(p.begin_row, p.begin_tile, p.end_row, p.end_tile) for p in found.parts] == [
        (0, 0, 0, 0),
        (0, 0, 1, 0),
        (1, 0, 2, 0),
        (2, 0, 3, 0),
        (3, 0, 4, 0),
    ]
    assert found.split_rows == ((-1, 0),) * 5


@pytest.mark.parametrize("rows", [1, 2, 3, 7, 64, 130])
def test_the_hosts_width_split_list(rows):
    """A call without lengths: the width split's (row, split) items dealt into parts whose item
    counts differ by at most one. Every tile of every row in one segment, in order, slots as the
    scheduler's lists have them; each part's items whole splits."""
    for tiles in (1, 10, 18, 130):
        for splits in {1, 2, min(tiles, 5), tiles}:
            per_split = -(-tiles // splits)
            splits = -(-tiles // per_split)  # as decode_schedule deals them: no empty split
            for parts in {1, 2, rows, rows * splits, max(rows * splits - 1, 1), min(rows * splits, 132)}:
                found = ds.split_schedule(rows, splits, per_split, parts)
                check([tiles] * rows, parts, 0, found, exact=False)
                sizes = []
                for part in found.parts:
                    items = 0
                    for seg in ds.segments(part, [tiles] * rows):
                        assert seg.tile_begin % per_split == 0
                        assert seg.tile_end == tiles or seg.tile_end % per_split == 0
                        items += -(-(seg.tile_end - seg.tile_begin) // per_split)
                    sizes.append(items)
                assert sum(sizes) == rows * splits and max(sizes) - min(sizes) <= 1, (rows, tiles, splits, parts)


def test_row_tiles_clamp_lengths():
    lens = torch.tensor([-5, 0, 1, 64, 65, 10**6])
    assert ds.row_tiles(6, 100, lens, 0, None, 64) == [1, 1, 1, 1, 2, 2]
    assert ds.row_tiles(2, 100, None, 30, torch.tensor([[29], [31]]), 64) == [3, 3]
    assert ds.row_tiles(3, 0, None, 0, None, 32) == [1, 1, 1]


# ---------------------------------------------------------------- on the GPU


def _lens(rng, rows, k, dtype):
    if k == 0 or rng.random() < 0.2:
        return None
    n = [rng.choice([-3, 0, 1, k, k + 7, rng.randrange(0, k + 1)]) for _ in range(rows)]
    return torch.tensor(n, dtype=dtype, device="cuda")


def _run(lib, threads, rows, parts, swa_k, swa_lens, extra_k, extra_lens, tile, cost, combine, whole_rows, canary=-7):
    work = torch.full((ds.work_ints(parts) + 64,), canary, dtype=torch.int32, device="cuda")
    launcher = lib.launcher(torch.cuda.current_device(), lib.spec(ds.SchedulerSpec(threads)))
    stream = current_raw_stream(torch.cuda.current_device())
    schedule = ds.schedule_fields(parts, tile, cost, combine, whole_rows)
    ds.launch(launcher, stream, work.data_ptr(), rows, swa_k, swa_lens, extra_k, extra_lens, schedule)
    return work


@pytest.mark.gpu
@pytest.mark.parametrize("rows", [1, 5, 256, 1031, 16384])
def test_device_list_is_the_model(rows, seed):
    """Every build that holds the parts, whatever the rows (past ROW_LOADS rows a thread a build
    loads its rows' lengths in turn)."""
    rng = random.Random(seed)
    lib = KernelLibrary()
    for parts in (1, 2, 66, 132, ds.MAX_PARTS):
        for tile, cost, combine, whole_rows in (
            (64, 0, 0, False),
            (64, 4, 1, False),
            (64, 1, 1, False),
            (32, 3, 5, False),
            (32, 1, 0, True),
        ):
            swa_k = rng.choice([1, 128, 640])
            extra_k = rng.choice([0, 512, 2048])
            swa_lens = _lens(rng, rows, swa_k, rng.choice([torch.int32, torch.int64]))
            extra_lens = _lens(rng, rows, extra_k, rng.choice([torch.int32, torch.int64]))
            tiles = ds.row_tiles(rows, swa_k, swa_lens, extra_k, extra_lens, tile)
            want = ds.schedule(tiles, parts, cost, combine, whole_rows).ints()
            for threads in (t for t in ds.BUILD_THREADS if parts < t):
                args = (rows, parts, swa_k, swa_lens, extra_k, extra_lens, tile, cost, combine, whole_rows)
                got = _run(lib, threads, *args).tolist()
                assert got[: len(want)] == want, (threads, parts, tile, cost, combine, whole_rows)
                assert got[len(want) :] == [-7] * 64  # nothing written past the list


@pytest.mark.gpu
@pytest.mark.parametrize("rows", [1, 3, 16384])
def test_device_list_past_32_bits(rows, seed):
    """Tables of 2^24 entries: the costs' sum passes 2^32 at 16,384 full rows, and the kernel's
    divisions leave their 32-bit path."""
    rng = random.Random(seed)
    lib, k = KernelLibrary(), 1 << 24
    for parts in (1, 7, 132, ds.MAX_PARTS):
        full = rng.random() < 0.5
        lens = None if full else torch.tensor([rng.randrange(k - 4096, k + 1) for _ in range(rows)], device="cuda")
        tiles = ds.row_tiles(rows, k, lens, k, None, 32)
        want = ds.schedule(tiles, parts, 1, 1).ints()
        for threads in (t for t in ds.BUILD_THREADS if parts < t):
            got = _run(lib, threads, rows, parts, k, lens, k, None, 32, 1, 1, False).tolist()
            assert got[: len(want)] == want, (threads, parts, full)


@pytest.mark.gpu
def test_graph_replays_follow_changed_lengths(seed):
    """Captured once, with the lengths copied in by the graph's previous kernel: each replay's list
    is the model's of that replay's lengths."""
    rng = random.Random(seed)
    lib = KernelLibrary()
    rows, parts, k = 300, 132, 2048
    source = torch.zeros(rows, dtype=torch.int32, device="cuda")
    lens = torch.zeros_like(source)
    work = torch.zeros(ds.work_ints(parts), dtype=torch.int32, device="cuda")
    launcher = lib.launcher(torch.cuda.current_device(), lib.spec(ds.spec_for(rows, parts)))
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        lens.copy_(source)
        stream = current_raw_stream(torch.cuda.current_device())
        schedule = ds.schedule_fields(parts, 64, 4, 1, False)
        ds.launch(launcher, stream, work.data_ptr(), rows, 128, None, k, lens, schedule)
    for _ in range(4):
        values = [rng.choice([0, 1, 100, k, rng.randrange(k + 1)]) for _ in range(rows)]
        source.copy_(torch.tensor(values, dtype=torch.int32))
        graph.replay()
        tiles = [ds.live_tiles(128, v, 64) for v in values]
        assert work.tolist() == ds.schedule(tiles, parts, 4, 1).ints()


LATE_COPY = r"""
extern "C" __global__ void late_copy(const int* source, int* target, int words, unsigned long long delay_ns) {
#if __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.launch_dependents;");
#endif
    unsigned long long start, now;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(start));
    do asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now)); while (now - start < delay_ns);
    for (int i = threadIdx.x; i < words; i += blockDim.x) target[i] = source[i];
}
"""


def late_copy(target: torch.Tensor, source: torch.Tensor, delay_us: int = 200) -> None:
    """``target.copy_(source)`` on the current stream by a kernel that first lets the stream's next
    kernel launch (programmatic dependent launch, from sm_90), then waits ``delay_us``: that
    kernel's blocks start while ``target`` holds its old values, and its wait ends after the copy."""
    import cupy
    import numpy

    assert target.dtype == source.dtype and target.shape == source.shape and target.is_contiguous()
    major, minor = torch.cuda.get_device_capability()
    arch = f"--gpu-architecture=sm_{major}{minor}"
    kernel = cupy.RawKernel(LATE_COPY, "late_copy", options=(arch,), backend="nvrtc")
    words = numpy.int32(target.numel() * target.element_size() // 4)
    with cupy.cuda.ExternalStream(torch.cuda.current_stream().cuda_stream):
        args = (cupy.from_dlpack(source.contiguous()), cupy.from_dlpack(target), words, numpy.uint64(delay_us * 1000))
        kernel((1,), (128,), args)


@pytest.mark.gpu
@pytest.mark.parametrize("rows", [300, 16384])
def test_lengths_written_late_by_the_kernel_before(seed, rows):
    """The kernel before the scheduler lets it launch, then writes new lengths: the list is the
    model's of the new lengths. At 300 rows (costs kept in shared memory) the block has dealt from
    the old ones before its dependent-launch wait, and deals again; at 16,384 it deals after it."""
    rng = random.Random(seed)
    lib = KernelLibrary()
    parts, k = 132, 2048
    launcher = lib.launcher(torch.cuda.current_device(), lib.spec(ds.spec_for(rows, parts)))
    stream = current_raw_stream(torch.cuda.current_device())
    schedule = ds.schedule_fields(parts, 64, 4, 1, False)
    lens = torch.zeros(rows, dtype=torch.int32, device="cuda")
    work = torch.zeros(ds.work_ints(parts), dtype=torch.int32, device="cuda")
    for _ in range(3):
        values = [rng.choice([0, 1, 100, k, rng.randrange(k + 1)]) for _ in range(rows)]
        new = torch.tensor(values, dtype=torch.int32, device="cuda")
        lens.zero_()
        late_copy(lens, new)  # the scheduler's launch comes next on the stream
        ds.launch(launcher, stream, work.data_ptr(), rows, 128, None, k, lens, schedule)
        tiles = [ds.live_tiles(128, v, 64) for v in values]
        assert work.tolist() == ds.schedule(tiles, parts, 4, 1).ints()


def test_a_call_takes_the_smallest_build_that_holds_it():
    """A thread a part boundary and at most ROW_LOADS rows a thread: the fewest threads that hold
    both; past every build, the largest (which holds any parts the planner makes)."""
    spec_for, loads = ds.spec_for, ds.ROW_LOADS
    small, large = ds.BUILD_THREADS
    assert ds.specs() == (ds.SchedulerSpec(small), ds.SchedulerSpec(large))
    assert spec_for(1, 1).threads == spec_for(loads * small, small - 1).threads == small
    assert spec_for(loads * small + 1, 132).threads == spec_for(1, small).threads == large
    assert spec_for(16_384, ds.MAX_PARTS).threads == large
    assert all(s.defines() == {"ROW_LOADS": loads} for s in ds.specs())
