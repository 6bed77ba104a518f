"""Soak run: many mixed calls of every entry, eager and CUDA-graph replayed, sampled against the reference.

    PYTHONPATH=src python3 benchmarks/soak.py [--calls 1000000] [--minutes M] [--seed S]

Thirteen fixed geometries (all four entries; page sizes 1..300; 1..128 heads; 3-D, HND and NHD
caches, padded pools; int32/int64 slots; DP padding; invalid slots and positions), run by
``nvfp4_mla.testing.soak.run_soak`` (its docstring says how steps are made and checked). Prints
calls/s (checks excluded) and the number of mismatching checks; exit status 1 on any mismatch, 2
without a usable GPU.
"""

from __future__ import annotations

import argparse
import sys

import torch

from nvfp4_mla import gpu_unavailable_reason
from nvfp4_mla.testing.soak import GEOMETRIES, run_soak


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=1_000_000, help="calls to make (default 1,000,000)")
    parser.add_argument("--minutes", type=float, default=None, help="stop the run after this long")
    parser.add_argument("--calls-per-graph", type=int, default=100, help="calls of a step / of a captured graph")
    parser.add_argument("--sample-every", type=int, default=2000, help="check the step holding every N-th call")
    parser.add_argument("--eager-fraction", type=float, default=0.25, help="share of steps run eagerly")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    problem = gpu_unavailable_reason()
    if problem:
        print(f"soak: needs a CUDA GPU (sm_80 or newer) with CuPy: {problem}", file=sys.stderr)
        return 2
    print(f"soak on {torch.cuda.get_device_name()}, torch {torch.__version__}")
    result = run_soak(
        GEOMETRIES,
        calls=args.calls,
        calls_per_step=args.calls_per_graph,
        sample_every=args.sample_every,
        eager_fraction=args.eager_fraction,
        minutes=args.minutes,
        seed=args.seed,
    )
    print(
        f"soak: {result.calls} calls in {result.seconds:.1f} s ({result.check_seconds:.1f} s of it checking): "
        f"{result.calls_per_second:,.0f} calls/s without the checks; "
        f"{result.mismatches} mismatches in {result.checks} checks"
    )
    for report in result.reports:
        print(report)
    return 1 if result.mismatches else 0


if __name__ == "__main__":
    sys.exit(main())
