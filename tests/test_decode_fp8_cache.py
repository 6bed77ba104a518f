"""The FP8 comparison cache (nvfp4_mla.fp8_cache): layout, the UE8M0 scale rule over every BF16
amax, E4M3 rounding against a brute-force nearest value, round-trip bounds, zeros, inf and NaN."""

from __future__ import annotations

import math

import pytest
import torch

from nvfp4_mla import fp8_cache
from nvfp4_mla.fp8_cache import fp8_dequantize_rows, fp8_quantize_rows, fp8_scale_exponents
from nvfp4_mla.testing import e4m3_byte

F32_NAN = 0x7FC00000
SCALE_AT = fp8_cache.FP8_SCALE_OFFSET


E4M3_GRID = torch.tensor([e4m3_byte(c) for c in range(0x7F)], dtype=torch.float64)  # codes 0..126, 0..448


def nearest_e4m3(y: torch.Tensor) -> torch.Tensor:
    """Brute force: the E4M3 code nearest to |y| (ties to the even code), sign bit from y."""
    dist = (y.double().abs()[..., None] - E4M3_GRID).abs()
    best = dist == dist.min(dim=-1, keepdim=True).values
    codes = torch.arange(0x7F)
    even = torch.where(best & (codes % 2 == 0), codes, 999).min(dim=-1).values
    code = torch.where(even < 999, even, torch.where(best, codes, 999).min(dim=-1).values)
    return code.to(torch.uint8) | (torch.signbit(y).to(torch.uint8) << 7)


def rows_with(values: dict[int, float], n: int = 1) -> torch.Tensor:
    rows = torch.zeros(n, 512, dtype=torch.bfloat16)
    for i, v in values.items():
        rows[:, i] = v
    return rows


# ------------------------------------------------------------------ known answers


def test_known_record():
    row = rows_with({0: 448.0, 1: -448.0, 2: 1.0, 3: 2.0**-9, 4: -0.0, 64: 450.0, 65: 1.0, 128: 0.04, 500: -1.5})
    rec = fp8_quantize_rows(row)[0]
    assert rec.shape == (584,) and rec.dtype == torch.uint8
    # block 0: amax 448 -> scale 2^0 (byte 127): 448 = 0x7E, -448 = 0xFE, 1.0 = 0x38, 2^-9 = 0x01, -0 = 0x80
    assert rec[:5].tolist() == [0x7E, 0xFE, 0x38, 0x01, 0x80]
    # block 1: amax 450 > 448 -> scale 2 (byte 128): 450 / 2 = 225 -> 224 (0x76), 1 / 2 = 0.5 (0x30)
    assert rec[64:66].tolist() == [0x76, 0x30]
    # block 2: amax 0.04 < 448e-4 -> the floor 2^-13 (byte 114): 0.04 * 8192 = 327.68 -> 320 (0x7A)
    assert rec[128] == 0x7A
    assert rec[SCALE_AT:].tolist() == [127, 128, 114, 114, 114, 114, 114, 0]
    assert rec[448:576].view(torch.bfloat16)[52].item() == -1.5  # element 500: RoPE dim 52, stored as is
    back = fp8_dequantize_rows(rec)
    assert back[:5].tolist() == [448.0, -448.0, 1.0, 2.0**-9, 0.0] and torch.signbit(back[4])
    assert back[64:66].tolist() == [448.0, 1.0]
    assert back[128].item() == 320 * 2.0**-13


def test_zero_rows():
    row = torch.zeros(2, 512, dtype=torch.bfloat16)
    row[1] = -0.0
    rec = fp8_quantize_rows(row)
    assert (rec[0, :448] == 0).all() and (rec[1, :448] == 0x80).all()
    assert (rec[:, SCALE_AT : SCALE_AT + 7] == 114).all() and (rec[:, -1] == 0).all()
    back = fp8_dequantize_rows(rec)
    assert (back == 0).all() and torch.equal(torch.signbit(back), torch.signbit(row.float()))


# ------------------------------------------------------------------ the scale rule


def test_scale_exponent_of_every_bf16_amax():
    """For every finite non-negative BF16 amax: the smallest e with 448 * 2^e >= amax, at least -13."""
    bits = torch.arange(0, 0x7F80, dtype=torch.int32).to(torch.int16)
    amax = bits.view(torch.bfloat16)
    nope = torch.zeros(len(amax), 448, dtype=torch.bfloat16)
    nope[:, 64 * 3 + 17] = amax  # block 3
    nope[:, 5] = -amax  # block 0, negative
    e = fp8_scale_exponents(nope)
    assert e.dtype == torch.int32 and e.shape == (len(amax), 7)
    for block in (0, 3):
        eb = e[:, block].double()
        a = amax.double()
        assert (448 * torch.exp2(eb) >= a).all()
        assert ((eb == -13) | (448 * torch.exp2(eb - 1) < a)).all()
        assert (eb >= -13).all() and ((eb == -13) == (a <= 448 * 2.0**-13)).all()
    assert (e[:, [1, 2, 4, 5, 6]] == -13).all()


@pytest.mark.parametrize("k", [-12, -1, 0, 5, 100])
def test_power_of_two_boundaries(k):
    exact, above = 448 * 2.0**k, 448 * 2.0**k * (1 + 2**-7)
    e = fp8_scale_exponents(rows_with({0: exact, 64: above})[:, :448])
    assert e[0, :2].tolist() == [k, k + 1]


# ------------------------------------------------------------------ round trip


def test_round_trip_is_nearest_e4m3(seed):
    g = torch.Generator().manual_seed(seed)
    n = 64
    magnitude = torch.exp2(torch.randint(-30, 30, (n, 7, 1), generator=g).float())
    nope = torch.randn(n, 7, 64, generator=g) * magnitude
    nope[: n // 4] *= torch.rand(n // 4, 7, 64, generator=g) < 0.3  # zeros and sparse blocks
    rope = torch.randn(n, 64, generator=g)
    rows = torch.cat((nope.view(n, 448), rope), 1).to(torch.bfloat16)
    rec = fp8_quantize_rows(rows)
    e = fp8_scale_exponents(rows[:, :448])
    assert torch.equal(rec[:, SCALE_AT : SCALE_AT + 7], (e + 127).to(torch.uint8))
    y = rows[:, :448].float().view(n, 7, 64) / torch.exp2(e.float())[..., None]
    assert torch.equal(rec[:, :448], nearest_e4m3(y).view(n, 448))
    assert torch.equal(rec[:, 448:576].view(torch.int16), rows[:, 448:].view(torch.int16))
    back = fp8_dequantize_rows(rec)
    assert torch.equal(back[:, 448:], rows[:, 448:].float())
    x, scale = rows[:, :448].double(), torch.exp2(e.double()).repeat_interleave(64, 1)
    err = (back[:, :448].double() - x).abs()
    assert (err <= torch.maximum(x.abs() * 2.0**-4, scale * 2.0**-10)).all()  # half an E4M3 step
    assert (x.abs() <= 448 * scale).all()  # no saturation


def test_any_bytes_read_exactly(seed):
    """Every code and scale byte: e4m3(code) * 2^(byte - 127) rounded once to fp32 (overflow: inf)."""
    g = torch.Generator().manual_seed(seed)
    rec = torch.randint(0, 256, (48, 584), generator=g, dtype=torch.uint8)
    rec[:32, :256] = torch.arange(256, dtype=torch.uint8)
    rec[:, SCALE_AT : SCALE_AT + 7] = torch.randperm(48 * 7, generator=g).remainder(256).view(48, 7).to(torch.uint8)
    back = fp8_dequantize_rows(rec)
    want_values = [
        [
            e4m3_byte(int(rec[r, i])) * (math.nan if s == 255 else 2.0 ** (s - 127))
            for i in range(448)
            for s in [int(rec[r, SCALE_AT + i // 64])]
        ]
        for r in range(48)
    ]
    want = torch.tensor(want_values, dtype=torch.float64).float()
    nan = torch.isnan(want)
    assert torch.equal(torch.isnan(back[:, :448]), nan)
    assert torch.equal(back[:, :448][~nan], want[~nan])
    rope = rec[:, 448:576].contiguous().view(torch.bfloat16)
    rope_nan = torch.isnan(rope)
    assert torch.equal(back[:, 448:][~rope_nan], rope[~rope_nan].float())
    assert (back[torch.isnan(back)].view(torch.int32) == F32_NAN).all()


def test_bf16_maximum_reads_as_inf():
    """amax at the BF16 maximum: scale 2^120, 255 rounds to E4M3 256, and 2^128 is beyond fp32."""
    big = float.fromhex("0x1.fep127")
    rec = fp8_quantize_rows(rows_with({0: big, 1: -big / 2}))[0]
    assert rec[SCALE_AT] == 127 + 120 and rec[0] == 0x78
    back = fp8_dequantize_rows(rec)
    assert back[0] == math.inf and back[1] == -(2.0**127)


# ------------------------------------------------------------------ inf and NaN


@pytest.mark.parametrize("bad", [math.inf, -math.inf, math.nan])
def test_non_finite_value_makes_its_block_nan(bad):
    row = rows_with({70: 3.0, 130: bad, 131: 1.0, 300: -2.0})
    rope_bits = torch.tensor([0x7F81, -1, 0x7F80, 0x3F80], dtype=torch.int16)  # NaN payloads, inf, 1.0
    row[0, 448:452] = rope_bits.view(torch.bfloat16)
    rec = fp8_quantize_rows(row)[0]
    assert rec[SCALE_AT + 2] == 0xFF and (rec[128:192] == 0x7F).all()
    assert torch.equal(rec[448:456].view(torch.int16), rope_bits)  # RoPE bits stored as they are
    back = fp8_dequantize_rows(rec)
    assert (back[128:192].view(torch.int32) == F32_NAN).all()
    assert back[70] == 3.0 and back[300] == -2.0 and torch.isfinite(back[:128]).all()
    assert back[448:452].view(torch.int32).tolist() == [F32_NAN, F32_NAN, 0x7F800000, 0x3F800000]


# ------------------------------------------------------------------ shapes and checks


def test_leading_shapes():
    rows = torch.randn(2, 3, 512).to(torch.bfloat16)
    rec = fp8_quantize_rows(rows)
    assert rec.shape == (2, 3, 584)
    assert torch.equal(fp8_dequantize_rows(rec), fp8_dequantize_rows(rec.view(6, 584)).view(2, 3, 512))


@pytest.mark.parametrize(
    ("call", "arg", "message"),
    [
        (fp8_quantize_rows, torch.zeros(2, 512), "rows must be a torch.bfloat16 tensor"),
        (fp8_quantize_rows, torch.zeros(2, 448, dtype=torch.bfloat16), "rows must be a torch.bfloat16 tensor"),
        (fp8_quantize_rows, [0.0] * 512, "rows must be a torch.bfloat16 tensor"),
        (fp8_dequantize_rows, torch.zeros(2, 584, dtype=torch.int8), "records must be a torch.uint8 tensor"),
        (fp8_dequantize_rows, torch.zeros(2, 384, dtype=torch.uint8), "records must be a torch.uint8 tensor"),
    ],
)
def test_argument_checks(call, arg, message):
    with pytest.raises(ValueError, match=message):
        call(arg)
