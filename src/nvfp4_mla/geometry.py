"""Kernels built ahead of time: :class:`Geometry` names what fixes a kernel, :func:`precompile`
builds (and optionally loads) them, e.g. while building a container image or at server start-up."""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Any, NamedTuple

import torch

from . import decode, jit, kernel_cache, launch, reader, validation
from .variant import Variant

ENTRIES = ("main", "kv", "append", "pack", "read", "decode")


class Geometry(NamedTuple):
    """What fixes compiled kernels, for :func:`precompile`. ``entry`` is a writer ("main", "kv",
    "append", "pack"), "read" (the GPU reader) or "decode" (every kernel of ``sparse_mla_decode``);
    the other fields are the entries' arguments of the same names (``slot_dtype`` is the dtype of
    ``slot_mapping``, or of the reader's ``slots``, None for ``slots=None``; ``dtype`` is the
    reader's output dtype)."""

    entry: str
    page_size: int = 0
    num_heads: int = 0
    q_head_padded: int = 0
    apply_q_rope: bool = True
    q_inplace: bool = False
    compress_ratio: int = 1
    slot_dtype: torch.dtype | None = torch.int64
    dtype: torch.dtype = torch.float32

    def specs(self) -> tuple:
        """The kernels this geometry needs; ValueError for what the entry itself would refuse."""
        if self.entry == "decode":
            return decode.ALL_SPECS
        if self.entry == "read":
            validation.check_page_size(self.page_size)
            if self.slot_dtype is not None:
                validation.check_slot_dtype(self.slot_dtype)
            validation.check_read_dtype(self.dtype)
            return (reader.ReaderVariant.of(self.page_size, self.slot_dtype, self.dtype),)
        return (self.variant(),)

    def variant(self) -> Variant:
        """The writer kernel of a writer entry (see :meth:`specs` for every entry)."""
        if self.entry not in ENTRIES[:4]:
            raise ValueError(f"entry must be one of {ENTRIES}, got {self.entry!r}")
        validation.check_page_size(self.page_size)
        if self.entry == "pack":
            return Variant.pack(self.page_size)
        validation.check_slot_dtype(self.slot_dtype)
        assert self.slot_dtype is not None
        if self.entry == "main":
            if type(self.num_heads) is not int or self.num_heads < 1:
                raise ValueError(f"num_heads must be a positive int for the main entry, got {self.num_heads!r}")
            validation.check_flag(self.apply_q_rope, "apply_q_rope")
            validation.check_flag(self.q_inplace, "q_inplace")
            validation.check_q_options(self.num_heads, self.q_head_padded, self.q_inplace)
            return Variant.main(
                self.page_size, self.slot_dtype, self.num_heads, self.q_head_padded, self.apply_q_rope, self.q_inplace
            )
        if self.entry == "kv":
            validation.check_compress_ratio(self.compress_ratio)
            return Variant.kv(self.page_size, self.slot_dtype, self.compress_ratio)
        return Variant.append(self.page_size, self.slot_dtype)


def precompile(
    geometries: Iterable[Geometry | dict[str, Any]],
    *,
    device: torch.device | str | int | None = None,
    arch: str | None = None,
    directory: str | Path | None = None,
) -> list:
    """Builds kernels ahead of time (serving start-up, container images), e.g.
    ``precompile([Geometry("main", 256, num_heads=8, q_head_padded=16), Geometry("decode")])``.

    With ``arch`` ("sm_90", ...) the cubins are only compiled (no GPU needed) and their paths
    returned, one per unique kernel; otherwise they are also loaded on ``device`` (default:
    current), so the first real call does no compile and no file I/O. With ``directory`` they are
    written into exactly that directory (``kernel_cache.CacheError`` when it cannot hold them);
    else into the kernel cache's writable layer (docs/format.md section 11).
    """
    specs = list(
        dict.fromkeys(s for g in geometries for s in (g if isinstance(g, Geometry) else Geometry(**g)).specs())
    )
    cache = kernel_cache.default()
    target = None if directory is None else Path(directory)
    if arch is not None:
        jit.check_arch(arch)
        return [cache.build(s, arch, target)[1] for s in specs]
    index = torch.device("cuda" if device is None else device).index
    index = torch.cuda.current_device() if index is None else index
    if target is not None:
        for s in specs:
            cache.build(s, launch.device_arch(index), target)
    return [cache.launcher(index, s) for s in specs]
