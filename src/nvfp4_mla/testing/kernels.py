"""Kernels built or launched another way, for the tests, the benchmark and the sanitizer run:
kept in memory only, or planned with a forced grid."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from pathlib import Path

from .. import jit, kernel_cache, ops
from ..variant import Variant

_SHIPPED_GRID = Variant.grid


class MemoryKernels(kernel_cache.KernelCache):
    """Kernels compiled by :meth:`compile` and kept in memory: nothing is read from or written to
    a kernel cache directory, so they never mix with the shipped kernels. The entries use them
    inside ``nvfp4_mla.ops.kernels_from``."""

    what = "these kernels"  # named in the refusal of a directory

    def __init__(self) -> None:
        super().__init__(layers=[])

    def compile(self, spec: jit.Spec, arch: str) -> bytes:
        raise NotImplementedError

    def build(self, spec: jit.Spec, arch: str, directory: Path | None = None) -> tuple[bytes, Path | None]:
        if directory is not None:
            raise kernel_cache.CacheError(f"{self.what} are kept in memory, never in a kernel cache directory")
        return self.compile(spec, arch), None


class VirtualArchKernels(MemoryKernels):
    """Every kernel as PTX for ``arch``'s virtual architecture (:func:`nvfp4_mla.jit.compile_ptx`),
    which the driver compiles for the GPU at hand when it loads it: the numerics header's
    ``__CUDA_ARCH__`` branches of that older GPU run here, where the native kernels take the other
    branch."""

    what = "virtual-architecture kernels"

    def __init__(self, arch: str = "sm_80"):
        super().__init__()
        self.arch = jit.check_arch(arch)

    def compile(self, spec: jit.Spec, arch: str) -> bytes:
        return jit.compile_ptx(spec, self.arch)


@contextlib.contextmanager
def planned_with_grid(grid: Callable[[Variant, int, int, int, int], tuple[int, int]]) -> Iterator[None]:
    """Within the block, the writer entries plan their launches with ``grid`` in place of
    ``Variant.grid`` (same arguments), in tables of their own (``nvfp4_mla.ops.kernels_from`` on
    the process's kernel cache) that are dropped after it: to force launch layouts the shipped grid
    would not choose. Not thread-safe, like ``kernels_from``."""
    Variant.grid = grid  # type: ignore[method-assign, assignment]
    try:
        with ops.kernels_from(kernel_cache.default()):
            yield
    finally:
        Variant.grid = _SHIPPED_GRID  # type: ignore[method-assign]


def one_kv_block(
    variant: Variant, num_tokens: int, num_kv_rows: int, resident_blocks: int, sms: int
) -> tuple[int, int]:
    """``Variant.grid`` as on a GPU that holds one block at a time: a single block takes every KV
    row (for :func:`planned_with_grid`)."""
    return _SHIPPED_GRID(variant, num_tokens, num_kv_rows, 1, sms)
