"""The contract of a ``sparse_mla_decode`` backend: the attention kernels' parameters, what a
backend declares (:class:`DecodeBackend`) and what it gives a call (:class:`Attention`).

An attention kernel takes the ``Params`` of :data:`ATTEND_PARAMS` and walks the call's work list
(:mod:`.decode_scheduler`): a block per (part, head tile, part of the 512 output dims), walking
its part's segments (its tiles of one query row's live entries) in turn. A segment that holds a
whole row writes ``out`` and ``lse`` itself, the others unnormalized fp32 partial outputs at
their slots, which the combine kernel (:mod:`.decode_combine`) merges in order.

A backend declares the GPUs it runs on, its kernels, the shapes it prefers and the
:class:`~nvfp4_mla.ops.library.KernelLibrary` overrides it accepts. The planner
(:mod:`.decode_planner`) takes the first backend in order of preference that runs on the GPU and
prefers the call's shape, and refuses overrides the backend does not declare; it names no backend.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import TYPE_CHECKING, NamedTuple

from ..device import Device
from ..jit import KernelSpec
from ..launch import Launcher
from ..params import ParamsLayout, float64, int64, nested, pointer
from .decode_scheduler import SCHEDULE

if TYPE_CHECKING:
    from .library import KernelLibrary


POOL = ParamsLayout(
    "Pool",
    [
        pointer("cache", "const u8*", "page 0"),
        pointer("slots", "const void*", "[rows, k] int32 or int64"),
        pointer("lens", "const void*", "[rows] int32 or int64, or null (every entry counts)"),
        int64("page_stride", "bytes"),
        int64("page_size", "entries a page"),
        int64("capacity", "num_pages * page_size: valid slots are [0, capacity)"),
        int64("k", "entries a row of the slot table; 0: no such pool"),
        int64("slot_int64", "slots are int64 (else int32)"),
        int64("lens_int64", "lens are int64 (else int32)"),
    ],
)
# The Params of every attention kernel (the Hopper kernel's add a tensor map of q).
ATTEND_PARAMS = ParamsLayout(
    "Params",
    [
        pointer("q", "const u16*", "BF16 [rows, num_heads, 512]"),
        pointer("out", "u32*", "BF16 [rows, num_heads, 512] (no splits)"),
        pointer("lse", "float*", "[rows, num_heads] (no splits)"),
        pointer("partial_o", "float*", "[slots, num_heads, 512]: the segments' partial outputs"),
        pointer("partial_ml", "float*", "[slots, num_heads, 2]: their m (log2) and l"),
        pointer("sinks", "const float*", "[num_heads] or null"),
        nested("swa", POOL, "the sliding-window pool"),
        nested("extra", POOL, "the extra (compressed) pool"),
        int64("rows", "query rows: batch * q_len"),
        int64("num_heads", "heads of q"),
        int64("num_splits", "the host's list: the splits of a row it was dealt from; else 1"),
        float64("score_scale", "sm_scale * log2(e)"),
        pointer("work", "const void*", "the work list's parts (struct WorkPart), 16-byte aligned"),
        int64("static_list", "the list was written before the call (the host's): read before the wait"),
        int64("own_list", "1: each block deals the list after the wait, block 0 writing it at work"),
        nested("schedule", SCHEDULE, "how the list is dealt (own_list)"),
    ],
)


class Attention(NamedTuple):
    """A backend's attention kernel for a call shape on one device."""

    launcher: Launcher  # its launches ask for the template's shared memory (launcher.shared_bytes)
    head_tile: int  # heads a block
    tile_tokens: int  # live entries a tile (segments are whole tiles)
    # Blocks the GPU holds at once (whole clusters): the parts are these over the blocks a part takes.
    max_blocks: int
    dim_parts: int = 1  # the parts of a row's output dims, an item each
    # Whether a row's two halves run as a pair of blocks that share each dequantized tile (the
    # plan weighs half rows by that).
    halves_pair: bool = False
    # Kernels whose Params end with a tensor map of q: (num_heads, rows) -> that map for q's
    # address (the bytes of the last field).
    q_map: Callable[[int, int], Callable[[int], bytes]] | None = None
    # What a segment of the work list costs a block besides its tiles (its query load and output
    # rows), in this kernel's tile-times: the scheduler balances parts by it.
    segment_cost: int = 1
    # Splits of a row up to which the kernel lets the stream's next kernel (the combine) launch at
    # its start, its blocks beside the attention's; 0: never (the next kernel starts after it).
    early_dependents_max_splits: int = 0


# The KernelLibrary fields a backend may accept (DecodeBackend.overrides). Every backend takes
# decode_backend (its own name), decode_parts, and decode_dim_parts among its dim_parts.
HEAD_TILE_OVERRIDE = "decode_head_tile"
OVERRIDES = (HEAD_TILE_OVERRIDE,)


class DecodeBackend(NamedTuple):
    """One kernel family of ``sparse_mla_decode``, as the planner sees it."""

    name: str
    min_capability: int  # the GPUs it runs on: compute capability in [min, max] (90 for sm_90)
    max_capability: int
    specs: Callable[[str], tuple[KernelSpec, ...]]  # every kernel it may launch on a GPU of this arch
    # (library, device, num_heads, dim_parts) -> its attention kernel for a call (loaded through
    # the library), each item's output dims in dim_parts parts (one of the dim_parts below)
    attention: Callable[[KernelLibrary, Device, int, int], Attention]
    # (num_heads, rows, tokens) -> whether it takes a call of rows query rows of num_heads heads over
    # tokens selected tokens a row (both tables' widths), where it runs and no backend before it does
    prefers: Callable[[int, int, int], bool]
    overrides: frozenset[str] = frozenset()  # the OVERRIDES it accepts
    dim_parts: tuple[int, ...] = (1,)  # the parts it may split a row's output dims into

    def supports(self, capability: int) -> bool:
        return self.min_capability <= capability <= self.max_capability


def arch_capability(arch: str) -> int:
    """90 for "sm_90" or "sm_90a"."""
    match = re.fullmatch(r"sm_(\d+)[af]?", arch)
    if match is None:
        raise ValueError(f"arch must look like 'sm_90', got {arch!r}")
    return int(match.group(1))
