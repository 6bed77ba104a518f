"""Every op's kernels in one place: what a precompile request (:class:`nvfp4_mla.Geometry`) builds
on an architecture, and the catalogue of builds that CI compiles for every architecture.

``precompile``, ``Geometry``, the CLI's presets, the compile tests and ``nvfp4-mla info`` all read
:data:`OPS`; an op (or a backend of one) adds its kernels here and nowhere else.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import NamedTuple

import torch

from .. import abi, jit, validation
from ..jit import KernelSpec
from . import decode
from .reader import ReaderSpec
from .writer_spec import WriterSpec


class Geometry(NamedTuple):
    """What fixes compiled kernels, for :func:`nvfp4_mla.precompile`: a precompile request.

    ``entry`` is a writer ("main", "kv", "append", "pack"), "read" (the GPU reader) or "decode"
    (every kernel of ``sparse_mla_decode`` for the GPU); the other fields are the entries'
    arguments of the same names (``slot_dtype`` is the dtype of ``slot_mapping``, or of the
    reader's ``slots``, None for ``slots=None``; ``dtype`` is the reader's output dtype).
    """

    entry: str
    page_size: int = 0
    num_heads: int = 0
    q_head_padded: int = 0
    apply_q_rope: bool = True
    q_inplace: bool = False
    compress_ratio: int = 1
    slot_dtype: torch.dtype | None = torch.int64
    dtype: torch.dtype = torch.float32

    def describe(self) -> str:
        """The request in words, e.g. ``main, page 256, 8 -> 16 heads`` or ``decode``."""
        slots = "every slot" if self.slot_dtype is None else f"{str(self.slot_dtype)[6:]} slots"
        if self.entry == "main":
            if self.q_inplace:
                what = f"{self.num_heads} heads in place"
            elif self.q_head_padded:
                what = f"{self.num_heads} -> {self.q_head_padded} heads"
            else:
                what = f"{self.num_heads} heads, cache only (the KV kernel, ratio 1)"
            return f"main, page {self.page_size}, {what}, {slots}"
        if self.entry == "kv":
            return f"kv, page {self.page_size}, compress ratio {self.compress_ratio}, {slots}"
        if self.entry == "read":
            return f"read, page {self.page_size}, {slots} -> {str(self.dtype)[6:]}"
        if self.entry == "decode":
            return "decode, every kernel of sparse_mla_decode for the GPU"
        return f"{self.entry}, page {self.page_size}" + ("" if self.entry == "pack" else f", {slots}")

    def specs(self, arch: str) -> tuple[KernelSpec, ...]:
        """The kernels this request needs on a GPU of ``arch``; ValueError for what the entry itself
        would refuse."""
        return specs(self, arch)


class Op(NamedTuple):
    """One op as precompile and CI see it."""

    name: str  # Geometry.entry
    summary: str  # what it is, for help texts and ``nvfp4-mla info``
    # The kernels of a request on a GPU of this arch; ValueError for what the entry would refuse.
    specs: Callable[[Geometry, str], tuple[KernelSpec, ...]]
    catalogue: Callable[[str], Iterable[KernelSpec]]  # the builds CI compiles for this arch


def _writer_spec(g: Geometry) -> WriterSpec:
    """The writer kernel of a writer request (its fields validated like the entry's arguments)."""
    validation.check_page_size(g.page_size)
    if g.entry == "pack":
        return WriterSpec.pack(g.page_size)
    validation.check_slot_dtype(g.slot_dtype)
    assert g.slot_dtype is not None
    if g.entry == "main":
        if type(g.num_heads) is not int or g.num_heads < 1:
            raise ValueError(f"num_heads must be a positive int for the main entry, got {g.num_heads!r}")
        validation.check_flag(g.apply_q_rope, "apply_q_rope")
        validation.check_flag(g.q_inplace, "q_inplace")
        validation.check_q_options(g.num_heads, g.q_head_padded, g.q_inplace)
        return WriterSpec.main(g.page_size, g.slot_dtype, g.num_heads, g.q_head_padded, g.apply_q_rope, g.q_inplace)
    if g.entry == "kv":
        validation.check_compress_ratio(g.compress_ratio)
        return WriterSpec.kv(g.page_size, g.slot_dtype, g.compress_ratio)
    return WriterSpec.append(g.page_size, g.slot_dtype)


def _reader_spec(g: Geometry) -> ReaderSpec:
    validation.check_page_size(g.page_size)
    if g.slot_dtype is not None:
        validation.check_slot_dtype(g.slot_dtype)
    validation.check_read_dtype(g.dtype)
    return ReaderSpec.of(g.page_size, g.slot_dtype, g.dtype)


def _writer_catalogue(arch: str) -> list[WriterSpec]:
    """Every (heads, padded heads, rope, in-place) combination at page 64, every entry on the
    page sizes of the GPU tests, both slot dtypes, both compress ratios."""
    specs = []
    for heads in (1, 5, 8, 16, 64, 128):
        for padded in (0, *abi.Q_HEAD_PADDINGS):
            if padded == 0 or padded >= heads:
                specs += [WriterSpec.main(64, torch.int64, heads, padded, rope, False) for rope in (True, False)]
        if heads in abi.Q_HEAD_PADDINGS:
            specs += [WriterSpec.main(64, torch.int64, heads, heads, rope, True) for rope in (True, False)]
    for page_size in (1, 3, 16, 32, 128, 256):
        for slot_dtype in (torch.int32, torch.int64):
            specs.append(WriterSpec.main(page_size, slot_dtype, 8, 16, True, False))
            specs.append(WriterSpec.append(page_size, slot_dtype))
            specs += [WriterSpec.kv(page_size, slot_dtype, ratio) for ratio in abi.COMPRESS_RATIOS]
        specs.append(WriterSpec.pack(page_size))
    return specs


def _reader_catalogue(arch: str) -> list[ReaderSpec]:
    """Page sizes 1-256, both slot dtypes and slots=None, both output dtypes."""
    return [
        ReaderSpec.of(page_size, slot_dtype, dtype)
        for page_size in (1, 3, 16, 64, 256)
        for slot_dtype in (torch.int32, torch.int64, None)
        for dtype in validation.READ_DTYPES
    ]


def _writer_op(name: str, summary: str) -> Op:
    return Op(name, summary, lambda g, arch: (_writer_spec(g),), _writer_catalogue)


OPS: dict[str, Op] = {
    op.name: op
    for op in (
        _writer_op("main", "cake_dsv4_nvfp4_rope_quantize_insert (the fused writer)"),
        _writer_op("kv", "cake_dsv4_nvfp4_kv_rope_quantize_insert"),
        _writer_op("append", "nvfp4_quantize_append_sparse_mla_cache"),
        _writer_op("pack", "nvfp4_quantize_pack_sparse_mla_cache"),
        Op("read", "nvfp4_dequantize_sparse_mla_cache", lambda g, arch: (_reader_spec(g),), _reader_catalogue),
        Op("decode", "sparse_mla_decode (every backend for the GPU)", lambda g, arch: decode.specs(arch), decode.specs),
    )
}


def specs(geometry: Geometry, arch: str) -> tuple[KernelSpec, ...]:
    """The kernels of a precompile request on a GPU of ``arch``."""
    op = OPS.get(geometry.entry)
    if op is None:
        raise ValueError(f"entry must be one of {tuple(OPS)}, got {geometry.entry!r}")
    return op.specs(geometry, arch)


def catalogue(arch: str) -> list[KernelSpec]:
    """Every build CI compiles for ``arch``, each once (ops share builds: the writers' catalogue
    is theirs together)."""
    return jit.unique(spec for op in OPS.values() for spec in op.catalogue(arch))
