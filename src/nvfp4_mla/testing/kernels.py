"""Kernels built another way, for the tests and the benchmark, kept in memory only."""

from __future__ import annotations

from pathlib import Path

from .. import jit, kernel_cache


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
