"""Property-based fuzzing of the writers (hypothesis), its regression corpus, and the soak loop.

One strategy, :func:`fuzz_cases`, draws whole calls: the entry and its options, the cache geometry
(page size 1..300, 3-D/HND/NHD, pool padding 0/16/48, number of pages), slot patterns (unique
valid, with -1 and out-of-range slots, DP padding ``n < T``), head counts and ``q_head_padded``,
positions (some outside the table), and row values of several kinds (normal with random
per-group scales, huge, tiny down to BF16 subnormals, ...) with +-0/+-inf/NaN sprinkled.

- CPU (no marker): the reference's invariants, derived independently of its code: bytes outside
  the inserted records keep the 0xA5 canary; each record decodes within half a quantization step
  of its input where the group's scale is a normal E4M3 value (amax/6 in [2^-6, 448]) and
  amax/6 within E4M3 rounding of it; groups whose amax/6 rounds to E4M3 zero decode to zeros,
  saturating ones get scale 448; RoPE bytes are the roped BF16 values (bitwise); q_out's live
  heads are the (rotated) query, all-NaN outside the table, and its padded heads zero bits.
- GPU (``gpu`` marker): kernel == reference, whole storages and returned tensors byte for byte.

The corpus of tests/writers_fuzz_corpus.py runs first through both. Hypothesis keeps no database (CI is
stateless) and draws fresh examples every run; a failure prints the falsifying example, a
``corpus entry`` line to paste into the corpus, and a ``@reproduce_failure`` blob.
"""

from __future__ import annotations

import dataclasses
import math
import os
import subprocess
import sys
import types
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, Phase, given, note, settings
from hypothesis import strategies as st
from writers_fuzz_corpus import CORPUS

from nvfp4_mla import abi, reference
from nvfp4_mla.testing import (
    ARG_NAMES,
    CANARY,
    ENTRIES,
    SPECIAL_BITS,
    Case,
    args_of,
    bits,
    cache_locator,
    check,
    clone,
    crafted_rows,
    make_inputs,
    raw_bytes,
    record_offsets,
    run_reference,
    storage_bytes,
)
from nvfp4_mla.testing.soak import GEOMETRIES, run_soak

DEVICE = "cuda"
gpu = pytest.mark.gpu


def fuzz_settings(max_examples: int, shrink: bool = True):
    """Fresh examples every run, no example database (stateless CI), the failing example printed
    with a ``@reproduce_failure`` blob. ``shrink=False`` reports the first failure as drawn."""
    phases = tuple(p for p in Phase if shrink or p not in (Phase.shrink, Phase.explain))
    return settings(
        max_examples=max_examples,
        deadline=None,
        database=None,
        derandomize=False,
        print_blob=True,
        phases=phases,
        suppress_health_check=[HealthCheck.too_slow],
    )


# Examples per entry (four entries); NVFP4_MLA_FUZZ_EXAMPLES=N sets both, for a longer local run.
_OVERRIDE = os.environ.get("NVFP4_MLA_FUZZ_EXAMPLES")
CPU_EXAMPLES_PER_ENTRY = int(_OVERRIDE or 10)  # 40 in all
GPU_EXAMPLES_PER_ENTRY = int(_OVERRIDE or 15)  # 60 in all


# ---------------------------------------------------------------- row values

VALUE_KINDS = ("normal", "huge", "tiny", "wide", "zeros", "crafted")
# Element replacements of ``specials``: +-0, then nvfp4_mla.testing's +-inf and NaNs (several payloads).
_SPECIAL_BITS = torch.tensor((0, -0x8000, *SPECIAL_BITS), dtype=torch.int16)


def _log_uniform(size, low: float, high: float) -> torch.Tensor:
    return torch.exp(torch.empty(size, dtype=torch.float64).uniform_(math.log(low), math.log(high)))


def _kind_bits(kind: str, size: tuple) -> torch.Tensor:
    """BF16 bits (int16) of ``size = (groups, 16)`` values of one kind."""
    if kind == "crafted":  # nvfp4_mla.testing's ties, saturation, tiny groups, inf/NaN
        return crafted_rows(size).view(torch.int16)
    sign = torch.where(torch.rand(size) < 0.5, -1.0, 1.0).double()
    if kind == "normal":  # random per-group scales 2^-24 .. 2^15: E4M3 underflow to saturation
        values = torch.randn(size).double() * torch.exp2(torch.randint(-24, 16, (size[0], 1)).double())
    elif kind == "huge":
        values = sign * _log_uniform(size, 1e30, 3e38)
    elif kind == "tiny":  # down to BF16 subnormals (below 1.2e-38)
        values = sign * _log_uniform(size, 1e-40, 1e-3)
    elif kind == "wide":  # every magnitude in one group
        values = sign * _log_uniform(size, 1e-40, 3e38)
    elif kind == "zeros":
        values = sign * 0.0
    else:
        raise ValueError(kind)
    return values.float().to(torch.bfloat16).view(torch.int16)


def fuzz_rows(shape, kinds, specials: float) -> torch.Tensor:
    """BF16 ``shape`` (last dim a multiple of 16): each group of 16 of one kind from ``kinds``, then
    a ``specials`` fraction of elements replaced by +-0, +-inf or NaN. Uses torch's CPU generator."""
    groups = math.prod(shape) // abi.GROUP_SIZE
    size = (groups, abi.GROUP_SIZE)
    by_kind = torch.stack([_kind_bits(kind, size) for kind in kinds])
    choice = torch.randint(len(kinds), (1, groups, 1)).expand(1, *size)
    out = by_kind.gather(0, choice)[0]
    sprinkle = torch.rand(size) < specials
    out = torch.where(sprinkle, _SPECIAL_BITS[torch.randint(len(_SPECIAL_BITS), size)], out)
    return out.view(torch.bfloat16).reshape(shape)


# ---------------------------------------------------------------- cases

_CASE_FIELDS = {f.name: f.default for f in dataclasses.fields(Case)}
_DTYPES = {"int32": torch.int32, "int64": torch.int64}


@dataclasses.dataclass(frozen=True)
class FuzzCase:
    """One fuzzed call: the geometry and options (an nvfp4_mla.testing.Case), the value kinds of its
    rows, and the seed of everything drawn at random; ``edits`` are explicit values (corpus)."""

    case: Case
    values: tuple = ("normal",)
    specials: float = 0.0
    seed: int = 0
    edits: tuple = ()
    name: str = ""

    def __str__(self):
        extra = f", edits={len(self.edits)}" if self.edits else ""
        drawn = f"values={list(self.values)} specials={self.specials} seed={self.seed}{extra}"
        return f"{self.name or 'fuzz'}: {self.case} {drawn}"

    def as_dict(self) -> dict:
        """The corpus form (tests/writers_fuzz_corpus.py): Case fields that differ from the defaults."""
        d: dict[str, Any] = {"name": self.name or "FILL_IN", "entry": self.case.entry}
        for name, default in _CASE_FIELDS.items():
            value = getattr(self.case, name)
            if name != "entry" and value != default:
                d[name] = str(value).removeprefix("torch.") if name == "slot_dtype" else value
        d.update(seed=self.seed, values=list(self.values), specials=self.specials)
        if self.edits:
            d["edits"] = [list(e) for e in self.edits]
        return d

    @classmethod
    def from_dict(cls, d: dict) -> FuzzCase:
        d = dict(d)
        own = {k: d.pop(k) for k in ("name", "seed", "values", "specials", "edits") if k in d}
        if "slot_dtype" in d:
            d["slot_dtype"] = _DTYPES[d["slot_dtype"]]
        own["values"] = tuple(own.get("values", ("normal",)))
        own["edits"] = tuple(tuple(e) for e in own.get("edits", ()))
        return cls(case=Case(**d), **own)


CORPUS_CASES = [FuzzCase.from_dict(d) for d in CORPUS]

PAGE_SIZES = st.one_of(st.sampled_from((1, 2, 3, 16, 64, 256, 300)), st.integers(1, 300))


@st.composite
def fuzz_cases(draw, entry: str | None = None) -> FuzzCase:
    """A random call of ``entry`` (default: any entry), small enough for the CPU reference."""
    entry = entry or draw(st.sampled_from(tuple(ENTRIES)))
    page_size = draw(PAGE_SIZES)
    fields = dict(entry=entry, page_size=page_size)
    if entry == "pack":
        fields.update(
            layout=draw(st.sampled_from(abi.KV_LAYOUTS)), pages=draw(st.integers(0, max(1, 600 // page_size)))
        )
    else:
        num_tokens = draw(st.integers(0, 40))
        fields.update(
            num_tokens=num_tokens,
            layout=draw(st.sampled_from(("3D", *abi.KV_LAYOUTS))),
            pad=draw(st.sampled_from((0, 16, 48))),
            pages=draw(st.one_of(st.none(), st.integers(0, 4))),  # None: room for every row
            slots=draw(st.one_of(st.none(), st.integers(0, num_tokens))),  # None: one a row; fewer: DP padding
            slot_dtype=draw(st.sampled_from((torch.int32, torch.int64))),
            bad_slots=draw(st.booleans()),  # -1 and out-of-range slots; else unique valid ones
            bad_positions=draw(st.booleans()),
            max_position=draw(st.sampled_from((4097, 64, 7, 1, 0))),  # 0: an empty table
            table=draw(st.sampled_from(("real", "wild"))),
        )
    if entry == "main":
        num_heads = draw(st.sampled_from((1, 3, 8, 16, 40, 64, 128)))
        inplace = num_heads in abi.Q_HEAD_PADDINGS and draw(st.booleans())
        paddings = (0, num_heads) if inplace else (0, *(p for p in abi.Q_HEAD_PADDINGS if p >= num_heads))
        fields.update(
            num_heads=num_heads,
            q_inplace=inplace,
            q_head_padded=draw(st.sampled_from(paddings)),
            apply_q_rope=draw(st.booleans()),
        )
    if entry == "kv":
        fields.update(compress_ratio=draw(st.sampled_from(abi.COMPRESS_RATIOS)))
    values = draw(st.lists(st.sampled_from(VALUE_KINDS), min_size=1, max_size=3, unique=True))
    specials = draw(st.sampled_from((0.0, 0.01, 0.2)))
    return FuzzCase(Case(**fields), tuple(values), specials, draw(st.integers(0, 2**31 - 1)))


def apply_edits(inputs: dict, edits) -> None:
    """Writes each ``(name, index, values)`` edit (see tests/writers_fuzz_corpus.py) into ``inputs``."""
    for name, index, values in edits:
        t = inputs[name]
        *lead, start = index
        target = t[tuple(lead)] if lead else t
        source = torch.tensor(values, dtype=torch.float64 if t.is_floating_point() else torch.int64)
        target[start : start + len(values)] = source.to(t.dtype)


def fuzz_inputs(fc: FuzzCase, device="cpu") -> dict:
    """The named inputs of ``fc`` on ``device``: drawn on the CPU from ``fc.seed`` (without
    disturbing the global generator), q and kv rows replaced by ``fuzz_rows``, then the edits."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(fc.seed)
        inputs = make_inputs(fc.case, device="cpu")
        for name in ("q", "kv"):
            if name in inputs:
                inputs[name] = fuzz_rows(inputs[name].shape, fc.values, fc.specials)
    apply_edits(inputs, fc.edits)
    return {name: clone(t, device) for name, t in inputs.items()}  # clone keeps pool padding


# ---------------------------------------------------------------- reference invariants (CPU)


def inserted_rows(case: Case, inputs: dict):
    """Which rows the call must insert, by docs/format.md section 5 (not by the reference's code): the row
    indices, their slots and their RoPE rows (None for append/pack, which do not rotate)."""
    if case.entry == "pack":
        slots = torch.arange(case.num_pages * case.page_size)
        return slots, slots, None
    slots = inputs["slot_mapping"].long()
    n, capacity = slots.shape[0], case.num_pages * case.page_size
    keep = (slots >= 0) & (slots < capacity)
    rope_rows = None
    if case.entry in ("main", "kv"):
        positions = inputs["positions"][:n]
        ratio = case.compress_ratio if case.entry == "kv" else 1
        rope_rows = torch.div(positions, ratio, rounding_mode="floor") * ratio
        keep &= (positions >= 0) & ((positions + 1) % ratio == 0)
        keep &= (rope_rows >= 0) & (rope_rows < case.max_position)
    rows = keep.nonzero().flatten()
    return rows, slots[rows], None if rope_rows is None else rope_rows[rows]


def half_step_bound(v: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
    """Largest error of NVFP4 with scale ``d`` at ``v`` (fp64): half the E2M1 step around |v|/d
    (0.25 below 2, 0.5 below 4, 1 above, which also covers the clip at 6 of |v|/d <= 6.4), plus
    slack for the fp32 rounding of v * (1/d)."""
    y = v.abs() / d
    half = torch.where(y < 2, 0.25, torch.where(y < 4, 0.5, 1.0))
    return half * d + v.abs() * 2.0**-20


def assert_nope_decodes(v: torch.Tensor, got: torch.Tensor, scale_codes: torch.Tensor, where: str) -> None:
    """Quantization of BF16 ``v`` against its read-back ``got`` (both ``[k, 28, 16]``) and the
    stored scale bytes ``[k, 28]``, group by group, by group amax (subnormals flushed)."""
    v, got = v.double(), got.double()
    finite = torch.isfinite(v).all(-1)
    amax = torch.where(v.abs() < 2.0**-126, 0.0, v.abs()).amax(-1)
    sf = amax / 6
    d = reference.e4m3_value(scale_codes).double()

    normal = finite & (sf >= 2.0**-6) & (sf <= 448)  # scale neither saturates nor underflows
    bad = normal & ((d - sf).abs() > sf * 2.0**-4 * (1 + 2.0**-10))
    assert not bad.any(), f"{where}: E4M3 scale not amax/6 rounded, groups {bad.nonzero()[:4].tolist()}"
    err = (got - v).abs()
    over = normal[..., None] & ~(err <= half_step_bound(v, d[..., None]))
    if over.any():
        r, g, e = over.nonzero()[0].tolist()
        raise AssertionError(
            f"{where}: row {r} group {g} element {e}: input {v[r, g, e].item()!r} decodes to "
            f"{got[r, g, e].item()!r}, scale {d[r, g].item()!r} (amax {amax[r, g].item()!r}); "
            f"{int(over.sum())} elements over half a step"
        )
    underflow = finite & (sf < 2.0**-10 * (1 - 2.0**-8))  # amax/6 rounds to E4M3 zero
    assert (scale_codes[underflow] == 0).all(), f"{where}: an underflowing group has a nonzero scale"
    assert (got[underflow] == 0).all(), f"{where}: an underflowing group does not decode to zeros"
    saturated = finite & (sf > 448 * (1 + 2.0**-20))
    assert (scale_codes[saturated] == abi.E4M3_MAX_CODE).all(), f"{where}: a saturating group's scale is not 448"


def assert_canary_elsewhere(cache: torch.Tensor, offsets: torch.Tensor, slot_mapping, where: str) -> None:
    raw = storage_bytes(cache)
    outside = torch.ones(raw.numel(), dtype=torch.bool)
    outside[offsets.flatten()] = False
    changed = (outside & (raw != CANARY)).nonzero().flatten()
    if changed.numel():
        locate = cache_locator(cache, slot_mapping)
        first = int(changed[0])
        raise AssertionError(
            f"{where}: {changed.numel()} bytes outside the inserted records changed; first {first}: {locate(first)}"
        )


def assert_q_out(case: Case, q: torch.Tensor, got: torch.Tensor, positions, cos_sin_cache, where: str) -> None:
    """q_out (or q in place): live heads are q with its RoPE dims rotated (copied without
    apply_q_rope), NoPE dims bitwise; a row outside the table has all-NaN live heads (left
    untouched in place); padded heads are zero bits."""
    t, h = q.shape[0], q.shape[1]
    in_range = ((positions >= 0) & (positions < case.max_position))[:, None, None]
    safe = torch.where(in_range[:, 0, 0], positions, 0)
    table = cos_sin_cache[safe] if case.max_position else torch.zeros(t, abi.ROPE_DIM)
    rotated = reference.rope(q[..., abi.NOPE_DIM :], table[:, None, : abi.ROPE_PAIRS], table[:, None, abi.ROPE_PAIRS :])
    want = bits(q).clone()
    if case.apply_q_rope:
        want[..., abi.NOPE_DIM :] = torch.where(in_range, bits(rotated), want[..., abi.NOPE_DIM :])
        if not case.q_inplace:
            want = torch.where(in_range, want, torch.tensor(abi.BF16_NAN_BITS, dtype=torch.int16))
    if case.q_inplace or case.q_head_padded:
        assert torch.equal(bits(got[:, :h]), want), (
            f"{where}: live q heads are not q rotated (or NaN outside the table)"
        )
    if not case.q_inplace:
        assert tuple(got.shape) == (t, case.q_head_padded, abi.HEAD_DIM), f"{where}: q_out shape {list(got.shape)}"
        assert (bits(got[:, h:]) == 0).all(), f"{where}: padded q_out heads are not zero bits"


def check_reference_invariants(fc: FuzzCase) -> None:
    """The reference on ``fc``'s inputs (CPU), held to the invariants of the module docstring."""
    case = fc.case
    inputs = fuzz_inputs(fc)
    got, args_after = run_reference(case.entry, args_of(case.entry, inputs), case.kwargs(), "cpu")
    after = dict(zip(ARG_NAMES[case.entry], args_after))
    rows, slots, rope_rows = inserted_rows(case, inputs)
    kv = inputs["kv"].reshape(-1, abi.HEAD_DIM)[rows]
    cache = got if case.entry == "pack" else after["cache"]
    offsets = record_offsets(cache, slots)
    if case.entry != "pack":  # pack returns a new cache: no canary, every byte is a record
        assert_canary_elsewhere(cache, offsets, inputs["slot_mapping"], str(fc))
    records = storage_bytes(cache)[offsets]  # [k, 384]

    assert (records[:, abi.DATA_BYTES + abi.NUM_GROUPS :] == 0).all(), f"{fc}: scale slot padding not zero"
    if rope_rows is None:
        want_rope = kv[:, abi.NOPE_DIM :]
    else:
        table = inputs["cos_sin_cache"][rope_rows]
        want_rope = reference.rope(kv[:, abi.NOPE_DIM :], table[:, : abi.ROPE_PAIRS], table[:, abi.ROPE_PAIRS :])
    got_rope = records[:, abi.NOPE_BYTES : abi.DATA_BYTES].contiguous().view(torch.int16)
    assert torch.equal(got_rope, bits(want_rope)), f"{fc}: RoPE bytes are not the roped BF16 values"
    decoded = reference.nvfp4_dequantize_sparse_mla_cache(cache, slots)[:, : abi.NOPE_DIM]
    grouped = (abi.NUM_GROUPS, abi.GROUP_SIZE)
    assert_nope_decodes(
        kv[:, : abi.NOPE_DIM].unflatten(-1, grouped),
        decoded.unflatten(-1, grouped),
        records[:, abi.DATA_BYTES : abi.DATA_BYTES + abi.NUM_GROUPS],
        str(fc),
    )
    if case.entry == "main":
        assert_q_out(case, inputs["q"], got, inputs["positions"], inputs["cos_sin_cache"], str(fc))


@pytest.mark.parametrize("fc", CORPUS_CASES, ids=lambda fc: fc.name)
def test_reference_corpus(fc):
    check_reference_invariants(fc)


@pytest.mark.parametrize("entry", tuple(ENTRIES))
@fuzz_settings(CPU_EXAMPLES_PER_ENTRY)
@given(data=st.data())
def test_reference_fuzz(entry, data):
    fc = data.draw(fuzz_cases(entry), label="case")
    note(f"corpus entry: {fc.as_dict()!r}")
    check_reference_invariants(fc)


def test_strategy_reaches_every_shape():
    """The strategy's draws cover what the fuzz tests claim (a guard against a narrowed strategy)."""
    seen = set()

    @fuzz_settings(300)
    @given(fc=fuzz_cases())
    def collect(fc):
        c = fc.case
        seen.update({("entry", c.entry), ("layout", c.layout), ("pad", c.pad), ("big page", c.page_size > 256)})
        if c.entry != "pack":
            seen.update(
                {
                    ("dp padding", c.num_slots < c.num_tokens),
                    ("bad slots", c.bad_slots),
                    ("bad positions", c.bad_positions),
                }
            )
        if c.entry == "main":
            seen.update({("in place", c.q_inplace), ("padded", c.q_head_padded > c.num_heads)})
        seen.update(("kind", k) for k in fc.values)

    collect()
    want: set[tuple[str, object]] = {("entry", e) for e in ENTRIES} | {("layout", lay) for lay in ("3D", "HND", "NHD")}
    want |= {("pad", p) for p in (0, 16, 48)} | {("kind", k) for k in VALUE_KINDS}
    want |= {(k, True) for k in ("big page", "dp padding", "bad slots", "bad positions", "in place", "padded")}
    assert want <= seen, sorted(want - seen)


def test_fuzz_rows_value_kinds():
    """fuzz_rows gives what its kinds promise: huge magnitudes, BF16 subnormals, and specials."""
    torch.manual_seed(0)
    huge = fuzz_rows((64, 512), ("huge",), 0.0).float().abs()
    assert (huge >= 0.99e30).all() and (huge <= 3.01e38).all()
    tiny = fuzz_rows((64, 512), ("tiny",), 0.0).float().abs()
    assert ((tiny > 0) & (tiny < 2.0**-126)).any() and (tiny <= 1.01e-3).all()
    special = fuzz_rows((64, 512), ("normal",), 0.2)
    assert torch.isnan(special).any() and torch.isinf(special).any() and (torch.signbit(special) & (special == 0)).any()


# ---------------------------------------------------------------- kernel == reference (GPU)


def check_kernel(fc: FuzzCase) -> None:
    """The GPU entry and the reference (on CPU copies) on ``fc``'s inputs: equal bytes everywhere."""
    inputs = fuzz_inputs(fc, DEVICE)
    check(fc.case.entry, args_of(fc.case.entry, inputs), fc.case.kwargs(), label=str(fc), ref_device="cpu")


@gpu
@pytest.mark.parametrize("fc", CORPUS_CASES, ids=lambda fc: fc.name)
def test_kernel_corpus(fc):
    check_kernel(fc)


# No shrinking on the GPU: each shrink step may compile a new kernel variant, and a broken kernel
# would spend minutes there; the drawn case is printed (and pasteable into the corpus) as it is.
@gpu
@pytest.mark.parametrize("entry", tuple(ENTRIES))
@fuzz_settings(GPU_EXAMPLES_PER_ENTRY, shrink=False)
@given(data=st.data())
def test_kernel_fuzz(entry, data):
    fc = data.draw(fuzz_cases(entry), label="case")
    note(f"corpus entry: {fc.as_dict()!r}")
    check_kernel(fc)


# ---------------------------------------------------------------- the soak loop on the CPU


def soak_on_cpu(geometries, impl, calls: int, sample_every: int):
    """The soak loop on the CPU, eager only, two calls a step, ``impl`` as the kernels."""
    return run_soak(
        geometries,
        calls=calls,
        calls_per_step=2,
        sample_every=sample_every,
        eager_fraction=1.0,
        device="cpu",
        impl=impl,
        use_graphs=False,
        seed=0,
        log=lambda *a: None,
    )


def test_soak_logic_on_cpu():
    """The soak loop with the reference standing in for the kernels: every geometry stepped and
    checked (the sampled steps and each geometry's final one), no mismatch."""
    result = soak_on_cpu(GEOMETRIES, reference, calls=40, sample_every=4)
    assert result.mismatches == 0, result.reports
    assert result.checks >= len(GEOMETRIES) + 40 // 4 // 2
    assert result.calls == 40 + 2 * len(GEOMETRIES)


@pytest.mark.parametrize("entry", tuple(ENTRIES))
def test_soak_catches_a_wrong_byte(entry):
    """A stand-in that bumps one byte after each call of ``entry`` is reported as mismatching."""

    def corrupt(name):
        def wrapped(*args, **kwargs):
            out = getattr(reference, name)(*args, **kwargs)
            target = out if isinstance(out, torch.Tensor) and out.numel() else args[ARG_NAMES[entry].index("cache")]
            raw_bytes(target)[target.storage_offset() * target.element_size()] += 1  # twice != 0
            return out

        return wrapped

    impl = types.SimpleNamespace(**{n: getattr(reference, n) for n in ENTRIES.values()})
    setattr(impl, ENTRIES[entry], corrupt(ENTRIES[entry]))
    geometries = [g for g in GEOMETRIES if g.entry == entry][:1]
    result = soak_on_cpu(geometries, impl, calls=4, sample_every=1)
    assert result.mismatches == result.checks > 0
    assert "differ" in result.reports[0]


@pytest.mark.skipif(torch.cuda.is_available(), reason="would run the soak")
def test_soak_script_needs_a_gpu():
    """benchmarks/soak.py, run as a script without a usable GPU, exits 2 and says why."""
    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "PYTHONPATH": str(root / "src")}  # as docs/testing.md runs it
    command = [sys.executable, str(root / "benchmarks" / "soak.py"), "--calls", "10"]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stderr
    assert "needs a CUDA GPU" in done.stderr
