"""What every backend of ``sparse_mla_decode`` shares: the attention kernels' parameters, the
declaration of a backend, and what a backend decides for a call.

An attention kernel (``nvfp4_mla_decode`` in any of its backends' files) takes the ``Params`` of
:data:`ATTEND_PARAMS` and works on items (query row, head tile, split of the selected tokens, and
where a backend splits them, a part of the 512 output dims), the head tile fastest, a block each
or (``Attention.max_blocks``) walked by at most that many blocks in turn: it writes ``out`` and
``lse`` itself without splits, else unnormalized fp32 partial outputs that the op's combine kernel
merges in split order. A backend is one module that declares :class:`DecodeBackend`;
``ops.decode`` lists the backends and holds the rule that picks one.
"""

from __future__ import annotations

import re
import struct
from collections.abc import Callable
from typing import TYPE_CHECKING, NamedTuple

from ..device import Device
from ..jit import KernelSpec
from ..launch import Launcher

if TYPE_CHECKING:
    from .library import KernelLibrary

DECODE_HEADER = "nvfp4_mla_decode.cuh"  # what the attention kernels share, beside the numerics header

# The attention kernels' Params (their static_asserts check the size): 6 pointers (q, out, lse,
# partial_o, partial_ml, sinks), two pools (3 pointers and 6 int64 each), 4 int64 (rows, heads,
# splits, tiles a split) and sm_scale * log2(e) as a double.
ATTEND_PARAMS = struct.Struct("<6Q3Q6q3Q6q4qd")


class Attention(NamedTuple):
    """A backend's attention kernel for a call shape on one device."""

    launcher: Launcher  # its launches ask for the template's shared memory (launcher.shared_bytes)
    head_tile: int  # heads a block
    tile_tokens: int  # selected tokens a tile (splits are whole tiles)
    # The most blocks of a launch, each walking items in turn (block b: items b, b + grid, ...);
    # 0: a block an item.
    max_blocks: int = 0
    dim_parts: int = 1  # the parts of a row's output dims, an item each
    # Whether a row's two halves run as a pair of blocks that share each dequantized tile (the
    # plan weighs half rows by that).
    halves_pair: bool = False
    # Kernels whose Params end with a tensor map of q: (num_heads, rows) -> that map for q's
    # address (the bytes of the last field).
    q_map: Callable[[int, int], Callable[[int], bytes]] | None = None


class DecodeBackend(NamedTuple):
    """One kernel family of ``sparse_mla_decode``."""

    name: str
    min_capability: int  # the GPUs it runs on: compute capability in [min, max] (90 for sm_90)
    max_capability: int
    specs: Callable[[str], tuple[KernelSpec, ...]]  # every kernel it may launch on a GPU of this arch
    # (library, device, num_heads, dim_parts) -> its attention kernel for a call (loaded through
    # the library), each item's output dims in dim_parts parts (one of the dim_parts below)
    attention: Callable[[KernelLibrary, Device, int, int], Attention]
    dim_parts: tuple[int, ...] = (1,)  # the parts it may split a row's output dims into

    def supports(self, capability: int) -> bool:
        return self.min_capability <= capability <= self.max_capability


def arch_capability(arch: str) -> int:
    """90 for "sm_90" or "sm_90a"."""
    match = re.fullmatch(r"sm_(\d+)[af]?", arch)
    if match is None:
        raise ValueError(f"arch must look like 'sm_90', got {arch!r}")
    return int(match.group(1))
