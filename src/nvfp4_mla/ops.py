"""The GPU writer entries: validate, look up the compiled kernel, launch once on torch's current stream.

Signatures and semantics are docs/format.md sections 2-7 (and ``nvfp4_mla.reference``, which
defines the bytes). Each call does: the checks of :mod:`validation`, at most one output
allocation, one dict lookup of the kernel keyed on (device, arguments that fix the geometry), and
one kernel launch with raw pointers. No host synchronisation, so calls can be captured in CUDA
graphs.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator
from typing import NamedTuple

import torch
from torch.autograd.graph import increment_version

from . import abi, kernel_cache, launch, validation
from .reference import new_cache
from .variant import Variant

_NO_PTR = 0
_BF16 = torch.bfloat16


class _Plan(NamedTuple):
    """What a signature fixes of a call: its per-call checks, launch, grid and scalar parameters."""

    checks: validation.PointerChecks
    # The loaded kernel's launch with this grid bound: called with the stream, the pointers and
    # ``scalars`` (no Python frame of its own). None when there is nothing to launch.
    launch: functools.partial[None] | None
    device_index: int
    scalars: tuple[int, ...]  # page_stride, capacity (slots), max_position, num_kv_rows, kv_blocks, q_rows
    out_shape: tuple[int, ...]  # of the tensor the entry allocates (q_out, the packed cache); () if none
    out_strides: tuple[int, ...]  # its contiguous strides


# The kernels loaded, one dict per entry, keyed on the device and the arguments that fix the kernel.
_main_kernels: dict[tuple, launch.Launcher] = {}
_kv_kernels: dict[tuple, launch.Launcher] = {}
_append_kernels: dict[tuple, launch.Launcher] = {}
_pack_kernels: dict[tuple, launch.Launcher] = {}
# Call plans, one dict per entry, keyed on validation.signature: the one lookup a warm call does.
# A miss runs every check and builds the plan; a hit runs the per-call checks only
# (validation.check_pointers). Cleared when full, so varying batch sizes cannot grow it forever.
MAX_PLANS = 4096
_main_plans: dict[tuple | None, _Plan] = {}
_kv_plans: dict[tuple | None, _Plan] = {}
_append_plans: dict[tuple | None, _Plan] = {}
_pack_plans: dict[tuple | None, _Plan] = {}
# Where a miss takes its kernel: the process's kernel cache, and the KV rows a warp (None: the
# Variant constructors' own). kernels_from() swaps both, with fresh tables, for the benchmark.
_kernel_cache = kernel_cache.default
_kv_rows_per_warp: int | None = None


@contextlib.contextmanager
def kernels_from(cache: kernel_cache.KernelCache, kv_rows_per_warp: int | None = None) -> Iterator[None]:
    """Within the block, the entries take their kernels from ``cache``, in tables of their own.

    For the benchmark's other kernels (a stubbed quantizer, another number of KV rows a warp):
    the same validation and launch geometry, other cubins. The shipped tables and cache are back
    after the block. Not thread-safe: no other thread may call the entries meanwhile.

    Parameters
    ----------
    cache
        Where the kernels come from (compiled there on first use).
    kv_rows_per_warp
        The Variant's ``kv_rows_per_warp`` (None: the constructors' default).
    """
    global _kernel_cache, _kv_rows_per_warp, _main_kernels, _kv_kernels, _append_kernels, _pack_kernels
    global _main_plans, _kv_plans, _append_plans, _pack_plans
    shipped = (
        (_kernel_cache, _kv_rows_per_warp),
        (_main_kernels, _kv_kernels, _append_kernels, _pack_kernels),
        (_main_plans, _kv_plans, _append_plans, _pack_plans),
    )
    _kernel_cache, _kv_rows_per_warp = (lambda: cache), kv_rows_per_warp
    _main_kernels, _kv_kernels, _append_kernels, _pack_kernels = {}, {}, {}, {}
    _main_plans, _kv_plans, _append_plans, _pack_plans = {}, {}, {}, {}
    try:
        yield
    finally:
        (_kernel_cache, _kv_rows_per_warp), kernels, plans = shipped
        _main_kernels, _kv_kernels, _append_kernels, _pack_kernels = kernels
        _main_plans, _kv_plans, _append_plans, _pack_plans = plans


def _plan(
    plans: dict,
    signature: tuple | None,
    kernels: dict,
    kernel_key: tuple,
    variant: Variant,
    checks: validation.PointerChecks,
    geometry: validation.CacheGeometry,
    max_position: int,
    num_tokens: int,
    num_kv_rows: int,
    out_shape: tuple[int, ...] = (),
) -> _Plan:
    """Builds (after the full checks passed) and stores the plan of ``signature``."""
    device_index = kernel_key[0]
    if _kv_rows_per_warp is not None:
        variant = variant._replace(kv_rows_per_warp=_kv_rows_per_warp)
    bound = None  # a call with nothing to launch loads and launches no kernel (a 0-block grid is an error)
    kv_blocks = 0
    if variant.kv_units(num_kv_rows) or variant.q_units(num_tokens):
        launcher = kernels.get(kernel_key)
        if launcher is None:
            launcher = kernels[kernel_key] = _kernel_cache().launcher(device_index, variant)
        kv_blocks, blocks = variant.grid(num_tokens, num_kv_rows, launcher.resident_blocks, launcher.sms)
        bound = functools.partial(launcher.launch, blocks, 1, 1, 0)
    num_pages, page_size, page_stride = geometry
    scalars = (page_stride, num_pages * page_size, max_position, num_kv_rows, kv_blocks, variant.q_rows(num_tokens))
    plan = _Plan(checks, bound, device_index, scalars, out_shape, launch.contiguous_strides(out_shape))
    if signature is not None:
        if len(plans) >= MAX_PLANS:
            plans.clear()
        plans[signature] = plan
    return plan


# ---------------------------------------------------------------- eager implementations


def _rope_quantize_insert(q, kv, cache, slot_mapping, positions, cos_sin_cache, q_head_padded, apply_q_rope, q_inplace):
    tensors = (q, kv, cache, slot_mapping, positions, cos_sin_cache)
    signature = validation.signature(tensors, (q_head_padded, apply_q_rope, q_inplace))
    plan = _main_plans.get(signature)
    if plan is None or validation.DEBUG_CHECKS:
        geometry = validation.check_main(
            q, kv, cache, slot_mapping, positions, cos_sin_cache, q_head_padded, apply_q_rope, q_inplace, need_cuda=True
        )
        num_tokens, num_heads = q.shape[0], q.shape[1]
        device_index = cache.get_device()
        key = (device_index, geometry.page_size, slot_mapping.dtype, num_heads, q_head_padded, apply_q_rope, q_inplace)
        plan = _plan(
            _main_plans,
            signature,
            _main_kernels,
            key,
            Variant.main(*key[1:]),
            validation.main_pointer_checks(tensors, geometry, q_inplace),
            geometry,
            cos_sin_cache.shape[0],
            num_tokens,
            slot_mapping.shape[0],
            (num_tokens, q_head_padded, abi.HEAD_DIM),
        )
    q_ptr, kv_ptr, cache_ptr, slots_ptr, positions_ptr, cos_sin_ptr = validation.check_pointers(tensors, plan.checks)
    q_out = q if q_inplace else launch.new_output(q, plan.out_shape, plan.out_strides, _BF16, plan.device_index)
    if plan.launch is not None:  # else T == 0, or a cache-only call without slots
        stream = launch.current_raw_stream(plan.device_index)
        q_out_ptr = q_out.data_ptr()
        plan.launch(stream, q_ptr, q_out_ptr, kv_ptr, cache_ptr, slots_ptr, positions_ptr, cos_sin_ptr, *plan.scalars)
        increment_version(cache)  # the kernel wrote it: autograd and views must see a new version
        if q_inplace and apply_q_rope:
            increment_version(q)
    return q_out


def _kv_rope_quantize_insert(kv, cache, slot_mapping, positions, cos_sin_cache, compress_ratio):
    tensors = (kv, cache, slot_mapping, positions, cos_sin_cache)
    signature = validation.signature(tensors, (compress_ratio,))
    plan = _kv_plans.get(signature)
    if plan is None or validation.DEBUG_CHECKS:
        geometry = validation.check_kv(
            kv, cache, slot_mapping, positions, cos_sin_cache, compress_ratio, need_cuda=True
        )
        key = (cache.get_device(), geometry.page_size, slot_mapping.dtype, compress_ratio)
        plan = _plan(
            _kv_plans,
            signature,
            _kv_kernels,
            key,
            Variant.kv(*key[1:]),
            validation.kv_pointer_checks(tensors, geometry),
            geometry,
            cos_sin_cache.shape[0],
            0,
            slot_mapping.shape[0],
        )
    kv_ptr, cache_ptr, slots_ptr, positions_ptr, cos_sin_ptr = validation.check_pointers(tensors, plan.checks)
    if plan.launch is not None:
        stream = launch.current_raw_stream(plan.device_index)
        plan.launch(stream, _NO_PTR, _NO_PTR, kv_ptr, cache_ptr, slots_ptr, positions_ptr, cos_sin_ptr, *plan.scalars)
        increment_version(cache)
    return None


def _append(latent_kv, slot_mapping, cache):
    tensors = (latent_kv, slot_mapping, cache)
    signature = validation.signature(tensors, ())
    plan = _append_plans.get(signature)
    if plan is None or validation.DEBUG_CHECKS:
        geometry = validation.check_append(latent_kv, slot_mapping, cache, need_cuda=True)
        key = (cache.get_device(), geometry.page_size, slot_mapping.dtype)
        plan = _plan(
            _append_plans,
            signature,
            _append_kernels,
            key,
            Variant.append(*key[1:]),
            validation.append_pointer_checks(tensors, geometry),
            geometry,
            0,
            0,
            slot_mapping.shape[0],
        )
    kv_ptr, slots_ptr, cache_ptr = validation.check_pointers(tensors, plan.checks)
    if plan.launch is not None:
        stream = launch.current_raw_stream(plan.device_index)
        plan.launch(stream, _NO_PTR, _NO_PTR, kv_ptr, cache_ptr, slots_ptr, _NO_PTR, _NO_PTR, *plan.scalars)
        increment_version(cache)
    return None


def _pack(latent_kv, kv_layout):
    tensors = (latent_kv,)
    signature = validation.signature(tensors, (kv_layout,))
    plan = _pack_plans.get(signature)
    if plan is None or validation.DEBUG_CHECKS:
        validation.check_pack(latent_kv, kv_layout, need_cuda=True)
        num_pages, page_size = latent_kv.shape[0], latent_kv.shape[1]
        key = (latent_kv.get_device(), page_size)
        plan = _plan(
            _pack_plans,
            signature,
            _pack_kernels,
            key,
            Variant.pack(page_size),
            validation.PACK_POINTER_CHECKS,
            validation.CacheGeometry(num_pages, page_size, page_size * abi.RECORD_BYTES),
            0,
            0,
            num_pages * page_size,
            tuple(new_cache(num_pages, page_size, kv_layout, "meta").shape),
        )
    (kv_ptr,) = validation.check_pointers(tensors, plan.checks)
    cache = launch.new_output(latent_kv, plan.out_shape, plan.out_strides, torch.uint8, plan.device_index)
    if plan.launch is not None:
        stream = launch.current_raw_stream(plan.device_index)
        plan.launch(stream, _NO_PTR, _NO_PTR, kv_ptr, cache.data_ptr(), _NO_PTR, _NO_PTR, _NO_PTR, *plan.scalars)
    return cache


# ---------------------------------------------------------------- torch custom ops
# Registered so torch.compile traces the entries without a graph break (the fake
# implementations give output shapes). Eager calls skip the dispatcher: it would cost more host
# time than the whole launch path.

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
    return _rope_quantize_insert(
        q, kv, cache, slot_mapping, positions, cos_sin_cache, q_head_padded, apply_q_rope, False
    )


@_rope_quantize_insert_op.register_fake
def _(q, kv, cache, slot_mapping, positions, cos_sin_cache, q_head_padded, apply_q_rope):
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
    _rope_quantize_insert(q, kv, cache, slot_mapping, positions, cos_sin_cache, q_head_padded, apply_q_rope, True)


@_rope_quantize_insert_inplace_op.register_fake
def _(q, kv, cache, slot_mapping, positions, cos_sin_cache, q_head_padded, apply_q_rope):
    return None


@torch.library.custom_op("nvfp4_mla::kv_rope_quantize_insert", mutates_args=("cache",))
def _kv_rope_quantize_insert_op(
    kv: _Tensor, cache: _Tensor, slot_mapping: _Tensor, positions: _Tensor, cos_sin_cache: _Tensor, compress_ratio: int
) -> None:
    _kv_rope_quantize_insert(kv, cache, slot_mapping, positions, cos_sin_cache, compress_ratio)


@_kv_rope_quantize_insert_op.register_fake
def _(kv, cache, slot_mapping, positions, cos_sin_cache, compress_ratio):
    return None


@torch.library.custom_op("nvfp4_mla::quantize_append", mutates_args=("cache",))
def _append_op(latent_kv: _Tensor, slot_mapping: _Tensor, cache: _Tensor) -> None:
    _append(latent_kv, slot_mapping, cache)


@_append_op.register_fake
def _(latent_kv, slot_mapping, cache):
    return None


@torch.library.custom_op("nvfp4_mla::quantize_pack", mutates_args=())
def _pack_op(latent_kv: _Tensor, kv_layout: str) -> _Tensor:
    return _pack(latent_kv, kv_layout)


@_pack_op.register_fake
def _(latent_kv, kv_layout):
    return new_cache(latent_kv.shape[0], latent_kv.shape[1], kv_layout, latent_kv.device)


_is_compiling = torch.compiler.is_compiling


# ---------------------------------------------------------------- public entries


def cake_dsv4_nvfp4_rope_quantize_insert(
    q, kv, cache, slot_mapping, positions, cos_sin_cache, *, q_head_padded=0, apply_q_rope=True, q_inplace=False
):
    """Rotate q, then rotate, quantize and insert kv into the DeepSeek-V4 NVFP4 cache, in one launch.

    The cache bytes equal appending the BF16-rounded roped KV row
    (:func:`nvfp4_quantize_append_sparse_mla_cache`); ``q_out`` is the fp32 rotation of each live
    head rounded to BF16, with zero-filled padded heads. Rows ``>= slot_mapping.numel()``
    (data-parallel padding) get their ``q_out`` rows but are not inserted; negative and
    out-of-range slots are skipped. A row whose position is outside ``cos_sin_cache`` is not
    inserted and its live ``q_out`` heads are BF16 NaN (left untouched in place).

    Parameters
    ----------
    q : torch.Tensor
        Contiguous CUDA BF16 ``[num_tokens, num_heads, 512]`` queries (448 NoPE dims, then 64 RoPE dims).
    kv : torch.Tensor
        Contiguous CUDA BF16 ``[num_tokens, 512]`` latent KV rows, one per query token (unrotated).
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
    return _rope_quantize_insert(
        q, kv, cache, slot_mapping, positions, cos_sin_cache, q_head_padded, apply_q_rope, q_inplace
    )


def cake_dsv4_nvfp4_kv_rope_quantize_insert(kv, cache, slot_mapping, positions, cos_sin_cache, *, compress_ratio=1):
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

    Returns
    -------
    None
        The cache is updated in place.
    """
    if _is_compiling():
        validation.check_compress_ratio(compress_ratio)
        return torch.ops.nvfp4_mla.kv_rope_quantize_insert(
            kv, cache, slot_mapping, positions, cos_sin_cache, compress_ratio
        )
    return _kv_rope_quantize_insert(kv, cache, slot_mapping, positions, cos_sin_cache, compress_ratio)


def nvfp4_quantize_append_sparse_mla_cache(latent_kv, slot_mapping, cache):
    """Quantize already-roped BF16 rows and insert row ``i`` at ``slot_mapping[i]`` (the unfused writer).

    Parameters
    ----------
    latent_kv : torch.Tensor
        Contiguous CUDA BF16 ``[num_rows, 512]``.
    slot_mapping : torch.Tensor
        Contiguous 1-D int32 or int64, at most ``num_rows`` entries; negative and out-of-range
        slots are skipped.
    cache : torch.Tensor
        As in :func:`cake_dsv4_nvfp4_rope_quantize_insert`.

    Returns
    -------
    None
        The cache is updated in place.
    """
    if _is_compiling():
        return torch.ops.nvfp4_mla.quantize_append(latent_kv, slot_mapping, cache)
    return _append(latent_kv, slot_mapping, cache)


def nvfp4_quantize_pack_sparse_mla_cache(latent_kv, *, kv_layout="HND"):
    """Quantize whole pages into a new cache.

    Parameters
    ----------
    latent_kv : torch.Tensor
        Contiguous CUDA BF16 ``[num_pages, page_size, 512]`` (already roped).
    kv_layout : str
        "HND" gives ``[num_pages, 1, page_size, 384]``, "NHD" ``[num_pages, page_size, 1, 384]``.

    Returns
    -------
    torch.Tensor
        The new uint8 cache, every byte written; equal to appending every row at slot
        ``page * page_size + entry``.
    """
    if _is_compiling():
        return torch.ops.nvfp4_mla.quantize_pack(latent_kv, kv_layout)
    return _pack(latent_kv, kv_layout)
