"""Run-time compilation of the kernel templates in ``kernels/`` and the cache of compiled variants.

A :class:`Variant` is one specialization of ``nvfp4_mla_write.cu`` (its ``-D`` constants). It is
compiled with NVRTC (through CuPy's bindings; no GPU needed) for one architecture, kept on disk
as a cubin, and loaded with ``cupy.RawModule`` once per device. Calls after the first do one
dict lookup (see :func:`launcher`).

Disk cache: ``$NVFP4_MLA_CACHE_DIR``, else ``$XDG_CACHE_HOME/nvfp4_mla``, else
``~/.cache/nvfp4_mla``. A file is ``<key>-<sha256 of its bytes>.cubin``: a truncated or corrupted
file fails that check and is rebuilt. An unwritable directory falls back to a private temporary
one, with one warning.
"""

from __future__ import annotations

import ctypes
import glob
import hashlib
import os
import re
import struct
import tempfile
import threading
import warnings
from pathlib import Path
from typing import NamedTuple

from . import abi
from .variant import UNIT_THREADS, Variant

KERNEL_NAME = "nvfp4_mla_write"
KERNEL_FILE = "nvfp4_mla_write.cu"
HEADER_FILE = "nvfp4_numerics.cuh"
THREADS = 256  # kernel block size
UNITS_PER_BLOCK = THREADS // UNIT_THREADS
ARCHS = ("sm_80", "sm_90", "sm_100", "sm_120")  # the architectures CI compiles for

# Params in nvfp4_mla_write.cu: 7 pointers then 5 int64.
PARAMS = struct.Struct("<7Q5q")


class CompileResult(NamedTuple):
    cubin: bytes
    log: str  # ptxas resource report (-v)
    registers: int
    stack_bytes: int
    spill_bytes: int  # spill stores + spill loads


def kernel_dir() -> Path:
    """``nvfp4_mla/kernels`` in an installed wheel, else ``kernels/`` of the source tree."""
    installed = Path(__file__).with_name("kernels")
    return installed if (installed / KERNEL_FILE).exists() else Path(__file__).resolve().parents[2] / "kernels"


_SOURCES: tuple[str, str] | None = None


def _sources() -> tuple[str, str]:
    global _SOURCES
    if _SOURCES is None:
        d = kernel_dir()
        _SOURCES = ((d / KERNEL_FILE).read_text(), (d / HEADER_FILE).read_text())
    return _SOURCES


_CUPY_FIX = "install CuPy for your CUDA: pip install 'nvfp4-mla[cu12]' (or [cu13])"


def _cupy_driver():
    try:
        from cupy.cuda import driver
    except ImportError as exc:
        raise RuntimeError(f"nvfp4_mla's GPU entries need CuPy: {_CUPY_FIX} ({exc})") from exc
    return driver


def _nvrtc():
    try:
        from cupy.cuda import nvrtc

        nvrtc.getVersion()
    except Exception as exc:  # CuPy missing, or libnvrtc not found
        raise RuntimeError(
            "NVRTC is not available: install the CUDA extra, e.g. pip install 'nvfp4-mla[cu12]' "
            f"(CuPy and the nvidia-cuda-nvrtc wheel) ({exc})"
        ) from exc
    return nvrtc


# The block size and the record ABI, defined in Python once and handed to the kernel.
_ABI_OPTIONS = [
    f"-D{name}={value}"
    for name, value in (
        ("THREADS", THREADS), ("UNIT_THREADS", UNIT_THREADS), ("HEAD_DIM", abi.HEAD_DIM), ("NOPE_DIM", abi.NOPE_DIM), ("ROPE_PAIRS", abi.ROPE_PAIRS),
        ("DATA_BYTES", abi.DATA_BYTES), ("NOPE_BYTES", abi.NOPE_BYTES), ("SCALE_BYTES", abi.SCALE_BYTES),
        ("NUM_GROUPS", abi.NUM_GROUPS),
    )
]


def _compile_options(variant: Variant, arch: str) -> list[str]:
    # --fmad=false: no contraction anywhere (the numerics use explicit intrinsics anyway);
    # no fast math: denormals are kept; -Xptxas -v: the resource report the spill check reads.
    return [f"--gpu-architecture={arch}", "-std=c++17", "--fmad=false", "-lineinfo", "-Xptxas=-v", *_ABI_OPTIONS, *(f"-D{k}={v}" for k, v in variant.defines().items())]


def compile_variant(variant: Variant, arch: str) -> CompileResult:
    """Compiles one variant to a cubin for ``arch`` ("sm_80", "sm_90", ...). Needs no GPU."""
    nvrtc = _nvrtc()
    source, header = _sources()
    program = nvrtc.createProgram(source, KERNEL_FILE, [header.encode()], [HEADER_FILE.encode()])
    try:
        try:
            nvrtc.compileProgram(program, _compile_options(variant, arch))
        except nvrtc.NVRTCError as exc:
            raise RuntimeError(f"NVRTC failed for {variant} on {arch}:\n{nvrtc.getProgramLog(program)}") from exc
        log = nvrtc.getProgramLog(program)
        cubin = nvrtc.getCUBIN(program)
    finally:
        nvrtc.destroyProgram(program)

    def number(pattern: str) -> int:
        return sum(int(x) for x in re.findall(pattern, log))

    return CompileResult(
        cubin,
        log,
        registers=max((int(x) for x in re.findall(r"Used (\d+) registers", log)), default=0),
        stack_bytes=number(r"(\d+) bytes stack frame"),
        spill_bytes=number(r"(\d+) bytes spill stores") + number(r"(\d+) bytes spill loads"),
    )


# ---------------------------------------------------------------- disk cache


def cache_dir() -> Path:
    env = os.environ.get("NVFP4_MLA_CACHE_DIR")
    if env:
        return Path(env)
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "nvfp4_mla"


_fallback_dir: Path | None = None
_build_lock = threading.RLock()  # compiles, disk-cache writes and module loads


def _writable_cache_dir() -> Path:
    global _fallback_dir
    if _fallback_dir is not None:
        return _fallback_dir
    d = cache_dir()
    try:
        d.mkdir(parents=True, exist_ok=True)
        probe = tempfile.NamedTemporaryFile(dir=d, delete=True)
        probe.close()
        return d
    except OSError as exc:
        _fallback_dir = Path(tempfile.mkdtemp(prefix="nvfp4_mla-"))
        warnings.warn(
            f"nvfp4_mla: kernel cache directory {d} is not writable ({exc}); compiling into "
            f"{_fallback_dir} for this process. Set NVFP4_MLA_CACHE_DIR to a writable directory.",
            RuntimeWarning,
            stacklevel=3,
        )
        return _fallback_dir


def _key(variant: Variant, arch: str) -> str:
    nvrtc = _nvrtc()
    source, header = _sources()
    text = "\0".join((source, header, " ".join(_compile_options(variant, arch)), str(nvrtc.getVersion())))
    return f"{arch}-{hashlib.sha256(text.encode()).hexdigest()[:32]}"


def cubin_path(variant: Variant, arch: str) -> Path:
    """The verified cubin of ``variant`` for ``arch`` on disk, compiling it when missing or bad.

    Threads of one process compile a variant once (the build lock); processes sharing the
    directory may both compile, and each publishes a whole file atomically.
    """
    key = _key(variant, arch)
    with _build_lock:
        directory = _writable_cache_dir()
        for name in glob.glob(str(directory / f"{key}-*.cubin")):
            path = Path(name)
            if hashlib.sha256(path.read_bytes()).hexdigest()[:16] == path.stem.rsplit("-", 1)[1]:
                return path
            path.unlink(missing_ok=True)  # truncated or corrupted: rebuild
        cubin = compile_variant(variant, arch).cubin
        path = directory / f"{key}-{hashlib.sha256(cubin).hexdigest()[:16]}.cubin"
        fd, tmp = tempfile.mkstemp(dir=directory, suffix=".tmp")
        with os.fdopen(fd, "wb") as f:
            f.write(cubin)
        os.chmod(tmp, 0o644)  # mkstemp's 0600 would keep other users of a shared cache out
        os.replace(tmp, path)  # atomic: a concurrent reader sees a whole file or none
        return path


# ---------------------------------------------------------------- loading and launching

try:
    import torch as _torch

    current_raw_stream = _torch._C._cuda_getCurrentRawStream  # the stream handle, no Stream object
except AttributeError:  # CPU-only torch builds lack it (and never reach a launch)

    def current_raw_stream(device_index: int) -> int:
        import torch

        return torch.cuda.current_stream(device_index).cuda_stream



def gpu_unavailable_reason(device_index: int | None = None) -> str | None:
    """Why the GPU entries cannot run here (no CUDA device, one older than sm_80, or CuPy unable to
    reach it), or None when they can. The one such check: tests, the CLI and the benchmark use it."""
    import torch

    if not torch.cuda.is_available():
        return "no CUDA GPU visible to torch"
    index = torch.cuda.current_device() if device_index is None else device_index
    major, minor = torch.cuda.get_device_capability(index)
    if major < 8:
        return f"GPU {index} is sm_{major}{minor}; the kernels need sm_80 or newer"
    try:
        import cupy

        cupy.cuda.runtime.getDeviceCount()
    except Exception as exc:  # CuPy missing, or its CUDA runtime unusable
        return f"CuPy cannot reach the GPU: {exc}"
    return None


def device_arch(device_index: int) -> str:
    import torch

    major, minor = torch.cuda.get_device_capability(device_index)
    if major < 8:
        name = torch.cuda.get_device_name(device_index)
        raise RuntimeError(f"{name} is sm_{major}{minor}; nvfp4_mla's kernels need an sm_80 or newer GPU")
    return f"sm_{major}{minor}"


class Launcher:
    """A loaded kernel on one device: packs the parameters and launches, nothing else."""

    __slots__ = ("function", "context", "kernel", "_module")

    def __init__(self, path: Path, device_index: int):
        import cupy

        # Load under the device's primary context, made current explicitly: a thread that has
        # not touched CUDA yet has no current context, and cupy.cuda.Device would not set one.
        previous = _driver.ctxGetCurrent()
        cupy.cuda.runtime.setDevice(device_index)
        try:
            self._module = cupy.RawModule(path=str(path))
            self.kernel = self._module.get_function(KERNEL_NAME)  # cupy.RawKernel: attributes
            self.function = self.kernel.kernel.ptr  # the CUfunction of this device's module
            self.context = _driver.ctxGetCurrent()
        finally:
            _driver.ctxSetCurrent(previous)

    def launch(self, num_units: int, stream: int, *params: int) -> None:
        """Launches ``num_units`` work units; ``params`` are Params' fields but num_units."""
        storage = _storage
        PARAMS.pack_into(storage.buffer, 0, *params, num_units)
        blocks = (num_units + UNITS_PER_BLOCK - 1) // UNITS_PER_BLOCK
        current = _driver.ctxGetCurrent()
        if current == self.context:
            _driver.launchKernel(self.function, blocks, 1, 1, THREADS, 1, 1, 0, stream, storage.argv, 0)
            return
        # The tensors' GPU is not current here (another device, or a thread that has not used
        # CUDA yet): launch under its context, then give the thread its own back.
        _driver.ctxSetCurrent(self.context)
        try:
            _driver.launchKernel(self.function, blocks, 1, 1, THREADS, 1, 1, 0, stream, storage.argv, 0)
        finally:
            _driver.ctxSetCurrent(current)


class _LaunchStorage(threading.local):
    """Per-thread parameter buffer: cuLaunchKernel copies it at the call, so threads never share one."""

    def __init__(self):
        self.buffer = ctypes.create_string_buffer(PARAMS.size)
        self._pointers = (ctypes.c_void_p * 1)(ctypes.addressof(self.buffer))
        self.argv = ctypes.addressof(self._pointers)


_storage = _LaunchStorage()
_driver = None  # cupy.cuda.driver, imported with the first kernel so the reference needs no CuPy
_launchers: dict = {}


def launcher(key: tuple) -> Launcher:
    """The loaded kernel for ``key = (device_index, variant)``; built on first use.

    The hot path is this one dict lookup on a plain tuple. Safe under concurrent first calls:
    one thread builds, the others wait and share it.
    """
    found = _launchers.get(key)
    return found if found is not None else _build(key)


def _build(key: tuple) -> Launcher:
    global _driver
    with _build_lock:
        found = _launchers.get(key)
        if found is None:
            if _driver is None:
                _driver = _cupy_driver()
            device_index, variant = key
            found = Launcher(cubin_path(variant, device_arch(device_index)), device_index)
            _launchers[key] = found
    return found
