"""The GPUs the kernels run on: which can (:func:`gpu_unavailable_reason`) and what the planners
need to know of one (:class:`Device`: architecture, SMs, shared-memory opt-in), read once per device."""

from __future__ import annotations

import dataclasses
import functools

from . import config

MIN_CAPABILITY = 80  # sm_80 (Ampere): the oldest GPU the kernels support


@dataclasses.dataclass(frozen=True)
class Device:
    """A CUDA device as the planners see it. Tests build fake ones (an sm_80, an sm_120, ...)."""

    index: int
    capability: int  # major * 10 + minor: 90 for sm_90
    sms: int  # multiprocessors
    shared_optin: int  # bytes of dynamic shared memory a block may opt into

    @property
    def arch(self) -> str:
        """The native architecture, e.g. ``sm_90``."""
        return f"sm_{self.capability}"


def capability_of(index: int) -> int:
    import torch

    major, minor = torch.cuda.get_device_capability(index)
    return major * 10 + minor


@functools.cache
def device_info(index: int) -> Device:
    """CUDA device ``index`` (read once; RuntimeError for a GPU older than sm_80)."""
    import torch

    capability = capability_of(index)
    if capability < MIN_CAPABILITY:
        name = torch.cuda.get_device_name(index)
        raise RuntimeError(f"{name} is sm_{capability}; nvfp4_mla's kernels need an sm_80 or newer GPU")
    from cupy.cuda import runtime

    sms = runtime.deviceGetAttribute(runtime.cudaDevAttrMultiProcessorCount, index)
    optin = runtime.deviceGetAttribute(runtime.cudaDevAttrMaxSharedMemoryPerBlockOptin, index)
    return Device(index, capability, sms, optin)


def gpu_unavailable_reason(device_index: int | None = None) -> str | None:
    """Why the GPU entries cannot run here, or None when they can.

    Parameters
    ----------
    device_index
        The CUDA device to ask about (default: torch's current device).

    Returns
    -------
    str or None
        A sentence such as "no CUDA GPU visible to torch", "GPU 0 is sm_75; the kernels need sm_80
        or newer" or "CuPy cannot reach the GPU: ...", or None when the kernels can run. The CLI,
        the tests and the benchmark use this one check.
    """
    import torch

    if not torch.cuda.is_available():
        return "no CUDA GPU visible to torch"
    index = torch.cuda.current_device() if device_index is None else device_index
    capability = capability_of(index)
    if capability < MIN_CAPABILITY:
        return f"GPU {index} is sm_{capability}; the kernels need sm_80 or newer"
    try:
        import cupy

        cupy.cuda.runtime.getDeviceCount()
    except Exception as exc:  # CuPy missing, unable to start, or its CUDA runtime unusable
        return f"CuPy cannot reach the GPU: {exc} ({config.cupy_fix(exc)})"
    return None
