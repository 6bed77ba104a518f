"""Reference writers: the four entries that quantize rows into the cache (docs/format.md sections 3 and 5)."""

from __future__ import annotations

import torch

from .. import abi, validation
from .numerics import bf16_nan, quantize_rows, rope

__all__ = [
    "cake_dsv4_nvfp4_kv_rope_quantize_insert",
    "cake_dsv4_nvfp4_rope_quantize_insert",
    "new_cache",
    "nvfp4_quantize_append_sparse_mla_cache",
    "nvfp4_quantize_pack_sparse_mla_cache",
]


def _insert(
    cache: torch.Tensor, layout: validation.CacheLayout, rows: torch.Tensor, slots: torch.Tensor, keep: torch.Tensor
) -> None:
    """Writes the records of ``rows[keep]`` at ``slots[keep]``; invalid slots are skipped."""
    num_pages, page_size, _ = layout
    slots = slots.long()
    keep = keep & (slots >= 0) & (slots < num_pages * page_size)
    rows, slots = rows[keep], slots[keep]
    data, scales = abi.record_views(cache, layout)
    row_data, row_scales = quantize_rows(rows)
    pages, entries = slots // page_size, slots % page_size
    data[pages, entries] = row_data
    scales[pages, entries] = row_scales


def _cos_sin(cos_sin_cache: torch.Tensor, rope_rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """cos, sin ``[n, 32]`` of each RoPE row, and whether the row is inside the table.

    Out-of-range rows read row 0 instead (or zeros for an empty table); callers mask them.
    """
    in_range = (rope_rows >= 0) & (rope_rows < cos_sin_cache.shape[0])
    if cos_sin_cache.shape[0] == 0:
        table = torch.zeros(rope_rows.shape[0], abi.ROPE_DIM, device=rope_rows.device)
    else:
        table = cos_sin_cache[torch.where(in_range, rope_rows, 0)]
    return table[:, : abi.ROPE_PAIRS], table[:, abi.ROPE_PAIRS :], in_range


def _roped(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """``x[..., 512]`` with its last 64 dims rotated; NoPE dims bitwise."""
    return torch.cat((x[..., : abi.NOPE_DIM], rope(x[..., abi.NOPE_DIM :], cos, sin)), dim=-1)


# ---------------------------------------------------------------- entries


@torch.no_grad()  # like the kernels: the writers are not differentiable
def cake_dsv4_nvfp4_rope_quantize_insert(
    q: torch.Tensor,
    kv: torch.Tensor,
    cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    positions: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    *,
    q_head_padded: int = 0,
    apply_q_rope: bool = True,
    q_inplace: bool = False,
) -> torch.Tensor:
    """The main fused writer in pure torch, on any device: the definition of its bytes
    (docs/format.md sections 4-5).

    Arguments, result and refusals are those of :func:`nvfp4_mla.cake_dsv4_nvfp4_rope_quantize_insert`
    (see its parameters), with tensors on any one device (the CPU included) instead of CUDA only.
    It writes the same bytes into ``cache`` and returns the same ``q_out`` (or ``q`` in place).
    """
    layout = validation.check_main(
        q, kv, cache, slot_mapping, positions, cos_sin_cache, q_head_padded, apply_q_rope, q_inplace, need_cuda=False
    )
    num_tokens, num_heads = q.shape[0], q.shape[1]
    if num_tokens == 0:
        return q if q_inplace else q.new_empty(0, q_head_padded, abi.HEAD_DIM)
    cos, sin, in_range = _cos_sin(cos_sin_cache, positions)
    n = slot_mapping.shape[0]
    if n:
        _insert(cache, layout, _roped(kv[:n], cos[:n], sin[:n]), slot_mapping, in_range[:n])

    if q_inplace:
        if apply_q_rope:
            rotated = rope(q[..., abi.NOPE_DIM :], cos[:, None], sin[:, None])
            keep = in_range[:, None, None]
            q[..., abi.NOPE_DIM :] = torch.where(keep, rotated, q[..., abi.NOPE_DIM :])
        return q
    q_out = q.new_zeros(num_tokens, q_head_padded, abi.HEAD_DIM)
    if q_head_padded:
        live = q
        if apply_q_rope:
            live = torch.where(in_range[:, None, None], _roped(q, cos[:, None], sin[:, None]), bf16_nan(q.device))
        q_out[:, :num_heads] = live
    return q_out


@torch.no_grad()  # like the kernels: the writers are not differentiable
def cake_dsv4_nvfp4_kv_rope_quantize_insert(
    kv: torch.Tensor,
    cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    positions: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    *,
    compress_ratio: int = 1,
) -> None:
    """The KV-only writer in pure torch, on any device: the definition of its bytes.

    As :func:`nvfp4_mla.cake_dsv4_nvfp4_kv_rope_quantize_insert` (see its parameters), tensors on
    any one device: row ``i`` is inserted when ``(positions[i] + 1) % compress_ratio == 0``, roped
    with row ``positions[i] // compress_ratio * compress_ratio``; negative positions and RoPE rows
    outside ``cos_sin_cache`` are never inserted.
    """
    layout = validation.check_kv(kv, cache, slot_mapping, positions, cos_sin_cache, compress_ratio, need_cuda=False)
    n = slot_mapping.shape[0]
    if n == 0:
        return None
    pos = positions[:n]
    rope_rows = torch.div(pos, compress_ratio, rounding_mode="floor") * compress_ratio
    cos, sin, in_range = _cos_sin(cos_sin_cache, rope_rows)
    keep = in_range & (pos >= 0) & ((pos + 1) % compress_ratio == 0)
    _insert(cache, layout, _roped(kv[:n], cos, sin), slot_mapping, keep)
    return None


@torch.no_grad()  # like the kernels: the writers are not differentiable
def nvfp4_quantize_append_sparse_mla_cache(
    latent_kv: torch.Tensor, slot_mapping: torch.Tensor, cache: torch.Tensor
) -> None:
    """The unfused writer in pure torch, on any device: quantizes already-roped BF16 rows and
    inserts row ``i`` at ``slot_mapping[i]``; the bytes every other writer is defined by.

    As :func:`nvfp4_mla.nvfp4_quantize_append_sparse_mla_cache` (see its parameters), tensors on
    any one device.
    """
    layout = validation.check_append(latent_kv, slot_mapping, cache, need_cuda=False)
    n = slot_mapping.shape[0]
    if n:
        keep = torch.ones(n, dtype=torch.bool, device=latent_kv.device)
        _insert(cache, layout, latent_kv[:n], slot_mapping, keep)


def new_cache(num_pages: int, page_size: int, kv_layout: str, device: torch.device | str) -> torch.Tensor:
    """An uninitialised packed cache of the given layout (what the pack entry returns)."""
    shape = (
        (num_pages, 1, page_size, abi.RECORD_BYTES)
        if kv_layout == "HND"
        else (num_pages, page_size, 1, abi.RECORD_BYTES)
    )
    return torch.empty(shape, dtype=torch.uint8, device=device)


@torch.no_grad()  # like the kernels: the writers are not differentiable
def nvfp4_quantize_pack_sparse_mla_cache(latent_kv: torch.Tensor, *, kv_layout: str = "HND") -> torch.Tensor:
    """The whole-page writer in pure torch, on any device: ``[num_pages, page_size, 512]`` BF16
    rows into a new cache (``kv_layout`` "HND" or "NHD").

    As :func:`nvfp4_mla.nvfp4_quantize_pack_sparse_mla_cache` (see its parameters), tensors on any
    device; equal to appending every row at slot ``page * page_size + entry``.
    """
    validation.check_pack(latent_kv, kv_layout, need_cuda=False)
    num_pages, page_size = latent_kv.shape[0], latent_kv.shape[1]
    cache = new_cache(num_pages, page_size, kv_layout, latent_kv.device)
    layout = validation.check_cache(cache)
    rows = latent_kv.reshape(num_pages * page_size, abi.HEAD_DIM)
    slots = torch.arange(num_pages * page_size, device=latent_kv.device)
    _insert(cache, layout, rows, slots, torch.ones_like(slots, dtype=torch.bool))
    return cache
