"""Benchmark of the GPU reader, ``nvfp4_dequantize_sparse_mla_cache`` on CUDA tensors, against
the same run's ceilings: ``nvfp4-mla bench reader [--out DIR]`` (also
``python -m nvfp4_mla.bench reader``).

It prints a table and writes ``reader_bench.csv`` and ``reader_bench.md`` into DIR (default
``bench-results/<GPU name>/``).

What is measured (one process, one GPU):

- **copy ceiling**: ``copy_`` of a 1 GiB device tensor, bytes read + written per second,
  back-to-back eager calls (:func:`~nvfp4_mla.bench.ceilings.copy_bandwidth`);
- **bandwidth**: 65,536 (and 262,144) rows, BF16 (and fp32) out, distinct random slots over a
  pool of at least max(256 MiB, 4 x L2), bytes = 384 read + 512 x {2, 4} written + the slot, per
  row, per second of graph-replayed device time, as % of the copy ceiling. Calls rotate over 4
  slot sets with their own outputs, so records are not found in L2. Also sequential slots (the
  same kernel and bytes, DRAM-friendly order) and rows_per_team 1, 2 and 4 side by side (same
  run: an A/B of the kernel's rows in flight);
- **1 row, graph-replayed**: device time of one call replayed from a CUDA graph (slot and
  record then sit in L2, as in a decode loop), next to an empty kernel's;
- **eager host time**: best of 5 batches of 4,000 calls, host clock, each from an idle device,
  over torch ``add_`` on a 1-element tensor measured the same way in batches alternating with
  the call's (:func:`~nvfp4_mla.bench.timing.host_pair`); also its parts alone (an empty
  kernel's launch, the output's allocation, the argument checks);
- **4,096 rows vs the pure-torch reference** (``nvfp4_mla.reference`` on the same GPU): eager
  time per call, back to back (median of 5 batches), BF16 out.

Device time: ``triton.testing.do_bench_cudagraph`` over graphs of about 20 ms, median of its 10
replays; eager times: ``torch.utils.benchmark.Timer`` (:class:`~nvfp4_mla.bench.timing.DeviceTimer`).

Predictions, written before the first measurement on an H200 (141 GB HBM3e, 60 MB L2):

- copy ceiling about 4.3 TB/s (read + write);
- 65,536 rows BF16: about 85% of the copy ceiling (~24 us). A random 352-byte data row spans 6
  or 7 of HBM's 64-byte bursts and the 32-byte scale slot one, so about 10-15% more bytes move
  than the model counts; fp32 out a little higher (more of the traffic is sequential writes);
  rows_per_team 2 and 4 within a few % of each other, 1 a few % lower;
- 1 row graph-replayed: about 1.6 us (an empty kernel about 0.5 us, plus two dependent L2
  round trips: slot, then record);
- eager host time about 1.4x torch ``add_`` (checks + one allocation + one cuLaunchKernel);
- 4,096 rows: about 40x faster than the reference (its dozen-odd launches and temporaries cost
  about 0.3 ms; the kernel call is host-bound at about 7 us).
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

import nvfp4_mla

from .. import abi, kernel_cache, reference, validation
from ..launch import new_output
from ..ops import reader as gpu_reader
from ..testing import make_cache, raw_bytes
from .ceilings import copy_bandwidth, empty_kernel_launcher
from .report import markdown_grid, write_suite
from .run import require_gpu, results_dir, suite_parser
from .timing import SUITE_GRAPH_S, SUITE_REPS, DeviceTimer, Timer, host_pair

PAGE_SIZE = 64
SLOT_SETS = 4  # calls rotate over these, so a call does not find the previous call's records in L2
OUTPUT_STEM = "reader_bench"  # reader_bench.csv, reader_bench.md
COLUMNS = ["measure", "value", "unit", "target", "note"]
read = nvfp4_mla.nvfp4_dequantize_sparse_mla_cache
SlotsOut = tuple[torch.Tensor, torch.Tensor]  # one call's slots and output rows


# ---------------------------------------------------------------- inputs and the bytes model


def pool_cache(device: torch.device) -> torch.Tensor:
    """A cache of at least max(256 MiB, 4 x L2) of random records (scale bytes 0x00..0x7E, as
    the writers store them)."""
    l2 = getattr(torch.cuda.get_device_properties(device), "L2_cache_size", 0)
    pool_bytes = max(256 << 20, 4 * l2)
    num_pages = -(-pool_bytes // (PAGE_SIZE * abi.RECORD_BYTES))
    cache = make_cache(num_pages, PAGE_SIZE, "HND", device=device)
    storage = raw_bytes(cache)
    storage.copy_(torch.randint(0, 256, storage.shape, dtype=torch.uint8, device=device))
    _, scales = abi.record_views(cache, validation.check_cache(cache))
    scales.copy_(torch.randint(0, abi.E4M3_MAX_CODE + 1, scales.shape, dtype=torch.uint8, device=device))
    return cache


def slot_sets(rows: int, capacity: int, device: torch.device) -> list[torch.Tensor]:
    """SLOT_SETS sets of ``rows`` distinct random slots below ``capacity``."""
    return [torch.randperm(capacity, device=device)[:rows] for _ in range(SLOT_SETS)]


def row_bytes(dtype: torch.dtype) -> int:
    """Modelled bytes of one row read: its record, its output row and its int64 slot."""
    return abi.RECORD_BYTES + abi.HEAD_DIM * dtype.itemsize + 8


def copy_percent(rows: int, dtype: torch.dtype, seconds: float, copy_bytes_per_s: float) -> float:
    """The modelled bytes of a ``rows``-row read per ``seconds``, as % of the copy ceiling."""
    return 100 * rows * row_bytes(dtype) / seconds / copy_bytes_per_s


# ---------------------------------------------------------------- the measurements


class Results(list[dict[str, Any]]):
    """The measured rows (:data:`COLUMNS`), each printed as it is added."""

    def add(self, measure: str, value: float, unit: str, target: str = "", note: str = "") -> None:
        """Appends one row and prints it."""
        self.append(dict(measure=measure, value=value, unit=unit, target=target, note=note))
        print(f"{measure:58s} {value:12.3f} {unit:6s} {target:10s} {note}")


def run(device: torch.device, timer: Timer) -> Results:
    """Every measurement of the module's docstring, in order."""
    results = Results()
    copy_bw = copy_bandwidth(device, timer)
    torch.cuda.empty_cache()  # the copy's 2 GiB back
    results.add("copy ceiling: 1 GiB copy_", copy_bw / 1e12, "TB/s")

    cache = pool_cache(device)
    layout = validation.check_cache(cache)
    capacity = layout.num_pages * layout.page_size
    results.add("pool", cache.numel() / 2**20, "MiB", note=f"{capacity} slots, page_size {PAGE_SIZE}")

    def bandwidth(label: str, call: Callable[[Any], object], sets: list[SlotsOut], goal: str = "") -> None:
        """Graph-replayed ``call`` over ``sets``, as % of the copy ceiling."""
        slots, out = sets[0]
        seconds = timer.graph(call, sets)
        results.add(label, copy_percent(len(slots), out.dtype, seconds, copy_bw), "%", goal, f"{seconds * 1e6:.1f} us")

    def read_into(dtype: torch.dtype) -> Callable[[Any], object]:
        return lambda slots_out: read(cache, slots_out[0], dtype=dtype, out=slots_out[1])

    def outputs(slots: list[torch.Tensor], dtype: torch.dtype) -> list[SlotsOut]:
        return [(s, torch.empty(len(s), abi.HEAD_DIM, dtype=dtype, device=device)) for s in slots]

    for rows, dtype in ((65_536, torch.bfloat16), (65_536, torch.float32), (262_144, torch.bfloat16)):
        goal = ">= 85%" if (rows, dtype) == (65_536, torch.bfloat16) else ""
        label = f"{rows} rows {str(dtype)[6:]}, random slots: % of copy"
        bandwidth(label, read_into(dtype), outputs(slot_sets(rows, capacity, device), dtype), goal)

    rows = 65_536
    sequential = [torch.arange(i * rows, (i + 1) * rows, device=device) for i in range(SLOT_SETS)]
    label = f"{rows} rows bfloat16, sequential slots: % of copy"
    bandwidth(label, read_into(torch.bfloat16), outputs(sequential, torch.bfloat16))
    sets = outputs(slot_sets(rows, capacity, device), torch.bfloat16)
    fill = gpu_reader.fill_pattern(float("nan"), False)
    index = device.index or 0
    for per_team in (1, 2, 4):
        spec = gpu_reader.ReaderSpec.of(PAGE_SIZE, torch.int64, torch.bfloat16)._replace(rows_per_team=per_team)
        launcher = kernel_cache.default().launcher(index, spec)

        def launch_variant(slots_out: Any, launcher: Any = launcher, rows_per_block: int = spec.rows_per_block) -> None:
            slots, out = slots_out
            return gpu_reader.launch(launcher, rows_per_block, index, cache, slots.data_ptr(), out, layout, rows, fill)

        bandwidth(f"A/B rows_per_team={per_team}: 65536 rows bf16, % of copy", launch_variant, sets)
    del sets, sequential

    one = torch.randint(0, capacity, (1,), device=device)
    out_one = torch.empty(1, abi.HEAD_DIM, dtype=torch.bfloat16, device=device)
    one_row_s = timer.graph(lambda _: read(cache, one, dtype=torch.bfloat16, out=out_one), [None])
    results.add("1 row, graph-replayed", 1e6 * one_row_s, "us", "<= 2.0")
    empty_kernel = empty_kernel_launcher(device)
    results.add("empty kernel, graph-replayed", 1e6 * timer.graph(empty_kernel, [None]), "us")

    scalar = torch.zeros(1, device=device)

    def timed(call: Callable[[], object]) -> tuple[float, float]:  # (call, add_ beside it) host seconds
        return host_pair(call, lambda: scalar.add_(1))

    new_s, new_add_s = timed(lambda: read(cache, one, dtype=torch.bfloat16))
    out_s, out_add_s = timed(lambda: read(cache, one, dtype=torch.bfloat16, out=out_one))
    results.add("torch add_ host time", 1e6 * min(new_add_s, out_add_s), "us")
    results.add("eager host time / add_ (new output)", new_s / new_add_s, "x", "<= 1.5", f"{new_s * 1e6:.2f} us")
    results.add("eager host time / add_ (out=)", out_s / out_add_s, "x", "", f"{out_s * 1e6:.2f} us")
    # Where the host time goes: the parts of a call, each timed alone the same way.
    parts = {
        "cuLaunchKernel through CuPy (empty kernel)": lambda: empty_kernel(None),
        "the output's launch.new_output": lambda: new_output(
            cache, (1, abi.HEAD_DIM), (abi.HEAD_DIM, 1), torch.bfloat16, index
        ),
        "validation.check_dequantize": lambda: validation.check_dequantize(cache, one, torch.bfloat16, 0.0, None, True),
    }
    for part, call in parts.items():
        part_s, add_s = timed(call)
        results.add(f"  part: {part}", part_s / add_s, "x", "", f"{part_s * 1e6:.2f} us")

    slots = torch.randperm(capacity, device=device)[:4096]
    kernel_s, _ = timer.eager(lambda _: read(cache, slots, dtype=torch.bfloat16), [None])
    reference_s, _ = timer.eager(
        lambda _: reference.nvfp4_dequantize_sparse_mla_cache(cache, slots, dtype=torch.bfloat16), [None]
    )
    results.add(
        "4096 rows: reference / kernel (eager, back to back)",
        reference_s / kernel_s,
        "x",
        ">= 20",
        f"{kernel_s * 1e6:.1f} us vs {reference_s * 1e6:.0f} us",
    )
    return results


# ---------------------------------------------------------------- outputs and the command line


def markdown(results: list[dict[str, Any]], device_name: str) -> str:
    """The markdown table of ``results`` under a title naming the GPU."""
    cells = [[r["measure"], f"{r['value']:.3f}", r["unit"], r["target"], r["note"]] for r in results]
    return "\n".join([f"# Reader benchmark on {device_name}", "", *markdown_grid(COLUMNS, cells)]) + "\n"


def write(results: list[dict[str, Any]], out: Path, device_name: str) -> None:
    """``reader_bench.csv`` and ``reader_bench.md`` in ``out`` (created when missing)."""
    write_suite(out, OUTPUT_STEM, results, COLUMNS, markdown(results, device_name))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The suite's options (``out`` stays None: it depends on the GPU)."""
    parser = suite_parser("reader", __doc__, OUTPUT_STEM)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    """Runs the suite (``argv`` as after ``nvfp4-mla bench reader``); returns the exit status."""
    args = parse_args(argv)
    require_gpu("nvfp4-mla bench reader")
    device = torch.device("cuda", torch.cuda.current_device())
    name = torch.cuda.get_device_name(device)
    out = results_dir(args.out, name)
    print(f"{name}, torch {torch.__version__}")
    write(run(device, DeviceTimer(SUITE_REPS, SUITE_GRAPH_S)), out, name)
    print(f"wrote {out / f'{OUTPUT_STEM}.csv'} and {out / f'{OUTPUT_STEM}.md'}")
    return 0
