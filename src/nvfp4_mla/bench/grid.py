"""What the benchmark measures: the grid of rows and the bytes each row must move.

docs/performance.md explains the bytes model. Everything here is pure arithmetic on the rows.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch

from .. import abi
from ..ops.writer_spec import WriterSpec

MAX_POSITION = 65536  # rows of the cos/sin table; positions are uniform in [0, MAX_POSITION)
MAIN_PAGE_SIZE = 256  # main entry, head-padded and in place
KV_PAGE_SIZE = 128  # KV entry, append and pack

ENTRIES = ("main", "inplace", "kv", "append", "pack")
KV_ONLY_ENTRIES = ("kv", "append", "pack")  # no query: the KV rows per warp A/B is theirs
SHIPPED_KV_ROWS_PER_WARP: int = WriterSpec._field_defaults["kv_rows_per_warp"]

MAIN_TOKENS = (1, 8, 64, 384, 4096, 16384)
WIDE_TOKENS = (1, 64, 4096)  # main entry with 64 and 128 heads
OTHER_TOKENS = (1, 64, 4096, 16384)  # in place, KV entry, append
IN_PLACE_LONG_HEADS = (8, 16, 128)  # in place at T = 16384: the heads of the in-place target
# KV entry and append also at T = 65536, out of L2, where the KV targets are judged; the pack
# entry writes whole pages of KV_PAGE_SIZE; kv r1 also at the largest size measured before.
LONG_TOKENS = 65536
PACK_TOKENS = (4096, 16384, LONG_TOKENS)
LONGEST_KV_TOKENS = 262144
# The torch.compile arm spends its budget in this order of tokens (plot rows first): T = 1, 64
# and 4096 carry the speedup targets.
TOKEN_PRIORITY = (1, 4096, 64, 8, 384, 16384, LONG_TOKENS, LONGEST_KV_TOKENS)

# Bytes model: each input read once, each output written once.
BF16_ROW_BYTES = abi.HEAD_DIM * 2  # 1024: a kv row or one query head
ROPE_DIMS_READ_WRITTEN = 2 * abi.ROPE_BYTES  # 256: a head's 64 RoPE dims read and written in place
COS_SIN_ROW_BYTES = abi.ROPE_DIM * 4  # 256: cos[32] | sin[32] in fp32
POSITION_BYTES = 8

# Input sets rotated so that timed calls do not find their data in L2.
ROTATION_FACTOR = 3  # rotate until the sets span this many L2 sizes
MAX_INPUT_SETS = 64


class Row(NamedTuple):
    """One geometry of one entry. Field names are the entries' argument names.

    ``entry`` is "main" (head-padded ``q_out``), "inplace" (``q_inplace=True``), "kv" (the KV
    entry) or "append". In place, ``q_head_padded`` equals ``num_heads``.
    """

    entry: str
    num_tokens: int
    num_heads: int = 0  # live query heads
    q_head_padded: int = 0  # heads of q_out
    page_size: int = MAIN_PAGE_SIZE
    compress_ratio: int = 1  # the KV entry's
    slot_dtype: torch.dtype = torch.int64
    kv_rows_per_warp: int = SHIPPED_KV_ROWS_PER_WARP  # the kernel's (the A/B's rows differ)

    @staticmethod
    def main(num_tokens: int, num_heads: int, q_head_padded: int) -> Row:
        """The main entry writing a head-padded ``q_out``."""
        return Row("main", num_tokens, num_heads, q_head_padded)

    @staticmethod
    def in_place(num_tokens: int, num_heads: int) -> Row:
        """The main entry rotating ``q`` in place."""
        return Row("inplace", num_tokens, num_heads, num_heads)

    @staticmethod
    def kv(num_tokens: int, compress_ratio: int) -> Row:
        """The KV entry."""
        return Row("kv", num_tokens, page_size=KV_PAGE_SIZE, compress_ratio=compress_ratio)

    @staticmethod
    def append(num_tokens: int) -> Row:
        """The append entry (already-roped rows)."""
        return Row("append", num_tokens, page_size=KV_PAGE_SIZE)

    @staticmethod
    def pack(num_tokens: int) -> Row:
        """The pack entry: ``num_tokens / KV_PAGE_SIZE`` whole pages into a new cache."""
        return Row("pack", num_tokens, page_size=KV_PAGE_SIZE)

    @property
    def slot_bytes(self) -> int:
        return self.slot_dtype.itemsize

    @property
    def ships(self) -> bool:
        """Whether the row runs the kernels as shipped (the targets judge only those)."""
        return self.kv_rows_per_warp == SHIPPED_KV_ROWS_PER_WARP

    @property
    def label(self) -> str:
        name = {
            "main": f"main {self.num_heads}->{self.q_head_padded}",
            "inplace": f"in place {self.num_heads}",
            "kv": f"kv r{self.compress_ratio}",
            "append": "append",
            "pack": "pack",
        }[self.entry]
        return name if self.ships else f"{name} ({self.kv_rows_per_warp} rows/warp)"

    @property
    def is_plot_row(self) -> bool:
        return self.entry == "main" and (self.num_heads, self.q_head_padded) == (8, 16)


def full_grid() -> list[Row]:
    """Every row of the full run."""
    rows = [Row.main(t, 8, padded) for padded in (16, 8) for t in MAIN_TOKENS]
    rows += [Row.main(t, h, h) for h in (64, 128) for t in WIDE_TOKENS]
    rows += [
        Row.in_place(t, h)
        for h in (8, 16, 64, 128)
        for t in OTHER_TOKENS
        if t < max(OTHER_TOKENS) or h in IN_PLACE_LONG_HEADS
    ]
    rows += [Row.kv(t, r) for r in (1, 2) for t in (*OTHER_TOKENS, LONG_TOKENS)] + [Row.kv(LONGEST_KV_TOKENS, 1)]
    rows += [Row.append(t) for t in (*OTHER_TOKENS, LONG_TOKENS)]
    rows += [Row.pack(t) for t in PACK_TOKENS]
    return rows


def quick_grid() -> list[Row]:
    """The rows of ``--quick``: the targets' token counts, a few of each entry."""
    rows = [Row.main(t, 8, 16) for t in (1, 64, 4096)] + [Row.main(4096, 8, 8), Row.main(1, 128, 128)]
    rows += [Row.in_place(t, 16) for t in (1, 4096, 16384)]
    rows += [Row.kv(t, 2) for t in (1, 4096)] + [Row.kv(LONG_TOKENS, 1)]
    rows += [Row.append(4096), Row.append(LONG_TOKENS), Row.pack(LONG_TOKENS)]
    return rows


def select_rows(rows: list[Row], entries: tuple[str, ...], kv_rows_per_warp: tuple[int, ...]) -> list[Row]:
    """The rows of ``entries``, each KV-only row (KV entry, append, pack) once per count of KV
    rows a warp in ``kv_rows_per_warp`` (the A/B)."""
    selected = []
    for row in rows:
        if row.entry in entries:
            counts = kv_rows_per_warp if row.entry in KV_ONLY_ENTRIES else (row.kv_rows_per_warp,)
            selected += [row._replace(kv_rows_per_warp=n) for n in counts]
    return selected


def measurement_order(rows: list[Row]) -> list[int]:
    """Indices of ``rows`` in the order they are measured: the compile arm's budget goes first to
    the plotted rows, then to the token counts that carry targets (stable within a tier)."""

    def rank(row: Row) -> tuple[bool, int]:
        tier = TOKEN_PRIORITY.index(row.num_tokens) if row.num_tokens in TOKEN_PRIORITY else len(TOKEN_PRIORITY)
        return (not row.is_plot_row, tier)

    return sorted(range(len(rows)), key=lambda i: rank(rows[i]))


def modelled_bytes(row: Row, inserted_rows: float | None = None) -> float:
    """Bytes a call must move: each input read once, each output written once.

    Parameters
    ----------
    row
        The geometry.
    inserted_rows
        KV rows that pass the compress-ratio test (default ``num_tokens / compress_ratio``); only
        they read their kv row and cos/sin row and write a record. Positions and slots are read for
        every row.
    """
    tokens = row.num_tokens
    inserted = tokens / row.compress_ratio if inserted_rows is None else inserted_rows
    if row.entry == "append":  # already-roped rows: no positions, no cos/sin
        return tokens * (BF16_ROW_BYTES + abi.RECORD_BYTES + row.slot_bytes)
    if row.entry == "pack":  # whole pages: no slots either
        return tokens * (BF16_ROW_BYTES + abi.RECORD_BYTES)
    kv_side = inserted * (BF16_ROW_BYTES + abi.RECORD_BYTES + COS_SIN_ROW_BYTES) + tokens * (
        POSITION_BYTES + row.slot_bytes
    )
    if row.entry == "kv":
        return kv_side
    if row.entry == "inplace":  # only the 64 RoPE dims of each head are read and written
        return kv_side + tokens * row.num_heads * ROPE_DIMS_READ_WRITTEN
    if row.entry == "main":  # live heads read, every padded head written
        return kv_side + tokens * (row.num_heads + row.q_head_padded) * BF16_ROW_BYTES
    raise ValueError(f"unknown entry {row.entry!r}")


def input_set_count(bytes_per_set: float, l2_bytes: int) -> int:
    """How many input sets to rotate over so that timed calls do not find their data in L2."""
    if bytes_per_set >= l2_bytes:
        return 1
    return max(1, min(MAX_INPUT_SETS, math.ceil(ROTATION_FACTOR * l2_bytes / max(bytes_per_set, 1))))
