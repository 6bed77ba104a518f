"""The numerics of the record, step by step (docs/format.md section 4): scalar formats, RoPE, NVFP4.

Vectorized pure torch on any device. fp32 operations that torch cannot express with one rounding
(the fused multiply-add of RoPE) are emulated exactly in fp64.
"""

from __future__ import annotations

import torch

from .. import abi

__all__ = [
    "E2M1_VALUES",
    "R6",
    "bf16_nan",
    "e2m1_code",
    "e2m1_value",
    "e4m3_code",
    "e4m3_value",
    "flush_subnormal",
    "fma_f32",
    "group_amax",
    "mul_f32",
    "quantize_nope",
    "quantize_rows",
    "rope",
    "rope_table",
    "to_bf16",
]

_F32_MIN_NORMAL = 2.0**-126
R6 = torch.tensor(1.0 / 6.0, dtype=torch.float32).item()  # the fp32 nearest 1/6, 0x3E2AAAAB

# E2M1 magnitudes by code, and the rounding boundaries between neighbouring codes: a magnitude
# at a boundary rounds to the even code (0.25 -> 0, 0.75 -> 1, 1.25 -> 1, 1.75 -> 2, 2.5 -> 2,
# 3.5 -> 4, 5 -> 4); "inclusive" marks the boundaries that already belong to the upper code.
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
_E2M1_BOUNDS = ((0.25, False), (0.75, True), (1.25, False), (1.75, True), (2.5, False), (3.5, True), (5.0, False))


# ---------------------------------------------------------------- scalar formats


def to_bf16(x: torch.Tensor) -> torch.Tensor:
    """bf16(x) of fp32 ``x``: round to nearest even, NaN -> 0x7FC0.

    torch's own conversion rounds the same way but its NaN bits depend on the device and code
    path (0x7FC0 scalar, 0xFFFF vectorized on the CPU, 0x7FFF on CUDA), so NaN is set here.
    """
    return torch.where(torch.isnan(x), bf16_nan(x.device), x.to(torch.bfloat16))


def bf16_nan(device: torch.device) -> torch.Tensor:
    return torch.tensor(abi.BF16_NAN_BITS, dtype=torch.int16, device=device).view(torch.bfloat16)


def fma_f32(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    """IEEE fp32 ``fma(a, b, c)``: one rounding, subnormals kept.

    ``a * b`` of two fp32 values is exact in fp64 (24 + 24 < 53 bits). The fp64 sum is made
    round-to-odd with its exact error term (TwoSum), so that the final rounding to fp32 is
    correct (53 >= 24 + 2 bits; double rounding through round-to-odd is innocuous).
    """
    p = a.double() * b.double()
    c = c.double()
    s = p + c
    p_part = s - c
    c_part = s - p_part
    err = (p - p_part) + (c - c_part)
    lsb_even = (s.view(torch.int64) & 1) == 0
    to_odd = (err != 0) & lsb_even & torch.isfinite(s)
    s = torch.where(to_odd, torch.nextafter(s, torch.where(err > 0, torch.inf, -torch.inf).double()), s)
    return s.float()


def mul_f32(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """IEEE fp32 product with one rounding (exact in fp64 first), whatever the device's fp32 mode."""
    return (a.double() * b.double()).float()


def flush_subnormal(x: torch.Tensor) -> torch.Tensor:
    """Subnormal fp32 values become zero of the same sign (what ``.ftz`` instructions do)."""
    return torch.where(x.abs() < _F32_MIN_NORMAL, x * 0.0, x)


def e4m3_code(x: torch.Tensor) -> torch.Tensor:
    """E4M3 (fn) code of fp32 ``x >= 0`` (section 4 step 4) as uint8.

    Round to nearest even; anything above 448, including +inf, saturates to 448 (0x7E); NaN gives
    0x7F. Codes 0..7 are the subnormals m * 2^-9; code (e << 3 | m) with e >= 1 is
    (1 + m/8) * 2^(e-7). Code 8 is 2^-6 in both readings, so the subnormal rounding carries over.
    """
    x = x.double().clamp(max=448.0)
    _, exp = torch.frexp(x)  # x = mant * 2^exp, mant in [0.5, 1)
    e = (exp - 1).clamp(min=-6)  # binade of x; the subnormal binade shares e = -6
    mant8 = torch.ldexp(x, 3 - e)  # x / 2^e * 8, exact
    normal = x >= 2.0**-6
    code = torch.round(mant8) + torch.where(normal, (e + 7) * 8 - 8, 0)  # round(): half to even
    code = torch.where(torch.isnan(x), abi.E4M3_NAN_CODE, code)
    return code.to(torch.uint8)


def e4m3_value(code: torch.Tensor) -> torch.Tensor:
    """fp32 value of E4M3 (fn) codes 0..0x7F (0x7F is NaN)."""
    code = code.to(torch.int32)
    e, m = code >> 3, code & 7
    value = torch.where(e == 0, m * 2.0**-9, torch.ldexp((8 + m).double(), e - 10))
    return torch.where(code == abi.E4M3_NAN_CODE, torch.nan, value).float()


def e2m1_code(y: torch.Tensor) -> torch.Tensor:
    """E2M1 code of fp32 ``y`` (section 4 step 7) as uint8: sign bit 8, magnitude code 0..7.

    The sign bit is y's, also when the magnitude rounds to 0; above 6 (inf too) saturates to
    code 7; NaN gives +6 (0x7).
    """
    a = y.abs()
    code = torch.zeros_like(y, dtype=torch.uint8)
    for bound, inclusive in _E2M1_BOUNDS:
        code += (a >= bound) if inclusive else (a > bound)
    code |= torch.signbit(y).to(torch.uint8) << 3
    return torch.where(torch.isnan(y), torch.tensor(7, dtype=torch.uint8, device=y.device), code)


def e2m1_value(code: torch.Tensor) -> torch.Tensor:
    """fp32 value of E2M1 codes 0..15."""
    table = torch.tensor(E2M1_VALUES + tuple(-v for v in E2M1_VALUES), device=code.device)
    return table[code.long()]


# ---------------------------------------------------------------- RoPE and quantization


def rope_table(max_position: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """A RoPE table for ``cos_sin_cache``: fp32 ``[max_position, 64]``, row ``p`` = cos[32] | sin[32]
    of ``p * inv_freq`` with base 10000 (docs/format.md section 2), computed in float64.

    Parameters
    ----------
    max_position
        Rows of the table (positions ``0 .. max_position - 1``).
    device
        Where the table is made (default the CPU).
    """
    inv_freq = 1.0 / 10000.0 ** (torch.arange(0, abi.ROPE_DIM, 2, dtype=torch.float64) / abi.ROPE_DIM)
    angles = torch.arange(max_position, dtype=torch.float64)[:, None] * inv_freq[None, :]
    return torch.cat((angles.cos(), angles.sin()), dim=1).float().to(device)


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """GPT-J RoPE of BF16 ``x[..., 64]`` with fp32 ``cos``/``sin[..., 32]`` broadcastable to pairs.

    even = fma(xe, c, -(xo * s)), odd = fma(xe, s, xo * c), each rounded to BF16.
    """
    xe, xo = x[..., 0::2].float(), x[..., 1::2].float()
    even = fma_f32(xe, cos, -mul_f32(xo, sin))
    odd = fma_f32(xe, sin, mul_f32(xo, cos))
    return to_bf16(torch.stack((even, odd), dim=-1).flatten(-2))


def _sel(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a > b ? a : b``: a NaN in ``a`` loses, a NaN in ``b`` wins."""
    return torch.where(a > b, a, b)


def group_amax(v: torch.Tensor) -> torch.Tensor:
    """Per-half amax of groups ``v[..., 28, 16]`` (fp32), section 4 steps 2-3: ``[..., 28, 2]``.

    Without NaN both halves of a group get max |v|; with NaN the two-threads-per-group reduction
    order of the reference quantizer decides, reproduced here exactly.
    """
    a = flush_subnormal(v).abs()
    a = a.unflatten(-1, (2, 4, 2))  # [half, pair i, lane (x = even element, y = odd)]
    m = a[..., 0, :]
    for i in range(1, 4):
        m = _sel(m, a[..., i, :])
    m0, m1 = m[..., 0, :], m[..., 1, :]  # [..., lane] of each half
    lanes = torch.stack((_sel(m1, m0), _sel(m0, m1)), dim=-2)  # half 0, half 1
    return _sel(lanes[..., 0], lanes[..., 1])


def quantize_nope(nope: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """NVFP4 of BF16 ``nope[..., 448]`` (section 4 steps 1-7).

    Returns the 224 packed E2M1 bytes and the 28 scale bytes of each row, both uint8.
    """
    v = nope.float().unflatten(-1, (abi.NUM_GROUPS, abi.GROUP_SIZE))
    amax = group_amax(v)  # [..., 28, 2]
    code = e4m3_code(mul_f32(amax, torch.tensor(R6)))  # step 4
    inv = torch.where(amax != 0, 1.0 / e4m3_value(code), 0.0)  # step 5, fp32 division
    inv = inv.repeat_interleave(abi.GROUP_SIZE // 2, dim=-1)  # [..., 28, 16]: each half's elements
    y = flush_subnormal(mul_f32(flush_subnormal(v), inv))  # step 6
    codes = e2m1_code(y).flatten(-2)  # step 7
    packed = codes[..., 0::2] | (codes[..., 1::2] << 4)
    return packed, code[..., 0]  # the group's scale is half 0's


def quantize_rows(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Records of BF16 ``rows[n, 512]``: the 352-byte data rows and the 32-byte scale slots."""
    packed, scales = quantize_nope(rows[:, : abi.NOPE_DIM])
    rope_bytes = rows[:, abi.NOPE_DIM :].contiguous().view(torch.uint8)
    data = torch.cat((packed, rope_bytes), dim=1)
    pad = torch.zeros(rows.shape[0], abi.SCALE_BYTES - abi.NUM_GROUPS, dtype=torch.uint8, device=rows.device)
    return data, torch.cat((scales, pad), dim=1)
