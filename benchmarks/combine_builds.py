"""The split combine's builds side by side: the decode of a call with its combine forced to each
build (``KernelLibrary(tune=...)``), graph-replayed (the benchmark's timer:
``triton.testing.do_bench_cudagraph``, median), on the yardstick sweep's shapes whose plan cuts rows
(docs/yardstick_sweep_h200.csv) and on ragged batches (``bench decode --ragged``'s lengths over
128 + 2,048 selections). One CSV row a shape on stdout: the attention's blocks, the combine's split
rows and (m, l) pairs (split rows x heads), the partials a split row (the host's list; blank with
lengths), the build that ``decode_combine.launcher`` takes, and each build's time. Measures the
launcher's rule. ``--most-rows R``: only the sweep's shapes of at most R query rows (batch x q_len),
no ragged batch. ``--off-sweep``: instead, 1-14 query rows over widths the sweep does not hold
(384, 896, 1,664 and 3,200 selections), no ragged batch.

    python benchmarks/combine_builds.py [--every N] [--most-rows R | --off-sweep]
"""

from __future__ import annotations

import torch
from decode_plan_ab import start, sweep_parser, sweep_shapes

import nvfp4_mla
from nvfp4_mla.bench import decode_arms, decode_ragged
from nvfp4_mla.bench.timing import DeviceTimer
from nvfp4_mla.ops import decode_planner
from nvfp4_mla.ops.decode_combine import BUILDS, CombineSpec

TIMER = DeviceTimer(reps=1, graph_s=10e-3)  # graph-replayed only
# The shipped builds, then other forms of the kernel (warps a head, prefetched, loads in flight).
CANDIDATES = (*BUILDS, CombineSpec(2, 4, 16), CombineSpec(1, 2, 16))


def forced(build: CombineSpec) -> nvfp4_mla.KernelLibrary:
    return nvfp4_mla.KernelLibrary(tune=lambda spec: build if isinstance(spec, CombineSpec) else spec)


def name(build: CombineSpec) -> str:
    return f"t_{build.warps_a_head}_{build.prefetch}_{build.in_flight}"


def row(
    pools: decode_arms.Pools,
    x: decode_arms.Inputs,
    default: nvfp4_mla.KernelLibrary,
    libraries: list[nvfp4_mla.KernelLibrary],
    cells: list[object],
    extra_lens: torch.Tensor | None,
) -> None:
    heads, rows, extra_k = x.q.shape[2], x.q.shape[0] * x.q.shape[1], x.slots[1].shape[-1]
    plan = decode_planner.plan(default, 0, heads, rows, decode_arms.SWA_K, extra_k, extra_lens is not None)
    if plan.combine is None:
        return
    taken = next(b for b in CANDIDATES if plan.combine is default.launcher(0, b))
    split_rows = plan.combine_blocks // taken.blocks(1, heads)
    partials = f"{plan.slots / split_rows:.1f}" if extra_lens is None else ""
    cells += [plan.blocks, split_rows, split_rows * heads, partials, name(taken)[2:]]
    for lib in libraries:

        def call(inputs: decode_arms.Inputs, lib: nvfp4_mla.KernelLibrary = lib) -> object:
            return decode_arms.fused(pools, inputs, library=lib, extra_lens=extra_lens)

        cells.append(f"{TIMER.graph(call, [x]) * 1e6:.2f}")
    print(",".join(map(str, cells)), flush=True)


def main() -> None:
    parser = sweep_parser(__doc__)
    parser.add_argument("--most-rows", type=int, default=0, help="only sweep shapes of at most this many query rows")
    parser.add_argument("--off-sweep", action="store_true", help="few query rows over widths the sweep does not hold")
    args, pools, g = start(__doc__, parser)
    every, most_rows = args.every, args.most_rows
    default, libraries = nvfp4_mla.KernelLibrary(), [forced(b) for b in CANDIDATES]
    columns = "B,ql,H,k,lens,attention,split_rows,pairs,partials,taken,"
    print(columns + ",".join(name(b) for b in CANDIDATES), flush=True)
    ragged_heads = () if most_rows or args.off_sweep else (64, 128)
    for heads in ragged_heads:
        for batch in (32, 64, 128):
            for dist in decode_ragged.RAGGED_DISTRIBUTIONS:
                x = decode_arms.Inputs(batch, 1, heads, decode_ragged.RAGGED_EXTRA_K, g, pools)
                lens = decode_ragged.ragged_lengths(dist, batch, decode_ragged.RAGGED_EXTRA_K, g).cuda()
                k = decode_arms.SWA_K + decode_ragged.RAGGED_EXTRA_K
                row(pools, x, default, libraries, [batch, 1, heads, k, dist], lens)
    if args.off_sweep:
        shapes = [
            (rows // q_len, q_len, heads, k)
            for k in (384, 896, 1664, 3200)
            for heads in (16, 64, 128)
            for rows in (1, 2, 3, 5, 6, 7, 10, 12, 14)
            for q_len in (1, 2)
            if rows % q_len == 0
        ]
    else:
        shapes = [s for s in sweep_shapes() if not most_rows or s[0] * s[1] <= most_rows]
    for batch, q_len, heads, k in shapes[::every]:
        x = decode_arms.Inputs(batch, q_len, heads, k - decode_arms.SWA_K, g, pools)
        row(pools, x, default, libraries, [batch, q_len, heads, k, ""], None)


if __name__ == "__main__":
    main()
