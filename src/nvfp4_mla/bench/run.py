"""Measuring the grid, and the command line ``nvfp4-mla bench`` (``python -m nvfp4_mla.bench``)."""

from __future__ import annotations

import argparse
import datetime
import importlib
import json
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from ..device import gpu_unavailable_reason
from ..help_text import plain
from ..testing import rope_table
from .arms import ARM_TITLES, Call, Library, compiled_reference, fused_call, same_outputs, unfused_call
from .ceilings import measure_ceilings
from .grid import (
    ENTRIES,
    MAX_POSITION,
    SHIPPED_KV_ROWS_PER_WARP,
    Row,
    full_grid,
    input_set_count,
    measurement_order,
    modelled_bytes,
    quick_grid,
    select_rows,
)
from .inputs import Inputs, inserted_rows, make_inputs
from .plot import write_plot
from .probes import environment, first_call_probe, gpu_slug, measure_first_use
from .report import SHORT_COLUMNS, markdown_report, markdown_table, write_csv
from .results import ArmSkipped, Ceilings, RowResult, format_s, format_us, reason
from .stub import kernel_library
from .targets import target_summary
from .timing import DeviceTimer, Timer

COMPILE_MAX_TOKENS = 4096  # the torch.compile arm stops here to keep the run short
# torch.compile recompiles per shape (10-30 s each): no new compile starts once this much compile
# time is spent, so the full run stays near 4 minutes.
DEFAULT_COMPILE_BUDGET_S = 90.0
DEFAULT_L2_BYTES = 50 * 2**20  # when torch does not report the device's L2 size
RESULTS_DIR = Path("bench-results")  # default output: RESULTS_DIR/<GPU name>/
OUTPUT_STEM = "bench"  # bench.csv, bench.md, bench.png
# ``nvfp4-mla bench <suite>``: modules of this package with their own ``main(argv)``; no suite
# name: the writers' grid.
SUITES = {
    "reader": "[--out DIR]: the GPU reader (nvfp4_dequantize_sparse_mla_cache)",
    "decode": "[--out DIR] [--quick] [--head-tiles]: the fused sparse decode (sparse_mla_decode)",
    "host": "[--out DIR]: host time of one eager call of each entry, against torch add_",
}


@dataclass
class Context:
    """What every row's measurement shares.

    ``libraries(kv_rows_per_warp, stubbed)`` gives the entries the fused arms (``stubbed`` False)
    and the no-quantizer arm (True) call: :func:`~nvfp4_mla.bench.stub.kernel_library`; the CPU
    tests give ``nvfp4_mla.reference``.
    """

    device: torch.device
    cos_sin: torch.Tensor
    timer: Timer
    l2_bytes: int
    compile_budget_s: float
    libraries: Callable[[int, bool], Library] = kernel_library
    compile_spent_s: float = 0.0


def _progress(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def attempt(result: RowResult, arm: str, measure: Callable[[], float]) -> None:
    """Runs one arm's measurement; a failure makes the arm n/a with its reason, not the run fail."""
    try:
        result.seconds[arm] = measure()
    except Exception as exc:
        result.seconds[arm] = None
        outcome = "skipped" if isinstance(exc, ArmSkipped) else "n/a"
        result.notes.append(f"{ARM_TITLES[arm]}: {outcome}: {reason(exc)}")
        if isinstance(exc, torch.cuda.OutOfMemoryError):
            torch.cuda.empty_cache()


def compiled_seconds(row: Row, sets: list[Inputs], fused: Call, result: RowResult, ctx: Context) -> float:
    """The compile arm: within the budget, compiles this shape (timed, checked against the fused
    arm's bytes) and times it eagerly."""
    if ctx.compile_budget_s <= 0:
        raise ArmSkipped("--compile-budget 0")
    if ctx.compile_spent_s >= ctx.compile_budget_s:
        raise ArmSkipped(f"compile budget of {ctx.compile_budget_s:.0f} s spent")
    compiled = fused_call(row, compiled_reference(), ctx.cos_sin)
    began = time.perf_counter()
    try:
        agree = same_outputs(fused, compiled, sets[0])  # the first compiled call compiles this shape
    finally:
        result.compile_first_call_s = time.perf_counter() - began
        ctx.compile_spent_s += result.compile_first_call_s
    if not agree:
        result.notes.append("torch.compile(reference) wrote different bytes from the fused kernel")
    return ctx.timer.eager(compiled, sets)[0]


def measure_row(row: Row, ctx: Context) -> RowResult:
    """Every arm of one row; a failed arm is n/a with a note."""
    sets = [make_inputs(row, ctx.device) for _ in range(input_set_count(modelled_bytes(row), ctx.l2_bytes))]
    result = RowResult(row, modelled_bytes(row, inserted_rows(row, sets)), len(sets))
    library = ctx.libraries(row.kv_rows_per_warp, False)
    fused = fused_call(row, library, ctx.cos_sin)

    def fused_eager() -> float:
        seconds, result.calls_per_batch = ctx.timer.eager(fused, sets)
        return seconds

    def stub_graph() -> float:  # the library is built here: a failing stub transform is this arm's n/a
        stub = fused_call(row, ctx.libraries(row.kv_rows_per_warp, True), ctx.cos_sin)
        return ctx.timer.graph(stub, sets)

    attempt(result, "fused", fused_eager)
    if result.seconds["fused"] is None:
        return result
    attempt(result, "graph", lambda: ctx.timer.graph(fused, sets))
    # Right after the graph arm, so that kernel / stub compares neighbouring measurements.
    attempt(result, "stub", stub_graph)
    unfused = unfused_call(row, library, ctx.cos_sin)
    if unfused is not None:
        attempt(result, "unfused", lambda: ctx.timer.eager(unfused, sets)[0])
    if row.num_tokens <= COMPILE_MAX_TOKENS:
        attempt(result, "compile", lambda: compiled_seconds(row, sets, fused, result, ctx))
    if row.num_tokens == 1:
        try:
            result.host_s = ctx.timer.host(fused, sets[0])
        except Exception as exc:
            result.notes.append(f"host time: n/a: {reason(exc)}")
    return result


def run_grid(rows: list[Row], ctx: Context) -> list[RowResult]:
    """Measures every row (in :func:`~nvfp4_mla.bench.grid.measurement_order`) and returns the
    results in grid order."""
    results: dict[int, RowResult] = {}
    began = time.perf_counter()
    for done, i in enumerate(measurement_order(rows), 1):
        row = rows[i]
        try:
            result = measure_row(row, ctx)
        except Exception as exc:  # input creation (memory) or a broken context: keep the others
            result = RowResult(row, modelled_bytes(row), 0, notes=[f"row failed: {reason(exc)}"])
        results[i] = result
        torch.cuda.empty_cache()
        arms = ", ".join(f"{arm} {format_us(result.seconds[arm])} us" for arm in ARM_TITLES if arm in result.seconds)
        _progress(
            f"[{done}/{len(rows)}] {row.label} T={row.num_tokens}: {arms or '; '.join(result.notes)} "
            f"({time.perf_counter() - began:.0f} s)"
        )
    return [results[i] for i in range(len(rows))]


# ---------------------------------------------------------------- command line


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The benchmark's options, defaults resolved (``out`` stays None: it depends on the GPU)."""
    parser = argparse.ArgumentParser(
        prog="nvfp4-mla bench",
        description="Benchmark of the nvfp4_mla writers on this GPU against torch RoPE + append, "
        "torch.compile of the reference and the same launch with the quantizer stubbed, with the copy and "
        "launch ceilings and the performance targets. Needs a CUDA GPU; about 4 minutes (--quick: under 1). "
        "Also: python -m nvfp4_mla.bench.",
        epilog="Other suites, each with its own -h: "
        + "; ".join(f"nvfp4-mla bench {name} {usage}" for name, usage in SUITES.items())
        + ".",
    )
    parser.add_argument(
        "--quick",
        action="store_true",
        help=f"a short grid ({len(quick_grid())} rows), fewer repetitions, no torch.compile arm",
    )
    parser.add_argument(
        "--out",
        type=Path,
        default=None,
        metavar="DIR",
        help=f"directory for {OUTPUT_STEM}.csv/.md/.png (default: {RESULTS_DIR}/<GPU name>/ in the current directory)",
    )
    parser.add_argument(
        "--reps",
        type=int,
        default=None,
        help="timed batches per eager arm, the median is reported (default 15; --quick 7)",
    )
    parser.add_argument(
        "--compile-budget",
        type=float,
        default=None,
        metavar="SECONDS",
        help="stop starting torch.compile arms once their compiles took this long "
        f"(default {DEFAULT_COMPILE_BUDGET_S:.0f}; --quick 0: no compile arm)",
    )
    parser.add_argument(
        "--entries",
        nargs="+",
        choices=ENTRIES,
        default=list(ENTRIES),
        metavar="ENTRY",
        help=f"measure only these entries' rows, of {', '.join(ENTRIES)} (default: all)",
    )
    parser.add_argument(
        "--kv-rows-per-warp",
        nargs="+",
        type=int,
        default=[SHIPPED_KV_ROWS_PER_WARP],
        metavar="N",
        help="the KV rows per warp A/B: measure the kv, append and pack rows once with each N KV rows a "
        f"warp (default: {SHIPPED_KV_ROWS_PER_WARP}, the shipped kernels; the targets judge only those)",
    )
    parser.add_argument("--first-call-probe", choices=("cold", "warm"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.reps is None:
        args.reps = 7 if args.quick else 15
    if args.compile_budget is None:
        args.compile_budget = 0.0 if args.quick else DEFAULT_COMPILE_BUDGET_S
    if args.reps < 1:
        parser.error("--reps must be at least 1")
    if min(args.kv_rows_per_warp) < 1:
        parser.error("--kv-rows-per-warp takes counts of at least 1")
    return args


def suite_parser(suite: str, doc: str | None, output_stem: str) -> argparse.ArgumentParser:
    """The parser of ``nvfp4-mla bench <suite>``, described by the first paragraph of ``doc``, with
    its ``--out`` option (None unless given: see :func:`results_dir`)."""
    parser = argparse.ArgumentParser(prog=f"nvfp4-mla bench {suite}", description=plain((doc or "").split("\n\n")[0]))
    parser.add_argument(
        "--out",
        type=Path,
        default=None,
        metavar="DIR",
        help=f"directory for {output_stem}.csv and .md (default: {RESULTS_DIR}/<GPU name>/ in the current directory)",
    )
    return parser


def require_gpu(command: str) -> None:
    """Exits with the reason when the GPU path cannot run here."""
    unavailable = gpu_unavailable_reason()
    if unavailable is not None:
        raise SystemExit(f"{command} needs a CUDA GPU (sm_80 or newer) with CuPy: {unavailable}")


def results_dir(out: Path | None, gpu_name: str) -> Path:
    """``out``, else ``bench-results/<gpu slug>/`` under the current directory."""
    return out if out is not None else RESULTS_DIR / gpu_slug(gpu_name)


def write_outputs(
    out: Path, results: list[RowResult], ceilings: Ceilings, report: Callable[[str | None], str], gpu_name: str
) -> None:
    """The CSV, the plot (skipped without matplotlib) and the markdown ``report(plot_name)``."""
    out.mkdir(parents=True, exist_ok=True)
    write_csv(out / f"{OUTPUT_STEM}.csv", results, ceilings)
    plot_name: str | None = f"{OUTPUT_STEM}.png"
    try:
        write_plot(
            out / f"{OUTPUT_STEM}.png", results, ceilings, f"main entry, 8 heads padded to 16, page 256: {gpu_name}"
        )
    except Exception as exc:  # matplotlib missing: the tables still count
        _progress(f"plot not written: {reason(exc)}")
        plot_name = None
    (out / f"{OUTPUT_STEM}.md").write_text(report(plot_name))
    _progress(f"wrote {out}/{OUTPUT_STEM}.csv, .md" + (", .png" if plot_name else ""))


def main(argv: list[str] | None = None) -> int:
    """Runs the benchmark (``argv`` as after ``nvfp4-mla bench``; a first argument naming one of
    :data:`SUITES` runs that suite instead); returns the exit status."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] and argv[0] in SUITES:
        suite = importlib.import_module(f"{__package__}.{argv[0]}")  # imported only when asked for
        status: int = suite.main(argv[1:])
        return status
    args = parse_args(argv)
    if args.first_call_probe:
        print(json.dumps(first_call_probe(args.first_call_probe)))
        return 0
    require_gpu("nvfp4-mla bench")

    began = time.perf_counter()
    started = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    torch.manual_seed(0)
    device = torch.device("cuda", torch.cuda.current_device())
    props = torch.cuda.get_device_properties(device)
    out = results_dir(args.out, props.name)
    rows = select_rows(quick_grid() if args.quick else full_grid(), tuple(args.entries), tuple(args.kv_rows_per_warp))
    _progress(f"nvfp4-mla bench on {props.name}: {len(rows)} rows, results to {out}")

    timer = DeviceTimer(args.reps)
    ceilings = measure_ceilings(device, timer)
    copy_gbps = "n/a" if ceilings.copy_bytes_per_s is None else f"{ceilings.copy_bytes_per_s * 1e-9:.4g}"
    _progress(
        f"ceilings: copy {copy_gbps} GB/s, empty kernel eager {format_us(ceilings.launch_eager_s)} us / graph "
        f"{format_us(ceilings.launch_graph_s)} us, add_ host {format_us(ceilings.add_host_s)} us"
    )
    first_use = measure_first_use()
    _progress(
        f"first use: cold {format_s(first_use.cold_first_call_s)}, warm {format_s(first_use.warm_first_call_s)}"
        + (f" ({first_use.error})" if first_use.error else "")
    )
    l2_bytes = getattr(props, "L2_cache_size", 0) or DEFAULT_L2_BYTES
    ctx = Context(device, rope_table(MAX_POSITION, device), timer, l2_bytes, args.compile_budget)
    results = run_grid(rows, ctx)

    run = [
        (
            "run",
            f"{'--quick' if args.quick else 'full'} grid ({' '.join(args.entries)}; KV rows per warp "
            f"{' '.join(map(str, args.kv_rows_per_warp))}), {args.reps} timed batches per eager arm, "
            f"compile budget {args.compile_budget:.0f} s (spent {ctx.compile_spent_s:.0f} s), "
            f"{started}, {time.perf_counter() - began:.0f} s",
        ),
    ]
    env = environment(device)
    write_outputs(
        out,
        results,
        ceilings,
        lambda plot_name: markdown_report(env, run, ceilings, first_use, results, plot_name),
        props.name,
    )
    for title, verdict, detail in target_summary(results, ceilings, first_use):
        print(f"{verdict:4}  {title}: {detail}")
    print()
    print(markdown_table(results, ceilings, SHORT_COLUMNS))
    return 0
