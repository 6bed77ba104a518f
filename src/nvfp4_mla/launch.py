"""Launches: a loaded kernel's launch with raw pointers, torch's current stream, and the outputs
the kernels fill."""

from __future__ import annotations

import ctypes
import functools
import struct
import sys
import threading
from collections.abc import Callable
from typing import Any

from . import config
from .device import Device
from .jit import Template

PARAMS_CAPACITY = 512  # bytes of the per-thread launch buffer; every template's Params fits


class LoadError(RuntimeError):
    """The driver refused a kernel image (an invalid image, no code for this GPU, ...)."""


def _cupy_driver() -> Any:
    try:
        from cupy.cuda import driver
    except Exception as exc:  # not installed, or it cannot start (its cache directory, its libraries)
        raise RuntimeError(f"nvfp4_mla's GPU entries need CuPy: {config.cupy_fix(exc)} ({exc})") from exc
    return driver


def _stream_getter() -> Callable[[int], int]:
    import torch

    fast = getattr(torch._C, "_cuda_getCurrentRawStream", None)  # the handle, no Stream object
    if fast is not None:
        return fast
    return lambda device_index: torch.cuda.current_stream(device_index).cuda_stream  # CPU-only builds


current_raw_stream = _stream_getter()


def output_allocator() -> Callable[[tuple, tuple, Any], Any] | None:
    """torch's allocation of a CUDA tensor without the dispatcher, ``(shape, strides, dtype)`` on
    the current device and stream (what inductor's generated code calls), or None where this
    torch has none. It is private to torch, hence the fallbacks of :func:`new_output`."""
    import torch

    # About half of new_empty's host time (docs/performance.md#host-path).
    guards = getattr(getattr(torch._C, "_dynamo", None), "guards", None)
    return getattr(guards, "_empty_strided_cuda", None)


# What new_output allocates with: output_allocator() at import; None once it raised anything but
# running out of memory (new_empty from then on).
fast_empty = output_allocator()


def _stop_fast_empty(exc: Exception) -> None:
    """The private allocation raised: re-raises running out of memory, else turns it off for good
    (a torch that changed it must not break the entries) and says so once."""
    import torch

    global fast_empty
    if isinstance(exc, torch.cuda.OutOfMemoryError):
        raise exc
    fast_empty = None
    config.log.warning(
        "torch's _empty_strided_cuda raised (%s): nvfp4_mla's outputs come from new_empty from now on", exc
    )


@functools.lru_cache(maxsize=1024)  # per-call shapes repeat (a decode step's); a hit costs a hash
def contiguous_strides(shape: tuple) -> tuple:
    """The strides, in elements, of a contiguous tensor of ``shape`` (torch's: a 0-size dim counts as 1)."""
    strides = [1] * len(shape)
    for i in range(len(shape) - 1, 0, -1):
        strides[i - 1] = strides[i] * max(shape[i], 1)
    return tuple(strides)


def new_output(like: Any, shape: tuple, strides: tuple, dtype: Any, device_index: int) -> Any:
    """An uninitialised contiguous tensor (``strides``: :func:`contiguous_strides` of ``shape``) for
    a kernel to fill (every byte), on CUDA device ``device_index`` (``like``'s) and its current
    stream: what ``like.new_empty`` gives, faster. ``shape`` and ``strides`` are plain tuples of
    ints: the fast allocation raises on anything else, a ``torch.Size`` included, and turns itself
    off (the GPU tests check that no entry does that)."""
    if fast_empty is not None:
        try:
            out = fast_empty(shape, strides, dtype)
        except (TypeError, RuntimeError) as exc:
            _stop_fast_empty(exc)
        else:
            if out.get_device() == device_index:  # it allocates on the current device, maybe not like's
                return out
    return like.new_empty(shape, dtype=dtype)


TENSOR_MAP_BYTES = 128  # a CUtensorMap
_BF16 = 9  # CU_TENSOR_MAP_DATA_TYPE_BFLOAT16
_SWIZZLE_128B = 3  # CU_TENSOR_MAP_SWIZZLE_128B
_L2_PROMOTION_128B = 2  # CU_TENSOR_MAP_L2_PROMOTION_L2_128B


@functools.cache
def _driver_library() -> ctypes.CDLL:
    """The CUDA driver, for the calls CuPy does not wrap."""
    return ctypes.CDLL("nvcuda.dll" if sys.platform == "win32" else "libcuda.so.1")


@functools.cache
def tensor_map_driver() -> tuple[Any, Any]:
    """The driver's cuTensorMapEncodeTiled and cuTensorMapReplaceAddress (CUDA 12.0 on): the
    default ``driver`` of :class:`Bf16TensorMap`."""
    library = _driver_library()
    encode, replace = library.cuTensorMapEncodeTiled, library.cuTensorMapReplaceAddress
    u32s, u64s = ctypes.POINTER(ctypes.c_uint32), ctypes.POINTER(ctypes.c_uint64)
    encode.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_uint32, ctypes.c_void_p, u64s, u64s, u32s, u32s]
    encode.argtypes += [ctypes.c_int] * 4  # interleave, swizzle, L2 promotion, out-of-bounds fill
    replace.argtypes = [ctypes.c_void_p, ctypes.c_void_p]
    encode.restype = replace.restype = ctypes.c_int
    return encode, replace


class _MapScratch(threading.local):
    """Per-thread room for a tensor map the driver writes (64-byte aligned, as it requires)."""

    def __init__(self) -> None:
        self._storage = ctypes.create_string_buffer(TENSOR_MAP_BYTES + 64)
        base = ctypes.addressof(self._storage)
        self.at = base + (-base % 64)


_map_scratch = _MapScratch()


class Bf16TensorMap:
    """The tensor map (TMA descriptor, 128 bytes for a kernel's Params) of a BF16 tensor of
    ``dims`` elements (innermost first) with ``strides`` bytes between the steps of every dim but
    the first, copied in boxes of ``box`` elements into 128-byte-swizzled shared memory (zeros
    outside ``dims``), for the tensor at any address. The first address encodes the map; another
    one puts its address into a copy of that map (the cheaper driver call:
    docs/performance.md#host-path), and the map of the last address is kept: a decode step's q
    usually comes back at the same address. ``driver``: the (encode, replace) calls, the CUDA
    driver's (:func:`tensor_map_driver`) when None."""

    __slots__ = ("_arguments", "_driver", "_first", "_last")

    def __init__(
        self,
        dims: tuple[int, ...],
        strides: tuple[int, ...],
        box: tuple[int, ...],
        driver: tuple[Any, Any] | None = None,
    ):
        rank = len(dims)
        self._arguments = (
            rank,
            (ctypes.c_uint64 * rank)(*dims),
            (ctypes.c_uint64 * (rank - 1))(*strides),
            (ctypes.c_uint32 * rank)(*box),
            (ctypes.c_uint32 * rank)(*([1] * rank)),  # every element of a box
        )
        self._driver = driver
        self._first: bytes | None = None  # the map of the first address
        self._last: tuple[int, bytes] = (-1, b"")  # one reference: threads see a consistent pair

    def __call__(self, address: int) -> bytes:
        last = self._last
        if last[0] != address:
            last = address, self._map_at(address)
            self._last = last
        return last[1]

    def _map_at(self, address: int) -> bytes:
        encode, replace = tensor_map_driver() if self._driver is None else self._driver
        at, first = _map_scratch.at, self._first
        if first is None:
            rank, dims, strides, box, steps = self._arguments
            modes = 0, _SWIZZLE_128B, _L2_PROMOTION_128B, 0  # no interleave; out-of-bounds elements read as zeros
            status, call = encode(at, _BF16, rank, address, dims, strides, box, steps, *modes), "cuTensorMapEncodeTiled"
        else:
            ctypes.memmove(at, first, TENSOR_MAP_BYTES)
            status, call = replace(at, address), "cuTensorMapReplaceAddress"
        if status != 0:
            raise RuntimeError(f"{call} failed with CUDA error {status} (dims {list(self._arguments[1])})")
        mapped = ctypes.string_at(at, TENSOR_MAP_BYTES)
        if first is None:
            self._first = mapped
        return mapped


# cuLaunchKernelEx's CUlaunchConfig (grid, block, shared bytes, stream, its attributes and their
# count) and the one attribute it points to: CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION
# (6) set to 1, an id padded to 8 bytes before the value's 64-byte union. The attribute is a
# constant that the driver only reads: one buffer serves every thread.
_LAUNCH_CONFIG = struct.Struct("<7I4xQQI4x")
_DEPENDENT_LAUNCH_ATTRIBUTE = ctypes.create_string_buffer(struct.pack("<i4xi60x", 6, 1), 72)


def asks_dependent_launch(template: Template, device: Device) -> bool:
    """Whether ``template``'s kernel launches with programmatic dependent launch on ``device``: a
    kernel that waits for it (``Template.dependent_launch``), on sm_90 and newer. It hides the gap
    between two kernels of a stream (docs/performance.md#programmatic-dependent-launch)."""
    return template.dependent_launch and device.capability >= 90


@functools.cache
def _launch_kernel_ex() -> Any:
    """The driver's cuLaunchKernelEx (CUDA 12.0 on), None where it lacks it."""
    launch = getattr(_driver_library(), "cuLaunchKernelEx", None)
    if launch is not None:
        launch.argtypes = [ctypes.c_void_p] * 4  # config, function, kernelParams, extra
        launch.restype = ctypes.c_int
    return launch


class _LaunchStorage(threading.local):
    """Per-thread parameter buffer and launch config: the driver copies both at the call, so
    threads never share one."""

    def __init__(self) -> None:
        buffer = ctypes.create_string_buffer(PARAMS_CAPACITY)
        self._pointers = (ctypes.c_void_p * 1)(ctypes.addressof(buffer))
        config = ctypes.create_string_buffer(_LAUNCH_CONFIG.size)
        # One thread-local read a launch.
        self.launch_state = (
            buffer,
            ctypes.addressof(self._pointers),
            config,
            ctypes.addressof(config),
            ctypes.addressof(_DEPENDENT_LAUNCH_ATTRIBUTE),
        )


_storage = _LaunchStorage()


def parameter_buffer() -> tuple[ctypes.Array, int]:
    """This thread's parameter buffer and the address of its argument vector (what a launch
    passes as ``kernelParams``): for timing a bare driver launch."""
    return _storage.launch_state[:2]


class Launcher:
    """A kernel loaded on one device from verified bytes: packs the parameters and launches."""

    __slots__ = (
        "_current_context",
        "_driver",
        "_launch_dependent",
        "_launch_kernel",
        "_module",
        "context",
        "device",
        "function",
        "pack_into",
        "resident_blocks",
        "shared_bytes",
        "threads",
    )

    def __init__(self, cubin: bytes, template: Template, device: Device):
        assert template.params.size <= PARAMS_CAPACITY
        self._driver = driver = _cupy_driver()
        import cupy

        # Load under the device's primary context, made current explicitly: a thread that has
        # not touched CUDA yet has no current context, and cupy.cuda.Device would not set one.
        previous = driver.ctxGetCurrent()
        cupy.cuda.runtime.setDevice(device.index)
        try:
            self._module = cupy.cuda.function.Module()
            try:  # the bytes that were verified: no second read of the file
                self._module.load(cubin)
                self.function = self._module.get_function(template.function).ptr
            except driver.CUDADriverError as exc:  # an image the driver refuses, or without this kernel
                raise LoadError(str(exc)) from exc
            self.context = driver.ctxGetCurrent()
            if template.max_shared_bytes > 48 * 1024:
                attribute = driver.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
                driver.funcSetAttribute(self.function, attribute, template.max_shared_bytes)
            # Blocks the whole GPU holds at once (at the template's most dynamic shared memory):
            # the writer's grid-stride KV blocks need no more, and the decode sizes its splits by it.
            per_sm = driver.occupancyMaxActiveBlocksPerMultiprocessor(
                self.function, template.threads, template.max_shared_bytes
            )
            self.resident_blocks = device.sms * max(per_sm, 1)
        finally:
            driver.ctxSetCurrent(previous)
        self.device = device
        self.pack_into = template.params.struct.pack_into
        self.threads = template.threads
        self.shared_bytes = template.max_shared_bytes  # what a launch of a fixed shared layout asks for
        self._current_context, self._launch_kernel = driver.ctxGetCurrent, driver.launchKernel  # bound once
        self._launch_dependent = _launch_kernel_ex() if asks_dependent_launch(template, device) else None

    @property
    def dependent_launch(self) -> bool:
        """Whether launches let the kernel start while the stream's previous kernel still runs
        (programmatic dependent launch)."""
        return self._launch_dependent is not None

    @property
    def local_size_bytes(self) -> int:
        """Local memory per thread (0 unless registers spilled)."""
        driver = self._driver
        return driver.funcGetAttribute(driver.CU_FUNC_ATTRIBUTE_LOCAL_SIZE_BYTES, self.function)

    def launch_bare(self, gx: int, stream: int, argv: int) -> None:
        """The driver's launch alone, of ``gx`` blocks with the parameters already at ``argv``
        (see :func:`parameter_buffer`): the floor the benchmark compares :meth:`launch` with."""
        self._launch_kernel(self.function, gx, 1, 1, self.threads, 1, 1, 0, stream, argv, 0)

    def launch(self, gx: int, gy: int, gz: int, shared_bytes: int, stream: int, *params: int) -> None:
        """Launches a ``gx x gy x gz`` grid with ``shared_bytes`` of dynamic shared memory on
        ``stream``; ``params`` are the kernel's Params fields. The one launch path of every entry:
        it packs and launches in this frame (a decode step calls it once per layer)."""
        buffer, argv, config, config_at, attribute_at = _storage.launch_state
        self.pack_into(buffer, 0, *params)
        current = self._current_context()
        if current != self.context:
            # The tensors' GPU is not current here (another device, or a thread that has not used
            # CUDA yet): launch under its context, then give the thread its own back.
            driver = self._driver
            driver.ctxSetCurrent(self.context)
            try:
                self.launch(gx, gy, gz, shared_bytes, stream, *params)
            finally:
                driver.ctxSetCurrent(current)
            return
        launch_dependent = self._launch_dependent
        if launch_dependent is None:
            self._launch_kernel(self.function, gx, gy, gz, self.threads, 1, 1, shared_bytes, stream, argv, 0)
            return
        _LAUNCH_CONFIG.pack_into(config, 0, gx, gy, gz, self.threads, 1, 1, shared_bytes, stream, attribute_at, 1)
        status = launch_dependent(config_at, self.function, argv, None)
        if status:
            raise self._driver.CUDADriverError(status)
