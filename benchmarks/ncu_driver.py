"""One benchmark shape, called a few times, for a profiler (``ncu``, ``nsys``): the same inputs as
the benchmark's, so a profile explains a benchmark row.

    python benchmarks/ncu_driver.py decode BATCH Q_LEN HEADS EXTRA_K [--batch-invariant] [--lengths DIST] [--plan FORM]
    python benchmarks/ncu_driver.py write ENTRY NUM_TOKENS [NUM_HEADS Q_HEAD_PADDED]

``DIST`` gives the extra pool's rows live lengths as ``nvfp4-mla bench decode --ragged`` does
(full, tail1of8, uniform, short; q_len 1), or one of its other distributions (bimodal, geometric,
mostly_empty, one_long, ramp). ``FORM`` is how the calls get their work list: ``none``
(each call its own), ``reused`` (one plan, ``plan_sparse_mla_decode``) or ``updated`` (``plan.update()``
before each call): with ``--replay-mode application --cache-control none`` ncu sees the attention
kernel after what each form runs before it. ``ENTRY`` is main, inplace, kv, kv2 (compress ratio 2)
or append. Profile the last call, e.g.
``ncu --clock-control none --set full -k regex:nvfp4_mla_decode$ -c 1 -s 3 python ...``
(``--calls`` sets how many calls are made; the default 4 leaves 3 warm-up calls).
"""

from __future__ import annotations

import argparse

import torch

import nvfp4_mla
from nvfp4_mla import ops
from nvfp4_mla.bench import decode_arms
from nvfp4_mla.bench.arms import fused_call
from nvfp4_mla.bench.decode_ragged import LENGTH_DISTRIBUTIONS, ragged_lengths
from nvfp4_mla.bench.grid import MAX_POSITION, Row
from nvfp4_mla.bench.inputs import make_inputs
from nvfp4_mla.testing import rope_table


def writer_row(entry: str, tokens: int, heads: int, padded: int) -> Row:
    if entry == "main":
        return Row.main(tokens, heads, padded)
    if entry == "inplace":
        return Row.in_place(tokens, heads)
    if entry in ("kv", "kv2"):
        return Row.kv(tokens, 2 if entry == "kv2" else 1)
    return Row.append(tokens)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--calls", type=int, default=4)
    sub = parser.add_subparsers(dest="kind", required=True)
    d = sub.add_parser("decode")
    for name in ("batch", "q_len", "heads", "extra_k"):
        d.add_argument(name, type=int)
    d.add_argument("--batch-invariant", action="store_true", help="plan with batch_invariant=True")
    d.add_argument("--lengths", choices=LENGTH_DISTRIBUTIONS, help="the extra pool's live lengths (q_len 1)")
    d.add_argument("--plan", choices=("none", "reused", "updated"), default="none", help="the calls' work list")
    w = sub.add_parser("write")
    w.add_argument("entry", choices=("main", "inplace", "kv", "kv2", "append"))
    w.add_argument("tokens", type=int)
    w.add_argument("heads", type=int, nargs="?", default=8)
    w.add_argument("padded", type=int, nargs="?", default=16)
    args = parser.parse_args()
    torch.cuda.set_device(0)
    if args.kind == "decode":
        pools = decode_arms.Pools("cuda")
        g = torch.Generator().manual_seed(0)
        x = decode_arms.Inputs(args.batch, args.q_len, args.heads, args.extra_k, g, pools)
        lens = None
        if args.lengths is not None:
            lens = ragged_lengths(args.lengths, args.batch * args.q_len, args.extra_k, g).view(args.batch, args.q_len)
            lens = lens.to("cuda")
        plan = None
        if args.plan != "none":
            plan = nvfp4_mla.plan_sparse_mla_decode(
                args.heads, x.slots[0], extra_slots=x.slots[1], extra_lens=lens, batch_invariant=args.batch_invariant
            )
        invariant = None if plan else args.batch_invariant  # a plan's calls take the plan's
        for _ in range(args.calls):
            if plan is not None and args.plan == "updated":
                plan.update()
            decode_arms.fused(pools, x, extra_lens=lens, plan=plan, batch_invariant=invariant)
    else:
        row = writer_row(args.entry, args.tokens, args.heads, args.padded)
        call = fused_call(row, ops, rope_table(MAX_POSITION, "cuda"))
        inputs = make_inputs(row, "cuda")
        for _ in range(args.calls):
            call(inputs)
    torch.cuda.synchronize()
    print("done", vars(args))


if __name__ == "__main__":
    main()
