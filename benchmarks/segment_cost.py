"""What a segment costs a decode block besides its tiles, in tiles of the same build: the
scheduler's segment cost (each build's ``Attention.segment_cost``), measured on one part of the
work list (``KernelLibrary(decode_parts=1)``: one block, or one cluster, walks every segment), for
each build a call with lengths may take.

Three calls a build, graph-replayed (the benchmark's timer: ``triton.testing.do_bench_cudagraph``,
median), with no window entry live (``swa_lens`` 0) and ``extra_lens`` in whole tiles:

- ``t_rows``: N rows of one tile each: N segments;
- ``t_row``, ``t_row2``: one row of N tiles, and of 2 N tiles: one segment.

A tile costs ``(t_row2 - t_row) / N``, a segment besides its tiles ``(t_rows - t_row) / (N - 1)``
(its query's load and its output rows). One CSV row a build on stdout, the ratio last.

    python benchmarks/segment_cost.py [--every N]   # N: every Nth build
"""

from __future__ import annotations

import torch
from decode_plan_ab import start

import nvfp4_mla
from nvfp4_mla.bench import decode_arms
from nvfp4_mla.bench.timing import DeviceTimer
from nvfp4_mla.ops import decode_planner, decode_sm90

TIMER = DeviceTimer(reps=1, graph_s=10e-3)  # graph-replayed only
N = 16
# (backend, heads, dim parts): each build a call with lengths takes on the H200.
BUILDS = (
    ("mma_sync", 16, None),
    ("wgmma_sm90_narrow", 16, None),
    ("wgmma_sm90", 64, 1),
    ("wgmma_sm90", 64, 2),
    ("wgmma_sm90", 128, 1),
    ("wgmma_sm90", 128, 2),
)


def time_us(
    pools: decode_arms.Pools,
    g: torch.Generator,
    lib: nvfp4_mla.KernelLibrary,
    heads: int,
    extra_k: int,
    lens: list[int],
) -> float:
    """A call's graph-replayed time: a row of ``extra_lens`` each of ``lens``, no window entry live."""
    x = decode_arms.Inputs(len(lens), 1, heads, extra_k, g, pools)
    swa_lens = torch.zeros(len(lens), 1, dtype=torch.int32, device="cuda")
    extra_lens = torch.tensor(lens, dtype=torch.int32, device="cuda").view(-1, 1)

    def call(inputs: decode_arms.Inputs) -> object:
        return decode_arms.fused(pools, inputs, library=lib, extra_lens=extra_lens, swa_lens=swa_lens)

    return TIMER.graph(call, [x]) * 1e6


def main() -> None:
    args, pools, g = start(__doc__)
    print("backend,heads,dim_parts,cluster,tile_tokens,N,t_rows,t_row,t_row2,tile_us,segment_us,segment_tiles")
    for backend, heads, dims in BUILDS[:: args.every]:
        lib = nvfp4_mla.KernelLibrary(decode_backend=backend, decode_dim_parts=dims, decode_parts=1)
        plan = decode_planner.plan(lib, 0, heads, N, decode_arms.SWA_K, 2 * N * 64)
        tile = plan.tile_tokens
        extra_k = 2 * N * tile
        t_rows = time_us(pools, g, lib, heads, extra_k, [tile] * N)
        t_row = time_us(pools, g, lib, heads, extra_k, [N * tile])
        t_row2 = time_us(pools, g, lib, heads, extra_k, [2 * N * tile])
        tile_us, segment_us = (t_row2 - t_row) / N, (t_rows - t_row) / (N - 1)
        cluster = decode_sm90.cluster_of(heads, plan.dim_parts) if backend == "wgmma_sm90" else 1
        cells = [backend, heads, plan.dim_parts, cluster, tile, N, f"{t_rows:.2f}", f"{t_row:.2f}", f"{t_row2:.2f}"]
        print(",".join(map(str, [*cells, f"{tile_us:.3f}", f"{segment_us:.3f}", f"{segment_us / tile_us:.2f}"])))


if __name__ == "__main__":
    main()
