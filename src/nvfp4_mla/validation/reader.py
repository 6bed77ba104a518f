"""Argument checks of the reader, ``nvfp4_dequantize_sparse_mla_cache`` (docs/format.md section 8)."""

from __future__ import annotations

import torch

from .. import abi
from . import common

READ_DTYPES = (torch.float32, torch.bfloat16)  # what the reader returns


def check_read_dtype(dtype: object) -> None:
    """The reader's output dtype (also what precompile's Geometry("read") checks)."""
    if dtype not in READ_DTYPES:
        common.fail(f"dtype must be torch.float32 or torch.bfloat16 (both hold every value exactly), got {dtype!r}")


def check_dequantize(
    cache: torch.Tensor,
    slots: torch.Tensor | None,
    dtype: object,
    invalid: object,
    out: torch.Tensor | None,
    need_cuda: bool,
) -> common.CacheLayout:
    """``nvfp4_dequantize_sparse_mla_cache``. Its output is ``slots.shape + (512,)``, or
    ``[num_pages * page_size, 512]`` for ``slots=None``."""
    layout = common.check_cache(cache)  # checks that it is a tensor
    tensors, names = [cache], ["cache"]
    if slots is None:
        out_shape: tuple[int, ...] = (layout.num_pages * layout.page_size, abi.HEAD_DIM)
    else:
        if not common.dense(slots):  # on every decode step: the loop only when it fails
            common.check_tensors((slots,), ("slots",))
        if slots.dtype not in common.SLOT_DTYPES:
            common.fail(f"slots must have dtype torch.int32 or torch.int64, got {slots.dtype}")
        if not slots.is_contiguous():
            common.fail("slots must be contiguous (pass slots.contiguous())")
        tensors.append(slots)
        names.append("slots")
        out_shape = (*slots.shape, abi.HEAD_DIM)
    check_read_dtype(dtype)
    if type(invalid) not in (float, int):
        common.fail(f"invalid must be a Python float (the value of the rows of invalid slots), got {invalid!r}")
    if type(invalid) is int:
        try:
            float(invalid)  # what the entries do with it
        except OverflowError:  # (no repr of it in the message: an int of over 4300 digits has none)
            common.fail(
                f"invalid must be a Python float (the value of the rows of invalid slots), got an int of "
                f"{invalid.bit_length()} bits, beyond the float range; pass float('inf') or float('-inf')"
            )
    if out is not None:
        if not common.dense(out):
            common.check_tensors((out,), ("out",))
        if out.dtype != dtype:
            common.fail(f"out must have the dtype asked for ({dtype}), got {out.dtype}")
        if tuple(out.shape) != out_shape:
            common.fail(f"out must be slots.shape + (512,) = {list(out_shape)}, got {list(out.shape)}")
        if not out.is_contiguous():
            common.fail("out must be contiguous")
        common.check_mutable(out, "out")
        tensors.append(out)
        names.append("out")
    common.check_device(tuple(tensors), tuple(names), need_cuda)
    common.check_aligned((cache,) if out is None else (cache, out), ("cache", "out"))
    if out is not None:
        common.check_out_disjoint(out, tuple(tensors[1:-1]), tuple(names[1:-1]), ((cache, layout, "cache"),))
    return layout
