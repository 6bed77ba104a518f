"""Kernels built or launched another way, for the tests, the benchmark and the sanitizer run: kept
in memory only (:class:`MemoryKernels`), PTX of an older GPU (:class:`VirtualArchKernels`), or
planned with a forced grid (:func:`one_kv_block`). Each goes into a
:class:`nvfp4_mla.KernelLibrary` that the entries take as ``library=``."""

from __future__ import annotations

from collections.abc import Collection
from pathlib import Path

from .. import jit, kernel_cache
from ..ops.writer_spec import WriterSpec


class MemoryKernels(kernel_cache.KernelCache):
    """Kernels compiled by :meth:`compile` and kept in memory: nothing is read from or written to
    a kernel cache directory, so they never mix with the shipped kernels."""

    what = "these kernels"  # named in the refusal of a directory

    def __init__(self) -> None:
        super().__init__(layers=[])

    def compile(self, spec: jit.KernelSpec, arch: str) -> bytes:
        raise NotImplementedError

    def build(
        self, spec: jit.KernelSpec, arch: str, directory: Path | None = None, skip: Collection[Path] = ()
    ) -> tuple[bytes, Path | None]:
        if directory is not None:
            raise kernel_cache.CacheError(f"{self.what} are kept in memory, never in a kernel cache directory")
        return self.compile(spec, jit.target_arch(spec, jit.check_arch(arch))), None


class VirtualArchKernels(MemoryKernels):
    """Every kernel as PTX for ``arch``'s virtual architecture (:func:`nvfp4_mla.jit.compile_ptx`),
    which the driver compiles for the GPU at hand when it loads it: the numerics header's
    ``__CUDA_ARCH__`` branches of that older GPU run here, where the native kernels take the other
    branch."""

    what = "virtual-architecture kernels"

    def __init__(self, arch: str = "sm_80"):
        super().__init__()
        self.arch = jit.check_arch(arch)

    def compile(self, spec: jit.KernelSpec, arch: str) -> bytes:
        return jit.compile_ptx(spec, self.arch)


def one_kv_block(
    spec: WriterSpec, num_tokens: int, num_kv_rows: int, resident_blocks: int, sms: int
) -> tuple[int, int]:
    """A writer grid (``KernelLibrary(writer_grid=...)``) as on a GPU that holds one block at a
    time: a single block takes every KV row."""
    return spec.grid(num_tokens, num_kv_rows, 1, sms)
