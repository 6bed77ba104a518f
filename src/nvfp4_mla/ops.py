"""The GPU entries: validate, look up the compiled variant, launch once on torch's current stream.

Signatures and semantics are SPEC.md sections 2-5 (and ``nvfp4_mla.reference``, which defines
the bytes). Each call does: the checks of :mod:`validation`, at most one output allocation, one
dict lookup of the kernel keyed on (device, geometry), and one kernel launch with raw pointers.
No host synchronisation, so calls can be captured in CUDA graphs.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from . import abi, jit, validation
from .reference import new_cache, nvfp4_dequantize_sparse_mla_cache  # noqa: F401  (pure torch, any device)

try:
    _raw_stream = torch._C._cuda_getCurrentRawStream  # the current stream's handle, no Stream object
except AttributeError:  # pragma: no cover - older torch
    def _raw_stream(device_index):
        return torch.cuda.current_stream(device_index).cuda_stream

_NO_PTR = 0


# Variant keys as plain tuples in jit.Variant's field order (page_size, slot_int64,
# identity_slots, kv_rope, compress_ratio, q_mode, num_heads, q_heads, apply_q_rope): the hot
# path builds one and looks it up; jit.Variant(*key) only on the first call.
def _kv_variant(page_size: int, slot_int64: bool, compress_ratio: int) -> tuple:
    return (page_size, slot_int64, 0, 1, compress_ratio, 0, 0, 0, 0)


def _main_variant(page_size, slot_int64, num_heads, q_head_padded, apply_q_rope, q_inplace) -> tuple:
    if q_inplace and apply_q_rope:
        return (page_size, slot_int64, 0, 1, 1, 2, num_heads, num_heads, 1)
    if q_inplace or not q_head_padded:  # cache only: the KV entry with ratio 1
        return _kv_variant(page_size, slot_int64, 1)
    return (page_size, slot_int64, 0, 1, 1, 1, num_heads, q_head_padded, int(bool(apply_q_rope)))


def _append_variant(page_size: int, slot_int64: bool) -> tuple:
    return (page_size, slot_int64, 0, 0, 1, 0, 0, 0, 0)


def _pack_variant(page_size: int) -> tuple:
    return (page_size, 0, 1, 0, 1, 0, 0, 0, 0)


class Geometry(NamedTuple):
    """What fixes a compiled kernel, for :func:`precompile`. ``entry`` is "main", "kv", "append"
    or "pack"; the other fields are the entries' arguments of the same names."""

    entry: str
    page_size: int
    num_heads: int = 0
    q_head_padded: int = 0
    apply_q_rope: bool = True
    q_inplace: bool = False
    compress_ratio: int = 1
    slot_dtype: torch.dtype = torch.int64

    def variant(self) -> jit.Variant:
        slot_int64 = self.slot_dtype is torch.int64
        if self.entry == "main":
            validation.check_q_options(self.num_heads, self.q_head_padded, self.q_inplace)
            key = _main_variant(self.page_size, slot_int64, self.num_heads, self.q_head_padded, self.apply_q_rope, self.q_inplace)
        elif self.entry == "kv":
            key = _kv_variant(self.page_size, slot_int64, self.compress_ratio)
        elif self.entry == "append":
            key = _append_variant(self.page_size, slot_int64)
        elif self.entry == "pack":
            key = _pack_variant(self.page_size)
        else:
            raise ValueError(f"entry must be one of 'main', 'kv', 'append', 'pack', got {self.entry!r}")
        return jit.Variant(*key)


def precompile(geometries, *, device=None, arch=None) -> list:
    """Builds kernels ahead of time (serving start-up), e.g.
    ``precompile([Geometry("main", 256, num_heads=8, q_head_padded=16)])``.

    With ``arch`` ("sm_90", ...) the cubins are only compiled into the disk cache (no GPU needed)
    and their paths returned; otherwise they are also loaded on ``device`` (default: current), so
    the first real call does no compile and no file I/O.
    """
    variants = [(g if isinstance(g, Geometry) else Geometry(**g)).variant() for g in geometries]
    if arch is not None:
        return [jit.cubin_path(v, arch) for v in variants]
    index = torch.device("cuda" if device is None else device).index
    index = torch.cuda.current_device() if index is None else index
    return [jit.launcher((index, *v)) for v in variants]


def _launch(key, num_units, q, q_out, kv, cache, slots, positions, cos_sin, geometry, max_position, num_kv_rows):
    num_pages, page_size, page_stride = geometry
    device_index = cache.get_device()
    jit.launcher((device_index, *key)).launch(
        num_units,
        _raw_stream(device_index),
        q, q_out, kv, cache.data_ptr(), slots, positions, cos_sin,
        page_stride, num_pages * page_size, max_position, num_kv_rows,
    )


def cake_dsv4_nvfp4_rope_quantize_insert(
    q, kv, cache, slot_mapping, positions, cos_sin_cache, *, q_head_padded=0, apply_q_rope=True, q_inplace=False
):
    """Rotate q, then rotate, quantize and insert kv into the DeepSeek-V4 NVFP4 cache, in one launch."""
    geometry = validation.check_main(
        q, kv, cache, slot_mapping, positions, cos_sin_cache, q_head_padded, q_inplace, need_cuda=True
    )
    num_tokens, num_heads = q.shape[0], q.shape[1]
    num_kv_rows = slot_mapping.shape[0]
    if q_inplace:
        q_out = q
        q_units = num_tokens * num_heads // 8 if apply_q_rope else 0  # 8 heads' RoPE chunks a unit
    elif q_head_padded:
        q_out = torch.empty((num_tokens, q_head_padded, abi.HEAD_DIM), dtype=torch.bfloat16, device=q.device)
        q_units = num_tokens * q_head_padded
    else:
        q_out = q.new_empty((num_tokens, 0, abi.HEAD_DIM))
        q_units = 0
    num_units = num_kv_rows + q_units
    if num_units == 0:
        return q_out
    key = _main_variant(geometry.page_size, slot_mapping.dtype is torch.int64, num_heads, q_head_padded, apply_q_rope, q_inplace)
    _launch(
        key, num_units, q.data_ptr(), q_out.data_ptr(), kv.data_ptr(), cache, slot_mapping.data_ptr(),
        positions.data_ptr(), cos_sin_cache.data_ptr(), geometry, cos_sin_cache.shape[0], num_kv_rows,
    )
    return q_out


def cake_dsv4_nvfp4_kv_rope_quantize_insert(kv, cache, slot_mapping, positions, cos_sin_cache, *, compress_ratio=1):
    """Rotate, quantize and insert KV rows; with ``compress_ratio=2`` only rows whose
    ``(positions[i] + 1) % 2 == 0``, roped with row ``positions[i] // 2 * 2``."""
    geometry = validation.check_kv(kv, cache, slot_mapping, positions, cos_sin_cache, compress_ratio, need_cuda=True)
    num_kv_rows = slot_mapping.shape[0]
    if num_kv_rows == 0:
        return None
    key = _kv_variant(geometry.page_size, slot_mapping.dtype is torch.int64, compress_ratio)
    _launch(
        key, num_kv_rows, _NO_PTR, _NO_PTR, kv.data_ptr(), cache, slot_mapping.data_ptr(),
        positions.data_ptr(), cos_sin_cache.data_ptr(), geometry, cos_sin_cache.shape[0], num_kv_rows,
    )
    return None


def nvfp4_quantize_append_sparse_mla_cache(latent_kv, slot_mapping, cache):
    """Quantize already-roped BF16 rows ``[n, 512]`` and insert row i at ``slot_mapping[i]``."""
    geometry = validation.check_append(latent_kv, slot_mapping, cache, need_cuda=True)
    num_kv_rows = slot_mapping.shape[0]
    if num_kv_rows == 0:
        return None
    key = _append_variant(geometry.page_size, slot_mapping.dtype is torch.int64)
    _launch(
        key, num_kv_rows, _NO_PTR, _NO_PTR, latent_kv.data_ptr(), cache, slot_mapping.data_ptr(),
        _NO_PTR, _NO_PTR, geometry, 0, num_kv_rows,
    )
    return None


def nvfp4_quantize_pack_sparse_mla_cache(latent_kv, *, kv_layout="HND"):
    """Quantize whole pages ``[num_pages, page_size, 512]`` into a new cache (HND or NHD)."""
    validation.check_pack(latent_kv, kv_layout, need_cuda=True)
    num_pages, page_size = latent_kv.shape[0], latent_kv.shape[1]
    cache = new_cache(num_pages, page_size, kv_layout, latent_kv.device)
    num_rows = num_pages * page_size
    if num_rows:
        geometry = validation.CacheGeometry(num_pages, page_size, page_size * abi.RECORD_BYTES)
        _launch(_pack_variant(page_size), num_rows, _NO_PTR, _NO_PTR, latent_kv.data_ptr(), cache, _NO_PTR, _NO_PTR, _NO_PTR, geometry, 0, num_rows)
    return cache
