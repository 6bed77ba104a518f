"""docs/format.md section 4 numerics of ``nvfp4_mla.reference``, checked against independent derivations.

The reference defines the correct bytes for the kernels, so here it is held to things that do not
share its code: exact rational arithmetic (``fractions.Fraction``), tables built from the format
definitions, torch's own float8_e4m3fn conversion, a straightforward numpy quantizer, and bytes
written out by hand. Random inputs are fresh every run (the ``seed`` fixture prints the seed).
"""

from __future__ import annotations

import math
import random
import struct
from fractions import Fraction

import numpy as np
import torch

from nvfp4_mla import abi, reference
from nvfp4_mla.testing import e4m3_byte, make_cache, rope_table

INF = math.inf
NAN = math.nan

# ------------------------------------------------------------------ exact helpers (independent)


def round_binary(q: Fraction, frac_bits: int, emin: int, emax: int, zero_sign: float = 1.0) -> float:
    """Correct round-to-nearest-even of the exact rational ``q`` to a binary format with
    ``frac_bits`` stored fraction bits, normal exponents ``emin..emax`` (subnormals below), and
    overflow to infinity. A zero result takes the sign of ``q`` (or ``zero_sign`` for q == 0)."""
    if q == 0:
        return math.copysign(0.0, zero_sign)
    sign = -1.0 if q < 0 else 1.0
    a = abs(q)
    e = a.numerator.bit_length() - a.denominator.bit_length()
    if a < Fraction(2) ** e:
        e -= 1
    assert Fraction(2) ** e <= a < Fraction(2) ** (e + 1)
    quantum = Fraction(2) ** (max(e, emin) - frac_bits)
    n = a / quantum
    whole = n.numerator // n.denominator
    rest = n - whole
    if rest > Fraction(1, 2) or (rest == Fraction(1, 2) and whole % 2 == 1):
        whole += 1
    r = whole * quantum
    if r >= Fraction(2) ** (emax + 1):
        return sign * INF
    if r == 0:
        return math.copysign(0.0, sign)
    return sign * float(r)  # r is exactly representable in a double


def round_fp32(q: Fraction, zero_sign: float = 1.0) -> float:
    return round_binary(q, 23, -126, 127, zero_sign)


def round_bf16(x: float) -> float:
    """bf16 of an fp32 value (finite, infinite or signed zero; no NaN here)."""
    if math.isinf(x) or x == 0:
        return x
    return round_binary(Fraction(x), 7, -126, 127)


def exact_mul_f32(a: float, b: float) -> float:
    zero_sign = math.copysign(1.0, a) * math.copysign(1.0, b)
    return round_fp32(Fraction(a) * Fraction(b), zero_sign)


def exact_fma_f32(a: float, b: float, c: float) -> float:
    """IEEE fp32 fma(a, b, c) of finite a, b and a finite or infinite c, round to nearest even."""
    if math.isinf(c):
        return c  # a * b is finite
    prod = Fraction(a) * Fraction(b)
    total = prod + Fraction(c)
    if total == 0:
        prod_sign = math.copysign(1.0, a) * math.copysign(1.0, b)
        # exact zero sum: -0 only when both terms are -0 (or cancel to zero: +0 in round to nearest)
        both_neg_zero = prod == 0 and c == 0 and prod_sign < 0 and math.copysign(1.0, c) < 0
        return -0.0 if both_neg_zero else 0.0
    return round_fp32(total)


def exact_rope_pair(xe: float, xo: float, c: float, s: float) -> tuple[float, float]:
    even = exact_fma_f32(xe, c, -exact_mul_f32(xo, s))
    odd = exact_fma_f32(xe, s, exact_mul_f32(xo, c))
    return round_bf16(even), round_bf16(odd)


def f32_bits(x: float) -> int:
    return struct.unpack("<I", struct.pack("<f", x))[0]


def bits_f32(b: int) -> float:
    return struct.unpack("<f", struct.pack("<I", b))[0]


def f32(values) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float32)


def bf16_bits_of(values) -> list[int]:
    """bf16 bit patterns of Python floats that are bf16-representable."""
    return torch.tensor(values, dtype=torch.float32).to(torch.bfloat16).view(torch.int16).tolist()


# E2M1 and E4M3 value tables straight from the format definitions.
E2M1 = [Fraction(0), Fraction(1, 2), Fraction(1), Fraction(3, 2), Fraction(2), Fraction(3), Fraction(4), Fraction(6)]


E4M3 = [Fraction(e4m3_byte(c)) for c in range(0x7F)]  # codes 0..0x7E, ascending; 0x7E = 448 (exact in a float)


def nearest_even_code(a: Fraction, table: list[Fraction]) -> int:
    """Index of the value of ``table`` nearest to ``a`` (0 <= a <= table[-1]); ties to the even index."""
    best = None
    for i, v in enumerate(table):
        d = abs(a - v)
        if best is None or d < best[0] or (d == best[0] and i % 2 == 0):
            best = (d, i)
    assert best is not None
    return best[1]


def e2m1_expected(y: float) -> int:
    if math.isnan(y):
        return 0x7
    sign = 8 if math.copysign(1.0, y) < 0 else 0
    a = abs(y)
    if a > 6:
        return sign | 7
    return sign | nearest_even_code(Fraction(a), E2M1)


def round_to_table(x: np.ndarray, table: np.ndarray) -> np.ndarray:
    """Vectorized nearest-even index into an ascending table for 0 <= x (saturating at the top).
    Midpoints are exact in float64 for every table here, so the comparisons are exact."""
    x = np.minimum(x.astype(np.float64), table[-1])
    hi = np.clip(np.searchsorted(table, x, side="left"), 1, len(table) - 1)
    lo = hi - 1
    mid = (table[lo] + table[hi]) / 2
    tie_pick = np.where(lo % 2 == 0, lo, hi)
    return np.where(x < mid, lo, np.where(x > mid, hi, tie_pick))


E2M1_NP = np.array([float(v) for v in E2M1])
E4M3_NP = np.array([float(v) for v in E4M3])
R6_NP = np.float32(1.0) / np.float32(6.0)


def np_quantize_nope(nope: torch.Tensor) -> tuple[np.ndarray, np.ndarray]:
    """Straightforward NVFP4 of finite BF16 rows [n, 448]: amax = max |v| over 16 (subnormals
    flushed), scale = e4m3(amax * fp32(1/6)), y = v * fp32(1/d), e2m1. Returns packed, scales."""
    v = nope.float().numpy().reshape(-1, abi.NUM_GROUPS, abi.GROUP_SIZE)
    v = np.where(np.abs(v) < np.float32(2.0**-126), v * np.float32(0), v).astype(np.float32)
    amax = np.abs(v).max(axis=-1)
    sf = (amax * R6_NP).astype(np.float32)
    scale = round_to_table(sf, E4M3_NP)
    d = E4M3_NP[scale].astype(np.float32)
    with np.errstate(divide="ignore", invalid="ignore", over="ignore", under="ignore"):
        inv = np.where(amax != 0, np.float32(1.0) / d, np.float32(0.0)).astype(np.float32)
        y = (v * inv[..., None]).astype(np.float32)
    mag = round_to_table(np.nan_to_num(np.abs(y), nan=0.0, posinf=7.0), E2M1_NP)
    codes = np.where(np.isnan(y), 7, mag | (np.signbit(y).astype(np.int64) << 3)).reshape(len(v), -1)
    packed = (codes[:, 0::2] | (codes[:, 1::2] << 4)).astype(np.uint8)
    return packed, scale.astype(np.uint8)


def test_independent_helpers_are_sane():
    """The test's own tools against a few known values, so a broken helper cannot hide a bug."""
    assert f32_bits(float(R6_NP)) == 0x3E2AAAAB == f32_bits(reference.R6)
    assert round_fp32(Fraction(1) + Fraction(1, 2**24)) == 1.0  # tie to even
    assert round_fp32(Fraction(1) + Fraction(3, 2**24)) == 1.0 + 2.0**-22  # tie to even (up)
    assert round_fp32(Fraction(1, 2**150)) == 0.0  # half the smallest subnormal: tie to 0
    assert round_fp32(Fraction(3, 2**151)) == 2.0**-149
    assert round_fp32(Fraction(-1, 2**200)) == 0.0 and math.copysign(1, round_fp32(Fraction(-1, 2**200))) < 0
    assert round_fp32(Fraction(2) ** 128) == INF
    assert round_fp32(Fraction(2) ** 128 - Fraction(2) ** 103) == INF  # halfway past max rounds to inf
    assert round_fp32(Fraction(2) ** 128 - Fraction(2) ** 103 - 1) == bits_f32(0x7F7FFFFF)
    assert round_bf16(1.0 + 2.0**-8) == 1.0 and round_bf16(1.0 + 3 * 2.0**-8) == 1.0 + 2.0**-6
    assert E4M3[0x38] == 1 and E4M3[0x7E] == 448 and E4M3[1] == Fraction(1, 512) and E4M3[8] == Fraction(1, 64)
    assert round_to_table(np.array([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 7.0]), E2M1_NP).tolist() == [
        0,
        2,
        2,
        4,
        4,
        6,
        6,
        7,
    ]


# ------------------------------------------------------------------ known answers


def test_known_answer_row():
    row = torch.zeros(1, abi.HEAD_DIM)
    row[0, :16] = f32([0, -0.0, 0.5, -0.5, 1, -1, 1.5, -1.5, 2, -2, 3, -3, 4, -4, 6, -6])
    data, scales = reference.quantize_rows(row.to(torch.bfloat16))
    assert data.shape == (1, abi.DATA_BYTES) and scales.shape == (1, abi.SCALE_BYTES)
    assert data.dtype == torch.uint8 and scales.dtype == torch.uint8
    assert data[0, :8].tolist() == [0x80, 0x91, 0xA2, 0xB3, 0xC4, 0xD5, 0xE6, 0xF7]
    assert scales[0, 0].item() == 0x38
    assert data[0, 8:224].tolist() == [0] * 216  # all-zero groups: codes 0
    assert scales[0, 1:].tolist() == [0] * 31  # scale 0, and the 4 pad bytes
    assert data[0, 224:].tolist() == [0] * 128  # RoPE dims as BF16 bits


# ------------------------------------------------------------------ E2M1


E2M1_EXACT = [(0.0, 0), (0.5, 1), (1.0, 2), (1.5, 3), (2.0, 4), (3.0, 5), (4.0, 6), (6.0, 7)]
# boundary, code at the tie, code just below, code just above
E2M1_BOUNDS = [
    (0.25, 0, 0, 1),
    (0.75, 2, 1, 2),
    (1.25, 2, 2, 3),
    (1.75, 4, 3, 4),
    (2.5, 4, 4, 5),
    (3.5, 6, 5, 6),
    (5.0, 6, 6, 7),
]


def _e2m1(values) -> list[int]:
    return reference.e2m1_code(f32(values)).tolist()


def test_e2m1_exact_values_and_ties():
    values = [v for v, _ in E2M1_EXACT] + [b for b, *_ in E2M1_BOUNDS]
    codes = [c for _, c in E2M1_EXACT] + [t for _, t, _, _ in E2M1_BOUNDS]
    assert _e2m1(values) == codes
    assert _e2m1([-v for v in values]) == [c | 8 for c in codes]


def test_e2m1_boundary_neighbours():
    b = f32([b for b, *_ in E2M1_BOUNDS])
    up = torch.nextafter(b, f32(INF))
    down = torch.nextafter(b, f32(0.0))
    assert reference.e2m1_code(down).tolist() == [lo for *_, lo, _ in E2M1_BOUNDS]
    assert reference.e2m1_code(up).tolist() == [hi for *_, hi in E2M1_BOUNDS]
    assert reference.e2m1_code(-down).tolist() == [lo | 8 for *_, lo, _ in E2M1_BOUNDS]
    assert reference.e2m1_code(-up).tolist() == [hi | 8 for *_, hi in E2M1_BOUNDS]


def test_e2m1_signed_zero_saturation_nan():
    assert _e2m1([0.0, -0.0, 1e-30, -1e-30, 2.0**-149, -(2.0**-149), 0.1, -0.25]) == [0, 8, 0, 8, 0, 8, 0, 8]
    top = bits_f32(f32_bits(6.0) + 1)
    assert _e2m1([6.0, top, 7.0, 1e30, 3.4e38, INF, -top, -1e30, -INF]) == [7] * 6 + [0xF] * 3
    nan_bits = [0xFFC00000, 0xFF800001, 0x7FC00000, 0x7F800001]
    neg_nan = torch.tensor([b - 2**32 if b >= 2**31 else b for b in nan_bits], dtype=torch.int32).view(torch.float32)
    assert torch.isnan(neg_nan).all() and torch.signbit(neg_nan[:2]).all()
    assert reference.e2m1_code(neg_nan).tolist() == [7, 7, 7, 7]
    assert reference.e2m1_code(f32([NAN, -NAN])).tolist() == [7, 7]


def test_e2m1_random_against_fraction(seed):
    g = torch.Generator().manual_seed(seed)
    parts = [
        (torch.rand(6000, generator=g) * 16 - 8),  # the interesting range
        torch.randn(2000, generator=g) * torch.exp2(torch.randint(-20, 20, (2000,), generator=g).float()),
    ]
    # fp32 values within a few ulps of every boundary and every exact value
    anchors = f32([b for b, *_ in E2M1_BOUNDS] + [v for v, _ in E2M1_EXACT])
    anchor_bits = anchors.view(torch.int32).long()
    offsets = torch.randint(-4, 5, (3000,), generator=g)
    picks = anchor_bits[torch.randint(0, len(anchors), (3000,), generator=g)]
    near = (picks + offsets).clamp(min=0).to(torch.int32).view(torch.float32)
    near = near * torch.where(torch.rand(3000, generator=g) < 0.5, -1.0, 1.0)
    parts.append(near)
    y = torch.cat(parts).float()
    got = reference.e2m1_code(y).tolist()
    want = [e2m1_expected(v) for v in y.tolist()]
    assert got == want


# ------------------------------------------------------------------ E4M3


def _torch_e4m3(x: torch.Tensor) -> torch.Tensor:
    return x.clamp(max=448).to(torch.float8_e4m3fn).view(torch.uint8)


def test_e4m3_dense_sweep_against_torch(seed):
    g = torch.Generator().manual_seed(seed)
    values = torch.tensor([float(v) for v in E4M3], dtype=torch.float32)
    mids = ((values[1:].double() + values[:-1].double()) / 2).float()
    assert torch.equal(mids.double(), (values[1:].double() + values[:-1].double()) / 2)  # exact
    special = torch.cat((values, mids))
    sweep = [
        special,
        torch.nextafter(special, f32(INF)),
        torch.nextafter(special, f32(0.0)),
        torch.linspace(0, 480, 400_001),
        torch.exp2(torch.empty(300_000).uniform_(-30, 9.5, generator=g)),
        torch.linspace(2.0**-10, 2.0**-6, 100_001),  # subnormal range of E4M3
        torch.rand(100_000, generator=g) * 2.0**-6,
        f32([0.0, 2.0**-149, 2.0**-126, 1e-30]),
    ]
    x = torch.cat(sweep).float()
    got = reference.e4m3_code(x)
    assert got.dtype == torch.uint8
    want = _torch_e4m3(x)
    bad = (got != want).nonzero()
    assert bad.numel() == 0, f"first mismatch at x={x[bad[0]].item()!r}: {got[bad[0]].item()} vs {want[bad[0]].item()}"


def test_e4m3_midpoints_by_fraction():
    """Every midpoint rounds to the even code, independently of torch."""
    for c in range(0x7E):
        mid = (E4M3[c] + E4M3[c + 1]) / 2
        even = c if c % 2 == 0 else c + 1
        assert reference.e4m3_code(f32([float(mid)])).item() == even, hex(c)


def test_e4m3_saturation_nan_underflow():
    x = f32([448.0, 449.0, 464.0, 465.0, 1e30, 3.4e38, INF, NAN, 0.0, 2.0**-10, 1.0, 432.0])
    assert reference.e4m3_code(x).tolist() == [0x7E, 0x7E, 0x7E, 0x7E, 0x7E, 0x7E, 0x7E, 0x7F, 0, 0, 0x38, 0x7E]
    tiny = f32([2.0**-12, 2.0**-11, 2.0**-10])
    assert reference.e4m3_code(tiny).tolist() == [0, 0, 0]
    above = torch.nextafter(f32([2.0**-10]), f32(1.0))
    below = torch.nextafter(f32([2.0**-10]), f32(0.0))
    assert reference.e4m3_code(above).tolist() == [1] and reference.e4m3_code(below).tolist() == [0]
    # ties in the subnormal range: 3*2^-10 between codes 1 and 2 -> 2, 5*2^-10 between 2 and 3 -> 2
    assert reference.e4m3_code(f32([3 * 2.0**-10, 5 * 2.0**-10, 7 * 2.0**-10, 15 * 2.0**-10])).tolist() == [2, 2, 4, 8]


def test_e4m3_value_round_trip():
    codes = torch.arange(0x80, dtype=torch.uint8)
    values = reference.e4m3_value(codes)
    assert values.dtype == torch.float32
    assert torch.isnan(values[0x7F])
    for c in range(0x7F):
        assert Fraction(values[c].item()) == E4M3[c], hex(c)
    assert torch.equal(values[:0x7F], codes[:0x7F].view(torch.float8_e4m3fn).float())
    assert torch.equal(reference.e4m3_code(values[:0x7F]), codes[:0x7F])


# ------------------------------------------------------------------ RoPE and fma


def _random_f32(g: torch.Generator, n: int, lo: int, hi: int) -> torch.Tensor:
    """Signed fp32 with a uniform random exponent in [lo, hi) and random mantissa."""
    mant = torch.rand(n, generator=g, dtype=torch.float64) + 1.0
    exp = torch.randint(lo, hi, (n,), generator=g).double()
    sign = torch.where(torch.rand(n, generator=g) < 0.5, -1.0, 1.0).double()
    return (sign * mant * torch.exp2(exp)).float()


def _random_bf16(g: torch.Generator, n: int) -> torch.Tensor:
    """BF16 values: moderate, wide-range, subnormal and zero, all finite."""
    k = n // 4
    moderate = (torch.randn(k, generator=g) * 4).to(torch.bfloat16)
    bits = torch.randint(-(2**15), 2**15, (k,), generator=g).to(torch.int16)
    wide = bits.view(torch.bfloat16)
    wide = torch.where(torch.isfinite(wide), wide, torch.ones_like(wide))
    sub_bits = torch.randint(1, 128, (k,), generator=g) - torch.where(torch.rand(k, generator=g) < 0.5, 0x8000, 0)
    subnormal = sub_bits.to(torch.int16).view(torch.bfloat16)  # -0x8000 + m: the sign bit set
    rest = _random_f32(g, n - 3 * k, -30, 30).to(torch.bfloat16)
    x = torch.cat((moderate, wide, subnormal, rest))
    x[:4] = torch.tensor([0.0, -0.0, 0.0, -0.0], dtype=torch.bfloat16)
    return x[torch.randperm(n, generator=g)]


def _check_rope(xe: torch.Tensor, xo: torch.Tensor, c: torch.Tensor, s: torch.Tensor) -> None:
    x = torch.stack((xe, xo), dim=-1).flatten(-2).view(-1, 64)
    out = reference.rope(x, c.view(-1, 32), s.view(-1, 32)).view(-1, 2)
    assert out.dtype == torch.bfloat16
    got = out.view(torch.int16).tolist()
    for i, (a, b, cc, ss) in enumerate(zip(xe.float().tolist(), xo.float().tolist(), c.tolist(), s.tolist())):
        even, odd = exact_rope_pair(a, b, cc, ss)
        want = bf16_bits_of([even, odd])
        assert got[i] == want, f"pair {i}: x=({a!r}, {b!r}) c={cc!r} s={ss!r}: got {got[i]} want {want}"


def test_rope_random_against_exact(seed):
    g = torch.Generator().manual_seed(seed)
    n = 64 * 48
    xe, xo = _random_bf16(g, n), _random_bf16(g, n)
    k = n // 4
    table = rope_table(4096)
    real = table[torch.randint(0, 4096, (k,), generator=g)]
    cols = torch.randint(0, 32, (k,), generator=g)
    real_c, real_s = real[torch.arange(k), cols], real[torch.arange(k), 32 + cols]
    c = torch.cat(
        (real_c, _random_f32(g, k, -3, 3), _random_f32(g, k, -149, 128), _random_f32(g, n - 3 * k, -140, -100))
    )
    s = torch.cat(
        (real_s, _random_f32(g, k, -3, 3), _random_f32(g, k, -149, 128), _random_f32(g, n - 3 * k, -140, -100))
    )
    perm = torch.randperm(n, generator=g)
    _check_rope(xe, xo, c[perm], s[perm])


def _fma_cases() -> list[tuple[float, float, float]]:
    """(a, b, c) with a*b an exact fp32 midpoint and c a tiny nudge below fp64 resolution."""
    cases = []
    for scale in (0, -20, 40, -120, -135):
        k = 2.0**scale
        # far below fp64 resolution for normal results; for subnormal results (scale -120, -135)
        # the smallest fp32 is the least nudge there is, and then the fp64 sum is exact anyway
        tiny = [k * 2.0**-80, k * 2.0**-70] if scale > -100 else [2.0**-149, 2.0**-148]
        # (1 + 2^-12)^2 = 1 + 2^-11 + 2^-24: midpoint, the lower neighbour is even
        cases += [(1 + 2.0**-12, (1 + 2.0**-12) * k, t * tiny[0]) for t in (1, -1)]
        # 1.5 * (1 + m 2^-23) = 1.5 + 1.5 m 2^-23: a midpoint for odd m; lower neighbour odd for
        # m = 1, 5 (so a plain sum rounds up) and even for m = 3, 7 (a plain sum rounds down).
        # In the subnormal range: 1.5 * (2^13 + m) 2^-149, a midpoint of the subnormal grid.
        for m in (1, 3, 5, 7):
            b = (1 + m * 2.0**-23) * k if scale > -126 else (2**13 + m) * 2.0**-149
            cases += [(1.5, b, t * tiny[1]) for t in (1, -1)]
    return cases


def test_fma_f32_midpoints_against_exact():
    cases = _fma_cases()
    a, b, c = (f32([case[i] for case in cases]) for i in range(3))
    assert [float(v) for v in a.tolist()] == [case[0] for case in cases]  # inputs are fp32-exact
    assert b.tolist() == [case[1] for case in cases] and c.tolist() == [case[2] for case in cases]
    got = reference.fma_f32(a, b, c)
    assert got.dtype == torch.float32
    want = [exact_fma_f32(*case) for case in cases]
    assert [f32_bits(v) for v in got.tolist()] == [f32_bits(v) for v in want]
    naive = (a.double() * b.double() + c.double()).float()
    assert not torch.equal(naive, got), "the crafted cases must catch a plain fp64 sum"
    assert int((naive != got).sum()) == 15  # one of each +-tiny pair, 5 families, 3 normal scales


def test_fma_f32_random_against_exact(seed):
    g = torch.Generator().manual_seed(seed)
    n = 3000
    a = _random_f32(g, n, -75, 75)
    b = _random_f32(g, n, -75, 75)
    # c near a*b in magnitude (cancellation), far below it, or random
    ab = (a.double() * b.double()).float()
    c = torch.cat(
        (-ab[:1000] * (1 + _random_f32(g, 1000, -30, -1).abs()), _random_f32(g, 1000, -149, 128), ab[2000:] * 2.0**-60)
    )
    c = torch.where(torch.isfinite(c), c, torch.ones_like(c))
    got = reference.fma_f32(a, b, c).tolist()
    for i, (x, y, z) in enumerate(zip(a.tolist(), b.tolist(), c.tolist())):
        want = exact_fma_f32(x, y, z)
        assert f32_bits(got[i]) == f32_bits(want), (x, y, z, got[i], want)
    # and exact zero sums / signed zeros
    zs = f32([0.0, -0.0, 1.0, -0.0, 2.0])
    ws = f32([1.0, 1.0, -1.0, 0.0, 3.0])
    cs = f32([-0.0, -0.0, 1.0, -0.0, -6.0])
    got = reference.fma_f32(zs, ws, cs).tolist()
    assert [f32_bits(v) for v in got] == [
        f32_bits(exact_fma_f32(*t)) for t in zip(zs.tolist(), ws.tolist(), cs.tolist())
    ]
    assert [math.copysign(1, v) for v in got] == [1, -1, 1, -1, 1]


def _double_rounding_pairs() -> list[tuple[float, float, float, float]]:
    """(xe, xo, c, s) where one RoPE output's exact value is an fp32 midpoint plus a tiny term and
    the fp32 result sits on a BF16 tie: a plain fp64 sum then rounds the BF16 result the wrong way
    (even u) or the same way (odd u)."""
    pairs = []
    for u in range(128, 256):
        n = (u << 17) | 0x10001  # 25 bits: (u, BF16 midpoint, fp32 midpoint)
        for m in range(3, 256, 2):
            if n % m == 0 and n // m < 2**24:
                q = n // m
                pairs.append((float(m), -1.0, float(q), 2.0**-60))  # even = m*q + 2^-60
                pairs.append((float(m), 1.0, 2.0**-60, float(q)))  # odd = m*q + 2^-60
                pairs.append((-float(m), 1.0, float(q), 2.0**-60))  # even = -(m*q) - 2^-60
                break
    # exact value = fp32 value on a BF16 tie + tiny: fp32 first, then BF16 (tie to even)
    pairs.append((1.0, -1.0, 1 + 2.0**-8, 2.0**-60))
    pairs.append((1.0, 1.0, 1 + 2.0**-8, -(2.0**-60)))
    return pairs


def test_rope_double_rounding_midpoints():
    pairs = _double_rounding_pairs()
    assert len(pairs) > 60
    xe = torch.tensor([p[0] for p in pairs]).to(torch.bfloat16)
    xo = torch.tensor([p[1] for p in pairs]).to(torch.bfloat16)
    c, s = f32([p[2] for p in pairs]), f32([p[3] for p in pairs])
    assert xe.float().tolist() == [p[0] for p in pairs] and c.tolist() == [p[2] for p in pairs]
    pad = (-len(pairs)) % 32
    ext = lambda t, v: torch.cat((t, torch.full((pad,), v, dtype=t.dtype)))  # noqa: E731
    xe, xo, c, s = ext(xe, 1.0), ext(xo, 1.0), ext(c, 1.0), ext(s, 0.0)
    _check_rope(xe, xo, c, s)
    # a plain fp64 evaluation gets some of them wrong: the crafted inputs can fail a wrong reference
    x = torch.stack((xe, xo), dim=-1).flatten(-2).view(-1, 64)
    got = reference.rope(x, c.view(-1, 32), s.view(-1, 32)).view(-1, 2)
    e, o = xe.double(), xo.double()
    naive = torch.stack(((e * c - o * s).float(), (e * s + o * c).float()), -1).to(torch.bfloat16)
    assert (naive.view(torch.int16) != got.view(torch.int16)).sum() >= 30
    # the first crafted pair, spelled out: xe=m, c=q with m*q = (u << 17) | 0x10001, tiny positive
    first = pairs[0]
    n = int(first[0] * first[2])
    u = n >> 17
    assert got[0, 0].float().item() == float((u + 1) << 17)  # even u: a plain sum would give u << 17


# ------------------------------------------------------------------ group rules


def _rows_with_group(group: list[float], g: int = 0, fill: float = 0.0) -> torch.Tensor:
    row = torch.full((1, abi.HEAD_DIM), fill)
    row[0, 16 * g : 16 * g + 16] = f32(group)
    return row.to(torch.bfloat16)


def _group_codes(packed: torch.Tensor, g: int) -> list[int]:
    b = packed[0, 8 * g : 8 * g + 8].tolist()
    return [x for byte in b for x in (byte & 0xF, byte >> 4)]


def test_group_all_zero_and_negative_zero():
    data, scales = reference.quantize_rows(_rows_with_group([0.0] * 16))
    assert data[0, :224].tolist() == [0] * 224 and scales[0].tolist() == [0] * 32
    data, scales = reference.quantize_rows(_rows_with_group([-0.0] * 16, g=5))
    assert _group_codes(data, 5) == [8] * 16 and scales[0, 5].item() == 0
    assert data[0, 40:48].tolist() == [0x88] * 8
    packed, sc = reference.quantize_nope(_rows_with_group([-0.0] * 16, g=5)[:, :448])
    assert torch.equal(packed, data[:, :224]) and torch.equal(sc, scales[:, :28])


def test_group_scale_underflow():
    # amax/6 rounds to E4M3 zero when amax * R6 <= 2^-10, i.e. amax < ~0.00586
    assert reference.e4m3_code(f32([0.005859375 * float(R6_NP)])).item() == 0  # 0.005859375 = 3 * 2^-9
    assert reference.e4m3_code(f32([0.005889892578125 * float(R6_NP)])).item() == 1
    sub = [-(2.0**-130), 2.0**-133]  # subnormal BF16: signed zeros, so NaN too (not -inf)
    group = [0.005, -0.004, 0.0, -0.0, 0.001, -0.001, 2.0**-126, -(2.0**-126)] + sub + [0.0] * 5 + [0.0058]
    data, scales = reference.quantize_rows(_rows_with_group(group))
    assert scales[0, 0].item() == 0x00
    # nonzero elements: v * inf -> +-6; zeros: 0 * inf = NaN -> +6 (0x7)
    assert _group_codes(data, 0) == [0x7, 0xF, 0x7, 0x7, 0x7, 0xF, 0x7, 0xF] + [0x7] * 7 + [0x7]
    assert _sim_group(torch.tensor(group).to(torch.bfloat16).float().tolist()) == (0, _group_codes(data, 0))
    assert data[0, :8].tolist() == [0xF7, 0x77, 0xF7, 0xF7, 0x77, 0x77, 0x77, 0x77]
    # it still dequantizes to zeros
    cache = make_cache(1, 1)
    row = _rows_with_group(group)
    reference.nvfp4_quantize_append_sparse_mla_cache(row, torch.tensor([0]), cache)
    dq = reference.nvfp4_dequantize_sparse_mla_cache(cache)
    assert dq[0, :16].tolist() == [0.0] * 16


def test_group_huge_values_saturate():
    big = 3.3895313892515355e38  # bf16 max
    assert torch.tensor(big).to(torch.bfloat16).float().item() == big
    group = [big, -big, 1e38, 448.0 * 6, 1.0, -(2.0**100)] + [0.0] * 10
    data, scales = reference.quantize_rows(_rows_with_group(group))
    assert scales[0, 0].item() == 0x7E
    # d = 448, inv = fp32(1/448): big values saturate, 2688/448 = 6, 1/448 -> 0, zeros -> 0
    assert _group_codes(data, 0)[:6] == [0x7, 0xF, 0x7, 0x7, 0x0, 0xF]


def test_group_with_inf():
    group = [
        1.0,
        float("inf"),
        2000.0,
        -2000.0,
        100.0,
        -100.0,
        672.0,
        224.0,
        1120.0,
        2240.0,
        -0.0,
        0.0,
        500.0,
        3e3,
        1e-3,
        -50.0,
    ]
    data, scales = reference.quantize_rows(_rows_with_group(group, g=3))
    assert scales[0, 3].item() == 0x7E  # inf * R6 = inf saturates to 448
    # finite elements quantize with d = 448, inv = fp32(1/448) (slightly above 1/448)
    inv = np.float32(1) / np.float32(448)
    vals = torch.tensor(group).to(torch.bfloat16).float().tolist()
    want = [e2m1_expected(float(np.float32(v) * inv)) for v in vals]
    # spot checks by hand: inf -> 7, 672/448 = 1.5 -> 3, 224/448 = 0.5 -> 1, -0 -> 8,
    # 3000/448 > 6 -> 7, -50/448 -> -0 (8); inv = (1 + 3 * 2^-26) / 448, so 1120 * inv = 2.5 + 1.1e-7
    # rounds back to 2.5 in fp32 (half an ulp is 1.19e-7): the tie gives 2.0 (code 4)
    assert [want[i] for i in (1, 6, 7, 8, 10, 11, 13, 15)] == [7, 3, 1, 4, 8, 0, 7, 8]
    assert _group_codes(data, 3) == want


def _sim_group(vals: list[float]) -> tuple[int, list[int]]:
    """Steps 2-7 of docs/format.md section 4 for one group of fp32-representable values, with Python floats
    and numpy fp32 scalars: the two-thread reduction simulated lane by lane."""

    def sel(a, b):
        return a if a > b else b  # a NaN in a loses, a NaN in b wins

    def flushed(v):
        return math.copysign(0.0, v) if (not math.isnan(v) and abs(v) < 2.0**-126) else v

    a = [abs(flushed(v)) for v in vals]
    m = {}
    for h in (0, 1):
        for lane in (0, 1):
            cur = a[8 * h + lane]
            for i in range(1, 4):
                cur = sel(cur, a[8 * h + 2 * i + lane])
            m[h, lane] = cur
    amax = []
    for h in (0, 1):
        lanes = [sel(m[1, ln], m[0, ln]) if h == 0 else sel(m[0, ln], m[1, ln]) for ln in (0, 1)]
        amax.append(sel(lanes[0], lanes[1]))
    codes = []
    scale_codes = []
    for h in (0, 1):
        with np.errstate(all="ignore"):
            sf = float(np.float32(amax[h]) * R6_NP)
            if math.isnan(sf):
                sc = 0x7F
            else:
                sc = nearest_even_code(Fraction(min(sf, 448.0)), E4M3)
            d = NAN if sc == 0x7F else float(E4M3[sc])
            inv = float(np.float32(1.0) / np.float32(d)) if amax[h] != 0 else 0.0
            scale_codes.append(sc)
            for v in vals[8 * h : 8 * h + 8]:
                y = float(np.float32(flushed(v)) * np.float32(inv))
                codes.append(e2m1_expected(flushed(y)))
    return scale_codes[0], codes


def test_group_nan_every_position(seed):
    rng = random.Random(seed)
    for pos in range(16):
        for _ in range(3):
            vals = [
                float(torch.tensor(rng.uniform(-8, 8) * 2.0 ** rng.randint(-3, 3)).to(torch.bfloat16))
                for _ in range(16)
            ]
            vals[pos] = NAN
            g = rng.randrange(28)
            data, scales = reference.quantize_rows(_rows_with_group(vals, g=g, fill=1.0))
            want_scale, want_codes = _sim_group(vals)
            assert scales[0, g].item() == want_scale, (pos, vals)
            assert _group_codes(data, g) == want_codes, (pos, vals)
            # the NaN alone does not disturb the other groups
            other = (g + 1) % 28
            # amax 1: 1/6 -> E4M3 0.171875 (0x23), 1 * fp32(64/11) = 5.8 -> 6
            assert scales[0, other].item() == 0x23 and _group_codes(data, other) == [7] * 16
        # the scale is NaN exactly when the NaN is the last element of half 0's lane y
        vals = [1.0] * 16
        vals[pos] = NAN
        _, scales = reference.quantize_rows(_rows_with_group(vals))
        assert (scales[0, 0].item() == 0x7F) == (pos == 7)


def test_group_nan_hand_written_bytes():
    # NaN at position 0 (lane x, pair 0 of half 0): the lane's reduction drops it; amax = 6.
    vals = [NAN, 6.0] + [1.0] * 14
    data, scales = reference.quantize_rows(_rows_with_group(vals))
    assert scales[0, 0].item() == 0x38
    assert data[0, :8].tolist() == [0x77, 0x22, 0x22, 0x22, 0x22, 0x22, 0x22, 0x22]
    # NaN at position 7 (lane y, pair 3 of half 0): half 0's amax is NaN -> scale 0x7F and every
    # half-0 element NaN -> 0x7; half 1 takes amax over lanes x of both halves and its own lane y
    # = 3 (the 12 at position 1 is lost): d = 0.5, inv = 2.
    vals = [1.0, 12.0, 1.0, 1.0, 1.0, 1.0, 1.0, NAN, 3.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, -2.0]
    data, scales = reference.quantize_rows(_rows_with_group(vals))
    assert scales[0, 0].item() == 0x7F
    assert data[0, :8].tolist() == [0x77, 0x77, 0x77, 0x77, 0x47, 0x44, 0x44, 0xE4]
    # NaN at position 14 (lane x, pair 3 of half 1): half 0 is unaffected (amax 4 -> d = 0.6875),
    # half 1's amax comes from lane y only (0.5 -> d = 11/128, inv = 11.6...)
    vals = [4.0, 0.5, 1.0, 0.5, 1.0, 0.5, 1.0, 0.5, 1.0, 0.5, 1.0, 0.5, 1.0, 0.5, NAN, -0.5]
    data, scales = reference.quantize_rows(_rows_with_group(vals))
    assert scales[0, 0].item() == 0x33
    assert data[0, :8].tolist() == [0x17, 0x13, 0x13, 0x13, 0x77, 0x77, 0x77, 0xF7]
    # and the simulation agrees with the hand-written bytes
    assert _sim_group(vals) == (0x33, [7, 1, 3, 1, 3, 1, 3, 1, 7, 7, 7, 7, 7, 7, 7, 0xF])


def test_group_subnormal_inputs_flushed():
    sub = [2.0**-127, -(2.0**-130), 2.0**-133, -(2.0**-133)] * 4
    row = _rows_with_group(sub, g=2)
    assert all(v != 0 for v in row[0, 32:48].float().tolist())  # really subnormal BF16 values
    data, scales = reference.quantize_rows(row)
    assert scales[0, 2].item() == 0
    assert _group_codes(data, 2) == [0, 8, 0, 8] * 4
    # a subnormal next to a normal value counts as a signed zero
    mixed = [1.0, -(2.0**-130)] + [0.0] * 14
    data, scales = reference.quantize_rows(_rows_with_group(mixed))
    assert scales[0, 0].item() == 0x23 and _group_codes(data, 0)[:3] == [7, 8, 0]
    assert _sim_group(mixed)[1][:3] == _group_codes(data, 0)[:3]


def test_quantize_random_rows_against_numpy(seed):
    g = torch.Generator().manual_seed(seed)
    n = 96
    x = torch.randn(n, abi.NOPE_DIM, generator=g)
    group_exp = torch.randint(-14, 12, (n, abi.NUM_GROUPS), generator=g).float()
    x = x * torch.exp2(group_exp).repeat_interleave(16, -1)
    # sprinkle exact grid values, zeros, negative zeros and subnormals
    x[: n // 4] = (torch.randint(-6, 7, (n // 4, abi.NOPE_DIM), generator=g) * 0.5).float()
    x[n // 4, :16] = -0.0
    x[n // 4, 16:32] = 2.0**-130
    x = x.to(torch.bfloat16)
    packed, scales = reference.quantize_nope(x)
    want_packed, want_scales = np_quantize_nope(x)
    assert np.array_equal(scales.numpy(), want_scales)
    assert np.array_equal(packed.numpy(), want_packed)


# ------------------------------------------------------------------ dequantize round trip


def test_dequantize_round_trip(seed):
    g = torch.Generator().manual_seed(seed)
    n, page_size = 40, 8
    rows = torch.randn(n, abi.HEAD_DIM, generator=g)
    # group magnitudes keep amax / 6 in E4M3's normal range (>= 2^-6), where the bound holds
    rows[:, :448] *= torch.exp2(torch.randint(-2, 8, (n, 28), generator=g).float()).repeat_interleave(16, -1)
    rows[:, :448] += torch.sign(rows[:, :448]) * 0.1
    rows = rows.to(torch.bfloat16)
    cache = make_cache(n // page_size, page_size, "HND")
    slots = torch.randperm(n, generator=g)
    reference.nvfp4_quantize_append_sparse_mla_cache(rows, slots, cache)
    dq = reference.nvfp4_dequantize_sparse_mla_cache(cache, slots)
    assert dq.shape == (n, 512) and dq.dtype == torch.float32
    assert torch.equal(dq[:, 448:], rows[:, 448:].float())  # RoPE dims exact
    x = rows[:, :448].double().view(n, 28, 16)
    amax = x.abs().amax(-1, keepdim=True)
    _, scale_codes = reference.quantize_nope(rows[:, :448])
    d = torch.tensor([[float(E4M3[c]) for c in r] for r in scale_codes.tolist()], dtype=torch.float64)[..., None]
    assert (amax * float(R6_NP) >= 2.0**-6).all()
    t = (x.abs() / d).clamp(max=6.0)
    gap = torch.where(t < 2, 0.5, torch.where(t < 4, 1.0, 2.0))
    err = (x - dq[:, :448].double().view(n, 28, 16)).abs()
    bound = d * gap / 2 * (1 + 2.0**-18)  # slack for inv = fp32(1/d)
    assert (err <= bound).all(), f"max excess {(err - bound).max().item()}"
    # and the codes really are the nearest ones: values at exact grid points come back exactly
    signed = torch.tensor(E2M1_NP.tolist() + (-E2M1_NP).tolist())
    grid = signed[torch.randint(0, 16, (4, 512), generator=g)].to(torch.bfloat16)
    grid = grid.view(4, 32, 16)
    grid[:, :, 0] = 6.0  # every group's amax is 6 -> d = 1, inv = 1
    grid = grid.view(4, 512)
    small = make_cache(1, 4, "NHD")
    reference.nvfp4_quantize_append_sparse_mla_cache(grid, torch.arange(4), small)
    back = reference.nvfp4_dequantize_sparse_mla_cache(small, torch.arange(4))
    assert torch.equal(back, grid.float())


def test_bf16_nan_is_0x7fc0_whatever_the_path():
    """torch gives 0xFFFF for NaN on its vectorized CPU path (and 0x7FFF on CUDA); docs/format.md says 0x7FC0."""
    x = torch.full((4099,), float("nan"))
    x[::2] = -x[::2]
    x[1::3] = torch.nan_to_num(x[1::3], nan=1.0)
    got = reference.to_bf16(x).view(torch.int16)
    assert set(got[torch.isnan(x)].tolist()) == {0x7FC0}
    assert torch.equal(got[~torch.isnan(x)], x[~torch.isnan(x)].to(torch.bfloat16).view(torch.int16))
    rows = torch.full((64, 64), float("nan")).to(torch.bfloat16)
    out = reference.rope(rows, torch.ones(64, 32), torch.zeros(64, 32)).view(torch.int16)
    assert set(out.flatten().tolist()) == {0x7FC0}
