"""The GPU reader (``nvfp4_mla.nvfp4_dequantize_sparse_mla_cache`` on CUDA tensors) against the
reference reader, bit for bit (docs/format.md section 8), and its execution contract (section 7).

Every read is compared with ``nvfp4_mla.reference`` run on CPU copies: the output's bytes, so NaN
bits and signs of zero count. Outputs start as garbage (``dirty_allocator``), so an element the
kernel does not write shows. Caches hold random bytes (every byte of the storage, pool padding
included), crafted records (every E2M1 code times every scale byte) or records written by the
writer entries. Inputs are fresh every run (``seed`` fixture).
"""

from __future__ import annotations

import math

import pytest
import torch

import nvfp4_mla
from nvfp4_mla import abi, reference, validation
from nvfp4_mla.testing import (
    ARG_NAMES,
    ENTRIES,
    Case,
    args_of,
    bytes_mismatch,
    clone,
    dirty_allocator,
    element_locator,
    flat_bytes,
    make_cache,
    make_inputs,
    raw_bytes,
    storage_bytes,
)

pytestmark = pytest.mark.gpu
DEVICE = "cuda"
DTYPES = (torch.float32, torch.bfloat16)
PAGE_SIZES = (1, 3, 16, 64, 256)
LAYOUTS = ("3D", "HND", "NHD")
NAN_BITS = {torch.float32: (torch.int32, 0x7FC00000), torch.bfloat16: (torch.int16, abi.BF16_NAN_BITS)}

read = nvfp4_mla.nvfp4_dequantize_sparse_mla_cache


def dtype_id(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


# ---------------------------------------------------------------- inputs and the check


def random_byte_cache(num_pages: int, page_size: int, layout: str = "3D", pad: int = 0) -> torch.Tensor:
    """A cache view on the GPU whose whole storage (pool padding included) is random bytes."""
    cache = make_cache(num_pages, page_size, layout, pad, device=DEVICE)
    storage = raw_bytes(cache)
    storage.copy_(torch.randint(0, 256, storage.shape, dtype=torch.uint8))
    return cache


def random_slots(shape: tuple[int, ...], capacity: int, dtype: torch.dtype) -> torch.Tensor:
    """Slots of ``shape``: mostly valid (repeats allowed), about a quarter invalid (negative, at or
    past the capacity, and the dtype's extremes)."""
    slots = torch.randint(0, max(capacity, 1), shape, dtype=torch.int64)
    info = torch.iinfo(dtype)
    bad = torch.tensor([-1, -2, capacity, capacity + 1, capacity + 4099, info.min, info.max])
    pick = torch.rand(shape) < 0.25
    slots = torch.where(pick, bad[torch.randint(len(bad), shape)], slots)
    return slots.to(dtype).to(DEVICE)


def check_read(cache: torch.Tensor, slots: torch.Tensor | None, label: str, **kwargs) -> torch.Tensor:
    """Reads on the GPU (into a garbage-filled output unless ``out`` is given) and with the
    reference on CPU copies; raises AssertionError unless the shapes, dtypes and bytes agree.
    Returns the GPU output."""
    out = kwargs.get("out")
    ref_kwargs = {**kwargs, "out": None if out is None else torch.empty_like(out, device="cpu")}
    want = reference.nvfp4_dequantize_sparse_mla_cache(
        clone(cache, "cpu"), None if slots is None else slots.cpu(), **ref_kwargs
    )
    if out is None:
        dirty_allocator(want.numel() * want.element_size(), DEVICE)
    got = read(cache, slots, **kwargs)
    torch.cuda.synchronize()
    assert out is None or got is out, f"{label}: out= must be returned"
    assert (got.shape, got.dtype, got.device) == (want.shape, want.dtype, cache.device), (
        f"{label}: got {got.dtype} {list(got.shape)} on {got.device}, want {want.dtype} {list(want.shape)}"
    )
    assert got.is_contiguous(), f"{label}: strides {got.stride()}"
    problem = bytes_mismatch(flat_bytes(got), flat_bytes(want), element_locator(want), f"{label}: output")
    assert problem is None, problem
    return got


def assert_nan_bits_canonical(got: torch.Tensor) -> None:
    int_dtype, canonical = NAN_BITS[got.dtype]
    nan_bits = got.view(int_dtype)[torch.isnan(got)]
    assert (nan_bits == torch.tensor(canonical, dtype=int_dtype).to(DEVICE)).all(), (
        f"non-canonical NaN bits: {sorted({hex(b & 0xFFFFFFFF) for b in nan_bits.tolist()})[:8]}"
    )


def crafted_cache(num_pages: int, page_size: int, layout: str, pad: int) -> torch.Tensor:
    """Records whose every group holds each E2M1 code once (shuffled) and whose scale bytes run
    through all 256 values in turn; RoPE and the rest of the storage random bytes."""
    cache = random_byte_cache(num_pages, page_size, layout, pad)
    data, scales = abi.record_views(cache, validation.check_cache(cache))
    n = num_pages * page_size
    codes = torch.argsort(torch.rand(n, abi.NUM_GROUPS, abi.GROUP_SIZE), dim=-1).reshape(n, abi.NOPE_DIM)
    packed = (codes[:, 0::2] | codes[:, 1::2] << 4).to(torch.uint8)
    start = int(torch.randint(0, 256, ()))
    scale_bytes = ((torch.arange(n * abi.NUM_GROUPS) + start) % 256).to(torch.uint8)
    data[..., : abi.NOPE_BYTES] = packed.view(num_pages, page_size, abi.NOPE_BYTES).to(DEVICE)
    scales[..., : abi.NUM_GROUPS] = scale_bytes.view(num_pages, page_size, abi.NUM_GROUPS).to(DEVICE)
    return cache


# ---------------------------------------------------------------- values, bit for bit


def geometry_grid():
    """Every page size with the three layouts and three pool paddings in a Latin square, int32
    and int64 slots in turn."""
    for i, page_size in enumerate(PAGE_SIZES):
        for j, layout in enumerate(LAYOUTS):
            yield page_size, layout, (0, 16, 48)[(i + j) % 3], (torch.int32, torch.int64)[(i + j) % 2]


@pytest.mark.parametrize("page_size, layout, pad, slot_dtype", list(geometry_grid()), ids=str)
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
def test_geometry_grid_random_bytes(seed, page_size, layout, pad, slot_dtype, dtype):
    """Random bytes everywhere, N-D slots with invalid ones, both fills, and slots=None."""
    num_pages = 300 // page_size + 2
    cache = random_byte_cache(num_pages, page_size, layout, pad)
    capacity = num_pages * page_size
    for shape in ((97,), (3, 41), (2, 3, 7)):
        slots = random_slots(shape, capacity, slot_dtype)
        for invalid in (math.nan, 0.0):
            label = f"page_size={page_size} {layout} pad={pad} {slot_dtype} {list(shape)} invalid={invalid}"
            got = check_read(cache, slots, label, dtype=dtype, invalid=invalid)
            assert_nan_bits_canonical(got)
    got = check_read(cache, None, f"page_size={page_size} {layout} pad={pad} slots=None", dtype=dtype)
    assert got.shape == (capacity, abi.HEAD_DIM)


@pytest.mark.parametrize("layout, pad", [("3D", 0), ("HND", 32), ("NHD", 16)])
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
def test_every_code_times_every_scale_byte(seed, layout, pad, dtype):
    """Every E2M1 code in every group, scale bytes 0x00..0xFF (0x7F and 0xFF NaN, 0x80..0xFE
    negative): bitwise equal to the reference, NaN canonical, and a few values known by hand."""
    cache = crafted_cache(4, 16, layout, pad)
    got = check_read(cache, None, f"crafted {layout} pad={pad}", dtype=dtype)
    assert_nan_bits_canonical(got)
    assert torch.isnan(got[:, : abi.NOPE_DIM]).any() and (got[:, : abi.NOPE_DIM] < 0).any()
    # Known values: group 0 of the first record, its scale byte and codes read back from the cache.
    data, scales = abi.record_views(cache, validation.check_cache(cache))
    scale_byte, row = int(scales[0, 0, 0]), got[0].float().cpu()
    codes = [int(data[0, 0, i // 2]) >> 4 * (i % 2) & 0xF for i in range(abi.GROUP_SIZE)]
    scale = math.nan if scale_byte & 0x7F == 0x7F else reference.e4m3_value(torch.tensor(scale_byte & 0x7F)).item()
    scale = -scale if scale_byte & 0x80 else scale
    for i, code in enumerate(codes):
        e2m1 = reference.E2M1_VALUES[code & 7] * (-1.0 if code & 8 else 1.0)
        want = e2m1 * scale
        if math.isnan(want):
            assert math.isnan(row[i]), (i, code, scale_byte)
        else:
            assert row[i].item() == want and math.copysign(1, row[i].item()) == math.copysign(1, want), (
                f"element {i}: code {code:#x} x scale byte {scale_byte:#04x}: got {row[i].item()}, want {want}"
            )


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
def test_signed_zero_and_extremes(dtype):
    """Hand-made records: -0 x +s = -0, -0 x -s = +0, +0 x -s = -0, 0.5 x 2^-9 = 2^-10 (the least
    magnitude), 6 x 448 = 2688 (the largest), -6 x -448 = +2688; RoPE -0, inf and NaN payloads."""
    cache = make_cache(1, 4, device=DEVICE)
    data, scales = abi.record_views(cache, validation.check_cache(cache))
    data.zero_()
    scales.zero_()
    data[0, 0, 0], scales[0, 0, 0] = 0x08, 0x38  # elements 0, 1: codes 8 (-0), 0 (+0); scale +1
    data[0, 1, 0], scales[0, 1, 0] = 0x08, 0xB8  # scale -1
    data[0, 2, 0], scales[0, 2, 0] = 0x71, 0x01  # codes 1 (0.5), 7 (6); scale 2^-9
    data[0, 3, 0], scales[0, 3, 0] = 0xF7, 0xFE  # codes 7 (6), 15 (-6); scale -448
    rope_bits = [b - (1 << 16) * (b >= 1 << 15) for b in (0x8000, 0x7F80, 0xFF80, 0x7F81, 0xFFFF)]
    rope = torch.tensor(rope_bits, dtype=torch.int16).view(torch.uint8)
    data[0, 0, abi.NOPE_BYTES : abi.NOPE_BYTES + 10] = rope.to(DEVICE)
    got = check_read(cache, torch.arange(4, device=DEVICE), "hand-made", dtype=dtype)
    values = got.float().cpu()
    signs = torch.signbit(values)
    assert values[0, 0] == 0 and signs[0, 0] and not signs[0, 1]
    assert values[1, 0] == 0 and not signs[1, 0] and signs[1, 1]
    assert values[2, 0] == 2.0**-10 and values[2, 1] == 6 * 2.0**-9
    assert values[3, 0] == -2688 and values[3, 1] == 2688
    assert signs[0, abi.NOPE_DIM] and values[0, abi.NOPE_DIM] == 0
    assert values[0, abi.NOPE_DIM + 1] == math.inf and values[0, abi.NOPE_DIM + 2] == -math.inf
    assert torch.isnan(values[0, abi.NOPE_DIM + 3 : abi.NOPE_DIM + 5]).all()
    assert_nan_bits_canonical(got)


FILLS = (math.nan, 0.0, -0.0, 1.0, -2.5, 7, 1e-40, 2.0**-140, 1.00390625, 1.01171875, 3.4e38, 1e300, -1e300, math.inf)


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
def test_fill_values(seed, dtype):
    """Rows of invalid slots are ``invalid`` rounded to fp32 then to the dtype: NaN, zeros of both
    signs, an int, fp32 subnormals, BF16 ties, values that overflow fp32 or BF16, infinity."""
    cache = random_byte_cache(3, 16)
    slots = torch.tensor([[-1, 5, 48], [2**31 - 1, -(2**31), 47]], dtype=torch.int32, device=DEVICE)
    for invalid in FILLS:
        check_read(cache, slots, f"invalid={invalid!r}", dtype=dtype, invalid=invalid)


@pytest.mark.parametrize("shape", [(), (1,), (5,), (4, 33), (2, 3, 5), (1, 1, 1, 9)], ids=str)
@pytest.mark.parametrize("slot_dtype", [torch.int32, torch.int64], ids=dtype_id)
def test_slot_shapes(seed, shape, slot_dtype):
    """Slots of any shape give ``slots.shape + (512,)``, a 0-d slot included."""
    cache = random_byte_cache(5, 16, "HND", 16)
    slots = random_slots(shape, 80, slot_dtype)
    for dtype in DTYPES:
        check_read(cache, slots, f"shape {list(shape)}", dtype=dtype)


def test_many_rows_many_blocks(seed):
    """A grid of many blocks over a large pool; the last block part full."""
    cache = random_byte_cache(1000, 64, "NHD", 16)
    for dtype in DTYPES:
        check_read(cache, random_slots((20_011,), 64_000, torch.int64), "20011 rows", dtype=dtype, invalid=0.0)


@pytest.mark.parametrize("entry", list(ENTRIES))
def test_records_written_by_each_writer(seed, entry):
    """Each GPU writer entry fills a cache (crafted rows: ties, zeros of both signs, inf, NaN);
    reading it back on the GPU equals the reference reader."""
    case = Case(entry=entry, num_tokens=70, rows="crafted", page_size=16, layout="HND" if entry == "pack" else "NHD")
    args = args_of(entry, make_inputs(case, DEVICE))
    result = getattr(nvfp4_mla, ENTRIES[entry])(*args, **case.kwargs())
    cache = result if entry == "pack" else args[ARG_NAMES[entry].index("cache")]
    for dtype in DTYPES:
        got = check_read(cache, None, f"{entry} records", dtype=dtype, invalid=0.0)
        assert_nan_bits_canonical(got)


# ---------------------------------------------------------------- out=, graphs, launches


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
def test_out_buffer(seed, dtype):
    """``out=`` inside a larger buffer: filled, returned, its version bumped, and not one byte
    around it written; reused with other slots."""
    cache = random_byte_cache(4, 16, "3D", 32)
    buffer = torch.full((2 * 3 * 7 * abi.HEAD_DIM + 1024,), -1.0, dtype=dtype, device=DEVICE)
    out = buffer[512 : 512 + 2 * 3 * 7 * abi.HEAD_DIM].view(2, 3, 7, abi.HEAD_DIM)
    for _ in range(2):
        version = out._version
        before = flat_bytes(buffer)
        check_read(cache, random_slots((2, 3, 7), 64, torch.int64), "out=", dtype=dtype, invalid=0.0, out=out)
        after = flat_bytes(buffer)
        edge = 512 * buffer.element_size()
        assert torch.equal(before[:edge], after[:edge]) and torch.equal(before[-edge:], after[-edge:])
        assert out._version > version


@pytest.mark.parametrize("with_out", [False, True], ids=["new output", "out="])
def test_cuda_graph_replay(seed, with_out):
    """Captured once; replayed after new slots and new cache bytes are copied into the static
    tensors: each replay equals the reference on that replay's inputs."""
    cache = random_byte_cache(6, 16, "HND", 16)
    slots = random_slots((4, 9), 96, torch.int32)
    out = torch.empty(4, 9, abi.HEAD_DIM, dtype=torch.bfloat16, device=DEVICE) if with_out else None

    def call():
        return read(cache, slots, dtype=torch.bfloat16, invalid=0.0, out=out)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up outside the capture, as torch recommends
        call()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        got = call()
    for replay in range(3):
        slots.copy_(random_slots((4, 9), 96, torch.int32))
        raw_bytes(cache).copy_(storage_bytes(random_byte_cache(6, 16, "HND", 16)))
        want = reference.nvfp4_dequantize_sparse_mla_cache(
            clone(cache, "cpu"), slots.cpu(), dtype=torch.bfloat16, invalid=0.0
        )
        graph.replay()
        torch.cuda.synchronize()
        problem = bytes_mismatch(flat_bytes(got), flat_bytes(want), element_locator(want), f"replay {replay}")
        assert problem is None, problem


def gpu_work(fn) -> list[str]:
    """Names of the kernels, copies and memsets ``fn()`` puts on the GPU (torch profiler, CUPTI)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]


def test_one_launch_none_for_empty_work(seed):
    """One kernel and no other GPU work per call; none for empty slots or an empty pool, whose
    results are still right."""
    noise = set(gpu_work(lambda: None))
    if len([n for n in gpu_work(lambda: torch.cuda._sleep(100)) if n not in noise]) != 1:
        pytest.skip("the torch profiler does not report GPU kernels here")
    cache = random_byte_cache(4, 16)
    slots = random_slots((3, 5), 64, torch.int64)
    read(cache, slots)  # compile and load outside the profile
    for dtype in DTYPES:
        work = [n for n in gpu_work(lambda dtype=dtype: read(cache, slots, dtype=dtype)) if n not in noise]
        assert len(work) == 1 and "nvfp4_mla_read" in work[0], work
    empty_pool = make_cache(0, 16, "HND", device=DEVICE)
    for label, args in [
        ("slots [0]", (cache, slots[:0, 0])),
        ("slots [3, 0]", (cache, slots[:, :0])),
        ("empty pool, slots=None", (empty_pool, None)),
    ]:
        work = [n for n in gpu_work(lambda args=args: read(*args)) if n not in noise]
        assert work == [], f"{label}: {work}"
        check_read(*args, label)
    work = [n for n in gpu_work(lambda: read(empty_pool, slots)) if n not in noise]
    assert len(work) == 1, f"empty pool with slots (all invalid): {work}"
    check_read(empty_pool, slots, "empty pool: every slot invalid")


def test_no_host_synchronisation(seed):
    """With the stream blocked behind a spin kernel, a call returns while it is still busy, and
    torch's sync debug mode sees no synchronising op in it."""
    cache = random_byte_cache(4, 16)
    slots = random_slots((64,), 64, torch.int64)
    read(cache, slots, dtype=torch.bfloat16)
    torch.cuda.synchronize()
    torch.cuda._sleep(200_000_000)
    torch.cuda.set_sync_debug_mode("error")
    try:
        read(cache, slots, dtype=torch.bfloat16)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    busy = not torch.cuda.current_stream().query()
    torch.cuda.synchronize()
    assert busy, "the stream's spin was over when the call returned: inconclusive or the call waited"


def test_allocates_only_the_output(seed):
    """A warm call grows torch's allocation by exactly a torch.empty of its output; with out=,
    by nothing."""
    cache = random_byte_cache(4, 16)
    slots = random_slots((33,), 64, torch.int64)
    out = read(cache, slots, dtype=torch.bfloat16)
    torch.cuda.synchronize()

    def growth(make):
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        kept = make()
        result = torch.cuda.memory_allocated() - base, torch.cuda.max_memory_allocated() - base
        del kept
        return result

    assert growth(lambda: read(cache, slots, dtype=torch.bfloat16)) == growth(lambda: torch.empty_like(out))
    assert growth(lambda: read(cache, slots, dtype=torch.bfloat16, out=out)) == (0, 0)


def test_torch_compile_matches_eager(seed):
    """torch.compile(fullgraph=True) traces both custom ops (new output and out=) and gives the
    eager bits."""
    torch._dynamo.reset()
    cache = random_byte_cache(4, 16, "NHD", 16)
    slots = random_slots((3, 11), 64, torch.int64)
    outs = [torch.empty(3, 11, abi.HEAD_DIM, device=DEVICE) for _ in range(2)]

    def step(cache, slots, out):
        read(cache, slots, out=out)
        return read(cache, slots, dtype=torch.bfloat16, invalid=0.0)

    compiled = torch.compile(step, fullgraph=True)(cache, slots, outs[0])
    eager = step(cache, slots, outs[1])
    torch.cuda.synchronize()
    assert torch.equal(flat_bytes(compiled), flat_bytes(eager))
    assert torch.equal(flat_bytes(outs[0]), flat_bytes(outs[1]))


# ---------------------------------------------------------------- contract and resources


def test_validation_on_the_gpu_path():
    """The kernel path refuses what the reference refuses, with its messages, plus CPU slots."""
    cache = random_byte_cache(2, 16)
    slots = torch.arange(4, device=DEVICE)
    out = torch.empty(4, abi.HEAD_DIM, device=DEVICE)
    with pytest.raises(ValueError, match="slots must be a CUDA tensor"):
        read(cache, slots.cpu())
    with pytest.raises(ValueError, match=r"dtype must be torch\.float32 or torch\.bfloat16"):
        read(cache, slots, dtype=torch.float16)
    with pytest.raises(ValueError, match="slots must have dtype"):
        read(cache, slots.float())
    with pytest.raises(ValueError, match="slots must be contiguous"):
        read(cache, torch.arange(8, device=DEVICE)[::2])
    with pytest.raises(ValueError, match="out must have the dtype"):
        read(cache, slots, dtype=torch.bfloat16, out=out)
    with pytest.raises(ValueError, match=r"out must be slots\.shape"):
        read(cache, slots[:3], out=out)
    pool = torch.zeros(2 * 16 * 384 + 4 * 512 * 4, dtype=torch.uint8, device=DEVICE)
    with pytest.raises(ValueError, match="cache overlaps out"):
        read(pool[: 2 * 16 * 384].view(2, 16, 384), slots, out=pool[: 4 * 512 * 4].view(torch.float32).view(4, 512))
    with pytest.raises(ValueError, match="slots overlaps out"):
        read(cache, pool[:32].view(torch.int64), out=pool[: 4 * 512 * 4].view(torch.float32).view(4, 512))
    with pytest.raises(ValueError, match="invalid must be a Python float"):
        read(cache, slots, invalid=torch.tensor(0.0))  # type: ignore[arg-type]
