"""The ``sparse_mla_decode`` op: fused sparse MLA decode attention over the NVFP4 cache, the
planner that picks a backend and divides a call's work, the launches, and the custom ops.

:func:`sparse_mla_decode` has the signature and semantics of
:func:`nvfp4_mla.reference.sparse_mla_decode` (docs/format.md section 9), plus an optional ``out``.
CUDA tensors go to a backend's kernels, other devices to the reference.

**Backends.** Each declares a :class:`~nvfp4_mla.ops.decode_backend.DecodeBackend` (its GPUs, its
kernels, the shapes it prefers, the overrides it accepts): :data:`BACKENDS`, in order of
preference. :func:`select_backend` takes the first that runs on the GPU and prefers the shape.

**Execution.** On a backend that walks a work list (the Hopper kernels): the scheduler
(:mod:`.decode_scheduler`) writes the call's list on the GPU from the rows' live lengths, the
attention kernel's blocks (a block per part, head tile and part of the output dims) walk their
part's segments, and the combine (:mod:`.decode_combine`) merges the rows cut between parts; the
work follows the live tokens, not the tables' widths. On the others (mma.sync): one launch of the
attention kernel, a block per query row, head tile and split of the selected tokens, plus the
combine when the tokens are split (:mod:`.decode_schedule`: a function of the shapes and the
device). Either way the split is a function of the shapes, the device and the lengths, and the
combine adds a row's partials in a fixed order, so equal inputs give equal bits on every run. A
warm call does the checks of :mod:`nvfp4_mla.validation`, one plan lookup and its allocations (the
outputs and the workspace, through torch's caching allocator on the current stream), with no host
synchronisation: it can be captured in a CUDA graph, and its work follows lengths that change
between replays.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import TYPE_CHECKING, NamedTuple

import torch
from torch.autograd.graph import increment_version

from .. import abi, reference, validation
from ..device import Device, device_info
from ..launch import Launcher, contiguous_strides, current_raw_stream, new_output
from . import decode_combine, decode_mma, decode_scheduler, decode_sm90
from .decode_backend import OVERRIDES, DecodeBackend, arch_capability
from .decode_schedule import MAX_SPLITS, choose_dim_parts, choose_split_and_parts
from .library import DEFAULT, KernelLibrary, check_traceable

if TYPE_CHECKING:
    from typing import TypeAlias

    from .decode_backend import Attention

    # A call's pool as the launches take it: (cache, slots, lens, layout), the layout a
    # validation.CacheLayout (num_pages, page_size, page_stride); all None for a missing extra pool.
    SwaPool: TypeAlias = tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, tuple[int, int, int]]
    Pool: TypeAlias = tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None, tuple[int, int, int] | None]

# A segment's cost besides its tiles, in tiles (its query load and output rows): the scheduler
# balances the parts by tiles plus this a segment.
SEGMENT_COST = 1
# The most parts of a work list: one row may be cut at every boundary, and the combine merges up to
# MAX_PARTIALS partials a row.
MAX_LIST_PARTS = min(decode_combine.MAX_PARTIALS, decode_scheduler.MAX_PARTS)

# Every backend, in order of preference.
BACKENDS: dict[str, DecodeBackend] = {b.name: b for b in (*decode_sm90.BACKENDS, decode_mma.BACKEND)}

_LOG2E = 1.0 / math.log(2.0)


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
    """The launches of one call shape on one device."""

    backend: str
    attend: Launcher
    head_tile: int
    blocks: int  # of the attention launch
    num_splits: int  # without a work list: of a row's selected tokens
    tiles_per_split: int
    dim_parts: int  # of a row's output dims, an item each
    combine: Launcher | None  # None: no split
    q_map: Callable[[int], bytes] | None  # q's address -> the tensor map that ends the attention Params
    parts: int = 0  # of the work list; 0: no list (the width split)
    scheduler: Launcher | None = None  # writes the work list of a call with lengths
    combine_blocks: int = 0  # of the combine launch
    workspace: int = 0  # fp32 values of the call's workspace: the work list (with lengths), then the partials
    slots: int = 0  # partial slots the workspace holds (with a work list)
    work: torch.Tensor | None = None  # a call without lengths: its work list, on the device


def plan(
    lib: KernelLibrary,
    device_index: int,
    num_heads: int,
    rows: int,
    k_swa: int,
    k_extra: int,
    lengths: bool = True,
) -> DecodePlan:
    """The plan of a call on ``device_index`` (compiling or loading its kernels on a miss):
    ``rows`` query rows (batch * q_len) of ``num_heads`` heads over tables of ``k_swa`` and
    ``k_extra`` entries, with length tensors (``lengths``: the work list is written on the GPU
    each call) or without (every entry counts: the list is made here, once). ``lib``'s decode
    fields override the backend, head tile, split, parts and dim parts."""
    key = ("decode", device_index, num_heads, rows, k_swa, k_extra, lengths)
    found = lib.plans.get(key)
    if found is not None:
        return found
    forced = lib.decode_backend
    if forced is not None and forced not in BACKENDS:
        raise ValueError(f"decode backend {forced!r} is not one of {sorted(BACKENDS)}")
    gpu = device_info(device_index)
    backend = select_backend(gpu, num_heads, rows, k_swa + k_extra) if forced is None else BACKENDS[forced]
    if not backend.supports(gpu.capability):
        raise ValueError(f"decode backend {backend.name!r} does not run on {gpu.arch}")
    check_overrides(lib, backend)
    attention = backend.attention(lib, gpu, num_heads, 1)
    if attention.work_list:
        return lib.remember(key, _list_plan(lib, gpu, backend, attention, num_heads, rows, k_swa + k_extra, lengths))
    blocks = rows * -(-num_heads // attention.head_tile)
    num_tiles = -(-(k_swa + k_extra) // attention.tile_tokens)
    parts = backend.dim_parts if lib.decode_dim_parts is None else (lib.decode_dim_parts,)
    if lib.decode_splits is None:
        resident = attention.launcher.resident_blocks
        num_splits, tiles_per_split, dim_parts = choose_split_and_parts(
            parts, blocks, num_tiles, resident, attention.max_blocks, rows * num_heads, attention.halves_pair
        )
    else:
        tiles_per_split = -(-num_tiles // min(lib.decode_splits, MAX_SPLITS))
        num_splits = -(-num_tiles // tiles_per_split)
        dim_parts = choose_dim_parts(parts, blocks * num_splits, attention.max_blocks)
    dim_parts = lib.decode_dim_parts or dim_parts
    if dim_parts != 1:
        attention = backend.attention(lib, gpu, num_heads, dim_parts)
    combine = decode_combine.launcher(lib, device_index, rows * num_heads) if num_splits > 1 else None
    items = blocks * num_splits * attention.dim_parts
    found = DecodePlan(
        backend.name,
        attention.launcher,
        attention.head_tile,
        min(items, attention.max_blocks) if attention.max_blocks else items,
        num_splits,
        tiles_per_split,
        attention.dim_parts,
        combine,
        None if attention.q_map is None else attention.q_map(num_heads, rows),
    )
    return lib.remember(key, found)


def _list_plan(
    lib: KernelLibrary,
    gpu: Device,
    backend: DecodeBackend,
    attention: Attention,
    num_heads: int,
    rows: int,
    tokens: int,
    lengths: bool,
) -> DecodePlan:
    """The plan of a backend that walks a work list, a block per (part, head tile, dim part).

    The dim parts are the width split's (:mod:`.decode_schedule`, at the tables' ``tokens``), or
    ``lib.decode_dim_parts``. With length tensors the scheduler writes the list on the GPU each
    call: its parts fill the GPU at once (or ``lib.decode_parts``). Without, every row has the
    tables' ``tokens``: the list is made here once and kept on the device, the width split's
    (row, split) items dealt into parts, or with ``lib.decode_parts`` as the scheduler deals
    them."""
    head_tiles = -(-num_heads // attention.head_tile)
    tiles = decode_scheduler.live_tiles(tokens, 0, attention.tile_tokens)
    dims = backend.dim_parts if lib.decode_dim_parts is None else (lib.decode_dim_parts,)
    resident = attention.launcher.resident_blocks
    num_splits, tiles_per_split, dim_parts = choose_split_and_parts(
        dims, rows * head_tiles, tiles, resident, attention.max_blocks, rows * num_heads, attention.halves_pair
    )
    dim_parts = lib.decode_dim_parts or dim_parts
    known = None
    if not lengths and lib.decode_parts is None:
        parts = min(rows * num_splits, max(attention.max_blocks // (head_tiles * dim_parts), 1), MAX_LIST_PARTS)
        known = decode_scheduler.split_schedule(rows, num_splits, tiles_per_split, parts)
    else:
        num_splits = 1  # the kernel's early dependent launch: the list's splits are not the width's
    if dim_parts != 1:
        attention = backend.attention(lib, gpu, num_heads, dim_parts)
    per_part = head_tiles * attention.dim_parts
    if lib.decode_parts is not None and not 1 <= lib.decode_parts <= MAX_LIST_PARTS:
        raise ValueError(f"decode_parts must be in [1, {MAX_LIST_PARTS}], got {lib.decode_parts}")
    if known is None:
        parts = lib.decode_parts or min(max(attention.max_blocks // per_part, 1), MAX_LIST_PARTS)
        if not lengths:
            known = decode_scheduler.schedule([tiles] * rows, parts, SEGMENT_COST)
    split_rows = min(parts - 1, rows)  # a boundary between parts cuts at most one row
    slots = parts - 1 + split_rows  # cuts, plus a slot more a split row
    list_values = -(-decode_scheduler.work_ints(parts) // 4) * 4  # the partials start 16-byte aligned
    work = None
    if known is not None:
        split_rows = sum(row >= 0 for row, _ in known.split_rows)
        slots = known.split_rows[-1][1]  # past the split rows: (-1, slots)
        work = torch.tensor(known.ints(), dtype=torch.int32, device=torch.device("cuda", gpu.index))
        list_values = 0
    combine = decode_combine.launcher(lib, gpu.index, split_rows * num_heads) if split_rows else None
    return DecodePlan(
        backend.name,
        attention.launcher,
        attention.head_tile,
        parts * per_part,
        num_splits,
        0,
        attention.dim_parts,
        combine,
        None if attention.q_map is None else attention.q_map(num_heads, rows),
        parts,
        None if known is not None else lib.launcher(gpu.index, lib.spec(decode_scheduler.SchedulerSpec())),
        split_rows * num_heads,
        list_values + slots * num_heads * (abi.HEAD_DIM + 2),
        slots,
        work,
    )


def _pool_params(
    cache: torch.Tensor | None,
    slots: torch.Tensor | None,
    lens: torch.Tensor | None,
    layout: tuple[int, int, int] | None,
) -> tuple[int, ...]:
    if cache is None or slots is None or layout is None:  # no second pool: k = 0, never read
        return (0, 0, 0, 0, 1, 0, 0, 0, 0)
    num_pages, page_size, page_stride = layout
    return (
        cache.data_ptr(),
        slots.data_ptr(),
        0 if lens is None else lens.data_ptr(),
        page_stride,
        page_size,
        num_pages * page_size,
        slots.shape[2],
        int(slots.dtype is torch.int64),
        int(lens is not None and lens.dtype is torch.int64),
    )


def _decode_cuda(
    lib: KernelLibrary,
    q: torch.Tensor,
    swa_cache: torch.Tensor,
    swa_slots: torch.Tensor,
    swa_lens: torch.Tensor | None,
    extra_cache: torch.Tensor | None,
    extra_slots: torch.Tensor | None,
    extra_lens: torch.Tensor | None,
    sm_scale: float,
    sinks: torch.Tensor | None,
    out: torch.Tensor | None,
    planned: SparseMlaDecodePlan | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    swa, extra = validation.check_decode(
        q, swa_cache, swa_slots, swa_lens, extra_cache, extra_slots, extra_lens, sm_scale, sinks, True, out
    )
    if planned is not None:
        planned.check(q, swa_slots, swa_lens, extra_slots, extra_lens)
    device = q.get_device()
    batch, q_len, num_heads = q.shape[0], q.shape[1], q.shape[2]
    if out is not None:
        increment_version(out)  # written in place: autograd and views must see a new version
    else:  # the kernels write every element of out and lse
        out_shape = tuple(q.shape)
        out = new_output(q, out_shape, contiguous_strides(out_shape), torch.bfloat16, device)
    lse_shape = (batch, q_len, num_heads)
    lse = new_output(q, lse_shape, contiguous_strides(lse_shape), torch.float32, device)
    rows = batch * q_len
    if rows == 0:
        return out, lse
    if planned is None:
        k_swa, k_extra = swa_slots.shape[2], 0 if extra_slots is None else extra_slots.shape[2]
        lengths = swa_lens is not None or extra_lens is not None
        found = lib.plans.get(("decode", device, num_heads, rows, k_swa, k_extra, lengths))  # plan()'s key, inline
        if found is None:
            found = plan(lib, device, num_heads, rows, k_swa, k_extra, lengths)
        work = 0
    else:
        found, work = planned.launches, planned.work_address
        assert found is not None  # a plan made on CUDA tensors with rows, as the check found
    pools = (swa_cache, swa_slots, swa_lens, swa), (extra_cache, extra_slots, extra_lens, extra)
    launch(found, q, out, lse, sm_scale, sinks, *pools, work)
    return out, lse


def launch(
    plan: DecodePlan,
    q: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    sm_scale: float,
    sinks: torch.Tensor | None,
    swa_pool: SwaPool,
    extra_pool: Pool,
    work: int = 0,
) -> None:
    """The launches of ``plan`` on checked arguments; each pool is ``(cache, slots, lens,
    layout)``, all None for a missing extra pool; ``work``: the address of a public plan's work
    list (0: the call writes its own). With splits, the fp32 workspace comes from torch's caching
    allocator on the current stream."""
    num_heads, device, q_ptr = q.shape[2], q.get_device(), q.data_ptr()
    rows = q.shape[0] * q.shape[1]  # batch * q_len
    stream = current_raw_stream(device)
    sinks_ptr = 0 if sinks is None else sinks.data_ptr()
    if plan.parts:
        _launch_list(plan, q, out, lse, sm_scale, sinks_ptr, swa_pool, extra_pool, stream, rows, work)
        return
    partial_o = partial_ml = 0
    if plan.combine is not None:
        entries = rows * num_heads * plan.num_splits
        workspace = new_output(q, (entries * (abi.HEAD_DIM + 2),), (1,), torch.float32, device)
        partial_o = workspace.data_ptr()
        partial_ml = partial_o + entries * abi.HEAD_DIM * 4
    plan.attend.launch(
        plan.blocks,
        1,
        1,
        plan.attend.shared_bytes,
        stream,
        q_ptr,
        out.data_ptr(),
        lse.data_ptr(),
        partial_o,
        partial_ml,
        sinks_ptr,
        *_pool_params(*swa_pool),
        *_pool_params(*extra_pool),
        rows,
        num_heads,
        plan.num_splits,
        plan.tiles_per_split,
        float(sm_scale) * _LOG2E,  # type: ignore[arg-type]  # Params' double: struct packs it with "d"
        *(() if plan.q_map is None else (plan.q_map(q_ptr),)),
    )
    if plan.combine is not None:
        plan.combine.launch(
            rows * num_heads,
            1,
            1,
            0,
            stream,
            partial_o,
            partial_ml,
            sinks_ptr,
            out.data_ptr(),
            lse.data_ptr(),
            num_heads,
            plan.num_splits,
            0,
            0,
        )


def _schedule(
    plan: DecodePlan,
    stream: int,
    work: int,
    rows: int,
    k_swa: int,
    swa_lens: torch.Tensor | None,
    k_extra: int,
    extra_lens: torch.Tensor | None,
) -> None:
    """The scheduler's launch: the work list of ``plan`` at ``work`` from the rows' lengths."""
    scheduler = plan.scheduler
    assert scheduler is not None
    decode_scheduler.launch(
        scheduler,
        stream,
        work,
        plan.parts,
        rows,
        k_swa,
        swa_lens,
        k_extra,
        extra_lens,
        decode_sm90.BLOCK_N,
        SEGMENT_COST,
    )


def _launch_list(
    plan: DecodePlan,
    q: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    sm_scale: float,
    sinks_ptr: int,
    swa_pool: SwaPool,
    extra_pool: Pool,
    stream: int,
    rows: int,
    work: int = 0,
) -> None:
    """The launches of a plan with a work list: the scheduler writes the list at the start of the
    call's workspace (unless the plan holds it, or a public plan's list is at ``work``), the
    attention kernel walks it, and the combine merges the split rows' partials (their slots in the
    workspace, after the list)."""
    num_heads, device = q.shape[2], q.get_device()
    partial_o = partial_ml = 0
    if plan.workspace:
        workspace = new_output(q, (plan.workspace,), (1,), torch.float32, device)
        partial_ml = workspace.data_ptr() + 4 * (plan.workspace - plan.slots * num_heads * 2)
        partial_o = partial_ml - plan.slots * num_heads * abi.HEAD_DIM * 4
    host_list = plan.work  # the host's list, written at planning: read before the kernels' waits
    static = host_list is not None
    if host_list is not None:
        work = host_list.data_ptr()
    elif not work:
        work = workspace.data_ptr()
        extra_k = 0 if extra_pool[1] is None else extra_pool[1].shape[2]
        _schedule(plan, stream, work, rows, swa_pool[1].shape[2], swa_pool[2], extra_k, extra_pool[2])
    plan.attend.launch(
        plan.blocks,
        1,
        1,
        plan.attend.shared_bytes,
        stream,
        q.data_ptr(),
        out.data_ptr(),
        lse.data_ptr(),
        partial_o,
        partial_ml,
        sinks_ptr,
        *_pool_params(*swa_pool),
        *_pool_params(*extra_pool),
        rows,
        num_heads,
        plan.num_splits,
        0,
        float(sm_scale) * _LOG2E,  # type: ignore[arg-type]  # Params' double: struct packs it with "d"
        work,
        int(static),
        plan.q_map(q.data_ptr()),  # type: ignore[misc,arg-type]  # raw bytes: the Params' tensor map
    )
    if plan.combine is not None:
        plan.combine.launch(
            plan.combine_blocks,
            1,
            1,
            0,
            stream,
            partial_o,
            partial_ml,
            sinks_ptr,
            out.data_ptr(),
            lse.data_ptr(),
            num_heads,
            0,
            work + decode_scheduler.PART_INTS * 4 * plan.parts,
            int(static),
        )


def _decode(
    lib: KernelLibrary,
    q: torch.Tensor,
    swa_cache: torch.Tensor,
    swa_slots: torch.Tensor,
    swa_lens: torch.Tensor | None,
    extra_cache: torch.Tensor | None,
    extra_slots: torch.Tensor | None,
    extra_lens: torch.Tensor | None,
    sm_scale: float,
    sinks: torch.Tensor | None,
    out: torch.Tensor | None,
    planned: SparseMlaDecodePlan | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    if isinstance(q, torch.Tensor) and q.is_cuda:
        return _decode_cuda(
            lib, q, swa_cache, swa_slots, swa_lens, extra_cache, extra_slots, extra_lens, sm_scale, sinks, out, planned
        )
    found = reference.sparse_mla_decode(
        q,
        swa_cache,
        swa_slots,
        swa_lens=swa_lens,
        extra_cache=extra_cache,
        extra_slots=extra_slots,
        extra_lens=extra_lens,
        sm_scale=sm_scale,
        sinks=sinks,
        out=out,
    )
    if planned is not None:  # the reference needs no plan: the arguments checked, then the plan
        planned.check(q, swa_slots, swa_lens, extra_slots, extra_lens)
    return found


# ---------------------------------------------------------------- plans


def _same_tensor(a: torch.Tensor | None, b: torch.Tensor | None) -> bool:
    if a is b:
        return True
    if a is None or b is None or not isinstance(a, torch.Tensor):
        return False
    return a.data_ptr() == b.data_ptr() and a.dtype == b.dtype and a.shape == b.shape and a.device == b.device


class SparseMlaDecodePlan:
    """The work of the ``sparse_mla_decode`` calls of one decode step: one batch shape, one
    device, one pair of length tensors (docs/format.md, "Plans"). Made by
    :func:`plan_sparse_mla_decode`; pass it as ``plan=`` to every call of the step (every layer),
    and call :meth:`update` when the lengths' values change."""

    __slots__ = (
        "batch",
        "device",
        "extra_lens",
        "k_extra",
        "k_swa",
        "launches",
        "library",
        "num_heads",
        "q_len",
        "swa_lens",
        "work",
        "work_address",
    )

    def __init__(
        self,
        num_heads: int,
        swa_slots: torch.Tensor,
        swa_lens: torch.Tensor | None,
        extra_slots: torch.Tensor | None,
        extra_lens: torch.Tensor | None,
        library: KernelLibrary,
        launches: DecodePlan | None,
        work: torch.Tensor | None,
    ) -> None:
        self.batch, self.q_len, self.k_swa = swa_slots.shape
        self.num_heads = num_heads
        self.k_extra = 0 if extra_slots is None else extra_slots.shape[2]
        self.device = swa_slots.get_device()  # -1 off CUDA
        self.swa_lens, self.extra_lens = swa_lens, extra_lens
        self.library: KernelLibrary = library
        self.launches: DecodePlan | None = launches  # None: no CUDA launch (CPU tensors, no rows)
        self.work: torch.Tensor | None = work  # the work list the scheduler writes, or the host's
        self.work_address = 0 if work is None or launches is None or launches.work is not None else work.data_ptr()

    @property
    def parts(self) -> int:
        """The parts of the work list (0: the call's backend splits by the tables' widths)."""
        return 0 if self.launches is None else self.launches.parts

    @property
    def workspace_bytes(self) -> int:
        """Bytes a call with this plan takes from torch's caching allocator for its partial outputs."""
        if self.launches is None or not self.launches.workspace:
            return 0
        return 4 * self.launches.workspace

    def update(self) -> None:
        """Writes the work list again from the length tensors' values now: one launch of the
        scheduler on the current stream, no host synchronisation, capturable in a CUDA graph. Run
        it on the stream of the calls (or order the streams) before the calls that should follow
        the new lengths. Nothing to do where the plan has no scheduled list (no length tensors,
        the ``mma_sync`` backend, CPU tensors)."""
        if self.work_address:
            stream = current_raw_stream(self.device)
            rows = self.batch * self.q_len
            assert self.launches is not None
            _schedule(
                self.launches, stream, self.work_address, rows, self.k_swa, self.swa_lens, self.k_extra, self.extra_lens
            )

    def __repr__(self) -> str:
        where = "cpu" if self.device < 0 else f"cuda:{self.device}"
        return (
            f"SparseMlaDecodePlan(batch={self.batch}, q_len={self.q_len}, num_heads={self.num_heads}, "
            f"k_swa={self.k_swa}, k_extra={self.k_extra}, device={where}, parts={self.parts})"
        )

    def check(
        self,
        q: torch.Tensor,
        swa_slots: torch.Tensor,
        swa_lens: torch.Tensor | None,
        extra_slots: torch.Tensor | None,
        extra_lens: torch.Tensor | None,
    ) -> None:
        """ValueError unless a call of these arguments is one this plan was made for."""
        k_extra = 0 if extra_slots is None else extra_slots.shape[2]
        got = (q.get_device(), tuple(q.shape[:3]), swa_slots.shape[2], k_extra)
        if got != (self.device, (self.batch, self.q_len, self.num_heads), self.k_swa, self.k_extra):
            raise ValueError(
                f"plan= was made for another call: {self!r}; this call has q {list(q.shape)} on {q.device}, "
                f"k_swa={swa_slots.shape[2]}, k_extra={k_extra}"
            )
        if not (_same_tensor(swa_lens, self.swa_lens) and _same_tensor(extra_lens, self.extra_lens)):
            raise ValueError(
                "plan= reads the length tensors it was made with: pass the same swa_lens and extra_lens "
                "(or None where the plan has none), and call plan.update() after their values change"
            )


def plan_sparse_mla_decode(
    num_heads: int,
    swa_slots: torch.Tensor,
    *,
    swa_lens: torch.Tensor | None = None,
    extra_slots: torch.Tensor | None = None,
    extra_lens: torch.Tensor | None = None,
    library: KernelLibrary | None = None,
) -> SparseMlaDecodePlan:
    """A plan for the ``sparse_mla_decode`` calls of one decode step: ``num_heads`` heads over
    the slot tables ``swa_slots`` (``[batch, q_len, k]``) and ``extra_slots``, with the length
    tensors ``swa_lens`` and ``extra_lens`` that the calls will pass (the same tensors).

    On the Hopper kernels with length tensors the plan holds the step's work list: it runs the
    scheduler once here (on the current stream) and again at each :meth:`~SparseMlaDecodePlan.update`,
    and the calls with ``plan=`` launch no scheduler. The list is read-only and shared by the calls;
    their partial outputs come per call from the current stream, so one plan may serve calls on two
    streams at once. A call whose shapes, device or length tensors are not the plan's is refused.
    A plan whose lengths changed without an update gives wrong outputs but reads nothing outside
    the tables (each row's live entries are read from its lengths at each call). On CPU tensors
    the plan is checked and the reference runs. Make the plan outside a CUDA graph capture (it may
    compile kernels and allocate); its ``update`` and the calls may be captured.

    Raises
    ------
    ValueError
        On an argument outside the contract of ``sparse_mla_decode``'s tables and lengths.
    """
    validation.check_decode_plan(num_heads, swa_slots, swa_lens, extra_slots, extra_lens)
    lib = DEFAULT if library is None else library
    rows = swa_slots.shape[0] * swa_slots.shape[1]
    launches = work = None
    if swa_slots.is_cuda and rows > 0:
        k_extra = 0 if extra_slots is None else extra_slots.shape[2]
        lengths = swa_lens is not None or extra_lens is not None
        launches = plan(lib, swa_slots.get_device(), num_heads, rows, swa_slots.shape[2], k_extra, lengths)
        if launches.work is not None:
            work = launches.work  # the host's list: the plan keeps it alive
        elif launches.parts:
            work = torch.empty(decode_scheduler.work_ints(launches.parts), dtype=torch.int32, device=swa_slots.device)
    found = SparseMlaDecodePlan(num_heads, swa_slots, swa_lens, extra_slots, extra_lens, lib, launches, work)
    found.update()
    return found


# ---------------------------------------------------------------- torch custom ops
# So torch.compile traces the entry without a graph break; eager calls skip the dispatcher.

_Tensor = torch.Tensor
_OptTensor = torch.Tensor | None


@torch.library.custom_op("nvfp4_mla::sparse_mla_decode", mutates_args=())
def _decode_op(
    q: _Tensor,
    swa_cache: _Tensor,
    swa_slots: _Tensor,
    swa_lens: _OptTensor,
    extra_cache: _OptTensor,
    extra_slots: _OptTensor,
    extra_lens: _OptTensor,
    sm_scale: float,
    sinks: _OptTensor,
) -> tuple[_Tensor, _Tensor]:
    args = (q, swa_cache, swa_slots, swa_lens, extra_cache, extra_slots, extra_lens, sm_scale, sinks)
    out, lse = _decode(DEFAULT, *args, None)
    return out, lse


@_decode_op.register_fake
def _(
    q: _Tensor,
    swa_cache: _Tensor,
    swa_slots: _Tensor,
    swa_lens: _OptTensor,
    extra_cache: _OptTensor,
    extra_slots: _OptTensor,
    extra_lens: _OptTensor,
    sm_scale: float,
    sinks: _OptTensor,
) -> tuple[_Tensor, _Tensor]:
    return q.new_empty(q.shape), q.new_empty(q.shape[:3], dtype=torch.float32)


@torch.library.custom_op("nvfp4_mla::sparse_mla_decode_out", mutates_args=("out",))
def _decode_out_op(
    q: _Tensor,
    swa_cache: _Tensor,
    swa_slots: _Tensor,
    swa_lens: _OptTensor,
    extra_cache: _OptTensor,
    extra_slots: _OptTensor,
    extra_lens: _OptTensor,
    sm_scale: float,
    sinks: _OptTensor,
    out: _Tensor,
) -> _Tensor:
    args = (q, swa_cache, swa_slots, swa_lens, extra_cache, extra_slots, extra_lens, sm_scale, sinks)
    _, lse = _decode(DEFAULT, *args, out)
    return lse


@_decode_out_op.register_fake
def _(
    q: _Tensor,
    swa_cache: _Tensor,
    swa_slots: _Tensor,
    swa_lens: _OptTensor,
    extra_cache: _OptTensor,
    extra_slots: _OptTensor,
    extra_lens: _OptTensor,
    sm_scale: float,
    sinks: _OptTensor,
    out: _Tensor,
) -> _Tensor:
    return q.new_empty(q.shape[:3], dtype=torch.float32)


_is_compiling = torch.compiler.is_compiling


def sparse_mla_decode(
    q: torch.Tensor,
    swa_cache: torch.Tensor,
    swa_slots: torch.Tensor,
    *,
    swa_lens: torch.Tensor | None = None,
    extra_cache: torch.Tensor | None = None,
    extra_slots: torch.Tensor | None = None,
    extra_lens: torch.Tensor | None = None,
    sm_scale: float,
    sinks: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    library: KernelLibrary | None = None,
    plan: SparseMlaDecodePlan | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sparse MLA decode attention read straight from one or two NVFP4 caches.

    The semantics of :func:`nvfp4_mla.reference.sparse_mla_decode` (docs/format.md section 9):
    masked entries (invalid slots, entries past ``lens``) are never read, a row with nothing
    live gives 0 and ``lse = +inf``, ``lse`` is the natural log-sum-exp before the sink. On CUDA
    tensors the kernel accumulates in fp32 with BF16 tensor-core products (P is rounded to BF16
    for P.V); it matches the reference within ``2^-7 |ref| + 2^-8 sum_j w_j |row_j|`` (times
    the sink factor) plus ``2^-126`` for ``out`` and ``1e-4 max(1, |lse|)`` for ``lse``. Other
    devices run the reference.

    Against FlashInfer's SM120 sparse backend,
    ``flashinfer.mla.trtllm_batch_decode_sparse_mla_dsv4(query, swa_kv_cache, workspace_buffer,
    sparse_indices, compressed_kv_cache, ..., bmm1_scale=, sinks=, swa_topk_lens=,
    extra_sparse_indices=, extra_sparse_topk_lens=)``: ``q`` is ``query``; ``swa_cache``,
    ``swa_slots``, ``swa_lens`` are ``swa_kv_cache``, ``sparse_indices`` and ``swa_topk_lens``
    (as ``[batch, q_len]``); ``extra_cache``, ``extra_slots``, ``extra_lens`` are
    ``compressed_kv_cache``, ``extra_sparse_indices`` and ``extra_sparse_topk_lens``; ``sm_scale``
    is ``bmm1_scale`` (``bmm2_scale`` must be 1 there, and has no counterpart); ``sinks`` is
    ``sinks``. No workspace argument: split partials are allocated per call. The caches are this
    library's 384-byte records, not FlashInfer's 584-byte FP8 ones, and ``lse`` is returned too.

    Parameters
    ----------
    q
        BF16 ``[batch, q_len, heads, 512]``, contiguous (the rotated queries).
    swa_cache, swa_slots
        The sliding-window pool: a cache (docs/format.md section 3) and its contiguous int32 or
        int64 slot table ``[batch, q_len, k]`` (``page * page_size + entry``; -1 or any invalid
        slot is masked).
    swa_lens
        Optional contiguous int32 or int64 ``[batch, q_len]``: only the first ``lens`` entries of a
        row count (clamped to ``[0, k]``).
    extra_cache, extra_slots, extra_lens
        The optional second (compressed) pool, likewise; its page size, slot dtype and ``k`` may
        differ from the first pool's.
    sm_scale
        The softmax scale of ``q . row``.
    sinks
        Optional fp32 ``[heads]`` attention-sink logits.
    out
        Optional BF16 ``[batch, q_len, heads, 512]`` output to fill (contiguous, on q's device,
        sharing no memory with the inputs). It is returned.
    library
        The kernels, backend choice and plan table to use on CUDA tensors (tests and benchmarks);
        default: the process's, or the plan's.
    plan
        A plan from :func:`plan_sparse_mla_decode` for this call's shapes, device and length
        tensors: the step's work list, so the call launches no scheduler (docs/format.md,
        "Plans"). Eager calls only.

    Returns
    -------
    tuple[torch.Tensor, torch.Tensor]
        ``out`` (before the inverse RoPE of its last 64 dims) and ``lse`` fp32 ``[batch, q_len, heads]``.

    Raises
    ------
    ValueError
        On any argument outside the contract, before anything is launched.
    """
    if _is_compiling():  # traced with fake tensors: the op checks its arguments when it runs
        check_traceable(library)
        if plan is not None:
            raise ValueError("plan= is for eager calls: under torch.compile each call plans its own work")
        args = (q, swa_cache, swa_slots, swa_lens, extra_cache, extra_slots, extra_lens, float(sm_scale), sinks)
        if out is None:
            return torch.ops.nvfp4_mla.sparse_mla_decode(*args)
        return out, torch.ops.nvfp4_mla.sparse_mla_decode_out(*args, out)
    if plan is None:
        lib = DEFAULT if library is None else library
    elif not isinstance(plan, SparseMlaDecodePlan):
        raise ValueError(f"plan must come from nvfp4_mla.plan_sparse_mla_decode, got {type(plan).__name__}")
    elif library is not None and library is not plan.library:
        raise ValueError("plan= carries the library it was made with: pass library= to plan_sparse_mla_decode")
    else:
        lib = plan.library
    pools = (swa_cache, swa_slots, swa_lens, extra_cache, extra_slots, extra_lens)
    return _decode(lib, q, *pools, sm_scale, sinks, out, plan)
