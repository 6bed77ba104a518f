"""The GPU entries against the pure-torch reference, byte for byte (docs/format.md sections 3-6).

Each case runs one entry on the GPU and ``nvfp4_mla.reference`` on clones of the same inputs
(caches filled with the 0xA5 canary, pool padding included) and asserts that the returned tensor
and every byte of every argument's storage agree (``nvfp4_mla.testing.check``). Inputs are random
every run (``seed`` fixture); each case is its own test, named by the fields it changes.

Every test is marked ``gpu`` (skipped without a usable GPU). On CPU tensors the entries run the
reference (tests/test_writers_custom_ops.py).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import torch

import nvfp4_mla
from nvfp4_mla import abi, reference
from nvfp4_mla.ops.writer_spec import WriterSpec
from nvfp4_mla.testing import (
    ARG_NAMES,
    CANARY,
    ENTRIES,
    Case,
    args_of,
    bits,
    bytes_mismatch,
    cache_locator,
    check_case,
    clone,
    flat_bytes,
    make_cache,
    make_inputs,
    one_kv_block,
    record_offsets,
    storage_bytes,
    synchronize,
)

DEVICE = "cuda"
gpu = pytest.mark.gpu  # on every test of this file but test_cpu_tensors_rejected
PAGE_SIZES = (1, 3, 16, 32, 64, 256)


def gpu_entry(entry: str):
    return getattr(nvfp4_mla, ENTRIES[entry])


def cases(made: list[Case]):
    """``@pytest.mark.parametrize("case", made)``, each case's test named after it."""
    return pytest.mark.parametrize("case", made, ids=str)


# ---------------------------------------------------------------- case lists


def page_size_and_layout_cases() -> list[Case]:
    """Every page size, each with the three layouts and three pool paddings (0, 16, 48) in a
    Latin square, through the main, KV and append entries (int32 and int64 slots in turn)."""
    made: list[Case] = []
    for i, page_size in enumerate(PAGE_SIZES):
        for j, layout in enumerate(("3D", "HND", "NHD")):
            geometry: dict[str, Any] = dict(page_size=page_size, layout=layout, pad=(0, 16, 48)[(i + j) % 3])
            dtype = (torch.int32, torch.int64)[(i + j) % 2]
            made += [
                Case(slots=33, slot_dtype=dtype, **geometry),
                Case(entry="kv", compress_ratio=1 + j % 2, slot_dtype=dtype, **geometry),
                Case(entry="append", slot_dtype=dtype, **geometry),
            ]
    return made


SLOT_MAPPING_CASES = [
    Case(entry=entry, num_tokens=40, slots=n, slot_dtype=dtype)
    for entry in ("main", "kv")
    for dtype in (torch.int32, torch.int64)
    for n in (40, 29, 1, 0)
] + [Case(entry=entry, num_tokens=40, pages=1, page_size=16) for entry in ("main", "kv", "append")]


def head_cases() -> list[Case]:
    """Heads 1, 5, 8, 16, 64, 128 with every legal q_head_padded (0 and each padding >= heads),
    apply_q_rope both ways; every other case also has out-of-range positions."""
    made: list[Case] = []
    for num_heads in (1, 5, 8, 16, 64, 128):
        for padded in (0, *(p for p in abi.Q_HEAD_PADDINGS if p >= num_heads)):
            for apply_q_rope in (True, False):
                made.append(
                    Case(
                        num_tokens=13, slots=11, num_heads=num_heads, q_head_padded=padded,
                        apply_q_rope=apply_q_rope, page_size=64, bad_positions=len(made) % 2 == 1,
                    )
                )  # fmt: skip
    return made


def q_inplace_cases() -> list[Case]:
    """In place for heads 8..128 with q_head_padded 0 and = heads, apply_q_rope both ways, page
    sizes 1, 16, 256, random and crafted rows."""
    made: list[Case] = []
    for num_heads in abi.Q_HEAD_PADDINGS:
        for padded in (0, num_heads):
            for apply_q_rope in (True, False):
                i = len(made)
                made.append(
                    Case(
                        num_tokens=21, slots=17, num_heads=num_heads, q_head_padded=padded, q_inplace=True,
                        apply_q_rope=apply_q_rope, page_size=(1, 16, 256)[i % 3], bad_positions=i % 2 == 0,
                        rows=("random", "crafted")[i // 2 % 2],
                    )
                )  # fmt: skip
    return made


def kv_entry_cases() -> list[Case]:
    """compress_ratio 1 and 2 on odd and even positions, out-of-range ones included (an odd
    max_position makes position max_position a valid ratio-2 insert at row max_position - 1)."""
    made: list[Case] = []
    for ratio in (1, 2):
        for page_size in (3, 64):
            for max_position in (4097, 7):
                i = len(made)
                made.append(
                    Case(
                        entry="kv", num_tokens=64, slots=60, compress_ratio=ratio, page_size=page_size,
                        max_position=max_position, bad_positions=True, layout=("3D", "NHD")[i % 2],
                        slot_dtype=(torch.int32, torch.int64)[i // 2 % 2],
                    )
                )  # fmt: skip
    return made


NUM_TOKENS_CASES = [
    case
    for num_tokens in (0, 1, 37, 4096)
    for case in (
        Case(num_tokens=num_tokens),
        Case(num_tokens=num_tokens, q_inplace=True, q_head_padded=0),
        Case(entry="kv", num_tokens=num_tokens, compress_ratio=2),
        Case(entry="append", num_tokens=num_tokens),
    )
] + [
    Case(num_tokens=3, slots=0),
    Case(num_tokens=3, slots=0, q_head_padded=0),
    Case(entry="kv", num_tokens=5, slots=0),
]

BIG = 70_000
OVER_65536_ROWS_CASES = [
    Case(num_tokens=BIG, slots=BIG - 1000, num_heads=1, q_head_padded=8, page_size=64),
    Case(entry="kv", num_tokens=BIG, page_size=64, compress_ratio=2, bad_positions=True),
    # More rows than 256 a block of any launch (135168 on the H200): several ratio-2 tiles a block.
    Case(entry="kv", num_tokens=300_000, slots=299_000, page_size=64, compress_ratio=2, bad_positions=True),
    Case(entry="append", num_tokens=BIG, page_size=64, slot_dtype=torch.int32),
    Case(num_tokens=1024, num_heads=128, q_head_padded=128, page_size=64, bad_positions=True),
    Case(num_tokens=1024, num_heads=128, q_head_padded=0, q_inplace=True, page_size=64, bad_positions=True),
]

_CRAFTED: dict[str, Any] = dict(rows="crafted", num_tokens=300)
CRAFTED_CASES = [
    Case(num_heads=5, q_head_padded=8, **_CRAFTED),
    Case(num_heads=5, q_head_padded=8, table="wild", bad_positions=True, **_CRAFTED),
    Case(num_heads=16, q_head_padded=32, apply_q_rope=False, **_CRAFTED),
    Case(num_heads=16, q_head_padded=0, q_inplace=True, table="wild", **_CRAFTED),
    Case(num_heads=8, q_head_padded=8, q_inplace=True, bad_positions=True, **_CRAFTED),
    Case(entry="kv", compress_ratio=1, table="wild", **_CRAFTED),
    Case(entry="kv", compress_ratio=2, bad_positions=True, **_CRAFTED),
    Case(entry="append", page_size=3, **_CRAFTED),
    Case(entry="pack", page_size=16, pages=20, layout="NHD", rows="crafted"),
]

_BAD: dict[str, Any] = dict(num_tokens=64, bad_positions=True)
POSITION_SAFETY_CASES = [
    Case(num_heads=5, q_head_padded=8, **_BAD),
    Case(num_heads=5, q_head_padded=8, apply_q_rope=False, **_BAD),
    Case(num_heads=8, q_head_padded=0, q_inplace=True, **_BAD),
    Case(num_heads=8, q_head_padded=8, q_inplace=True, apply_q_rope=False, **_BAD),
    Case(num_heads=16, q_head_padded=16, max_position=1, **_BAD),
    Case(num_heads=16, q_head_padded=16, max_position=0, **_BAD),  # an empty table
    Case(entry="kv", compress_ratio=1, max_position=0, **_BAD),
    Case(entry="kv", compress_ratio=2, max_position=7, **_BAD),
    Case(entry="kv", compress_ratio=2, max_position=4097, **_BAD),
]

APPEND_CASES = [
    Case(
        entry="append", num_tokens=50, slots=(50, 44)[i % 2], page_size=page_size,
        layout=("3D", "HND", "NHD")[i % 3], pad=(0, 48, 16)[i // 2 % 3],
        slot_dtype=(torch.int64, torch.int32)[i % 2], rows=("random", "crafted")[i // 3 % 2],
    )
    for i, page_size in enumerate(PAGE_SIZES)
]  # fmt: skip

PACK_CASES = [
    Case(entry="pack", layout=layout, page_size=page_size, pages=pages, rows=("random", "crafted")[i % 2])
    for layout in ("HND", "NHD")
    for i, (page_size, pages) in enumerate(((1, 7), (3, 5), (16, 4), (32, 3), (64, 3), (256, 2), (16, 0)))
]

_CRAFTED_BAD: dict[str, Any] = dict(rows="crafted", num_tokens=200, bad_positions=True)
REFERENCE_ON_CUDA_CASES = [
    Case(num_heads=5, q_head_padded=8, table="wild", **_CRAFTED_BAD),
    Case(num_heads=16, q_head_padded=0, q_inplace=True, table="wild", **_CRAFTED_BAD),
    Case(entry="kv", compress_ratio=2, table="wild", **_CRAFTED_BAD),
    Case(entry="append", **_CRAFTED_BAD),
    Case(entry="pack", page_size=16, pages=8, layout="HND", rows="crafted"),
]


# ---------------------------------------------------------------- tests against the reference


@gpu
@cases(page_size_and_layout_cases())
def test_page_sizes_and_layouts(case, seed):
    """Every page size, layout and pool padding through the main, KV and append entries."""
    check_case(case, DEVICE)


@gpu
@cases(SLOT_MAPPING_CASES)
def test_slot_mappings(case, seed):
    """int32 and int64 slots with -1, other negatives and out-of-range values; slot_mapping
    shorter than the rows (DP padding, down to empty); more rows than cache slots."""
    check_case(case, DEVICE)


@gpu
@cases(head_cases())
def test_heads_and_padding(case, seed):
    """Every head count with every legal q_head_padded, apply_q_rope both ways."""
    check_case(case, DEVICE)


@gpu
@cases(q_inplace_cases())
def test_q_inplace(case, seed):
    """In place: q's RoPE dims rotated (NoPE dims untouched), q itself returned, the cache as the
    reference."""
    check_case(case, DEVICE)


@gpu
@cases(kv_entry_cases())
def test_kv_entry(case, seed):
    """compress_ratio 1 and 2 on odd and even positions, out-of-range ones included."""
    check_case(case, DEVICE)


@gpu
@cases(NUM_TOKENS_CASES)
def test_num_tokens(case, seed):
    """T = 0, 1, 37, 4096 through the main (padded and in place), KV and append entries; rows
    present but no slots at all."""
    check_case(case, DEVICE)


# Calls whose KV units outnumber their blocks' units: the KV blocks' grid-stride loop and its
# pipeline, a unit with rows for only one of its warps, and the query's blocks after the KV block.
ONE_BLOCK_CASES = [
    Case(num_tokens=37),
    Case(num_tokens=37, q_head_padded=128, num_heads=96),
    Case(num_tokens=40, q_inplace=True, q_head_padded=0, num_heads=16),
    Case(entry="kv", num_tokens=301, compress_ratio=2),
    Case(entry="kv", num_tokens=2000, compress_ratio=2, bad_positions=True),  # many units insert nothing
    Case(entry="append", num_tokens=9),
    Case(entry="pack", layout="HND", page_size=16, pages=3),
]


@gpu
@cases(ONE_BLOCK_CASES)
def test_one_block_does_every_kv_unit(case, seed):
    """Every KV row inserted by a single block (4 units of 64 threads), whatever their number and
    however few of them are inserted."""
    check_case(case, DEVICE, library=nvfp4_mla.KernelLibrary(writer_grid=one_kv_block))


QUERY_BLOCK_CASES = [
    Case(num_tokens=1, num_heads=128, q_head_padded=128),
    Case(num_tokens=3, num_heads=5, q_head_padded=8),
    Case(num_tokens=37, num_heads=64, q_head_padded=64, apply_q_rope=False),
    Case(num_tokens=1, num_heads=128, q_head_padded=128, q_inplace=True),
    Case(num_tokens=7, num_heads=8, q_head_padded=8, q_inplace=True),  # 7 groups: a partial unit
    Case(num_tokens=37, num_heads=16, q_head_padded=16, q_inplace=True, bad_positions=True),
]
QUERY_LAYOUTS = {  # query blocks of each layout the kernel tells apart
    "row_a_block": lambda spec, tokens: spec.q_rows(tokens),
    "unit_a_block": lambda spec, tokens: spec.q_units(tokens),
    "four_units_a_block": lambda spec, tokens: -(-spec.q_units(tokens) // 4),
}


@gpu
@cases(QUERY_BLOCK_CASES)
@pytest.mark.parametrize("layout", QUERY_LAYOUTS)
def test_query_block_layouts(case, seed, layout):
    """The query's blocks do a row, a unit or 4 units each (WriterSpec.grid's choices, told apart by
    the kernel from the number of blocks), q_out and in place alike: the same bytes every way."""
    query_blocks = QUERY_LAYOUTS[layout]

    def forced(spec: WriterSpec, tokens, kv_rows, resident, sms):
        kv_blocks, _ = spec.grid(tokens, kv_rows, resident, sms)
        return kv_blocks, kv_blocks + query_blocks(spec, tokens)

    check_case(case, DEVICE, library=nvfp4_mla.KernelLibrary(writer_grid=forced))


@gpu
@cases(OVER_65536_ROWS_CASES)
def test_over_65536_rows(case, seed):
    """One launch over more than 65536 rows: 70000 tokens (q_out of 1 head padded to 8), the KV
    and append entries over 70000 rows (the KV entry over 300000 too), and 1024 tokens x 128
    heads (131072 q_out rows)."""
    check_case(case, DEVICE)


@gpu
@cases(CRAFTED_CASES)
def test_crafted_values(case, seed):
    """Rows full of ties, signed zeros, tiny groups, subnormals, BF16-max values, inf and NaN (in
    q, kv and latent rows), with real and wild RoPE tables, through every entry."""
    check_case(case, DEVICE)


@gpu
@cases(APPEND_CASES)
def test_append_entry(case, seed):
    """The unfused writer with random slots (invalid ones and DP padding included) on every page
    size, layout, padding and slot dtype, random and crafted rows."""
    check_case(case, DEVICE)


@gpu
@cases(REFERENCE_ON_CUDA_CASES)
def test_reference_same_on_cpu_and_cuda(case, seed):
    """The reference gives the same bytes on the GPU as on the CPU (the large cases compare
    against the reference run on the GPU)."""
    check_case(case, DEVICE, ref_device="cpu", impl=reference)


# ---------------------------------------------------------------- tests with their own checks


@gpu
@cases(POSITION_SAFETY_CASES)
def test_position_safety(case, seed):
    """Positions outside [0, max_position) (negative, max_position, huge; tables of 1 and 0 rows)
    are never inserted; their live q_out heads are BF16 NaN with apply_q_rope, copied without; in
    place they are left untouched (docs/format.md section 5). Besides the reference comparison,
    the NaN heads, zero padded heads and untouched records are checked directly."""
    got, args = check_case(case, DEVICE)
    named = dict(zip(ARG_NAMES[case.entry], args))
    positions = named["positions"].cpu()
    ratio = case.compress_ratio if case.entry == "kv" else 1
    rope_row = torch.div(positions, ratio, rounding_mode="floor") * ratio
    outside = (rope_row < 0) | (rope_row >= case.max_position)
    assert outside.any(), "the case has no out-of-range position"
    if case.entry == "main" and case.q_head_padded and not case.q_inplace:
        q_out = bits(got).cpu()
        if case.apply_q_rope:
            assert (q_out[outside, : case.num_heads] == abi.BF16_NAN_BITS).all(), "live heads of bad rows are not NaN"
        assert (q_out[:, case.num_heads :] == 0).all(), "padded heads are not zero"
    slots = named["slot_mapping"].cpu().long()[outside[: named["slot_mapping"].numel()]]
    slots = slots[(slots >= 0) & (slots < case.num_pages * case.page_size)]
    records = storage_bytes(named["cache"])[record_offsets(named["cache"], slots)]
    written = (records != CANARY).any(dim=1)
    assert not written.any(), f"slots {slots[written].tolist()} of out-of-range positions were written"


@gpu
@cases(PACK_CASES)
def test_pack_entry(case, seed):
    """Whole pages to a new HND or NHD cache: equal to the reference, and to the append entry
    writing every slot in order into a canary cache of the same layout (also for zero pages)."""
    packed, (latent,) = check_case(case, DEVICE)
    cache = make_cache(case.num_pages, case.page_size, case.layout, device=DEVICE)
    slots = torch.arange(case.num_pages * case.page_size, device=DEVICE)
    gpu_entry("append")(latent.reshape(-1, abi.HEAD_DIM), slots, cache)
    synchronize(DEVICE)
    report = bytes_mismatch(flat_bytes(packed), storage_bytes(cache), cache_locator(cache), "pack vs append")
    assert report is None, report


@gpu
@pytest.mark.parametrize(
    "num_heads, padded, apply_q_rope",
    [(5, 0, True), (5, 8, True), (1, 0, False), (1, 8, True), (8, 16, True), (16, 32, False), (32, 128, True),
     (16, 8, True)],
)  # fmt: skip
def test_q_inplace_rejections(num_heads, padded, apply_q_rope, seed):
    """In place with an unsupported head count or with head padding raises ValueError before
    anything is written."""
    args = args_of("main", make_inputs(Case(num_tokens=4, num_heads=num_heads), DEVICE))
    before = [storage_bytes(a) for a in args]
    with pytest.raises(ValueError, match=r"q_inplace|q_head_padded"):
        gpu_entry("main")(*args, q_head_padded=padded, apply_q_rope=apply_q_rope, q_inplace=True)
    synchronize(DEVICE)
    for name, b, a in zip(ARG_NAMES["main"], before, args):
        assert torch.equal(b, storage_bytes(a)), f"{name} was written"


@gpu
def test_main_without_q_is_kv_entry(seed):
    """q_head_padded=0 (not in place) writes the cache exactly as the KV entry with ratio 1 and
    returns an empty [T, 0, 512] BF16 tensor."""
    inputs = make_inputs(Case(num_tokens=50, slots=45, q_head_padded=0, bad_positions=True, rows="crafted"), DEVICE)
    main_args = [clone(a) for a in args_of("main", inputs)]
    kv_args = [clone(a) for a in args_of("kv", inputs)]
    out = gpu_entry("main")(*main_args, q_head_padded=0)
    gpu_entry("kv")(*kv_args, compress_ratio=1)
    synchronize(DEVICE)
    assert (out.dtype, tuple(out.shape), out.device) == (torch.bfloat16, (50, 0, abi.HEAD_DIM), main_args[0].device)
    report = bytes_mismatch(
        storage_bytes(main_args[2]), storage_bytes(kv_args[1]), cache_locator(kv_args[1]), "main vs kv cache"
    )
    assert report is None, report


@gpu
def test_known_answer_row(seed):
    """docs/format.md section 4's known answer, checked on the bytes directly: data bytes 0..7 are
    80 91 A2 B3 C4 D5 E6 F7, group 0's scale 0x38, every other byte of the record zero and every
    byte outside it still the canary."""
    row = torch.zeros(1, abi.HEAD_DIM)
    row[0, :16] = torch.tensor([0, -0.0, 0.5, -0.5, 1, -1, 1.5, -1.5, 2, -2, 3, -3, 4, -4, 6, -6])
    latent = row.to(torch.bfloat16).to(DEVICE)
    cache = make_cache(2, 4, "HND", 16, device=DEVICE)
    slot = torch.tensor([5])
    gpu_entry("append")(latent, slot.to(DEVICE), cache)
    record = torch.zeros(abi.RECORD_BYTES, dtype=torch.uint8)
    record[:8] = torch.tensor([0x80, 0x91, 0xA2, 0xB3, 0xC4, 0xD5, 0xE6, 0xF7], dtype=torch.uint8)
    record[abi.DATA_BYTES] = 0x38
    expected = torch.full_like(storage_bytes(cache), CANARY)
    expected[record_offsets(cache, slot)[0]] = record
    report = bytes_mismatch(storage_bytes(cache), expected, cache_locator(cache), "known-answer cache")
    assert report is None, report


@gpu
@pytest.mark.parametrize("problem", ["position", "slot"])
def test_debug_check_env(problem, seed, monkeypatch):
    """NVFP4_MLA_CHECK=1 (docs/format.md section 5): good inputs (padding slots included) still
    match the reference; an out-of-range position or a repeated valid slot raises ValueError
    before any write. The variable is read at import; the module attribute it sets is flipped here."""
    monkeypatch.setattr(nvfp4_mla.config, "DEBUG_CHECKS", True)
    case = Case(num_tokens=24)
    check_case(case, DEVICE)
    inputs = make_inputs(dataclasses.replace(case, bad_slots=False), DEVICE)
    if problem == "position":
        inputs["positions"][5] = case.max_position
    else:
        inputs["slot_mapping"][7] = inputs["slot_mapping"][2]
    before = storage_bytes(inputs["cache"])
    with pytest.raises(ValueError):
        gpu_entry("main")(*args_of("main", inputs), **case.kwargs())
    synchronize(DEVICE)
    assert torch.equal(before, storage_bytes(inputs["cache"])), f"bad {problem}: the cache was written"


@gpu
@pytest.mark.parametrize("name", ARG_NAMES["main"])
def test_mixed_devices_rejected(name, seed):
    """One argument left on the CPU: ValueError 'must be a CUDA tensor', nothing written."""
    inputs = make_inputs(Case(num_tokens=4), DEVICE)
    args = [t.cpu() if n == name else t for n, t in zip(ARG_NAMES["main"], args_of("main", inputs))]
    if name == "cache":
        args[2] = make_cache(3, 16, device="cpu")
    before = [storage_bytes(a) for a in args]
    with pytest.raises(ValueError, match="must be a CUDA tensor"):
        gpu_entry("main")(*args, q_head_padded=16)
    synchronize(DEVICE)
    for n, b, a in zip(ARG_NAMES["main"], before, args):
        assert torch.equal(b, storage_bytes(a)), f"{n} was written"
