"""Argument checks of ``sparse_mla_decode`` (docs/format.md section 9): its queries, up to two pools
with their slot tables and lengths, ``sm_scale``, ``sinks`` and an optional ``out``."""

from __future__ import annotations

import math
import numbers

import torch

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
    fail,
)

# Entries a slot table may hold per query row: the attention kernel counts its tiles of 32 in an int.
MAX_TABLE_WIDTH = 1 << 24
_PLAN_NAMES = ("swa_slots", "swa_lens", "extra_slots", "extra_lens")


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
    if out is not None:
        pools = ((swa_cache, swa, "swa_cache"),) + (() if extra is None else ((extra_cache, extra, "extra_cache"),))
        _check_out(out, q, tensors, names, pools)
    return swa, extra


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


def _check_out(out: torch.Tensor, q: torch.Tensor, inputs: list, names: list, caches: tuple) -> None:
    """The optional ``out``: BF16 with q's shape, contiguous, on q's device, 16-byte aligned,
    writable, sharing no memory with any input (q, a cache's pages, a slot table, lengths, sinks)."""
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
    uncached = [(t, n) for t, n in zip(inputs, names) if not n.endswith("_cache")]
    check_out_disjoint(out, tuple(t for t, _ in uncached), tuple(n for _, n in uncached), caches)
