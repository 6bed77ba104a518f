"""Every op's kernels in one place: what a precompile request (:class:`nvfp4_mla.Geometry`) builds
on an architecture, and the catalogue of builds that CI compiles for every architecture.

``precompile``, ``Geometry``, the CLI's presets, the compile tests and ``nvfp4-mla info`` all read
:data:`OPS`. The writers' and the reader's ops are made from their entries' descriptions
(:class:`~nvfp4_mla.ops.entry.Request`); the decode's is listed here.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import NamedTuple

import torch

from .. import jit
from ..jit import KernelSpec
from . import decode, reader, writers
from .entry import Entry


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


def _op(entry: Entry) -> Op:
    """An entry's op, from its description (a request's fields are passed by name)."""
    request = entry.request
    return Op(request.name, entry.summary, lambda g, arch: request.kernels(arch=arch, **g._asdict()), request.catalogue)


OPS: dict[str, Op] = {
    op.name: op
    for op in (
        *(_op(entry) for entry in (*writers.ENTRIES, *reader.ENTRIES)),
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
