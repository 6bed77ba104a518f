"""The writer entries on the GPU (semantics: docs/format.md sections 2-7, ``nvfp4_mla.reference``)
and their torch custom ops.

A call with a CUDA tensor among its tensors takes the kernel path (:mod:`.writer_calls`: the
checks of :mod:`nvfp4_mla.validation`, at most one output allocation, one plan lookup in its
:class:`~nvfp4_mla.ops.library.KernelLibrary` (``library=``, default the process's) and one
launch with raw pointers on torch's current stream, no host synchronisation); a call with none
(CPU tensors) runs the same entry of :mod:`nvfp4_mla.reference`, which writes the same bytes.
"""

from __future__ import annotations

import torch

from .. import abi, reference, validation
from .library import DEFAULT, KernelLibrary, check_traceable
from .writer_calls import append, kv_rope_quantize_insert, on_cuda, pack, rope_quantize_insert

# ---------------------------------------------------------------- torch custom ops
# Registered so torch.compile traces the entries without a graph break (the fake
# implementations give output shapes). Eager calls skip the dispatcher: it would cost more host
# time than the whole launch path. At run time the ops call the public entries (not compiling
# then), which send CUDA tensors to the kernels and CPU tensors to the reference.

_Tensor = torch.Tensor


@torch.library.custom_op("nvfp4_mla::rope_quantize_insert", mutates_args=("cache",))
def _rope_quantize_insert_op(
    q: _Tensor,
    kv: _Tensor,
    cache: _Tensor,
    slot_mapping: _Tensor,
    positions: _Tensor,
    cos_sin_cache: _Tensor,
    q_head_padded: int,
    apply_q_rope: bool,
) -> _Tensor:
    return cake_dsv4_nvfp4_rope_quantize_insert(
        q, kv, cache, slot_mapping, positions, cos_sin_cache, q_head_padded=q_head_padded, apply_q_rope=apply_q_rope
    )


@_rope_quantize_insert_op.register_fake
def _(
    q: _Tensor,
    kv: _Tensor,
    cache: _Tensor,
    slot_mapping: _Tensor,
    positions: _Tensor,
    cos_sin_cache: _Tensor,
    q_head_padded: int,
    apply_q_rope: bool,
) -> _Tensor:
    return q.new_empty((q.shape[0], q_head_padded, abi.HEAD_DIM))


@torch.library.custom_op("nvfp4_mla::rope_quantize_insert_inplace", mutates_args=("q", "cache"))
def _rope_quantize_insert_inplace_op(
    q: _Tensor,
    kv: _Tensor,
    cache: _Tensor,
    slot_mapping: _Tensor,
    positions: _Tensor,
    cos_sin_cache: _Tensor,
    q_head_padded: int,
    apply_q_rope: bool,
) -> None:
    cake_dsv4_nvfp4_rope_quantize_insert(
        q,
        kv,
        cache,
        slot_mapping,
        positions,
        cos_sin_cache,
        q_head_padded=q_head_padded,
        apply_q_rope=apply_q_rope,
        q_inplace=True,
    )


@_rope_quantize_insert_inplace_op.register_fake
def _(
    q: _Tensor,
    kv: _Tensor,
    cache: _Tensor,
    slot_mapping: _Tensor,
    positions: _Tensor,
    cos_sin_cache: _Tensor,
    q_head_padded: int,
    apply_q_rope: bool,
) -> None:
    return None


@torch.library.custom_op("nvfp4_mla::kv_rope_quantize_insert", mutates_args=("cache",))
def _kv_rope_quantize_insert_op(
    kv: _Tensor, cache: _Tensor, slot_mapping: _Tensor, positions: _Tensor, cos_sin_cache: _Tensor, compress_ratio: int
) -> None:
    cake_dsv4_nvfp4_kv_rope_quantize_insert(
        kv, cache, slot_mapping, positions, cos_sin_cache, compress_ratio=compress_ratio
    )


@_kv_rope_quantize_insert_op.register_fake
def _(
    kv: _Tensor, cache: _Tensor, slot_mapping: _Tensor, positions: _Tensor, cos_sin_cache: _Tensor, compress_ratio: int
) -> None:
    return None


@torch.library.custom_op("nvfp4_mla::quantize_append", mutates_args=("cache",))
def _append_op(latent_kv: _Tensor, slot_mapping: _Tensor, cache: _Tensor) -> None:
    nvfp4_quantize_append_sparse_mla_cache(latent_kv, slot_mapping, cache)


@_append_op.register_fake
def _(latent_kv: _Tensor, slot_mapping: _Tensor, cache: _Tensor) -> None:
    return None


@torch.library.custom_op("nvfp4_mla::quantize_pack", mutates_args=())
def _pack_op(latent_kv: _Tensor, kv_layout: str) -> _Tensor:
    return nvfp4_quantize_pack_sparse_mla_cache(latent_kv, kv_layout=kv_layout)


@_pack_op.register_fake
def _(latent_kv: _Tensor, kv_layout: str) -> _Tensor:
    return reference.new_cache(latent_kv.shape[0], latent_kv.shape[1], kv_layout, latent_kv.device)


_is_compiling = torch.compiler.is_compiling


# ---------------------------------------------------------------- public entries


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
            torch.ops.nvfp4_mla.rope_quantize_insert_inplace(
                q, kv, cache, slot_mapping, positions, cos_sin_cache, q_head_padded, apply_q_rope
            )
            return q
        return torch.ops.nvfp4_mla.rope_quantize_insert(
            q, kv, cache, slot_mapping, positions, cos_sin_cache, q_head_padded, apply_q_rope
        )
    if on_cuda((q, kv, cache, slot_mapping, positions, cos_sin_cache)):
        return rope_quantize_insert(
            DEFAULT if library is None else library,
            q,
            kv,
            cache,
            slot_mapping,
            positions,
            cos_sin_cache,
            q_head_padded,
            apply_q_rope,
            q_inplace,
        )
    return reference.cake_dsv4_nvfp4_rope_quantize_insert(
        q,
        kv,
        cache,
        slot_mapping,
        positions,
        cos_sin_cache,
        q_head_padded=q_head_padded,
        apply_q_rope=apply_q_rope,
        q_inplace=q_inplace,
    )


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
        return torch.ops.nvfp4_mla.kv_rope_quantize_insert(
            kv, cache, slot_mapping, positions, cos_sin_cache, compress_ratio
        )
    if on_cuda((kv, cache, slot_mapping, positions, cos_sin_cache)):
        lib = DEFAULT if library is None else library
        return kv_rope_quantize_insert(lib, kv, cache, slot_mapping, positions, cos_sin_cache, compress_ratio)
    return reference.cake_dsv4_nvfp4_kv_rope_quantize_insert(
        kv, cache, slot_mapping, positions, cos_sin_cache, compress_ratio=compress_ratio
    )


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
        return torch.ops.nvfp4_mla.quantize_append(latent_kv, slot_mapping, cache)
    if on_cuda((latent_kv, slot_mapping, cache)):
        return append(DEFAULT if library is None else library, latent_kv, slot_mapping, cache)
    return reference.nvfp4_quantize_append_sparse_mla_cache(latent_kv, slot_mapping, cache)


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
        return torch.ops.nvfp4_mla.quantize_pack(latent_kv, kv_layout)
    if on_cuda((latent_kv,)):
        return pack(DEFAULT if library is None else library, latent_kv, kv_layout)
    return reference.nvfp4_quantize_pack_sparse_mla_cache(latent_kv, kv_layout=kv_layout)
