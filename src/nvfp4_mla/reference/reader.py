"""Reference reader: records back to values (NoPE = E2M1 value x E4M3 scale, RoPE = BF16)."""

from __future__ import annotations

import torch

from .. import abi, validation
from .numerics import e2m1_value, e4m3_value


def nvfp4_dequantize_sparse_mla_cache(cache, slots=None, *, dtype=torch.float32):
    """Records read back as ``[n, 512]`` values: NoPE = E2M1 value x E4M3 scale, RoPE = BF16.

    ``slots=None`` reads every slot in order; rows of invalid slots are NaN.
    """
    geometry = validation.check_dequantize(cache, slots, dtype)
    num_pages, page_size, _ = geometry
    capacity = num_pages * page_size
    if slots is None:
        slots = torch.arange(capacity, device=cache.device)
    slots = slots.long()
    valid = (slots >= 0) & (slots < capacity)
    safe = torch.where(valid, slots, 0)
    if capacity == 0:
        return torch.full((slots.shape[0], abi.HEAD_DIM), torch.nan, dtype=dtype, device=cache.device)
    data, scales = abi.record_views(cache, geometry)
    data = data[safe // page_size, safe % page_size]
    scale = e4m3_value(scales[safe // page_size, safe % page_size, : abi.NUM_GROUPS])
    packed = data[:, : abi.NOPE_BYTES]
    codes = torch.stack((packed & 0xF, packed >> 4), dim=-1).flatten(-2)
    nope = e2m1_value(codes).unflatten(-1, (abi.NUM_GROUPS, abi.GROUP_SIZE)) * scale[..., None]
    rope_values = data[:, abi.NOPE_BYTES :].contiguous().view(torch.bfloat16).float()
    values = torch.cat((nope.flatten(-2), rope_values), dim=-1)
    return torch.where(valid[:, None], values, torch.nan).to(dtype)
