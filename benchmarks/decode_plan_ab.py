"""The decode's plans for calls without length tensors, side by side on the yardstick sweep's
shapes (docs/yardstick_sweep_h200.csv): the plan the planner takes (``t_default``: the width split,
or the dealt half rows of ``decode_schedule.deals_half_rows``) against the scheduler's dealing of
the same rows over as many parts as fill the GPU, as a call with lengths is dealt, in whole rows
(``t_sched1``) and half rows (``t_sched2``, where the backend has them), and the width split in
whole rows (``t_width1``: what the planner takes where it does not deal half rows, e.g. where the
split's blocks fill the GPU, ``WIDTH_FILLS_SHARE``). Graph-replayed (the benchmark's timer:
``triton.testing.do_bench_cudagraph``, median); one CSV row a shape on stdout. Measures what the
width split's cost model (``ops.decode_schedule``) is worth. ``--shapes long``: 1-16 query rows
at 16-128 heads over 640-16,512 tokens instead of the sweep's (whose rows hold at most 34 tiles).

    python benchmarks/decode_plan_ab.py [--shapes sweep|long] [--every N]
"""

from __future__ import annotations

import argparse
import csv
from pathlib import Path

import torch

import nvfp4_mla
from nvfp4_mla.bench import decode_arms
from nvfp4_mla.bench.timing import DeviceTimer
from nvfp4_mla.ops import decode_planner

TIMER = DeviceTimer(reps=1, graph_s=10e-3)  # graph-replayed only
SWEEP = Path(__file__).resolve().parent.parent / "docs" / "yardstick_sweep_h200.csv"


def sweep_shapes() -> list[tuple[int, int, int, int]]:
    """(batch, q_len, heads, selected tokens a row) of every sweep row, in order, once each."""
    shapes: dict[tuple[int, int, int, int], None] = {}
    with SWEEP.open() as f:
        for r in csv.DictReader(f):
            shapes[(int(r["B"]), int(r["ql"]), int(r["H"].rstrip("*")), int(r["k"]))] = None
    return list(shapes)


def long_shapes() -> list[tuple[int, int, int, int]]:
    """(batch, q_len, heads, selected tokens a row): 1-16 rows of q_len 1 over long selections."""
    tokens = (640, 1152, 2176, 3200, 4224, 6272, 8320, 16512)
    return [(rows, 1, heads, k) for heads in (16, 32, 64, 96, 128) for rows in range(1, 17) for k in tokens]


def graph_us(pools: decode_arms.Pools, x: decode_arms.Inputs, lib: nvfp4_mla.KernelLibrary) -> float:
    return TIMER.graph(lambda inputs: decode_arms.fused(pools, inputs, library=lib), [x]) * 1e6


def sweep_parser(doc: str) -> argparse.ArgumentParser:
    """A sweep script's argument parser, its module docstring as the help; :func:`start` adds ``--every``."""
    return argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)


def start(
    doc: str, parser: argparse.ArgumentParser | None = None
) -> tuple[argparse.Namespace, decode_arms.Pools, torch.Generator]:
    """A sweep script's start: its arguments (``parser``'s, if given, and ``--every N``: time every
    Nth shape or batch), the pools on GPU 0, a seeded generator."""
    parser = parser or sweep_parser(doc)
    parser.add_argument("--every", type=int, default=1, help="time every Nth shape (or batch size)")
    args = parser.parse_args()
    torch.cuda.set_device(0)
    return args, decode_arms.Pools("cuda"), torch.Generator().manual_seed(0)


def main() -> None:
    parser = sweep_parser(__doc__)
    parser.add_argument("--shapes", choices=("sweep", "long"), default="sweep", help="the shapes timed")
    args, pools, g = start(__doc__, parser)
    every = args.every
    default = nvfp4_mla.KernelLibrary()
    swa_k = decode_arms.SWA_K
    shapes = sweep_shapes() if args.shapes == "sweep" else long_shapes()
    print("B,ql,H,k,backend,splits,parts,dim,t_default,parts1,t_sched1,parts2,t_sched2,t_width1", flush=True)
    for batch, q_len, heads, k in shapes[::every]:
        x = decode_arms.Inputs(batch, q_len, heads, k - swa_k, g, pools)
        rows = batch * q_len
        plan = decode_planner.plan(default, 0, heads, rows, swa_k, k - swa_k, lengths=False)
        cells = [batch, q_len, heads, k, plan.backend, plan.num_splits, plan.parts, plan.dim_parts]
        cells.append(f"{graph_us(pools, x, default):.2f}")
        for dim_parts in (1, 2):
            if dim_parts not in decode_planner.BACKENDS[plan.backend].dim_parts:
                cells += ["", ""]
                continue
            probe = nvfp4_mla.KernelLibrary(decode_backend=plan.backend, decode_dim_parts=dim_parts)
            parts = decode_planner.plan(probe, 0, heads, rows, swa_k, k - swa_k, lengths=True).parts
            lib = nvfp4_mla.KernelLibrary(decode_backend=plan.backend, decode_dim_parts=dim_parts, decode_parts=parts)
            cells += [parts, f"{graph_us(pools, x, lib):.2f}"]
        width = nvfp4_mla.KernelLibrary(decode_backend=plan.backend, decode_dim_parts=1)
        cells.append(f"{graph_us(pools, x, width):.2f}")
        print(",".join(map(str, cells)), flush=True)


if __name__ == "__main__":
    main()
