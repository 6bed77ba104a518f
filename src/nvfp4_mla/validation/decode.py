"""Argument checks of ``sparse_mla_decode`` (docs/format.md section 9): its queries, up to two pools
with their slot tables and lengths, ``sm_scale``, ``sinks`` and an optional ``out``."""

from __future__ import annotations

import math
import numbers

import torch

from .. import abi
from .common import (
    BF16,
    SLOT_DTYPES,
    CacheLayout,
    check_aligned,
    check_bf16_rows,
    check_cache,
    check_device,
    check_mutable,
    check_out_disjoint,
    check_tensors,
    dense,
    fail,
)

# Entries a slot table may hold per query row: the attention kernel counts its tiles of 32 in an int.
MAX_TABLE_WIDTH = 1 << 24
_PLAN_NAMES = ("swa_slots", "swa_lens", "extra_slots", "extra_lens")
_OUT_INPUTS = ("q", *_PLAN_NAMES, "sinks")  # the inputs out may not overlap, the caches aside (their pages)
_FP32, _UINT8 = torch.float32, torch.uint8
_LAYOUTS: dict[tuple, CacheLayout] = {}  # (shape, strides) -> layout: the caches of _known_layout
_MAX_LAYOUTS = 1024


def _check_pool(
    pool: str, cache: torch.Tensor, slots: torch.Tensor, lens: torch.Tensor | None, batch: int, q_len: int
) -> CacheLayout:
    """One pool of ``sparse_mla_decode``: its cache, its ``[batch, q_len, k]`` slot table and
    optional ``[batch, q_len]`` valid lengths (int32 or int64, like the slots)."""
    check_tensors((cache, slots), (f"{pool}_cache", f"{pool}_slots"))
    try:
        layout = check_cache(cache)
    except ValueError as exc:
        raise ValueError(f"{pool}_cache: {exc}") from None
    _check_table(pool, slots, lens, batch, q_len)
    return layout


def _check_table(pool: str, slots: torch.Tensor, lens: torch.Tensor | None, batch: int, q_len: int) -> None:
    """A pool's ``[batch, q_len, k]`` slot table (a tensor) and its optional ``[batch, q_len]``
    lengths."""
    if slots.dtype not in SLOT_DTYPES:
        fail(f"{pool}_slots must have dtype torch.int32 or torch.int64, got {slots.dtype}")
    shape = slots.shape
    if len(shape) != 3 or shape[0] != batch or shape[1] != q_len:
        fail(f"{pool}_slots must be [batch, q_len, k] = [{batch}, {q_len}, k] like q, got {list(shape)}")
    if shape[2] < 1:
        fail(f"{pool}_slots must hold at least one slot per query row (k >= 1); mask entries with -1 or {pool}_lens")
    if shape[2] > MAX_TABLE_WIDTH:
        fail(f"{pool}_slots may hold at most {MAX_TABLE_WIDTH} slots per query row, got k = {shape[2]}")
    if not slots.is_contiguous():
        fail(f"{pool}_slots must be contiguous (pass {pool}_slots.contiguous())")
    if lens is not None:
        check_tensors((lens,), (f"{pool}_lens",))
        if lens.dtype not in SLOT_DTYPES:
            fail(f"{pool}_lens must have dtype torch.int32 or torch.int64, got {lens.dtype}")
        if tuple(lens.shape) != (batch, q_len):
            fail(f"{pool}_lens must be [batch, q_len] = [{batch}, {q_len}], got {list(lens.shape)}")
        if not lens.is_contiguous():
            fail(f"{pool}_lens must be contiguous")


def check_decode_plan(
    num_heads: object,
    swa_slots: torch.Tensor,
    swa_lens: torch.Tensor | None,
    extra_slots: torch.Tensor | None,
    extra_lens: torch.Tensor | None,
) -> None:
    """``plan_sparse_mla_decode``: the head count, the slot tables and lengths of a step's calls,
    as ``sparse_mla_decode`` checks them, all on one device."""
    if isinstance(num_heads, bool) or not isinstance(num_heads, int) or num_heads < 1:
        fail(f"num_heads must be a positive int, got {num_heads!r}")
    check_tensors((swa_slots,), ("swa_slots",))
    if swa_slots.dim() != 3:
        fail(f"swa_slots must be [batch, q_len, k], got {list(swa_slots.shape)}")
    batch, q_len = swa_slots.shape[0], swa_slots.shape[1]
    _check_table("swa", swa_slots, swa_lens, batch, q_len)
    if extra_slots is None:
        if extra_lens is not None:
            fail("extra_lens needs extra_slots (and, in the calls, extra_cache)")
    else:
        check_tensors((extra_slots,), ("extra_slots",))
        _check_table("extra", extra_slots, extra_lens, batch, q_len)
    given = [(t, n) for t, n in zip((swa_slots, swa_lens, extra_slots, extra_lens), _PLAN_NAMES) if t is not None]
    check_device(tuple(t for t, _ in given), tuple(n for _, n in given), False)


def check_decode(
    q: torch.Tensor,
    swa_cache: torch.Tensor,
    swa_slots: torch.Tensor,
    swa_lens: torch.Tensor | None,
    extra_cache: torch.Tensor | None,
    extra_slots: torch.Tensor | None,
    extra_lens: torch.Tensor | None,
    sm_scale: object,
    sinks: torch.Tensor | None,
    need_cuda: bool,
    out: torch.Tensor | None = None,
) -> tuple[CacheLayout, CacheLayout | None]:
    """``sparse_mla_decode`` (with its optional ``out``): returns the layout of the sliding-window
    pool and of the extra pool (None without one)."""
    pools = (swa_cache, swa_slots, swa_lens, extra_cache, extra_slots, extra_lens)
    layouts = usual_decode_call(q, *pools, sm_scale, sinks)
    if layouts is None:  # another call, a bad one included: the checks one by one say what is off
        layouts = check_decode_inputs(q, *pools, sm_scale, sinks, need_cuda)
    if out is not None:
        swa, extra = layouts
        caches = ((swa_cache, swa, "swa_cache"),) + (() if extra is None else ((extra_cache, extra, "extra_cache"),))
        _check_out(out, q, (q, swa_slots, swa_lens, extra_slots, extra_lens, sinks), caches)
    return layouts


def check_decode_inputs(
    q: torch.Tensor,
    swa_cache: torch.Tensor,
    swa_slots: torch.Tensor,
    swa_lens: torch.Tensor | None,
    extra_cache: torch.Tensor | None,
    extra_slots: torch.Tensor | None,
    extra_lens: torch.Tensor | None,
    sm_scale: object,
    sinks: torch.Tensor | None,
    need_cuda: bool,
) -> tuple[CacheLayout, CacheLayout | None]:
    """:func:`check_decode` but ``out``, one check at a time."""
    check_tensors((q,), ("q",))
    check_bf16_rows(q, "q", "batch, q_len, num_heads, 512", 4)
    batch, q_len, num_heads = q.shape[0], q.shape[1], q.shape[2]
    if num_heads < 1:
        fail("q must hold at least one head")
    swa = _check_pool("swa", swa_cache, swa_slots, swa_lens, batch, q_len)
    tensors, names = [q, swa_cache, swa_slots], ["q", "swa_cache", "swa_slots"]
    if swa_lens is not None:
        tensors.append(swa_lens)
        names.append("swa_lens")
    extra = None
    if extra_cache is None and extra_slots is None:
        if extra_lens is not None:
            fail("extra_lens needs extra_cache and extra_slots")
    elif extra_cache is None or extra_slots is None:
        fail("extra_cache and extra_slots come together: pass both, or neither")
    else:
        extra = _check_pool("extra", extra_cache, extra_slots, extra_lens, batch, q_len)
        tensors += [extra_cache, extra_slots]
        names += ["extra_cache", "extra_slots"]
        if extra_lens is not None:
            tensors.append(extra_lens)
            names.append("extra_lens")
    if not _finite_real(sm_scale):
        fail(f"sm_scale must be a finite real number (a Python or numpy float), got {sm_scale!r}")
    if sinks is not None:
        check_tensors((sinks,), ("sinks",))
        if sinks.dtype is not torch.float32:
            fail(f"sinks must have dtype torch.float32, got {sinks.dtype}")
        if tuple(sinks.shape) != (num_heads,) or not sinks.is_contiguous():
            fail(f"sinks must be a contiguous [num_heads] = [{num_heads}] tensor, got {list(sinks.shape)}")
        tensors.append(sinks)
        names.append("sinks")
    check_device(tuple(tensors), tuple(names), need_cuda)
    caches = (q, swa_cache) if extra_cache is None else (q, swa_cache, extra_cache)
    check_aligned(caches, ("q", "swa_cache", "extra_cache"))
    return swa, extra


def usual_decode_call(
    q: torch.Tensor,
    swa_cache: torch.Tensor,
    swa_slots: torch.Tensor,
    swa_lens: torch.Tensor | None,
    extra_cache: torch.Tensor | None,
    extra_slots: torch.Tensor | None,
    extra_lens: torch.Tensor | None,
    sm_scale: object,
    sinks: torch.Tensor | None,
) -> tuple[CacheLayout, CacheLayout | None] | None:
    """:func:`check_decode_inputs`'s acceptance of the usual call (CUDA tensors, a float ``sm_scale``)
    in one pass over the arguments, each attribute read once: a decode step makes this call once
    per layer, and the checks one by one cost several times more. Returns what they return, or
    None for any other call, a bad one included: they then run and name what is off. It accepts
    no call they refuse (tests/test_decode_cpu.py)."""
    if type(sm_scale) is not float or not math.isfinite(sm_scale):
        return None
    if not (dense(q) and q.dtype is BF16 and q.is_contiguous()):
        return None
    shape = q.shape
    if len(shape) != 4 or shape[3] != abi.HEAD_DIM or shape[2] < 1:
        return None
    batch, q_len, num_heads, _ = shape
    device = q.get_device()  # -1 off CUDA (the reference): the checks one by one
    if device < 0:
        return None
    swa = _usual_pool(swa_cache, swa_slots, swa_lens, batch, q_len, device)
    if swa is None:
        return None
    extra = None
    if extra_cache is not None or extra_slots is not None or extra_lens is not None:
        if extra_cache is None or extra_slots is None:
            return None
        extra = _usual_pool(extra_cache, extra_slots, extra_lens, batch, q_len, device)
        if extra is None:
            return None
    if sinks is not None and not (
        dense(sinks)
        and sinks.dtype is _FP32
        and sinks.shape == (num_heads,)
        and sinks.is_contiguous()
        and sinks.get_device() == device
    ):
        return None
    # The pointers last, as the checks one by one read them (a tensor without storage has none).
    addresses = q.data_ptr() | swa_cache.data_ptr() | (0 if extra_cache is None else extra_cache.data_ptr())
    if addresses % abi.PAGE_ALIGN:
        return None
    return swa, extra


def _usual_pool(
    cache: torch.Tensor, slots: torch.Tensor, lens: torch.Tensor | None, batch: int, q_len: int, device: int
) -> CacheLayout | None:
    """A pool of :func:`usual_decode_call`: its cache's layout, or None."""
    if not (dense(cache) and cache.dtype is _UINT8 and cache.get_device() == device):
        return None
    if not (dense(slots) and slots.dtype in SLOT_DTYPES and slots.is_contiguous() and slots.get_device() == device):
        return None
    shape = slots.shape
    if len(shape) != 3 or shape[0] != batch or shape[1] != q_len or not 1 <= shape[2] <= MAX_TABLE_WIDTH:
        return None
    if lens is not None and not (
        dense(lens)
        and lens.dtype in SLOT_DTYPES
        and lens.shape == (batch, q_len)
        and lens.is_contiguous()
        and lens.get_device() == device
    ):
        return None
    return _known_layout(cache)


def _known_layout(cache: torch.Tensor) -> CacheLayout | None:
    """:func:`check_cache`'s layout of ``cache`` (a dense uint8 tensor), kept by shape and strides:
    a model's caches come back with theirs every call; None where check_cache refuses it."""
    key = (cache.shape, cache.stride())
    try:
        layout = _LAYOUTS.get(key)
    except TypeError:  # symbolic sizes (a trace) do not hash: the checks one by one
        return None
    if layout is None:
        try:
            layout = check_cache(cache)
        except ValueError:
            return None
        if len(_LAYOUTS) >= _MAX_LAYOUTS:  # (views of ever new shapes: start again)
            _LAYOUTS.clear()
        _LAYOUTS[key] = layout
    return layout


def _finite_real(x: object) -> bool:
    """A real number (not a bool) with a finite float value; an int too large for a float is not."""
    if type(x) is float:  # the usual case, every decode call: the ABC check below costs far more
        return math.isfinite(x)
    if not isinstance(x, numbers.Real) or isinstance(x, bool):
        return False
    try:
        return math.isfinite(float(x))
    except OverflowError:
        return False


def _check_out(out: torch.Tensor, q: torch.Tensor, inputs: tuple, caches: tuple) -> None:
    """The optional ``out``: BF16 with q's shape, contiguous, on q's device, 16-byte aligned,
    writable, sharing no memory with any input (q, a cache's pages, a slot table, lengths, sinks).
    ``inputs``: q and the call's tables, lengths and sinks (None where not given), named by
    _OUT_INPUTS; ``caches``: ``(cache, layout, name)`` triples."""
    check_tensors((out,), ("out",))
    if out.dtype is not BF16:
        fail(f"out must have dtype torch.bfloat16, got {out.dtype}")
    if out.shape != q.shape:
        fail(f"out must have q's shape {list(q.shape)}, got {list(out.shape)}")
    if not out.is_contiguous():
        fail("out must be contiguous")
    check_mutable(out, "out")
    check_device((q, out), ("q", "out"), need_cuda=False)  # q's device was checked with the rest
    check_aligned((out,), ("out",))
    check_out_disjoint(out, inputs, _OUT_INPUTS, caches)
