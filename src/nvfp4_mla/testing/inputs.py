"""Inputs of test calls: RoPE tables, random and crafted rows, slots, positions, canary caches, and
:class:`Case`, one call of an entry with the recipe of its inputs."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any

import torch

from .. import abi, reference

CANARY = 0xA5  # the byte a fresh test cache is filled with: any byte a call writes shows

ENTRIES = {  # short name -> the entry's name in nvfp4_mla, nvfp4_mla.ops and nvfp4_mla.reference
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
Device = torch.device | str


# ---------------------------------------------------------------- inputs


def random_rows(shape: Sequence[int], device: Device = "cpu", scale: float = 1.0) -> torch.Tensor:
    """BF16 normal values whose groups of 16 along the last dim each get a random power-of-two
    magnitude in [2^-8, 2^7], so the groups' scales differ."""
    x = torch.randn(*shape, device=device) * scale
    exponents = torch.randint(-8, 8, (*shape[:-1], shape[-1] // abi.GROUP_SIZE), device=device)
    return (x * torch.exp2(exponents.float()).repeat_interleave(abi.GROUP_SIZE, -1)).to(torch.bfloat16)


def random_slots(
    num_rows: int, capacity: int, dtype: torch.dtype = torch.int64, device: Device = "cpu"
) -> torch.Tensor:
    """``num_rows`` distinct valid slots of a cache of ``capacity`` slots (``capacity >= num_rows``)."""
    return torch.randperm(capacity)[:num_rows].to(dtype).to(device)


# E2M1 values and the rounding boundaries between them: times an exact scale 2^k these are exact
# ties of the E2M1 rounding (0.25 -> 0, 0.75 -> 1, ..., 5 -> 4).
E2M1_POINTS = (0.0, 0.25, 0.5, 0.75, 1.0, 1.25, 1.5, 1.75, 2.0, 2.5, 3.0, 3.5, 4.0, 5.0, 6.0)
# Group maxima whose amax/6 is (up to R6's rounding) halfway between two E4M3 values (scale
# ties), then maxima whose scale saturates at 448.
_E4M3 = reference.e4m3_value(torch.arange(abi.E4M3_MAX_CODE + 1)).double()
_MIDS = 6 * (_E4M3[1:] + _E4M3[:-1]) / 2
SCALE_TIES = [*_MIDS[_MIDS.float().to(torch.bfloat16).double() == _MIDS].tolist(), 6 * 448.0, 6 * 464.0, 1e5]
# Group maxima around 6 * 2^-10, below which the scale rounds to E4M3 zero (codes become +-6).
TINY_AMAX = (6 * 2**-10, 6 * 2**-10 - 2**-15, 6 * 2**-10 + 2**-15, 0.004, 0.001, 2**-20, 2**-120)
BF16_MAX = float.fromhex("0x1.fep127")
# +inf, -inf and NaNs with several signs and payloads, as int16 bit patterns.
SPECIAL_BITS = tuple(b - 0x10000 if b >= 0x8000 else b for b in (0x7F80, 0xFF80, 0x7FC0, 0xFFC0, 0x7F81, 0xFFFF))


def crafted_rows(shape: Sequence[int]) -> torch.Tensor:
    """BF16 rows whose groups of 16 each follow one awkward pattern of docs/format.md section 4:
    E2M1 ties at an exact scale, E4M3 scale ties and saturation, zeros of both signs, tiny groups,
    BF16 subnormals, values up to the BF16 maximum, and inf/NaN (several payloads). CPU only."""
    n, g = math.prod(shape[:-1]), shape[-1] // abi.GROUP_SIZE
    size = (n, g, abi.GROUP_SIZE)

    def per_group(values: Sequence[float]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.float32)[torch.randint(len(values), (n, g, 1))]

    def per_element(values: Sequence[float]) -> torch.Tensor:
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
    return torch.where(sprinkle, special, out).view(torch.bfloat16).reshape(*shape)


def make_slots(num_rows: int, capacity: int, dtype: torch.dtype, bad: bool) -> torch.Tensor:
    """Distinct valid slots (``-1`` once the capacity is used up); with ``bad``, about one row in
    eight gets -1, another negative or an out-of-range slot instead."""
    slots = torch.full((num_rows,), -1, dtype=torch.int64)
    valid = min(num_rows, capacity)
    slots[:valid] = random_slots(valid, capacity)
    slots = slots[torch.randperm(num_rows)]
    if bad and num_rows:
        limit = 2**31 if dtype == torch.int32 else 2**62
        values = torch.tensor([-1, -2, capacity, capacity + 1, capacity + 4099, -limit, limit - 1])
        rows = torch.randperm(num_rows)[: max(1, num_rows // 8)]
        slots[rows] = values[torch.randint(len(values), (len(rows),))]
        slots[rows[0]] = -1
    return slots.to(dtype)


def make_positions(num_rows: int, max_position: int, bad: bool) -> torch.Tensor:
    """Random positions in ``[0, max_position)`` (odd and even); with ``bad``, about one row in six
    gets one outside the table (negative, ``max_position`` itself, huge)."""
    positions = torch.randint(0, max(max_position, 1), (num_rows,))
    if bad and num_rows:
        m = max_position
        values = torch.tensor([-1, -2, -m - 1, m, m + 1, 2**40, -(2**40), 2**62, -(2**63)])
        rows = torch.randperm(num_rows)[: max(1, num_rows // 6)]
        positions[rows] = values[torch.randint(len(values), (len(rows),))]
        positions[rows[0]] = -1
        positions[rows[-1]] = m
    return positions


def make_table(max_position: int, kind: str) -> torch.Tensor:
    """``"real"``: :func:`rope_table`. ``"wild"``: fp32 values of every size, ~5% subnormal (RoPE
    keeps subnormals), ~2% +-inf, NaN or +-0."""
    if kind == "real":
        return reference.rope_table(max_position)
    shape = (max_position, abi.ROPE_DIM)
    table = torch.randn(shape) * torch.exp2(torch.randint(-24, 24, shape).float())
    r = torch.rand(shape)
    table = torch.where(r < 0.05, torch.rand(shape) * 2.0**-126, table)
    specials = torch.tensor([math.inf, -math.inf, math.nan, 0.0, -0.0])
    return torch.where(r > 0.98, specials[torch.randint(len(specials), shape)], table)


def make_cache(
    num_pages: int, page_size: int, layout: str = "3D", pad: int = 0, device: Device = "cpu"
) -> torch.Tensor:
    """A cache view filled with the :data:`CANARY` byte.

    Parameters
    ----------
    num_pages, page_size
        The cache geometry.
    layout
        ``"3D"`` (``[num_pages, page_size, 384]``), ``"HND"`` or ``"NHD"``.
    pad
        Extra bytes after each page (a multiple of 16 for a valid cache): a padded pool, whose
        page stride exceeds the page's ``page_size * 384`` bytes.
    device
        Where the cache lives.
    """
    payload = page_size * abi.RECORD_BYTES
    pool = torch.full((num_pages, payload + pad), CANARY, dtype=torch.uint8, device=device)
    pages = pool[:, :payload]
    if layout == "3D":
        return pages.unflatten(1, (page_size, abi.RECORD_BYTES))
    if layout == "HND":
        return pages.unflatten(1, (1, page_size, abi.RECORD_BYTES))
    if layout == "NHD":
        return pages.unflatten(1, (page_size, 1, abi.RECORD_BYTES))
    raise ValueError(f"layout must be 3D, HND or NHD, got {layout!r}")


# ---------------------------------------------------------------- cases


@dataclasses.dataclass(frozen=True)
class Case:
    """One call: the entry, its options, and how its inputs are made."""

    entry: str = "main"  # a key of ENTRIES
    num_tokens: int = 37
    num_heads: int = 8
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
    rows: str = "random"  # "random" (random_rows) or "crafted" (crafted_rows)
    table: str = "real"  # see make_table
    max_position: int = 4096

    def __post_init__(self) -> None:
        if self.entry not in ENTRIES:
            raise ValueError(f"entry must be one of {tuple(ENTRIES)}, got {self.entry!r}")
        layouts = abi.KV_LAYOUTS if self.entry == "pack" else ("3D", *abi.KV_LAYOUTS)
        if self.layout not in layouts:
            raise ValueError(f"layout of a {self.entry} case must be one of {layouts}, got {self.layout!r}")

    def __str__(self) -> str:
        changed = [
            f"{f.name}={getattr(self, f.name)}"
            for f in dataclasses.fields(self)
            if f.name != "entry" and getattr(self, f.name) != f.default
        ]
        return f"{self.entry}({', '.join(changed)})"

    @property
    def num_slots(self) -> int:
        return self.num_tokens if self.slots is None else self.slots

    @property
    def num_pages(self) -> int:
        return self.pages if self.pages is not None else self.num_slots * 5 // 4 // self.page_size + 2

    def kwargs(self) -> dict[str, Any]:
        """The entry's keyword options."""
        if self.entry == "main":
            return dict(q_head_padded=self.q_head_padded, apply_q_rope=self.apply_q_rope, q_inplace=self.q_inplace)
        if self.entry == "kv":
            return dict(compress_ratio=self.compress_ratio)
        if self.entry == "pack":
            return dict(kv_layout=self.layout)
        return {}


def make_inputs(case: Case, device: Device) -> dict[str, torch.Tensor]:
    """The named input tensors of ``case`` on ``device``, drawn on the CPU so that a seed replays."""
    rows = crafted_rows if case.rows == "crafted" else random_rows
    if case.entry == "pack":
        return {"kv": rows((case.num_pages, case.page_size, abi.HEAD_DIM)).to(device)}
    t = case.num_tokens
    made = {
        "kv": rows((t, abi.HEAD_DIM)),
        "slot_mapping": make_slots(case.num_slots, case.num_pages * case.page_size, case.slot_dtype, case.bad_slots),
        "positions": make_positions(t, case.max_position, case.bad_positions),
        "cos_sin_cache": make_table(case.max_position, case.table),
    }
    if case.entry == "main":
        made["q"] = rows((t, case.num_heads, abi.HEAD_DIM))
    made = {name: tensor.to(device) for name, tensor in made.items()}
    made["cache"] = make_cache(case.num_pages, case.page_size, case.layout, case.pad, device=device)
    return made


def args_of(entry: str, inputs: dict[str, torch.Tensor]) -> tuple[torch.Tensor, ...]:
    """The positional arguments of ``entry`` from named inputs."""
    return tuple(inputs[name] for name in ARG_NAMES[entry])
