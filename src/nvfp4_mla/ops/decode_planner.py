"""How ``sparse_mla_decode`` plans a call: the backend that runs it and how its work is divided.

**Backends.** Each declares a :class:`~nvfp4_mla.ops.decode_backend.DecodeBackend` (its GPUs, its
kernels, the shapes it prefers, the overrides it accepts): :data:`BACKENDS`, in order of
preference. :func:`select_backend` takes the first that runs on the GPU and prefers the shape.

**The work.** Every backend walks a work list: a call's plan holds the list's parts, a block
per part, head tile and part of the output dims. With length tensors the scheduler
(:mod:`.decode_scheduler`) writes the list on the GPU each call; without them the list is made
here once, from the split of the rows by the tables' widths (:mod:`.decode_schedule`). A
:class:`DecodePlan` is kept in the library's plan table, so a warm call does one lookup;
:mod:`.decode_launch` launches it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch

from .. import abi
from ..device import Device, device_info
from ..launch import Launcher
from . import decode_combine, decode_mma, decode_scheduler, decode_sm90
from .decode_backend import OVERRIDES, Attention, DecodeBackend, arch_capability
from .decode_schedule import (
    COMBINE_COST,
    choose_dim_parts,
    choose_split_and_parts,
    deals_half_rows,
    lengths_dim_parts,
)
from .library import KernelLibrary

# The most parts of a work list: one row may be cut at every boundary, and the combine merges up to
# MAX_PARTIALS partials a row.
MAX_LIST_PARTS = min(decode_combine.MAX_PARTIALS, decode_scheduler.MAX_PARTS)

# Every backend, in order of preference.
BACKENDS: dict[str, DecodeBackend] = {b.name: b for b in (*decode_sm90.BACKENDS, decode_mma.BACKEND)}
# The row count a batch-invariant plan selects its backend for, whatever the call's: the backend's
# kernel, hence a row's bits, then depend on the heads and the tables' widths alone.
INVARIANT_ROWS = 1 << 24


def list_costs(attention: Attention) -> tuple[int, int]:
    """``(segment cost, combine cost)`` of a work list walked by ``attention``: the scheduler
    balances the parts by tiles plus the kernel's segment cost a segment, and keeps rows whole
    where that costs a part no more than the combine's cost (the width split's ``COMBINE_COST``)
    past a cut list's bound (both measured: docs/performance.md#the-decode-scheduler)."""
    return attention.segment_cost, COMBINE_COST


def select_backend(gpu: Device, num_heads: int, rows: int, tokens: int) -> DecodeBackend:
    """The backend of a call of ``rows`` query rows of ``num_heads`` heads over ``tokens`` selected
    tokens a row (both tables' widths): the first of :data:`BACKENDS` that runs on the GPU and
    prefers the shape. docs/format.md section 12 says where each is taken."""
    capability = gpu.capability
    found = next((b for b in BACKENDS.values() if b.supports(capability) and b.prefers(num_heads, rows, tokens)), None)
    if found is None:
        raise ValueError(f"no decode backend runs on {gpu.arch}")
    return found


def specs(arch: str) -> tuple:
    """Every kernel ``sparse_mla_decode`` may launch on a GPU of ``arch``: each supporting
    backend's, the combine's builds and the scheduler."""
    capability = arch_capability(arch)
    kernels = [s for b in BACKENDS.values() if b.supports(capability) for s in b.specs(arch)]
    return (*kernels, *decode_combine.specs(), *decode_scheduler.specs())


def check_overrides(lib: KernelLibrary, backend: DecodeBackend) -> None:
    """ValueError for a field of ``lib`` that overrides what ``backend`` does not declare: one of
    its OVERRIDES, or dim parts it has no form for."""
    for field in OVERRIDES:
        value = getattr(lib, field)
        if value is not None and field not in backend.overrides:
            takers = " and ".join(b.name for b in BACKENDS.values() if field in b.overrides)
            raise ValueError(
                f"{field}={value} applies to the {takers} backends' kernels only, but this call runs the "
                f"{backend.name} backend: force decode_backend= with it"
            )
    if lib.decode_dim_parts is not None and lib.decode_dim_parts not in backend.dim_parts:
        raise ValueError(
            f"decode_dim_parts={lib.decode_dim_parts} is not a form of the {backend.name} backend's kernel "
            f"(its forms: {backend.dim_parts})"
        )


class DecodePlan(NamedTuple):
    """The launches of one call shape on one device: a block per (part of the work list, head
    tile, dim part), then the combine of the rows cut between parts."""

    backend: str
    attend: Launcher
    head_tile: int
    blocks: int  # of the attention launch
    num_splits: int  # the host's list: the splits of a row it was dealt from; else 1
    dim_parts: int  # of a row's output dims, a block each
    combine: Launcher | None  # None: no row is cut
    q_map: Callable[[int], bytes] | None  # q's address -> the tensor map that ends the attention Params
    parts: int  # of the work list
    scheduler: Launcher | None  # writes the work list of a call with lengths; None: the host's list
    combine_blocks: int  # of the combine launch
    # fp32 values of a call's workspace: the work list (a list the scheduler writes), then the
    # partial outputs of `slots` slots of num_heads rows, then their (m, l)
    workspace: int
    slots: int
    work: torch.Tensor | None  # a call without lengths: its work list, on the device
    # A call with lengths and no step's list: its attention kernel deals its own list (no scheduler
    # launch before it), where a block has a thread a boundary between parts.
    own_list: bool
    schedule: decode_scheduler.ScheduleFields  # how its list is dealt

    @property
    def tile_tokens(self) -> int:
        """Live entries a tile of the work list."""
        return 1 << self.schedule.tile_shift

    @property
    def whole_rows(self) -> bool:
        """No row is cut between parts (batch-invariant rows)."""
        return bool(self.schedule.whole_rows)


def plan(
    lib: KernelLibrary,
    device_index: int,
    num_heads: int,
    rows: int,
    k_swa: int,
    k_extra: int,
    lengths: bool = True,
    batch_invariant: bool = False,
) -> DecodePlan:
    """The plan of a call on ``device_index`` (compiling or loading its kernels on a miss):
    ``rows`` query rows (batch * q_len) of ``num_heads`` heads over tables of ``k_swa`` and
    ``k_extra`` entries, with length tensors (``lengths``) or without (every entry counts).
    ``lib``'s decode fields override the backend, head tile, parts and dim parts.

    The dim parts are the width split's (:mod:`.decode_schedule`, at the tables' widths), with
    length tensors half rows for few rows (``lengths_dim_parts``), or ``lib.decode_dim_parts``.
    With length tensors the scheduler writes the list on the GPU each call: its parts fill the
    GPU at once (or ``lib.decode_parts``). Without, every row has the tables' entries: the list
    is made here once and kept on the device, the width split's (row, split) items dealt into
    parts, or as the scheduler deals them: in half rows where the width split keeps whole rows
    but a whole-rows block would have little work (``deals_half_rows``), or with
    ``lib.decode_parts``.

    ``batch_invariant``: the backend is the one selected for :data:`INVARIANT_ROWS` rows and no
    row is cut between parts, so a row's tiles are summed by one block in tile order, by a kernel
    that the heads and the widths choose: its bits do not depend on the other rows
    (docs/format.md, "Plans")."""
    key = ("decode", device_index, num_heads, rows, k_swa, k_extra, lengths, batch_invariant)
    found = lib.plans.get(key)
    if found is not None:
        return found
    forced = lib.decode_backend
    if forced is not None and forced not in BACKENDS:
        raise ValueError(f"decode backend {forced!r} is not one of {sorted(BACKENDS)}")
    if lib.decode_parts is not None and not 1 <= lib.decode_parts <= MAX_LIST_PARTS:
        raise ValueError(f"decode_parts must be in [1, {MAX_LIST_PARTS}], got {lib.decode_parts}")
    gpu = device_info(device_index)
    selected_for = INVARIANT_ROWS if batch_invariant else rows
    backend = select_backend(gpu, num_heads, selected_for, k_swa + k_extra) if forced is None else BACKENDS[forced]
    if not backend.supports(gpu.capability):
        raise ValueError(f"decode backend {backend.name!r} does not run on {gpu.arch}")
    check_overrides(lib, backend)
    attention = backend.attention(lib, gpu, num_heads, 1)
    head_tiles = -(-num_heads // attention.head_tile)
    tiles = decode_scheduler.live_tiles(k_swa + k_extra, 0, attention.tile_tokens)
    dims = backend.dim_parts if lib.decode_dim_parts is None else (lib.decode_dim_parts,)
    resident = attention.launcher.resident_blocks
    if batch_invariant:  # whole rows, one split each
        num_splits, tiles_per_split = 1, tiles
        dim_parts = choose_dim_parts(dims, rows * head_tiles, attention.max_blocks)
    else:
        num_splits, tiles_per_split, dim_parts = choose_split_and_parts(
            dims, rows * head_tiles, tiles, resident, attention.max_blocks, rows * num_heads, attention.halves_pair
        )
        if lengths:
            dim_parts = lengths_dim_parts(dims, rows * head_tiles, tiles, attention.max_blocks, dim_parts)
    # Without lengths, where the width split keeps whole rows but a whole-rows block would have
    # little work: the rows in half rows, dealt as a call with lengths deals them.
    half_rows_dealt = (
        not (lengths or batch_invariant or lib.decode_parts or lib.decode_dim_parts)
        and dim_parts == 1
        and deals_half_rows(dims, rows * head_tiles, tiles, attention.max_blocks, num_splits, tiles_per_split)
    )
    dim_parts = lib.decode_dim_parts or (2 if half_rows_dealt else dim_parts)
    if dim_parts != 1:
        attention = backend.attention(lib, gpu, num_heads, dim_parts)
    per_part = head_tiles * attention.dim_parts
    most_parts = min(max(attention.max_blocks // per_part, 1), MAX_LIST_PARTS)
    known = None
    segment_cost, combine_cost = list_costs(attention)
    if not lengths and lib.decode_parts is None and not half_rows_dealt:
        parts = min(rows * num_splits, most_parts)
        known = decode_scheduler.split_schedule(rows, num_splits, tiles_per_split, parts)
    else:
        num_splits = 1  # the kernel's early dependent launch: the list's splits are not the width's
        parts = lib.decode_parts or (min(rows, most_parts) if batch_invariant else most_parts)
        if not lengths:
            known = decode_scheduler.schedule([tiles] * rows, parts, segment_cost, combine_cost, batch_invariant)
    # A boundary between parts cuts at most one row; whole rows: none.
    split_rows = 0 if batch_invariant else min(parts - 1, rows)
    slots = parts - 1 + split_rows if split_rows else 0  # cuts, plus a slot more a split row
    list_values = -(-decode_scheduler.work_ints(parts) // 4) * 4  # the partials start 16-byte aligned
    work = None
    if known is not None:
        split_rows = sum(row >= 0 for row, _ in known.split_rows)
        slots = known.split_rows[-1][1]  # past the split rows: (-1, slots)
        work = torch.tensor(known.ints(), dtype=torch.int32, device=torch.device("cuda", gpu.index))
        list_values = 0
    # The SMs the attention's blocks leave free while the combine's start beside them.
    beside = num_splits <= attention.early_dependents_max_splits and attention.launcher.dependent_launch
    attention_sms = -(-parts * per_part // decode_combine.blocks_an_sm(attention.launcher))
    free_sms = max(gpu.sms - attention_sms, 0) if beside else 0
    combine, combine_blocks = (
        (None, 0) if not split_rows else decode_combine.launcher(lib, gpu.index, split_rows, num_heads, free_sms)
    )
    found = DecodePlan(
        backend.name,
        attention.launcher,
        attention.head_tile,
        parts * per_part,
        num_splits,
        attention.dim_parts,
        combine,
        None if attention.q_map is None else attention.q_map(num_heads, rows),
        parts,
        None if known is not None else lib.launcher(gpu.index, lib.spec(decode_scheduler.spec_for(rows, parts))),
        combine_blocks,
        list_values + slots * num_heads * (abi.HEAD_DIM + 2),
        slots,
        work,
        known is None and parts < attention.launcher.threads,
        decode_scheduler.schedule_fields(parts, attention.tile_tokens, segment_cost, combine_cost, batch_invariant),
    )
    return lib.remember(key, found)
