"""The ``mma.sync`` backend of ``sparse_mla_decode``: ``kernels/nvfp4_mla_decode.cu`` on every GPU
from sm_80 up (BF16 ``m16n8k16`` tensor-core products, 16, 32 or 64 heads a block), and the one
that takes every call no other backend prefers.

docs/kernels/decode_mma.md describes the block's work. Page sizes, slot dtypes, head counts,
lengths and sinks are run-time arguments: each is used once per selected token or per row, next
to 512 dequantized values and 4 * 512 * head_tile MMA flops, so specializing on them would only
multiply the builds.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, NamedTuple

from .. import abi
from ..device import Device
from ..jit import Template, included_headers
from .decode_backend import ATTEND_PARAMS, HEAD_TILE_OVERRIDE, Attention, DecodeBackend
from .decode_scheduler import SCHEDULE_DEFINES

if TYPE_CHECKING:
    from .library import KernelLibrary

SOURCE = "nvfp4_mla_decode.cu"
BLOCK_N = 32  # selected tokens a tile
HEAD_TILES = (16, 32, 64)  # heads a block; the largest that fits the GPU's shared memory
# Warps sharing a row block of 16 heads, each a slice of the 512 dims: 2 give a warp 256 output
# dims (128 fp32 accumulators a thread: one block of 8 warps an SM at 64 heads); 4 halve that, for
# blocks of 4 or 8 warps at 16 and 32 heads.
DIM_SPLITS = {16: 4, 32: 4, 64: 2}


def attend_threads(head_tile: int) -> int:
    """Threads of an attention block: a warp per (row block of 16 heads, dims slice)."""
    return 32 * head_tile // 16 * DIM_SPLITS[head_tile]


def q_in_registers(head_tile: int) -> bool:
    """Whether a warp keeps its Q fragments in registers (a dims slice of 128: 32 registers a
    thread), else in shared memory (64 heads a block, whose 128 accumulators a thread leave no room)."""
    return DIM_SPLITS[head_tile] == 4


def shared_bytes(head_tile: int) -> int:
    """Dynamic shared memory of the attention kernel with ``head_tile`` heads a block (its layout
    is in the kernel, which checks this count)."""
    return (
        (0 if q_in_registers(head_tile) else head_tile * abi.HEAD_DIM * 2)  # Q, as MMA fragments
        + BLOCK_N * (abi.HEAD_DIM + 8) * 2  # K (= V): padded BF16 rows
        + BLOCK_N * abi.RECORD_BYTES  # the tile's records
        + attend_threads(head_tile) * 4 * 4 * 4  # partial scores: 4 n-tiles x 4 fp32 a thread
        + 2 * BLOCK_N * 8  # record addresses
        + 2 * BLOCK_N * 8  # slots of two tiles
        + 16  # live-token masks of two tiles
        + 256 * 4  # every E4M3 scale byte as a BF16 pair
    )


class MmaAttentionSpec(NamedTuple):
    """One build of the ``mma.sync`` attention kernel: ``head_tile`` heads a block."""

    head_tile: int

    @staticmethod
    @functools.cache
    def of(head_tile: int) -> MmaAttentionSpec:
        if head_tile not in HEAD_TILES:
            raise ValueError(f"head_tile must be one of {HEAD_TILES}, got {head_tile!r}")
        return MmaAttentionSpec(head_tile)

    @property
    def threads(self) -> int:
        return attend_threads(self.head_tile)

    @property
    def shared_bytes(self) -> int:
        return shared_bytes(self.head_tile)

    @property
    def template(self) -> Template:
        return Template(
            SOURCE,
            "nvfp4_mla_decode",
            ATTEND_PARAMS,
            self.threads,
            self.shared_bytes,
            included_headers(SOURCE),
            dependent_launch=True,
        )

    def defines(self) -> dict[str, int]:
        """The kernel's ``-D`` constants."""
        return {
            "HEAD_TILE": self.head_tile,
            "DIM_SPLIT": DIM_SPLITS[self.head_tile],
            "BLOCK_N": BLOCK_N,
            "SMEM_BYTES": self.shared_bytes,
            **SCHEDULE_DEFINES,
        }

    def describe(self) -> str:
        """The kernel in words, e.g. ``decode attention (mma.sync), 32 heads a block``."""
        return f"decode attention (mma.sync), {self.head_tile} heads a block"


def choose_head_tile(num_heads: int, shared_optin: int) -> int:
    """The smallest head tile holding every head, else the largest whose shared memory fits
    ``shared_optin`` bytes (a block's opt-in maximum: 99 KiB on sm_86/89/120, more on sm_80/90/100)."""
    fitting = [t for t in HEAD_TILES if shared_bytes(t) <= shared_optin]
    return next((t for t in fitting if t >= num_heads), fitting[-1])


def specs(arch: str) -> tuple[MmaAttentionSpec, ...]:
    """Every attention kernel of this backend (the head tile is chosen at run time)."""
    return tuple(MmaAttentionSpec.of(t) for t in HEAD_TILES)


def attention(lib: KernelLibrary, device: Device, num_heads: int, dim_parts: int) -> Attention:
    """The attention kernel of a call with ``num_heads`` heads (``lib.decode_head_tile`` overrides
    the head tile); ``dim_parts`` is 1, this kernel's one form: its items are whole output rows."""
    head_tile = lib.decode_head_tile or choose_head_tile(num_heads, device.shared_optin)
    spec = lib.spec(MmaAttentionSpec.of(head_tile))
    launcher = lib.launcher(device.index, spec)
    return Attention(launcher, spec.head_tile, BLOCK_N, max(launcher.resident_blocks, 1))


def prefers(num_heads: int, rows: int, tokens: int) -> bool:
    """Every shape: the backend of last resort."""
    return True


BACKEND = DecodeBackend("mma_sync", 80, 10**9, specs, attention, prefers, frozenset({HEAD_TILE_OVERRIDE}))
