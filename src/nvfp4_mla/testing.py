"""Test support: inputs, canary caches and byte-exact checks against the reference.

Used by the test suite, ``benchmarks/``, the command line and the benchmark. Importing it needs
neither a GPU nor pytest.
"""

from __future__ import annotations

import torch

from . import abi

CANARY = 0xA5  # the byte a fresh test cache is filled with: any byte a call writes shows


def rope_table(max_position: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """A real RoPE table ``[max_position, 64]`` fp32: cos[32] | sin[32] of position * inv_freq
    (base 10000), as ``cos_sin_cache`` expects (docs/format.md section 2)."""
    inv_freq = 1.0 / 10000.0 ** (torch.arange(0, abi.ROPE_DIM, 2, dtype=torch.float64) / abi.ROPE_DIM)
    angles = torch.arange(max_position, dtype=torch.float64)[:, None] * inv_freq[None, :]
    return torch.cat((angles.cos(), angles.sin()), dim=1).float().to(device)


def random_rows(shape: tuple[int, ...], device: torch.device | str = "cpu", scale: float = 1.0) -> torch.Tensor:
    """BF16 normal values whose groups of 16 along the last dim each get a random power-of-two
    magnitude in [2^-8, 2^7], so the groups' scales differ."""
    x = torch.randn(*shape, device=device) * scale
    exponents = torch.randint(-8, 8, (*shape[:-1], shape[-1] // abi.GROUP_SIZE), device=device)
    return (x * torch.exp2(exponents.float()).repeat_interleave(abi.GROUP_SIZE, -1)).to(torch.bfloat16)


def make_cache(
    num_pages: int, page_size: int, layout: str = "3D", pad: int = 0, device: torch.device | str = "cpu"
) -> torch.Tensor:
    """A cache view filled with the :data:`CANARY` byte.

    Parameters
    ----------
    num_pages, page_size
        The cache geometry.
    layout
        ``"3D"`` (``[num_pages, page_size, 384]``), ``"HND"`` or ``"NHD"``.
    pad
        Extra bytes (a multiple of 16) after each page: a padded pool, page stride > payload.
    device
        Where the cache lives.
    """
    payload = page_size * abi.RECORD_BYTES
    pool = torch.full((num_pages, payload + pad), CANARY, dtype=torch.uint8, device=device)
    pages = pool[:, :payload]
    if layout == "3D":
        return pages.unflatten(1, (page_size, abi.RECORD_BYTES))
    if layout == "HND":
        return pages.unflatten(1, (1, page_size, abi.RECORD_BYTES))
    if layout == "NHD":
        return pages.unflatten(1, (page_size, 1, abi.RECORD_BYTES))
    raise ValueError(f"layout must be 3D, HND or NHD, got {layout!r}")


def raw_bytes(t: torch.Tensor) -> torch.Tensor:
    """Every byte of ``t``'s storage (pool padding included) as a uint8 view on its device."""
    return torch.empty(0, dtype=torch.uint8, device=t.device).set_(t.untyped_storage())


def storage_bytes(t: torch.Tensor) -> torch.Tensor:
    """A CPU copy of every byte of ``t``'s storage (pool padding included)."""
    return raw_bytes(t).to("cpu", copy=True)
