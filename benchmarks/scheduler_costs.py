"""The decode scheduler's two costs side by side on ragged batches: each batch's one-call form
(``sparse_mla_decode`` with ``extra_lens``, the scheduler in the call), graph-replayed (the
benchmark's timer: ``triton.testing.do_bench_cudagraph``, median), with the segment cost and the
combine's cost that the scheduler balances by and keeps rows whole by set to each candidate
(``decode_planner.SEGMENT_COST`` and ``COMBINE_COST``, which a plan's Schedule takes when it is
made: each candidate plans on a library of its own).

The batches: 1 to 256 rows (sizes between the yardsticks' too), 16, 64 and 128 heads, over 128
window + 2,048 compressed selections whose live counts follow ``bench decode --ragged``'s
distributions and ``log`` (log-uniform in 1-2,048: many short rows, a few long). One CSV row a
batch on stdout: its live selections over a full batch's, the candidates' split rows (the CPU
model's, at the same lengths) and times in us.

    python benchmarks/scheduler_costs.py [--every N]   # N: time every Nth batch size
"""

from __future__ import annotations

import math

import torch
from decode_plan_ab import start

import nvfp4_mla
from nvfp4_mla.bench import decode_arms, decode_ragged
from nvfp4_mla.bench.timing import DeviceTimer
from nvfp4_mla.ops import decode_planner, decode_scheduler

TIMER = DeviceTimer(reps=1, graph_s=3e-3)  # graph-replayed only
# (segment cost, combine cost): the shipped pair first, then the others.
SHIPPED = (decode_planner.SEGMENT_COST, decode_planner.COMBINE_COST)
OTHERS = ((0, 0), (1, 0), (1, 1), (1, 2), (1, 3), (2, 1), (3, 1), (2, 2))
CANDIDATES = (SHIPPED, *(pair for pair in OTHERS if pair != SHIPPED))
BATCHES = (1, 4, 8, 16, 24, 48, 96, 160, 256)
DISTRIBUTIONS = (*decode_ragged.RAGGED_DISTRIBUTIONS, "log")


def lengths(dist: str, batch: int, k: int, g: torch.Generator) -> torch.Tensor:
    if dist == "log":
        n = torch.exp(torch.rand(batch, generator=g) * math.log(k)).to(torch.int32).clamp(1, k)
        return n.view(batch, 1)
    return decode_ragged.ragged_lengths(dist, batch, k, g)


def main() -> None:
    every, pools, g = start(__doc__)
    lib = nvfp4_mla.KernelLibrary()
    extra_k, swa_k = decode_ragged.RAGGED_EXTRA_K, decode_arms.SWA_K
    names = [f"{s}_{c}" for s, c in CANDIDATES]
    print(",".join(["B,H,lens,live_full,parts,tile", *(f"rows_{n}" for n in names), *(f"t_{n}" for n in names)]))
    for batch in BATCHES[::every]:
        for heads in (16, 64, 128):
            for dist in DISTRIBUTIONS:
                x = decode_arms.Inputs(batch, 1, heads, extra_k, g, pools)
                lens = lengths(dist, batch, extra_k, g).cuda()
                plan = decode_planner.plan(lib, 0, heads, batch, swa_k, extra_k)
                tiles = decode_scheduler.row_tiles(batch, swa_k, None, extra_k, lens, plan.tile_tokens)
                cells: list[object] = [batch, heads, dist, f"{int(lens.sum()) / (batch * extra_k):.3f}"]
                cells += [plan.parts, plan.tile_tokens]
                for segment_cost, combine_cost in CANDIDATES:
                    listed = decode_scheduler.schedule(tiles, plan.parts, segment_cost, combine_cost)
                    cells.append(sum(row >= 0 for row, _ in listed.split_rows))
                for segment_cost, combine_cost in CANDIDATES:
                    decode_planner.SEGMENT_COST, decode_planner.COMBINE_COST = segment_cost, combine_cost
                    candidate = nvfp4_mla.KernelLibrary()  # its plans take this pair

                    def call(
                        inputs: decode_arms.Inputs, lens: torch.Tensor = lens, lib: nvfp4_mla.KernelLibrary = candidate
                    ) -> object:
                        return decode_arms.fused(pools, inputs, library=lib, extra_lens=lens)

                    cells.append(f"{TIMER.graph(call, [x]) * 1e6:.2f}")
                decode_planner.SEGMENT_COST, decode_planner.COMBINE_COST = SHIPPED
                print(",".join(map(str, cells)), flush=True)


if __name__ == "__main__":
    main()
