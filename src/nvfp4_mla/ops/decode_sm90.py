"""The Hopper backends of ``sparse_mla_decode``: ``kernels/nvfp4_mla_decode_sm90.cu`` on sm_90,
built for sm_90a (wgmma and setmaxnreg exist only there). docs/kernels/decode_sm90.md describes
the kernel.

- ``wgmma_sm90`` (:data:`BACKEND`): 64 heads a block (wgmma's M), tiles of 64 selected tokens,
  three warpgroups: a producer that gathers the records and dequantizes them exactly into shared
  memory, and two consumers that run the products and the online softmax. Two items that gather
  the same tiles run as a cluster of two blocks that share the dequantized tiles, each gathering
  and dequantizing half of every tile into both blocks' shared memory: the two head tiles of a
  query row (65-128 heads), or with one head tile the two halves of a row's output dims.
- ``wgmma_sm90_narrow`` (:data:`NARROW_BACKEND`): the kernel's NARROW build, 16 heads a block as
  the N of every wgmma (S^T = K.Q^T and O^T = V^T.P^T), so no MMA row is padding. One consumer
  warpgroup holds the block's O^T, and the register file this frees runs two producer
  warpgroups, each gathering and dequantizing one of every tile's two halves: at 16 heads the
  64-head build's one producer is what binds.

Both walk the call's work list (:mod:`.decode_scheduler`), like every backend. Where each is
preferred was measured on the H200 (docs/performance.md#decode-backend-rule).
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Any, NamedTuple

from .. import abi
from ..device import Device
from ..jit import Template, included_headers
from ..launch import TENSOR_MAP_BYTES, Bf16TensorMap
from ..params import raw_bytes
from .decode_backend import ATTEND_PARAMS, Attention, DecodeBackend
from .decode_scheduler import SCHEDULE_DEFINES

if TYPE_CHECKING:
    from .library import KernelLibrary

SOURCE = "nvfp4_mla_decode_sm90.cu"
HEAD_TILE = 64  # heads a block: the M of every wgmma
BLOCK_N = 64  # selected tokens a tile
THREADS = 3 * 128  # consumer 0, consumer 1, the producer; NARROW: a consumer, two producers
GATHER_UNIT = 32  # tokens the producer copies at once (two units a tile)
RAW_RECORD_BYTES = abi.RECORD_BYTES + 16  # a copied record in shared memory, padded: conflict-free reads
Q_SLAB_DIMS = 64  # dims of q a tensor copy loads (128-byte rows, the swizzle's width)
# The attention Params, then the tensor map of q (the host's cuTensorMapEncodeTiled: BF16
# [rows, num_heads, 512] as dims (512, num_heads, rows), boxes of 64 dims x HEAD_TILE heads x 1 row,
# 128-byte swizzle, zeros past num_heads), so that one thread's tensor copies load an item's Q.
PARAMS = ATTEND_PARAMS.extended(raw_bytes("q_map", TENSOR_MAP_BYTES, 64, "CUtensorMap of q (q_tensor_map)"))
PARTS = (1, 2)  # an item's output rows: whole, or in two halves (a block each)
NARROW_HEAD_TILE = 16  # the NARROW build: 16 heads a block as wgmma's N, one consumer, two producers
# A segment's cost besides its tiles in the build's tile-times (Attention.segment_cost), as
# benchmarks/segment_cost.py measures it on one part, rounded: whole rows in clusters (each block
# dequantizes half of every tile, so a tile takes less time than a segment's query and outputs)
# and the NARROW build take 2, the other builds 1.
CLUSTER_SEGMENT_COST = 2
NARROW_SEGMENT_COST = 2
# Splits of a row (the host's width split; 1 with a dealt list) up to which the kernel lets the
# stream's next kernel launch at its start: past them the combine's blocks, each long, would pile
# onto the few SMs this grid leaves free (docs/performance.md#programmatic-dependent-launch).
EARLY_DEPENDENTS_MAX_SPLITS = 32

# The shapes each build takes (docs/performance.md#decode-backend-rule), by the call's tiles (query
# rows x a row's tiles of BLOCK_N selections) against NARROW_MIN_TILES: up to NARROW_HEAD_TILE heads
# the NARROW build from that many tiles, the mma.sync kernel below; from WGMMA_MIN_HEADS heads the
# 64-head build, but up to NARROW_FEW_TILES_MAX_HEADS heads the NARROW build (a block per head tile)
# below that many tiles: where each measured the fastest on a dense grid of heads, rows and widths.
WGMMA_MIN_HEADS = 17
NARROW_MIN_TILES = 64
NARROW_FEW_TILES_MAX_HEADS = 48


def producers(head_tile: int) -> int:
    """Producer warpgroups of a block: two in the NARROW build."""
    return 2 if head_tile == NARROW_HEAD_TILE else 1


def shared_bytes(head_tile: int = HEAD_TILE) -> int:
    """Dynamic shared memory of a block (its layout is in the kernel, which checks this count)."""
    narrow = head_tile == NARROW_HEAD_TILE
    # Three per K/V buffer (full, empty, held), two per producer warp (its raw units), two for P
    # between the consumers (not NARROW: one consumer), one for Q.
    mbarriers = 3 * 2 + 2 * 4 * producers(head_tile) + (0 if narrow else 2) + 1
    return (
        head_tile * abi.HEAD_DIM * 2  # Q
        + 2 * BLOCK_N * abi.HEAD_DIM * 2  # K = V, two tile buffers
        + head_tile * BLOCK_N * 2  # P
        + producers(head_tile) * 2 * GATHER_UNIT * RAW_RECORD_BYTES  # two units of copied records a producer
        + 256 * 4  # every E4M3 scale byte as a BF16 pair
        + (0 if narrow else 2 * head_tile * 4)  # a row's rescale and output factors, for consumer 1
        + (2 * 4 * head_tile * 4 if narrow else 0)  # NARROW: the consumer warps' per-head maxima and sums
        + 64  # live tokens of the two tile buffers (per half, per producer warp)
        + mbarriers * 8
    )


class WgmmaAttentionSpec(NamedTuple):
    """A build of the Hopper attention kernel: 64 heads a block (wgmma's M) alone, or as clusters
    of two items that gather the same tiles (``cluster`` 2, see :func:`cluster_of`), each item's
    output rows whole or one of their two halves (``dim_parts`` 2: twice the items, each block
    writing half the bytes); or the NARROW build, 16 heads a block as wgmma's N (``head_tile`` 16,
    the ``wgmma_sm90_narrow`` backend)."""

    head_tile: int = HEAD_TILE
    cluster: int = 1
    dim_parts: int = 1

    @staticmethod
    @functools.cache
    def of(cluster: int, dim_parts: int = 1, head_tile: int = HEAD_TILE) -> WgmmaAttentionSpec:
        return WgmmaAttentionSpec(head_tile, cluster, dim_parts)

    @property
    def template(self) -> Template:
        return Template(
            SOURCE,
            "nvfp4_mla_decode_sm90",
            PARAMS,
            THREADS,
            shared_bytes(self.head_tile),
            included_headers(SOURCE),
            "sm_90a",
            dependent_launch=True,
        )

    def defines(self) -> dict[str, int]:
        """The kernel's ``-D`` constants."""
        return {
            "BLOCK_N": BLOCK_N,
            "HEAD_TILE": self.head_tile,
            "SMEM_BYTES": shared_bytes(self.head_tile),
            "CLUSTER": self.cluster,
            "DIM_PARTS": self.dim_parts,
            "EARLY_DEPENDENTS_MAX_SPLITS": EARLY_DEPENDENTS_MAX_SPLITS,
            **SCHEDULE_DEFINES,
        }

    def describe(self) -> str:
        on_n = " (wgmma's N)" if self.head_tile == NARROW_HEAD_TILE else ""
        pairs = ", clusters of two blocks" if self.cluster == 2 else ""
        halves = ", half rows" if self.dim_parts == 2 else ""
        return f"decode attention (wgmma, sm_90a), {self.head_tile} heads a block{on_n}{pairs}{halves}"


def specs(arch: str) -> tuple[WgmmaAttentionSpec, ...]:
    """The 64-head build's kernels: alone and in clusters, whole and half rows."""
    return tuple(WgmmaAttentionSpec.of(cluster, parts) for parts in PARTS for cluster in (1, 2))


NARROW_SPEC = WgmmaAttentionSpec.of(1, 1, NARROW_HEAD_TILE)


def narrow_specs(arch: str) -> tuple[WgmmaAttentionSpec, ...]:
    return (NARROW_SPEC,)


def cluster_of(num_heads: int, dim_parts: int = 1) -> int:
    """Blocks of a cluster for ``num_heads`` heads in ``dim_parts`` parts: two neighbouring items
    that gather the same tiles, so that each block dequantizes half of every tile. The grid's
    head tile is its fastest index, then the part: the head tiles of a row in pairs when their
    count is even, else with one head tile the two halves of a row, else each block alone.
    Heads past num_heads are zero rows."""
    head_tiles = -(-num_heads // HEAD_TILE)
    return 2 if head_tiles % 2 == 0 or (head_tiles == 1 and dim_parts == 2) else 1


def q_tensor_map(
    num_heads: int, rows: int, head_tile: int = HEAD_TILE, driver: tuple[Any, Any] | None = None
) -> Bf16TensorMap:
    """The map of q (BF16 [rows, num_heads, 512], contiguous) that the kernel loads an item's Q
    through: dims (512, num_heads, rows), boxes of 64 dims x ``head_tile`` heads x 1 row (heads
    past num_heads load as zeros); ``driver`` as :class:`~nvfp4_mla.launch.Bf16TensorMap`'s."""
    row_bytes = abi.HEAD_DIM * 2
    dims, strides = (abi.HEAD_DIM, num_heads, rows), (row_bytes, num_heads * row_bytes)
    return Bf16TensorMap(dims, strides, (Q_SLAB_DIMS, head_tile, 1), driver)


def attention(lib: KernelLibrary, device: Device, num_heads: int, dim_parts: int) -> Attention:
    """The attention kernel of a call: 64 heads a block, in clusters of two blocks where
    :func:`cluster_of` says so, each item's output rows in ``dim_parts`` parts, walking the work
    list."""
    cluster = cluster_of(num_heads, dim_parts)
    spec = lib.spec(WgmmaAttentionSpec.of(cluster, dim_parts))
    launcher = lib.launcher(device.index, spec)
    resident = launcher.resident_blocks
    max_blocks = max(resident - resident % cluster, cluster)
    halves_pair = cluster_of(num_heads, 2) == 2 and cluster_of(num_heads) == 1
    segment_cost = CLUSTER_SEGMENT_COST if cluster == 2 and spec.dim_parts == 1 else 1
    return Attention(
        launcher,
        spec.head_tile,
        BLOCK_N,
        max_blocks,
        spec.dim_parts,
        halves_pair,
        q_tensor_map,
        segment_cost,
        EARLY_DEPENDENTS_MAX_SPLITS,
    )


def narrow_attention(lib: KernelLibrary, device: Device, num_heads: int, dim_parts: int) -> Attention:
    """The NARROW build's kernel of a call: 16 heads a block, whole output rows, walking the work
    list."""
    spec = lib.spec(NARROW_SPEC)
    launcher = lib.launcher(device.index, spec)
    q_map = functools.partial(q_tensor_map, head_tile=NARROW_HEAD_TILE)
    blocks = max(launcher.resident_blocks, 1)
    return Attention(
        launcher, NARROW_HEAD_TILE, BLOCK_N, blocks, 1, False, q_map, NARROW_SEGMENT_COST, EARLY_DEPENDENTS_MAX_SPLITS
    )


def prefers(num_heads: int, rows: int, tokens: int) -> bool:
    """The 64-head build's shapes: every call of WGMMA_MIN_HEADS heads or more (where the NARROW
    build, before it, does not take them)."""
    return num_heads >= WGMMA_MIN_HEADS


def narrow_prefers(num_heads: int, rows: int, tokens: int) -> bool:
    """The NARROW build's shapes: at most NARROW_HEAD_TILE heads over NARROW_MIN_TILES tiles or more,
    and up to NARROW_FEW_TILES_MAX_HEADS heads over fewer."""
    many = rows * -(-tokens // BLOCK_N) >= NARROW_MIN_TILES
    if num_heads <= NARROW_HEAD_TILE:
        return many
    return num_heads <= NARROW_FEW_TILES_MAX_HEADS and not many


BACKEND = DecodeBackend("wgmma_sm90", 90, 90, specs, attention, prefers, frozenset(), PARTS)
NARROW_BACKEND = DecodeBackend("wgmma_sm90_narrow", 90, 90, narrow_specs, narrow_attention, narrow_prefers)
BACKENDS = (NARROW_BACKEND, BACKEND)  # in order of preference
