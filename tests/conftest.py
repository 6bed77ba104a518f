"""Shared fixtures. GPU tests carry ``@pytest.mark.gpu`` and skip, with the reason, without a GPU."""

import pytest
import torch


def _gpu_skip_reason():
    if not torch.cuda.is_available():
        return "no CUDA GPU visible to torch"
    major, minor = torch.cuda.get_device_capability()
    if major < 8:
        return f"GPU is sm_{major}{minor}; the kernels need sm_80 or newer"
    try:
        import cupy  # noqa: F401

        cupy.cuda.runtime.getDeviceCount()
    except Exception as exc:  # CuPy missing, or its CUDA runtime unusable
        return f"CuPy cannot reach the GPU: {exc}"
    return None


GPU_SKIP_REASON = _gpu_skip_reason()


def pytest_collection_modifyitems(config, items):
    if GPU_SKIP_REASON is None:
        return
    skip = pytest.mark.skip(reason=GPU_SKIP_REASON)
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def seed():
    """A fresh seed every run, printed so a failure can be replayed (pytest -s shows it)."""
    import random

    s = random.SystemRandom().randrange(2**31)
    print(f"seed={s}")
    torch.manual_seed(s)
    return s
