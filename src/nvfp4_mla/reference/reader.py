"""Reference reader: records back to values (docs/format.md section 3 for the record).

This is the definition the GPU reader reproduces bit for bit. For a valid slot, row element ``i``:

- **NoPE** (``i < 448``, group ``g = i // 16``): the IEEE product ``e2m1(code_i) * e4m3(scale_g)``.
  Bit 7 of an E4M3 scale byte is its sign: bytes ``0x80..0xFE`` are the negatives of
  ``0x00..0x7E`` (``0x80`` is -0), and ``0x7F`` and ``0xFF`` are NaN. The writers only store
  ``0x00..0x7E``; the reader still gives every byte a value. The sign of the product is the XOR
  of the two signs, zeros included: E2M1 code 8 (-0) times a positive scale is -0.0, times a
  negative scale +0.0.
- **RoPE** (``i >= 448``): the stored BF16 value.
- **Exactness:** an E2M1 value has at most 2 significant bits and an E4M3 value at most 4, so a
  product has at most 6, with magnitude 0 or within ``[2^-10, 2688]``: inside the normal range of
  both BF16 and fp32. Products are computed in fp32 (exact) and converted to the output dtype,
  which is exact too. No value is ever rounded.
- **NaN:** every NaN in the output is the canonical quiet NaN of the output dtype, fp32
  ``0x7FC00000`` or BF16 ``0x7FC0``, on every device: groups with a NaN scale, RoPE values with
  any NaN payload or sign, and a NaN fill.

A slot is invalid when it is negative or not below ``num_pages * page_size``. Its whole row is
``invalid``, rounded to fp32 (nearest even) and then to the output dtype (nearest even), NaN made
canonical. An invalid slot reads nothing from the cache.
"""

from __future__ import annotations

import torch

from .. import abi, validation
from .numerics import E2M1_VALUES, e4m3_value

_NAN_BITS = {torch.float32: (0x7FC00000, torch.int32), torch.bfloat16: (abi.BF16_NAN_BITS, torch.int16)}

# Both values of every packed E2M1 byte: element 2j is the low nibble of byte j.
_SIGNED_E2M1 = (*E2M1_VALUES, *(-v for v in E2M1_VALUES))
_E2M1_PAIRS = torch.tensor([(_SIGNED_E2M1[b & 0xF], _SIGNED_E2M1[b >> 4]) for b in range(256)], dtype=torch.float32)
_MAGNITUDES = e4m3_value(torch.arange(0x80))
_SIGNED_E4M3 = torch.cat((_MAGNITUDES, -_MAGNITUDES))  # by byte: bit 7 is the sign


def canonical_nan(dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    """The canonical quiet NaN of ``dtype`` (fp32 ``0x7FC00000``, BF16 ``0x7FC0``) as a 0-d tensor."""
    bits, int_dtype = _NAN_BITS[dtype]
    return torch.tensor(bits, dtype=int_dtype, device=device).view(dtype)


def canonicalize_nan(x: torch.Tensor) -> torch.Tensor:
    """``x`` (fp32 or BF16) with every NaN replaced by the canonical quiet NaN of its dtype.

    torch's NaN bits depend on the device and the code path (a NaN operand's payload and sign
    pass through on the CPU, CUDA returns 0x7FFFFFFF), so they are set here.
    """
    return torch.where(torch.isnan(x), canonical_nan(x.dtype, x.device), x)


def e4m3_signed_value(code: torch.Tensor) -> torch.Tensor:
    """fp32 value of E4M3 (fn) bytes 0..255 (uint8): bit 7 is the sign, ``0x7F`` and ``0xFF`` are NaN."""
    return _SIGNED_E4M3.to(code.device).index_select(0, code.reshape(-1).long()).view(code.shape)


def _record_values(cache: torch.Tensor, layout: validation.CacheLayout, slots: torch.Tensor) -> torch.Tensor:
    """fp32 ``[n, 512]`` values of the records at valid ``slots[n]`` (int64), NaN bits not yet canonical."""
    page_size = layout.page_size
    data, scales = abi.record_views(cache, layout)
    pages, entries = slots // page_size, slots % page_size
    data, scales = data[pages, entries], scales[pages, entries, : abi.NUM_GROUPS]
    n = slots.shape[0]
    values = torch.empty(n, abi.HEAD_DIM, dtype=torch.float32, device=cache.device)
    e2m1 = _E2M1_PAIRS.to(cache.device).index_select(0, data[:, : abi.NOPE_BYTES].reshape(-1).long())  # [n * 224, 2]
    nope = values[:, : abi.NOPE_DIM].unflatten(1, (abi.NUM_GROUPS, abi.GROUP_SIZE))
    torch.mul(e2m1.view(n, abi.NUM_GROUPS, abi.GROUP_SIZE), e4m3_signed_value(scales)[..., None], out=nope)
    values[:, abi.NOPE_DIM :] = data[:, abi.NOPE_BYTES :].view(torch.bfloat16)
    return values


def nvfp4_dequantize_sparse_mla_cache(
    cache: torch.Tensor,
    slots: torch.Tensor | None = None,
    *,
    dtype: torch.dtype = torch.float32,
    invalid: float = float("nan"),
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Reads records back as values: NoPE = E2M1 value x E4M3 scale, RoPE = BF16.

    Parameters
    ----------
    cache
        A cache view of docs/format.md section 3 (3-D, HND or NHD, padded pools included).
    slots
        int32 or int64 slots (``page * page_size + entry``) of any shape, contiguous, e.g. a decode
        batch's top-k indices ``[batch, topk]``. ``None`` reads every slot in order.
    dtype
        ``torch.float32`` or ``torch.bfloat16``; both are exact (see the module docstring).
    invalid
        The value of every element of the row of an invalid slot (negative, or not below
        ``num_pages * page_size``). NaN (the default) is loud; attention over top-k lists padded
        with -1 wants ``0.0``, because 0 x NaN is NaN.
    out
        Optional preallocated output: contiguous, ``slots.shape + (512,)``, of ``dtype``, on the
        cache's device, sharing no memory with the cache or the slots. It is returned.

    Returns
    -------
    torch.Tensor
        ``slots.shape + (512,)`` (``[num_pages * page_size, 512]`` for ``slots=None``) of ``dtype``.
        Every NaN in it is the canonical quiet NaN of ``dtype``.
    """
    layout = validation.check_dequantize(cache, slots, dtype, invalid, out, need_cuda=False)
    capacity = layout.num_pages * layout.page_size
    device = cache.device
    if slots is None:
        slots = torch.arange(capacity, device=device)
    shape = (*slots.shape, abi.HEAD_DIM)
    flat = slots.reshape(-1).long()
    valid = (flat >= 0) & (flat < capacity)
    if capacity:
        values = _record_values(cache, layout, torch.where(valid, flat, 0))  # invalid rows read slot 0, then dropped
    else:  # no record exists: every slot is invalid
        values = torch.zeros(flat.shape[0], abi.HEAD_DIM, dtype=torch.float32, device=device)
    fill = canonicalize_nan(torch.tensor(float(invalid), dtype=torch.float32, device=device).to(dtype))
    if out is None:
        out = torch.empty(shape, dtype=dtype, device=device)
    result = canonicalize_nan(values.to(dtype))
    torch.where(valid[:, None], result, fill, out=out.view(-1, abi.HEAD_DIM))
    return out
