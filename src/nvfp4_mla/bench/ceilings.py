"""The same run's ceilings: device copy bandwidth, an empty kernel's launch, a torch op's host time,
and (for the decode suite) a large BF16 matmul's rate."""

from __future__ import annotations

from collections.abc import Callable

import torch

from ..launch import current_raw_stream
from .results import Ceilings, reason
from .timing import Timer

COPY_BYTES = 2**30  # the copy ceiling's tensor
MATMUL_SIZE = 8192  # the matmul ceiling multiplies two square BF16 matrices of this size
EMPTY_KERNEL_NAME = "nvfp4_mla_bench_empty"
EMPTY_KERNEL_SOURCE = f'extern "C" __global__ void {EMPTY_KERNEL_NAME}() {{}}'
EMPTY_KERNEL_TITLE = (
    "a CuPy RawKernel with an empty body (1 block of 32 threads), launched with cuLaunchKernel "
    "through cupy.cuda.driver like nvfp4_mla's kernels"
)


def empty_kernel_launcher(device: torch.device) -> Callable[[object], None]:
    """Launches an empty kernel on torch's current stream the way nvfp4_mla launches its own
    (the argument is ignored: the launcher times like an arm's call)."""
    import cupy
    from cupy.cuda import driver

    index = torch.cuda.current_device() if device.index is None else device.index
    with cupy.cuda.Device(index):
        function = cupy.RawKernel(EMPTY_KERNEL_SOURCE, EMPTY_KERNEL_NAME).kernel.ptr

    def launch(_: object) -> None:
        driver.launchKernel(function, 1, 1, 1, 32, 1, 1, 0, current_raw_stream(index), 0, 0)

    return launch


def copy_bandwidth(device: torch.device, timer: Timer, copy_bytes: int = COPY_BYTES) -> float:
    """Bytes read + written per second by ``copy_`` of a ``copy_bytes`` device tensor.

    Timed eagerly (``timer.eager``), not graph-replayed: captured in a CUDA graph, ``copy_`` becomes
    a memcpy node, which ran at 2.7 TB/s on the H200 against 4.3 TB/s eager (a 0.5 ms copy has no
    host overhead to hide).
    """
    source = torch.empty(copy_bytes, dtype=torch.uint8, device=device)
    target = torch.empty_like(source)
    seconds, _ = timer.eager(lambda _: target.copy_(source), [None])
    return 2 * copy_bytes / seconds


def matmul_flops(device: torch.device, timer: Timer, size: int = MATMUL_SIZE) -> float:
    """Flops per second of a ``size``-cubed BF16 ``matmul``, graph-replayed."""
    a = torch.randn(size, size, device=device, dtype=torch.bfloat16)
    b = torch.randn(size, size, device=device, dtype=torch.bfloat16)
    return 2 * size**3 / timer.graph(lambda _: a @ b, [None])


def measure_ceilings(device: torch.device, timer: Timer, copy_bytes: int = COPY_BYTES) -> Ceilings:
    """All three ceilings; one that fails is None with its reason in ``notes``."""
    ceilings = Ceilings()
    try:
        ceilings.copy_bytes_per_s = copy_bandwidth(device, timer, copy_bytes)
        torch.cuda.empty_cache()  # 2 GiB back before the grid
    except Exception as exc:
        ceilings.notes.append(f"copy ceiling n/a: {reason(exc)}")
    try:
        launch = empty_kernel_launcher(device)
        ceilings.launch_eager_s, _ = timer.eager(launch, [None])
        ceilings.launch_graph_s = timer.graph(launch, [None])
    except Exception as exc:
        ceilings.notes.append(f"empty-kernel launch n/a: {reason(exc)}")
    scalar = torch.zeros(1, device=device)
    ceilings.add_host_s = timer.host(lambda t: t.add_(1), scalar)
    return ceilings
