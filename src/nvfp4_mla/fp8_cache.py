"""The FP8 latent-KV format DeepSeek-V4 serving uses today, for comparison: 584 bytes a token.

A token's record (``uint8 [..., 584]``):

- bytes ``0..447``: the 448 NoPE values as E4M3 (fn) codes, ``code = e4m3(v / 2^e_b)``;
- bytes ``448..575``: the 64 RoPE values, BF16 bits, little-endian (stored as they are);
- bytes ``576..582``: the seven UE8M0 scales, one per block ``b`` of 64 NoPE values: byte
  ``e_b + 127`` stands for ``2^e_b`` (``0xFF`` is NaN);
- byte ``583``: padding, zero.

In FlashMLA's paged cache (its ``MODEL1_FP8Sparse`` layout) a page keeps its tokens' 576-byte value
rows first and their 8 scale bytes after them, as this library's NVFP4 record does; the values per
token are the same, so the study here keeps one 584-byte record a token.

**Scale rule** (the serving quantizer's: ``2^ceil(log2(max(amax / 448, 1e-4)))``):
``amax_b = max |v|`` over the block's BF16 values, ``r = max(fp32(amax_b / 448), fp32(1e-4))`` and
``e_b`` the smallest integer with ``2^e_b >= r``. So ``|v| / 2^e_b <= 448`` always, and nothing
saturates. The floor ``1e-4`` gives every block whose ``amax < 0.0448`` (all-zero blocks included)
the scale ``2^-13``, UE8M0 byte ``114``. ``e_b`` is computed exactly (``frexp``, not a rounded
``log2``); rounding the quotient to fp32 cannot carry it across a power of two, since
``amax / 448`` of a BF16 ``amax`` is either a power of two or, relatively, at least 2^-9 away from one.

**Values:** ``v / 2^e_b`` (exact in fp32) rounded to E4M3 to nearest, ties to even, subnormals
included; the sign is kept, so -0 is code ``0x80``.

**Non-finite input:** a block holding an inf or a NaN gets scale byte ``0xFF`` (UE8M0 NaN) and all
64 codes ``0x7F`` (E4M3 NaN): one bad value makes its block NaN on reading, as in the serving
quantizer, where ``amax`` becomes inf or NaN. The RoPE part is stored bitwise whatever it holds.

**Reading:** ``e4m3(code) * 2^(byte - 127)``, computed exactly and rounded once to fp32: exact,
except that a value above the fp32 range reads as +-inf (only possible for blocks whose ``amax``
is within 1/16 of the BF16 maximum). Scale byte ``0xFF`` and E4M3 codes ``0x7F``/``0xFF`` read as
NaN; every NaN read is the canonical fp32 ``0x7FC00000``.
"""

from __future__ import annotations

import torch

from . import abi
from .reference.numerics import e4m3_code
from .reference.reader import canonicalize_nan, e4m3_signed_value

FP8_RECORD_BYTES = 584
FP8_BLOCK = 64  # NoPE values sharing one UE8M0 scale
FP8_NUM_BLOCKS = abi.NOPE_DIM // FP8_BLOCK  # 7
FP8_ROPE_OFFSET = abi.NOPE_DIM  # 448: one byte a NoPE value
FP8_SCALE_OFFSET = FP8_ROPE_OFFSET + abi.ROPE_BYTES  # 576
UE8M0_BIAS = 127
UE8M0_NAN = 0xFF
E4M3_MAX = 448.0
SCALE_FLOOR = torch.tensor(1e-4, dtype=torch.float32).item()  # the fp32 nearest 1e-4, as the quantizer uses it


def _check(t: torch.Tensor, name: str, dtype: torch.dtype, width: int) -> None:
    if not isinstance(t, torch.Tensor) or t.dtype != dtype or t.dim() < 1 or t.shape[-1] != width:
        got = f"{t.dtype} {list(t.shape)}" if isinstance(t, torch.Tensor) else type(t).__name__
        raise ValueError(f"{name} must be a {dtype} tensor [..., {width}], got {got}")


def fp8_scale_exponents(nope: torch.Tensor) -> torch.Tensor:
    """``e_b`` (int32 ``[..., 7]``) of BF16 NoPE values ``[..., 448]``, by the scale rule; blocks
    holding inf or NaN get the exponent ``128`` (byte ``0xFF``)."""
    blocks = nope.float().unflatten(-1, (FP8_NUM_BLOCKS, FP8_BLOCK))
    amax = blocks.abs().amax(dim=-1)  # inf or NaN in a non-finite block
    ratio = torch.clamp(amax / E4M3_MAX, min=SCALE_FLOOR)  # fp32, as the serving quantizer
    mantissa, exponent = torch.frexp(ratio)  # ratio = mantissa * 2^exponent, mantissa in [0.5, 1)
    e = torch.where(mantissa == 0.5, exponent - 1, exponent)  # exact powers of two: no rounding up
    return torch.where(torch.isfinite(amax), e, UE8M0_NAN - UE8M0_BIAS).to(torch.int32)


def fp8_quantize_rows(rows: torch.Tensor) -> torch.Tensor:
    """FP8 records ``uint8 [..., 584]`` of BF16 rows ``[..., 512]`` (already roped).

    Parameters
    ----------
    rows
        BF16 latent rows, any leading shape.

    Returns
    -------
    torch.Tensor
        The records, one per row, laid out and rounded as the module docstring says.
    """
    _check(rows, "rows", torch.bfloat16, abi.HEAD_DIM)
    nope = rows[..., : abi.NOPE_DIM]
    e = fp8_scale_exponents(nope)  # [..., 7]
    finite = e + UE8M0_BIAS != UE8M0_NAN
    blocks = nope.float().unflatten(-1, (FP8_NUM_BLOCKS, FP8_BLOCK))
    y = torch.ldexp(blocks, -torch.where(finite, e, 0)[..., None].float())  # exact: a power-of-two scale
    codes = e4m3_code(y.abs()) | (torch.signbit(y).to(torch.uint8) << 7)
    codes = torch.where(finite[..., None], codes, abi.E4M3_NAN_CODE).flatten(-2)
    record = torch.zeros(*rows.shape[:-1], FP8_RECORD_BYTES, dtype=torch.uint8, device=rows.device)
    record[..., :FP8_ROPE_OFFSET] = codes
    record[..., FP8_ROPE_OFFSET:FP8_SCALE_OFFSET] = rows[..., abi.NOPE_DIM :].contiguous().view(torch.uint8)
    record[..., FP8_SCALE_OFFSET : FP8_SCALE_OFFSET + FP8_NUM_BLOCKS] = (e + UE8M0_BIAS).to(torch.uint8)
    return record


def fp8_dequantize_rows(records: torch.Tensor) -> torch.Tensor:
    """fp32 values ``[..., 512]`` of FP8 records ``uint8 [..., 584]`` (rules in the module docstring)."""
    _check(records, "records", torch.uint8, FP8_RECORD_BYTES)
    codes = records[..., :FP8_ROPE_OFFSET].unflatten(-1, (FP8_NUM_BLOCKS, FP8_BLOCK))
    scale_bytes = records[..., FP8_SCALE_OFFSET : FP8_SCALE_OFFSET + FP8_NUM_BLOCKS]
    scales = torch.ldexp(torch.ones_like(scale_bytes, dtype=torch.float64), scale_bytes.double() - UE8M0_BIAS)
    scales = torch.where(scale_bytes == UE8M0_NAN, torch.nan, scales)
    nope = (e4m3_signed_value(codes).double() * scales[..., None]).float()  # exact product, one rounding
    rope = records[..., FP8_ROPE_OFFSET:FP8_SCALE_OFFSET].contiguous().view(torch.bfloat16).float()
    return canonicalize_nan(torch.cat((nope.flatten(-2), rope), dim=-1))
