"""Argument checks of the writer entries (docs/format.md section 6), shared by the reference and
the kernel path.

Every writer calls one of the ``check_*`` functions before anything else happens. They raise
``ValueError`` with the phrases docs/format.md lists and return the cache layout the caller needs,
so the shapes are read once. ``need_cuda`` is True on the kernel path (CPU tensors are rejected)
and False in the reference, which runs on any device.

These run on every call of a new signature: only attribute reads and comparisons, no allocation,
no device synchronisation (except the opt-in ``NVFP4_MLA_CHECK`` checks).
"""

from __future__ import annotations

import torch

from .. import abi, config
from .common import (
    SLOT_DTYPES,
    CacheLayout,
    PointerChecks,
    cache_extent,
    check_bf16_rows,
    check_cache,
    check_device,
    check_flag,
    check_pointers,
    check_tensors,
    fail,
)

# Each writer's tensor arguments, in the order of its signature (and of check_pointers' pointers).
MAIN_NAMES = ("q", "kv", "cache", "slot_mapping", "positions", "cos_sin_cache")
KV_NAMES = ("kv", "cache", "slot_mapping", "positions", "cos_sin_cache")
APPEND_NAMES = ("latent_kv", "slot_mapping", "cache")


def _pointer_checks(
    tensors: tuple, names: tuple, cache_index: int, layout: CacheLayout, aligned: tuple, written: tuple
) -> PointerChecks:
    spans = [t.nbytes for t in tensors]
    lo, hi = cache_extent(tensors[cache_index], layout)
    spans[cache_index] = hi - lo
    return PointerChecks(names, tuple(spans), aligned, written)


def main_pointer_checks(tensors: tuple, layout: CacheLayout, q_inplace: bool) -> PointerChecks:
    """The per-call checks of the main entry's checked ``tensors`` (in :data:`MAIN_NAMES` order):
    q, kv, the cache and cos_sin_cache aligned; the cache written, and q in place."""
    return _pointer_checks(tensors, MAIN_NAMES, 2, layout, (0, 1, 2, 5), (2, 0) if q_inplace else (2,))


def kv_pointer_checks(tensors: tuple, layout: CacheLayout) -> PointerChecks:
    """The per-call checks of the KV entry's checked ``tensors`` (:data:`KV_NAMES` order)."""
    return _pointer_checks(tensors, KV_NAMES, 1, layout, (0, 1, 4), (1,))


def append_pointer_checks(tensors: tuple, layout: CacheLayout) -> PointerChecks:
    """The per-call checks of the append entry's checked ``tensors`` (:data:`APPEND_NAMES` order)."""
    return _pointer_checks(tensors, APPEND_NAMES, 2, layout, (0, 2), (2,))


PACK_POINTER_CHECKS = PointerChecks(("latent_kv",), (0,), (0,), ())  # aligned; the output is new


def _check_write_range(rows: int, capacity: int) -> None:
    if rows >= abi.MAX_WRITE_ROWS or capacity >= abi.MAX_WRITE_ROWS:
        fail(
            f"a writer call inserts fewer than 2^30 rows into a cache of fewer than 2^30 slots, "
            f"got {rows} rows and {capacity} slots"
        )


def _check_slots(slot_mapping: torch.Tensor, num_rows: int, layout: CacheLayout) -> None:
    if slot_mapping.dtype not in SLOT_DTYPES:
        fail(f"slot_mapping must have dtype torch.int32 or torch.int64, got {slot_mapping.dtype}")
    shape = slot_mapping.shape
    if len(shape) != 1 or not slot_mapping.is_contiguous():
        fail(f"slot_mapping must be a contiguous 1D tensor, got shape {list(shape)}")
    if shape[0] > num_rows:
        fail(
            f"slot_mapping must hold at most one slot per token row (never longer than the rows): "
            f"{shape[0]} slots for {num_rows} rows"
        )
    _check_write_range(shape[0], layout.num_pages * layout.page_size)


def _check_kv_rows(kv: torch.Tensor, name: str) -> int:
    """Checks BF16 ``[rows, 512]`` and returns the number of rows."""
    check_bf16_rows(kv, name, "num_tokens, 512", 2)
    return kv.shape[0]


def _check_rope_inputs(positions: torch.Tensor, cos_sin_cache: torch.Tensor, num_rows: int) -> None:
    if positions.dtype is not torch.int64:
        fail(
            f"positions must have dtype torch.int64, got {positions.dtype} "
            "(int32 is rejected, never converted: a conversion would be a hidden launch)"
        )
    shape = positions.shape
    if len(shape) != 1 or not positions.is_contiguous():
        fail(f"positions must be a contiguous 1D tensor, got shape {list(shape)}")
    if shape[0] != num_rows:
        fail(f"positions must hold one entry per token row: {shape[0]} for {num_rows} rows")
    if cos_sin_cache.dtype is not torch.float32:
        fail(f"cos_sin_cache must have dtype torch.float32, got {cos_sin_cache.dtype}")
    shape = cos_sin_cache.shape
    if len(shape) != 2 or shape[1] != abi.ROPE_DIM:
        fail(f"cos_sin_cache must be [max_position, 64], got {list(shape)}")
    if not cos_sin_cache.is_contiguous():
        fail("cos_sin_cache must be contiguous")


def check_q_options(num_heads: int, q_head_padded: object, q_inplace: bool) -> None:
    """The query options against ``num_heads`` (also what precompile's Geometry checks)."""
    if type(q_head_padded) is not int or (q_head_padded != 0 and q_head_padded not in abi.Q_HEAD_PADDINGS):
        fail(f"q_head_padded must be 0 or one of {abi.Q_HEAD_PADDINGS}, got {q_head_padded!r}")
    if q_head_padded and q_head_padded < num_heads:
        fail(f"q_head_padded must be at least the number of query heads: {q_head_padded} < {num_heads}")
    if q_inplace:
        if num_heads not in abi.Q_HEAD_PADDINGS:
            fail(f"q_inplace needs num_heads in {abi.Q_HEAD_PADDINGS} (got {num_heads}); pass q_head_padded instead")
        if q_head_padded not in (0, num_heads):
            fail(
                f"q_inplace needs q_head_padded to be 0 or num_heads ({num_heads}): in place there is "
                f"no head padding, got {q_head_padded}"
            )


def check_main(
    q: torch.Tensor,
    kv: torch.Tensor,
    cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    positions: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    q_head_padded: int,
    apply_q_rope: bool,
    q_inplace: bool,
    need_cuda: bool,
) -> CacheLayout:
    """``cake_dsv4_nvfp4_rope_quantize_insert``."""
    tensors = (q, kv, cache, slot_mapping, positions, cos_sin_cache)
    names = MAIN_NAMES
    check_tensors(tensors, names)
    check_flag(apply_q_rope, "apply_q_rope")
    check_flag(q_inplace, "q_inplace")
    check_bf16_rows(q, "q", "num_tokens, num_heads, 512", 3)
    num_tokens, num_heads = q.shape[0], q.shape[1]
    if num_heads < 1:
        fail("q must hold at least one head")
    kv_rows = _check_kv_rows(kv, "kv")
    if kv_rows != num_tokens:
        fail(f"kv must hold one row per query token: {kv_rows} rows for {num_tokens} tokens")
    layout = check_cache(cache)
    _check_slots(slot_mapping, num_tokens, layout)
    _check_rope_inputs(positions, cos_sin_cache, num_tokens)
    check_device(tensors, names, need_cuda)
    check_q_options(num_heads, q_head_padded, q_inplace)
    check_pointers(tensors, main_pointer_checks(tensors, layout, q_inplace))
    if config.DEBUG_CHECKS:
        debug_check_rows(slot_mapping, layout.num_pages * layout.page_size, positions, cos_sin_cache.shape[0])
    return layout


def check_kv(
    kv: torch.Tensor,
    cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    positions: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    compress_ratio: int,
    need_cuda: bool,
) -> CacheLayout:
    """``cake_dsv4_nvfp4_kv_rope_quantize_insert``."""
    tensors = (kv, cache, slot_mapping, positions, cos_sin_cache)
    names = KV_NAMES
    check_tensors(tensors, names)
    num_rows = _check_kv_rows(kv, "kv")
    layout = check_cache(cache)
    _check_slots(slot_mapping, num_rows, layout)
    _check_rope_inputs(positions, cos_sin_cache, num_rows)
    check_device(tensors, names, need_cuda)
    check_compress_ratio(compress_ratio)
    check_pointers(tensors, kv_pointer_checks(tensors, layout))
    if config.DEBUG_CHECKS:
        capacity = layout.num_pages * layout.page_size
        used = positions[: slot_mapping.shape[0]]  # only rows with a slot are inserted
        debug_check_rows(slot_mapping, capacity, used, cos_sin_cache.shape[0], compress_ratio)
    return layout


def check_compress_ratio(compress_ratio: object) -> None:
    if type(compress_ratio) is not int or compress_ratio not in abi.COMPRESS_RATIOS:
        fail(f"compress_ratio must be one of {abi.COMPRESS_RATIOS}, got {compress_ratio!r}")


# The largest page size an entry can use: a writer's cache holds fewer than 2^30 slots
# (_check_write_range), so one page of it fewer too; no write can fill a larger page for the reader.
MAX_PAGE_SIZE = abi.MAX_WRITE_ROWS - 1


def check_page_size(page_size: object) -> None:
    """A precompile request's page size: one an entry's cache can have."""
    if type(page_size) is not int or page_size < 1:
        fail(f"page_size must be a positive int, got {page_size!r}")
    if page_size > MAX_PAGE_SIZE:
        fail(
            f"page_size must be a positive int below 2^30 (a cache holds fewer than 2^30 slots: the kernels "
            f"index them in 32 bits), got {page_size}"
        )


def check_slot_dtype(slot_dtype: object) -> None:
    if slot_dtype not in SLOT_DTYPES:
        fail(f"slot_dtype must be torch.int32 or torch.int64, got {slot_dtype!r}")


def check_append(
    latent_kv: torch.Tensor, slot_mapping: torch.Tensor, cache: torch.Tensor, need_cuda: bool
) -> CacheLayout:
    """``nvfp4_quantize_append_sparse_mla_cache``."""
    tensors = (latent_kv, slot_mapping, cache)
    check_tensors(tensors, APPEND_NAMES)
    num_rows = _check_kv_rows(latent_kv, "latent_kv")
    layout = check_cache(cache)
    _check_slots(slot_mapping, num_rows, layout)
    check_device((latent_kv, cache, slot_mapping), ("latent_kv", "cache", "slot_mapping"), need_cuda)
    check_pointers(tensors, append_pointer_checks(tensors, layout))
    if config.DEBUG_CHECKS:
        debug_check_rows(slot_mapping, layout.num_pages * layout.page_size)
    return layout


def check_pack(latent_kv: torch.Tensor, kv_layout: str, need_cuda: bool) -> None:
    """``nvfp4_quantize_pack_sparse_mla_cache``."""
    check_tensors((latent_kv,), ("latent_kv",))
    check_bf16_rows(latent_kv, "latent_kv", "num_pages, page_size, 512", 3)
    if latent_kv.shape[1] < 1:
        fail(f"latent_kv must be [num_pages, page_size, 512] with page_size >= 1, got {list(latent_kv.shape)}")
    rows = latent_kv.shape[0] * latent_kv.shape[1]
    _check_write_range(rows, rows)  # a slot a row
    check_device((latent_kv,), ("latent_kv",), need_cuda)
    if type(kv_layout) is not str or kv_layout not in abi.KV_LAYOUTS:
        fail(f"kv_layout must be one of {abi.KV_LAYOUTS}, got {kv_layout!r}")
    check_pointers((latent_kv,), PACK_POINTER_CHECKS)


def debug_check_rows(
    slot_mapping: torch.Tensor,
    capacity: int,
    positions: torch.Tensor | None = None,
    max_position: int = 0,
    compress_ratio: int = 1,
) -> None:
    """The NVFP4_MLA_CHECK=1 checks of the device's unchecked preconditions, naming the first bad
    row: every RoPE row the call would read (``positions``: the rows it uses) is inside
    cos_sin_cache, and no valid slot repeats. Copies the index tensors to the host (a
    synchronisation): a debugging aid only."""
    if positions is not None:
        used = positions.cpu()
        rope_rows = torch.div(used, compress_ratio, rounding_mode="floor") * compress_ratio
        bad = ((used < 0) | (rope_rows >= max_position)).nonzero()
        if bad.numel():
            row = int(bad[0])
            fail(
                f"NVFP4_MLA_CHECK: row {row} has position {int(used[row])}, outside cos_sin_cache "
                f"[0, {max_position}) (compress_ratio {compress_ratio})"
            )
    first_row: dict[int, int] = {}
    for row, slot in enumerate(slot_mapping.tolist()):
        if 0 <= slot < capacity:
            if slot in first_row:
                fail(
                    f"NVFP4_MLA_CHECK: row {row} repeats slot {slot} of row {first_row[slot]}; "
                    "a valid slot may appear once per call"
                )
            first_row[slot] = row
