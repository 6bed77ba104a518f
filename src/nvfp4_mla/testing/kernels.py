"""Kernels built another way for the tests: an older GPU's code paths, run on this one."""

from __future__ import annotations

from pathlib import Path

from .. import jit, kernel_cache


class VirtualArchKernels(kernel_cache.KernelCache):
    """Every kernel as PTX for ``arch``'s virtual architecture (:func:`nvfp4_mla.jit.compile_ptx`),
    which the driver compiles for the GPU at hand when it loads it: the numerics header's
    ``__CUDA_ARCH__`` branches of that older GPU run here, where the native kernels take the other
    branch. In memory only, never in a kernel cache directory; the entries use it inside
    ``nvfp4_mla.ops.kernels_from``."""

    def __init__(self, arch: str = "sm_80"):
        super().__init__(layers=[])
        self.arch = jit.check_arch(arch)

    def build(self, spec: jit.Spec, arch: str, directory: Path | None = None) -> tuple[bytes, Path | None]:
        if directory is not None:
            raise kernel_cache.CacheError("virtual-architecture kernels are kept in memory, never in a directory")
        return jit.compile_ptx(spec, self.arch), None
