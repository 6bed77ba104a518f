"""Argument checks of SPEC.md section 6, shared by the reference and the kernel path.

Every public entry calls one of the ``check_*`` functions before anything else happens. They
raise ``ValueError`` with the phrases SPEC.md lists and return the geometry the caller needs, so
the shapes are read once. ``need_cuda`` is True on the kernel path (CPU tensors are rejected)
and False in the reference, which runs on any device.

These run on every decode step of every layer: only attribute reads and comparisons, no
allocation, no device synchronisation.
"""

from __future__ import annotations

import os
from typing import NamedTuple

import torch

from . import abi

# NVFP4_MLA_CHECK=1 (read at import): the kernel entries also run debug_check_rows, which
# synchronises with the device. Tests and notebooks may flip this attribute directly.
DEBUG_CHECKS = os.environ.get("NVFP4_MLA_CHECK", "0") not in ("", "0")

_BF16 = torch.bfloat16
_SLOT_DTYPES = (torch.int32, torch.int64)
_CUDA_FIX = " (move it with .cuda(), or use nvfp4_mla.reference for CPU tensors)"


class CacheGeometry(NamedTuple):
    num_pages: int
    page_size: int
    page_stride: int  # bytes between pages; >= page_size * 384, a multiple of 16


def _fail(message: str) -> None:
    raise ValueError(message)


def _check_device(tensors: tuple, names: tuple, need_cuda: bool) -> None:
    # get_device() is an int (-1 off CUDA): cheaper than building torch.device objects; the
    # devices are only looked at closely when something is off, or off CUDA (the reference).
    indices = [t.get_device() for t in tensors]
    if indices[0] >= 0 and indices.count(indices[0]) == len(indices):
        return
    for t, name in zip(tensors, names):
        if need_cuda and not t.is_cuda:
            _fail(f"{name} must be a CUDA tensor, got one on {t.device}{_CUDA_FIX}")
        if t.device != tensors[0].device:
            _fail(
                f"all tensors must be on the same CUDA device (or all on the CPU for the "
                f"reference): {names[0]} is on {tensors[0].device}, {name} on {t.device}"
            )


def _check_aligned(tensors: tuple, names: tuple) -> None:
    # The kernels move these with 16-byte vector accesses.
    combined = 0
    for t in tensors:
        combined |= t.data_ptr()
    if combined % abi.PAGE_ALIGN:
        for t, name in zip(tensors, names):
            if t.data_ptr() % abi.PAGE_ALIGN:
                _fail(f"{name} must be 16-byte aligned (data_ptr {t.data_ptr():#x}); pass a fresh tensor")


def check_cache(cache: torch.Tensor) -> CacheGeometry:
    """Checks a cache view of SPEC section 3 and returns its geometry."""
    if cache.dtype is not torch.uint8:
        _fail(f"cache must have dtype torch.uint8, got {cache.dtype}")
    shape, strides = cache.shape, cache.stride()
    ndim = len(shape)
    if ndim == 3:
        page_axis = 1
    elif ndim == 4 and shape[1] == 1:
        page_axis = 2  # HND
    elif ndim == 4 and shape[2] == 1:
        page_axis = 1  # NHD
    elif ndim == 4:
        _fail(
            f"cache must have a singleton latent-head dimension: HND [num_pages, 1, page_size, 384] "
            f"or NHD [num_pages, page_size, 1, 384], got {list(shape)}"
        )
    if ndim not in (3, 4) or shape[-1] != abi.RECORD_BYTES or shape[page_axis] < 1:
        _fail(
            "cache must be [num_pages, page_size, 384], HND [num_pages, 1, page_size, 384] or "
            f"NHD [num_pages, page_size, 1, 384] with page_size >= 1, got {list(shape)}"
        )
    num_pages, page_size = shape[0], shape[page_axis]
    if strides[-1] != 1 or (page_size > 1 and strides[page_axis] != abi.RECORD_BYTES):
        _fail(
            "cache must keep each page's page_size * 384 bytes contiguous (stride(-1) == 1 and "
            f"page-size axis stride 384), got strides {list(strides)}"
        )
    page_stride = strides[0] if num_pages > 1 else page_size * abi.RECORD_BYTES
    if page_stride % abi.PAGE_ALIGN:
        _fail(f"cache page stride must be a multiple of 16 bytes, got {page_stride}")
    if page_stride < page_size * abi.RECORD_BYTES:
        _fail(f"cache pages overlap: page stride {page_stride} < page_size * 384 = {page_size * 384}")
    return CacheGeometry(num_pages, page_size, page_stride)


def _check_slots(slot_mapping: torch.Tensor, num_rows: int) -> None:
    if slot_mapping.dtype not in _SLOT_DTYPES:
        _fail(f"slot_mapping must have dtype torch.int32 or torch.int64, got {slot_mapping.dtype}")
    shape = slot_mapping.shape
    if len(shape) != 1 or not slot_mapping.is_contiguous():
        _fail(f"slot_mapping must be a contiguous 1D tensor, got shape {list(shape)}")
    if shape[0] > num_rows:
        _fail(
            f"slot_mapping must hold at most one slot per token row (never longer than the rows): "
            f"{shape[0]} slots for {num_rows} rows"
        )


def _check_kv_rows(kv: torch.Tensor, name: str) -> int:
    """Checks BF16 ``[rows, 512]`` and returns the number of rows."""
    if kv.dtype is not _BF16:
        _fail(f"{name} must have dtype torch.bfloat16, got {kv.dtype}")
    shape = kv.shape
    if len(shape) != 2 or shape[1] != abi.HEAD_DIM:
        _fail(f"{name} must be [num_tokens, 512], got {list(shape)}")
    if not kv.is_contiguous():
        _fail(f"{name} must be contiguous")
    return shape[0]


def _check_rope_inputs(positions: torch.Tensor, cos_sin_cache: torch.Tensor, num_rows: int) -> None:
    if positions.dtype is not torch.int64:
        _fail(
            f"positions must have dtype torch.int64, got {positions.dtype} "
            "(int32 is rejected, never converted: a conversion would be a hidden launch)"
        )
    shape = positions.shape
    if len(shape) != 1 or not positions.is_contiguous():
        _fail(f"positions must be a contiguous 1D tensor, got shape {list(shape)}")
    if shape[0] != num_rows:
        _fail(f"positions must hold one entry per token row: {shape[0]} for {num_rows} rows")
    if cos_sin_cache.dtype is not torch.float32:
        _fail(f"cos_sin_cache must have dtype torch.float32, got {cos_sin_cache.dtype}")
    shape = cos_sin_cache.shape
    if len(shape) != 2 or shape[1] != abi.ROPE_DIM:
        _fail(f"cos_sin_cache must be [max_position, 64], got {list(shape)}")
    if not cos_sin_cache.is_contiguous():
        _fail("cos_sin_cache must be contiguous")


def check_q_options(num_heads: int, q_head_padded, q_inplace: bool) -> None:
    if type(q_head_padded) is not int or (q_head_padded != 0 and q_head_padded not in abi.Q_HEAD_PADDINGS):
        _fail(f"q_head_padded must be 0 or one of {abi.Q_HEAD_PADDINGS}, got {q_head_padded!r}")
    if q_head_padded and q_head_padded < num_heads:
        _fail(f"q_head_padded must be at least the number of query heads: {q_head_padded} < {num_heads}")
    if q_inplace:
        if num_heads not in abi.Q_HEAD_PADDINGS:
            _fail(f"q_inplace needs num_heads in {abi.Q_HEAD_PADDINGS} (got {num_heads}); pass q_head_padded instead")
        if q_head_padded not in (0, num_heads):
            _fail(
                f"q_inplace needs q_head_padded to be 0 or num_heads ({num_heads}): in place there is "
                f"no head padding, got {q_head_padded}"
            )


def check_main(q, kv, cache, slot_mapping, positions, cos_sin_cache, q_head_padded, q_inplace, need_cuda) -> CacheGeometry:
    """``cake_dsv4_nvfp4_rope_quantize_insert``."""
    if q.dtype is not _BF16:
        _fail(f"q must have dtype torch.bfloat16, got {q.dtype}")
    shape = q.shape
    if len(shape) != 3 or shape[2] != abi.HEAD_DIM:
        _fail(f"q must be [num_tokens, num_heads, 512], got {list(shape)}")
    if not q.is_contiguous():
        _fail("q must be contiguous")
    num_tokens, num_heads = shape[0], shape[1]
    if num_heads < 1:
        _fail("q must hold at least one head")
    kv_rows = _check_kv_rows(kv, "kv")
    if kv_rows != num_tokens:
        _fail(f"kv must hold one row per query token: {kv_rows} rows for {num_tokens} tokens")
    geometry = check_cache(cache)
    _check_slots(slot_mapping, num_tokens)
    _check_rope_inputs(positions, cos_sin_cache, num_tokens)
    tensors = (q, kv, cache, slot_mapping, positions, cos_sin_cache)
    _check_device(tensors, ("q", "kv", "cache", "slot_mapping", "positions", "cos_sin_cache"), need_cuda)
    _check_aligned((q, kv, cache, cos_sin_cache), ("q", "kv", "cache", "cos_sin_cache"))
    check_q_options(num_heads, q_head_padded, q_inplace)
    return geometry


def check_kv(kv, cache, slot_mapping, positions, cos_sin_cache, compress_ratio, need_cuda) -> CacheGeometry:
    """``cake_dsv4_nvfp4_kv_rope_quantize_insert``."""
    num_rows = _check_kv_rows(kv, "kv")
    geometry = check_cache(cache)
    _check_slots(slot_mapping, num_rows)
    _check_rope_inputs(positions, cos_sin_cache, num_rows)
    tensors = (kv, cache, slot_mapping, positions, cos_sin_cache)
    _check_device(tensors, ("kv", "cache", "slot_mapping", "positions", "cos_sin_cache"), need_cuda)
    _check_aligned((kv, cache, cos_sin_cache), ("kv", "cache", "cos_sin_cache"))
    if type(compress_ratio) is not int or compress_ratio not in abi.COMPRESS_RATIOS:
        _fail(f"compress_ratio must be one of {abi.COMPRESS_RATIOS}, got {compress_ratio!r}")
    return geometry


def check_append(latent_kv, slot_mapping, cache, need_cuda) -> CacheGeometry:
    """``nvfp4_quantize_append_sparse_mla_cache``."""
    num_rows = _check_kv_rows(latent_kv, "latent_kv")
    geometry = check_cache(cache)
    _check_slots(slot_mapping, num_rows)
    _check_device((latent_kv, cache, slot_mapping), ("latent_kv", "cache", "slot_mapping"), need_cuda)
    _check_aligned((latent_kv, cache), ("latent_kv", "cache"))
    return geometry


def check_pack(latent_kv, kv_layout, need_cuda) -> None:
    """``nvfp4_quantize_pack_sparse_mla_cache``."""
    if latent_kv.dtype != _BF16:
        _fail(f"latent_kv must have dtype torch.bfloat16, got {latent_kv.dtype}")
    if latent_kv.dim() != 3 or latent_kv.shape[2] != abi.HEAD_DIM or latent_kv.shape[1] < 1:
        _fail(f"latent_kv must be [num_pages, page_size, 512] with page_size >= 1, got {list(latent_kv.shape)}")
    if not latent_kv.is_contiguous():
        _fail("latent_kv must be contiguous")
    _check_device((latent_kv,), ("latent_kv",), need_cuda)
    _check_aligned((latent_kv,), ("latent_kv",))
    if kv_layout not in abi.KV_LAYOUTS:
        _fail(f"kv_layout must be one of {abi.KV_LAYOUTS}, got {kv_layout!r}")


def check_dequantize(cache, slots, dtype) -> CacheGeometry:
    """``nvfp4_dequantize_sparse_mla_cache``."""
    geometry = check_cache(cache)
    if slots is not None:
        if slots.dtype not in _SLOT_DTYPES:
            _fail(f"slots must have dtype torch.int32 or torch.int64, got {slots.dtype}")
        if slots.dim() != 1:
            _fail(f"slots must be a 1D tensor, got shape {list(slots.shape)}")
        _check_device((cache, slots), ("cache", "slots"), False)
    if not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
        _fail(f"dtype must be a floating-point torch.dtype, got {dtype!r}")
    return geometry


def debug_check_rows(slot_mapping, capacity: int, positions=None, max_position: int = 0, compress_ratio: int = 1) -> None:
    """The NVFP4_MLA_CHECK=1 checks of the device's unchecked preconditions, naming the first bad
    row: every RoPE row the call would read is inside cos_sin_cache, and no valid slot repeats.
    Copies the index tensors to the host (a synchronisation): a debugging aid only."""
    if positions is not None:
        pos = positions.cpu()
        used = pos[: slot_mapping.shape[0]] if compress_ratio > 1 else pos
        rope_rows = torch.div(used, compress_ratio, rounding_mode="floor") * compress_ratio
        bad = ((used < 0) | (rope_rows >= max_position)).nonzero()
        if bad.numel():
            row = int(bad[0])
            _fail(
                f"NVFP4_MLA_CHECK: row {row} has position {int(used[row])}, outside cos_sin_cache "
                f"[0, {max_position}) (compress_ratio {compress_ratio})"
            )
    first_row = {}
    for row, slot in enumerate(slot_mapping.tolist()):
        if 0 <= slot < capacity:
            if slot in first_row:
                _fail(f"NVFP4_MLA_CHECK: row {row} repeats slot {slot} of row {first_row[slot]}; a valid slot may appear once per call")
            first_row[slot] = row
