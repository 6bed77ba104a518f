"""The split combine of ``sparse_mla_decode``: ``kernels/nvfp4_mla_combine.cu``, shared by every
backend. A warp per (split row, head), :data:`HEADS_A_BLOCK` heads of one split row a block, merges
the row's partial outputs in order and finishes the row (docs/kernels/combine.md): the work list's
split rows and their slots.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, NamedTuple

from ..jit import Template, included_headers
from ..launch import Launcher
from ..params import ParamsLayout, int64, pointer

if TYPE_CHECKING:
    from .library import KernelLibrary

SOURCE = "nvfp4_mla_combine.cu"
HEADS_A_BLOCK = 4
THREADS = 32 * HEADS_A_BLOCK  # a warp a head
MAX_PARTIALS = 512  # partial outputs a row: a warp's weights in shared memory (4 KiB)

COMBINE_PARAMS = ParamsLayout(
    "Params",
    [
        pointer("partial_o", "const float*", "[slots, num_heads, 512]"),
        pointer("partial_ml", "const float2*", "[slots, num_heads]: m (log2), l"),
        pointer("sinks", "const float*", "[num_heads] or null"),
        pointer("out", "uint2*", "BF16 [rows, num_heads, 512]"),
        pointer("lse", "float*", "[rows, num_heads]"),
        int64("num_heads", "heads of q"),
        pointer("split_rows", "const struct SplitRow*", "the work list's split rows"),
        int64("static_list", "the list was written before the call (the host's): read before the wait"),
    ],
)

# The two builds load the first splits' partial rows with the splits' (m, l), so that up to that
# many splits a warp waits for one round trip of loads, not two. The build of 4 takes registers
# that cut the blocks an SM holds, so a call takes it only where its blocks fit the GPU in one
# wave; elsewhere the build of 1, which needs about as many registers as none
# (docs/performance.md#combine-prefetch).
PREFETCH = 4
PREFETCH_WAVES = 1


class CombineSpec(NamedTuple):
    """A build of the split combine, loading the first ``prefetch`` splits' partial rows with the
    splits' (m, l)."""

    max_splits: int = MAX_PARTIALS
    prefetch: int = 0

    @staticmethod
    @functools.cache
    def of(prefetch: int) -> CombineSpec:
        return CombineSpec(MAX_PARTIALS, prefetch)

    @property
    def template(self) -> Template:
        return Template(
            SOURCE,
            "nvfp4_mla_decode_combine",
            COMBINE_PARAMS,
            THREADS,
            0,
            included_headers(SOURCE),
            dependent_launch=True,
        )

    def defines(self) -> dict[str, int]:
        """The kernel's ``-D`` constants."""
        return {"MAX_SPLITS": self.max_splits, "PREFETCH": self.prefetch}

    def describe(self) -> str:
        return f"decode split combine, {self.prefetch} splits prefetched"


def specs() -> tuple[CombineSpec, ...]:
    """Both builds."""
    return CombineSpec.of(PREFETCH_WAVES), CombineSpec.of(PREFETCH)


def blocks(split_rows: int, num_heads: int) -> int:
    """The combine's grid: :data:`HEADS_A_BLOCK` heads of a split row a block."""
    return split_rows * -(-num_heads // HEADS_A_BLOCK)


def launcher(lib: KernelLibrary, device_index: int, num_blocks: int) -> Launcher:
    """The combine of a call of ``num_blocks`` blocks (:func:`blocks`): the build of :data:`PREFETCH`
    where they fit the GPU in one wave, else that of :data:`PREFETCH_WAVES`."""
    found = lib.launcher(device_index, lib.spec(CombineSpec.of(PREFETCH)))
    if num_blocks > found.resident_blocks:
        found = lib.launcher(device_index, lib.spec(CombineSpec.of(PREFETCH_WAVES)))
    return found
