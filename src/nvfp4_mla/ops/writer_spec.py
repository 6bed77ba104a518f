"""The build spec of the writer kernel, ``kernels/nvfp4_mla_write.cu``: one vocabulary for every
writer entry, and the launch grid it plans.

A :class:`WriterSpec` is everything that specializes the kernel (its ``-D`` constants). Field
names are the entries' argument names. Each entry's build (its spec from its arguments) and the
builds CI compiles are in :mod:`.writers`, beside the entries' descriptions.
"""

from __future__ import annotations

import enum
from typing import NamedTuple

from .. import abi
from ..jit import Template, included_headers
from ..params import ParamsLayout, int64, pointer


class QMode(enum.IntEnum):
    """What the kernel does with the query."""

    NONE = 0  # cache only
    PADDED = 1  # write the head-padded q_out
    IN_PLACE = 2  # rotate q's RoPE dims in place


UNIT_THREADS = 64  # a work unit: one thread per 16-byte chunk of a 512-dim BF16 row (the query's work)
WARPS_PER_UNIT = UNIT_THREADS // 32  # the KV rows' work is a warp a row
Q_ROWS_PER_UNIT = 4  # 16-byte query loads in flight per thread: rows of q_out, or groups of 8 heads in place
UNITS_PER_BLOCK = 4

WRITE_PARAMS = ParamsLayout(
    "Params",
    [
        pointer("q", "const uint4*", "[num_tokens, NUM_HEADS, 64 chunks]"),
        pointer("q_out", "uint4*", "[num_tokens, Q_HEADS, 64 chunks]; q itself in place"),
        pointer("kv", "const uint4*", "[rows, 64 chunks]"),
        pointer("cache", "u8*", "page 0"),
        pointer("slots", "const void*", "[num_kv_rows] int32 or int64"),
        pointer("positions", "const i64*", "[num_tokens]"),
        pointer("cos_sin", "const float*", "[max_position, 64]: cos[32] | sin[32]"),
        int64("page_stride", "bytes"),
        int64("capacity", "num_pages * PAGE_SIZE: valid slots are [0, capacity)"),
        int64("max_position", "rows of cos_sin"),
        int64("num_kv_rows", "rows that may be inserted (slot_mapping.numel())"),
        int64("kv_blocks", "blocks of the KV rows; the query's blocks follow"),
        int64("q_rows", "q_out rows, or in place groups of 8 heads"),
    ],
)
WRITE_SOURCE = "nvfp4_mla_write.cu"
WRITE_TEMPLATE = Template(
    WRITE_SOURCE,
    "nvfp4_mla_write",
    WRITE_PARAMS,
    UNITS_PER_BLOCK * UNIT_THREADS,
    headers=included_headers(WRITE_SOURCE),
)


class WriterSpec(NamedTuple):
    """One build of the writer kernel. Fields an entry does not use are 0 / False."""

    page_size: int
    slot_int64: bool = True  # slot_mapping is int64 (else int32)
    identity_slots: bool = False  # row i goes to slot i (pack)
    kv_rope: bool = True  # rotate the KV row (else it is already roped: append, pack)
    compress_ratio: int = 1
    q_mode: QMode = QMode.NONE
    num_heads: int = 0
    q_head_padded: int = 0  # heads of q_out (q_mode PADDED), num_heads in place
    apply_q_rope: bool = False
    kv_rows_per_warp: int = 1  # KV rows one warp inserts at compress ratio 1 (above it, tiles)

    @property
    def template(self) -> Template:
        return WRITE_TEMPLATE

    # ------------------------------------------------------------ what the kernel needs

    def kv_units(self, num_kv_rows: int) -> int:
        """Work units (64 threads, a warp a row) of the KV rows."""
        return -(-num_kv_rows // (WARPS_PER_UNIT * self.kv_rows_per_warp))

    def q_rows(self, num_tokens: int) -> int:
        """Rows of the query's work: q_out rows, or groups of 8 heads in place."""
        if self.q_mode == QMode.NONE:
            return 0
        return num_tokens * (self.q_head_padded if self.q_mode == QMode.PADDED else self.num_heads // 8)

    def q_units(self, num_tokens: int) -> int:
        """Work units (64 threads) of the query; the last one in place may be partial."""
        return -(-self.q_rows(num_tokens) // Q_ROWS_PER_UNIT)

    def grid(self, num_tokens: int, num_kv_rows: int, resident_blocks: int, sms: int) -> tuple[int, int]:
        """(KV blocks, all blocks) of a launch on a GPU of ``sms`` SMs.

        The KV blocks loop over the KV units, so no more of them than the GPU holds at once
        (``resident_blocks``), and half as many when the query has work: its blocks follow them
        and run beside their loop. The query's blocks do 4 units each, or, for a small query,
        spread over more SMs: a block a row (a group of 8 heads) in place when there are at most as
        many as SMs, else a block a unit when there are at most half as many units as SMs (the
        kernel tells the three apart by the number of blocks). Each choice was the fastest
        measured (docs/performance.md#writer-launch-grid)."""
        cap = resident_blocks if self.q_mode == QMode.NONE else max(1, resident_blocks // 2)
        kv_blocks = min(_blocks(self.kv_units(num_kv_rows)), cap)
        q_rows, q_units = self.q_rows(num_tokens), self.q_units(num_tokens)
        if self.q_mode == QMode.IN_PLACE and q_rows <= sms:
            q_blocks = q_rows
        elif 2 * q_units <= sms:
            q_blocks = q_units
        else:
            q_blocks = _blocks(q_units)
        return kv_blocks, kv_blocks + q_blocks

    def defines(self) -> dict[str, int]:
        """The kernel's ``-D`` constants of this variant."""
        return {
            "PAGE_SIZE": self.page_size,
            "SLOT_INT64": int(self.slot_int64),
            "IDENTITY_SLOTS": int(self.identity_slots),
            "KV_ROPE": int(self.kv_rope),
            "COMPRESS_RATIO": self.compress_ratio,
            "Q_MODE": int(self.q_mode),
            "NUM_HEADS": self.num_heads,
            "Q_HEADS": self.q_head_padded,
            "APPLY_Q_ROPE": int(self.apply_q_rope),
            "Q_ROWS_PER_UNIT": Q_ROWS_PER_UNIT,
            "KV_ROWS_PER_WARP": self.kv_rows_per_warp,
            "UNIT_THREADS": UNIT_THREADS,
        }

    def describe(self) -> str:
        """The kernel in words, e.g. ``writer main, page 256, 8 -> 16 heads, int64 slots``."""
        slots = "" if self.identity_slots else f", {'int64' if self.slot_int64 else 'int32'} slots"
        if self.q_mode == QMode.PADDED:
            rope = "" if self.apply_q_rope else " (no RoPE)"
            what = f"main, {self.num_heads} -> {self.q_head_padded} heads{rope}"
        elif self.q_mode == QMode.IN_PLACE:
            what = f"main, {self.num_heads} heads in place"
        elif self.identity_slots:
            what = "pack"
        elif not self.kv_rope:
            what = "append"
        else:
            what = f"kv, compress ratio {self.compress_ratio}"
        extra = f", {self.kv_rows_per_warp} KV rows a warp" if self.kv_rows_per_warp != 1 else ""
        return f"writer {what}, page {self.page_size}{slots}{extra}"


def _blocks(units: int) -> int:
    return -(-units // UNITS_PER_BLOCK)


assert abi.HEAD_DIM * 2 // 16 == UNIT_THREADS  # one thread per 16-byte chunk of a BF16 row
