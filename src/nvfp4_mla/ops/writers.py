"""The writer entries on the GPU (semantics: docs/format.md sections 2-7, ``nvfp4_mla.reference``):
each entry's build, kernel path and description, from which its torch custom ops are made (the
public functions that call them: :mod:`.writer_api`).

A call with a CUDA tensor among its tensors takes the entry's kernel path: the checks of
:mod:`nvfp4_mla.validation`, at most one output allocation, one lookup of its plan (keyed on the
arguments' signature) in its :class:`~nvfp4_mla.ops.library.KernelLibrary` (``library=``, default
the process's) and one launch with raw pointers on torch's current stream: no host
synchronisation, so calls can be captured in CUDA graphs. A call with none (CPU tensors) runs the
same entry of :mod:`nvfp4_mla.reference`, which writes the same bytes.

Each entry is described once (:class:`~nvfp4_mla.ops.entry.Entry`, in :data:`ENTRIES`), beside its
build (the :class:`~.writer_spec.WriterSpec` of its arguments) and its kernel path: its custom ops
and their fakes, that dispatch and its registry entry are made from the description. A new writer
entry touches four files: this module (its build, its kernel path, its description and its builds
in :func:`catalogue`), :mod:`.writer_api` (its public function and its name in ``__all__``, which
:mod:`nvfp4_mla.ops` and the package export), the kernel (``kernels/nvfp4_mla_write.cu``) and its
reference (``nvfp4_mla/reference/writers.py``); its checks are made of
:mod:`nvfp4_mla.validation`'s.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch
from torch.autograd.graph import increment_version

from .. import abi, config, launch, reference, validation
from .entry import Entry, Op, Request
from .library import KernelLibrary
from .writer_spec import QMode, WriterSpec

_NO_PTR = 0
_BF16 = torch.bfloat16


def catalogue(arch: str) -> list[WriterSpec]:
    """The writer builds CI compiles (every writer entry's): every (heads, padded heads, rope,
    in-place) combination at page 64, every entry on the page sizes of the GPU tests, both slot
    dtypes, both compress ratios."""
    specs = []
    for heads in (1, 5, 8, 16, 64, 128):
        for padded in (0, *abi.Q_HEAD_PADDINGS):
            if padded == 0 or padded >= heads:
                specs += [main_spec(64, torch.int64, heads, padded, rope, False) for rope in (True, False)]
        if heads in abi.Q_HEAD_PADDINGS:
            specs += [main_spec(64, torch.int64, heads, heads, rope, True) for rope in (True, False)]
    for page_size in (1, 3, 16, 32, 128, 256):
        for slot_dtype in (torch.int32, torch.int64):
            specs.append(main_spec(page_size, slot_dtype, 8, 16, True, False))
            specs.append(append_spec(page_size, slot_dtype))
            specs += [kv_spec(page_size, slot_dtype, ratio) for ratio in abi.COMPRESS_RATIOS]
        specs.append(pack_spec(page_size))
    return specs


# ---------------------------------------------------------------- the kernel path's plan


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


# ---------------------------------------------------------------- the entries
# Each: its build (arguments already validated; memoized, so a plan miss gets the same spec object
# back for the same arguments), the kernels of a precompile request (its fields checked like the
# entry's arguments), its kernel path and its description. Registered as custom ops so
# torch.compile traces the entries without a graph break. Eager calls skip the dispatcher: it
# would cost more host time than the whole launch path.


def _checked_slots(page_size: int, slot_dtype: torch.dtype | None) -> torch.dtype:
    """A writer request's page size and slot dtype, checked like the entries' arguments."""
    validation.check_page_size(page_size)
    validation.check_slot_dtype(slot_dtype)
    assert slot_dtype is not None
    return slot_dtype


_ROPED = "Tensor kv, Tensor cache, Tensor slot_mapping, Tensor positions, Tensor cos_sin_cache"


@functools.cache
def main_spec(
    page_size: int,
    slot_dtype: torch.dtype,
    num_heads: int,
    q_head_padded: int,
    apply_q_rope: bool,
    q_inplace: bool,
) -> WriterSpec:
    """The build of ``cake_dsv4_nvfp4_rope_quantize_insert``."""
    if q_inplace and apply_q_rope:
        return WriterSpec(
            page_size,
            slot_dtype is torch.int64,
            q_mode=QMode.IN_PLACE,
            num_heads=num_heads,
            q_head_padded=num_heads,
            apply_q_rope=True,
        )
    if q_inplace or not q_head_padded:  # cache only: the KV entry with ratio 1
        return kv_spec(page_size, slot_dtype, 1)
    return WriterSpec(
        page_size,
        slot_dtype is torch.int64,
        q_mode=QMode.PADDED,
        num_heads=num_heads,
        q_head_padded=q_head_padded,
        apply_q_rope=bool(apply_q_rope),
    )


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
    return (main_spec(page_size, slots, num_heads, q_head_padded, apply_q_rope, q_inplace),)


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
        spec = main_spec(layout.page_size, slot_mapping.dtype, num_heads, q_head_padded, apply_q_rope, q_inplace)
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
    kernel=rope_quantize_insert,
    request=Request("main", _main_kernels, catalogue, note="the fused writer"),
)


@functools.cache
def kv_spec(page_size: int, slot_dtype: torch.dtype, compress_ratio: int) -> WriterSpec:
    """The build of ``cake_dsv4_nvfp4_kv_rope_quantize_insert``."""
    return WriterSpec(page_size, slot_dtype is torch.int64, compress_ratio=compress_ratio)


def _kv_kernels(page_size: int, slot_dtype: torch.dtype | None, compress_ratio: int, **_: object) -> tuple[WriterSpec]:
    slots = _checked_slots(page_size, slot_dtype)
    validation.check_compress_ratio(compress_ratio)
    return (kv_spec(page_size, slots, compress_ratio),)


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
            kv_spec(layout.page_size, slot_mapping.dtype, compress_ratio),
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


KV = Entry(
    "cake_dsv4_nvfp4_kv_rope_quantize_insert",
    args=f"{_ROPED}, SymInt compress_ratio",
    ops=(Op("kv_rope_quantize_insert", mutates=("cache",)),),
    kernel=kv_rope_quantize_insert,
    request=Request("kv", _kv_kernels, catalogue),
)


@functools.cache
def append_spec(page_size: int, slot_dtype: torch.dtype) -> WriterSpec:
    """The build of ``nvfp4_quantize_append_sparse_mla_cache``."""
    return WriterSpec(page_size, slot_dtype is torch.int64, kv_rope=False)


def _append_kernels(page_size: int, slot_dtype: torch.dtype | None, **_: object) -> tuple[WriterSpec]:
    return (append_spec(page_size, _checked_slots(page_size, slot_dtype)),)


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
            append_spec(layout.page_size, slot_mapping.dtype),
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


APPEND = Entry(
    "nvfp4_quantize_append_sparse_mla_cache",
    args="Tensor latent_kv, Tensor slot_mapping, Tensor cache",
    ops=(Op("quantize_append", mutates=("cache",)),),
    kernel=append,
    request=Request("append", _append_kernels, catalogue),
)


@functools.cache
def pack_spec(page_size: int) -> WriterSpec:
    """The build of ``nvfp4_quantize_pack_sparse_mla_cache``: row i goes to slot i."""
    return WriterSpec(page_size, False, identity_slots=True, kv_rope=False)


def _pack_kernels(page_size: int, **_: object) -> tuple[WriterSpec]:
    validation.check_page_size(page_size)
    return (pack_spec(page_size),)


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
            pack_spec(page_size),
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
    kernel=pack,
    request=Request("pack", _pack_kernels, catalogue),
)
ENTRIES = (MAIN, KV, APPEND, PACK)  # in the registry's order
