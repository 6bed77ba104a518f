"""Fused sparse MLA decode attention over the NVFP4 cache: ``kernels/nvfp4_mla_decode.cu`` and its entry.

:func:`sparse_mla_decode` has the signature and semantics of
:func:`nvfp4_mla.reference.sparse_mla_decode` (docs/format.md section 9), plus an optional ``out``.
CUDA tensors go to the kernel, other devices to the reference.

**Execution.** One launch of the attention kernel (a block per query row, head tile and split of
the selected tokens), plus one launch of the combine kernel when the tokens are split across
blocks. The split is a pure function of the shapes and the device (never of the data), and the
combine adds the splits in a fixed order, so equal inputs give equal bits on every run. A warm
call does the checks of :mod:`validation`, one dict lookup and its allocations (the outputs and,
with splits, an fp32 workspace, all through torch's caching allocator on the current stream), with
no host synchronisation: it can be captured in a CUDA graph.
"""

from __future__ import annotations

import functools
import math
import struct
from typing import NamedTuple

import torch
from torch.autograd.graph import increment_version

from . import abi, kernel_cache, reference, validation
from .jit import Template
from .launch import Launcher, contiguous_strides, current_raw_stream, new_output

BLOCK_N = 32  # selected tokens a tile
HEAD_TILES = (16, 32, 64)  # heads a block; the largest that fits the GPU's shared memory
# Warps sharing a row block of 16 heads, each a slice of the 512 dims: 2 give a warp 256 output
# dims (128 fp32 accumulators a thread: one block of 8 warps an SM at 64 heads); 4 halve that, for
# blocks of 4 or 8 warps at 16 and 32 heads.
DIM_SPLITS = {16: 4, 32: 4, 64: 2}
COMBINE_THREADS = abi.HEAD_DIM // 4
MAX_SPLITS = COMBINE_THREADS  # the combine kernel takes a split a thread
# When choosing the split, in tile-times of one block: what a block costs besides its tiles (its
# query load and its output rows), and what the combine launch costs.
_BLOCK_COST = 1
_COMBINE_COST = 1
_LOG2E = 1.0 / math.log(2.0)

# kernels/nvfp4_mla_decode.cu Params (their static_asserts check the sizes): attention is 6 pointers,
# two pools (3 pointers, 5 int64 each), 3 int64 and sm_scale * log2(e) as a double; combine is
# 5 pointers and 2 int64.
ATTEND_PARAMS = struct.Struct("<6Q3Q5q3Q5q3qd")
COMBINE_PARAMS = struct.Struct("<5Q2q")


def attend_threads(head_tile: int) -> int:
    """Threads of an attention block: a warp per (row block of 16 heads, dims slice)."""
    return 32 * head_tile // 16 * DIM_SPLITS[head_tile]


def shared_bytes(head_tile: int) -> int:
    """Dynamic shared memory of the attention kernel with ``head_tile`` heads a block (its layout
    is in the kernel, which checks this count)."""
    return (
        head_tile * abi.HEAD_DIM * 2  # Q, as MMA fragments
        + BLOCK_N * (abi.HEAD_DIM + 8) * 2  # K (= V): padded BF16 rows
        + BLOCK_N * abi.RECORD_BYTES  # the tile's records
        + attend_threads(head_tile) * 4 * 4 * 4  # partial scores: 4 n-tiles x 4 fp32 a thread
        + 2 * BLOCK_N * 8  # record addresses
        + 2 * BLOCK_N * 8  # slots of two tiles
        + 16  # live-token masks of two tiles
        + 256 * 4  # every E4M3 scale byte as a BF16 pair
    )


class DecodeSpec(NamedTuple):
    """One compile of ``kernels/nvfp4_mla_decode.cu``: the attention kernel for a head tile, or the
    split combine kernel. Page sizes, slot dtypes, head counts, lengths and sinks are run-time
    arguments: each is used once per selected token or per row, next to 512 dequantized values
    and 4 * 512 * head_tile MMA flops, so specializing on them would only multiply the variants."""

    kernel: str  # "attend" or "combine"
    head_tile: int = 0  # attend: heads a block, one of HEAD_TILES

    @staticmethod
    @functools.cache
    def attend(head_tile: int) -> DecodeSpec:
        if head_tile not in HEAD_TILES:
            raise ValueError(f"head_tile must be one of {HEAD_TILES}, got {head_tile!r}")
        return DecodeSpec("attend", head_tile)

    @staticmethod
    @functools.cache
    def combine() -> DecodeSpec:
        return DecodeSpec("combine")

    @property
    def threads(self) -> int:
        return attend_threads(self.head_tile) if self.kernel == "attend" else COMBINE_THREADS

    @property
    def shared_bytes(self) -> int:
        return shared_bytes(self.head_tile) if self.kernel == "attend" else 0

    @property
    def template(self) -> Template:
        if self.kernel == "attend":
            return Template("nvfp4_mla_decode.cu", "nvfp4_mla_decode", ATTEND_PARAMS, self.threads, self.shared_bytes)
        return Template("nvfp4_mla_decode.cu", "nvfp4_mla_decode_combine", COMBINE_PARAMS, self.threads)

    def defines(self) -> dict[str, int]:
        """The kernel's ``-D`` constants."""
        if self.kernel == "attend":
            return {
                "COMBINE": 0,
                "HEAD_TILE": self.head_tile,
                "DIM_SPLIT": DIM_SPLITS[self.head_tile],
                "BLOCK_N": BLOCK_N,
                "SMEM_BYTES": self.shared_bytes,
            }
        return {"COMBINE": 1, "MAX_SPLITS": MAX_SPLITS}

    def describe(self) -> str:
        """A short human-readable name, e.g. ``decode heads/block=32``."""
        return f"decode heads/block={self.head_tile}" if self.kernel == "attend" else "decode split combine"


ALL_SPECS = (*(DecodeSpec.attend(t) for t in HEAD_TILES), DecodeSpec.combine())


def choose_head_tile(num_heads: int, shared_optin: int) -> int:
    """The smallest head tile holding every head, else the largest whose shared memory fits
    ``shared_optin`` bytes (a block's opt-in maximum: 99 KiB on sm_86/89/120, more on sm_80/90/100)."""
    fitting = [t for t in HEAD_TILES if shared_bytes(t) <= shared_optin]
    return next((t for t in fitting if t >= num_heads), fitting[-1])


def choose_split(blocks: int, num_tokens: int, concurrent_blocks: int) -> tuple[int, int]:
    """``(num_splits, tiles_per_split)`` for ``blocks`` (query row, head tile) pairs over
    ``num_tokens`` selected tokens (both tables' widths) when ``concurrent_blocks`` blocks fit the
    GPU at once: the split with the fewest tile-times (waves x the tiles of a block, plus a block's
    fixed cost), plus the combine's, the smaller split on ties. Depends on shapes only, so runs are
    reproducible."""
    num_tiles = -(-num_tokens // BLOCK_N)
    best = ((num_tiles + _BLOCK_COST) * -(-blocks // concurrent_blocks), 1, num_tiles)
    for splits in range(2, min(num_tiles, MAX_SPLITS) + 1):
        per_split = -(-num_tiles // splits)
        used = -(-num_tiles // per_split)  # splits that get tiles
        if used != splits:
            continue
        cost = -(-blocks * splits // concurrent_blocks) * (per_split + _BLOCK_COST) + _COMBINE_COST
        best = min(best, (cost, splits, per_split))
    return best[1], best[2]


class Plan(NamedTuple):
    """The launches of one call shape on one device."""

    attend: Launcher
    combine: Launcher | None  # None: no split
    spec: DecodeSpec
    blocks: int
    num_splits: int
    tiles_per_split: int


def make_plan(
    index: int, num_heads: int, rows: int, num_tokens: int, head_tile: int | None = None, num_splits: int | None = None
) -> Plan:
    """The plan of a call on device ``index`` (compiling or loading its kernels): ``rows`` query
    rows (batch * q_len) of ``num_heads`` heads over ``num_tokens`` table entries. ``head_tile``
    and ``num_splits`` override the choices (for benchmarks and tests)."""
    from cupy.cuda import runtime

    if head_tile is None:
        optin = runtime.deviceGetAttribute(runtime.cudaDevAttrMaxSharedMemoryPerBlockOptin, index)
        head_tile = choose_head_tile(num_heads, optin)
    spec = DecodeSpec.attend(head_tile)
    cache = kernel_cache.default()
    attend = cache.launcher(index, spec)
    blocks = rows * -(-num_heads // head_tile)
    num_tiles = -(-num_tokens // BLOCK_N)
    if num_splits is None:
        num_splits, tiles_per_split = choose_split(blocks, num_tokens, attend.resident_blocks)
    else:
        tiles_per_split = -(-num_tiles // min(num_splits, MAX_SPLITS))
        num_splits = -(-num_tiles // tiles_per_split)
    combine = cache.launcher(index, DecodeSpec.combine()) if num_splits > 1 else None
    return Plan(attend, combine, spec, blocks * num_splits, num_splits, tiles_per_split)


# Keyed on (device, heads, rows, swa k, extra k): the only lookup a warm call does.
_plans: dict[tuple, Plan] = {}


def _pool_params(cache, slots, lens, geometry) -> tuple[int, ...]:
    if cache is None:  # no second pool: k = 0, never read
        return (0, 0, 0, 0, 1, 0, 0, 0)
    num_pages, page_size, page_stride = geometry
    return (
        cache.data_ptr(),
        slots.data_ptr(),
        0 if lens is None else lens.data_ptr(),
        page_stride,
        page_size,
        num_pages * page_size,
        slots.shape[2],
        int(slots.dtype is torch.int64),
    )


def _decode_cuda(q, swa_cache, swa_slots, swa_lens, extra_cache, extra_slots, extra_lens, sm_scale, sinks, out):
    swa, extra = validation.check_decode(
        q, swa_cache, swa_slots, swa_lens, extra_cache, extra_slots, extra_lens, sm_scale, sinks, need_cuda=True
    )
    device = q.get_device()
    batch, q_len, num_heads = q.shape[0], q.shape[1], q.shape[2]
    if out is not None:
        validation.check_decode_out(out, q, swa_cache, swa, extra_cache, extra)
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
    key = (device, num_heads, rows, k_swa, k_extra)
    plan = _plans.get(key)
    if plan is None:
        plan = _plans[key] = make_plan(key[0], num_heads, rows, k_swa + k_extra)
    launch(
        plan,
        q,
        out,
        lse,
        sm_scale,
        sinks,
        (swa_cache, swa_slots, swa_lens, swa),
        (extra_cache, extra_slots, extra_lens, extra),
    )
    return out, lse


def launch(plan: Plan, q, out, lse, sm_scale, sinks, swa_pool, extra_pool) -> None:
    """The launches of ``plan`` on checked arguments; each pool is ``(cache, slots, lens,
    geometry)``, all None for a missing extra pool. With splits, the fp32 workspace comes from
    torch's caching allocator on the current stream."""
    num_heads, device = q.shape[2], q.get_device()
    stream = current_raw_stream(device)
    sinks_ptr = 0 if sinks is None else sinks.data_ptr()
    partial_o = partial_ml = 0
    if plan.combine is not None:
        entries = q.shape[0] * q.shape[1] * num_heads * plan.num_splits
        workspace = new_output(q, (entries * (abi.HEAD_DIM + 2),), (1,), torch.float32, device)
        partial_o = workspace.data_ptr()
        partial_ml = partial_o + entries * abi.HEAD_DIM * 4
    plan.attend.launch(
        plan.blocks,
        1,
        1,
        plan.spec.shared_bytes,
        stream,
        q.data_ptr(),
        out.data_ptr(),
        lse.data_ptr(),
        partial_o,
        partial_ml,
        sinks_ptr,
        *_pool_params(*swa_pool),
        *_pool_params(*extra_pool),
        num_heads,
        plan.num_splits,
        plan.tiles_per_split,
        float(sm_scale) * _LOG2E,  # type: ignore[arg-type]  # Params' double: struct packs it with "d"
    )
    if plan.combine is not None:
        rows_heads = q.shape[0] * q.shape[1] * num_heads
        plan.combine.launch(
            rows_heads,
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


def _decode(q, swa_cache, swa_slots, swa_lens, extra_cache, extra_slots, extra_lens, sm_scale, sinks, out):
    if isinstance(q, torch.Tensor) and q.is_cuda:
        return _decode_cuda(
            q, swa_cache, swa_slots, swa_lens, extra_cache, extra_slots, extra_lens, sm_scale, sinks, out
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
    swa, extra = validation.check_decode(
        q, swa_cache, swa_slots, swa_lens, extra_cache, extra_slots, extra_lens, sm_scale, sinks, need_cuda=False
    )
    validation.check_decode_out(out, q, swa_cache, swa, extra_cache, extra)
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
    out, lse = _decode(q, swa_cache, swa_slots, swa_lens, extra_cache, extra_slots, extra_lens, sm_scale, sinks, None)
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
    _, lse = _decode(q, swa_cache, swa_slots, swa_lens, extra_cache, extra_slots, extra_lens, sm_scale, sinks, out)
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
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sparse MLA decode attention read straight from one or two NVFP4 caches.

    The semantics of :func:`nvfp4_mla.reference.sparse_mla_decode` (docs/format.md section 9):
    masked entries (invalid slots, entries past ``lens``) are never read, a row with nothing
    live gives 0 and ``lse = +inf``, ``lse`` is the natural log-sum-exp before the sink. On CUDA
    tensors the kernel accumulates in fp32 with BF16 tensor-core products (P is rounded to BF16
    for P.V); it matches the reference within ``2^-7 |ref| + 2^-8 sum_j w_j |row_j|`` (times
    the sink factor) for ``out`` and ``1e-4 max(1, |lse|)`` for ``lse``. Other devices run the
    reference.

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
        Optional contiguous int32 ``[batch, q_len]``: only the first ``lens`` entries of a row
        count (clamped to ``[0, k]``).
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
        args = (q, swa_cache, swa_slots, swa_lens, extra_cache, extra_slots, extra_lens, float(sm_scale), sinks)
        if out is None:
            return torch.ops.nvfp4_mla.sparse_mla_decode(*args)
        return out, torch.ops.nvfp4_mla.sparse_mla_decode_out(*args, out)
    return _decode(q, swa_cache, swa_slots, swa_lens, extra_cache, extra_slots, extra_lens, sm_scale, sinks, out)
