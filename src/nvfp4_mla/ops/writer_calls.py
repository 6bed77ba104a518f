"""The writer entries' kernel path on a :class:`~nvfp4_mla.ops.library.KernelLibrary`: a call's
checks (:mod:`nvfp4_mla.validation`), at most one output allocation, one lookup of its plan
(keyed on the arguments' signature) and one launch with raw pointers on torch's current stream:
no host synchronisation, so calls can be captured in CUDA graphs. :mod:`.writers` holds the
public entries and their custom ops.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch
from torch.autograd.graph import increment_version

from .. import abi, config, launch, reference, validation
from .library import KernelLibrary
from .writer_spec import WriterSpec

_NO_PTR = 0
_BF16 = torch.bfloat16


class WriterPlan(NamedTuple):
    """What a signature fixes of a call: its per-call checks, launch, grid and scalar parameters."""

    checks: validation.PointerChecks
    # The loaded kernel's launch with this grid bound: called with the stream, the pointers and
    # ``scalars`` (no Python frame of its own). None when there is nothing to launch.
    launch: functools.partial[None] | None
    device_index: int
    scalars: tuple[int, ...]  # page_stride, capacity (slots), max_position, num_kv_rows, kv_blocks, q_rows
    out_shape: tuple[int, ...]  # of the tensor the entry allocates (q_out, the packed cache); () if none
    out_strides: tuple[int, ...]  # its contiguous strides


def make_plan(
    lib: KernelLibrary,
    signature: tuple | None,
    device_index: int,
    spec: WriterSpec,
    checks: validation.PointerChecks,
    layout: validation.CacheLayout,
    max_position: int,
    num_tokens: int,
    num_kv_rows: int,
    out_shape: tuple[int, ...] = (),
) -> WriterPlan:
    """Builds (after the full checks passed) and remembers the plan of ``signature``."""
    spec = lib.spec(spec)
    bound = None  # a call with nothing to launch loads and launches no kernel (a 0-block grid is an error)
    kv_blocks = 0
    if spec.kv_units(num_kv_rows) or spec.q_units(num_tokens):
        launcher = lib.launcher(device_index, spec)
        kv_blocks, blocks = lib.grid(spec, num_tokens, num_kv_rows, launcher)
        bound = functools.partial(launcher.launch, blocks, 1, 1, 0)
    num_pages, page_size, page_stride = layout
    scalars = (page_stride, num_pages * page_size, max_position, num_kv_rows, kv_blocks, spec.q_rows(num_tokens))
    plan = WriterPlan(checks, bound, device_index, scalars, out_shape, launch.contiguous_strides(out_shape))
    return plan if signature is None else lib.remember(signature, plan)


# ---------------------------------------------------------------- the entries on a library


def rope_quantize_insert(
    lib: KernelLibrary,
    q: torch.Tensor,
    kv: torch.Tensor,
    cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    positions: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    q_head_padded: int,
    apply_q_rope: bool,
    q_inplace: bool,
) -> torch.Tensor:
    tensors = (q, kv, cache, slot_mapping, positions, cos_sin_cache)
    signature = validation.signature(tensors, ("main", q_head_padded, apply_q_rope, q_inplace))
    plan = lib.plans.get(signature)
    if plan is None or config.DEBUG_CHECKS:
        layout = validation.check_main(
            q, kv, cache, slot_mapping, positions, cos_sin_cache, q_head_padded, apply_q_rope, q_inplace, need_cuda=True
        )
        num_tokens, num_heads = q.shape[0], q.shape[1]
        spec = WriterSpec.main(layout.page_size, slot_mapping.dtype, num_heads, q_head_padded, apply_q_rope, q_inplace)
        plan = make_plan(
            lib,
            signature,
            cache.get_device(),
            spec,
            validation.main_pointer_checks(tensors, layout, q_inplace),
            layout,
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


def kv_rope_quantize_insert(
    lib: KernelLibrary,
    kv: torch.Tensor,
    cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    positions: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    compress_ratio: int,
) -> None:
    tensors = (kv, cache, slot_mapping, positions, cos_sin_cache)
    signature = validation.signature(tensors, ("kv", compress_ratio))
    plan = lib.plans.get(signature)
    if plan is None or config.DEBUG_CHECKS:
        layout = validation.check_kv(kv, cache, slot_mapping, positions, cos_sin_cache, compress_ratio, need_cuda=True)
        plan = make_plan(
            lib,
            signature,
            cache.get_device(),
            WriterSpec.kv(layout.page_size, slot_mapping.dtype, compress_ratio),
            validation.kv_pointer_checks(tensors, layout),
            layout,
            cos_sin_cache.shape[0],
            0,
            slot_mapping.shape[0],
        )
    kv_ptr, cache_ptr, slots_ptr, positions_ptr, cos_sin_ptr = validation.check_pointers(tensors, plan.checks)
    if plan.launch is not None:
        stream = launch.current_raw_stream(plan.device_index)
        plan.launch(stream, _NO_PTR, _NO_PTR, kv_ptr, cache_ptr, slots_ptr, positions_ptr, cos_sin_ptr, *plan.scalars)
        increment_version(cache)


def append(lib: KernelLibrary, latent_kv: torch.Tensor, slot_mapping: torch.Tensor, cache: torch.Tensor) -> None:
    tensors = (latent_kv, slot_mapping, cache)
    signature = validation.signature(tensors, ("append",))
    plan = lib.plans.get(signature)
    if plan is None or config.DEBUG_CHECKS:
        layout = validation.check_append(latent_kv, slot_mapping, cache, need_cuda=True)
        plan = make_plan(
            lib,
            signature,
            cache.get_device(),
            WriterSpec.append(layout.page_size, slot_mapping.dtype),
            validation.append_pointer_checks(tensors, layout),
            layout,
            0,
            0,
            slot_mapping.shape[0],
        )
    kv_ptr, slots_ptr, cache_ptr = validation.check_pointers(tensors, plan.checks)
    if plan.launch is not None:
        stream = launch.current_raw_stream(plan.device_index)
        plan.launch(stream, _NO_PTR, _NO_PTR, kv_ptr, cache_ptr, slots_ptr, _NO_PTR, _NO_PTR, *plan.scalars)
        increment_version(cache)


def pack(lib: KernelLibrary, latent_kv: torch.Tensor, kv_layout: str) -> torch.Tensor:
    tensors = (latent_kv,)
    signature = validation.signature(tensors, ("pack", kv_layout))
    plan = lib.plans.get(signature)
    if plan is None or config.DEBUG_CHECKS:
        validation.check_pack(latent_kv, kv_layout, need_cuda=True)
        num_pages, page_size = latent_kv.shape[0], latent_kv.shape[1]
        plan = make_plan(
            lib,
            signature,
            latent_kv.get_device(),
            WriterSpec.pack(page_size),
            validation.PACK_POINTER_CHECKS,
            validation.CacheLayout(num_pages, page_size, page_size * abi.RECORD_BYTES),
            0,
            0,
            num_pages * page_size,
            tuple(reference.new_cache(num_pages, page_size, kv_layout, "meta").shape),
        )
    (kv_ptr,) = validation.check_pointers(tensors, plan.checks)
    cache = launch.new_output(latent_kv, plan.out_shape, plan.out_strides, torch.uint8, plan.device_index)
    if plan.launch is not None:
        stream = launch.current_raw_stream(plan.device_index)
        plan.launch(stream, _NO_PTR, _NO_PTR, kv_ptr, cache.data_ptr(), _NO_PTR, _NO_PTR, _NO_PTR, *plan.scalars)
    return cache
