"""The checks every entry shares: argument types, devices, alignment, memory overlap, the cache layout.

Used by each op's checks (``validation.writers``, ``validation.reader``, ``validation.decode``);
``ValueError`` messages name the fix. :func:`signature` and
:func:`check_pointers` split a writer's checks for the kernel path's host time: those fixed by the
arguments' metadata run once per signature, those that depend on where the tensors are and on
their autograd state on every call.
"""

from __future__ import annotations

from typing import NamedTuple, NoReturn

import torch

from .. import abi

BF16 = torch.bfloat16
SLOT_DTYPES = (torch.int32, torch.int64)
_CUDA_FIX = " (move it with .cuda(), or use nvfp4_mla.reference for CPU tensors)"
_PLAIN_OPTIONS = (bool, int, str)  # option types a signature holds (hashable; keyed with the type, so True is not 1)
_Tensor = torch.Tensor
_STRIDED = torch.strided


class CacheLayout(NamedTuple):
    """Where a cache view's records lie (docs/format.md section 3)."""

    num_pages: int
    page_size: int
    page_stride: int  # bytes between pages; >= page_size * 384, a multiple of 16


class PointerChecks(NamedTuple):
    """What an entry's per-call checks (:func:`check_pointers`) need to know of its tensors, fixed by
    their signature."""

    names: tuple[str, ...]
    spans: tuple[int, ...]  # bytes each tensor covers from its data pointer (a cache: its pages)
    aligned: tuple[int, ...]  # indices of the tensors the kernels move with 16-byte accesses
    written: tuple[int, ...]  # indices of the tensors the call writes


def fail(message: str) -> NoReturn:
    raise ValueError(message)


def dense(t: object) -> bool:
    """Whether ``t`` is a dense torch tensor: the one kind the checks below can read. A sparse
    tensor has no strides and a nested one no shape: reading them raises from deep inside torch."""
    return isinstance(t, _Tensor) and t.layout is _STRIDED and not t.is_nested


def check_tensors(tensors: tuple, names: tuple) -> None:
    """Every argument is a dense torch tensor (a numpy array, a list, a sparse or a nested tensor
    gets a message naming it)."""
    for t, name in zip(tensors, names):
        if not isinstance(t, torch.Tensor):
            kind = type(t)
            fail(f"{name} must be a torch.Tensor, got {kind.__module__}.{kind.__qualname__}")
        if t.is_nested:  # (before the layout: a jagged nested tensor has layout torch.jagged)
            fail(f"{name} must be a dense tensor, got a nested tensor; pass a padded dense tensor")
        if t.layout is not _STRIDED:
            fail(f"{name} must be a dense tensor (layout torch.strided), got layout {t.layout}; pass {name}.to_dense()")


def check_bf16_rows(t: torch.Tensor, name: str, dims: str, ndim: int) -> None:
    """A contiguous BF16 tensor of ``ndim`` dims, the last 512 (``dims`` names them for the message)."""
    if t.dtype is not BF16:
        fail(f"{name} must have dtype torch.bfloat16, got {t.dtype}")
    shape = t.shape
    if len(shape) != ndim or shape[-1] != abi.HEAD_DIM:
        fail(f"{name} must be [{dims}], got {list(shape)}")
    if not t.is_contiguous():
        fail(f"{name} must be contiguous")


def check_flag(value: object, name: str) -> None:
    """A real bool: a string like 'False' would be truthy."""
    if type(value) is not bool:
        fail(f"{name} must be a bool, got {value!r}")


def extent(t: torch.Tensor) -> tuple[int, int]:
    """First and one-past-last byte of a contiguous tensor."""
    start = t.data_ptr()
    return start, start + t.nbytes


def _fail_overlap(name: str, written_name: str) -> None:
    fail(f"{name} overlaps {written_name} in memory: the call writes {written_name}; pass separate tensors")


def check_disjoint(written: tuple[int, int], written_name: str, tensors: tuple, names: tuple) -> None:
    """No input shares a byte with a tensor the call writes (on the GPU that would be a race);
    None stands for an input not given."""
    lo, hi = written
    if lo == hi:
        return
    for t, name in zip(tensors, names):  # (inlined extent: this runs on every call)
        if t is None:
            continue
        t_lo = t.data_ptr()
        if t_lo < hi and lo < t_lo + t.nbytes:
            _fail_overlap(name, written_name)


def signature(tensors: tuple, options: tuple) -> tuple | None:
    """Everything a writer's argument checks read except data pointers and autograd state: the
    options with their types, and each tensor's shape, dtype, strides and device.

    Calls with equal signatures pass or fail those checks alike (their outcome is a function of
    these values), so the kernel path runs them once per signature and :func:`check_pointers` on
    every call. None when an argument is not a dense tensor or an option not a plain bool, int or
    str: the full checks then say which.
    """
    key: list = []
    for option in options:
        kind = type(option)
        if kind not in _PLAIN_OPTIONS:
            return None
        key += (kind, option)
    for t in tensors:
        if not isinstance(t, _Tensor):
            return None
        try:
            key += (t.shape, t.dtype, t.stride(), t.device)
        except RuntimeError:  # a sparse or nested tensor has no strides (the full checks name it)
            return None
    return tuple(key)


def check_pointers(tensors: tuple, checks: PointerChecks) -> list[int]:
    """The checks that depend on where the tensors are and on their state, run on every call:
    16-byte alignment, a written tensor is mutable (:func:`check_mutable`) and shares no byte with
    another argument. Returns the tensors' data pointers."""
    pointers = [t.data_ptr() for t in tensors]
    combined = 0
    for i in checks.aligned:
        combined |= pointers[i]
    if combined % abi.PAGE_ALIGN:
        check_aligned(tuple(tensors[i] for i in checks.aligned), tuple(checks.names[i] for i in checks.aligned))
    spans = checks.spans
    for w in checks.written:
        t = tensors[w]
        if t.requires_grad or t.is_inference():  # (the usual case, a plain tensor, in two reads)
            check_mutable(t, checks.names[w])
        lo = pointers[w]
        hi = lo + spans[w]
        if lo != hi:
            for i, start in enumerate(pointers):
                if i != w and start < hi and lo < start + spans[i]:
                    _fail_overlap(checks.names[i], checks.names[w])
    return pointers


def check_out_disjoint(out: torch.Tensor, inputs: tuple, names: tuple, caches: tuple) -> None:
    """The ``out`` a call writes shares no byte with an input tensor (``inputs``, named ``names``;
    None for one not given) or with a cache's pages (``caches``: ``(cache, layout, name)``
    triples): on the GPU that would be a race, on the CPU a corrupted input."""
    written = extent(out)
    check_disjoint(written, "out", inputs, names)
    for cache, layout, name in caches:
        lo, hi = cache_extent(cache, layout)
        if written[0] < written[1] and lo < written[1] and written[0] < hi:
            _fail_overlap(name, "out")


def cache_extent(cache: torch.Tensor, layout: CacheLayout) -> tuple[int, int]:
    """First and one-past-last byte of a checked cache view."""
    num_pages, page_size, page_stride = layout
    start = cache.data_ptr()
    return start, start + (num_pages and (num_pages - 1) * page_stride + page_size * abi.RECORD_BYTES)


def check_mutable(t: torch.Tensor, name: str) -> None:
    """A tensor the call writes in place must not be tracked by autograd or be an inference tensor
    outside inference mode: the kernel's write would be invisible to either."""
    if t.requires_grad:
        fail(
            f"{name} is written in place but requires grad: autograd cannot see the kernel's write; "
            f"pass {name}.detach()"
        )
    if t.is_inference() and not torch.is_inference_mode_enabled():
        fail(
            f"{name} is an inference tensor written in place outside inference mode; call inside torch.inference_mode()"
        )


def check_device(tensors: tuple, names: tuple, need_cuda: bool) -> None:
    # get_device() is an int (-1 off CUDA): cheaper than building torch.device objects; the
    # devices are only looked at closely when something is off, or off CUDA (the reference).
    indices = [t.get_device() for t in tensors]
    if indices[0] >= 0 and indices.count(indices[0]) == len(indices):
        return
    for t, name in zip(tensors, names):
        if need_cuda and not t.is_cuda:
            fail(f"{name} must be a CUDA tensor, got one on {t.device}{_CUDA_FIX}")
        if t.device != tensors[0].device:
            fail(
                f"all tensors must be on the same CUDA device (or all on the CPU for the "
                f"reference): {names[0]} is on {tensors[0].device}, {name} on {t.device}"
            )


def check_aligned(tensors: tuple, names: tuple) -> None:
    # The kernels move these with 16-byte vector accesses.
    combined = 0
    for t in tensors:
        combined |= t.data_ptr()
    if combined % abi.PAGE_ALIGN:
        for t, name in zip(tensors, names):
            if t.data_ptr() % abi.PAGE_ALIGN:
                fail(f"{name} must be 16-byte aligned (data_ptr {t.data_ptr():#x}); pass a fresh tensor")


def check_cache(cache: torch.Tensor) -> CacheLayout:
    """Checks a cache view of docs/format.md section 3 and returns its layout."""
    if not dense(cache):
        check_tensors((cache,), ("cache",))
    if cache.dtype is not torch.uint8:
        fail(f"cache must have dtype torch.uint8, got {cache.dtype}")
    shape, strides = cache.shape, cache.stride()
    ndim = len(shape)
    if ndim == 3:
        page_axis = 1
    elif ndim == 4 and shape[1] == 1:
        page_axis = 2  # HND
    elif ndim == 4 and shape[2] == 1:
        page_axis = 1  # NHD
    elif ndim == 4:
        fail(
            f"cache must have a singleton latent-head dimension: HND [num_pages, 1, page_size, 384] "
            f"or NHD [num_pages, page_size, 1, 384], got {list(shape)}"
        )
    if ndim not in (3, 4) or shape[-1] != abi.RECORD_BYTES or shape[page_axis] < 1:
        fail(
            "cache must be [num_pages, page_size, 384], HND [num_pages, 1, page_size, 384] or "
            f"NHD [num_pages, page_size, 1, 384] with page_size >= 1, got {list(shape)}"
        )
    num_pages, page_size = shape[0], shape[page_axis]
    if strides[-1] != 1 or (page_size > 1 and strides[page_axis] != abi.RECORD_BYTES):
        fail(
            "cache must keep each page's page_size * 384 bytes contiguous (stride(-1) == 1 and "
            f"page-size axis stride 384), got strides {list(strides)}"
        )
    page_stride = strides[0] if num_pages > 1 else page_size * abi.RECORD_BYTES
    if page_stride % abi.PAGE_ALIGN:
        fail(f"cache page stride must be a multiple of 16 bytes, got {page_stride}")
    if page_stride < page_size * abi.RECORD_BYTES:
        fail(f"cache pages overlap: page stride {page_stride} < page_size * 384 = {page_size * 384}")
    return CacheLayout(num_pages, page_size, page_stride)
