"""The ``sparse_mla_decode`` op: fused sparse MLA decode attention over the NVFP4 cache, its
backends, the rule that picks one, and its custom ops.

:func:`sparse_mla_decode` has the signature and semantics of
:func:`nvfp4_mla.reference.sparse_mla_decode` (docs/format.md section 9), plus an optional ``out``.
CUDA tensors go to a backend's kernels, other devices to the reference.

**Backends.** Each is one module declaring an :class:`~nvfp4_mla.ops.attention.DecodeBackend`
(its GPUs, its kernels, its attention kernel for a call): :data:`BACKENDS`, in order of
preference. :func:`select_backend` is the one rule that picks among them.

**Execution.** One launch of the attention kernel (its work items are the query rows, head tiles
and splits of the selected tokens, on the Hopper kernel also halves of the output dims where the
plan takes them: a block each, or blocks that walk them in turn), plus one launch of the combine
kernel (``kernels/nvfp4_mla_decode.cu``, shared by every backend) when the tokens are split across
blocks. The split and the parts (:mod:`.decode_split`) are a pure function of the shapes and the
device (never of the data), and the combine adds the splits in a fixed order, so equal inputs give
equal bits on every run. A warm call does the checks of :mod:`nvfp4_mla.validation`, one plan
lookup and its allocations (the outputs and, with splits, an fp32 workspace, all through torch's
caching allocator on the current stream), with no host synchronisation: it can be captured in a
CUDA graph.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import NamedTuple

import torch
from torch.autograd.graph import increment_version

from .. import abi, reference, validation
from ..device import Device, device_info
from ..jit import Template, included_headers
from ..launch import Launcher, contiguous_strides, current_raw_stream, new_output
from ..params import ParamsLayout, int64, pointer
from . import decode_mma, decode_sm90, decode_sm90_narrow
from .attention import DecodeBackend, arch_capability
from .decode_split import MAX_SPLITS, choose_dim_parts, choose_split_and_parts
from .library import DEFAULT, KernelLibrary, check_traceable

BACKENDS: dict[str, DecodeBackend] = {
    b.name: b for b in (decode_mma.BACKEND, decode_sm90.BACKEND, decode_sm90_narrow.BACKEND)
}

COMBINE_THREADS = MAX_SPLITS  # the combine kernel takes a split a thread

# The split combine's two builds load the first splits' partial rows with the splits' (m, l), so
# that up to that many splits a block waits for one round trip of loads, not two. 16 (H200, batch
# 1 at 10 splits: 15.8 -> 13.9 us a call) take registers that leave 6 blocks an SM instead of 12,
# which cost up to 3% where the combine takes more than one wave, so plan() takes that build only
# where it fits one; elsewhere the build of 4, which needs no more registers than none (H200, 2-4
# splits over 1,024-4,096 rows x heads: 0.999-1.020x against none, 11 shapes).
COMBINE_PREFETCH = 16
COMBINE_PREFETCH_WAVES = 4
_LOG2E = 1.0 / math.log(2.0)

COMBINE_PARAMS = ParamsLayout(
    "Params",
    [
        pointer("partial_o", "const float4*", "[rows, num_heads, num_splits, 512]"),
        pointer("partial_ml", "const float2*", "[rows, num_heads, num_splits]: m (log2 units), l"),
        pointer("sinks", "const float*", "[num_heads] or null"),
        pointer("out", "uint2*", "BF16 [rows, num_heads, 512]"),
        pointer("lse", "float*", "[rows, num_heads]"),
        int64("num_heads", "heads of q"),
        int64("num_splits", "at most MAX_SPLITS"),
    ],
)


class CombineSpec(NamedTuple):
    """The split combine kernel, shared by every backend, loading the first ``prefetch`` splits'
    partial rows with the splits' (m, l)."""

    max_splits: int = MAX_SPLITS
    prefetch: int = 0

    @staticmethod
    @functools.cache
    def of(prefetch: int) -> CombineSpec:
        return CombineSpec(MAX_SPLITS, prefetch)

    @property
    def template(self) -> Template:
        function = "nvfp4_mla_decode_combine"
        return Template("nvfp4_mla_combine.cu", function, COMBINE_PARAMS, COMBINE_THREADS, 0, included_headers("nvfp4_mla_combine.cu"), dependent_launch=True)

    def defines(self) -> dict[str, int]:
        """The kernel's ``-D`` constants."""
        return {"MAX_SPLITS": self.max_splits, "PREFETCH": self.prefetch}

    def describe(self) -> str:
        return f"decode split combine, {self.prefetch} splits prefetched"


# The shape rule's thresholds (H200, `nvfp4-mla bench decode --quick --backends` and graph-replayed
# A/Bs, docs/performance.md): on sm_90 the wgmma kernel (64 heads a block, in clusters of two
# blocks that share each dequantized tile) wins from 17 heads at every row count: 1.5-2.6x over the
# mma.sync kernel at 64-128 rows and 1.4-1.6x at 1-2 rows from 33 heads, 1.05-1.32x at 1 row and
# 17-32 heads (whose mma.sync blocks take 32 heads). Up to 16 heads:
# - its NARROW build (16 heads as wgmma's N) from 6 rows, 1.05-1.29x over the 64-head build (6-256
#   rows, 640-8,320 tokens; at 4 rows they tie), and from 2 rows over 4,096 tokens, 1.065-1.29x
#   (8 and 16 heads, 2-5 rows, 4,224 tokens);
# - below those, the 64-head build in paired half rows from 2 rows (1.01-1.27x at 16 heads) but
#   the mma.sync kernel up to 8 heads (1.05-1.27x over the wgmma build at 2-5 rows, 640-2,176
#   tokens, 4 and 8 heads, one shape 0.96x; its 16-head blocks pad 8 heads to 16, the wgmma
#   build to 64);
# - at 1 row the 64-head build from 4,096 tokens (1.02-1.25x at 8-16 heads), else the mma.sync
#   kernel (0.92-1.03x).
WGMMA_MIN_HEADS = 17
LONG_TOKENS = 4096  # selected tokens a row from which the Hopper builds win at 1-5 rows too
NARROW_MAX_HEADS = decode_sm90_narrow.HEAD_TILE
NARROW_MIN_ROWS = 6  # or from 2 rows over LONG_TOKENS
MMA_MAX_HEADS = 8  # at 2-5 rows under LONG_TOKENS: the mma.sync kernel up to this many heads


def select_backend(gpu: Device, num_heads: int, rows: int, tokens: int) -> DecodeBackend:
    """The backend of a call of ``rows`` query rows of ``num_heads`` heads over ``tokens`` selected
    tokens a row (both tables' widths): by architecture first (the backends that support the
    GPU), then by shape where measurements show one wins. On Hopper: from
    :data:`WGMMA_MIN_HEADS` heads the ``wgmma`` kernel; below, its NARROW build from
    :data:`NARROW_MIN_ROWS` rows or from 2 rows over :data:`LONG_TOKENS` tokens, at 1 row the
    64-head build over :data:`LONG_TOKENS` tokens, at 2-5 rows the 64-head build above
    :data:`MMA_MAX_HEADS` heads; everything else (and every call on other GPUs) runs the
    ``mma.sync`` kernel. docs/format.md section 12 and docs/performance.md give the numbers."""
    wgmma, narrow = BACKENDS["wgmma_sm90"], BACKENDS["wgmma_sm90_narrow"]
    long = tokens >= LONG_TOKENS
    if wgmma.supports(gpu.capability) and num_heads >= WGMMA_MIN_HEADS:
        return wgmma
    few_heads_enough_rows = num_heads <= NARROW_MAX_HEADS and (rows >= NARROW_MIN_ROWS or (rows >= 2 and long))
    if narrow.supports(gpu.capability) and few_heads_enough_rows:
        return narrow
    if wgmma.supports(gpu.capability) and (long if rows == 1 else num_heads > MMA_MAX_HEADS):
        return wgmma
    return BACKENDS["mma_sync"]


def specs(arch: str) -> tuple:
    """Every kernel ``sparse_mla_decode`` may launch on a GPU of ``arch``: each supporting
    backend's, and the two combine builds."""
    capability = arch_capability(arch)
    kernels = [s for b in BACKENDS.values() if b.supports(capability) for s in b.specs(arch)]
    return (*kernels, CombineSpec.of(COMBINE_PREFETCH_WAVES), CombineSpec.of(COMBINE_PREFETCH))


class DecodePlan(NamedTuple):
    """The launches of one call shape on one device."""

    backend: str
    attend: Launcher
    head_tile: int
    blocks: int  # of the attention launch
    num_splits: int
    tiles_per_split: int
    dim_parts: int  # of a row's output dims, an item each
    combine: Launcher | None  # None: no split
    q_map: Callable[[int], bytes] | None  # q's address -> the tensor map that ends the attention Params


def plan(lib: KernelLibrary, device_index: int, num_heads: int, rows: int, k_swa: int, k_extra: int) -> DecodePlan:
    """The plan of a call on ``device_index`` (compiling or loading its kernels on a miss):
    ``rows`` query rows (batch * q_len) of ``num_heads`` heads over tables of ``k_swa`` and
    ``k_extra`` entries. ``lib``'s decode fields override the backend, head tile, split, block
    count and dim parts."""
    key = ("decode", device_index, num_heads, rows, k_swa, k_extra)
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
    if lib.decode_head_tile is not None and backend is not BACKENDS["mma_sync"]:
        raise ValueError(
            f"decode_head_tile={lib.decode_head_tile} is the mma_sync kernel's head tile, but this call runs the "
            f"{backend.name} backend: force decode_backend='mma_sync' with it"
        )
    if lib.decode_blocks is not None and backend is BACKENDS["mma_sync"]:
        raise ValueError(
            f"decode_blocks={lib.decode_blocks} caps the blocks of the wgmma kernels (wgmma_sm90, wgmma_sm90_narrow), "
            "which walk their items, but this call runs the mma_sync backend (a block an item)"
        )
    if lib.decode_dim_parts is not None and lib.decode_dim_parts not in backend.dim_parts:
        raise ValueError(
            f"decode_dim_parts={lib.decode_dim_parts} is not a form of the {backend.name} backend's kernel "
            f"(its forms: {backend.dim_parts})"
        )
    attention = backend.attention(lib, gpu, num_heads, 1)
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
    combine = None
    if num_splits > 1:
        combine = lib.launcher(device_index, lib.spec(CombineSpec.of(COMBINE_PREFETCH)))
        if rows * num_heads > combine.resident_blocks:  # more than one wave of its blocks
            combine = lib.launcher(device_index, lib.spec(CombineSpec.of(COMBINE_PREFETCH_WAVES)))
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


def _pool_params(cache, slots, lens, layout) -> tuple[int, ...]:
    if cache is None:  # no second pool: k = 0, never read
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


def _decode_cuda(lib, q, swa_cache, swa_slots, swa_lens, extra_cache, extra_slots, extra_lens, sm_scale, sinks, out):
    swa, extra = validation.check_decode(
        q, swa_cache, swa_slots, swa_lens, extra_cache, extra_slots, extra_lens, sm_scale, sinks, True, out
    )
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
    k_swa, k_extra = swa_slots.shape[2], 0 if extra_slots is None else extra_slots.shape[2]
    found = lib.plans.get(("decode", device, num_heads, rows, k_swa, k_extra))  # plan()'s key, looked up inline
    launch(
        plan(lib, device, num_heads, rows, k_swa, k_extra) if found is None else found,
        q,
        out,
        lse,
        sm_scale,
        sinks,
        (swa_cache, swa_slots, swa_lens, swa),
        (extra_cache, extra_slots, extra_lens, extra),
    )
    return out, lse


def launch(plan: DecodePlan, q, out, lse, sm_scale, sinks, swa_pool, extra_pool) -> None:
    """The launches of ``plan`` on checked arguments; each pool is ``(cache, slots, lens,
    layout)``, all None for a missing extra pool. With splits, the fp32 workspace comes from
    torch's caching allocator on the current stream."""
    num_heads, device, q_ptr = q.shape[2], q.get_device(), q.data_ptr()
    rows = q.shape[0] * q.shape[1]  # batch * q_len
    stream = current_raw_stream(device)
    sinks_ptr = 0 if sinks is None else sinks.data_ptr()
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
        )


def _decode(lib, q, swa_cache, swa_slots, swa_lens, extra_cache, extra_slots, extra_lens, sm_scale, sinks, out):
    if isinstance(q, torch.Tensor) and q.is_cuda:
        return _decode_cuda(
            lib, q, swa_cache, swa_slots, swa_lens, extra_cache, extra_slots, extra_lens, sm_scale, sinks, out
        )
    result, lse = reference.sparse_mla_decode(
        q,
        swa_cache,
        swa_slots,
        swa_lens=swa_lens,
        extra_cache=extra_cache,
        extra_slots=extra_slots,
        extra_lens=extra_lens,
        sm_scale=sm_scale,
        sinks=sinks,
    )
    if out is None:
        return result, lse
    validation.check_decode(
        q, swa_cache, swa_slots, swa_lens, extra_cache, extra_slots, extra_lens, sm_scale, sinks, False, out
    )
    out.copy_(result)
    return out, lse


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
def _(q, swa_cache, swa_slots, swa_lens, extra_cache, extra_slots, extra_lens, sm_scale, sinks):
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
def _(q, swa_cache, swa_slots, swa_lens, extra_cache, extra_slots, extra_lens, sm_scale, sinks, out):
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
        default: the process's.

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
        args = (q, swa_cache, swa_slots, swa_lens, extra_cache, extra_slots, extra_lens, float(sm_scale), sinks)
        if out is None:
            return torch.ops.nvfp4_mla.sparse_mla_decode(*args)
        return out, torch.ops.nvfp4_mla.sparse_mla_decode_out(*args, out)
    lib = DEFAULT if library is None else library
    return _decode(lib, q, swa_cache, swa_slots, swa_lens, extra_cache, extra_slots, extra_lens, sm_scale, sinks, out)
