"""The writer kernel's NVFP4 quantizer (docs/format.md section 4) against the reference, exhaustively.

The kernel decides E2M1 codes by comparing BF16 magnitudes with per-scale thresholds
(kernels/nvfp4_numerics.cuh, "the quantizer's fast path") and keeps the scalar fp32 path for
NaN groups and zero scales. These tests put every BF16 bit pattern, as an element, under every E4M3
scale code the format produces, and every awkward value (NaN, inf, -0, subnormals, E2M1 ties) at
every position of a group, through the append and KV entries: whole canary-filled storages must
agree with the reference byte for byte. The threshold tables of the header are checked here too,
on the CPU, against the reference's rounding of every (scale code, BF16 magnitude).

The GPU tests run twice: on the native kernels and on PTX of sm_80 JIT-compiled by the driver,
which takes the header's sm_80 branches (masked magnitudes, the E4M3 conversions in software).
"""

from __future__ import annotations

import re

import pytest
import torch

import nvfp4_mla
from nvfp4_mla import abi, jit, reference
from nvfp4_mla.testing import SPECIAL_BITS, VirtualArchKernels, check, make_cache, rope_table

DEVICE = "cuda"
PAGE_SIZE = 64
BF16_PATTERNS = 1 << 16
MAGNITUDES = torch.arange(0x7F81, dtype=torch.int32)  # +0 .. +inf: every non-NaN BF16 magnitude
SM80_LIBRARY = nvfp4_mla.KernelLibrary(VirtualArchKernels("sm_80"))


@pytest.fixture(params=["native", "sm_80 PTX"])
def kernels(request):
    """The library the entries run on: the native kernels, or sm_80's code paths JIT-compiled for this GPU."""
    return None if request.param == "native" else SM80_LIBRARY


def bf16_of(bits: torch.Tensor) -> torch.Tensor:
    """BF16 tensor of int bit patterns 0..0xFFFF."""
    signed = torch.where(bits < 0x8000, bits, bits - 0x10000)
    return signed.to(torch.int16).view(torch.bfloat16)


def scale_codes(magnitudes: torch.Tensor) -> torch.Tensor:
    """The E4M3 scale code (step 4) of a group whose amax is the BF16 magnitude ``magnitudes``."""
    amax = reference.flush_subnormal(bf16_of(magnitudes).float())
    return reference.e4m3_code(reference.mul_f32(amax, torch.tensor(reference.R6))).long()


def amax_for_every_code() -> torch.Tensor:
    """One random BF16 magnitude per E4M3 scale code 0..0x7E (fresh each run), plus +0 (amax 0):
    every scale a NaN-free group can get, and both kinds of zero scale."""
    codes = scale_codes(MAGNITUDES)
    picks = [torch.zeros(1, dtype=torch.int32)]
    for code in range(abi.E4M3_MAX_CODE + 1):
        candidates = MAGNITUDES[codes == code]
        assert candidates.numel(), f"no BF16 amax gives scale code {code:#x}"
        picks.append(candidates[torch.randint(candidates.numel(), (1,))])
    return torch.cat(picks)


def sweep_groups(amax: int) -> torch.Tensor:
    """Groups ``[n, 16]`` of int bit patterns: one element of magnitude ``amax`` (random sign and
    position) and 15 others that together take all 65536 BF16 patterns. The patterns are sorted by
    magnitude, so a group's other values are alike and any of them at most ``amax`` is quantized
    under ``amax``'s scale; the rest (and the NaN patterns) make groups of their own scales."""
    order = torch.argsort((torch.arange(BF16_PATTERNS) & 0x7FFF) * 2 + torch.randint(2, (BF16_PATTERNS,)))
    swept = torch.arange(BF16_PATTERNS)[order]
    width = abi.GROUP_SIZE - 1
    swept = torch.cat((swept, swept[: -len(swept) % width])).view(-1, width)
    n = swept.shape[0]
    lead = torch.full((n, 1), amax) | (torch.randint(2, (n, 1)) << 15)
    groups = torch.cat((lead, swept), dim=1)
    positions = torch.argsort(torch.rand(n, abi.GROUP_SIZE), dim=1)  # the amax element anywhere
    return groups.gather(1, positions)


def rows_of_groups(groups: torch.Tensor) -> torch.Tensor:
    """BF16 rows ``[n, 512]`` holding ``groups`` (shuffled, padded with copies) in their NoPE dims and
    random bit patterns (NaN included) in their RoPE dims."""
    groups = groups[torch.randperm(groups.shape[0])]
    groups = torch.cat((groups, groups[: -groups.shape[0] % abi.NUM_GROUPS]))
    nope = groups.reshape(-1, abi.NOPE_DIM)
    rope = torch.randint(BF16_PATTERNS, (nope.shape[0], abi.ROPE_DIM))
    return bf16_of(torch.cat((nope, rope), dim=1))


def special_groups(copies: int) -> torch.Tensor:
    """Groups with an awkward value at each of the 16 positions, ``copies`` times each: NaN (several
    signs and payloads), +-inf, +-0, BF16 subnormals, the largest BF16, E2M1 ties of the group's
    scale (amax 6 * 2^k: its elements at 0.25 .. 5 times the scale and one BF16 step either side),
    among random normal values, some with a second awkward value elsewhere."""
    awkward = torch.tensor([b & 0xFFFF for b in SPECIAL_BITS] + [0x0000, 0x8000, 0x0001, 0x807F, 0x7F7F, 0xFF7F])
    n = copies * abi.GROUP_SIZE * awkward.numel()
    scale = torch.exp2(torch.randint(-8, 8, (n, 1)).float())
    values = torch.randn(n, abi.GROUP_SIZE) * scale
    ties = torch.tensor((0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0))[torch.randint(7, (n, abi.GROUP_SIZE))]
    tie_groups = torch.rand(n, 1) < 0.5
    values = torch.where(tie_groups, ties * scale, values)
    values[:, :1] = torch.where(tie_groups, 6 * scale, values[:, :1])  # the tie groups' amax
    bits = values.to(torch.bfloat16).view(torch.int16).to(torch.int64) & 0xFFFF
    step = torch.randint(-1, 2, bits.shape) * tie_groups  # ties, or one step off
    bits = torch.where((bits & 0x7FFF) == 0, bits, bits + step)
    index = torch.arange(n)
    position = index % abi.GROUP_SIZE
    bits[index, position] = awkward[index // abi.GROUP_SIZE % awkward.numel()]
    second = torch.rand(n) < 0.25
    bits[index[second], (position[second] + torch.randint(1, 16, (int(second.sum()),))) % abi.GROUP_SIZE] = awkward[
        torch.randint(awkward.numel(), (int(second.sum()),))
    ]
    return bits


def append_call(rows: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Arguments of the append entry writing ``rows`` to random distinct slots of a canary cache."""
    n = rows.shape[0]
    num_pages = -(-n // PAGE_SIZE) + 1
    slots = torch.randperm(num_pages * PAGE_SIZE)[:n]
    return rows.to(DEVICE), slots.to(DEVICE), make_cache(num_pages, PAGE_SIZE, device=DEVICE)


@pytest.mark.gpu
def test_every_bf16_pattern_under_every_scale_code(seed, kernels):
    """All 65536 BF16 patterns, as an element beside an amax fixing each of the 128 possible
    scales (0x00 .. 0x7E, and amax 0), through the append entry: about 560k groups."""
    groups = torch.cat([sweep_groups(int(a)) for a in amax_for_every_code()])
    rows = rows_of_groups(groups)
    for start in range(0, rows.shape[0], 8192):  # a few calls, each checked as a whole storage
        rows_chunk = append_call(rows[start : start + 8192])
        check("append", rows_chunk, {}, label=f"sweep rows {start}+", ref_device=DEVICE, library=kernels)


@pytest.mark.gpu
@pytest.mark.parametrize("entry", ["append", "kv"])
def test_awkward_values_at_every_position(entry, seed, kernels):
    """NaN, inf, zeros, subnormals, the BF16 maximum and E2M1 ties at each position of a group,
    mixed with random groups in the same warps, through the append and KV entries."""
    groups = torch.cat((special_groups(copies=64), sweep_groups(int(amax_for_every_code()[1 + 0x38]))))
    rows = rows_of_groups(groups)
    args = append_call(rows)
    if entry == "append":
        check(entry, args, {}, label="awkward groups", ref_device=DEVICE, library=kernels)
        return
    kv, slots, cache = args
    max_position = 4096
    positions = torch.randint(max_position, (kv.shape[0],), device=DEVICE)
    check(
        entry,
        (kv, cache, slots, positions, rope_table(max_position, DEVICE)),
        {"compress_ratio": 1},
        label="awkward groups",
        ref_device=DEVICE,
        library=kernels,
    )


def header_constant(name: str) -> int:
    """A ``#define`` of the numerics header as an integer."""
    text = jit.source(jit.NUMERICS_HEADER)
    match = re.search(rf"^#define {name} \(?(-?(?:0x[0-9A-Fa-f]+|\d+))u?\)?$", text, re.MULTILINE)
    assert match, f"{name} not found in {jit.NUMERICS_HEADER}"
    return int(match.group(1), 0)


def header_thresholds(code: int) -> list[int]:
    """The kernel's thresholds T1..T7 (BF16 magnitudes) for scale ``code``, from the header's tables,
    computed the way e2m1_thresholds does."""
    d = int(reference.e4m3_value(torch.tensor(code)).view(torch.int32)) & 0xFFFFFFFF
    m = (d >> 20) & 7
    deltas = [header_constant("E2M1_DELTA1")]
    for k in (2, 3, 4):
        table = header_constant(f"E2M1_DELTA{k}_LO") | header_constant(f"E2M1_DELTA{k}_HI") << 32
        deltas.append(header_constant(f"E2M1_DELTA{k}") + (table >> (8 * m) & 0xFF))
    t = [(d >> 16) + delta for delta in deltas]
    return [*t, t[2] + 128, t[3] + 128, t[2] + 256]


def test_threshold_tables_match_the_reference():
    """For every nonzero scale code and every non-NaN BF16 magnitude (zeros, subnormals, inf), the
    number of header thresholds reached is the reference's E2M1 magnitude code (steps 5-7)."""
    values = bf16_of(MAGNITUDES).float()
    for code in range(1, abi.E4M3_MAX_CODE + 1):
        inv = 1.0 / reference.e4m3_value(torch.tensor(code))  # fp32 division: correctly rounded
        y = reference.flush_subnormal(reference.mul_f32(reference.flush_subnormal(values), inv))
        want = reference.e2m1_code(y).long()
        thresholds = header_thresholds(code)
        assert thresholds == sorted(set(thresholds)), f"code {code:#x}: thresholds not increasing"
        got = sum((t <= MAGNITUDES).long() for t in thresholds)
        assert isinstance(got, torch.Tensor)  # thresholds is not empty
        wrong = (got != want).nonzero().flatten()
        assert wrong.numel() == 0, f"code {code:#x}: magnitudes {[hex(int(m)) for m in wrong[:8]]}"
