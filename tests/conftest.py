"""Shared fixtures. GPU tests carry ``@pytest.mark.gpu`` and skip, with the reason, without a usable GPU."""

import random

import pytest
import torch

from nvfp4_mla import gpu_unavailable_reason

GPU_SKIP_REASON = gpu_unavailable_reason()


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
    s = random.SystemRandom().randrange(2**31)
    print(f"seed={s}")
    torch.manual_seed(s)
    return s
