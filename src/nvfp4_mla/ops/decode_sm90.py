"""The ``wgmma`` backend of ``sparse_mla_decode``: ``kernels/nvfp4_mla_decode_sm90.cu`` on Hopper
(sm_90, built for sm_90a: wgmma and setmaxnreg exist only there).

64 heads a block (wgmma's M), tiles of 64 selected tokens, three warpgroups: a producer that
gathers the records and dequantizes them exactly into shared memory, and two consumers that run
the products and the online softmax. The kernel's header comment describes the block's work.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, NamedTuple

from .. import abi
from ..device import Device
from ..jit import NUMERICS_HEADER, Template
from .attention import ATTEND_PARAMS, DECODE_HEADER, Attention, DecodeBackend

if TYPE_CHECKING:
    from .library import KernelLibrary

SOURCE = "nvfp4_mla_decode_sm90.cu"
HEAD_TILE = 64  # heads a block: the M of every wgmma
BLOCK_N = 64  # selected tokens a tile
THREADS = 3 * 128  # consumer 0, consumer 1, the producer
GATHER_UNIT = 32  # tokens the producer copies at once (two units a tile)
RAW_RECORD_BYTES = abi.RECORD_BYTES + 16  # a copied record in shared memory, padded: conflict-free reads
MBARRIERS = 8


def shared_bytes() -> int:
    """Dynamic shared memory of a block (its layout is in the kernel, which checks this count)."""
    return (
        HEAD_TILE * abi.HEAD_DIM * 2  # Q
        + 2 * BLOCK_N * abi.HEAD_DIM * 2  # K = V, two tile buffers
        + HEAD_TILE * BLOCK_N * 2  # P, for consumer 1
        + 2 * GATHER_UNIT * RAW_RECORD_BYTES  # two units of copied records
        + 256 * 4  # every E4M3 scale byte as a BF16 pair
        + 2 * HEAD_TILE * 4  # a row's rescale and output factors
        + 16  # live tokens of the two tile buffers
        + 16  # live tokens of the two gather units
        + MBARRIERS * 8
    )


class WgmmaAttentionSpec(NamedTuple):
    """The one build of the Hopper attention kernel (64 heads a block)."""

    head_tile: int = HEAD_TILE

    @staticmethod
    @functools.cache
    def of() -> WgmmaAttentionSpec:
        return WgmmaAttentionSpec()

    @property
    def template(self) -> Template:
        headers = (NUMERICS_HEADER, DECODE_HEADER)
        return Template(SOURCE, "nvfp4_mla_decode_sm90", ATTEND_PARAMS, THREADS, shared_bytes(), headers, "sm_90a")

    def defines(self) -> dict[str, int]:
        """The kernel's ``-D`` constants."""
        return {"BLOCK_N": BLOCK_N, "SMEM_BYTES": shared_bytes()}

    def describe(self) -> str:
        return f"decode attention (wgmma, sm_90a), {self.head_tile} heads a block"


def specs(arch: str) -> tuple[WgmmaAttentionSpec, ...]:
    return (WgmmaAttentionSpec.of(),)


def attention(lib: KernelLibrary, device: Device, num_heads: int) -> Attention:
    """The attention kernel of a call (one build: 64 heads a block, heads past num_heads are zero rows)."""
    spec = lib.spec(WgmmaAttentionSpec.of())
    return Attention(lib.launcher(device.index, spec), shared_bytes(), spec.head_tile, BLOCK_N)


BACKEND = DecodeBackend("wgmma_sm90", 90, 90, specs, attention)
