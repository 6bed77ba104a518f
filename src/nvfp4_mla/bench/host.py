"""Host time of one eager call of each entry, against a torch ``add_`` launch:
``nvfp4-mla bench host [--out DIR]`` (also ``python -m nvfp4_mla.bench host``).

It prints a table and writes ``host_bench.csv`` and ``host_bench.md`` into DIR (default
``bench-results/<GPU name>/``); it runs in a few seconds.

What is measured (one process, one GPU, every argument check in place): host seconds per call,
the best of 5 batches of 4,000 back-to-back calls, each batch from an idle device
(:func:`~nvfp4_mla.bench.timing.host_batches`: ``torch.utils.benchmark.Timer`` on the host clock,
the timer of the reader suite's host rows). The best batch, not the median: on a shared host,
noise only adds time, and the targets are about the code path. At ``T = 1`` every kernel's device
time (about 2 us) is below its host time, so the GPU keeps up and the host is what is timed. Each
row's batches alternate with batches of the reference, and its ratio is to that reference's best:
the host's speed drifts within a run.

- the reference: torch ``add_`` on a 1-element CUDA tensor;
- each writer entry at ``T = 1`` (main 8 -> 16 heads, in place 8, KV ratio 1 and 2, append, pack
  of one 64-row page) with its target ratio to ``add_`` (1.8x for the main entry, in
  place too, 1.5x for the others), and the reader and ``sparse_mla_decode`` for information, but
  ``sparse_mla_decode`` with lengths and a reused plan (2.0x: a decode step's per-layer call),
  and ``plan.update()`` (the scheduler's launch);
- the pieces of the reused-plan decode call, each alone: its argument checks
  (``validation.check_decode``), the plan's check of the call (``plan.check``), the two outputs'
  allocations, and the plan's launches (its workspace, the attention kernel, the combine);
- the pieces of a writer's call, each alone: the full argument checks (what a call's first use
  of a signature runs: ``validation.check_main``), the per-call part a warm call runs instead
  (``validation.signature``, the plan lookup and ``validation.check_pointers``), the ``q_out``
  allocation (``launch.new_output``, and ``new_empty``, its fallback), the plan's launch of an
  already-loaded kernel and torch's stream handle (``launch.current_raw_stream``).
"""

from __future__ import annotations

import argparse
import itertools
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

import nvfp4_mla

from .. import abi, launch, ops, validation
from ..ops import decode_launch
from ..testing import make_cache, random_rows, random_slots, rope_table
from .report import markdown_grid, write_suite
from .run import require_gpu, results_dir, suite_parser
from .timing import SUITE_HOST_BATCHES, SUITE_HOST_CALLS, host_pair

OUTPUT_STEM = "host_bench"  # host_bench.csv, host_bench.md
COLUMNS = ["call", "us", "add_us", "x_add", "target", "verdict"]
MAIN_TARGET, OTHER_TARGET = 1.8, 1.5  # x add_
DECODE_PLAN_TARGET = 2.0  # x add_: a decode call with a reused plan
MAX_POSITION = 4096
DECODE_HEADS, DECODE_K = 64, 128  # sparse_mla_decode: one query row, 64 heads, 128 selected tokens


def calls(device: torch.device) -> list[tuple[str, Callable[[], object], float | None]]:
    """(name, no-argument call, target ratio to ``add_`` or None) in measuring order, ``add_`` first;
    each call's kernel is loaded by its first run."""
    q = random_rows((1, 8, 512), device)
    kv = random_rows((1, 512), device)
    cache = make_cache(64, 256, device=device)
    kv_cache = make_cache(64, 128, device=device)
    slots = random_slots(1, 64 * 128).to(device)
    positions = torch.zeros(1, dtype=torch.int64, device=device)
    cos_sin = rope_table(MAX_POSITION, device)
    page = random_rows((1, 64, 512), device)
    scalar = torch.zeros(1, device=device)
    main_args = (q, kv, cache, slots, positions, cos_sin)
    kv_args = (kv, kv_cache, slots, positions, cos_sin)
    decode_q = random_rows((1, 1, DECODE_HEADS, 512), device)
    decode_slots = torch.randint(0, 64 * 256, (1, 1, DECODE_K), dtype=torch.int32, device=device)
    moving_q = itertools.cycle([decode_q, decode_q.clone()])  # q at another address each call
    decode_lens = torch.full((1, 1), DECODE_K, dtype=torch.int32, device=device)
    decode_plan = nvfp4_mla.plan_sparse_mla_decode(DECODE_HEADS, decode_slots, swa_lens=decode_lens)
    decode_checks = (decode_q, cache, decode_slots, decode_lens, None, None, None, 0.04, None, True)
    swa_layout, _ = validation.check_decode(*decode_checks)
    decode_out, decode_lse = nvfp4_mla.sparse_mla_decode(
        decode_q, cache, decode_slots, swa_lens=decode_lens, sm_scale=0.04, plan=decode_plan
    )
    decode_pools = (cache, decode_slots, decode_lens, swa_layout), (None, None, None, None)
    out_layout = (tuple(decode_out.shape), decode_out.stride())  # plain tuples, as new_output takes them
    lse_layout = (tuple(decode_lse.shape), decode_lse.stride())
    decode_launches = decode_plan.launches
    assert decode_launches is not None

    main = nvfp4_mla.cake_dsv4_nvfp4_rope_quantize_insert
    main(*main_args, q_head_padded=16)  # loads the kernel: the plan below is the warm call's
    tensors = (q, kv, cache, slots, positions, cos_sin)
    key = validation.signature(tensors, ("main", 16, True, False))  # the main entry's plan key
    plan = ops.DEFAULT.plans[key]
    bound, device_index = plan.launch, plan.device_index
    assert bound is not None
    pointers = validation.check_pointers(tensors, plan.checks)
    q_out = q.new_empty(plan.out_shape)

    def warm_checks() -> object:
        warm = ops.DEFAULT.plans.get(validation.signature(tensors, ("main", 16, True, False)))
        return validation.check_pointers(tensors, warm.checks)  # type: ignore[union-attr]

    def launch_loaded() -> None:
        bound(launch.current_raw_stream(device_index), pointers[0], q_out.data_ptr(), *pointers[1:], *plan.scalars)

    launch_loaded()  # packs the parameters the driver-only launch below reuses
    launcher, stream = bound.func.__self__, launch.current_raw_stream(device_index)
    argv = launch.parameter_buffer()[1]

    return [
        ("torch add_ (reference)", lambda: scalar.add_(1), None),
        ("main 8->16, T=1", lambda: main(*main_args, q_head_padded=16), MAIN_TARGET),
        ("in place 8, T=1", lambda: main(*main_args, q_inplace=True), MAIN_TARGET),
        ("kv r1, T=1", lambda: nvfp4_mla.cake_dsv4_nvfp4_kv_rope_quantize_insert(*kv_args), OTHER_TARGET),
        (
            "kv r2, T=1",
            lambda: nvfp4_mla.cake_dsv4_nvfp4_kv_rope_quantize_insert(*kv_args, compress_ratio=2),
            OTHER_TARGET,
        ),
        ("append, T=1", lambda: nvfp4_mla.nvfp4_quantize_append_sparse_mla_cache(kv, slots, cache), OTHER_TARGET),
        ("pack, 1 page of 64", lambda: nvfp4_mla.nvfp4_quantize_pack_sparse_mla_cache(page), OTHER_TARGET),
        (
            "reader, 1 slot, bf16",
            lambda: nvfp4_mla.nvfp4_dequantize_sparse_mla_cache(cache, slots, dtype=torch.bfloat16),
            None,
        ),
        (
            f"sparse_mla_decode, 1 row, {DECODE_HEADS} heads, k={DECODE_K}",
            lambda: nvfp4_mla.sparse_mla_decode(decode_q, cache, decode_slots, sm_scale=0.04),
            None,
        ),
        (
            f"sparse_mla_decode, 1 row, {DECODE_HEADS} heads, k={DECODE_K}, q at another address each call",
            lambda: nvfp4_mla.sparse_mla_decode(next(moving_q), cache, decode_slots, sm_scale=0.04),
            None,
        ),
        (
            f"sparse_mla_decode, 1 row, {DECODE_HEADS} heads, k={DECODE_K}, with lengths (the call schedules)",
            lambda: nvfp4_mla.sparse_mla_decode(decode_q, cache, decode_slots, swa_lens=decode_lens, sm_scale=0.04),
            None,
        ),
        (
            f"sparse_mla_decode, 1 row, {DECODE_HEADS} heads, k={DECODE_K}, with lengths and a reused plan",
            lambda: nvfp4_mla.sparse_mla_decode(
                decode_q, cache, decode_slots, swa_lens=decode_lens, sm_scale=0.04, plan=decode_plan
            ),
            DECODE_PLAN_TARGET,
        ),
        ("  piece: plan.update() (the scheduler's launch)", decode_plan.update, None),
        (
            "  piece: validation.check_decode (the decode call's checks)",
            lambda: validation.check_decode(*decode_checks),
            None,
        ),
        (
            "  piece: plan.check (the reused plan's check of the call)",
            lambda: decode_plan.check(decode_q, decode_slots, decode_lens, None, None),
            None,
        ),
        (
            "  piece: launch.new_output of out and lse (the decode's outputs)",
            lambda: (
                launch.new_output(decode_q, *out_layout, torch.bfloat16, device_index),
                launch.new_output(decode_q, *lse_layout, torch.float32, device_index),
            ),
            None,
        ),
        (
            "  piece: the reused plan's launches (workspace, attention, combine)",
            lambda: decode_launch.launch(
                decode_launches, decode_q, decode_out, decode_lse, 0.04, None, *decode_pools, decode_plan.work_address
            ),
            None,
        ),
        (
            "  piece: validation.check_main (first use of a signature)",
            lambda: validation.check_main(*main_args, 16, True, False, need_cuda=True),
            None,
        ),
        ("  piece: signature + plan lookup + check_pointers (warm call)", warm_checks, None),
        (
            "  piece: launch.new_output((1, 16, 512)) (q_out)",
            lambda: launch.new_output(q, plan.out_shape, plan.out_strides, torch.bfloat16, device_index),
            None,
        ),
        ("  piece: q.new_empty((1, 16, 512)) (its fallback)", lambda: q.new_empty((1, 16, abi.HEAD_DIM)), None),
        ("  piece: the plan's launch of the loaded main kernel", launch_loaded, None),
        ("  piece: launch.current_raw_stream", lambda: launch.current_raw_stream(device_index), None),
        (
            "  piece: CuPy's launchKernel alone (the floor)",
            lambda: launcher.launch_bare(bound.args[0], stream, argv),
            None,
        ),
    ]


def run(device: torch.device) -> list[dict[str, Any]]:
    """Every call of :func:`calls`, timed beside ``add_``, with its ratio to that ``add_`` and
    verdict; printed as it goes."""
    results: list[dict[str, Any]] = []
    (_, reference, _), *rows = calls(device)
    for name, call, target in rows:
        call()  # compiles or loads its kernel, outside the timing
        seconds, add_s = host_pair(call, reference)
        ratio = seconds / add_s
        verdict = "" if target is None else ("PASS" if ratio <= target else "MISS")
        row = dict(
            call=name,
            us=1e6 * seconds,
            add_us=1e6 * add_s,
            x_add=ratio,
            target="" if target is None else f"<= {target}x",
            verdict=verdict,
        )
        results.append(row)
        print(f"{name:64s} {row['us']:8.2f} us {row['add_us']:6.2f} us {ratio:6.2f}x {row['target']:8s} {verdict}")
    return results


def markdown(results: list[dict[str, Any]], device_name: str) -> str:
    """The markdown table of ``results`` under a title naming the GPU."""
    cells = [
        [r["call"], f"{r['us']:.2f}", f"{r['add_us']:.2f}", f"{r['x_add']:.2f}", r["target"], r["verdict"]]
        for r in results
    ]
    title = f"# Host time of one eager call on {device_name} (best of {SUITE_HOST_BATCHES} x {SUITE_HOST_CALLS} calls)"
    return "\n".join([title, "", *markdown_grid(COLUMNS, cells)]) + "\n"


def write(results: list[dict[str, Any]], out: Path, device_name: str) -> None:
    """``host_bench.csv`` and ``host_bench.md`` in ``out`` (created when missing)."""
    write_suite(out, OUTPUT_STEM, results, COLUMNS, markdown(results, device_name))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The suite's options (``out`` stays None: it depends on the GPU)."""
    parser = suite_parser("host", __doc__, OUTPUT_STEM)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    """Runs the suite (``argv`` as after ``nvfp4-mla bench host``); returns the exit status."""
    args = parse_args(argv)
    require_gpu("nvfp4-mla bench host")
    device = torch.device("cuda", torch.cuda.current_device())
    name = torch.cuda.get_device_name(device)
    out = results_dir(args.out, name)
    print(f"{name}, torch {torch.__version__}")
    write(run(device), out, name)
    print(f"wrote {out / f'{OUTPUT_STEM}.csv'} and {out / f'{OUTPUT_STEM}.md'}")
    return 0
