"""Run-time compilation of the kernel templates in ``kernels/`` and the cache of compiled kernels.

A *spec* (the writer's :class:`~nvfp4_mla.variant.Variant`, say) names a :class:`Template` and
its ``-D`` constants. It is compiled with NVRTC (through CuPy's bindings; no GPU needed) for one
architecture, kept on disk as a cubin by a :class:`KernelCache`, and loaded once per device.
Calls after the first do one dict lookup.

The cache only runs what it built for that key (docs/format.md section 11): the directory and the
file must be owned by this user or root and writable by nobody else, and the cubin must carry its
own full key, compiled into it as a string constant. Anything else is a miss with a warning.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import re
import stat
import struct
import tempfile
import threading
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple, Protocol

from . import abi

log = logging.getLogger("nvfp4_mla")

HEADER_FILE = "nvfp4_numerics.cuh"
ARCHS = ("sm_80", "sm_90", "sm_100", "sm_120")  # the architectures CI compiles for
MIN_ARCH = 80
PARAMS_CAPACITY = 256  # bytes of the per-thread launch buffer; every template's Params fits
STALE_TEMP_SECONDS = 3600  # a temp file this old was left by a killed process
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


class CacheError(RuntimeError):
    """A directory asked for explicitly cannot hold kernels (unwritable or untrusted)."""


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


_CUPY_FIX = "install CuPy for your CUDA: pip install -e '.[cu12]' (or [cu13])"


def _cupy_driver() -> Any:
    try:
        from cupy.cuda import driver
    except ImportError as exc:
        raise RuntimeError(f"nvfp4_mla's GPU entries need CuPy: {_CUPY_FIX} ({exc})") from exc
    return driver


def _nvrtc() -> Any:
    try:
        from cupy.cuda import nvrtc

        nvrtc.getVersion()
    except Exception as exc:  # CuPy missing, or libnvrtc not found
        raise RuntimeError(
            f"NVRTC is not available: {_CUPY_FIX}, which brings CuPy and the nvidia-cuda-nvrtc wheel ({exc})"
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


def kernel_key(spec: Spec, arch: str) -> str:
    """The full key of a compiled kernel: SHA-256 of its sources, options and NVRTC identity."""
    template = spec.template
    text = "\0".join((_source(template.file), _source(HEADER_FILE), " ".join(_options(spec, arch)), nvrtc_identity()))
    return hashlib.sha256(text.encode()).hexdigest()


def _proof(key: str) -> bytes:
    return (_KEY_PREFIX + key).encode()


def compile_kernel(spec: Spec, arch: str, key: str | None = None) -> CompileResult:
    """Compiles one spec to a cubin for ``arch`` ("sm_80", "sm_90", ...). Needs no GPU.

    The cubin carries ``key`` (default: :func:`kernel_key`) as a string constant: the cache's
    proof that the file is this kernel.
    """
    check_arch(arch)
    nvrtc = _nvrtc()
    key = kernel_key(spec, arch) if key is None else key
    template = spec.template
    options = [*_options(spec, arch), f'-DNVFP4_MLA_KEY="{_KEY_PREFIX}{key}"']
    program = nvrtc.createProgram(
        _source(template.file), template.file, [_source(HEADER_FILE).encode()], [HEADER_FILE.encode()]
    )
    try:
        try:
            nvrtc.compileProgram(program, options)
        except nvrtc.NVRTCError as exc:
            raise RuntimeError(f"NVRTC failed for {spec} on {arch}:\n{nvrtc.getProgramLog(program)}") from exc
        report = nvrtc.getProgramLog(program)
        cubin = nvrtc.getCUBIN(program)
    finally:
        nvrtc.destroyProgram(program)

    def number(pattern: str) -> int:
        return sum(int(x) for x in re.findall(pattern, report))

    return CompileResult(
        cubin,
        report,
        registers=max((int(x) for x in re.findall(r"Used (\d+) registers", report)), default=0),
        stack_bytes=number(r"(\d+) bytes stack frame"),
        spill_bytes=number(r"(\d+) bytes spill stores") + number(r"(\d+) bytes spill loads"),
    )


# ---------------------------------------------------------------- the disk cache


def default_user_dir() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "nvfp4_mla"


def configured_dirs() -> list[Path]:
    """The lookup layers: ``$NVFP4_MLA_CACHE_DIR`` (a path list), then the per-user default."""
    listed = [Path(p) for p in os.environ.get("NVFP4_MLA_CACHE_DIR", "").split(os.pathsep) if p]
    default = default_user_dir()
    return listed + ([] if default in listed else [default])


def _trust_group() -> bool:
    return os.environ.get("NVFP4_MLA_CACHE_TRUST_GROUP", "0") not in ("", "0")


def distrust(st: os.stat_result, what: str) -> str | None:
    """Why a file or directory with status ``st`` may not be trusted, or None (ssh StrictModes:
    owned by this user or root, writable by nobody else; group opt-in widens that)."""
    writable_by_others = stat.S_IWOTH | (0 if _trust_group() else stat.S_IWGRP)
    if st.st_mode & writable_by_others:
        return f"{what} is writable by {'others' if st.st_mode & stat.S_IWOTH else 'its group'}"
    if not _trust_group() and st.st_uid not in (os.geteuid(), 0):
        return f"{what} is owned by uid {st.st_uid}, not by this user or root"
    return None


class KernelCache:
    """Compiled kernels on disk (layered, trusted, locked) and loaded per device.

    ``layers`` are searched in order for a hit; a miss compiles into the first writable, trusted
    layer (or, when there is none, is kept in memory only). ``KernelCache()`` reads the layers from
    the environment (:func:`configured_dirs`).
    """

    def __init__(self, layers: list[Path] | None = None):
        self.layers = configured_dirs() if layers is None else [Path(p) for p in layers]
        self._lock = threading.RLock()  # compiles, disk writes and module loads of this process
        self._launchers: dict[tuple, Launcher] = {}
        self._warned: set[str] = set()
        self._writable: Path | bool | None = False  # False: not looked for yet

    # ------------------------------------------------------------ layers

    def _warn(self, message: str) -> None:
        log.warning(message)
        if message not in self._warned:
            self._warned.add(message)
            warnings.warn(f"nvfp4_mla: {message}", RuntimeWarning, stacklevel=4)

    def _trusted_dir(self, directory: Path) -> bool:
        try:
            st = os.stat(directory)
        except OSError:
            return False
        reason = "not a directory" if not stat.S_ISDIR(st.st_mode) else distrust(st, f"directory {directory}")
        if reason:
            self._warn(f"kernel cache {directory} ignored: {reason}")
        return reason is None

    def prepare(self, directory: Path) -> str | None:
        """Makes ``directory`` ready to receive kernels; returns why it cannot, or None.

        A directory this creates is private (0700)."""
        try:
            if not directory.exists():
                directory.mkdir(mode=0o700, parents=True, exist_ok=True)
            st = os.stat(directory)
        except OSError as exc:
            return f"cannot create {directory}: {exc.strerror or exc}"
        if not stat.S_ISDIR(st.st_mode):
            return f"{directory} is not a directory"
        reason = distrust(st, f"directory {directory}")
        if reason:
            return reason
        if not os.access(directory, os.W_OK | os.X_OK):
            return f"{directory} is not writable by this user"
        return None

    def writable_dir(self) -> Path | None:
        """The layer misses compile into, or None (memory only)."""
        if self._writable is False:
            reasons = []
            for directory in self.layers:
                reason = self.prepare(directory)
                if reason is None:
                    self._writable = directory
                    break
                reasons.append(reason)
            else:
                self._writable = None
                self._warn(f"no writable kernel cache directory ({'; '.join(reasons)}): kernels are compiled in memory")
        return self._writable if isinstance(self._writable, Path) else None

    # ------------------------------------------------------------ files

    @staticmethod
    def file_name(key: str, arch: str) -> str:
        return f"{arch}-{key[:32]}.cubin"

    def read_verified(self, path: Path, key: str) -> bytes | None:
        """The cubin at ``path`` if it is trusted and proves it is ``key``'s kernel, else None
        (with a warning when a file is there but refused). Any fault is a miss."""
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | getattr(os, "O_NONBLOCK", 0))
        except FileNotFoundError:
            return None
        except OSError as exc:
            self._warn(f"kernel cache file {path} refused: {exc.strerror or exc}")
            return None
        try:
            st = os.fstat(fd)
            reason = "not a regular file" if not stat.S_ISREG(st.st_mode) else distrust(st, "the file")
            if reason is None:
                with os.fdopen(os.dup(fd), "rb") as f:
                    data = f.read()
                if _proof(key) not in data:
                    reason = "it is not this key's kernel (truncated, corrupted or another kernel)"
        except OSError as exc:
            reason = str(exc.strerror or exc)
        finally:
            os.close(fd)
        if reason is not None:
            self._warn(f"kernel cache file {path} refused: {reason}; compiling")
            return None
        return data

    def lookup(self, key: str, arch: str) -> tuple[bytes, Path] | None:
        name = self.file_name(key, arch)
        for directory in self.layers:
            if (directory / name).exists() or (directory / name).is_symlink():
                if not self._trusted_dir(directory):
                    continue
                data = self.read_verified(directory / name, key)
                if data is not None:
                    log.debug("kernel %s found in %s", name, directory)
                    return data, directory / name
        return None

    @staticmethod
    def publish(directory: Path, name: str, data: bytes) -> Path:
        """Writes ``data`` as ``directory/name`` atomically (temp file, fsync, rename) and removes
        temp files that killed processes left behind."""
        now = time.time()
        for stale in directory.glob("*.tmp"):
            try:
                if now - stale.lstat().st_mtime > STALE_TEMP_SECONDS:
                    stale.unlink()
            except OSError:
                pass
        fd, tmp = tempfile.mkstemp(dir=directory, suffix=".tmp")
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            os.chmod(tmp, 0o644)  # readable by the users a shared precompiled set serves
            os.replace(tmp, directory / name)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
        return directory / name

    def build(self, spec: Spec, arch: str, directory: Path | None = None) -> tuple[bytes, Path | None]:
        """The verified cubin of ``spec`` for ``arch`` and where it lies (None: memory only),
        compiling on a miss. With ``directory``, it compiles into exactly that directory (or
        raises :class:`CacheError`). One compile per key across threads and processes."""
        arch = check_arch(arch)
        key = kernel_key(spec, arch)
        name = self.file_name(key, arch)
        with self._lock:
            if directory is None:
                found = self.lookup(key, arch)
                if found is not None:
                    return found
                target = self.writable_dir()
            else:
                reason = self.prepare(directory)
                if reason is not None:
                    raise CacheError(f"cannot write kernels into {directory}: {reason}")
                target = directory
            if target is None:
                return self._compile(spec, arch, key), None
            from filelock import FileLock

            data = None
            try:
                with FileLock(str(target / f"{name}.lock")):
                    data = self.read_verified(target / name, key)  # another process may have built it
                    if data is None:
                        data = self._compile(spec, arch, key)
                        self.publish(target, name, data)
            except OSError as exc:  # the directory changed under us (removed, made read-only, ...)
                if directory is not None:
                    raise CacheError(f"cannot write kernels into {directory}: {exc}") from exc
                self._warn(f"kernel cache {target} failed ({exc}); this kernel is kept in memory")
                return (self._compile(spec, arch, key) if data is None else data), None
            return data, target / name

    @staticmethod
    def _compile(spec: Spec, arch: str, key: str) -> bytes:
        start = time.perf_counter()
        cubin = compile_kernel(spec, arch, key).cubin
        log.info("compiled %s for %s in %.2f s", spec, arch, time.perf_counter() - start)
        return cubin

    # ------------------------------------------------------------ loaded kernels

    def launcher(self, device_index: int, spec: Spec) -> Launcher:
        """The loaded kernel of ``spec`` on device ``device_index``; built on first use.

        The hot path is one dict lookup. Safe under concurrent first calls: one thread builds,
        the others wait and share it.
        """
        found = self._launchers.get((device_index, spec))
        if found is None:
            with self._lock:
                found = self._launchers.get((device_index, spec))
                if found is None:
                    data, _ = self.build(spec, device_arch(device_index))
                    found = Launcher(data, spec.template, device_index)
                    self._launchers[(device_index, spec)] = found
        return found


_kernel_cache: KernelCache | None = None


def kernel_cache() -> KernelCache:
    """The process's kernel cache, its layers read from the environment at first use."""
    global _kernel_cache
    if _kernel_cache is None:
        _kernel_cache = KernelCache()
    return _kernel_cache


# ---------------------------------------------------------------- devices and launching


def gpu_unavailable_reason(device_index: int | None = None) -> str | None:
    """Why the GPU entries cannot run here (no CUDA device, one older than sm_80, or CuPy unable to
    reach it), or None when they can. The one such check: tests, the CLI and the benchmark use it."""
    import torch

    if not torch.cuda.is_available():
        return "no CUDA GPU visible to torch"
    index = torch.cuda.current_device() if device_index is None else device_index
    major, minor = torch.cuda.get_device_capability(index)
    if major * 10 + minor < MIN_ARCH:
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
    if major * 10 + minor < MIN_ARCH:
        name = torch.cuda.get_device_name(device_index)
        raise RuntimeError(f"{name} is sm_{major}{minor}; nvfp4_mla's kernels need an sm_80 or newer GPU")
    return f"sm_{major}{minor}"


def _stream_getter() -> Callable[[int], int]:
    import torch

    fast = getattr(torch._C, "_cuda_getCurrentRawStream", None)  # the handle, no Stream object
    if fast is not None:
        return fast
    return lambda device_index: torch.cuda.current_stream(device_index).cuda_stream  # CPU-only builds


current_raw_stream = _stream_getter()


class _LaunchStorage(threading.local):
    """Per-thread parameter buffer: cuLaunchKernel copies it at the call, so threads never share one."""

    def __init__(self) -> None:
        self.buffer = ctypes.create_string_buffer(PARAMS_CAPACITY)
        self._pointers = (ctypes.c_void_p * 1)(ctypes.addressof(self.buffer))
        self.argv = ctypes.addressof(self._pointers)


_storage = _LaunchStorage()


class Launcher:
    """A kernel loaded on one device from verified bytes: packs the parameters and launches."""

    __slots__ = ("_driver", "_module", "context", "function", "pack_into", "threads")

    def __init__(self, cubin: bytes, template: Template, device_index: int):
        assert template.params.size <= PARAMS_CAPACITY
        self._driver = driver = _cupy_driver()
        import cupy

        # Load under the device's primary context, made current explicitly: a thread that has
        # not touched CUDA yet has no current context, and cupy.cuda.Device would not set one.
        previous = driver.ctxGetCurrent()
        cupy.cuda.runtime.setDevice(device_index)
        try:
            self._module = cupy.cuda.function.Module()
            self._module.load(cubin)  # the bytes that were verified: no second read of the file
            self.function = self._module.get_function(template.function).ptr
            self.context = driver.ctxGetCurrent()
        finally:
            driver.ctxSetCurrent(previous)
        if template.max_shared_bytes > 48 * 1024:
            attribute = driver.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
            driver.funcSetAttribute(self.function, attribute, template.max_shared_bytes)
        self.pack_into = template.params.pack_into
        self.threads = template.threads

    @property
    def local_size_bytes(self) -> int:
        """Local memory per thread (0 unless registers spilled)."""
        driver = self._driver
        return driver.funcGetAttribute(driver.CU_FUNC_ATTRIBUTE_LOCAL_SIZE_BYTES, self.function)

    def launch(self, blocks: int, stream: int, *params: int) -> None:
        """Launches ``blocks`` blocks on ``stream``; ``params`` are the kernel's Params fields."""
        self.launch_grid(blocks, 1, 1, 0, stream, *params)

    def launch_grid(self, gx: int, gy: int, gz: int, shared_bytes: int, stream: int, *params: int) -> None:
        """Launches a ``gx x gy x gz`` grid with ``shared_bytes`` of dynamic shared memory."""
        storage = _storage
        self.pack_into(storage.buffer, 0, *params)
        driver = self._driver
        current = driver.ctxGetCurrent()
        threads = self.threads
        if current == self.context:
            driver.launchKernel(self.function, gx, gy, gz, threads, 1, 1, shared_bytes, stream, storage.argv, 0)
            return
        # The tensors' GPU is not current here (another device, or a thread that has not used
        # CUDA yet): launch under its context, then give the thread its own back.
        driver.ctxSetCurrent(self.context)
        try:
            driver.launchKernel(self.function, gx, gy, gz, threads, 1, 1, shared_bytes, stream, storage.argv, 0)
        finally:
            driver.ctxSetCurrent(current)
