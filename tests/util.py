"""Inputs and caches for the tests: canary-filled caches in every layout, random and crafted rows."""

from __future__ import annotations

import torch

from nvfp4_mla import abi

CANARY = 0xA5


def make_cache(num_pages: int, page_size: int, layout: str = "3D", pad: int = 0, device="cpu") -> torch.Tensor:
    """A cache view filled with the 0xA5 canary. ``layout`` is "3D", "HND" or "NHD"; ``pad`` extra
    bytes (a multiple of 16) after each page make a padded pool (page stride > payload)."""
    payload = page_size * abi.RECORD_BYTES
    pool = torch.full((num_pages, payload + pad), CANARY, dtype=torch.uint8, device=device)
    pages = pool[:, :payload]
    if layout == "3D":
        return pages.unflatten(1, (page_size, abi.RECORD_BYTES))
    if layout == "HND":
        return pages.unflatten(1, (1, page_size, abi.RECORD_BYTES))
    if layout == "NHD":
        return pages.unflatten(1, (page_size, 1, abi.RECORD_BYTES))
    raise ValueError(layout)


def storage_bytes(cache: torch.Tensor) -> torch.Tensor:
    """Every byte of the cache's storage (pool padding included), as a CPU uint8 tensor."""
    storage = cache.untyped_storage()
    return torch.empty(0, dtype=torch.uint8, device=cache.device).set_(storage).cpu().clone()


def random_rows(shape, device="cpu", scale=1.0) -> torch.Tensor:
    """BF16 normal values with a spread of magnitudes per group (so scales differ)."""
    x = torch.randn(*shape, device=device) * scale
    x = x * torch.exp2(torch.randint(-8, 8, (*shape[:-1], shape[-1] // 16), device=device).float()).repeat_interleave(16, -1)
    return x.to(torch.bfloat16)


def cos_sin_table(max_position: int, device="cpu") -> torch.Tensor:
    """A real RoPE table: cos[32] | sin[32] of position * inv_freq (fp32)."""
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, abi.ROPE_DIM, 2, dtype=torch.float64) / abi.ROPE_DIM))
    angles = torch.arange(max_position, dtype=torch.float64)[:, None] * inv_freq[None, :]
    return torch.cat((angles.cos(), angles.sin()), dim=1).float().to(device)


def random_slots(num_rows: int, capacity: int, dtype=torch.int64, device="cpu") -> torch.Tensor:
    """Distinct valid slots for ``num_rows`` rows (capacity >= num_rows)."""
    return torch.randperm(capacity)[:num_rows].to(dtype).to(device)


def bits(t: torch.Tensor) -> torch.Tensor:
    """Bit pattern of a BF16 tensor (for bitwise comparison, NaN included)."""
    return t.view(torch.int16)
