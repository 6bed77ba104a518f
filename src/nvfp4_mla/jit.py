"""Run-time compilation of the kernel templates in ``kernels/`` with NVRTC (no GPU needed).

A *spec* (the writer's :class:`~nvfp4_mla.variant.Variant`, say) names a :class:`Template` and
its ``-D`` constants. :func:`compile_kernel` builds it for one architecture into a cubin that
carries its own full key (:func:`kernel_key`) as a string constant: the proof that
:mod:`nvfp4_mla.kernel_cache` checks before it runs a file. :mod:`nvfp4_mla.launch` loads and
launches it.
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
import struct
from pathlib import Path
from typing import Any, NamedTuple, Protocol

from . import abi

log = logging.getLogger("nvfp4_mla")

HEADER_FILE = "nvfp4_numerics.cuh"
ARCHS = ("sm_80", "sm_90", "sm_100", "sm_120")  # the architectures CI compiles for
MIN_ARCH = 80
_KEY_PREFIX = "nvfp4_mla-key:"  # followed by the 64 hex digits of the key, inside the cubin


class Template(NamedTuple):
    """A kernel source in ``kernels/`` and its host-side launch contract."""

    file: str
    function: str  # the extern "C" kernel name
    params: struct.Struct  # host layout of the kernel's ``struct Params`` (size checked at compile time)
    threads: int  # block size
    max_shared_bytes: int = 0  # dynamic shared memory a launch may ask for (above 48 KiB needs opting in)


class Spec(Protocol):
    """What the cache needs of a kernel specialization (hashable: it keys the loaded kernels)."""

    @property
    def template(self) -> Template: ...

    def defines(self) -> dict[str, int]: ...

    def __hash__(self) -> int: ...


class CompileResult(NamedTuple):
    cubin: bytes
    log: str  # ptxas resource report (-v)
    registers: int
    stack_bytes: int
    spill_bytes: int  # spill stores + spill loads


# ---------------------------------------------------------------- sources and NVRTC


def kernel_dir() -> Path:
    """``nvfp4_mla/kernels`` in an installed wheel, else ``kernels/`` of the source tree."""
    installed = Path(__file__).with_name("kernels")
    return installed if (installed / HEADER_FILE).exists() else Path(__file__).resolve().parents[2] / "kernels"


_sources: dict[str, str] = {}


def _source(name: str) -> str:
    if name not in _sources:
        _sources[name] = (kernel_dir() / name).read_text()
    return _sources[name]


CUPY_FIX = "install CuPy for your CUDA: pip install -e '.[cu12]' (or [cu13])"


def _nvrtc() -> Any:
    try:
        from cupy.cuda import nvrtc

        nvrtc.getVersion()
    except Exception as exc:  # CuPy missing, or libnvrtc not found
        raise RuntimeError(
            f"NVRTC is not available: {CUPY_FIX}, which brings CuPy and the nvidia-cuda-nvrtc wheel ({exc})"
        ) from exc
    return nvrtc


_nvrtc_identity: str | None = None


def nvrtc_identity() -> str:
    """NVRTC's version with its patch level: major.minor, plus the loaded library file's path,
    size and modification time (a patch upgrade replaces the file), where the OS shows it."""
    global _nvrtc_identity
    if _nvrtc_identity is None:
        major, minor = _nvrtc().getVersion()
        files = []
        try:
            with open("/proc/self/maps") as maps:
                paths = {line.split()[-1] for line in maps if "libnvrtc" in line and "/" in line}
            for path in sorted(paths):
                st = os.stat(path)
                files.append(f"{path}:{st.st_size}:{st.st_mtime_ns}")
        except OSError:  # no /proc (not Linux): the version alone
            pass
        _nvrtc_identity = " ".join([f"{major}.{minor}", *files])
    return _nvrtc_identity


# The record ABI, defined in Python once and handed to every kernel.
_ABI_DEFINES = {
    "HEAD_DIM": abi.HEAD_DIM,
    "NOPE_DIM": abi.NOPE_DIM,
    "ROPE_PAIRS": abi.ROPE_PAIRS,
    "DATA_BYTES": abi.DATA_BYTES,
    "NOPE_BYTES": abi.NOPE_BYTES,
    "SCALE_BYTES": abi.SCALE_BYTES,
    "NUM_GROUPS": abi.NUM_GROUPS,
}


def _options(spec: Spec, arch: str) -> list[str]:
    # --fmad=false: no contraction anywhere (the numerics use explicit intrinsics anyway); no fast
    # math: denormals are kept; -Xptxas -v: the resource report the spill check reads.
    template = spec.template
    defines = {**_ABI_DEFINES, "THREADS": template.threads, "PARAMS_BYTES": template.params.size, **spec.defines()}
    return [
        f"--gpu-architecture={arch}",
        "-std=c++17",
        "--fmad=false",
        "-lineinfo",
        "-Xptxas=-v",
        *(f"-D{name}={value}" for name, value in defines.items()),
    ]


def check_arch(arch: object) -> str:
    """``arch`` as NVRTC takes it ("sm_90", "sm_90a", ...), sm_80 or newer, else ValueError."""
    match = re.fullmatch(r"sm_(\d+)([af]?)", arch) if isinstance(arch, str) else None
    if match is None:
        raise ValueError(f"arch must look like 'sm_90' (sm_80 or newer), got {arch!r}")
    if int(match.group(1)) < MIN_ARCH:
        raise ValueError(f"arch {arch} is older than sm_80, the oldest GPU nvfp4_mla's kernels support")
    return match.group(0)


def kernel_key(spec: Spec, arch: str, header: str | None = None) -> str:
    """The full key of a compiled kernel: SHA-256 of its sources, options and NVRTC identity.

    ``header`` replaces the text of ``kernels/nvfp4_numerics.cuh`` (see :func:`compile_kernel`).
    """
    template = spec.template
    header = _source(HEADER_FILE) if header is None else header
    text = "\0".join((_source(template.file), header, " ".join(_options(spec, arch)), nvrtc_identity()))
    return hashlib.sha256(text.encode()).hexdigest()


def proof(key: str) -> bytes:
    """What a cubin of ``key`` carries."""
    return (_KEY_PREFIX + key).encode()


def _run_nvrtc(spec: Spec, gpu_architecture: str, key: str, header: str | None, ptx: bool) -> tuple[bytes, str]:
    """NVRTC's output (a cubin, or PTX when ``ptx``) and log for one spec."""
    nvrtc = _nvrtc()
    template = spec.template
    header = _source(HEADER_FILE) if header is None else header
    options = [*_options(spec, gpu_architecture), f'-DNVFP4_MLA_KEY="{_KEY_PREFIX}{key}"']
    program = nvrtc.createProgram(_source(template.file), template.file, [header.encode()], [HEADER_FILE.encode()])
    try:
        try:
            nvrtc.compileProgram(program, options)
        except nvrtc.NVRTCError as exc:
            log_text = nvrtc.getProgramLog(program)
            raise RuntimeError(f"NVRTC failed for {spec} on {gpu_architecture}:\n{log_text}") from exc
        output = nvrtc.getPTX(program) if ptx else nvrtc.getCUBIN(program)
        return (output.encode() if isinstance(output, str) else output), nvrtc.getProgramLog(program)
    finally:
        nvrtc.destroyProgram(program)


def compile_ptx(spec: Spec, arch: str) -> bytes:
    """PTX of one spec for ``arch``'s virtual architecture (sm_80 -> compute_80), NUL-terminated:
    the driver compiles it for the GPU it is loaded on. The tests run the code paths of older GPUs
    (the header's ``__CUDA_ARCH__`` branches) on a newer one this way; nothing caches it."""
    virtual = "compute_" + check_arch(arch)[3:]
    ptx, _ = _run_nvrtc(spec, virtual, kernel_key(spec, virtual), None, ptx=True)
    return ptx.rstrip(b"\0") + b"\0"


def compile_kernel(spec: Spec, arch: str, key: str | None = None, header: str | None = None) -> CompileResult:
    """Compiles one spec to a cubin for ``arch`` ("sm_80", "sm_90", ...). Needs no GPU.

    The cubin carries ``key`` (default: :func:`kernel_key`) as a string constant: the cache's
    proof that the file is this kernel. ``header``, when given, is compiled in place of
    ``kernels/nvfp4_numerics.cuh`` (the benchmark's kernels with a stubbed quantizer); pass the
    same ``header`` to :func:`kernel_key`.
    """
    check_arch(arch)
    key = kernel_key(spec, arch, header) if key is None else key
    cubin, report = _run_nvrtc(spec, arch, key, header, ptx=False)

    def number(pattern: str) -> int:
        return sum(int(x) for x in re.findall(pattern, report))

    return CompileResult(
        cubin,
        report,
        registers=max((int(x) for x in re.findall(r"Used (\d+) registers", report)), default=0),
        stack_bytes=number(r"(\d+) bytes stack frame"),
        spill_bytes=number(r"(\d+) bytes spill stores") + number(r"(\d+) bytes spill loads"),
    )
