"""The writer entries on the GPU (semantics: docs/format.md sections 2-7, ``nvfp4_mla.reference``)
and their torch custom ops.

A call with a CUDA tensor among its tensors takes the kernel path (:mod:`.writer_calls`: the
checks of :mod:`nvfp4_mla.validation`, at most one output allocation, one plan lookup in its
:class:`~nvfp4_mla.ops.library.KernelLibrary` (``library=``, default the process's) and one
launch with raw pointers on torch's current stream, no host synchronisation); a call with none
(CPU tensors) runs the same entry of :mod:`nvfp4_mla.reference`, which writes the same bytes.

Each entry is described once (:class:`~nvfp4_mla.ops.entry.Entry`, in :data:`ENTRIES`): its custom
ops and their fakes, that dispatch and its registry entry are made from the description. A new
writer entry touches its description and public function here, its kernel path
(:mod:`.writer_calls`), its build (:mod:`.writer_spec`: a named constructor, its catalogue), the
kernel (``kernels/nvfp4_mla_write.cu``), its reference and checks (:mod:`nvfp4_mla.reference`,
:mod:`nvfp4_mla.validation`), and the lists that export its name.
"""

from __future__ import annotations

import torch

from .. import abi, reference, validation
from . import writer_calls, writer_spec
from .entry import Entry, Op, Request, make
from .library import KernelLibrary, check_traceable
from .writer_spec import WriterSpec

# ---------------------------------------------------------------- the entries' descriptions
# Registered as custom ops so torch.compile traces the entries without a graph break. Eager calls
# skip the dispatcher: it would cost more host time than the whole launch path.


def _checked_slots(page_size: int, slot_dtype: torch.dtype | None) -> torch.dtype:
    """A writer request's page size and slot dtype, checked like the entries' arguments."""
    validation.check_page_size(page_size)
    validation.check_slot_dtype(slot_dtype)
    assert slot_dtype is not None
    return slot_dtype


def _main_kernels(
    page_size: int,
    slot_dtype: torch.dtype | None,
    num_heads: int,
    q_head_padded: int,
    apply_q_rope: bool,
    q_inplace: bool,
    **_: object,
) -> tuple[WriterSpec]:
    slots = _checked_slots(page_size, slot_dtype)
    if type(num_heads) is not int or num_heads < 1:
        raise ValueError(f"num_heads must be a positive int for the main entry, got {num_heads!r}")
    validation.check_flag(apply_q_rope, "apply_q_rope")
    validation.check_flag(q_inplace, "q_inplace")
    validation.check_q_options(num_heads, q_head_padded, q_inplace)
    return (WriterSpec.main(page_size, slots, num_heads, q_head_padded, apply_q_rope, q_inplace),)


def _kv_kernels(page_size: int, slot_dtype: torch.dtype | None, compress_ratio: int, **_: object) -> tuple[WriterSpec]:
    slots = _checked_slots(page_size, slot_dtype)
    validation.check_compress_ratio(compress_ratio)
    return (WriterSpec.kv(page_size, slots, compress_ratio),)


def _append_kernels(page_size: int, slot_dtype: torch.dtype | None, **_: object) -> tuple[WriterSpec]:
    return (WriterSpec.append(page_size, _checked_slots(page_size, slot_dtype)),)


def _pack_kernels(page_size: int, **_: object) -> tuple[WriterSpec]:
    validation.check_page_size(page_size)
    return (WriterSpec.pack(page_size),)


_ROPED = "Tensor kv, Tensor cache, Tensor slot_mapping, Tensor positions, Tensor cos_sin_cache"

MAIN = Entry(
    "cake_dsv4_nvfp4_rope_quantize_insert",
    args=f"Tensor q, {_ROPED}, SymInt q_head_padded, bool apply_q_rope",
    ops=(
        Op(
            "rope_quantize_insert",
            "Tensor",
            mutates=("cache",),
            fixed=(False,),
            fake=lambda q, q_head_padded, **_: q.new_empty((q.shape[0], q_head_padded, abi.HEAD_DIM)),
        ),
        Op("rope_quantize_insert_inplace", mutates=("q", "cache"), fixed=(True,)),
    ),
    kernel=writer_calls.rope_quantize_insert,
    request=Request("main", _main_kernels, writer_spec.catalogue, note="the fused writer"),
)
KV = Entry(
    "cake_dsv4_nvfp4_kv_rope_quantize_insert",
    args=f"{_ROPED}, SymInt compress_ratio",
    ops=(Op("kv_rope_quantize_insert", mutates=("cache",)),),
    kernel=writer_calls.kv_rope_quantize_insert,
    request=Request("kv", _kv_kernels, writer_spec.catalogue),
)
APPEND = Entry(
    "nvfp4_quantize_append_sparse_mla_cache",
    args="Tensor latent_kv, Tensor slot_mapping, Tensor cache",
    ops=(Op("quantize_append", mutates=("cache",)),),
    kernel=writer_calls.append,
    request=Request("append", _append_kernels, writer_spec.catalogue),
)
PACK = Entry(
    "nvfp4_quantize_pack_sparse_mla_cache",
    args="Tensor latent_kv, str kv_layout",
    ops=(
        Op(
            "quantize_pack",
            "Tensor",
            fake=lambda latent_kv, kv_layout, **_: reference.new_cache(
                latent_kv.shape[0], latent_kv.shape[1], kv_layout, latent_kv.device
            ),
        ),
    ),
    kernel=writer_calls.pack,
    request=Request("pack", _pack_kernels, writer_spec.catalogue),
)
ENTRIES = (MAIN, KV, APPEND, PACK)  # in the registry's order

_main, (_main_op, _main_inplace_op) = make(MAIN)
_kv, (_kv_op,) = make(KV)
_append, (_append_op,) = make(APPEND)
_pack, (_pack_op,) = make(PACK)

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
