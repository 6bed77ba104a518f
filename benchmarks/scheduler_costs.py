"""The decode scheduler's two costs side by side on ragged batches: each batch's one-call form
(``sparse_mla_decode`` with ``extra_lens``, the scheduler in the call), graph-replayed (the
benchmark's timer: ``triton.testing.do_bench_cudagraph``, median), with the planner's costs
(``shipped``: each build's segment cost, ``decode_planner.list_costs``) and with the segment cost
and the combine's cost that the scheduler balances by and keeps rows whole by set to each
candidate pair for every build (each candidate plans on a library of its own).

The batches: 1 to 256 rows (sizes between the yardsticks' too), 16, 64 and 128 heads, over 128
window + 2,048 compressed selections whose live counts follow ``bench decode --ragged``'s
distributions and ``log`` (log-uniform in 1-2,048: many short rows, a few long). One CSV row a
batch on stdout: its live selections over a full batch's; the planner's segment cost;
``excess``, what the costliest part of its whole-rows list costs past the cut list's bound
(payload and a segment), in tiles, and ``slots``, the cut list's partial slots (the CPU model's,
at the same lengths); the arms' split rows and times in us. A combine cost of 99 keeps every row
whole.

    python benchmarks/scheduler_costs.py [--every N] [--pairs 1:1,2:1,1:99] [--batches 1,2,3]
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from decode_plan_ab import start, sweep_parser

import nvfp4_mla
from nvfp4_mla.bench import decode_arms, decode_ragged
from nvfp4_mla.bench.timing import DeviceTimer
from nvfp4_mla.ops import decode_planner, decode_scheduler
from nvfp4_mla.ops.decode_backend import Attention

TIMER = DeviceTimer(reps=1, graph_s=3e-3)  # graph-replayed only
PLANNER_COSTS = decode_planner.list_costs
# (segment cost, combine cost) pairs besides the planner's
OTHERS = "0:0,1:0,1:1,1:2,1:3,2:1,3:1,2:2"
BATCHES = "1,4,8,16,24,48,96,160,256"
DISTRIBUTIONS = (*decode_ragged.RAGGED_DISTRIBUTIONS, "log")


def lengths(dist: str, batch: int, k: int, g: torch.Generator) -> torch.Tensor:
    if dist == "log":
        n = torch.exp(torch.rand(batch, generator=g) * math.log(k)).to(torch.int32).clamp(1, k)
        return n.view(batch, 1)
    return decode_ragged.ragged_lengths(dist, batch, k, g)


def numbers(text: str) -> list[int]:
    return [int(v) for v in text.replace(":", ",").split(",")]


def fixed_costs(pair: tuple[int, int]) -> Callable[[Attention], tuple[int, int]]:
    """The planner's ``list_costs`` of every build at ``pair``."""

    def list_costs(attention: Attention) -> tuple[int, int]:
        return pair

    return list_costs


def main() -> None:
    parser = sweep_parser(__doc__)
    parser.add_argument("--pairs", default=OTHERS, help="segment:combine cost pairs besides the planner's")
    parser.add_argument("--batches", default=BATCHES, help="batch sizes")
    args, pools, g = start(__doc__, parser)
    others = numbers(args.pairs)
    pairs = list(zip(others[::2], others[1::2]))
    lib = nvfp4_mla.KernelLibrary()
    extra_k, swa_k = decode_ragged.RAGGED_EXTRA_K, decode_arms.SWA_K
    names = ["shipped", *(f"{s}_{c}" for s, c in pairs)]
    header = ["B,H,lens,live_full,parts,tile,segment_cost,excess,slots"]
    print(",".join([*header, *(f"rows_{n}" for n in names), *(f"t_{n}" for n in names)]), flush=True)
    for batch in numbers(args.batches)[:: args.every]:
        for heads in (16, 64, 128):
            for dist in DISTRIBUTIONS:
                x = decode_arms.Inputs(batch, 1, heads, extra_k, g, pools)
                lens = lengths(dist, batch, extra_k, g).cuda()
                plan = decode_planner.plan(lib, 0, heads, batch, swa_k, extra_k)
                tiles = decode_scheduler.row_tiles(batch, swa_k, None, extra_k, lens, plan.tile_tokens)
                cells: list[object] = [batch, heads, dist, f"{int(lens.sum()) / (batch * extra_k):.3f}"]
                segment_cost = plan.schedule.segment_cost
                bounds, payload, longest = decode_scheduler.cut_bounds(tiles, plan.parts, segment_cost)
                cut = decode_scheduler.list_of_bounds([(row, tile) for row, tile, _ in bounds])
                cells += [plan.parts, plan.tile_tokens, segment_cost, longest - payload - segment_cost]
                cells.append(cut.split_rows[-1][1])
                for costs in [plan.schedule.costs, *pairs]:
                    listed = decode_scheduler.schedule(tiles, plan.parts, *costs)
                    cells.append(sum(row >= 0 for row, _ in listed.split_rows))
                for pair in [None, *pairs]:
                    costs_of = PLANNER_COSTS if pair is None else fixed_costs(pair)
                    decode_planner.list_costs = costs_of  # type: ignore[assignment]
                    candidate = nvfp4_mla.KernelLibrary()  # its plans take these costs

                    def call(
                        inputs: decode_arms.Inputs, lens: torch.Tensor = lens, lib: nvfp4_mla.KernelLibrary = candidate
                    ) -> object:
                        return decode_arms.fused(pools, inputs, library=lib, extra_lens=lens)

                    cells.append(f"{TIMER.graph(call, [x]) * 1e6:.2f}")
                decode_planner.list_costs = PLANNER_COSTS
                print(",".join(map(str, cells)), flush=True)


if __name__ == "__main__":
    main()
