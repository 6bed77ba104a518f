"""The GPU entries against the pure-torch reference, byte for byte (SPEC.md sections 3-6).

Each check runs one entry on the GPU and ``nvfp4_mla.reference`` on clones of the same inputs
(caches filled with the 0xA5 canary, pool padding included) and asserts that the returned tensor
and every byte of every argument's storage agree. Inputs are random every run (``seed`` fixture).
Tests that loop over configurations run all of them, then report every failing one by name.

Every test is marked ``gpu`` (skipped without a usable GPU) except test_cpu_tensors_rejected,
which only exercises the argument checks and runs anywhere.
"""

from __future__ import annotations

import dataclasses
import math
import traceback

import pytest
import torch

import nvfp4_mla
from nvfp4_mla import abi, reference, validation
from util import CANARY, bits, cos_sin_table, make_cache, random_rows, random_slots, storage_bytes

DEVICE = "cuda"
gpu = pytest.mark.gpu  # on every test of this file but test_cpu_tensors_rejected

ENTRIES = {
    "main": "cake_dsv4_nvfp4_rope_quantize_insert",
    "kv": "cake_dsv4_nvfp4_kv_rope_quantize_insert",
    "append": "nvfp4_quantize_append_sparse_mla_cache",
    "pack": "nvfp4_quantize_pack_sparse_mla_cache",
}
ARG_NAMES = {  # positional arguments of each entry ("kv" is latent_kv for append and pack)
    "main": ("q", "kv", "cache", "slot_mapping", "positions", "cos_sin_cache"),
    "kv": ("kv", "cache", "slot_mapping", "positions", "cos_sin_cache"),
    "append": ("kv", "slot_mapping", "cache"),
    "pack": ("kv",),
}
PAGE_SIZES = (1, 3, 16, 32, 64, 256)
# Calls with more input elements than this run the reference on the GPU too (it is cross-checked
# against the CPU in test_reference_same_on_cpu_and_cuda); smaller ones on CPU copies.
REF_ON_GPU_ELEMENTS = 1 << 23


def gpu_entry(name: str):
    return getattr(nvfp4_mla, name)


def synchronize(device) -> None:
    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# ---------------------------------------------------------------- inputs

# E2M1 values and the rounding boundaries between them: times an exact scale 2^k these are exact
# ties of step 7 (0.25 -> 0, 0.75 -> 1, ..., 5 -> 4).
E2M1_POINTS = (0.0, 0.25, 0.5, 0.75, 1.0, 1.25, 1.5, 1.75, 2.0, 2.5, 3.0, 3.5, 4.0, 5.0, 6.0)
# Group maxima whose amax/6 is (up to R6's rounding) halfway between two E4M3 values (step 4
# ties), then maxima whose scale saturates at 448.
_E4M3 = reference.e4m3_value(torch.arange(abi.E4M3_MAX_CODE + 1)).double()
_MIDS = 6 * (_E4M3[1:] + _E4M3[:-1]) / 2
SCALE_TIES = _MIDS[_MIDS.float().to(torch.bfloat16).double() == _MIDS].tolist() + [6 * 448.0, 6 * 464.0, 1e5]
# Group maxima around 6 * 2^-10, below which the scale rounds to E4M3 zero (codes become +-6).
TINY_AMAX = (6 * 2**-10, 6 * 2**-10 - 2**-15, 6 * 2**-10 + 2**-15, 0.004, 0.001, 2**-20, 2**-120)
BF16_MAX = float.fromhex("0x1.fep127")
# +inf, -inf and NaNs with several signs and payloads, as int16 bit patterns.
SPECIAL_BITS = tuple(b - 0x10000 if b >= 0x8000 else b for b in (0x7F80, 0xFF80, 0x7FC0, 0xFFC0, 0x7F81, 0xFFFF))


def crafted_rows(shape) -> torch.Tensor:
    """BF16 rows whose groups of 16 each follow one awkward pattern of SPEC section 4: E2M1 ties
    at an exact scale, E4M3 scale ties and saturation, zeros of both signs, tiny groups, BF16
    subnormals, values up to the BF16 maximum, and inf/NaN (several payloads) at random places."""
    n, g = math.prod(shape[:-1]), shape[-1] // abi.GROUP_SIZE
    size = (n, g, abi.GROUP_SIZE)

    def per_group(values):
        return torch.tensor(values, dtype=torch.float32)[torch.randint(len(values), (n, g, 1))]

    def per_element(values):
        return torch.tensor(values, dtype=torch.float32)[torch.randint(len(values), size)]

    sign = per_element((1.0, -1.0))
    spot = torch.nn.functional.one_hot(torch.randint(abi.GROUP_SIZE, (n, g)), abi.GROUP_SIZE).bool()
    scale = torch.exp2(torch.randint(-9, 9, (n, g, 1)).float())  # E4M3-exact scales 2^-9 .. 2^8
    unit = torch.rand(size) * 2 - 1
    tie_amax, tiny_amax = per_group(SCALE_TIES), per_group(TINY_AMAX)
    patterns = [
        torch.randn(size) * scale,
        sign * torch.where(spot, 6.0, per_element(E2M1_POINTS)) * scale,  # amax 6 * 2^k
        torch.where(spot, sign * tie_amax, unit * tie_amax),
        sign * 0.0,
        torch.where(spot, sign * tiny_amax, unit * tiny_amax),
        sign * torch.randint(0, 128, size).float() * 2.0**-133,  # BF16 subnormals (and zeros)
        sign * BF16_MAX * torch.where(spot, 1.0, torch.rand(size)),
        torch.randn(size) * scale,  # 7: inf/NaN on about a quarter of the elements
        torch.randn(size) * scale,  # 8: one inf/NaN at a random element
    ]
    choice = torch.randint(len(patterns), (n, g, 1))
    values = torch.stack(patterns).gather(0, choice.expand(size).unsqueeze(0)).squeeze(0)
    out = values.to(torch.bfloat16).view(torch.int16)
    special = torch.tensor(SPECIAL_BITS, dtype=torch.int16)[torch.randint(len(SPECIAL_BITS), size)]
    sprinkle = ((choice == 7) & (torch.rand(size) < 0.25)) | ((choice == 8) & spot)
    return torch.where(sprinkle, special, out).view(torch.bfloat16).reshape(shape)


def make_slots(n: int, capacity: int, dtype, bad: bool) -> torch.Tensor:
    """Distinct valid slots (``-1`` once the capacity is used up); with ``bad``, about one row in
    eight gets -1, another negative or an out-of-range slot instead."""
    slots = torch.full((n,), -1, dtype=torch.int64)
    valid = min(n, capacity)
    slots[:valid] = random_slots(valid, capacity)
    slots = slots[torch.randperm(n)]
    if bad and n:
        limit = 2**31 if dtype == torch.int32 else 2**62
        values = torch.tensor([-1, -2, capacity, capacity + 1, capacity + 4099, -limit, limit - 1])
        rows = torch.randperm(n)[: max(1, n // 8)]
        slots[rows] = values[torch.randint(len(values), (len(rows),))]
        slots[rows[0]] = -1
    return slots.to(dtype)


def make_positions(n: int, max_position: int, bad: bool) -> torch.Tensor:
    """Random positions in ``[0, max_position)`` (odd and even); with ``bad``, about one row in six
    gets one outside the table (negative, ``max_position`` itself, huge)."""
    positions = torch.randint(0, max(max_position, 1), (n,))
    if bad and n:
        m = max_position
        values = torch.tensor([-1, -2, -m - 1, m, m + 1, 2**40, -(2**40), 2**62, -(2**63)])
        rows = torch.randperm(n)[: max(1, n // 6)]
        positions[rows] = values[torch.randint(len(values), (len(rows),))]
        positions[rows[0]] = -1
        positions[rows[-1]] = m
    return positions


def make_table(max_position: int, kind: str) -> torch.Tensor:
    """``real``: a RoPE table. ``wild``: fp32 values of every size, ~5% subnormal (RoPE keeps
    subnormals), ~2% +-inf, NaN or +-0."""
    if kind == "real":
        return cos_sin_table(max_position)
    shape = (max_position, abi.ROPE_DIM)
    table = torch.randn(shape) * torch.exp2(torch.randint(-24, 24, shape).float())
    r = torch.rand(shape)
    table = torch.where(r < 0.05, torch.rand(shape) * 2.0**-126, table)
    specials = torch.tensor([math.inf, -math.inf, math.nan, 0.0, -0.0])
    return torch.where(r > 0.98, specials[torch.randint(len(specials), shape)], table)


@dataclasses.dataclass(frozen=True)
class Case:
    """One call: the entry, its options, and how its inputs are made."""

    entry: str = "main"  # a key of ENTRIES
    tokens: int = 37
    heads: int = 8
    q_head_padded: int = 16
    apply_q_rope: bool = True
    q_inplace: bool = False
    compress_ratio: int = 1
    page_size: int = 16
    layout: str = "3D"  # "3D", "HND" or "NHD"; the kv_layout of pack
    pad: int = 0  # pool padding bytes after each page
    pages: int | None = None  # None: room for every row, with spare slots
    slot_dtype: torch.dtype = torch.int64
    slots: int | None = None  # slot_mapping length; None: one per token (fewer: DP padding)
    bad_slots: bool = True  # some rows get -1 or out-of-range slots
    bad_positions: bool = False  # some rows get positions outside [0, max_position)
    rows: str = "random"  # "random" (util.random_rows) or "crafted" (crafted_rows)
    table: str = "real"  # see make_table
    max_position: int = 4096

    def __post_init__(self):
        assert self.entry in ENTRIES, self.entry
        assert self.layout in (abi.KV_LAYOUTS if self.entry == "pack" else ("3D", *abi.KV_LAYOUTS)), self.layout

    def __str__(self):
        changed = [
            f"{f.name}={getattr(self, f.name)}"
            for f in dataclasses.fields(self)
            if f.name != "entry" and getattr(self, f.name) != f.default
        ]
        return f"{self.entry}({', '.join(changed)})"

    @property
    def num_slots(self) -> int:
        return self.tokens if self.slots is None else self.slots

    @property
    def num_pages(self) -> int:
        return self.pages if self.pages is not None else self.num_slots * 5 // 4 // self.page_size + 2

    def kwargs(self) -> dict:
        if self.entry == "main":
            return dict(q_head_padded=self.q_head_padded, apply_q_rope=self.apply_q_rope, q_inplace=self.q_inplace)
        if self.entry == "kv":
            return dict(compress_ratio=self.compress_ratio)
        if self.entry == "pack":
            return dict(kv_layout=self.layout)
        return {}


def make_inputs(case: Case, device=None) -> dict:
    """The named input tensors of ``case`` on ``device`` (default DEVICE), drawn on the CPU so
    that a seed replays."""
    device = DEVICE if device is None else device
    rows = crafted_rows if case.rows == "crafted" else random_rows
    if case.entry == "pack":
        return {"kv": rows((case.num_pages, case.page_size, abi.HEAD_DIM)).to(device)}
    t = case.tokens
    made = {
        "kv": rows((t, abi.HEAD_DIM)),
        "slot_mapping": make_slots(case.num_slots, case.num_pages * case.page_size, case.slot_dtype, case.bad_slots),
        "positions": make_positions(t, case.max_position, case.bad_positions),
        "cos_sin_cache": make_table(case.max_position, case.table),
    }
    if case.entry == "main":
        made["q"] = rows((t, case.heads, abi.HEAD_DIM))
    made = {name: tensor.to(device) for name, tensor in made.items()}
    made["cache"] = make_cache(case.num_pages, case.page_size, case.layout, case.pad, device=device)
    return made


def args_of(entry: str, inputs: dict) -> tuple:
    return tuple(inputs[name] for name in ARG_NAMES[entry])


def clone(t: torch.Tensor, device=None) -> torch.Tensor:
    """A copy of ``t`` with its whole storage (pool padding too), same sizes, strides and offset."""
    raw = torch.empty(0, dtype=torch.uint8, device=t.device).set_(t.untyped_storage())
    raw = raw.to(t.device if device is None else device, copy=True)
    return raw.view(t.dtype).as_strided(t.shape, t.stride(), t.storage_offset())


# ---------------------------------------------------------------- comparison


def flat_bytes(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().reshape(-1).view(torch.uint8).cpu()


def element_locator(t: torch.Tensor):
    """Maps a byte offset in ``t``'s storage to its element index and both values."""
    shape, size, base = tuple(t.shape), t.element_size(), t.storage_offset()

    def locate(offset: int, got: torch.Tensor, want: torch.Tensor) -> str:
        index = offset // size - base
        if not 0 <= index < t.numel():
            return "outside the tensor"
        coords = []
        for extent in reversed(shape):
            index, c = divmod(index, extent)
            coords.append(c)
        coords.reverse()
        start = offset - offset % size
        g, w = (int.from_bytes(bytes(b[start : start + size].tolist()), "little") for b in (got, want))
        part = ""
        if len(shape) >= 2 and shape[-1] == abi.HEAD_DIM:
            part = " (RoPE dim)" if coords[-1] >= abi.NOPE_DIM else " (NoPE dim)"
        return f"element {tuple(coords)}{part}: got {g:#0{2 + 2 * size}x}, want {w:#0{2 + 2 * size}x}"

    return locate


def cache_locator(cache: torch.Tensor, slot_mapping: torch.Tensor | None = None):
    """Maps a byte offset in the cache's storage to slot, page, entry and field (SPEC section 3),
    and names the rows of ``slot_mapping`` that address that slot."""
    num_pages, page_size, page_stride = validation.check_cache(cache)
    base = cache.storage_offset()
    slots = None if slot_mapping is None else slot_mapping.cpu().long()

    def locate(offset: int, got=None, want=None) -> str:
        page, within = divmod(offset - base, page_stride)
        if offset < base or page >= num_pages:
            return "outside the cache view"
        if within >= page_size * abi.RECORD_BYTES:
            return f"page {page}: pool padding byte {within - page_size * abi.RECORD_BYTES}"
        if within < page_size * abi.DATA_BYTES:
            entry, b = divmod(within, abi.DATA_BYTES)
            if b < abi.NOPE_BYTES:
                field = f"data byte {b} (E2M1 of elements {2 * b}, {2 * b + 1}; group {2 * b // abi.GROUP_SIZE})"
            else:
                field = f"data byte {b} (BF16 of RoPE dim {abi.NOPE_DIM + (b - abi.NOPE_BYTES) // 2})"
        else:
            entry, b = divmod(within - page_size * abi.DATA_BYTES, abi.SCALE_BYTES)
            field = f"scale byte {b}" + (f" (group {b})" if b < abi.NUM_GROUPS else " (zero pad)")
        slot = page * page_size + entry
        rows = "" if slots is None else f"; rows with this slot: {(slots == slot).nonzero().flatten().tolist()}"
        return f"slot {slot} (page {page}, entry {entry}), {field}{rows}"

    return locate


def bytes_mismatch(got: torch.Tensor, want: torch.Tensor, locate, what: str, limit: int = 8) -> str | None:
    """None when the byte tensors are equal, else a report of the first differing offsets."""
    if got.shape == want.shape and torch.equal(got, want):
        return None
    if got.shape != want.shape:
        return f"{what}: {got.numel()} bytes, expected {want.numel()}"
    diff = (got != want).nonzero().flatten()
    lines = [f"{what}: {diff.numel()} of {want.numel()} bytes differ; first ones:"]
    for offset in diff[:limit].tolist():
        lines.append(f"  byte {offset}: got {int(got[offset]):#04x}, want {int(want[offset]):#04x}; {locate(offset, got, want)}")
    return "\n".join(lines)


def assert_same(entry: str, got, want, gpu_args, ref_args, label: str) -> None:
    """The GPU call's result and argument storages against the reference's, byte for byte."""
    where = f"{ENTRIES[entry]} [{label}]"
    names = ARG_NAMES[entry]
    problems = []
    if want is None:
        assert got is None, f"{where}: returned {type(got).__name__}, expected None"
    elif want is ref_args[0]:
        assert got is gpu_args[0], f"{where}: in place it must return q itself"
    else:
        assert isinstance(got, torch.Tensor), f"{where}: returned {type(got).__name__}"
        assert (got.dtype, tuple(got.shape)) == (want.dtype, tuple(want.shape)), (
            f"{where}: returned {got.dtype} {list(got.shape)}, expected {want.dtype} {list(want.shape)}"
        )
        assert got.device == gpu_args[0].device, f"{where}: returned a tensor on {got.device}"
        assert got.is_contiguous(), f"{where}: returned strides {got.stride()}"
        if got.numel():
            shared = [n for n, a in zip(names, gpu_args) if a.untyped_storage().data_ptr() == got.untyped_storage().data_ptr()]
            assert not shared, f"{where}: the returned tensor shares storage with {shared}"
        locate = cache_locator(want) if entry == "pack" else element_locator(want)
        problems.append(bytes_mismatch(flat_bytes(got), flat_bytes(want), locate, "returned tensor"))
    slots = ref_args[names.index("slot_mapping")] if "slot_mapping" in names else None
    for name, g, r in zip(names, gpu_args, ref_args):
        locate = cache_locator(r, slots) if name == "cache" else element_locator(r)
        problems.append(bytes_mismatch(storage_bytes(g), storage_bytes(r), locate, f"argument {name}"))
    problems = [p for p in problems if p]
    assert not problems, f"{where}:\n" + "\n".join(problems)


def run_reference(entry: str, args, kwargs: dict, device):
    """The reference on copies of ``args`` on ``device``: (its result, its arguments after)."""
    ref_args = [clone(a, device) for a in args]
    return getattr(reference, ENTRIES[entry])(*ref_args, **kwargs), ref_args


def dirty_allocator(nbytes: int, device) -> None:
    """Leaves freed 0xFF blocks of ``nbytes`` in torch's caching allocator, so that the output
    the entry allocates next starts as garbage: bytes it does not write then show as mismatches."""
    if torch.device(device).type != "cuda" or nbytes == 0:
        return
    torch.cuda.empty_cache()
    blocks = [torch.full((nbytes,), 0xFF, dtype=torch.uint8, device=device) for _ in range(2)]
    del blocks


def check(entry: str, args, kwargs: dict, *, label: str, ref_device=None, impl=None):
    """Runs ``impl`` (default: the GPU entry) on clones of ``args`` and the reference on other
    clones, then asserts equal bytes everywhere. Returns (result, the arguments it was given)."""
    name = ENTRIES[entry]
    device = args[0].device
    if ref_device is None:
        ref_device = device if sum(a.numel() for a in args) > REF_ON_GPU_ELEMENTS else "cpu"
    want, ref_args = run_reference(entry, args, kwargs, ref_device)
    gpu_args = [clone(a) for a in args]
    if isinstance(want, torch.Tensor) and want is not ref_args[0]:
        dirty_allocator(want.untyped_storage().nbytes(), device)
    got = (impl or gpu_entry(name))(*gpu_args, **kwargs)
    synchronize(device)
    assert_same(entry, got, want, gpu_args, ref_args, f"{label}; reference on {ref_device}")
    return got, gpu_args


def check_case(case: Case, **options):
    inputs = make_inputs(case)
    return check(case.entry, args_of(case.entry, inputs), case.kwargs(), label=str(case), **options)


def run_cases(cases, run=check_case) -> None:
    """Runs every case, then fails once listing each failing case (first with its traceback)."""
    failures = []
    for case in cases:
        try:
            run(case)
        except Exception:
            failures.append(f"[{case}]\n" + traceback.format_exc(limit=None if not failures else 0))
    if failures:
        pytest.fail(f"{len(failures)} of {len(cases)} cases failed:\n\n" + "\n\n".join(failures), pytrace=False)


# ---------------------------------------------------------------- tests


@gpu
def test_page_sizes_and_layouts(seed):
    """Every page size, each with the three layouts and three pool paddings (0, 16, 48) in a
    Latin square, through the main, KV and append entries (int32 and int64 slots in turn)."""
    cases = []
    for i, page_size in enumerate(PAGE_SIZES):
        for j, layout in enumerate(("3D", "HND", "NHD")):
            geometry = dict(page_size=page_size, layout=layout, pad=(0, 16, 48)[(i + j) % 3])
            dtype = (torch.int32, torch.int64)[(i + j) % 2]
            cases += [
                Case(slots=33, slot_dtype=dtype, **geometry),
                Case(entry="kv", compress_ratio=1 + j % 2, slot_dtype=dtype, **geometry),
                Case(entry="append", slot_dtype=dtype, **geometry),
            ]
    run_cases(cases)


@gpu
def test_slot_mappings(seed):
    """int32 and int64 slots with -1, other negatives and out-of-range values; slot_mapping
    shorter than the rows (DP padding, down to empty); more rows than cache slots."""
    cases = [
        Case(entry=entry, tokens=40, slots=n, slot_dtype=dtype)
        for entry in ("main", "kv")
        for dtype in (torch.int32, torch.int64)
        for n in (40, 29, 1, 0)
    ]
    cases += [Case(entry=entry, tokens=40, pages=1, page_size=16) for entry in ("main", "kv", "append")]
    run_cases(cases)


@gpu
def test_heads_and_padding(seed):
    """Heads 1, 5, 8, 16, 64, 128 with every legal q_head_padded (0 and each padding >= heads),
    apply_q_rope both ways; every other case also has out-of-range positions."""
    cases = []
    for heads in (1, 5, 8, 16, 64, 128):
        for padded in (0, *(p for p in abi.Q_HEAD_PADDINGS if p >= heads)):
            for apply_q_rope in (True, False):
                cases.append(
                    Case(tokens=13, slots=11, heads=heads, q_head_padded=padded, apply_q_rope=apply_q_rope,
                         page_size=64, bad_positions=len(cases) % 2 == 1)
                )
    run_cases(cases)


@gpu
def test_q_inplace(seed):
    """In place for heads 8..128 with q_head_padded 0 and = heads, apply_q_rope both ways: q's RoPE
    dims rotated (NoPE dims untouched), q itself returned, the cache as the reference."""
    cases = []
    for heads in abi.Q_HEAD_PADDINGS:
        for padded in (0, heads):
            for apply_q_rope in (True, False):
                i = len(cases)
                cases.append(
                    Case(tokens=21, slots=17, heads=heads, q_head_padded=padded, q_inplace=True,
                         apply_q_rope=apply_q_rope, page_size=(1, 16, 256)[i % 3],
                         bad_positions=i % 2 == 0, rows=("random", "crafted")[i // 2 % 2])
                )
    run_cases(cases)


@gpu
def test_q_inplace_rejections(seed):
    """In place with an unsupported head count or with head padding raises ValueError before
    anything is written."""
    for heads, padded, apply_q_rope in [(5, 0, True), (5, 8, True), (1, 0, False), (1, 8, True),
                                        (8, 16, True), (16, 32, False), (32, 128, True), (16, 8, True)]:
        args = args_of("main", make_inputs(Case(tokens=4, heads=heads)))
        before = [storage_bytes(a) for a in args]
        with pytest.raises(ValueError, match="q_inplace|q_head_padded"):
            gpu_entry(ENTRIES["main"])(*args, q_head_padded=padded, apply_q_rope=apply_q_rope, q_inplace=True)
        synchronize(DEVICE)
        for name, b, a in zip(ARG_NAMES["main"], before, args):
            assert torch.equal(b, storage_bytes(a)), f"heads={heads}, q_head_padded={padded}: {name} was written"


@gpu
def test_kv_entry(seed):
    """compress_ratio 1 and 2 on odd and even positions, out-of-range ones included (an odd
    max_position makes position max_position a valid ratio-2 insert at row max_position - 1)."""
    cases = []
    for ratio in (1, 2):
        for page_size in (3, 64):
            for max_position in (4097, 7):
                i = len(cases)
                cases.append(
                    Case(entry="kv", tokens=64, slots=60, compress_ratio=ratio, page_size=page_size,
                         max_position=max_position, bad_positions=True, layout=("3D", "NHD")[i % 2],
                         slot_dtype=(torch.int32, torch.int64)[i // 2 % 2])
                )
    run_cases(cases)


@gpu
def test_main_without_q_is_kv_entry(seed):
    """q_head_padded=0 (not in place) writes the cache exactly as the KV entry with ratio 1 and
    returns an empty [T, 0, 512] BF16 tensor."""
    inputs = make_inputs(Case(tokens=50, slots=45, q_head_padded=0, bad_positions=True, rows="crafted"))
    main_args = [clone(a) for a in args_of("main", inputs)]
    kv_args = [clone(a) for a in args_of("kv", inputs)]
    out = gpu_entry(ENTRIES["main"])(*main_args, q_head_padded=0)
    gpu_entry(ENTRIES["kv"])(*kv_args, compress_ratio=1)
    synchronize(DEVICE)
    assert (out.dtype, tuple(out.shape), out.device) == (torch.bfloat16, (50, 0, abi.HEAD_DIM), main_args[0].device)
    report = bytes_mismatch(storage_bytes(main_args[2]), storage_bytes(kv_args[1]), cache_locator(kv_args[1]), "main vs kv cache")
    assert report is None, report


@gpu
def test_num_tokens(seed):
    """T = 0, 1, 37, 4096 through the main (padded and in place), KV and append entries; rows
    present but no slots at all."""
    cases = []
    for tokens in (0, 1, 37, 4096):
        cases += [
            Case(tokens=tokens),
            Case(tokens=tokens, q_inplace=True, q_head_padded=0),
            Case(entry="kv", tokens=tokens, compress_ratio=2),
            Case(entry="append", tokens=tokens),
        ]
    cases += [Case(tokens=3, slots=0), Case(tokens=3, slots=0, q_head_padded=0), Case(entry="kv", tokens=5, slots=0)]
    run_cases(cases)


@gpu
def test_over_65536_rows(seed):
    """One launch over more than 65536 rows: 70000 tokens (q_out of 1 head padded to 8), the KV
    and append entries over 70000 rows, and 1024 tokens x 128 heads (131072 q_out rows)."""
    big = 70_000
    run_cases([
        Case(tokens=big, slots=big - 1000, heads=1, q_head_padded=8, page_size=64),
        Case(entry="kv", tokens=big, page_size=64, compress_ratio=2, bad_positions=True),
        Case(entry="append", tokens=big, page_size=64, slot_dtype=torch.int32),
        Case(tokens=1024, heads=128, q_head_padded=128, page_size=64, bad_positions=True),
        Case(tokens=1024, heads=128, q_head_padded=0, q_inplace=True, page_size=64, bad_positions=True),
    ])


@gpu
def test_crafted_values(seed):
    """Rows full of ties, signed zeros, tiny groups, subnormals, BF16-max values, inf and NaN (in
    q, kv and latent rows), with real and wild RoPE tables, through every entry."""
    crafted = dict(rows="crafted", tokens=300)
    run_cases([
        Case(heads=5, q_head_padded=8, **crafted),
        Case(heads=5, q_head_padded=8, table="wild", bad_positions=True, **crafted),
        Case(heads=16, q_head_padded=32, apply_q_rope=False, **crafted),
        Case(heads=16, q_head_padded=0, q_inplace=True, table="wild", **crafted),
        Case(heads=8, q_head_padded=8, q_inplace=True, bad_positions=True, **crafted),
        Case(entry="kv", compress_ratio=1, table="wild", **crafted),
        Case(entry="kv", compress_ratio=2, bad_positions=True, **crafted),
        Case(entry="append", page_size=3, **crafted),
        Case(entry="pack", page_size=16, pages=20, layout="NHD", rows="crafted"),
    ])


@gpu
def test_known_answer_row(seed):
    """SPEC section 4's known answer, checked on the bytes directly: data bytes 0..7 are
    80 91 A2 B3 C4 D5 E6 F7, group 0's scale 0x38, every other byte of the record zero and every
    byte outside it still the canary."""
    row = torch.zeros(1, abi.HEAD_DIM)
    row[0, :16] = torch.tensor([0, -0.0, 0.5, -0.5, 1, -1, 1.5, -1.5, 2, -2, 3, -3, 4, -4, 6, -6])
    latent = row.to(torch.bfloat16).to(DEVICE)
    page_size, pad, slot = 4, 16, 5
    cache = make_cache(2, page_size, "HND", pad, device=DEVICE)
    gpu_entry(ENTRIES["append"])(latent, torch.tensor([slot], device=DEVICE), cache)
    expected = torch.full_like(storage_bytes(cache), CANARY)
    page_stride = page_size * abi.RECORD_BYTES + pad
    page, entry = divmod(slot, page_size)
    data = page * page_stride + entry * abi.DATA_BYTES
    scale = page * page_stride + page_size * abi.DATA_BYTES + entry * abi.SCALE_BYTES
    expected[data : data + abi.DATA_BYTES] = 0
    expected[data : data + 8] = torch.tensor([0x80, 0x91, 0xA2, 0xB3, 0xC4, 0xD5, 0xE6, 0xF7], dtype=torch.uint8)
    expected[scale : scale + abi.SCALE_BYTES] = 0
    expected[scale] = 0x38
    report = bytes_mismatch(storage_bytes(cache), expected, cache_locator(cache), "known-answer cache")
    assert report is None, report


@gpu
def test_position_safety(seed):
    """SPEC section 5 'Ours, safety': positions outside [0, max_position) (negative, max_position,
    huge; tables of 1 and 0 rows) are never inserted; their live q_out heads are BF16 NaN with
    apply_q_rope, copied without; in place they are left untouched. Besides the reference
    comparison, the NaN heads, zero padded heads and untouched records are checked directly."""

    def run(case: Case):
        got, args = check_case(case)
        positions = args[ARG_NAMES[case.entry].index("positions")].cpu()
        if case.entry == "kv":
            rope_row = torch.div(positions, case.compress_ratio, rounding_mode="floor") * case.compress_ratio
        else:
            rope_row = positions
        outside = (rope_row < 0) | (rope_row >= case.max_position)
        assert outside.any(), "the case has no out-of-range position"
        if case.entry == "main" and case.q_head_padded and not case.q_inplace:
            q_out = bits(got).cpu()
            if case.apply_q_rope:
                assert (q_out[outside, : case.heads] == abi.BF16_NAN_BITS).all(), "live heads of bad rows are not NaN"
            assert (q_out[:, case.heads :] == 0).all(), "padded heads are not zero"
        cache, slot_mapping = (args[ARG_NAMES[case.entry].index(n)] for n in ("cache", "slot_mapping"))
        slots = slot_mapping.cpu().long()[outside[: slot_mapping.numel()]]
        slots = slots[(slots >= 0) & (slots < case.num_pages * case.page_size)]
        num_pages, page_size, page_stride = validation.check_cache(cache)
        raw = storage_bytes(cache)
        for slot in slots.tolist():
            page, entry = divmod(slot, page_size)
            data = page * page_stride + entry * abi.DATA_BYTES
            scale = page * page_stride + page_size * abi.DATA_BYTES + entry * abi.SCALE_BYTES
            record = torch.cat((raw[data : data + abi.DATA_BYTES], raw[scale : scale + abi.SCALE_BYTES]))
            assert (record == CANARY).all(), f"slot {slot} of an out-of-range position was written"

    bad = dict(tokens=64, bad_positions=True)
    run_cases([
        Case(heads=5, q_head_padded=8, **bad),
        Case(heads=5, q_head_padded=8, apply_q_rope=False, **bad),
        Case(heads=8, q_head_padded=0, q_inplace=True, **bad),
        Case(heads=8, q_head_padded=8, q_inplace=True, apply_q_rope=False, **bad),
        Case(heads=16, q_head_padded=16, max_position=1, **bad),
        Case(heads=16, q_head_padded=16, max_position=0, **bad),  # an empty table
        Case(entry="kv", compress_ratio=1, max_position=0, **bad),
        Case(entry="kv", compress_ratio=2, max_position=7, **bad),
        Case(entry="kv", compress_ratio=2, max_position=4097, **bad),
    ], run=run)


@gpu
def test_debug_check_env(seed, monkeypatch):
    """NVFP4_MLA_CHECK=1 (SPEC section 5): good inputs (padding slots included) still match the
    reference; an out-of-range position or a repeated valid slot raises ValueError before any
    write. The variable is read at import; the module attribute it sets is flipped here."""
    monkeypatch.setattr(nvfp4_mla.validation, "DEBUG_CHECKS", True)
    case = Case(tokens=24)
    check_case(case)
    for problem in ("position", "slot"):
        inputs = make_inputs(dataclasses.replace(case, bad_slots=False))
        if problem == "position":
            inputs["positions"][5] = case.max_position
        else:
            inputs["slot_mapping"][7] = inputs["slot_mapping"][2]
        args = args_of("main", inputs)
        before = storage_bytes(inputs["cache"])
        with pytest.raises(ValueError):
            gpu_entry(ENTRIES["main"])(*args, **case.kwargs())
        synchronize(DEVICE)
        assert torch.equal(before, storage_bytes(inputs["cache"])), f"bad {problem}: the cache was written"


@gpu
def test_append_entry(seed):
    """The unfused writer with random slots (invalid ones and DP padding included) on every page
    size, layout, padding and slot dtype, random and crafted rows."""
    run_cases([
        Case(entry="append", tokens=50, slots=(50, 44)[i % 2], page_size=page_size,
             layout=("3D", "HND", "NHD")[i % 3], pad=(0, 48, 16)[i // 2 % 3],
             slot_dtype=(torch.int64, torch.int32)[i % 2], rows=("random", "crafted")[i // 3 % 2])
        for i, page_size in enumerate(PAGE_SIZES)
    ])


@gpu
def test_pack_entry(seed):
    """Whole pages to a new HND or NHD cache: equal to the reference, and to the append entry
    writing every slot in order into a canary cache of the same layout (also for zero pages)."""

    def run(case: Case):
        packed, (latent,) = check_case(case)
        cache = make_cache(case.num_pages, case.page_size, case.layout, device=DEVICE)
        slots = torch.arange(case.num_pages * case.page_size, device=DEVICE)
        gpu_entry(ENTRIES["append"])(latent.reshape(-1, abi.HEAD_DIM), slots, cache)
        synchronize(DEVICE)
        report = bytes_mismatch(flat_bytes(packed), storage_bytes(cache), cache_locator(cache), "pack vs append")
        assert report is None, report

    run_cases([
        Case(entry="pack", layout=layout, page_size=page_size, pages=pages, rows=("random", "crafted")[i % 2])
        for layout in ("HND", "NHD")
        for i, (page_size, pages) in enumerate(((1, 7), (3, 5), (16, 4), (32, 3), (64, 3), (256, 2), (16, 0)))
    ], run=run)


@gpu
def test_reference_same_on_cpu_and_cuda(seed):
    """The reference gives the same bytes on the GPU as on the CPU (the large cases above compare
    against the reference run on the GPU)."""
    crafted = dict(rows="crafted", tokens=200, bad_positions=True)
    cases = [
        Case(heads=5, q_head_padded=8, table="wild", **crafted),
        Case(heads=16, q_head_padded=0, q_inplace=True, table="wild", **crafted),
        Case(entry="kv", compress_ratio=2, table="wild", **crafted),
        Case(entry="append", **crafted),
        Case(entry="pack", page_size=16, pages=8, layout="HND", rows="crafted"),
    ]
    run_cases(cases, run=lambda case: check_case(case, ref_device="cpu", impl=getattr(reference, ENTRIES[case.entry])))


@gpu
def test_mixed_devices_rejected(seed):
    """One argument left on the CPU: ValueError 'must be a CUDA tensor', nothing written."""
    inputs = make_inputs(Case(tokens=4))
    for name in ARG_NAMES["main"]:
        args = [t.cpu() if n == name else t for n, t in zip(ARG_NAMES["main"], args_of("main", inputs))]
        if name == "cache":
            args[2] = make_cache(3, 16, device="cpu")
        with pytest.raises(ValueError, match="must be a CUDA tensor"):
            gpu_entry(ENTRIES["main"])(*args, q_head_padded=16)


def test_cpu_tensors_rejected(seed):
    """CPU tensors passed to a GPU entry raise ValueError 'must be a CUDA tensor' (the argument
    checks come before any compile or launch, so this runs without a GPU)."""
    for entry in ENTRIES:
        case = Case(entry=entry, tokens=4, pages=2, layout="HND")
        args = args_of(entry, make_inputs(case, device="cpu"))
        with pytest.raises(ValueError, match="must be a CUDA tensor"):
            gpu_entry(ENTRIES[entry])(*args, **case.kwargs())
