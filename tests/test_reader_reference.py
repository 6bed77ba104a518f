"""The reference reader (nvfp4_mla.reference.nvfp4_dequantize_sparse_mla_cache) against an
independent decoding of the record: every E2M1 code times every scale byte, bitwise in both
dtypes; canonical NaN bits; invalid slots and their fill; slot shapes; ``out=``; validation."""

from __future__ import annotations

import math
import struct
from typing import Any

import pytest
import torch

from nvfp4_mla import abi, reference, validation
from nvfp4_mla.testing import SPECIAL_BITS, e4m3_byte, make_cache, random_rows

read = reference.nvfp4_dequantize_sparse_mla_cache
F32_NAN, BF16_NAN = 0x7FC00000, 0x7FC0
DTYPES = (torch.float32, torch.bfloat16)


# ------------------------------------------------------------------ an independent decoding


def e2m1_nibble(c: int) -> float:
    """E2M1 from its bits: sign, 2 exponent bits (bias 1), 1 mantissa bit."""
    sign = -1.0 if c & 8 else 1.0
    e, m = (c >> 1) & 3, c & 1
    return sign * (m / 2 if e == 0 else (1 + m / 2) * 2.0 ** (e - 1))


def f32_bits(x: float) -> int:
    return F32_NAN if math.isnan(x) else struct.unpack("<I", struct.pack("<f", x))[0]


def bf16_float(bits16: int) -> float:
    return struct.unpack("<f", struct.pack("<I", bits16 << 16))[0]


def expected_row(record: bytes) -> list[float]:
    """The 512 values of one 384-byte record (data row then scale slot) as Python floats."""
    data, scales = record[: abi.DATA_BYTES], record[abi.DATA_BYTES :]
    nope = []
    for i in range(abi.NOPE_DIM):
        code = data[i // 2] >> (4 * (i % 2)) & 0xF
        nope.append(e2m1_nibble(code) * e4m3_byte(scales[i // abi.GROUP_SIZE]))
    rope = [bf16_float(int.from_bytes(data[j : j + 2], "little")) for j in range(abi.NOPE_BYTES, abi.DATA_BYTES, 2)]
    return nope + rope


def record_bytes(cache: torch.Tensor, slot: int) -> bytes:
    data, scales = abi.record_views(cache, validation.check_cache(cache))
    page, entry = divmod(slot, data.shape[1])
    return bytes(data[page, entry].tolist() + scales[page, entry].tolist())


def assert_row_bits(got: torch.Tensor, want: list[float]) -> None:
    """``got`` (fp32 or BF16 ``[512]``) has exactly the bits of ``want`` (NaN canonical)."""
    if got.dtype == torch.float32:
        got_bits = got.view(torch.int32).tolist()
        want_bits = [f32_bits(x) - (1 << 32) * (f32_bits(x) >= 1 << 31) for x in want]
    else:
        got_bits = got.view(torch.int16).tolist()
        want32 = [f32_bits(x) for x in want]
        assert all(b & 0xFFFF == 0 or b == F32_NAN for b in want32), "a value is not exact in BF16"
        want_bits = [(b >> 16) - (1 << 16) * (b >= 1 << 31) for b in want32]
    bad = [i for i, (g, w) in enumerate(zip(got_bits, want_bits)) if g != w]
    assert not bad, (
        f"elements {bad[:8]}: got bits {[got_bits[i] for i in bad[:8]]}, want {[want_bits[i] for i in bad[:8]]}"
    )


def fill_records(cache: torch.Tensor, g: torch.Generator) -> None:
    """Every record of ``cache`` gets: every E2M1 code once per group (shuffled), scale bytes
    running through all 256 values (both NaN codes and negative scales included), RoPE bits that
    include inf and NaN with several payloads."""
    data, scales = abi.record_views(cache, validation.check_cache(cache))
    num_pages, page_size = data.shape[0], data.shape[1]
    n = num_pages * page_size
    codes = torch.argsort(torch.rand(n, abi.NUM_GROUPS, abi.GROUP_SIZE, generator=g), dim=-1).to(torch.uint8)
    codes = codes.reshape(n, abi.NOPE_DIM)
    packed = codes[:, 0::2] | (codes[:, 1::2] << 4)
    start = torch.randint(0, 256, (1,), generator=g)
    scale_bytes = ((torch.arange(n * abi.NUM_GROUPS) + start) % 256).to(torch.uint8).view(n, abi.NUM_GROUPS)
    rope_bits = torch.randint(-(2**15), 2**15, (n, abi.ROPE_DIM), generator=g, dtype=torch.int16)
    special = torch.tensor(SPECIAL_BITS, dtype=torch.int16)
    rope_bits[:, : len(special)] = special
    rope_bits = rope_bits[:, torch.randperm(abi.ROPE_DIM, generator=g)]
    rows = torch.cat((packed, rope_bits.view(torch.uint8)), dim=1).view(num_pages, page_size, abi.DATA_BYTES)
    data.copy_(rows)
    scales[..., : abi.NUM_GROUPS] = scale_bytes.view(num_pages, page_size, abi.NUM_GROUPS)


# ------------------------------------------------------------------ values


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
def test_every_code_times_every_scale_bitwise(seed, dtype):
    g = torch.Generator().manual_seed(seed)
    cache = make_cache(2, 8, "NHD", pad=32)  # 16 records x 28 groups: every scale byte at least once
    fill_records(cache, g)
    slots = torch.randperm(16, generator=g)
    got = read(cache, slots, dtype=dtype)
    assert got.shape == (16, 512) and got.dtype == dtype
    for row, slot in enumerate(slots.tolist()):
        assert_row_bits(got[row], expected_row(record_bytes(cache, slot)))


def test_bf16_and_fp32_agree_exactly(seed):
    g = torch.Generator().manual_seed(seed)
    cache = make_cache(3, 16)
    fill_records(cache, g)
    f32, b16 = read(cache), read(cache, dtype=torch.bfloat16)
    nan = torch.isnan(f32)
    assert torch.equal(nan, torch.isnan(b16))
    assert torch.equal(b16.float()[~nan].view(torch.int32), f32[~nan].view(torch.int32))  # signed zeros too


def test_signed_zero_and_negative_scales():
    cache = make_cache(1, 2)
    data, scales = abi.record_views(cache, validation.check_cache(cache))
    data[0, 0, : abi.NOPE_BYTES] = 0x08  # element 0: code 8 (-0), element 1: code 0 (+0)
    data[0, 0, abi.NOPE_BYTES :] = 0
    scales[0, 0, :4] = torch.tensor([0x38, 0xB8, 0x80, 0x00], dtype=torch.uint8)  # +1, -1, -0, +0
    row = read(cache, torch.tensor([0]))[0]
    signs = torch.signbit(row[:64]).view(4, 16)
    assert signs[0, 0] and not signs[0, 1]  # -0 x +1 = -0, +0 x +1 = +0
    assert not signs[1, 0] and signs[1, 1]  # -0 x -1 = +0, +0 x -1 = -0
    assert not signs[2, 0] and signs[2, 1]  # x -0
    assert signs[3, 0] and not signs[3, 1]  # x +0
    assert (row[:64] == 0).all()


def test_nan_scales_and_nan_rope_are_canonical():
    cache = make_cache(1, 4)
    data, scales = abi.record_views(cache, validation.check_cache(cache))
    data[0, :, : abi.NOPE_BYTES] = torch.randint(0, 256, (4, abi.NOPE_BYTES), dtype=torch.uint8)
    rope = torch.tensor(SPECIAL_BITS, dtype=torch.int16).repeat(11)[: abi.ROPE_DIM].repeat(4, 1)
    data[0, :, abi.NOPE_BYTES :] = rope.view(torch.uint8)
    scales[0, :, : abi.NUM_GROUPS] = torch.tensor([0x7F, 0xFF], dtype=torch.uint8).repeat(14)
    for dtype, nan_bits, int_dtype in ((torch.float32, F32_NAN, torch.int32), (torch.bfloat16, BF16_NAN, torch.int16)):
        got = read(cache, dtype=dtype)
        nope, rope_values = got[:, : abi.NOPE_DIM], got[:, abi.NOPE_DIM :]
        assert (nope.view(int_dtype) == nan_bits).all()
        nan = torch.isnan(rope.view(torch.bfloat16))
        assert (rope_values[nan].view(int_dtype) == nan_bits).all()
        assert torch.equal(rope_values[~nan].float(), rope.view(torch.bfloat16)[~nan].float())  # +-inf kept


def test_written_rows_come_back(seed):
    """Rows on the NVFP4 grid (every group's amax is 6 * 2^k) are stored exactly by the reference
    writer and read back exactly; random rows come back from the same records in any layout."""
    g = torch.Generator().manual_seed(seed)
    n = 24
    signed = torch.tensor([*reference.E2M1_VALUES, *(-v for v in reference.E2M1_VALUES)])
    grid = signed[torch.randint(0, 16, (n, 28, 16), generator=g)]
    grid[:, :, 0] = 6.0 * torch.sign(torch.randn(n, 28, generator=g))
    grid = grid * torch.exp2(torch.randint(-9, 9, (n, 28, 1), generator=g).float())
    rows = torch.cat((grid.view(n, 448), torch.randn(n, 64, generator=g)), 1).to(torch.bfloat16)
    caches = [make_cache(4, 8), make_cache(4, 8, "HND", pad=48), make_cache(5, 8, "NHD", pad=16)]
    slots = torch.randperm(32, generator=g)[:n]
    for cache in caches:
        reference.nvfp4_quantize_append_sparse_mla_cache(rows, slots, cache)
    for dtype in DTYPES:
        got = [read(cache, slots, dtype=dtype) for cache in caches]
        assert torch.equal(got[0], rows.to(dtype))
        for other in got[1:]:
            assert torch.equal(other.view(torch.uint8), got[0].view(torch.uint8))
    others = random_rows((n, 512))
    for cache in caches:
        reference.nvfp4_quantize_append_sparse_mla_cache(others, slots, cache)
    got = [read(cache, slots) for cache in caches]
    assert all(torch.equal(x.view(torch.int32), got[0].view(torch.int32)) for x in got[1:])


# ------------------------------------------------------------------ slots


@pytest.mark.parametrize("slot_dtype", [torch.int32, torch.int64])
def test_slot_shapes_and_none(seed, slot_dtype):
    g = torch.Generator().manual_seed(seed)
    cache = make_cache(3, 8, "HND")
    fill_records(cache, g)
    everything = read(cache)
    assert everything.shape == (24, 512)
    slots = torch.randint(0, 24, (2, 3, 5), generator=g).to(slot_dtype)
    got = read(cache, slots, dtype=torch.bfloat16)
    assert got.shape == (2, 3, 5, 512)
    want = read(cache, slots.reshape(-1).long(), dtype=torch.bfloat16).view(2, 3, 5, 512)
    assert torch.equal(got.view(torch.int16), want.view(torch.int16))
    assert torch.equal(
        read(cache, slots.reshape(-1)).view(torch.int32), everything[slots.reshape(-1).long()].view(torch.int32)
    )
    assert read(cache, torch.tensor(7, dtype=slot_dtype)).shape == (512,)
    assert read(cache, torch.zeros(2, 0, dtype=slot_dtype)).shape == (2, 0, 512)


@pytest.mark.parametrize("slot_dtype", [torch.int32, torch.int64])
def test_invalid_slots_and_fills(seed, slot_dtype):
    g = torch.Generator().manual_seed(seed)
    cache = make_cache(2, 8, pad=16)
    fill_records(cache, g)
    limit = 2**31 if slot_dtype == torch.int32 else 2**63
    slots = torch.tensor([3, -1, 16, 17, -limit, limit - 1, 15, -2], dtype=slot_dtype)
    bad = torch.tensor([False, True, True, True, True, True, False, True])
    good_rows = {dtype: read(cache, slots[~bad], dtype=dtype) for dtype in DTYPES}
    one_plus_tie = 1 + 2.0**-8 + 2.0**-30  # fp32 first: 1 + 2^-8, then a BF16 tie -> 1.0 (not 1 + 2^-7)
    fills = [  # a list: 0.0 and -0.0 are the same dict key
        (float("nan"), (F32_NAN, BF16_NAN)),
        (-float("nan"), (F32_NAN, BF16_NAN)),
        (0.0, (0, 0)),
        (-0.0, (-(2**31), -(2**15))),
        (math.inf, (0x7F800000, 0x7F80)),
        (1e39, (0x7F800000, 0x7F80)),
        (3, (0x40400000, 0x4040)),
        (one_plus_tie, (0x3F808000, 0x3F80)),
    ]
    for fill, (f32_want, bf16_want) in fills:
        for dtype, want, int_dtype in (
            (torch.float32, f32_want, torch.int32),
            (torch.bfloat16, bf16_want, torch.int16),
        ):
            got = read(cache, slots, dtype=dtype, invalid=fill)
            assert (got[bad].view(int_dtype) == want).all(), (fill, dtype)
            assert torch.equal(got[~bad].view(int_dtype), good_rows[dtype].view(int_dtype))


def test_empty_cache_and_default_fill():
    cache = make_cache(0, 4)
    got = read(cache, torch.tensor([0, -1, 3]))
    assert got.shape == (3, 512) and (got.view(torch.int32) == F32_NAN).all()
    assert read(cache).shape == (0, 512)


# ------------------------------------------------------------------ out=


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
def test_out_is_filled_and_returned(seed, dtype):
    g = torch.Generator().manual_seed(seed)
    cache = make_cache(2, 8)
    fill_records(cache, g)
    slots = torch.tensor([[1, -1], [15, 40]])
    out = torch.full((2, 2, 512), 123.0, dtype=dtype)
    got = read(cache, slots, dtype=dtype, invalid=0.0, out=out)
    assert got is out
    assert torch.equal(out.view(torch.uint8), read(cache, slots, dtype=dtype, invalid=0.0).view(torch.uint8))


def test_out_checks():
    cache = make_cache(2, 8)
    slots = torch.tensor([1, 2, 3])
    good: dict[str, Any] = dict(dtype=torch.float32)
    cases = [
        (torch.empty(3, 511), "slots.shape \\+ \\(512,\\)"),
        (torch.empty(4, 512), "slots.shape \\+ \\(512,\\)"),
        (torch.empty(3, 512, dtype=torch.bfloat16), "out must have the dtype"),
        (torch.empty(512, 3).t(), "out must be contiguous"),
        (torch.empty(3, 512, device="meta"), "same CUDA device"),
        (torch.empty(3, 512, requires_grad=True), "requires grad"),
        ([[0.0] * 512] * 3, "out must be a torch.Tensor"),
    ]
    for out, message in cases:
        with pytest.raises(ValueError, match=message):
            read(cache, slots, out=out, **good)  # type: ignore[arg-type]  # one out is a list
    storage = torch.zeros(2 * 8 * 384 + 3 * 2048, dtype=torch.uint8)
    shared = storage[: 2 * 8 * 384].view(2, 8, 384)
    overlapping = storage[2048 : 2048 + 3 * 2048].view(torch.float32).view(3, 512)
    with pytest.raises(ValueError, match="cache overlaps out"):
        read(shared, slots, out=overlapping)
    flat = torch.zeros(2 + 3 * 256, dtype=torch.int64)  # out starts 16 bytes in, inside the slots
    with pytest.raises(ValueError, match="slots overlaps out"):
        read(cache, flat[:3], out=flat[2:].view(torch.float32).view(3, 512))


# ------------------------------------------------------------------ validation


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (dict(dtype=torch.float16), "dtype must be torch.float32 or torch.bfloat16"),
        (dict(dtype=torch.float64), "dtype must be torch.float32 or torch.bfloat16"),
        (dict(dtype="float32"), "dtype must be torch.float32 or torch.bfloat16"),
        (dict(invalid=None), "invalid must be a Python float"),
        (dict(invalid=True), "invalid must be a Python float"),
        (dict(invalid=torch.tensor(0.0)), "invalid must be a Python float"),
        (dict(slots=torch.tensor([1.0])), "slots must have dtype torch.int32 or torch.int64"),
        (dict(slots=torch.arange(8).view(2, 4).t()), "slots must be contiguous"),
        (dict(slots=torch.arange(4, device="meta")), "same CUDA device"),
        (dict(slots=[1, 2]), "slots must be a torch.Tensor"),
    ],
)
def test_argument_checks(kwargs, message):
    cache = make_cache(2, 8)
    slots = kwargs.pop("slots", torch.tensor([1]))
    with pytest.raises(ValueError, match=message):
        read(cache, slots, **kwargs)


def test_cache_checks():
    with pytest.raises(ValueError, match="cache must have dtype torch"):
        read(torch.zeros(2, 8, 384, dtype=torch.int8))
    with pytest.raises(ValueError, match="16-byte aligned"):
        read(torch.zeros(2 * 8 * 384 + 1, dtype=torch.uint8)[1:].view(2, 8, 384))


# ------------------------------------------------------------------ CUDA tensors


@pytest.mark.gpu
def test_same_bits_on_cuda(seed):
    """The reference on CUDA tensors gives the CPU's bits, canonical NaN included."""
    g = torch.Generator().manual_seed(seed)
    cache = make_cache(3, 16, "HND", pad=16)
    fill_records(cache, g)
    slots = torch.tensor([[5, -1, 47], [48, 0, 12]])
    gpu_cache = make_cache(3, 16, "HND", pad=16, device="cuda")
    gpu_cache.copy_(cache)
    for dtype in DTYPES:
        for fill in (float("nan"), 0.0, -0.0):
            cpu = read(cache, slots, dtype=dtype, invalid=fill)
            gpu = read(gpu_cache, slots.cuda(), dtype=dtype, invalid=fill)
            assert gpu.is_cuda
            assert torch.equal(gpu.cpu().view(torch.uint8), cpu.view(torch.uint8))
