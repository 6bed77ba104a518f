"""The fused decode without a GPU: its backends and the selection rule on fake GPUs, the
shared-memory and split plans, the CPU path (= the reference), validation of ``out``, and the
custom op's fake implementation and tracing. Its kernels compile in tests/test_ops_compile.py."""

import ctypes
import fractions
import random
from typing import Any, NamedTuple

import pytest
import torch

import nvfp4_mla
from nvfp4_mla import abi, jit, launch, reference
from nvfp4_mla.device import Device
from nvfp4_mla.ops import (
    decode,
    decode_backend,
    decode_combine,
    decode_mma,
    decode_planner,
    decode_schedule,
    decode_scheduler,
    decode_sm90,
)
from nvfp4_mla.testing import make_cache

BF16 = torch.bfloat16
SM_SCALE = abi.HEAD_DIM**-0.5
SMALLEST_SHARED_OPTIN = 101_376  # bytes a block may opt in to on sm_86/89/120 (99 KiB); more on sm_80/90/100
SM80_SHARED_OPTIN = 166_912


# ---------------------------------------------------------------- backends and plans


def test_specs_and_names():
    specs = decode.specs("sm_80")
    assert {s.head_tile for s in specs if isinstance(s, decode_mma.MmaAttentionSpec)} == set(decode_mma.HEAD_TILES)
    combines = decode_combine.specs()
    assert combines == decode_combine.BUILDS
    schedulers = decode_scheduler.specs()
    assert schedulers == tuple(decode_scheduler.SchedulerSpec(t) for t in decode_scheduler.BUILD_THREADS)
    assert specs[-6:] == combines + schedulers
    assert len(set(specs)) == len(specs) == len(decode_mma.HEAD_TILES) + 6
    forms = [(c.defines()["WARPS_A_HEAD"], c.defines()["PREFETCH"]) for c in combines]
    assert forms == [(4, 16), (4, 4), (1, 4), (1, 1)]
    assert [c.blocks(3, 65) for c in combines] == [3 * 65, 3 * 65, 3 * 17, 3 * 17]  # a head a block, four
    # Alone and in pairs, each with whole output rows and with half rows; and the NARROW build.
    hopper = {decode_sm90.WgmmaAttentionSpec.of(c, parts) for c in (1, 2) for parts in (1, 2)}
    narrow = decode_sm90.WgmmaAttentionSpec.of(1, 1, 16)
    assert set(decode.specs("sm_90")) == {*specs, *hopper, narrow} and len(hopper) == 4  # the Hopper kernels too
    assert decode_sm90.narrow_specs("sm_90") == (narrow,) and narrow not in hopper
    assert {s.template.arch for s in (*hopper, narrow)} == {"sm_90a"}
    assert {(s.defines()["CLUSTER"], s.defines()["DIM_PARTS"]) for s in hopper} == {(1, 1), (1, 2), (2, 1), (2, 2)}
    assert {s.defines()["HEAD_TILE"] for s in hopper} == {64} and narrow.defines()["HEAD_TILE"] == 16
    assert decode_sm90.WgmmaAttentionSpec.of(2, 2).describe().endswith("clusters of two blocks, half rows")
    assert narrow.describe() == "decode attention (wgmma, sm_90a), 16 heads a block (wgmma's N)"
    assert decode_mma.MmaAttentionSpec.of(32) is decode_mma.MmaAttentionSpec.of(32)  # memoized: the plans' keys
    assert decode_mma.MmaAttentionSpec.of(32).describe() == "decode attention (mma.sync), 32 heads a block"
    assert {c.template.function for c in combines} == {"nvfp4_mla_decode_combine"}
    with pytest.raises(ValueError, match="head_tile must be one of"):
        decode_mma.MmaAttentionSpec.of(8)
    for spec in specs:
        assert spec.template.params.size <= launch.PARAMS_CAPACITY
    assert decode_mma.MmaAttentionSpec.of(16).template.threads == decode_mma.attend_threads(16)


FAKE_GPUS = {  # capability -> a Device as the planners see it (SMs, shared-memory opt-in)
    80: Device(0, 80, 108, SM80_SHARED_OPTIN),
    90: Device(0, 90, 132, 232_448),
    120: Device(0, 120, 84, SMALLEST_SHARED_OPTIN),
}


@pytest.mark.parametrize("capability", FAKE_GPUS)
@pytest.mark.parametrize("heads", [1, 8, 9, 16, 17, 32, 48, 49, 64, 128])
@pytest.mark.parametrize("rows", [1, 2, 3, 6, 7, 32, 256])
@pytest.mark.parametrize("tokens", [1, 640, 1152, 4032, 4033, 4096, 8320])
def test_selection_rule(capability, heads, rows, tokens):
    """By architecture, then shape, by the call's tiles of 64 selected tokens (rows x a row's
    tiles: 64 from 7 rows of 640 tokens or 1 row of 4,033). On sm_90 up to 16 heads: the wgmma
    kernel's NARROW build from 64 tiles, else the mma.sync kernel; from 17 heads its 64-head build,
    but up to 48 heads the NARROW build under 64 tiles. Everywhere else the mma.sync kernel; only
    backends that support the GPU are compiled for it."""
    gpu = FAKE_GPUS[capability]
    hopper = capability == 90
    many = rows * -(-tokens // 64) >= 64
    if not hopper:
        want = "mma_sync"
    elif heads <= 16:
        want = "wgmma_sm90_narrow" if many else "mma_sync"
    elif heads <= 48 and not many:
        want = "wgmma_sm90_narrow"
    else:
        want = "wgmma_sm90"
    assert decode.select_backend(gpu, heads, rows, tokens).name == want
    for name in ("wgmma_sm90", "wgmma_sm90_narrow"):
        assert decode.BACKENDS[name].supports(gpu.capability) == hopper
    for spec in decode.specs(gpu.arch):
        assert jit.target_arch(spec, gpu.arch).startswith(gpu.arch)


def test_a_forced_backend_must_exist_and_support_the_gpu(monkeypatch):
    library = nvfp4_mla.KernelLibrary(decode_backend="no_such_backend")
    with pytest.raises(ValueError, match="decode backend 'no_such_backend' is not one of"):
        decode.plan(library, 0, 16, 1, 32, 0)
    monkeypatch.setattr(decode_planner, "device_info", lambda index: FAKE_GPUS[80])
    with pytest.raises(ValueError, match="decode backend 'wgmma_sm90' does not run on sm_80"):
        decode.plan(nvfp4_mla.KernelLibrary(decode_backend="wgmma_sm90"), 0, 64, 1, 32, 0)


def test_a_forced_head_tile_needs_the_mma_sync_kernel(monkeypatch):
    """The wgmma kernel has one head tile: forcing another must not be ignored silently."""
    monkeypatch.setattr(decode_planner, "device_info", lambda index: FAKE_GPUS[90])
    with pytest.raises(ValueError, match="decode_head_tile=32 applies to the mma_sync backends' kernels only, but"):
        decode.plan(nvfp4_mla.KernelLibrary(decode_head_tile=32), 0, 64, 8, 128, 0)
    with pytest.raises(ValueError, match="runs the wgmma_sm90 backend"):
        decode.plan(nvfp4_mla.KernelLibrary(decode_backend="wgmma_sm90", decode_head_tile=64), 0, 16, 1, 128, 0)


def test_a_forced_head_tile_on_a_hopper_build_is_refused(monkeypatch):
    """The head tile is the mma.sync kernel's only (every backend takes ``decode_parts``): forcing
    it on a Hopper build must not be ignored silently."""
    monkeypatch.setattr(decode_planner, "device_info", lambda index: FAKE_GPUS[90])
    with pytest.raises(ValueError, match=r"decode_head_tile=16 applies .* runs the wgmma_sm90_narrow backend"):
        forced = nvfp4_mla.KernelLibrary(decode_backend="wgmma_sm90_narrow", decode_head_tile=16)
        decode.plan(forced, 0, 16, 1, 128, 0)
    assert decode.MAX_LIST_PARTS == decode_combine.MAX_PARTIALS == 512 < decode_scheduler.MAX_PARTS


class _StandInLauncher(NamedTuple):
    """A loaded kernel as the planner sees it: its spec, the blocks the GPU holds at once and the GPU."""

    spec: Any
    resident_blocks: int
    device: Device

    @property
    def threads(self) -> int:
        return self.spec.template.threads

    @property
    def dependent_launch(self) -> bool:
        return launch.asks_dependent_launch(self.spec.template, self.device)

    def launch(self, *args: int) -> None:
        raise AssertionError("a plan is built, never launched, here")


_COMBINE_PER_SM = dict(zip(decode_combine.BUILDS, (4, 10, 5, 9)))  # the H200's


class _StandInKernels:
    """Stands in for a KernelCache on a fake GPU (``gpu``): a launcher of each spec asked for,
    holding ``attention`` Hopper attention blocks an SM (one: their shared memory) and
    :data:`_COMBINE_PER_SM` blocks of each combine build."""

    def __init__(self, gpu: Device = FAKE_GPUS[90], attention: int = 1, mma: int = 1):
        self.gpu, self.attention, self.mma = gpu, attention, mma

    def launcher(self, device_index: int, spec: Any) -> _StandInLauncher:
        if isinstance(spec, decode_sm90.WgmmaAttentionSpec):
            per_sm = self.attention
        elif isinstance(spec, decode_mma.MmaAttentionSpec):
            per_sm = self.mma
        elif isinstance(spec, decode_combine.CombineSpec):
            per_sm = _COMBINE_PER_SM[spec]
        else:
            per_sm = 1
        return _StandInLauncher(spec, self.gpu.sms * per_sm, self.gpu)


def _list_plan(monkeypatch, num_heads, rows, kernels=None, capability=90, **forced):
    """``decode.plan`` of a call on a fake GPU (the H200) with stand-in kernels (nothing compiled),
    and the library it planned on."""
    monkeypatch.setattr(decode_planner, "device_info", lambda index: FAKE_GPUS[capability])
    library = nvfp4_mla.KernelLibrary(kernels or _StandInKernels(), **forced)  # type: ignore[arg-type]  # a stand-in cache
    return decode.plan(library, 0, num_heads, rows, 128, 512), library


def _host_list_plan(monkeypatch, num_heads, rows, k_extra, **forced):
    """``decode.plan`` of a call without length tensors on a fake GPU (the H200) with stand-in
    kernels: the host makes its list, kept here on the CPU (no GPU)."""
    monkeypatch.setattr(decode_planner, "device_info", lambda index: FAKE_GPUS[90])
    on_cpu = torch.tensor
    monkeypatch.setattr(torch, "tensor", lambda data, dtype=None, device=None: on_cpu(data, dtype=dtype))
    library = nvfp4_mla.KernelLibrary(_StandInKernels(), **forced)  # type: ignore[arg-type]  # a stand-in cache
    return decode.plan(library, 0, num_heads, rows, 128, k_extra, lengths=False)


def _check_list_plan(plan, num_heads, rows, parts, dim_parts):
    """What a work-list plan of ``parts`` parts and ``dim_parts`` dim parts holds: a block per
    (part, head tile, dim part), no width split, a combine (and a block per split row and head)
    only with more than one part, a slot per cut and one more per split row (a boundary between
    parts cuts at most one row), and a workspace of the list (16-byte aligned), then the slots'
    partial rows and (m, l)."""
    head_tiles = -(-num_heads // plan.head_tile)
    split_rows = min(parts - 1, rows)
    assert (plan.parts, plan.dim_parts, plan.blocks) == (parts, dim_parts, parts * head_tiles * dim_parts)
    assert plan.num_splits == 1
    assert (plan.combine is None) == (parts == 1)
    assert plan.combine is None or plan.combine_blocks == plan.combine.spec.blocks(split_rows, num_heads)
    assert plan.slots == parts - 1 + split_rows <= decode_scheduler.max_slots(parts)
    list_values = -(-decode_scheduler.work_ints(parts) // 4) * 4
    assert plan.workspace == list_values + plan.slots * num_heads * (abi.HEAD_DIM + 2)
    assert plan.scheduler is not None and plan.scheduler.spec == decode_scheduler.spec_for(rows, parts)
    assert (plan.q_map is not None) == plan.backend.startswith("wgmma")


@pytest.mark.parametrize(
    ("num_heads", "rows", "backend", "dim_parts", "cluster"),
    [
        (64, 1, "wgmma_sm90", 2, 2),  # one head tile in half rows: a cluster of the two halves
        (128, 1, "wgmma_sm90", 2, 2),
        (100, 7, "wgmma_sm90", 2, 2),  # 2 head tiles, 14 items of 10 tiles: 1.1 tiles a whole-rows block
        (256, 3, "wgmma_sm90", 2, 2),
        (128, 20, "wgmma_sm90", 1, 2),  # 40 items of 10 tiles: 3.03 tiles a whole-rows block
        (192, 20, "wgmma_sm90", 1, 1),  # 3 head tiles: no cluster; 120 half-row items would not fit
        (64, 64, "wgmma_sm90", 2, 2),  # the cost model's paired halves
        (128, 64, "wgmma_sm90", 1, 2),
        (16, 7, "wgmma_sm90_narrow", 1, 1),  # 70 tiles: the NARROW build from 64
        (16, 16384, "wgmma_sm90_narrow", 1, 1),
        (40, 7, "wgmma_sm90", 2, 2),  # 70 tiles
        (40, 2, "wgmma_sm90_narrow", 1, 1),  # 20 tiles: three NARROW head tiles
    ],
)
def test_a_list_plan_fills_the_gpu(monkeypatch, num_heads, rows, backend, dim_parts, cluster):
    """The rule's Hopper plans: as many parts as the GPU holds the blocks of at once (whole
    clusters) over a part's blocks, in the dim parts of the width split at the tables' widths
    (``choose_split_and_parts``), or half rows where a whole-rows block would have little work
    (``lengths_dim_parts``), dealt at the build's segment cost; the workspace holds the list of
    any lengths (the CPU model's lists of every kind of lengths take at most the plan's slots and
    split rows)."""
    plan, library = _list_plan(monkeypatch, num_heads, rows)
    assert plan.backend == backend
    head_tile = decode_sm90.NARROW_HEAD_TILE if backend == "wgmma_sm90_narrow" else decode_sm90.HEAD_TILE
    head_tiles = -(-num_heads // head_tile)
    per_part = head_tiles * dim_parts
    parts = min(132 // per_part, decode.MAX_LIST_PARTS)  # 132 SMs, a Hopper attention block each
    _check_list_plan(plan, num_heads, rows, parts, dim_parts)
    assert plan.blocks <= 132 < plan.blocks + per_part  # the GPU filled at once
    assert plan.attend.spec == decode_sm90.WgmmaAttentionSpec.of(cluster, dim_parts, head_tile)
    if backend == "wgmma_sm90_narrow":
        assert plan.schedule.costs == (decode_sm90.NARROW_SEGMENT_COST, decode.COMBINE_COST)
    else:  # whole rows in clusters: a tile of each block's half is cheaper against a segment's cost
        segment_cost = decode_sm90.CLUSTER_SEGMENT_COST if (cluster, dim_parts) == (2, 1) else 1
        assert plan.schedule.costs == (segment_cost, decode.COMBINE_COST)
    split_rows = min(plan.parts - 1, rows)
    fits = [b for b in decode_combine.BUILDS if b.blocks(split_rows, num_heads) <= _COMBINE_PER_SM[b] * 132]
    assert plan.combine.spec == (fits or [decode_combine.PACKED])[0]  # the first build that fits at once
    assert list(library.plans.values()) == [plan]  # remembered: the next call's one lookup
    rng = random.Random(rows)
    for tiles in (
        [1] * rows,
        [10] * rows,
        [1 if r != rows // 2 else 10 for r in range(rows)],
        [rng.randint(1, 10) for _ in range(rows)],
    ):
        listed = decode_scheduler.schedule(tiles, plan.parts, *plan.schedule.costs)
        split = [row for row, _ in listed.split_rows if row >= 0]
        assert plan.combine.spec.blocks(len(split), num_heads) <= plan.combine_blocks
        assert listed.split_rows[-1][1] <= plan.slots


@pytest.mark.parametrize("capability", [80, 90, 120])
@pytest.mark.parametrize(("num_heads", "rows", "head_tile"), [(16, 1, 16), (16, 5, 16), (8, 40, 16), (64, 3, 64)])
def test_the_mma_sync_kernel_walks_the_list_too(monkeypatch, capability, num_heads, rows, head_tile):
    """On every GPU the mma.sync kernel walks a work list in tiles of 32 entries, with lengths in as
    many parts as its blocks fit the GPU at once over its head tiles (here 3 blocks an SM)."""
    forced: dict[str, Any] = {}
    if capability == 90 and ((num_heads > 8 and rows >= 2) or rows >= 6):
        forced["decode_backend"] = "mma_sync"  # the rule picks a Hopper build there
    if capability == 120 and head_tile == 64:
        forced["decode_head_tile"] = 32  # 64 heads a block do not fit sm_120's shared memory
        head_tile = 32
    kernels = _StandInKernels(FAKE_GPUS[capability], mma=3)
    plan, _ = _list_plan(monkeypatch, num_heads, rows, kernels, capability, **forced)
    head_tiles = -(-num_heads // head_tile)
    assert (plan.backend, plan.head_tile, plan.tile_tokens) == ("mma_sync", head_tile, decode_mma.BLOCK_N)
    assert plan.schedule.costs == (1, decode.COMBINE_COST)
    parts = min(3 * FAKE_GPUS[capability].sms // head_tiles, decode.MAX_LIST_PARTS)
    _check_list_plan(plan, num_heads, rows, parts, 1)


@pytest.mark.parametrize("capability", [80, 90, 120])
@pytest.mark.parametrize("num_heads", [1, 8, 16, 40, 64, 128])
def test_a_batch_invariant_plan_cuts_no_row(monkeypatch, capability, num_heads):
    """batch_invariant: at every row count the same backend and head tile (what a row's bits
    depend on), no combine and no partial slot; the scheduler's list of any lengths holds each
    row in one segment. (Without lengths the host's list deals whole rows: GPU tests.)"""
    monkeypatch.setattr(decode_planner, "device_info", lambda index: FAKE_GPUS[capability])
    library = nvfp4_mla.KernelLibrary(_StandInKernels())  # type: ignore[arg-type]  # a stand-in cache
    kernels = set()
    for rows in (1, 2, 5, 6, 31, 132, 1000, 16384):
        plan = decode.plan(library, 0, num_heads, rows, 128, 512, batch_invariant=True)
        kernels.add((plan.backend, plan.head_tile))
        assert plan.whole_rows and plan.combine is None and plan.slots == 0 and plan.num_splits == 1
        assert plan.parts <= rows and plan.blocks == plan.parts * -(-num_heads // plan.head_tile) * plan.dim_parts
        assert plan.workspace == -(-decode_scheduler.work_ints(plan.parts) // 4) * 4  # the list alone
        tiles = [random.Random(rows).randint(1, 20) for _ in range(rows)]
        listed = decode_scheduler.schedule(tiles, plan.parts, *plan.schedule.costs, plan.whole_rows)
        assert all(row < 0 for row, _ in listed.split_rows)
    assert len(kernels) == 1, kernels
    if capability == 90:  # the backend a large batch takes
        want = decode.select_backend(FAKE_GPUS[90], num_heads, decode_planner.INVARIANT_ROWS, 640).name
        assert kernels == {(want, 16 if want == "wgmma_sm90_narrow" else 64)}


@pytest.mark.parametrize(
    ("num_heads", "rows", "k_extra", "forced", "early_splits", "want"),
    [
        # 80 attention blocks leave 52 SMs: SPREAD_PREFETCH's 256 blocks would not fit there (4 an
        # SM), BESIDE's 64 do (5 an SM).
        (128, 2, 512, {}, 32, decode_combine.BESIDE),
        (64, 4, 512, {}, 32, decode_combine.BESIDE),
        (128, 1, 512, {}, 32, decode_combine.SPREAD_PREFETCH),  # 40 blocks: its 128 fit on the 92 free SMs
        # The same call with the combine launched after the attention: its 10 splits past the early
        # launch's, or the mma.sync kernel, which never lets the next kernel launch early.
        (128, 2, 512, {}, 9, decode_combine.SPREAD_PREFETCH),
        (128, 2, 512, {"decode_backend": "mma_sync"}, 32, decode_combine.SPREAD_PREFETCH),
        # 120 NARROW blocks leave 12 SMs, under BESIDE_MIN_FREE_SHARE of the GPU, where BESIDE's 48
        # blocks would fit.
        (16, 12, 3072, {}, 32, decode_combine.SPREAD_PREFETCH),
    ],
)
def test_the_combine_beside_the_attention(monkeypatch, num_heads, rows, k_extra, forced, early_splits, want):
    """Where the combine's blocks start beside the attention's (the Hopper kernel's early launch),
    the first build that fits the GPU gives way to ``BESIDE`` if its blocks would not all fit on the
    SMs the attention leaves free and ``BESIDE``'s would (at least a fifth of the SMs free)."""
    monkeypatch.setattr(decode_sm90, "EARLY_DEPENDENTS_MAX_SPLITS", early_splits)
    plan = _host_list_plan(monkeypatch, num_heads, rows, k_extra, **forced)
    combine: Any = plan.combine  # a stand-in launcher
    assert combine.spec == want
    split_rows = plan.combine_blocks // want.blocks(1, num_heads)
    assert split_rows * want.blocks(1, num_heads) == plan.combine_blocks and split_rows >= 1
    assert combine.dependent_launch and (plan.num_splits > early_splits) == (early_splits < 32)
    free_sms = 132 - plan.blocks
    first_fit = decode_combine.SPREAD_PREFETCH
    fits_beside = first_fit.blocks(split_rows, num_heads) <= _COMBINE_PER_SM[first_fit] * free_sms
    if want is decode_combine.BESIDE:
        assert not fits_beside and free_sms >= decode_combine.BESIDE_MIN_FREE_SHARE * 132
        assert want.blocks(split_rows, num_heads) <= _COMBINE_PER_SM[want] * free_sms
    elif early_splits > plan.num_splits and "decode_backend" not in forced:
        assert fits_beside or free_sms < decode_combine.BESIDE_MIN_FREE_SHARE * 132


def test_a_list_plan_has_at_most_max_list_parts(monkeypatch):
    """Where the GPU holds more blocks than that, the combine's most partials of a row (one row
    may be cut at every boundary) cap the parts."""
    plan, _ = _list_plan(monkeypatch, 16, 64, _StandInKernels(attention=4))
    _check_list_plan(plan, 16, 64, decode.MAX_LIST_PARTS, 1)
    assert plan.blocks == decode.MAX_LIST_PARTS == 512 < 4 * 132


@pytest.mark.parametrize("parts", [1, 2, 3, 7, 64, 255, 256, 512])
def test_decode_parts_forces_the_parts(monkeypatch, parts):
    """``decode_parts`` sets the parts, whatever the GPU holds at once, on both Hopper backends and
    in whole or half rows: half rows at the same parts take twice the blocks (the same list)."""
    for heads, rows in ((128, 3), (64, 1), (16, 40)):
        for dim_parts in (1, 2) if heads > 16 else (None,):
            plan, _ = _list_plan(monkeypatch, heads, rows, decode_parts=parts, decode_dim_parts=dim_parts)
            _check_list_plan(plan, heads, rows, parts, dim_parts or 1)


@pytest.mark.parametrize("parts", [0, -1, 513, 1023])
def test_decode_parts_out_of_range_are_refused(monkeypatch, parts):
    for heads, rows in ((128, 3), (16, 40)):
        with pytest.raises(ValueError, match=rf"decode_parts must be in \[1, 512\], got {parts}"):
            _list_plan(monkeypatch, heads, rows, decode_parts=parts)


def test_a_forced_dim_split_needs_a_backend_that_has_it(monkeypatch):
    """Only the wgmma kernel splits a row's output dims over two items: asking the mma.sync kernel
    for it, or for parts no kernel has, must not be ignored silently."""
    monkeypatch.setattr(decode_planner, "device_info", lambda index: FAKE_GPUS[90])
    with pytest.raises(
        ValueError, match=r"decode_dim_parts=2 is not a form of the mma_sync backend's kernel \(its forms: \(1,\)\)"
    ):
        decode.plan(nvfp4_mla.KernelLibrary(decode_backend="mma_sync", decode_dim_parts=2), 0, 64, 1, 128, 0)
    with pytest.raises(ValueError, match="decode_dim_parts=4 is not a form of the wgmma_sm90 backend's kernel"):
        decode.plan(nvfp4_mla.KernelLibrary(decode_dim_parts=4), 0, 64, 1, 128, 0)


@pytest.mark.parametrize(
    ("parts", "items", "max_blocks", "want"),
    [
        ((1, 2), 10, 132, 2),  # batch 1, 64 heads, 10 splits: 20 blocks
        ((1, 2), 52, 132, 2),  # 104 blocks: within HALF_ROWS_SHARE of the H200's 132
        ((1, 2), 53, 132, 1),
        ((1, 2), 65, 132, 1),  # 130 blocks: measured slower than whole rows
        ((1, 2), 3, 4, 1),  # a capped grid
        ((1,), 10, 132, 1),  # a backend with whole rows only
        ((1,), 10, 0, 1),  # a block an item (no cap)
    ],
)
def test_half_rows_where_twice_the_items_fit_at_once(parts, items, max_blocks, want):
    assert decode_schedule.choose_dim_parts(parts, items, max_blocks) == want


@pytest.mark.parametrize(
    ("parts", "items", "num_tiles", "width_dim_parts", "want"),
    [
        ((1, 2), 1, 34, 2, 2),
        ((1, 2), 11, 34, 1, 2),  # 5 rows of 128 heads over 2,176 entries: 2.8 tiles a whole-rows block
        ((1, 2), 12, 34, 1, 1),  # 6 rows: 3.1 tiles, the width split's
        ((1, 2), 38, 10, 1, 2),  # 19 rows over 640 entries: 2.9 tiles
        ((1, 2), 40, 10, 1, 1),
        ((1, 2), 40, 10, 2, 2),
        ((1,), 1, 10, 1, 1),  # a backend with whole rows only
    ],
)
def test_lengths_take_half_rows_for_little_work(parts, items, num_tiles, width_dim_parts, want):
    assert decode_schedule.lengths_dim_parts(parts, items, num_tiles, 132, width_dim_parts) == want


@pytest.mark.parametrize(
    ("parts", "items", "num_tiles", "split", "want"),
    [
        ((1, 2), 16, 10, (5, 2), True),  # 8 rows of 128 heads over 640 entries: 1.2 tiles a whole-rows block
        ((1, 2), 16, 18, (6, 3), True),  # over 1,152 entries: 2.2 tiles
        ((1, 2), 32, 10, (4, 3), False),  # 16 rows over 640: 2.4 tiles
        ((1, 2), 16, 34, (7, 5), False),  # 8 rows over 2,176: 4.1 tiles
        ((1,), 2, 10, (10, 1), False),  # a backend with whole rows only
        ((1, 2), 2, 130, (65, 2), False),  # 1 row of 128 heads over 8,320: the split's blocks fill the GPU
        ((1, 2), 2, 66, (66, 1), True),  # over 4,224: they fill it with one tile each
        ((1, 2), 2, 98, (49, 2), True),  # over 6,272: 98 of 132 blocks
    ],
)
def test_few_rows_without_lengths_are_dealt_in_half_rows(parts, items, num_tiles, split, want):
    assert decode_schedule.deals_half_rows(parts, items, num_tiles, 132, *split) == want


@pytest.mark.parametrize(
    ("num_heads", "rows", "k_extra", "want"),
    [
        (128, 1, 8192, (65, 65, 1)),  # the width split's 130 blocks of two tiles fill the H200: whole rows
        (64, 4, 4096, (33, 132, 1)),  # 132 blocks of two tiles
        (128, 13, 512, (5, 65, 1)),  # 130 blocks of two tiles
        (128, 12, 512, (1, 33, 2)),  # 120 blocks: dealt half rows
        (128, 1, 4096, (1, 33, 2)),  # 132 blocks of one tile: dealt half rows
        (128, 4, 1024, (1, 33, 2)),  # 96 blocks: dealt half rows
    ],
)
def test_whole_rows_where_the_width_split_fills_the_gpu(monkeypatch, num_heads, rows, k_extra, want):
    """A call without lengths deals its rows in half rows where a whole-rows block would have little
    work, but not where the width split's blocks already fill the GPU with two tiles or more each:
    the plan's (splits, parts, dim parts) on the H200's Hopper kernel."""
    plan = _host_list_plan(monkeypatch, num_heads, rows, k_extra)
    assert plan.backend == "wgmma_sm90" and (plan.num_splits, plan.parts, plan.dim_parts) == want


@pytest.mark.parametrize(
    ("num_heads", "rows", "with_lengths", "without"),
    [(128, 2, 2, 1), (128, 5, 2, 1), (128, 6, 1, 1), (64, 11, 2, 1), (64, 12, 1, 1)],
)
def test_a_call_with_lengths_of_few_rows_takes_half_rows(monkeypatch, num_heads, rows, with_lengths, without):
    """Over 128 + 2,048 entries the width split keeps whole rows at these row counts; with lengths
    the list deals the live tiles into every part, and few rows take half rows."""
    monkeypatch.setattr(decode_planner, "device_info", lambda index: FAKE_GPUS[90])
    library = nvfp4_mla.KernelLibrary(_StandInKernels())  # type: ignore[arg-type]  # a stand-in cache
    assert decode.plan(library, 0, num_heads, rows, 128, 2048).dim_parts == with_lengths
    head_tiles, pairs = -(-num_heads // 64), num_heads <= 64  # one head tile: the halves as a pair
    width = decode_schedule.choose_split_and_parts((1, 2), rows * head_tiles, 34, 132, 132, rows * num_heads, pairs)
    assert width[2] == without


@pytest.mark.parametrize(
    ("parts", "blocks", "num_tiles", "head_rows", "want"),
    [
        ((1, 2), 2, 10, 128, (10, 1, 2)),  # batch 1, 128 heads, 640 tokens: half rows at the same split
        ((1, 2), 4, 18, 256, (9, 2, 2)),  # 2 rows, 128 heads, 1,152 tokens: 144 blocks would not fit, 72 do
        ((1, 2), 8, 10, 512, (5, 2, 2)),  # 4 rows, 128 heads, 640 tokens
        ((1, 2), 16, 10, 1024, (5, 2, 1)),  # 8 rows: splits of two tiles already, too many for half rows
        ((1, 2), 64, 10, 4096, (2, 5, 1)),  # 32 rows: whole rows
        ((1, 2), 128, 10, 8192, (1, 10, 1)),  # 64 rows: no split
        ((1, 2), 1, 130, 64, (65, 2, 1)),  # batch 1, 64 heads, the long pool: 130 blocks would not fit
        ((1, 2), 192, 10, 12288, (1, 10, 1)),  # 96 rows, 128 heads: not 3 waves of 2 splits (50 MB of partials)
        ((1,), 2, 10, 128, (10, 1, 1)),  # the mma.sync kernel: whole rows, the split as before
    ],
)
def test_the_split_and_the_parts_chosen_together(parts, blocks, num_tiles, head_rows, want):
    got = decode_schedule.choose_split_and_parts(parts, blocks, num_tiles, 132, 132 if 2 in parts else 0, head_rows)
    assert got == want
    splits, per_split, _ = got
    assert (splits - 1) * per_split < num_tiles <= splits * per_split  # every tile once


@pytest.mark.parametrize(
    ("rows", "heads", "num_tiles", "want"),
    [
        (1, 64, 130, (65, 2, 2)),  # the long pool: 130 blocks in pairs, where whole rows take 65
        (12, 64, 10, (5, 2, 2)),  # not 10 splits of whole rows
        (32, 64, 10, (2, 5, 2)),  # not 4 splits (3, 3, 3, 1 tiles) of whole rows
        (64, 64, 10, (1, 10, 2)),  # no split: 128 blocks in pairs, not 2 splits of whole rows
        (32, 64, 18, (4, 5, 1)),  # 1,152 tokens: whole rows (pairs at 2 splits of 9 tiles: 0.95x)
        (32, 16, 10, (4, 3, 1)),  # 16 heads: a quarter of the partial bytes, whole rows (pairs 0.97x)
        (128, 64, 10, (1, 10, 1)),  # 128 rows fill the GPU: whole rows
    ],
)
def test_paired_halves_where_the_cost_model_prefers_them(rows, heads, num_tiles, want):
    """One head tile (16-64 heads) on the wgmma kernel: a row's two halves as a pair sharing each
    dequantized tile, where fewer splits (fewer partial rows) pay for doing S twice."""
    assert decode_schedule.choose_split_and_parts((1, 2), rows, num_tiles, 132, 132, rows * heads, True) == want
    if want[2] == 2:  # without pairs, the same call keeps whole rows
        assert decode_schedule.choose_split_and_parts((1, 2), rows, num_tiles, 132, 132, rows * heads)[2] == 1


def test_the_q_tensor_map_is_encoded_once_then_moved():
    """The Hopper kernel's map of q: q's [rows, heads, 512] as dims (512, heads, rows), boxes of
    64 dims x 64 heads x 1 row, 128-byte swizzle, zeros outside; encoded (here by a fake driver
    that writes the address into the map) for the first address, for another one a copy of that
    map with the address replaced, kept while q does not move; at the end of the Params, on a
    64-byte boundary."""
    calls: list[tuple] = []

    def pattern(address):
        return address.to_bytes(8, "little") * 16

    def encode(at, dtype, rank, address, dims, strides, box, steps, interleave, swizzle, promotion, fill):
        calls.append(("encode", address, dims[:rank], strides[: rank - 1], box[:rank], steps[:rank], swizzle, fill))
        ctypes.memmove(at, pattern(address), launch.TENSOR_MAP_BYTES)
        return 0

    def replace(at, address):
        calls.append(("replace", address, ctypes.string_at(at, launch.TENSOR_MAP_BYTES)))  # what it was given
        ctypes.memmove(at, pattern(address), launch.TENSOR_MAP_BYTES)
        return 0 if address else 1  # the driver refuses address 0 here

    q_map = decode_sm90.q_tensor_map(100, 7, driver=(encode, replace))
    first, moved = 0x7F0000000010, 0x7F0000100000
    mapped = q_map(first)
    assert mapped == pattern(first) and q_map(first) is mapped
    assert q_map(moved) == pattern(moved) and q_map(first) == mapped
    shape = ([512, 100, 7], [1024, 100 * 1024], [64, 64, 1], [1, 1, 1], 3, 0)
    assert calls == [("encode", first, *shape), ("replace", moved, mapped), ("replace", first, mapped)]
    with pytest.raises(RuntimeError, match="cuTensorMapReplaceAddress failed"):
        q_map(0)
    params = decode_sm90.PARAMS
    fields = ("parts", "tile_shift", "segment_cost", "combine_cost", "whole_rows")
    schedule = tuple(f"schedule.{name}" for name in fields)
    assert params.size == 320 + launch.TENSOR_MAP_BYTES
    assert params.names == (*decode_backend.ATTEND_PARAMS.names, "q_map")
    names = decode_backend.ATTEND_PARAMS.names  # every backend's work list and how it is dealt
    assert names[names.index("work") :] == ("work", "static_list", "own_list", *schedule)
    assert params.offsets["q_map"] == 320 > decode_backend.ATTEND_PARAMS.size == 288  # the next 64 bytes
    assert decode_sm90.WgmmaAttentionSpec.of(1).template.params is params and params.size <= launch.PARAMS_CAPACITY


def test_the_wgmma_kernel_fits_the_hopper_block():
    assert decode_sm90.shared_bytes() == 232_136 <= FAKE_GPUS[90].shared_optin
    assert decode_sm90.WgmmaAttentionSpec.of(2).template.threads == 384
    # NARROW: Q and P of 16 heads, no factors for a second consumer, a second producer's raw units,
    # the consumer warps' exchange, 8 more raw-unit barriers and none for P.
    narrow_bytes = 232_136 - 48 * 1024 - 6 * 1024 - 2 * 64 * 4 + 25_600 + 512 + 8 * 8 - 2 * 8
    assert decode_sm90.shared_bytes(16) == narrow_bytes == 202_488 <= FAKE_GPUS[90].shared_optin
    assert decode_sm90.NARROW_SPEC.template.threads == 384 and decode_sm90.NARROW_SPEC.template.max_shared_bytes == (
        decode_sm90.shared_bytes(16)
    )


@pytest.mark.parametrize(
    ("heads", "cluster"), [(1, 1), (16, 1), (64, 1), (65, 2), (100, 2), (128, 2), (129, 1), (256, 2)]
)
def test_the_wgmma_kernel_pairs_an_even_number_of_head_tiles(heads, cluster):
    """Two head tiles of a row share their dequantized tiles as a cluster; an odd count cannot pair."""
    assert decode_sm90.cluster_of(heads) == cluster


@pytest.mark.parametrize(("heads", "cluster"), [(1, 2), (16, 2), (64, 2), (65, 2), (128, 2), (129, 1), (192, 1)])
def test_the_wgmma_kernel_pairs_the_halves_of_a_row_at_one_head_tile(heads, cluster):
    """In half rows, one head tile pairs the two halves of a row (neighbouring items, the same
    tiles); an even count still pairs its head tiles, and an odd count above one cannot pair."""
    assert decode_sm90.cluster_of(heads, 2) == cluster


def test_shared_memory_fits_every_gpu_it_is_chosen_for():
    assert decode_mma.shared_bytes(16) <= decode_mma.shared_bytes(32) <= SMALLEST_SHARED_OPTIN  # every sm_80+ GPU
    assert SMALLEST_SHARED_OPTIN < decode_mma.shared_bytes(64) <= SM80_SHARED_OPTIN  # sm_80, sm_90, sm_100


@pytest.mark.parametrize(
    ("heads", "optin", "tile"),
    [
        (1, SMALLEST_SHARED_OPTIN, 16),
        (8, SMALLEST_SHARED_OPTIN, 16),
        (16, SM80_SHARED_OPTIN, 16),
        (20, SMALLEST_SHARED_OPTIN, 32),
        (32, SMALLEST_SHARED_OPTIN, 32),
        (64, SMALLEST_SHARED_OPTIN, 32),
        (128, SMALLEST_SHARED_OPTIN, 32),
        (64, SM80_SHARED_OPTIN, 64),
        (128, 232_448, 64),
    ],
)
def test_head_tile_choice(heads, optin, tile):
    assert decode_mma.choose_head_tile(heads, optin) == tile


@pytest.mark.parametrize("blocks", [1, 2, 8, 100, 131, 132, 133, 264, 1000])
@pytest.mark.parametrize("num_tokens", [1, 31, 32, 33, 640, 1152, 2176, 10_000])
def test_split_covers_every_tile_once(blocks, num_tokens):
    num_tiles = -(-num_tokens // decode_mma.BLOCK_N)
    _, splits, per_split = decode_schedule.cheapest_split(blocks, num_tiles, 132, 64 * blocks)
    assert 1 <= splits <= min(num_tiles, decode.MAX_SPLITS)  # the combine takes at most MAX_SPLITS
    assert (splits - 1) * per_split < num_tiles <= splits * per_split  # no empty split, no tile left over
    if blocks % 132 == 0:
        assert splits == 1  # whole waves already: no combine
    assert decode_schedule.cheapest_split(blocks, num_tiles, 132, 64 * blocks)[1:] == (splits, per_split)


def test_small_batches_are_split_to_fill_the_gpu():
    # batch 1, 128 heads in 2 tiles of 64, 128 + 512 tokens (20 tiles), 132 SMs of one block each
    _, splits, per_split = decode_schedule.cheapest_split(2, 20, 132, 128)
    assert (splits, per_split) == (20, 1)
    # batch 64, q_len 2, 4 tiles of 32 heads, 2 blocks an SM: 512 blocks already fill it
    assert decode_schedule.cheapest_split(512, 36, 264, 128 * 128)[1:] == (1, 36)


# ---------------------------------------------------------------- the CPU path and validation


def pool(num_pages, page_size, g, layout="3D", pad=0):
    cache = make_cache(num_pages, page_size, layout, pad)
    capacity = num_pages * page_size
    rows = (torch.randn(capacity, abi.HEAD_DIM, generator=g)).to(BF16)
    reference.nvfp4_quantize_append_sparse_mla_cache(rows, torch.arange(capacity), cache)
    return cache, capacity


def inputs(g, batch=2, q_len=3, heads=4):
    swa_cache, swa_capacity = pool(4, 16, g)
    extra_cache, extra_capacity = pool(3, 8, g, "HND", 32)
    q = torch.randn(batch, q_len, heads, abi.HEAD_DIM, generator=g).to(BF16)
    swa_slots = torch.randint(-2, swa_capacity + 2, (batch, q_len, 10), generator=g)
    extra_slots = torch.randint(-2, extra_capacity + 2, (batch, q_len, 7), generator=g).int()
    lens = torch.randint(-1, 9, (batch, q_len), generator=g, dtype=torch.int32)
    return {
        "q": q,
        "swa_cache": swa_cache,
        "swa_slots": swa_slots,
        "swa_lens": lens,
        "extra_cache": extra_cache,
        "extra_slots": extra_slots,
        "sm_scale": SM_SCALE,
        "sinks": torch.randn(heads, generator=g),
    }


def test_cpu_path_is_the_reference(seed):
    args = inputs(torch.Generator().manual_seed(seed))
    q, swa_cache, swa_slots = args.pop("q"), args.pop("swa_cache"), args.pop("swa_slots")
    got = nvfp4_mla.sparse_mla_decode(q, swa_cache, swa_slots, **args)
    want = reference.sparse_mla_decode(q, swa_cache, swa_slots, **args)
    assert torch.equal(got[0].view(torch.int16), want[0].view(torch.int16))
    assert torch.equal(got[1].view(torch.int32), want[1].view(torch.int32))
    out = torch.empty_like(q)
    given = nvfp4_mla.sparse_mla_decode(q, swa_cache, swa_slots, out=out, **args)
    assert given[0] is out and torch.equal(out.view(torch.int16), want[0].view(torch.int16))


def test_validation_is_shared_with_the_reference(seed):
    args = inputs(torch.Generator().manual_seed(seed))
    q, swa_cache, swa_slots = args.pop("q"), args.pop("swa_cache"), args.pop("swa_slots")
    for bad, match in [
        ({"sm_scale": float("nan")}, "sm_scale must be a finite"),
        ({"swa_lens": args["swa_lens"].short()}, "swa_lens must have dtype torch.int32 or torch.int64"),
        ({"extra_cache": None}, "extra_cache and extra_slots come together"),
        ({"sinks": args["sinks"][:-1]}, "sinks must be a contiguous"),
    ]:
        with pytest.raises(ValueError, match=match):
            nvfp4_mla.sparse_mla_decode(q, swa_cache, swa_slots, **{**args, **bad})
        with pytest.raises(ValueError, match=match):
            reference.sparse_mla_decode(q, swa_cache, swa_slots, **{**args, **bad})


def test_out_is_validated(seed):
    args = inputs(torch.Generator().manual_seed(seed))
    q, swa_cache, swa_slots = args.pop("q"), args.pop("swa_cache"), args.pop("swa_slots")
    cases = [
        (torch.empty(q.shape, dtype=torch.float32), "out must have dtype torch.bfloat16"),
        (torch.empty((*q.shape[:-1], 256), dtype=BF16), "out must have q's shape"),
        (torch.empty((*q.shape[:-1], 1024), dtype=BF16)[..., ::2], "out must be contiguous"),
        (q, "q overlaps out"),
        (torch.empty(q.shape, dtype=BF16, requires_grad=True), "requires grad"),
    ]
    for out, match in cases:
        with pytest.raises(ValueError, match=match):
            nvfp4_mla.sparse_mla_decode(q, swa_cache, swa_slots, out=out, **args)


def test_out_shares_no_memory_with_any_input(seed):
    """An out that overlaps a slot table, the lengths or the sinks is refused before anything is
    written (on the CPU it would overwrite them; on a GPU it would race)."""
    args = inputs(torch.Generator().manual_seed(seed))
    q, swa_cache = args.pop("q"), args.pop("swa_cache")
    size = q.numel() * 2
    for name in ("swa_slots", "swa_lens", "extra_slots", "sinks"):
        pool = torch.zeros(size + 4096, dtype=torch.uint8)  # out and the input, one storage
        given = args[name]
        inside = pool[: given.nbytes].view(given.dtype).view(given.shape)
        inside.copy_(given)
        before = inside.clone()
        out = pool[:size].view(BF16).view(q.shape)
        call = {**args, name: inside}
        swa_slots = call.pop("swa_slots")
        with pytest.raises(ValueError, match=f"{name} overlaps out"):
            nvfp4_mla.sparse_mla_decode(q, swa_cache, swa_slots, out=out, **call)
        assert torch.equal(inside, before)


@pytest.mark.parametrize("sm_scale", [10**400, float("inf"), True, "0.04", None])
def test_sm_scale_must_be_a_finite_real(seed, sm_scale):
    args = inputs(torch.Generator().manual_seed(seed))
    q, swa_cache, swa_slots = args.pop("q"), args.pop("swa_cache"), args.pop("swa_slots")
    args["sm_scale"] = sm_scale
    with pytest.raises(ValueError, match="sm_scale must be a finite real number"):
        nvfp4_mla.sparse_mla_decode(q, swa_cache, swa_slots, **args)


def test_sm_scale_takes_numpy_floats(seed):
    np = pytest.importorskip("numpy")
    args = inputs(torch.Generator().manual_seed(seed))
    q, swa_cache, swa_slots = args.pop("q"), args.pop("swa_cache"), args.pop("swa_slots")
    want = nvfp4_mla.sparse_mla_decode(q, swa_cache, swa_slots, **{**args, "sm_scale": 0.25})
    for scale in (np.float32(0.25), np.float64(0.25), 1 / 4):
        got = nvfp4_mla.sparse_mla_decode(q, swa_cache, swa_slots, **{**args, "sm_scale": scale})
        assert torch.equal(got[0].view(torch.int16), want[0].view(torch.int16))


def _misaligned(t):
    """``t``'s values 2 bytes past where a fresh tensor starts (16-byte aligned): not aligned."""
    flat = torch.empty(t.numel() * t.element_size() + 2, dtype=torch.uint8)[2:]
    moved = flat.view(t.dtype).view(t.shape)
    return moved.copy_(t)


def _strided(t, step=2):
    """``t``'s values in a tensor whose last dim has stride ``step``: not contiguous."""
    wide = torch.zeros(*t.shape[:-1], t.shape[-1] * step, dtype=t.dtype)
    wide[..., ::step] = t
    return wide[..., ::step]


# name -> (the arguments of inputs() changed, whether it is the usual call: one that the one-pass
# acceptance must take, else the host-time saving is silently lost)
CALLS: dict[str, tuple[Any, bool]] = {
    "two pools, lengths, sinks": (lambda a: a, True),
    "one pool": (lambda a: {**a, "extra_cache": None, "extra_slots": None}, True),
    "no lengths, no sinks": (lambda a: {**a, "swa_lens": None, "sinks": None}, True),
    "extra lengths too": (lambda a: {**a, "extra_lens": a["swa_lens"].long()}, True),
    "sinks a Parameter": (lambda a: {**a, "sinks": torch.nn.Parameter(a["sinks"])}, True),
    "an NHD cache": (lambda a: {**a, "swa_cache": make_cache(4, 16, "NHD")}, True),
    "a one-page cache": (lambda a: {**a, "swa_cache": make_cache(1, 16, "3D", 32)}, True),
    "a Fraction for sm_scale": (lambda a: {**a, "sm_scale": fractions.Fraction(1, 4)}, False),
    "int sm_scale": (lambda a: {**a, "sm_scale": 1}, False),
    "fp32 q": (lambda a: {**a, "q": a["q"].float()}, False),
    "3-D q": (lambda a: {**a, "q": a["q"][0]}, False),
    "256-wide q": (lambda a: {**a, "q": a["q"][..., :256].contiguous()}, False),
    "strided q": (lambda a: {**a, "q": _strided(a["q"])}, False),
    "no heads": (lambda a: {**a, "q": a["q"][:, :, :0], "sinks": None}, False),
    "misaligned q": (lambda a: {**a, "q": _misaligned(a["q"])}, False),
    "sparse q": (lambda a: {**a, "q": a["q"].to_sparse()}, False),
    "q a list": (lambda a: {**a, "q": a["q"].tolist()}, False),
    "int8 cache": (lambda a: {**a, "swa_cache": a["swa_cache"].view(torch.int8)}, False),
    "383-byte records": (lambda a: {**a, "swa_cache": a["swa_cache"][..., :383]}, False),
    "page stride of 8 bytes more": (lambda a: {**a, "swa_cache": make_cache(4, 16, "3D", 8)}, False),
    "misaligned cache": (lambda a: {**a, "extra_cache": _misaligned(a["extra_cache"])}, False),
    "a 2-D cache": (lambda a: {**a, "swa_cache": a["swa_cache"][0]}, False),
    "float slots": (lambda a: {**a, "swa_slots": a["swa_slots"].float()}, False),
    "int16 slots": (lambda a: {**a, "extra_slots": a["extra_slots"].short()}, False),
    "slots of another batch": (lambda a: {**a, "swa_slots": a["swa_slots"][:1]}, False),
    "slots of another q_len": (lambda a: {**a, "extra_slots": a["extra_slots"][:, :1].contiguous()}, False),
    "2-D slots": (lambda a: {**a, "swa_slots": a["swa_slots"][:, 0]}, False),
    "no slot a row": (lambda a: {**a, "swa_slots": a["swa_slots"][..., :0]}, False),
    "strided slots": (lambda a: {**a, "swa_slots": _strided(a["swa_slots"])}, False),
    "int16 lengths": (lambda a: {**a, "swa_lens": a["swa_lens"].short()}, False),
    "lengths of another shape": (lambda a: {**a, "swa_lens": a["swa_lens"][:, :1].contiguous()}, False),
    "strided lengths": (lambda a: {**a, "swa_lens": _strided(a["swa_lens"])}, False),
    "lengths a list": (lambda a: {**a, "swa_lens": a["swa_lens"].tolist()}, False),
    "extra cache alone": (lambda a: {**a, "extra_slots": None}, False),
    "extra slots alone": (lambda a: {**a, "extra_cache": None}, False),
    "extra lengths alone": (
        lambda a: {**a, "extra_cache": None, "extra_slots": None, "extra_lens": a["swa_lens"]},
        False,
    ),
    "nan sm_scale": (lambda a: {**a, "sm_scale": float("nan")}, False),
    "inf sm_scale": (lambda a: {**a, "sm_scale": float("inf")}, False),
    "bool sm_scale": (lambda a: {**a, "sm_scale": True}, False),
    "str sm_scale": (lambda a: {**a, "sm_scale": "0.04"}, False),
    "fp64 sinks": (lambda a: {**a, "sinks": a["sinks"].double()}, False),
    "sinks of another head count": (lambda a: {**a, "sinks": torch.zeros(5)}, False),
    "strided sinks": (lambda a: {**a, "sinks": _strided(a["sinks"])}, False),
}


@pytest.mark.parametrize("name", CALLS)
def test_the_one_pass_acceptance_takes_no_call_the_checks_refuse(seed, monkeypatch, name):
    """check_decode accepts the usual call of CUDA tensors in one pass (validation.decode's
    usual_decode_call) and leaves every other call to the checks one by one, which name what is off:
    here every tensor says it is on device 0, so the one pass runs on CPU tensors. Whatever it
    accepts, the checks accept with the same layouts; it takes the usual calls; and check_decode
    says what the checks say."""
    from nvfp4_mla.validation import decode as checks

    change, usual = CALLS[name]
    args = change(inputs(torch.Generator().manual_seed(seed)))
    args.setdefault("extra_lens", None)
    monkeypatch.setattr(torch.Tensor, "get_device", lambda self: 0)
    try:
        want = checks.check_decode_inputs(**args, need_cuda=False)
    except ValueError as exc:
        want, message = None, str(exc)
    got = checks.usual_decode_call(**args)
    assert got == want if usual else got is None or got == want
    assert want is not None or not usual
    if want is None:
        with pytest.raises(ValueError) as raised:
            checks.check_decode(**args, need_cuda=False)
        assert str(raised.value) == message
    else:
        assert checks.check_decode(**args, need_cuda=False) == want


def test_out_is_validated_after_the_one_pass(seed, monkeypatch):
    """With ``out``, a call the one pass accepts gets the checks of ``out``, with their messages."""
    from nvfp4_mla.validation import decode as checks

    args = inputs(torch.Generator().manual_seed(seed))
    args["extra_lens"] = None
    q = args["q"]
    monkeypatch.setattr(torch.Tensor, "get_device", lambda self: 0)
    assert checks.usual_decode_call(**args) is not None
    checks.check_decode(**args, need_cuda=False, out=torch.empty_like(q))
    sinks_inside = torch.zeros(q.numel() + 64, dtype=BF16)  # out, then sinks over its last 16 bytes
    sinks = sinks_inside[q.numel() - 8 :].view(torch.float32)[: q.shape[2]]
    for out, change, match in [
        (torch.empty(q.shape, dtype=torch.float32), {}, "out must have dtype torch.bfloat16"),
        (torch.empty((*q.shape[:-1], 256), dtype=BF16), {}, "out must have q's shape"),
        (_strided(torch.empty(q.shape, dtype=BF16)), {}, "out must be contiguous"),
        (torch.empty(q.shape, dtype=BF16, requires_grad=True), {}, "requires grad"),
        (_misaligned(torch.empty(q.shape, dtype=BF16)), {}, "out must be 16-byte aligned"),
        (q, {}, "q overlaps out"),
        (args["swa_cache"].view(-1)[: q.numel() * 2].view(BF16).view(q.shape), {}, "swa_cache overlaps out"),
        (sinks_inside[: q.numel()].view(q.shape), {"sinks": sinks}, "sinks overlaps out"),
    ]:
        with pytest.raises(ValueError, match=match):
            checks.check_decode(**{**args, **change}, need_cuda=False, out=out)


# ---------------------------------------------------------------- custom op


def test_fake_implementations_give_the_output_shapes():
    q = torch.empty(3, 2, 16, abi.HEAD_DIM, dtype=BF16, device="meta")
    cache = torch.empty(4, 64, abi.RECORD_BYTES, dtype=torch.uint8, device="meta")
    slots = torch.empty(3, 2, 100, dtype=torch.int32, device="meta")
    out, lse = torch.ops.nvfp4_mla.sparse_mla_decode(q, cache, slots, None, None, None, None, SM_SCALE, None)
    assert out.shape == q.shape and out.dtype == BF16 and out.device.type == "meta"
    assert lse.shape == (3, 2, 16) and lse.dtype == torch.float32
    lse = torch.ops.nvfp4_mla.sparse_mla_decode_out(q, cache, slots, None, None, None, None, SM_SCALE, None, out)
    assert lse.shape == (3, 2, 16) and lse.dtype == torch.float32


@pytest.mark.parametrize("batch_invariant", [None, True])
@pytest.mark.parametrize("with_out", [False, True])
def test_compile_traces_without_graph_break(seed, with_out, batch_invariant):
    """fullgraph=True fails on any graph break (batch_invariant too); the traced op then runs the
    CPU path."""
    torch._dynamo.reset()
    args = inputs(torch.Generator().manual_seed(seed))
    q, swa_cache, swa_slots = args.pop("q"), args.pop("swa_cache"), args.pop("swa_slots")

    def step(q, swa_cache, swa_slots, swa_lens, extra_cache, extra_slots, sinks):
        out = torch.empty_like(q) if with_out else None
        o, lse = nvfp4_mla.sparse_mla_decode(
            q,
            swa_cache,
            swa_slots,
            swa_lens=swa_lens,
            extra_cache=extra_cache,
            extra_slots=extra_slots,
            sm_scale=SM_SCALE,
            sinks=sinks,
            out=out,
            batch_invariant=batch_invariant,
        )
        return o * 2, lse

    traced = torch.compile(step, fullgraph=True, backend="aot_eager")
    tensors = (args["swa_lens"], args["extra_cache"], args["extra_slots"], args["sinks"])
    got = traced(q, swa_cache, swa_slots, *tensors)
    want = step(q, swa_cache, swa_slots, *tensors)
    assert torch.equal(got[0].view(torch.int16), want[0].view(torch.int16))
    assert torch.equal(got[1].view(torch.int32), want[1].view(torch.int32))
