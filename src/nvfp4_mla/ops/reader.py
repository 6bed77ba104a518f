"""The reader op: ``nvfp4_dequantize_sparse_mla_cache`` as one launch of ``kernels/nvfp4_mla_read.cu``.

Semantics are docs/format.md section 8 and :func:`nvfp4_mla.reference.nvfp4_dequantize_sparse_mla_cache`,
which defines the bits: CUDA tensors go to the kernel, other devices to that reference. A warm
call does the checks of :mod:`nvfp4_mla.validation`, at most one output allocation, one plan
lookup and one launch on torch's current stream, with no host synchronisation (graph-capturable);
none when there is no row to read.
"""

from __future__ import annotations

import functools
import struct
from typing import NamedTuple

import torch
from torch.autograd.graph import increment_version

from .. import abi, validation
from ..jit import Template, included_headers
from ..launch import Launcher, contiguous_strides, current_raw_stream, new_output
from ..params import ParamsLayout, int64, pointer
from .entry import Entry, Op, Request, make
from .library import KernelLibrary, check_traceable

TEAM_THREADS = 16  # threads that read one row together (the kernel's TEAM)
BLOCK_THREADS = 256
# Rows a team reads with all their loads in flight (docs/performance.md#reader-rows-per-team).
ROWS_PER_TEAM = 2

READ_PARAMS = ParamsLayout(
    "Params",
    [
        pointer("cache", "const u8*", "page 0"),
        pointer("slots", "const void*", "[num_rows] int32 or int64 (unused with IDENTITY_SLOTS)"),
        pointer("out", "uint4*", "[num_rows, OUT_CHUNKS]"),
        int64("page_stride", "bytes"),
        int64("capacity", "num_pages * PAGE_SIZE: valid slots are [0, capacity)"),
        int64("num_rows", "rows to read"),
        int64("fill", "low 32 bits: an invalid row's pattern (fp32 bits, or the BF16 bits twice)"),
    ],
)
READ_SOURCE = "nvfp4_mla_read.cu"
READ_TEMPLATE = Template(
    READ_SOURCE, "nvfp4_mla_read", READ_PARAMS, BLOCK_THREADS, headers=included_headers(READ_SOURCE)
)

_F32_NAN, _BF16_NAN = 0x7FC00000, abi.BF16_NAN_BITS
_F32_INF = 0x7F800000


class ReaderSpec(NamedTuple):
    """One build of the reader kernel."""

    page_size: int
    slot_int64: bool  # slots are int64 (else int32)
    identity_slots: bool  # slots=None: row i reads slot i
    out_fp32: bool  # the output is float32 (else bfloat16)
    rows_per_team: int = ROWS_PER_TEAM

    @property
    def template(self) -> Template:
        return READ_TEMPLATE

    @staticmethod
    @functools.cache
    def of(page_size: int, slot_dtype: torch.dtype | None, dtype: torch.dtype) -> ReaderSpec:
        """The spec of a call (arguments already validated); ``slot_dtype`` None for slots=None."""
        return ReaderSpec(page_size, slot_dtype is torch.int64, slot_dtype is None, dtype is torch.float32)

    @property
    def rows_per_block(self) -> int:
        return BLOCK_THREADS // TEAM_THREADS * self.rows_per_team

    def defines(self) -> dict[str, int]:
        """The kernel's ``-D`` constants."""
        return {
            "PAGE_SIZE": self.page_size,
            "SLOT_INT64": int(self.slot_int64),
            "IDENTITY_SLOTS": int(self.identity_slots),
            "OUT_FP32": int(self.out_fp32),
            "ROWS_PER_TEAM": self.rows_per_team,
        }

    def describe(self) -> str:
        """The kernel in words, e.g. ``reader, page 64, int32 slots -> bfloat16``."""
        slots = "every slot" if self.identity_slots else f"{'int64' if self.slot_int64 else 'int32'} slots"
        extra = f", {self.rows_per_team} rows a team" if self.rows_per_team != ROWS_PER_TEAM else ""
        return f"reader, page {self.page_size}, {slots} -> {'float32' if self.out_fp32 else 'bfloat16'}{extra}"


def fill_pattern(invalid: float, out_fp32: bool) -> int:
    """The 32-bit pattern of the rows of invalid slots: ``invalid`` rounded to fp32, then for BF16
    to BF16 (nearest even both times; the BF16 bits twice), NaN canonical (docs/format.md section 8).

    Plain Python (no tensor, no device work): it runs on every call.
    """
    x = float(invalid)
    if x != x:
        return _F32_NAN if out_fp32 else _BF16_NAN * 0x10001
    try:
        bits = struct.unpack("<I", struct.pack("<f", x))[0]  # C's double -> float: nearest even
    except OverflowError:  # finite, but rounds past the fp32 maximum
        bits = _F32_INF if x > 0 else _F32_INF | 1 << 31
    if out_fp32:
        return bits
    bf16 = (bits + 0x7FFF + (bits >> 16 & 1)) >> 16  # nearest even; no NaN reaches here
    return bf16 * 0x10001


def launch(
    launcher: Launcher,
    rows_per_block: int,
    device: int,
    cache: torch.Tensor,
    slots_ptr: int,
    out: torch.Tensor,
    layout: validation.CacheLayout,
    num_rows: int,
    fill: int,
) -> None:
    """One launch reading ``num_rows > 0`` rows into ``out`` (arguments already checked), on the
    current stream of CUDA device ``device``; the kernel's ``Params`` in order."""
    num_pages, page_size, page_stride = layout
    launcher.launch(
        -(-num_rows // rows_per_block),
        1,
        1,
        0,
        current_raw_stream(device),
        cache.data_ptr(),
        slots_ptr,
        out.data_ptr(),
        page_stride,
        num_pages * page_size,
        num_rows,
        fill,
    )


_NAN_FILLS = {torch.float32: _F32_NAN, torch.bfloat16: _BF16_NAN * 0x10001}


def dequantize(
    lib: KernelLibrary,
    cache: torch.Tensor,
    slots: torch.Tensor | None,
    dtype: torch.dtype,
    invalid: float,
    out: torch.Tensor | None,
) -> torch.Tensor:
    """The kernel path of :func:`nvfp4_dequantize_sparse_mla_cache` on ``lib``'s kernels: the
    entry's checks with CUDA tensors required (ValueError otherwise), then one launch."""
    # Lean on purpose: this is the whole host cost of a decode step's read (see the benchmark).
    layout = validation.check_dequantize(cache, slots, dtype, invalid, out, need_cuda=True)
    given = out is not None
    device = cache.get_device()
    if slots is None:
        num_rows = layout[0] * layout[1]
        slot_dtype, slots_ptr = None, 0
        shape: tuple = (num_rows, abi.HEAD_DIM)
    else:
        num_rows = slots.numel()
        slot_dtype, slots_ptr = slots.dtype, slots.data_ptr()
        shape = (*slots.shape, abi.HEAD_DIM)
    if out is None:  # every row is written (invalid slots get the fill)
        out = new_output(cache, shape, contiguous_strides(shape), dtype, device)
    if num_rows == 0:
        return out
    key = ("read", device, layout[1], slot_dtype, dtype)
    found = lib.plans.get(key)
    if found is None:
        spec = lib.spec(ReaderSpec.of(*key[2:]))
        found = lib.remember(key, (lib.launcher(device, spec), spec.rows_per_block))
    fill = _NAN_FILLS[dtype] if invalid != invalid else fill_pattern(invalid, dtype is torch.float32)
    launch(found[0], found[1], device, cache, slots_ptr, out, layout, num_rows, fill)
    if given:
        increment_version(out)  # written in place: autograd and views must see a new version
    return out


# ---------------------------------------------------------------- the entry's description
# Custom ops so torch.compile traces the reader without a graph break; eager calls skip the
# dispatcher. A CPU cache goes to the reference, whatever the other tensors are.


def _kernels(page_size: int, slot_dtype: torch.dtype | None, dtype: torch.dtype, **_: object) -> tuple[ReaderSpec]:
    """The kernel of a precompile request, its fields checked like the entry's arguments."""
    validation.check_page_size(page_size)
    if slot_dtype is not None:
        validation.check_slot_dtype(slot_dtype)
    validation.check_read_dtype(dtype)
    return (ReaderSpec.of(page_size, slot_dtype, dtype),)


def catalogue(arch: str) -> list[ReaderSpec]:
    """The builds CI compiles: page sizes 1-256, both slot dtypes and slots=None, both output dtypes."""
    return [
        ReaderSpec.of(page_size, slot_dtype, dtype)
        for page_size in (1, 3, 16, 64, 256)
        for slot_dtype in (torch.int32, torch.int64, None)
        for dtype in validation.READ_DTYPES
    ]


def _rows(cache: torch.Tensor, slots: torch.Tensor | None, dtype: torch.dtype, **_: object) -> torch.Tensor:
    if slots is None:
        layout = validation.check_cache(cache)
        return cache.new_empty((layout.num_pages * layout.page_size, abi.HEAD_DIM), dtype=dtype)
    return cache.new_empty((*slots.shape, abi.HEAD_DIM), dtype=dtype)


READ = Entry(
    "nvfp4_dequantize_sparse_mla_cache",
    args="Tensor cache, Tensor? slots, ScalarType dtype, float invalid",
    ops=(
        Op("dequantize", "Tensor", fixed=(None,), fake=_rows),
        Op("dequantize_out", extra="Tensor out", mutates=("out",)),
    ),
    kernel=dequantize,
    request=Request("read", _kernels, catalogue),
    routes_on=("cache",),
)
ENTRIES = (READ,)

_read, (_dequantize_op, _dequantize_out_op) = make(READ)

_is_compiling = torch.compiler.is_compiling


def nvfp4_dequantize_sparse_mla_cache(
    cache: torch.Tensor,
    slots: torch.Tensor | None = None,
    *,
    dtype: torch.dtype = torch.float32,
    invalid: float = float("nan"),
    out: torch.Tensor | None = None,
    library: KernelLibrary | None = None,
) -> torch.Tensor:
    """Reads records back as values: NoPE = E2M1 value x E4M3 scale, RoPE = the stored BF16.

    On CUDA tensors this is one launch of a compiled gather kernel; on other devices it is
    :func:`nvfp4_mla.reference.nvfp4_dequantize_sparse_mla_cache`. Both give the same bits for
    every record content (docs/format.md section 8).

    Parameters
    ----------
    cache
        A cache view of docs/format.md section 3 (3-D, HND or NHD, padded pools included).
    slots
        Contiguous int32 or int64 slots (``page * page_size + entry``) of any shape, e.g. a decode
        batch's top-k indices ``[batch, topk]``, on the cache's device. ``None`` reads every slot
        in order.
    dtype
        ``torch.float32`` or ``torch.bfloat16``; both hold every value exactly.
    invalid
        The value of every element of the row of an invalid slot (negative, or not below
        ``num_pages * page_size``). NaN (the default) is loud; attention over top-k lists padded
        with -1 wants ``0.0``, because 0 x NaN is NaN.
    out
        Optional preallocated output: contiguous, ``slots.shape + (512,)``, of ``dtype``, on the
        cache's device, sharing no memory with the cache or the slots. It is filled and returned.
    library
        The kernels and plan table to use on CUDA tensors (tests and benchmarks); default: the
        process's.

    Returns
    -------
    torch.Tensor
        ``slots.shape + (512,)`` (``[num_pages * page_size, 512]`` for ``slots=None``) of ``dtype``.
        Every NaN in it is the canonical quiet NaN of ``dtype``.

    Raises
    ------
    ValueError
        On any argument outside the contract (docs/format.md section 6), before anything is read
        or written.
    """
    if _is_compiling():  # traced with fake tensors: the op checks its arguments when it runs
        check_traceable(library)
        if out is None:
            return _dequantize_op(cache, slots, dtype, invalid)
        _dequantize_out_op(cache, slots, dtype, invalid, out)
        return out
    return _read(library, cache, slots, dtype, invalid, out)
