"""The split combine of ``sparse_mla_decode``: ``kernels/nvfp4_mla_combine.cu``, shared by every
backend. One or four warps per (split row, head) merge the row's partial outputs in order and
finish the row (docs/kernels/combine.md): the work list's split rows and their slots.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple

from ..jit import Template, included_headers
from ..launch import Launcher
from ..params import ParamsLayout, int64, pointer

if TYPE_CHECKING:
    from .library import KernelLibrary

SOURCE = "nvfp4_mla_combine.cu"
THREADS = 128  # four warps a block
MAX_PARTIALS = 512  # partial outputs a row: the weights a warp keeps in shared memory (4 KiB)

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


class CombineSpec(NamedTuple):
    """A build of the split combine: ``warps_a_head`` warps merge a (split row, head), so a block
    holds ``4 // warps_a_head`` heads of a split row, loading the first ``prefetch`` partial rows
    with the partials' (m, l)."""

    warps_a_head: int
    prefetch: int
    max_splits: int = MAX_PARTIALS

    def blocks(self, split_rows: int, num_heads: int) -> int:
        """The grid of a combine of ``split_rows`` rows of ``num_heads`` heads."""
        return split_rows * -(-num_heads // (THREADS // 32 // self.warps_a_head))

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
        return {"MAX_SPLITS": self.max_splits, "PREFETCH": self.prefetch, "WARPS_A_HEAD": self.warps_a_head}

    def describe(self) -> str:
        return f"decode split combine, {self.warps_a_head} warps a head, {self.prefetch} splits prefetched"


# The two builds. Where a combine's blocks of four warps a head fit the GPU at once, SPREAD: each
# thread merges 4 of a head's dims, and 16 partial rows come with the (m, l) loads (one round trip
# up to 16 partials). Elsewhere PACKED: a warp a head, four heads a block, so many (row, head) pairs
# run in fewer waves; one partial row prefetched, about as many registers as none
# (docs/performance.md#split-combine).
SPREAD = CombineSpec(4, 16)
PACKED = CombineSpec(1, 1)


def specs() -> tuple[CombineSpec, ...]:
    """Both builds."""
    return PACKED, SPREAD


def launcher(lib: KernelLibrary, device_index: int, split_rows: int, num_heads: int) -> tuple[Launcher, int]:
    """The combine of ``split_rows`` rows of ``num_heads`` heads and its grid: :data:`SPREAD` where
    its blocks fit the GPU in one wave, else :data:`PACKED`; the grid is the built spec's (after the
    library's ``tune``), so a tuned build never reads past the list's split rows."""
    spread = lib.spec(SPREAD)
    found = lib.launcher(device_index, spread)
    if spread.blocks(split_rows, num_heads) <= found.resident_blocks:
        return found, spread.blocks(split_rows, num_heads)
    packed = lib.spec(PACKED)
    return lib.launcher(device_index, packed), packed.blocks(split_rows, num_heads)
