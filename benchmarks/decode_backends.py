"""The decode backends side by side: each call forced to every backend of this GPU
(``KernelLibrary(decode_backend=...)``), graph-replayed (the benchmark's timer:
``triton.testing.do_bench_cudagraph``, median), the backends in turn, two rounds, the faster of
each backend's two times kept. One CSV row a shape on stdout: the backend the rule
(``ops.decode_planner.select_backend``) takes, the call's tiles of 64 selections (query rows x
tiles a row), each backend's time and the rule's time over the fastest. Measures the backend
rule on a dense grid (default: 1-16 heads, 1-128 query rows of q_len 1, 640-4,224 selections).

    python benchmarks/decode_backends.py [--heads 1,2,4,8,12,16] [--rows 1,2,...] [--tokens 640,...] [--every N]
"""

from __future__ import annotations

import math

from decode_plan_ab import start, sweep_parser

import nvfp4_mla
from nvfp4_mla.bench import decode_arms
from nvfp4_mla.bench.timing import DeviceTimer
from nvfp4_mla.device import device_info
from nvfp4_mla.ops import decode_planner, decode_sm90

TIMER = DeviceTimer(reps=1, graph_s=10e-3)  # graph-replayed only
ROUNDS = 2


def numbers(text: str) -> list[int]:
    return [int(v) for v in text.split(",")]


def main() -> None:
    parser = sweep_parser(__doc__)
    parser.add_argument("--heads", type=numbers, default=[1, 2, 4, 8, 12, 16], help="head counts")
    rows_default = [*range(1, 9), 10, 12, 16, 24, 32, 48, 64, 96, 128]
    parser.add_argument("--rows", type=numbers, default=rows_default, help="query rows (batch, q_len 1)")
    parser.add_argument("--tokens", type=numbers, default=[640, 1152, 2176, 3200, 4224], help="selections a row")
    args, pools, g = start(__doc__, parser)
    gpu = device_info(0)
    names = [n for n, b in decode_planner.BACKENDS.items() if b.supports(gpu.capability)]
    libraries = {n: nvfp4_mla.KernelLibrary(decode_backend=n) for n in names}
    print("H,rows,k,tiles,rule," + ",".join(f"t_{n}" for n in names) + ",rule_over_best", flush=True)
    shapes = [(h, r, k) for h in args.heads for r in args.rows for k in args.tokens]
    for heads, rows, k in shapes[:: args.every]:
        x = decode_arms.Inputs(rows, 1, heads, k - decode_arms.SWA_K, g, pools)
        rule = decode_planner.select_backend(gpu, heads, rows, k).name
        times = {n: math.inf for n in names}
        for _ in range(ROUNDS):
            for n in names:

                def call(inputs: decode_arms.Inputs, lib: nvfp4_mla.KernelLibrary = libraries[n]) -> object:
                    return decode_arms.fused(pools, inputs, library=lib)

                times[n] = min(times[n], TIMER.graph(call, [x]) * 1e6)
        cells = [heads, rows, k, rows * -(-k // decode_sm90.BLOCK_N), rule, *(f"{times[n]:.2f}" for n in names)]
        print(",".join(map(str, [*cells, f"{times[rule] / min(times.values()):.3f}"])), flush=True)


if __name__ == "__main__":
    main()
