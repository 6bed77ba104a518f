"""Benchmark of the fused sparse decode, ``nvfp4_mla.sparse_mla_decode`` on CUDA tensors, against the
paths a user writes without it and the same run's ceilings:
``nvfp4-mla bench decode [--out DIR] [--quick] [--head-tiles] [--backends] [--ragged]`` (also
``python -m nvfp4_mla.bench decode``); ``--ragged`` adds :mod:`.decode_ragged`'s suite.

It prints a table and writes ``decode_bench.csv`` and ``decode_bench.md`` into DIR (default
``bench-results/<GPU name>/``).

**Shapes**: batch 1, 8, 64, 128; q_len 1, 2; heads 16, 64, 128; 128 sliding-window
plus 512 or 1024 compressed selections, every selection live, int32 slots, per-head sinks,
``sm_scale = 1/sqrt(576)``. ``--quick`` runs batch 1 and 64 only. Both also run prefill:
4,096 and 16,384 query rows of 128 heads over 128 + 512 selections, the fused arm
alone (the torch arms would gather 2.7 and 10.7 GB of BF16 rows). The window pool holds 2^18
tokens, the compressed pool 2^20 (96 and 384 MiB of records; 0.25 and 1 GiB as BF16), both
written from the same random BF16 rows by the pack entry, page size 64. Calls rotate over up to
8 slot sets, so small calls do not find their records in L2 from the previous call.

**Arms** (:mod:`.decode_arms`), each timed graph-replayed (``triton.testing.do_bench_cudagraph`` over
graphs of about 20 ms, median) and eager (back-to-back calls, median of 5 batches; both
:class:`~nvfp4_mla.bench.timing.DeviceTimer`): ``fused`` (this kernel), ``torch_bf16`` and
``torch_reader`` (what a user writes without it).

**Rooflines** of each shape, from the same run: bytes (q, out, lse, 384 per selected token,
the int32 slots) over the copy ceiling (eager ``copy_`` of 1 GiB, read + write:
:func:`~nvfp4_mla.bench.ceilings.copy_bandwidth`), and the useful MMA flops
``4 * 512 * selected tokens * heads`` per query row over a large BF16 ``matmul`` (8192^3,
graph-replayed: :func:`~nvfp4_mla.bench.ceilings.matmul_flops`). ``% roofline`` is the binding
one's time over the measured time; ``byte_roofline_pct``, the Hopper target's: the bytes' time
plus one empty launch (graph-replayed), over the measured time. ``diff`` is the largest
``|fused - torch_reader|`` over the largest ``|torch_reader|`` (a sanity check: both read the same
records; BF16 weights make it about 1e-2 at most).

**Plan**: each row's ``backend``, ``head_tile`` and ``parts``, the parts of its work list (the
rows are cut where the parts' boundaries fall in their live tiles).

**Verdicts**: the targets against the torch arms and the rooflines, then the Hopper kernel's
absolute targets (lines labelled "Hopper target:") on the rows the selection rule ran (``choice``
"rule"; "forced" rows run a backend or head tile the ``--head-tiles`` and ``--backends`` options
force). The Hopper kernel's targets against FlashMLA are not measured here.

The predictions written before its first measurement are in docs/performance_history.md.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import torch

import nvfp4_mla

from .. import abi
from ..device import device_info
from ..ops import decode as decode_op
from ..ops import decode_mma
from .ceilings import copy_bandwidth, empty_kernel_launcher, matmul_flops
from .decode_arms import ARMS, SWA_K, Inputs, Pools, fused, torch_reader
from .decode_ragged import ragged
from .report import markdown_grid, write_suite
from .run import require_gpu, results_dir, suite_parser
from .timing import SUITE_GRAPH_S, SUITE_REPS, DeviceTimer, Timer

MAX_SETS = 8
DEFAULT_L2_BYTES = 50 << 20  # when torch does not report the device's L2 size
OUTPUT_STEM = "decode_bench"  # decode_bench.csv, decode_bench.md
TARGETS = {  # against the torch arms and the rooflines
    "speedup_small_heads": 4.0,  # vs torch_bf16, heads <= 32
    "speedup_128_heads": 2.0,  # vs torch_bf16, heads 128
    "roofline_batch32": 0.40,  # batch >= 32, % of the binding roofline
    "batch1_128_heads_us": 15.0,  # graph-replayed
}
HOPPER_TARGETS = {  # the Hopper kernel's absolute targets (H200)
    "matmul_pct_128_heads": 50.0,  # 128 heads, >= 64 query rows: % of the same-run matmul
    "byte_roofline_pct_16_heads": 50.0,  # 16 heads, >= 64 query rows: byte_roofline_pct
    "batch1_128_heads_640_us": 10.0,  # 1 row, 128 heads, 128 + 512 tokens, graph-replayed
    "prefill_16384_over_4096": 1.0,  # TFLOP/s at 16,384 query rows over 4,096 (128 heads, 640 tokens)
}
PREFILL_ROWS = (4096, 16384)  # query rows of the prefill shapes: 128 heads, 128 + 512 tokens, q_len 1
Shape = tuple[int, int, int, int]  # batch, q_len, heads, extra_k


# ---------------------------------------------------------------- models, measurement, verdicts


def shapes(quick: bool) -> list[Shape]:
    """The decode shapes (``quick``: batch 1 and 64 only)."""
    batches = (1, 64) if quick else (1, 8, 64, 128)
    return [(b, q, h, k) for b in batches for q in (1, 2) for h in (16, 64, 128) for k in (512, 1024)]


def prefill_shapes() -> list[Shape]:
    """The prefill shapes, the fused arm alone."""
    return [(rows, 1, 128, 512) for rows in PREFILL_ROWS]


def useful(batch: int, q_len: int, heads: int, extra_k: int) -> tuple[int, int]:
    """(bytes, flops) of one call: every selection is live."""
    rows, tokens = batch * q_len, SWA_K + extra_k
    q_out = 2 * rows * heads * abi.HEAD_DIM * 2 + rows * heads * 4
    return q_out + rows * tokens * (abi.RECORD_BYTES + 4), 4 * abi.HEAD_DIM * tokens * heads * rows


def set_count(shape: Shape, l2_bytes: int) -> int:
    """Slot sets to rotate over: enough that a set's records are gone from L2 when it comes back."""
    batch, q_len, _, extra_k = shape
    record_bytes = batch * q_len * (SWA_K + extra_k) * abi.RECORD_BYTES
    return max(1, min(MAX_SETS, -(-2 * l2_bytes // record_bytes)))


def add_rooflines(row: dict[str, Any], shape: Shape, ceilings: dict[str, float]) -> None:
    """The fused arm's rate and its shares of the byte and flop rooflines, into ``row``."""
    nbytes, flops = useful(*shape)
    t = row["fused_graph_us"] * 1e-6
    bytes_time, flops_time = nbytes / ceilings["copy"], flops / ceilings["matmul"]
    row["fused_tflops"] = flops / t / 1e12
    row["bytes_pct"] = 100 * bytes_time / t
    row["flops_pct"] = 100 * flops_time / t
    row["binding"] = "flops" if flops_time > bytes_time else "bytes"
    row["roofline_pct"] = max(row["bytes_pct"], row["flops_pct"])
    row["byte_roofline_pct"] = 100 * (bytes_time + ceilings["launch"]) / t


def measure(
    pools: Pools,
    shape: Shape,
    ceilings: dict[str, float],
    g: torch.Generator,
    timer: Timer,
    forced: nvfp4_mla.KernelLibrary | None = None,
    peers: bool = True,
) -> dict[str, Any]:
    """One shape's row: every arm, or the fused arm alone with ``forced`` (on that library's
    choices) or without ``peers``."""
    batch, q_len, heads, extra_k = shape
    l2 = getattr(torch.cuda.get_device_properties(0), "L2_cache_size", DEFAULT_L2_BYTES)
    sets = [Inputs(*shape, g, pools) for _ in range(set_count(shape, l2))]
    arms = dict(ARMS) if forced is None and peers else {"fused": lambda p, x: fused(p, x, forced)}
    row: dict[str, Any] = {"batch": batch, "q_len": q_len, "heads": heads, "tokens": SWA_K + extra_k, "sets": len(sets)}
    row["choice"] = "rule" if forced is None else "forced"
    for name, arm in arms.items():
        call = lambda x, arm=arm: arm(pools, x)  # noqa: E731
        row[f"{name}_graph_us"] = timer.graph(call, sets) * 1e6
        row[f"{name}_eager_us"] = timer.eager(call, sets)[0] * 1e6
        torch.cuda.empty_cache()
    add_rooflines(row, shape, ceilings)
    library = forced or nvfp4_mla.ops.DEFAULT  # the plan of the arms' calls (without lengths)
    plan = decode_op.plan(library, 0, heads, batch * q_len, SWA_K, extra_k, lengths=False)
    row["backend"], row["head_tile"], row["parts"] = plan.backend, plan.head_tile, plan.parts
    if "torch_bf16" in arms:
        row["vs_torch_bf16"] = row["torch_bf16_graph_us"] / row["fused_graph_us"]
        row["vs_torch_reader"] = row["torch_reader_graph_us"] / row["fused_graph_us"]
        got, want = fused(pools, sets[0])[0].float(), torch_reader(pools, sets[0])[0].float()
        row["diff"] = float((got - want).abs().max() / want.abs().max())
    return row


def verdicts(rows: list[dict]) -> list[str]:
    """The targets against the measured rows (a target without rows has no line)."""
    small = [r for r in rows if r["heads"] <= 32 and "vs_torch_bf16" in r]
    big = [r for r in rows if r["heads"] == 128 and "vs_torch_bf16" in r]
    large_batch = [r for r in rows if r["batch"] >= 32 and "vs_torch_bf16" in r]
    one = [r for r in rows if r["batch"] == 1 and r["heads"] == 128 and "vs_torch_bf16" in r]
    rule = [r for r in rows if r.get("choice") == "rule"]
    many_rows = [r for r in rule if r["batch"] * r["q_len"] >= 64]
    one_640 = [r for r in rule if r["batch"] * r["q_len"] == 1 and r["heads"] == 128 and r["tokens"] == 640]
    prefill = {
        r["batch"] * r["q_len"]: r["fused_tflops"]
        for r in rule
        if r["heads"] == 128 and r["tokens"] == 640 and r["batch"] * r["q_len"] in PREFILL_ROWS
    }
    checks: list[tuple[str, list[float], float, bool]] = [  # name, values, goal, at most
        (
            "vs torch_bf16, heads <= 32 (min speedup)",
            [r["vs_torch_bf16"] for r in small],
            TARGETS["speedup_small_heads"],
            False,
        ),
        (
            "vs torch_bf16, heads 128 (min speedup)",
            [r["vs_torch_bf16"] for r in big],
            TARGETS["speedup_128_heads"],
            False,
        ),
        (
            "batch >= 32, % of binding roofline (min)",
            [r["roofline_pct"] for r in large_batch],
            100 * TARGETS["roofline_batch32"],
            False,
        ),
        (
            "batch 1, heads 128, graph us (max)",
            [r["fused_graph_us"] for r in one],
            TARGETS["batch1_128_heads_us"],
            True,
        ),
        (
            "Hopper target: heads 128, >= 64 rows, % of the matmul (min)",
            [r["flops_pct"] for r in many_rows if r["heads"] == 128],
            HOPPER_TARGETS["matmul_pct_128_heads"],
            False,
        ),
        (
            "Hopper target: heads 16, >= 64 rows, % of the byte roofline with a launch (min)",
            [r["byte_roofline_pct"] for r in many_rows if r["heads"] == 16],
            HOPPER_TARGETS["byte_roofline_pct_16_heads"],
            False,
        ),
        (
            "Hopper target: 1 row, heads 128, 640 tokens, graph us (max)",
            [r["fused_graph_us"] for r in one_640],
            HOPPER_TARGETS["batch1_128_heads_640_us"],
            True,
        ),
        (
            f"Hopper target: prefill TFLOP/s, {PREFILL_ROWS[1]} rows / {PREFILL_ROWS[0]}",
            [prefill[PREFILL_ROWS[1]] / prefill[PREFILL_ROWS[0]]] if len(prefill) == 2 else [],
            HOPPER_TARGETS["prefill_16384_over_4096"],
            False,
        ),
    ]
    lines = []
    for name, values, goal, at_most in checks:
        if not values:
            continue
        value = max(values) if at_most else min(values)
        met = value <= goal if at_most else value >= goal
        lines.append(f"{name}: {value:.3g} (goal {goal:g}) {'met' if met else 'MISSED'}")
    return lines


COLUMNS = [
    "batch", "q_len", "heads", "tokens", "backend", "head_tile", "parts", "sets",
    "fused_graph_us", "fused_eager_us", "torch_bf16_graph_us", "torch_bf16_eager_us",
    "torch_reader_graph_us", "torch_reader_eager_us", "vs_torch_bf16", "vs_torch_reader",
    "fused_tflops", "bytes_pct", "flops_pct", "binding", "roofline_pct", "byte_roofline_pct", "choice", "diff",
]  # fmt: skip


def markdown(rows: list[dict[str, Any]], ceilings: dict[str, float], lines: list[str], device_name: str) -> str:
    """The report: the ceilings, the verdict ``lines`` and the table of :data:`COLUMNS`."""

    def cell(value: object) -> str:
        return f"{value:.3g}" if isinstance(value, float) else str(value)

    md = [
        f"# Fused sparse decode on {device_name}",
        "",
        f"copy ceiling {ceilings['copy'] / 1e12:.2f} TB/s, matmul ceiling {ceilings['matmul'] / 1e12:.0f} TFLOP/s, "
        f"empty launch {ceilings['launch'] * 1e6:.2f} us",
        "",
        *[f"- {line}" for line in lines],
        "",
        *markdown_grid(COLUMNS, [[cell(r.get(c, "")) for c in COLUMNS] for r in rows]),
    ]
    return "\n".join(md) + "\n"


def write(
    rows: list[dict[str, Any]], ceilings: dict[str, float], lines: list[str], out: Path, device_name: str
) -> None:
    """``decode_bench.csv`` and ``decode_bench.md`` in ``out`` (created when missing)."""
    write_suite(out, OUTPUT_STEM, rows, COLUMNS, markdown(rows, ceilings, lines, device_name))


# ---------------------------------------------------------------- command line


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The suite's options (``out`` stays None: it depends on the GPU)."""
    parser = suite_parser("decode", __doc__, OUTPUT_STEM)
    parser.add_argument("--quick", action="store_true", help="batch 1 and 64 only")
    parser.add_argument(
        "--head-tiles", action="store_true", help="also every head tile at 64 and 128 heads, fused only"
    )
    parser.add_argument(
        "--backends", action="store_true", help="also every other backend of this GPU on every shape, fused only"
    )
    parser.add_argument(
        "--ragged", action="store_true", help="also ragged batches: time against live work, one call and a reused plan"
    )
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    """Runs the suite (``argv`` as after ``nvfp4-mla bench decode``); returns the exit status."""
    args = parse_args(argv)
    require_gpu("nvfp4-mla bench decode")
    torch.cuda.set_device(0)
    device = torch.device("cuda", 0)
    name = torch.cuda.get_device_name(device)
    out = results_dir(args.out, name)
    timer = DeviceTimer(SUITE_REPS, SUITE_GRAPH_S)
    g = torch.Generator().manual_seed(0)
    ceilings = {"copy": copy_bandwidth(device, timer)}
    torch.cuda.empty_cache()
    ceilings["matmul"] = matmul_flops(device, timer)
    torch.cuda.empty_cache()
    ceilings["launch"] = timer.graph(empty_kernel_launcher(device), [None])
    print(
        f"copy {ceilings['copy'] / 1e12:.2f} TB/s, matmul {ceilings['matmul'] / 1e12:.0f} TFLOP/s, "
        f"empty launch {ceilings['launch'] * 1e6:.2f} us"
    )
    pools = Pools(device)
    header = f"{'batch':>5} {'q':>2} {'heads':>5} {'tok':>5} {'tile':>4} {'parts':>5} {'fused':>8} {'bf16':>8} "
    print(header + f"{'reader':>8} {'xbf16':>6} {'TF/s':>6} {'roof%':>6} {'diff':>8}")
    rows = []
    grid = shapes(args.quick)
    for shape in grid:
        r = measure(pools, shape, ceilings, g, timer)
        rows.append(r)
        print(
            f"{r['batch']:5d} {r['q_len']:2d} {r['heads']:5d} {r['tokens']:5d} {r.get('head_tile', 0):4d} "
            f"{r.get('parts', 0):5d} {r['fused_graph_us']:8.1f} {r['torch_bf16_graph_us']:8.1f} "
            f"{r['torch_reader_graph_us']:8.1f} {r['vs_torch_bf16']:6.2f} {r['fused_tflops']:6.1f} "
            f"{r['roofline_pct']:6.1f} {r['diff']:8.2e}"
        )
    for shape in prefill_shapes():
        r = measure(pools, shape, ceilings, g, timer, peers=False)
        rows.append(r)
        torch.cuda.empty_cache()
        print(f"prefill {shape}: fused {r['fused_graph_us']:.1f} us, {r['fused_tflops']:.1f} TFLOP/s")
    if args.head_tiles:
        optin = device_info(0).shared_optin
        tiles = [t for t in decode_mma.HEAD_TILES[1:] if decode_mma.shared_bytes(t) <= optin]
        for shape in [s for s in grid if s[2] >= 64 and s[1] == 2]:
            for tile in tiles:
                r = measure(
                    pools,
                    shape,
                    ceilings,
                    g,
                    timer,
                    nvfp4_mla.KernelLibrary(decode_backend="mma_sync", decode_head_tile=tile),
                )
                rows.append(r)
                print(f"head tile {tile}: {shape} fused {r['fused_graph_us']:.1f} us, {r['fused_tflops']:.1f} TFLOP/s")
    if args.backends:  # every backend of this GPU on the shapes where the rule picked another one
        gpu = device_info(0)
        defaults = rows[: len(grid)]
        for backend in [n for n, b in decode_op.BACKENDS.items() if b.supports(gpu.capability)]:
            library = nvfp4_mla.KernelLibrary(decode_backend=backend)
            for shape, default in zip(grid, defaults):
                if default["backend"] == backend:
                    continue
                r = measure(pools, shape, ceilings, g, timer, library)
                rows.append(r)
                speedup = default["fused_graph_us"] / r["fused_graph_us"]
                print(
                    f"{backend}: {shape} fused {r['fused_graph_us']:.1f} us ({r['parts']} parts), "
                    f"{r['fused_tflops']:.1f} TFLOP/s, {speedup:.2f}x the default"
                )
    if args.ragged:
        ragged(pools, g, timer, out, name)
    lines = verdicts(rows)
    print("\n".join(lines))
    write(rows, ceilings, lines, out, name)
    print(f"wrote {out / f'{OUTPUT_STEM}.csv'} and {out / f'{OUTPUT_STEM}.md'}")
    return 0
