"""Run-time compilation of the kernel templates in ``kernels/`` with NVRTC (no GPU needed).

A *spec* (:class:`KernelSpec`: the writer's ``WriterSpec``, say) names a :class:`Template` and its
``-D`` constants. :func:`compile_kernel` builds it for one architecture into a whole cubin that carries its own full
key (:func:`kernel_key`) as a string constant, the proof that :mod:`nvfp4_mla.kernel_file` checks
before the cache runs a file. :mod:`nvfp4_mla.launch` loads and
launches it.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import re
import sys
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any, NamedTuple, Protocol

from . import abi, config, kernel_file
from .device import MIN_CAPABILITY
from .params import HEADER as PARAMS_HEADER
from .params import ParamsLayout

NUMERICS_HEADER = "nvfp4_numerics.cuh"
ARCHS = ("sm_80", "sm_90", "sm_100", "sm_120")  # the architectures CI compiles for


class Template(NamedTuple):
    """A kernel source in ``kernels/`` and its host-side launch contract."""

    file: str
    function: str  # the extern "C" kernel name
    params: ParamsLayout  # the kernel's ``struct Params``: the host's packer and the generated header
    threads: int  # block size
    max_shared_bytes: int = 0  # dynamic shared memory a launch may ask for (above 48 KiB needs opting in)
    headers: tuple[str, ...] = (NUMERICS_HEADER,)  # the files of kernels/ it includes, all in its key
    # (beside them, the generated PARAMS_HEADER)
    arch: str | None = None  # the architecture it is built for (e.g. "sm_90a"); None: the GPU's own
    # It waits for the stream's previous kernel (the decode header's wait_for_prior_grids) before it
    # writes global memory or uses what that kernel may write, so from sm_90 it is launched with
    # programmatic dependent launch: its start overlaps that kernel's end.
    dependent_launch: bool = False


class KernelSpec(Protocol):
    """What the cache needs of a kernel specialization. Hashable: with its type, it keys the loaded
    kernels, so two spec types with equal fields never share a kernel."""

    @property
    def template(self) -> Template: ...

    def defines(self) -> dict[str, int]: ...

    def describe(self) -> str: ...

    def __hash__(self) -> int: ...


def target_arch(spec: KernelSpec, arch: str) -> str:
    """The architecture ``spec`` compiles for on a GPU (or a precompile request) of ``arch``."""
    return spec.template.arch or arch


def unique(specs: Iterable[KernelSpec]) -> list[KernelSpec]:
    """``specs`` in order, each once, told apart by type as well as fields (NamedTuple specs of two
    kernel families compare equal when their fields do)."""
    return [spec for _, spec in dict.fromkeys((type(spec), spec) for spec in specs)]


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
    return installed if (installed / NUMERICS_HEADER).exists() else Path(__file__).resolve().parents[2] / "kernels"


_sources: dict[str, str] = {}


def source(name: str) -> str:
    """The text of ``kernels/<name>`` (read once)."""
    if name not in _sources:
        _sources[name] = (kernel_dir() / name).read_text()
    return _sources[name]


_INCLUDE = re.compile(r'^[ \t]*#[ \t]*include[ \t]*"([^"]+)"', re.MULTILINE)


@functools.cache
def included_headers(name: str) -> tuple[str, ...]:
    """Every header of ``kernels/`` that ``kernels/<name>`` includes, directly or through another,
    each once (the generated :data:`PARAMS_HEADER` apart): a template's ``headers``."""
    found: dict[str, None] = {}

    def visit(file: str) -> None:
        for header in _INCLUDE.findall(source(file)):
            if header != PARAMS_HEADER and header not in found:
                found[header] = None
                visit(header)

    visit(name)
    return tuple(found)


def nvrtc_module() -> Any:
    """CuPy's NVRTC binding, loaded (RuntimeError with the fix where CuPy or NVRTC is missing)."""
    try:
        from cupy.cuda import nvrtc

        nvrtc.getVersion()
    except Exception as exc:  # CuPy missing, or libnvrtc not found
        raise RuntimeError(f"NVRTC is not available: {config.cupy_fix(exc)} ({exc})") from exc
    return nvrtc


_LIBNVRTC = re.compile(r"/libnvrtc(\.alt)?\.so[.\d]*$")  # not libnvrtc-builtins


@functools.cache
def nvrtc_library() -> tuple[ctypes.CDLL, str]:
    """The libnvrtc CuPy's binding uses, and its path: the mapped one of CuPy's NVRTC version,
    opened with RTLD_NOLOAD so that it is the very library already loaded, never a second copy."""
    version = tuple(nvrtc_module().getVersion())  # makes CuPy load its libnvrtc if it has not yet
    try:
        with open("/proc/self/maps") as maps:
            paths = sorted({line.split(maxsplit=5)[-1].strip() for line in maps if _LIBNVRTC.search(line.strip())})
    except OSError:  # not Linux
        paths = []
    found: dict[str, ctypes.CDLL] = {}
    for path in paths:
        try:
            lib = ctypes.CDLL(path, mode=os.RTLD_NOLOAD)
        except OSError:  # unmapped since
            continue
        major, minor = ctypes.c_int(), ctypes.c_int()
        if lib.nvrtcVersion(ctypes.byref(major), ctypes.byref(minor)) == 0 and (major.value, minor.value) == version:
            found[os.path.realpath(path)] = lib
    pathfinder = sys.modules.get("cuda.pathfinder")  # CuPy 14 loads libnvrtc through its cached call
    if len(found) > 1 and pathfinder is not None:
        try:
            chosen = os.path.realpath(pathfinder.load_nvidia_dynamic_lib("nvrtc").abs_path or "")
        except Exception:  # not how this CuPy found it: the ambiguity stands
            chosen = ""
        found = {p: lib for p, lib in found.items() if p == chosen}
    if len(found) != 1:
        raise RuntimeError(
            f"cannot tell which libnvrtc CuPy's NVRTC {version[0]}.{version[1]} uses "
            f"(loaded libnvrtc files: {', '.join(paths) or 'none found in /proc/self/maps'})"
        )
    path, lib = next(iter(found.items()))
    lib.nvrtcGetErrorString.restype = ctypes.c_char_p
    return lib, path


@functools.cache
def nvrtc_build() -> kernel_file.Compiler:
    """The NVRTC this process compiles with, as a kernel file records it: its version (major.minor)
    and the SHA-256 of the libnvrtc file CuPy loaded, hashed once per process (about 0.2 s for
    100 MB, beside seconds of compiling). Loads NVRTC: only compiles call it, never a lookup or a
    load (:func:`loaded_nvrtc`)."""
    major, minor = nvrtc_module().getVersion()
    digest = hashlib.sha256()
    with open(nvrtc_library()[1], "rb") as library:
        while chunk := library.read(1 << 20):
            digest.update(chunk)
    return kernel_file.Compiler(major, minor, digest.digest())


def loaded_nvrtc() -> kernel_file.Compiler | None:
    """:func:`nvrtc_build` when this process has already worked it out (it compiled), else None:
    never imports or loads NVRTC, so a cache hit needs none."""
    return nvrtc_build() if nvrtc_build.cache_info().currsize else None


def nvrtc_identity() -> str:
    """NVRTC in words: its version, the start of its library's digest and the library's path, e.g.
    ``12.9 sha256:3f2a9c...e1 (/venv/.../libnvrtc.so.12)``. Loads NVRTC. Not in the key
    (docs/format.md section 11): a kernel file records :func:`nvrtc_build`."""
    return f"{nvrtc_build().describe()} ({nvrtc_library()[1]})"


def whole_cubin(program: int) -> bytes:
    """NVRTC's complete cubin of a compiled program: ``nvrtcGetCUBINSize`` bytes, copied on CuPy's
    program handle through CuPy's own libnvrtc (CuPy's ``getCUBIN`` drops the last byte)."""
    lib = nvrtc_library()[0]
    handle, size = ctypes.c_void_p(program), ctypes.c_size_t()
    if rc := lib.nvrtcGetCUBINSize(handle, ctypes.byref(size)):
        raise RuntimeError(f"nvrtcGetCUBINSize failed: {lib.nvrtcGetErrorString(rc).decode()}")
    if size.value == 0:
        raise RuntimeError("NVRTC holds no cubin for this program (compiled for a virtual architecture?)")
    buffer = ctypes.create_string_buffer(size.value)
    if rc := lib.nvrtcGetCUBIN(handle, buffer):
        raise RuntimeError(f"nvrtcGetCUBIN failed: {lib.nvrtcGetErrorString(rc).decode()}")
    return buffer.raw


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


def _options(spec: KernelSpec, arch: str) -> list[str]:
    # --fmad=false: no contraction anywhere (the numerics use explicit intrinsics anyway); no fast
    # math: denormals are kept; -Xptxas -v: the resource report the spill check reads.
    template = spec.template
    defines = {**_ABI_DEFINES, "THREADS": template.threads, **spec.defines()}
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
    if int(match.group(1)) < MIN_CAPABILITY:
        raise ValueError(f"arch {arch} is older than sm_80, the oldest GPU nvfp4_mla's kernels support")
    return match.group(0)


def _texts(spec: KernelSpec, sources: Mapping[str, str] | None) -> list[tuple[str, str]]:
    """(name, text) of the template's file, every header it lists and the generated header of its
    Params; ``sources`` replaces texts by name."""
    template, given = spec.template, sources or {}
    texts = [(name, given.get(name) or source(name)) for name in (template.file, *template.headers)]
    return [*texts, (PARAMS_HEADER, given.get(PARAMS_HEADER) or template.params.header())]


def kernel_key(spec: KernelSpec, arch: str, sources: Mapping[str, str] | None = None) -> str:
    """The full key of a compiled kernel: SHA-256 of its kernel function's name, every source file
    it is built from, its options (the architecture among them). Needs no NVRTC: nothing of the
    compiler is in it, neither its version nor its library's path, size or time (a kernel file
    records the NVRTC that built it; docs/format.md section 11 says why), so a precompiled
    directory hits wherever it is copied and whatever NVRTC is installed, or none.

    ``sources`` replaces the text of files by name (see :func:`compile_kernel`).
    """
    parts = [spec.template.function, *(f"{name}\0{text}" for name, text in _texts(spec, sources))]
    text = "\0".join((*parts, " ".join(_options(spec, arch))))
    return hashlib.sha256(text.encode()).hexdigest()


def _run_nvrtc(
    spec: KernelSpec, gpu_architecture: str, key: str, sources: Mapping[str, str] | None, ptx: bool
) -> tuple[bytes, str]:
    """NVRTC's output (a cubin, or PTX when ``ptx``) and log for one spec."""
    nvrtc = nvrtc_module()
    (name, text), *headers = _texts(spec, sources)
    options = [*_options(spec, gpu_architecture), f'-DNVFP4_MLA_KEY="{kernel_file.KEY_PREFIX}{key}"']
    program = nvrtc.createProgram(text, name, [h.encode() for _, h in headers], [n.encode() for n, _ in headers])
    try:
        try:
            nvrtc.compileProgram(program, options)
        except nvrtc.NVRTCError as exc:
            log_text = nvrtc.getProgramLog(program)
            raise RuntimeError(f"NVRTC failed for {spec.describe()} on {gpu_architecture}:\n{log_text}") from exc
        if not ptx:
            return whole_cubin(program), nvrtc.getProgramLog(program)
        text = nvrtc.getPTX(program)
        return (text.encode() if isinstance(text, str) else text), nvrtc.getProgramLog(program)
    finally:
        nvrtc.destroyProgram(program)


def compile_ptx(spec: KernelSpec, arch: str) -> bytes:
    """PTX of one spec for ``arch``'s virtual architecture (sm_80 -> compute_80), NUL-terminated:
    the driver compiles it for the GPU it is loaded on. The tests run the code paths of older GPUs
    (the header's ``__CUDA_ARCH__`` branches) on a newer one this way; nothing caches it."""
    virtual = "compute_" + check_arch(arch)[3:]
    ptx, _ = _run_nvrtc(spec, virtual, kernel_key(spec, virtual), None, ptx=True)
    return ptx.rstrip(b"\0") + b"\0"


def compile_kernel(
    spec: KernelSpec, arch: str, key: str | None = None, sources: Mapping[str, str] | None = None
) -> CompileResult:
    """Compiles one spec to a cubin for ``arch`` ("sm_80", "sm_90a", ...: the architecture of the
    build, see :func:`target_arch`). Needs no GPU.

    The cubin carries ``key`` (default: :func:`kernel_key`) as a string constant: the cache's
    proof that the file is this kernel. ``sources``, when given, replaces the text of files of
    ``kernels/`` by name (the benchmark's kernels with a stubbed quantizer); pass the same
    ``sources`` to :func:`kernel_key`.
    """
    check_arch(arch)
    key = kernel_key(spec, arch, sources) if key is None else key
    cubin, report = _run_nvrtc(spec, arch, key, sources, ptx=False)
    kernel_file.check_cubin(cubin, key, arch)  # what the cache will demand of the file: fail here, loudly

    def number(pattern: str) -> int:
        return sum(int(x) for x in re.findall(pattern, report))

    return CompileResult(
        cubin,
        report,
        registers=max((int(x) for x in re.findall(r"Used (\d+) registers", report)), default=0),
        stack_bytes=number(r"(\d+) bytes stack frame"),
        spill_bytes=number(r"(\d+) bytes spill stores") + number(r"(\d+) bytes spill loads"),
    )
