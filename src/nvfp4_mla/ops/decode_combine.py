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
    with the partials' (m, l), then ``in_flight`` float4 loads a thread at once while whole batches
    of partials remain, then the rest ``tail_chunk`` partial rows at a time."""

    warps_a_head: int
    prefetch: int
    in_flight: int
    tail_chunk: int = 1
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
        return {
            "MAX_SPLITS": self.max_splits,
            "PREFETCH": self.prefetch,
            "IN_FLIGHT": self.in_flight,
            "TAIL_CHUNK": self.tail_chunk,
            "WARPS_A_HEAD": self.warps_a_head,
        }

    def describe(self) -> str:
        return (
            f"decode split combine, {self.warps_a_head} warps a head, {self.prefetch} splits prefetched, "
            f"{self.in_flight} loads in flight, the rest {self.tail_chunk} at a time"
        )


# The builds, in the order a call prefers them: each holds more (split row, head) pairs at once than
# the one before (docs/performance.md#split-combine). Four warps a pair, a thread a float4 of its 512
# dims: SPREAD_PREFETCH loads 16 partial rows with the (m, l) (one round trip up to 16 partials; its
# registers cost blocks an SM) and the partials past whole batches of 16 four at a time, SPREAD four
# with the (m, l) (fewer registers, more blocks an SM) and the rest one at a time (four at a time
# measured slower). A warp a pair and four pairs a block: PACKED_PREFETCH loads four partial rows with
# the (m, l), PACKED one (fewer registers, more blocks an SM).
SPREAD_PREFETCH = CombineSpec(4, 16, 16, tail_chunk=4)
SPREAD = CombineSpec(4, 4, 16)
PACKED_PREFETCH = CombineSpec(1, 4, 16)
PACKED = CombineSpec(1, 1, 8)
BUILDS = (SPREAD_PREFETCH, SPREAD, PACKED_PREFETCH, PACKED)
# Where the combine's blocks start beside the attention's (programmatic dependent launch) and the
# preferred build's blocks outnumber what the SMs the attention leaves free hold, the rest start on
# the attention's SMs as its blocks leave, and hold the stream's next kernel off those SMs until
# they end. BESIDE, whose blocks (four pairs each) fit there more often, is faster then, if at
# least BESIDE_MIN_FREE_SHARE of the SMs are free: on fewer, it is slower than the spread blocks
# (docs/performance.md#split-combine).
BESIDE = PACKED_PREFETCH
BESIDE_MIN_FREE_SHARE = 0.2


def blocks_an_sm(launcher: Launcher) -> int:
    """The blocks of ``launcher``'s kernel an SM holds at once (at least one)."""
    return launcher.resident_blocks // launcher.device.sms


def specs() -> tuple[CombineSpec, ...]:
    """Every build."""
    return BUILDS


def launcher(
    lib: KernelLibrary, device_index: int, split_rows: int, num_heads: int, free_sms: int = 0
) -> tuple[Launcher, int]:
    """The combine of ``split_rows`` rows of ``num_heads`` heads and its grid: the first of
    :data:`BUILDS` whose blocks fit the GPU at once, else the last (the most pairs at once);
    :data:`BESIDE` instead where that build's blocks would not fit on the ``free_sms`` SMs that the
    attention leaves free while the combine's blocks start beside it (0: they start after it) and
    its blocks would. The grid is the built spec's (after the library's ``tune``), so a tuned build
    never reads past the list's split rows."""

    def built(build: CombineSpec) -> tuple[Launcher, int, int]:
        spec = lib.spec(build)
        found = lib.launcher(device_index, spec)
        return found, spec.blocks(split_rows, num_heads), blocks_an_sm(found) * free_sms

    for build in BUILDS:
        found, blocks, beside = built(build)
        if blocks <= found.resident_blocks:
            break
    if blocks > beside and free_sms >= BESIDE_MIN_FREE_SHARE * found.device.sms and build is not BESIDE:
        other, other_blocks, other_beside = built(BESIDE)
        if other_blocks <= other_beside:
            return other, other_blocks
    return found, blocks
