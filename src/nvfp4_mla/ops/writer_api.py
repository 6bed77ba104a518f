"""The public writer functions (semantics: docs/format.md sections 2-7, ``nvfp4_mla.reference``):
typed and documented, each dispatching to its entry's eager path, or under ``torch.compile`` to its
custom op. The entries themselves (their builds, kernel paths and descriptions, from which the ops
are made) are in :mod:`.writers`; :mod:`nvfp4_mla.ops` exports this module's ``__all__``.
"""

from __future__ import annotations

import torch

from .. import validation
from .entry import make
from .library import KernelLibrary, check_traceable
from .writers import APPEND, KV, MAIN, PACK

__all__ = [
    "cake_dsv4_nvfp4_kv_rope_quantize_insert",
    "cake_dsv4_nvfp4_rope_quantize_insert",
    "nvfp4_quantize_append_sparse_mla_cache",
    "nvfp4_quantize_pack_sparse_mla_cache",
]

_main, (_main_op, _main_inplace_op) = make(MAIN)
_kv, (_kv_op,) = make(KV)
_append, (_append_op,) = make(APPEND)
_pack, (_pack_op,) = make(PACK)

_is_compiling = torch.compiler.is_compiling


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
    library: KernelLibrary | None = None,
) -> torch.Tensor:
    """Rotate q, then rotate, quantize and insert kv into the DeepSeek-V4 NVFP4 cache, in one launch.

    The cache bytes equal appending the BF16-rounded roped KV row
    (:func:`nvfp4_quantize_append_sparse_mla_cache`); ``q_out`` is the fp32 rotation of each live
    head rounded to BF16, with zero-filled padded heads. Rows ``>= slot_mapping.numel()``
    (data-parallel padding) get their ``q_out`` rows but are not inserted; negative and
    out-of-range slots are skipped. A row whose position is outside ``cos_sin_cache`` is not
    inserted and its live ``q_out`` heads are BF16 NaN (left untouched in place).

    On CUDA tensors this is one launch of a compiled kernel; a call with no CUDA tensor (CPU
    tensors) runs :func:`nvfp4_mla.reference.cake_dsv4_nvfp4_rope_quantize_insert` instead, which
    writes the same bytes. The same holds for every writer entry, each with its reference.

    Parameters
    ----------
    q : torch.Tensor
        Contiguous BF16 ``[num_tokens, num_heads, 512]`` queries (448 NoPE dims, then 64 RoPE dims).
    kv : torch.Tensor
        Contiguous BF16 ``[num_tokens, 512]`` latent KV rows, one per query token (unrotated).
    cache : torch.Tensor
        uint8 NVFP4 paged cache: ``[num_pages, page_size, 384]``, HND ``[num_pages, 1, page_size, 384]``
        or NHD ``[num_pages, page_size, 1, 384]``; any page size; page stride a multiple of 16 bytes
        (padded pools accepted). Only the addressed records are written.
    slot_mapping : torch.Tensor
        Contiguous 1-D int32 or int64, at most ``num_tokens`` entries, ``page * page_size + entry``.
        A valid slot must not repeat within one call.
    positions : torch.Tensor
        Contiguous 1-D int64 ``[num_tokens]`` rows of ``cos_sin_cache`` (int32 is rejected, not converted).
    cos_sin_cache : torch.Tensor
        Contiguous fp32 ``[max_position, 64]``: ``cos[32] | sin[32]``; pair ``p`` uses column ``p``.
    q_head_padded : int
        Heads of ``q_out``: 0 (cache only) or one of 8, 16, 32, 64, 128, at least ``num_heads``.
    apply_q_rope : bool
        Rotate the live heads (default); False copies them bitwise.
    q_inplace : bool
        Rotate dims 448..511 of ``q`` in place and return ``q`` (needs ``num_heads`` in
        8, 16, 32, 64, 128 and ``q_head_padded`` 0 or ``num_heads``).
    library : KernelLibrary, optional
        The kernels and plan table to use on CUDA tensors (tests and benchmarks); default: the process's.

    Returns
    -------
    torch.Tensor
        ``q_out``, a new BF16 ``[num_tokens, q_head_padded, 512]`` tensor, or ``q`` itself in place.

    Raises
    ------
    ValueError
        On any argument outside the contract (docs/format.md section 6), before anything is written.
    """
    if _is_compiling():
        check_traceable(library)
        # Traced with fake tensors: check what eager would refuse and is known while tracing; the
        # op checks the rest when it runs.
        validation.check_flag(apply_q_rope, "apply_q_rope")
        validation.check_flag(q_inplace, "q_inplace")
        validation.check_q_options(q.shape[1], q_head_padded, q_inplace)
        if q_inplace:
            if q.requires_grad:  # (is_inference() cannot be traced: the op checks it when it runs)
                validation.check_mutable(q, "q")
            _main_inplace_op(q, kv, cache, slot_mapping, positions, cos_sin_cache, q_head_padded, apply_q_rope)
            return q
        return _main_op(q, kv, cache, slot_mapping, positions, cos_sin_cache, q_head_padded, apply_q_rope)
    return _main(library, q, kv, cache, slot_mapping, positions, cos_sin_cache, q_head_padded, apply_q_rope, q_inplace)


def cake_dsv4_nvfp4_kv_rope_quantize_insert(
    kv: torch.Tensor,
    cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    positions: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    *,
    compress_ratio: int = 1,
    library: KernelLibrary | None = None,
) -> None:
    """Rotate, quantize and insert latent KV rows (no query), in one launch.

    Row ``i < slot_mapping.numel()`` is inserted when its slot is valid and
    ``(positions[i] + 1) % compress_ratio == 0``; its RoPE row is
    ``positions[i] // compress_ratio * compress_ratio`` (the compressed pool of ratio 2 and
    speculative-context writes). Negative positions and RoPE rows outside ``cos_sin_cache`` are
    not inserted.

    Parameters
    ----------
    kv, cache, slot_mapping, positions, cos_sin_cache : torch.Tensor
        As in :func:`cake_dsv4_nvfp4_rope_quantize_insert`.
    compress_ratio : int
        1 or 2.
    library : KernelLibrary, optional
        The kernels and plan table to use on CUDA tensors (tests and benchmarks); default: the process's.

    Returns
    -------
    None
        The cache is updated in place.
    """
    if _is_compiling():
        check_traceable(library)
        validation.check_compress_ratio(compress_ratio)
        return _kv_op(kv, cache, slot_mapping, positions, cos_sin_cache, compress_ratio)
    return _kv(library, kv, cache, slot_mapping, positions, cos_sin_cache, compress_ratio)


def nvfp4_quantize_append_sparse_mla_cache(
    latent_kv: torch.Tensor, slot_mapping: torch.Tensor, cache: torch.Tensor, *, library: KernelLibrary | None = None
) -> None:
    """Quantize already-roped BF16 rows and insert row ``i`` at ``slot_mapping[i]`` (the unfused writer).

    Parameters
    ----------
    latent_kv : torch.Tensor
        Contiguous BF16 ``[num_rows, 512]``.
    slot_mapping : torch.Tensor
        Contiguous 1-D int32 or int64, at most ``num_rows`` entries; negative and out-of-range
        slots are skipped.
    cache : torch.Tensor
        As in :func:`cake_dsv4_nvfp4_rope_quantize_insert`.
    library : KernelLibrary, optional
        The kernels and plan table to use on CUDA tensors (tests and benchmarks); default: the process's.

    Returns
    -------
    None
        The cache is updated in place.
    """
    if _is_compiling():
        check_traceable(library)
        return _append_op(latent_kv, slot_mapping, cache)
    return _append(library, latent_kv, slot_mapping, cache)


def nvfp4_quantize_pack_sparse_mla_cache(
    latent_kv: torch.Tensor, *, kv_layout: str = "HND", library: KernelLibrary | None = None
) -> torch.Tensor:
    """Quantize whole pages into a new cache.

    Parameters
    ----------
    latent_kv : torch.Tensor
        Contiguous BF16 ``[num_pages, page_size, 512]`` (already roped).
    kv_layout : str
        "HND" gives ``[num_pages, 1, page_size, 384]``, "NHD" ``[num_pages, page_size, 1, 384]``.
    library : KernelLibrary, optional
        The kernels and plan table to use on CUDA tensors (tests and benchmarks); default: the process's.

    Returns
    -------
    torch.Tensor
        The new uint8 cache, every byte written; equal to appending every row at slot
        ``page * page_size + entry``.
    """
    if _is_compiling():
        check_traceable(library)
        return _pack_op(latent_kv, kv_layout)
    return _pack(library, latent_kv, kv_layout)
