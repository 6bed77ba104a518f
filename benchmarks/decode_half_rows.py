"""Whole rows against half rows for calls with length tensors: each ragged batch's one-call form
(``sparse_mla_decode`` with ``extra_lens``: the list dealt on the GPU into every part the GPU
holds) with the Hopper kernel's dim parts forced to 1 and to 2, graph-replayed (the benchmark's
timer: ``triton.testing.do_bench_cudagraph``, median). ``plan_dim`` is what the planner takes
(``ops.decode_schedule.lengths_dim_parts``). Measures the work a whole-rows block may take for
half rows to pay (``LENGTHS_HALF_ROWS_TILES``).

The batches: every row count from 1 to 16 at 128 heads over 128 window + 2,048 compressed
selections and from 1 to 20 over + 512, 1-8 rows at 96 heads, 6-16 rows at 64 heads, then 1-256
rows at 64 and 128 heads over + 2,048; live counts as ``benchmarks/scheduler_costs.py`` draws them (the
``--ragged`` distributions and ``log``). One CSV row a batch on stdout.

    python benchmarks/decode_half_rows.py [--every N]   # N: time every Nth batch
"""

from __future__ import annotations

import torch
from decode_plan_ab import start
from scheduler_costs import DISTRIBUTIONS, lengths

import nvfp4_mla
from nvfp4_mla.bench import decode_arms
from nvfp4_mla.bench.timing import DeviceTimer
from nvfp4_mla.ops import decode_planner

TIMER = DeviceTimer(reps=1, graph_s=3e-3)  # graph-replayed only
FEW = (
    [(128, rows, 2048) for rows in range(1, 17)]
    + [(128, rows, 512) for rows in range(1, 21)]
    + [(96, rows, 2048) for rows in range(1, 9)]
    + [(64, rows, 2048) for rows in range(6, 17, 2)]
)
MANY = [(heads, rows, 2048) for rows in (1, 2, 4, 8, 12, 16, 24, 32, 48, 64, 96, 128, 160, 256) for heads in (64, 128)]


def main() -> None:
    args, pools, g = start(__doc__)
    every = args.every
    default = nvfp4_mla.KernelLibrary()
    forced = {dims: nvfp4_mla.KernelLibrary(decode_backend="wgmma_sm90", decode_dim_parts=dims) for dims in (1, 2)}
    print("B,H,extra_k,lens,live_full,plan_dim,t_dim1,t_dim2", flush=True)
    for heads, batch, extra_k in (FEW + MANY)[::every]:
        for dist in DISTRIBUTIONS:
            x = decode_arms.Inputs(batch, 1, heads, extra_k, g, pools)
            lens = lengths(dist, batch, extra_k, g).cuda()
            plan = decode_planner.plan(default, 0, heads, batch, decode_arms.SWA_K, extra_k)
            cells: list[object] = [batch, heads, extra_k, dist, f"{int(lens.sum()) / (batch * extra_k):.3f}"]
            cells.append(plan.dim_parts)
            for dims in (1, 2):

                def call(inputs: decode_arms.Inputs, lens: torch.Tensor = lens, dims: int = dims) -> object:
                    return decode_arms.fused(pools, inputs, library=forced[dims], extra_lens=lens)

                cells.append(f"{TIMER.graph(call, [x]) * 1e6:.2f}")
            print(",".join(map(str, cells)), flush=True)


if __name__ == "__main__":
    main()
