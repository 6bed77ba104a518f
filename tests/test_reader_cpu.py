"""The reader's CPU-side pieces (no GPU needed): the spec and fill-pattern logic, validation on the
kernel path, CPU tensors going to the reference, and the torch custom ops (fake shapes,
torch.compile). Its kernels compile in tests/test_ops_compile.py."""

from __future__ import annotations

import math

import pytest
import torch

import nvfp4_mla
from nvfp4_mla import abi, reference
from nvfp4_mla.ops import reader
from nvfp4_mla.ops.reader import ReaderSpec
from nvfp4_mla.testing import make_cache, raw_bytes

DTYPES = (torch.float32, torch.bfloat16)
SLOT_DTYPES = (torch.int32, torch.int64, None)  # None: slots=None
read = nvfp4_mla.nvfp4_dequantize_sparse_mla_cache


def random_byte_cache(num_pages: int, page_size: int, layout: str = "3D", pad: int = 0) -> torch.Tensor:
    cache = make_cache(num_pages, page_size, layout, pad)
    storage = raw_bytes(cache)
    storage.copy_(torch.randint(0, 256, storage.shape, dtype=torch.uint8))
    return cache


# ---------------------------------------------------------------- the spec of a call


def test_spec_of_a_call():
    """One memoized object per call geometry; the defines say what the call needs."""
    v = ReaderSpec.of(16, torch.int32, torch.bfloat16)
    assert ReaderSpec.of(16, torch.int32, torch.bfloat16) is v
    assert v.defines() == dict(PAGE_SIZE=16, SLOT_INT64=0, IDENTITY_SLOTS=0, OUT_FP32=0, ROWS_PER_TEAM=2)
    assert ReaderSpec.of(3, None, torch.float32).defines() | {"PAGE_SIZE": 16} == dict(
        PAGE_SIZE=16, SLOT_INT64=0, IDENTITY_SLOTS=1, OUT_FP32=1, ROWS_PER_TEAM=2
    )
    assert ReaderSpec.of(3, torch.int64, torch.float32).slot_int64
    assert v.describe() == "reader, page 16, int32 slots -> bfloat16"
    assert v.rows_per_block == reader.BLOCK_THREADS // reader.TEAM_THREADS * v.rows_per_team


# ---------------------------------------------------------------- the fill of invalid rows

FILLS = [
    math.nan,
    -math.nan,
    0.0,
    -0.0,
    1.0,
    -2.5,
    7,
    1e-40,  # fp32 subnormal
    1e-46,  # rounds to fp32 zero
    2.0**-149 * 1.5,  # fp32 tie between subnormals
    1.00390625,  # BF16 tie, rounds down (even)
    1.01171875,  # BF16 tie, rounds up (even)
    1 + 2.0**-24,  # fp32 tie, rounds to 1.0
    3.4e38,  # BF16 overflows to inf
    3.4028235677973366e38,  # fp32 maximum, rounds up in BF16
    3.4028235677973366e38 * (1 + 2.0**-25),  # rounds to the fp32 maximum
    1e300,  # fp32 overflows to inf
    -1e300,
    math.inf,
    -math.inf,
]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_fill_pattern_is_the_references_fill(dtype):
    """The kernel's fill word equals the bits of the reference's invalid rows, both dtypes, for
    NaN, zeros, subnormals, ties at both roundings, and overflows."""
    cache = make_cache(1, 2)
    int_dtype = torch.int32 if dtype == torch.float32 else torch.int16
    for invalid in FILLS:
        row = reference.nvfp4_dequantize_sparse_mla_cache(cache, torch.tensor([-1]), dtype=dtype, invalid=invalid)
        bits = set(row.view(int_dtype).flatten().tolist())
        assert len(bits) == 1, invalid
        want = bits.pop() & (0xFFFFFFFF if dtype == torch.float32 else 0xFFFF)
        if dtype == torch.bfloat16:
            want *= 0x10001
        assert reader.fill_pattern(invalid, dtype == torch.float32) == want, f"invalid={invalid!r} {dtype}"


# ---------------------------------------------------------------- paths and validation


def test_cpu_tensors_use_the_reference(monkeypatch, seed):
    """CPU tensors go to the reference (called with the same arguments), bit for bit."""
    cache = random_byte_cache(3, 16, "NHD", 32)
    slots = torch.randint(-8, 56, (4, 5), dtype=torch.int32)
    calls = []
    original = reference.nvfp4_dequantize_sparse_mla_cache

    def spy(*args, **kwargs):
        calls.append((args, kwargs))
        return original(*args, **kwargs)

    monkeypatch.setattr(reference, "nvfp4_dequantize_sparse_mla_cache", spy)
    got = read(cache, slots, dtype=torch.bfloat16, invalid=0.0)
    assert len(calls) == 1 and calls[0][1] == dict(dtype=torch.bfloat16, invalid=0.0, out=None)
    want = original(cache, slots, dtype=torch.bfloat16, invalid=0.0)
    assert torch.equal(got.view(torch.int16), want.view(torch.int16))
    out = torch.empty(3 * 16, abi.HEAD_DIM)
    assert read(cache, out=out) is out and len(calls) == 2


def test_kernel_path_refuses_cpu_tensors():
    """The kernel path checks like the reference, with need_cuda: CPU tensors are refused there
    (the public entry sends them to the reference instead)."""
    cache = make_cache(2, 16)
    with pytest.raises(ValueError, match="cache must be a CUDA tensor"):
        reader.dequantize(nvfp4_mla.ops.DEFAULT, cache, torch.arange(3), torch.float32, math.nan, None)


BAD_CALLS = [  # (keyword arguments on top of a good call, a phrase of the message)
    (dict(dtype=torch.float16), "dtype must be torch.float32 or torch.bfloat16"),
    (dict(slots=torch.arange(4.0)), "slots must have dtype"),
    (dict(slots=torch.arange(8)[::2]), "slots must be contiguous"),
    (dict(slots=[1, 2]), "slots must be a torch.Tensor"),
    (dict(cache=torch.zeros(2, 16, 383, dtype=torch.uint8)), "cache must be"),
    (dict(cache=torch.zeros(2, 16, 384)), "cache must have dtype torch.uint8"),
    (dict(invalid="nan"), "invalid must be a Python float"),
    (dict(out=torch.empty(4, abi.HEAD_DIM, dtype=torch.bfloat16)), "out must have the dtype"),
    (dict(out=torch.empty(5, abi.HEAD_DIM)), "out must be slots.shape"),
    (dict(out=torch.empty(abi.HEAD_DIM, 4).t()), "out must be contiguous"),
    (dict(out=torch.empty(4, abi.HEAD_DIM, requires_grad=True)), "requires grad"),
]


@pytest.mark.parametrize("change, phrase", BAD_CALLS, ids=[p for _, p in BAD_CALLS])
def test_validation_errors(change, phrase):
    """Bad arguments raise ValueError naming the problem, before anything is read or written."""
    kwargs = {"cache": make_cache(2, 16), "slots": torch.arange(4), **change}
    with pytest.raises(ValueError, match=phrase.replace(".", r"\.")):
        read(**kwargs)


@pytest.mark.parametrize("invalid", [10**400, -(10**400), 2**1024], ids=["10**400", "-10**400", "2**1024"])
def test_invalid_beyond_the_float_range(invalid):
    """An int too large for a float is a ValueError naming ``invalid`` (not float()'s
    OverflowError), on the reference and on the kernel path; the largest ints a float holds pass."""
    cache, slots = make_cache(2, 16), torch.tensor([-1])
    with pytest.raises(ValueError, match=r"invalid must be a Python float .* beyond the float range"):
        read(cache, slots, invalid=invalid)
    with pytest.raises(ValueError, match="invalid must be a Python float"):
        reader.dequantize(nvfp4_mla.ops.DEFAULT, cache, slots, torch.float32, invalid, None)
    finite = 2**1023 if invalid > 0 else -(2**1023)
    assert read(cache, slots, invalid=finite)[0, 0] == math.copysign(math.inf, finite)  # fp32 overflow, like 1e300


@pytest.mark.filterwarnings("ignore:Sparse CSR tensor support is in beta", "ignore:The PyTorch API of nested tensors")
@pytest.mark.parametrize("name", ["cache", "slots", "out"])
@pytest.mark.parametrize("kind", ["sparse_csr", "nested"])
def test_sparse_and_nested_tensors_are_named(name, kind):
    """A sparse or nested tensor is a ValueError naming the argument, not a RuntimeError from
    inside torch (a sparse tensor has no strides, a nested one no shape)."""
    args = {"cache": make_cache(2, 16), "slots": torch.arange(4), "out": torch.empty(4, abi.HEAD_DIM)}
    t = args[name]
    args[name] = t.reshape(len(t), -1).to_sparse_csr() if kind == "sparse_csr" else torch.nested.as_nested_tensor([t])
    with pytest.raises(ValueError, match=f"{name} must be a dense tensor"):
        read(args["cache"], args["slots"], out=args["out"])


# ---------------------------------------------------------------- custom ops


def test_fake_implementations_give_shapes():
    cache = torch.empty(4, 1, 16, abi.RECORD_BYTES, dtype=torch.uint8, device="meta")
    slots = torch.empty(2, 3, dtype=torch.int32, device="meta")
    out = torch.ops.nvfp4_mla.dequantize(cache, slots, torch.bfloat16, 0.0)
    assert (out.shape, out.dtype, out.device.type) == ((2, 3, abi.HEAD_DIM), torch.bfloat16, "meta")
    out = torch.ops.nvfp4_mla.dequantize(cache, None, torch.float32, math.nan)
    assert (out.shape, out.dtype) == ((4 * 16, abi.HEAD_DIM), torch.float32)
    given = torch.empty(2, 3, abi.HEAD_DIM, device="meta")
    assert torch.ops.nvfp4_mla.dequantize_out(cache, slots, torch.float32, 0.0, given) is None


def test_torch_compile_traces_both_ops_on_cpu(seed):
    """fullgraph=True fails on any graph break; the traced ops run the reference on CPU tensors
    and give its bits, with and without out=."""
    torch._dynamo.reset()
    cache = random_byte_cache(3, 16, "HND", 16)
    slots = torch.randint(-4, 52, (5, 7))

    def step(cache, slots, out):
        read(cache, slots, out=out)
        return read(cache, slots, dtype=torch.bfloat16, invalid=0.0)

    outs = [torch.empty(5, 7, abi.HEAD_DIM) for _ in range(2)]
    got = torch.compile(step, fullgraph=True, backend="aot_eager")(cache, slots, outs[0])
    want = step(cache, slots, outs[1])
    assert torch.equal(got.view(torch.int16), want.view(torch.int16))
    assert torch.equal(outs[0].view(torch.int32), outs[1].view(torch.int32))
