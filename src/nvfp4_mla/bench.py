"""The benchmark: the fused writer against what a user runs without it, all in one run.

``python -m nvfp4_mla.bench [--quick] [--out DIR] [--reps N] [--compile-budget S]`` (also
``python -m nvfp4_mla bench``). Every row of the grid is one entry and geometry, timed in up to
four arms in the same process:

- ``fused``: the nvfp4_mla entry, eager calls back to back;
- ``graph``: the same calls replayed from one CUDA graph (device time without host launch cost);
- ``unfused``: torch-level RoPE of q and kv (fp32 math, BF16 result), the zero-padded ``q_out``
  copy, then nvfp4_mla's append kernel: what a stack without the fused writer runs;
- ``compile``: ``torch.compile`` of ``nvfp4_mla.reference``'s entry, the best a user gets without us.

Ceilings from the same run (device copy bandwidth, an empty kernel's launch time, a torch
``add_`` launch's host time) turn times into fractions, and the targets of the performance issue
become PASS/MISS verdicts. Outputs: ``bench_h200.csv``, ``bench_h200.md`` (environment, ceilings,
first use, targets, table) and ``bench_h200.png`` under ``--out``; the short table goes to stdout
last. docs/performance.md explains the bytes model and the floors.

Only the measuring functions need a GPU; the grid, the bytes model, the arms' plumbing (with
``nvfp4_mla.reference`` as the library) and the writers run on the CPU (tests/test_bench_cpu.py).
"""

from __future__ import annotations

import argparse
import csv
import datetime
import importlib
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Callable, NamedTuple

import torch

import nvfp4_mla

from . import abi, jit, ops, reference

# ---------------------------------------------------------------- what is measured

MAX_POSITION = 65536  # rows of the cos/sin table; positions are uniform in [0, MAX_POSITION)
MAIN_PAGE_SIZE = 256
KV_PAGE_SIZE = 128  # KV entry and append rows

MAIN_TOKENS = (1, 8, 64, 384, 4096, 16384)
WIDE_TOKENS = (1, 64, 4096)  # main entry with 64 and 128 heads
OTHER_TOKENS = (1, 64, 4096, 16384)  # in place, KV entry, append
MAX_HEADS_AT_MOST_TOKENS = 16  # keeps memory modest: no T=16384 with 64 or 128 heads
COMPILE_MAX_TOKENS = 4096  # the torch.compile arm stops here to keep the run short
# torch.compile recompiles per shape (10-30 s each): no new compile starts once this much compile
# time is spent, so the full run stays near 4 minutes.
DEFAULT_COMPILE_BUDGET_S = 90.0
# The compile arm takes its budget in this order of tokens (plot rows first): T = 1, 64 and 4096
# carry the speedup targets.
TOKEN_PRIORITY = (1, 4096, 64, 8, 384, 16384)

ARM_TITLES = {
    "fused": "fused, eager",
    "graph": "fused, CUDA graph",
    "unfused": "unfused (torch RoPE + append)",
    "compile": "torch.compile(reference)",
}

# Bytes model: each input read once, each output written once (docs/performance.md).
BF16_ROW_BYTES = abi.HEAD_DIM * 2  # 1024: a kv row or one query head
ROPE_DIMS_READ_WRITTEN = 2 * abi.ROPE_BYTES  # 256: a head's 64 RoPE dims read and written in place
COS_SIN_ROW_BYTES = abi.ROPE_DIM * 4  # 256: cos[32] | sin[32] in fp32
POSITION_BYTES = 8

# Timing.
DEFAULT_L2_BYTES = 50 * 2**20
ROTATION_FACTOR = 3  # rotate input sets until they span this many L2 sizes
MAX_INPUT_SETS = 64
TARGET_BATCH_S = 4e-3  # one timed batch (between two events) lasts about this long
MAX_CALLS_PER_BATCH = 200
HOST_CALLS = 200  # host time: calls per perf_counter batch
HOST_BATCHES = 9
COPY_BYTES = 2**30  # the copy ceiling's tensor

# Targets (same-run ratios).
BANDWIDTH_TARGET = 0.85  # of the copy ceiling, T >= BANDWIDTH_MIN_TOKENS
BANDWIDTH_MIN_TOKENS = 4096
LATENCY_TARGETS_US = ((16, 2.0), (128, 3.0))  # T = 1, graph-replayed: (up to padded heads, limit)
HOST_RATIO_TARGET = 2.5  # eager call's host time / torch add_'s
SPEEDUP_SMALL = (64, 3.0)  # T <= 64: peers at least 3x the fused time
SPEEDUP_LARGE = (4096, 1.3)  # T >= 4096: at least 1.3x
FIRST_USE_TARGET_S = 1.5
WARM_RELOAD_TARGET_S = 0.050

OUTPUT_STEM = "bench_h200"
EMPTY_KERNEL_NAME = "nvfp4_mla_bench_empty"
EMPTY_KERNEL_SOURCE = f'extern "C" __global__ void {EMPTY_KERNEL_NAME}() {{}}'
EMPTY_KERNEL_TITLE = "a CuPy RawKernel with an empty body (1 block of 32 threads), launched with cuLaunchKernel through cupy.cuda.driver like nvfp4_mla's kernels"


class Row(NamedTuple):
    """One geometry of one entry."""

    entry: str  # "main" (head-padded q_out), "inplace", "kv" or "append"
    tokens: int
    heads: int = 0  # live query heads
    q_heads: int = 0  # heads of q_out (main), == heads in place
    page_size: int = MAIN_PAGE_SIZE
    ratio: int = 1  # compress_ratio of the KV entry
    slot_bytes: int = 8  # int64 slot_mapping; 4 for int32

    @property
    def label(self) -> str:
        return {
            "main": f"main {self.heads}->{self.q_heads}",
            "inplace": f"in place {self.heads}",
            "kv": f"kv r{self.ratio}",
            "append": "append",
        }[self.entry]

    @property
    def is_plot_row(self) -> bool:
        return self.entry == "main" and (self.heads, self.q_heads) == (8, 16)


def main_row(tokens: int, heads: int, q_heads: int) -> Row:
    return Row("main", tokens, heads, q_heads)


def full_grid() -> list[Row]:
    rows = [main_row(t, 8, q) for q in (16, 8) for t in MAIN_TOKENS]
    rows += [main_row(t, h, h) for h in (64, 128) for t in WIDE_TOKENS]
    rows += [Row("inplace", t, h, h) for h in (8, 16, 64, 128) for t in OTHER_TOKENS
             if t < max(OTHER_TOKENS) or h <= MAX_HEADS_AT_MOST_TOKENS]
    rows += [Row("kv", t, page_size=KV_PAGE_SIZE, ratio=r) for r in (1, 2) for t in OTHER_TOKENS]
    rows += [Row("append", t, page_size=KV_PAGE_SIZE) for t in OTHER_TOKENS]
    return rows


def quick_grid() -> list[Row]:
    rows = [main_row(t, 8, 16) for t in (1, 64, 4096)] + [main_row(1, 128, 128)]
    rows += [Row("inplace", t, 16, 16) for t in (1, 4096)]
    rows += [Row("kv", t, page_size=KV_PAGE_SIZE, ratio=2) for t in (1, 4096)]
    rows += [Row("append", 4096, page_size=KV_PAGE_SIZE)]
    return rows


def measurement_order(rows: list[Row]) -> list[int]:
    """Indices of ``rows`` in the order they are measured: the compile arm's budget goes first to
    the plotted rows, then to the token counts that carry targets (stable within a tier)."""
    def rank(row: Row) -> tuple:
        tokens = TOKEN_PRIORITY.index(row.tokens) if row.tokens in TOKEN_PRIORITY else len(TOKEN_PRIORITY)
        return (not row.is_plot_row, tokens)

    return sorted(range(len(rows)), key=lambda i: rank(rows[i]))


def modelled_bytes(row: Row, inserted_rows: float | None = None) -> float:
    """Bytes a call must move: each input read once, each output written once.

    ``inserted_rows``: KV rows that pass the compress-ratio test (default tokens / ratio); only
    they read their kv row and cos/sin row and write a 384-byte record. Positions and slots are
    read for every row.
    """
    tokens = row.tokens
    inserted = tokens / row.ratio if inserted_rows is None else inserted_rows
    if row.entry == "append":  # already-roped rows: no positions, no cos/sin
        return tokens * (BF16_ROW_BYTES + abi.RECORD_BYTES + row.slot_bytes)
    kv_side = inserted * (BF16_ROW_BYTES + abi.RECORD_BYTES + COS_SIN_ROW_BYTES) + tokens * (POSITION_BYTES + row.slot_bytes)
    if row.entry == "kv":
        return kv_side
    if row.entry == "inplace":  # only the 64 RoPE dims of each head are read and written
        return kv_side + tokens * row.heads * ROPE_DIMS_READ_WRITTEN
    if row.entry == "main":  # live heads read, every padded head written
        return kv_side + tokens * (row.heads + row.q_heads) * BF16_ROW_BYTES
    raise ValueError(f"unknown entry {row.entry!r}")


def input_set_count(bytes_per_set: float, l2_bytes: int) -> int:
    """How many input sets to rotate over so that timed calls do not find their data in L2."""
    if bytes_per_set >= l2_bytes:
        return 1
    return max(1, min(MAX_INPUT_SETS, math.ceil(ROTATION_FACTOR * l2_bytes / max(bytes_per_set, 1))))


# ---------------------------------------------------------------- inputs


class Inputs(NamedTuple):
    q: torch.Tensor | None
    kv: torch.Tensor
    cache: torch.Tensor
    slots: torch.Tensor
    positions: torch.Tensor

    def clone_written(self) -> Inputs:
        """A copy of what an entry writes (the cache, q in place); the read-only tensors are shared."""
        return self._replace(q=None if self.q is None else self.q.clone(), cache=self.cache.clone())


def rope_table(device, max_position: int = MAX_POSITION) -> torch.Tensor:
    """A real RoPE table, cos[32] | sin[32] of position * inv_freq (fp32), like tests/util.py's."""
    inv_freq = 1.0 / 10000.0 ** (torch.arange(0, abi.ROPE_DIM, 2, dtype=torch.float64, device=device) / abi.ROPE_DIM)
    angles = torch.arange(max_position, dtype=torch.float64, device=device)[:, None] * inv_freq
    return torch.cat((angles.cos(), angles.sin()), dim=1).float()


def make_inputs(row: Row, device, max_position: int = MAX_POSITION) -> Inputs:
    """Random rows; positions uniform over the table; slots a random permutation of a pool one
    page larger than the tokens need."""
    tokens = row.tokens
    pages = -(-tokens // row.page_size) + 1
    q = torch.randn(tokens, row.heads, abi.HEAD_DIM, device=device).to(torch.bfloat16) if row.heads else None
    kv = torch.randn(tokens, abi.HEAD_DIM, device=device).to(torch.bfloat16)
    slot_dtype = torch.int64 if row.slot_bytes == 8 else torch.int32
    slots = torch.randperm(pages * row.page_size, device=device)[:tokens].to(slot_dtype)
    positions = torch.randint(0, max_position, (tokens,), device=device)
    cache = torch.zeros(pages, row.page_size, abi.RECORD_BYTES, dtype=torch.uint8, device=device)
    return Inputs(q, kv, cache, slots, positions)


def inserted_rows(row: Row, sets: list[Inputs]) -> float:
    """Mean number of rows a call inserts (with ratio 2, the KV entry inserts only rows whose
    position + 1 is even)."""
    if row.ratio == 1:
        return float(row.tokens)
    counts = [int(((s.positions + 1) % row.ratio == 0).sum()) for s in sets]
    return sum(counts) / len(counts)


# ---------------------------------------------------------------- arms: one call of each


def fused_call(row: Row, lib, cos_sin: torch.Tensor) -> Callable[[Inputs], object]:
    """One call of the row's entry taken from ``lib``: ``nvfp4_mla.ops`` (the fused kernels),
    ``nvfp4_mla.reference`` or :func:`compiled_reference` (same signatures)."""
    if row.entry in ("main", "inplace"):
        entry = lib.cake_dsv4_nvfp4_rope_quantize_insert
        in_place = row.entry == "inplace"
        return lambda x: entry(x.q, x.kv, x.cache, x.slots, x.positions, cos_sin, q_head_padded=row.q_heads, q_inplace=in_place)
    if row.entry == "kv":
        entry = lib.cake_dsv4_nvfp4_kv_rope_quantize_insert
        return lambda x: entry(x.kv, x.cache, x.slots, x.positions, cos_sin, compress_ratio=row.ratio)
    entry = lib.nvfp4_quantize_append_sparse_mla_cache
    return lambda x: entry(x.kv, x.slots, x.cache)


def torch_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """GPT-J RoPE of BF16 ``x[..., 64]`` with plain fp32 torch ops, rounded to BF16.

    What a stack without the fused writer runs. ``reference.rope`` is the bit-exact form (one
    fma per output), but its fp64 emulation would make this peer slower than it needs to be.
    """
    xe, xo = x[..., 0::2].float(), x[..., 1::2].float()
    return torch.stack((xe * cos - xo * sin, xe * sin + xo * cos), dim=-1).flatten(-2).to(torch.bfloat16)


def _cos_sin_rows(cos_sin: torch.Tensor, rope_rows: torch.Tensor):
    table = cos_sin[rope_rows]
    return table[:, : abi.ROPE_PAIRS], table[:, abi.ROPE_PAIRS :]


def _roped_kv(kv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    return torch.cat((kv[:, : abi.NOPE_DIM], torch_rope(kv[:, abi.NOPE_DIM :], cos, sin)), dim=1)


def unfused_call(row: Row, lib, cos_sin: torch.Tensor) -> Callable[[Inputs], object] | None:
    """Torch-level RoPE (+ the zero-padded q_out copy) followed by ``lib``'s append kernel; None
    for the append rows, which are that kernel alone."""
    append = lib.nvfp4_quantize_append_sparse_mla_cache
    nope = abi.NOPE_DIM

    def main(x: Inputs):
        cos, sin = _cos_sin_rows(cos_sin, x.positions)
        q_out = torch.empty(row.tokens, row.q_heads, abi.HEAD_DIM, dtype=torch.bfloat16, device=x.q.device)
        if row.q_heads > row.heads:
            q_out[:, row.heads :].zero_()
        q_out[:, : row.heads, :nope] = x.q[..., :nope]
        q_out[:, : row.heads, nope:] = torch_rope(x.q[..., nope:], cos[:, None], sin[:, None])
        append(_roped_kv(x.kv, cos, sin), x.slots, x.cache)
        return q_out

    def in_place(x: Inputs):
        cos, sin = _cos_sin_rows(cos_sin, x.positions)
        x.q[..., nope:] = torch_rope(x.q[..., nope:], cos[:, None], sin[:, None])
        append(_roped_kv(x.kv, cos, sin), x.slots, x.cache)
        return x.q

    def kv_only(x: Inputs):
        # The KV entry's ratio test with tensor ops (no host sync): skipped rows get slot -1.
        rope_rows = torch.div(x.positions, row.ratio, rounding_mode="floor") * row.ratio
        slots = torch.where((x.positions + 1) % row.ratio == 0, x.slots, -1) if row.ratio > 1 else x.slots
        cos, sin = _cos_sin_rows(cos_sin, rope_rows)
        append(_roped_kv(x.kv, cos, sin), slots, x.cache)

    return {"main": main, "inplace": in_place, "kv": kv_only}.get(row.entry)


REFERENCE_ENTRIES = (
    "cake_dsv4_nvfp4_rope_quantize_insert",
    "cake_dsv4_nvfp4_kv_rope_quantize_insert",
    "nvfp4_quantize_append_sparse_mla_cache",
)
_compiled_reference: SimpleNamespace | None = None


def compiled_reference() -> SimpleNamespace:
    """``torch.compile(..., dynamic=False)`` of the reference entries (graph breaks allowed: the
    reference indexes with data-dependent masks)."""
    global _compiled_reference
    if _compiled_reference is None:
        config = torch._dynamo.config
        # dynamic=False compiles once per shape; the grid has more shapes than dynamo's default
        # limit of 8, past which it would silently run the reference eagerly.
        for names in (("recompile_limit", "cache_size_limit"), ("accumulated_recompile_limit", "accumulated_cache_size_limit")):
            name = next((n for n in names if hasattr(config, n)), None)
            if name is not None:
                setattr(config, name, 4096)
        _compiled_reference = SimpleNamespace(
            **{name: torch.compile(getattr(reference, name), dynamic=False) for name in REFERENCE_ENTRIES}
        )
    return _compiled_reference


def same_outputs(call_a, call_b, inputs: Inputs) -> bool:
    """Whether two arms write the same bytes (cache, q in place, returned q_out) from the same state."""
    a, b = inputs.clone_written(), inputs.clone_written()
    out_a, out_b = call_a(a), call_b(b)
    same = torch.equal(a.cache, b.cache)
    if a.q is not None:
        same = same and torch.equal(a.q.view(torch.int16), b.q.view(torch.int16))
    if isinstance(out_a, torch.Tensor) and isinstance(out_b, torch.Tensor):
        same = same and out_a.shape == out_b.shape and torch.equal(out_a.view(torch.int16), out_b.view(torch.int16))
    return same


# ---------------------------------------------------------------- timing (needs a GPU)


def median_per_call(run_batch: Callable[[], None], calls: int, reps: int, clock: str = "gpu") -> float:
    """Median over ``reps`` batches of one batch's seconds divided by its ``calls`` calls.

    ``clock="gpu"``: CUDA events on the current stream around the batch. ``clock="host"``:
    ``perf_counter`` around enqueueing the batch, starting from an idle GPU so it keeps up with
    small calls (the host cost, not a full launch queue, is measured).
    """
    start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    samples = []
    for _ in range(reps):
        if clock == "gpu":
            start.record()
            run_batch()
            stop.record()
            stop.synchronize()
            samples.append(start.elapsed_time(stop) * 1e-3 / calls)
        else:
            torch.cuda.synchronize()
            began = time.perf_counter()
            run_batch()
            samples.append((time.perf_counter() - began) / calls)
    torch.cuda.synchronize()
    return statistics.median(samples)


def call_batch(call: Callable, sets: list, calls: int) -> Callable[[], None]:
    """``calls`` back-to-back calls rotating over the input sets."""

    def run():
        for i in range(calls):
            call(sets[i % len(sets)])

    return run


def time_eager(call: Callable, sets: list, reps: int) -> tuple[float, int]:
    """Median seconds per eager call, and the calls per timed batch (about TARGET_BATCH_S)."""
    for inputs in sets:  # warm-up: compiles and loads the kernel, touches every set once
        call(inputs)
    probe_calls = min(len(sets), 4)
    estimate = median_per_call(call_batch(call, sets, probe_calls), probe_calls, reps=3)
    calls = max(1, min(MAX_CALLS_PER_BATCH, int(TARGET_BATCH_S / max(estimate, 1e-7))))
    return median_per_call(call_batch(call, sets, calls), calls, reps), calls


def time_graph(call: Callable, sets: list, calls: int, reps: int) -> float:
    """Median seconds per call when one CUDA graph holding ``calls`` calls is replayed (the
    calls were already made eagerly, so nothing compiles or loads during capture)."""
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        call_batch(call, sets, calls)()
    graph.replay()  # the first replay uploads the graph
    torch.cuda.synchronize()
    return median_per_call(graph.replay, calls, reps)


def host_seconds(call: Callable, inputs) -> float:
    """Host time of one eager call (validation + lookup + launch for ours), after one untimed
    batch so that first-call effects (interpreter specialisation, allocator) stay out."""
    batch = call_batch(call, [inputs], HOST_CALLS)
    batch()
    return median_per_call(batch, HOST_CALLS, HOST_BATCHES, clock="host")


# ---------------------------------------------------------------- results


@dataclass
class Ceilings:
    copy_bytes_per_s: float | None = None  # bytes read + written per second by a device copy
    launch_eager_s: float | None = None  # empty kernel, back-to-back eager launches
    launch_graph_s: float | None = None  # empty kernel, replayed from a CUDA graph
    add_host_s: float | None = None  # host time of one torch add_ launch
    notes: list[str] = field(default_factory=list)


@dataclass
class RowResult:
    row: Row
    bytes: float
    input_sets: int
    # arm -> median seconds per call; None: attempted but n/a (the reason is in notes); an arm
    # missing from the dict is not part of this row.
    seconds: dict = field(default_factory=dict)
    calls_per_batch: int = 0
    host_s: float | None = None
    compile_first_call_s: float | None = None
    notes: list[str] = field(default_factory=list)


class Metrics(NamedTuple):
    floor_s: float | None  # bytes / copy bandwidth
    gbps: float | None  # modelled bytes / fused device time (graph-replayed, else eager), GB/s
    copy_fraction: float | None
    ratios: dict  # arm -> arm time / fused eager time
    host_ratio: float | None  # host time / torch add_ host time
    targets: dict  # target name -> "PASS", "MISS", "n/a" (applies, not measured); absent: n/a to this row


TARGET_TITLES = {
    "bandwidth": f"T >= {BANDWIDTH_MIN_TOKENS}: fused device time (graph-replayed) >= {BANDWIDTH_TARGET:.0%} of the copy ceiling",
    "latency": "T = 1: graph-replayed fused call <= %.1f us up to %d padded heads, <= %.1f us at %d"
    % (LATENCY_TARGETS_US[0][1], LATENCY_TARGETS_US[0][0], LATENCY_TARGETS_US[1][1], LATENCY_TARGETS_US[1][0]),
    "host": f"host time of one eager call <= {HOST_RATIO_TARGET}x a torch add_ launch",
    "speedup": f"fused eager >= {SPEEDUP_SMALL[1]}x faster than unfused and torch.compile for T <= {SPEEDUP_SMALL[0]}, "
    f">= {SPEEDUP_LARGE[1]}x for T >= {SPEEDUP_LARGE[0]}",
}


def latency_limit_us(row: Row) -> float:
    heads = row.q_heads if row.entry in ("main", "inplace") else 0
    return next((limit for max_heads, limit in LATENCY_TARGETS_US if heads <= max_heads), LATENCY_TARGETS_US[-1][1])


def speedup_needed(tokens: int) -> float | None:
    if tokens <= SPEEDUP_SMALL[0]:
        return SPEEDUP_SMALL[1]
    if tokens >= SPEEDUP_LARGE[0]:
        return SPEEDUP_LARGE[1]
    return None


def _verdict(ok: bool) -> str:
    return "PASS" if ok else "MISS"


def row_metrics(result: RowResult, ceilings: Ceilings) -> Metrics:
    row, fused = result.row, result.seconds.get("fused")
    copy_bw = ceilings.copy_bytes_per_s
    floor = result.bytes / copy_bw if copy_bw else None
    # Bandwidth from the graph-replayed time: back-to-back eager calls are bounded by the host's
    # launch rate whenever one call's device time is shorter than its host time.
    device = result.seconds.get("graph") or fused
    gbps = result.bytes / device / 1e9 if device else None
    fraction = result.bytes / device / copy_bw if device and copy_bw else None
    ratios = {arm: s / fused for arm, s in result.seconds.items() if arm != "fused" and s is not None and fused}
    host_ratio = result.host_s / ceilings.add_host_s if result.host_s and ceilings.add_host_s else None

    targets = {}
    if row.tokens >= BANDWIDTH_MIN_TOKENS:
        targets["bandwidth"] = "n/a" if fraction is None else _verdict(fraction >= BANDWIDTH_TARGET)
    if row.tokens == 1:
        graph = result.seconds.get("graph")
        targets["latency"] = "n/a" if graph is None else _verdict(graph * 1e6 <= latency_limit_us(row))
        targets["host"] = "n/a" if host_ratio is None else _verdict(host_ratio <= HOST_RATIO_TARGET)
    needed = speedup_needed(row.tokens)
    peers = [arm for arm in ("unfused", "compile") if arm in result.seconds]
    if needed is not None and peers:
        measured = [ratios[arm] for arm in peers if arm in ratios]
        targets["speedup"] = _verdict(min(measured) >= needed) if measured else "n/a"
    return Metrics(floor, gbps, fraction, ratios, host_ratio, targets)


class FirstUse(NamedTuple):
    cold_first_call_s: float | None = None  # new process, empty disk cache: compile + load + launch
    compile_variant_s: float | None = None  # NVRTC alone (jit.compile_variant, same process, after)
    warm_first_call_s: float | None = None  # new process, warm disk cache: read + load + launch
    import_cupy_s: float | None = None  # once per process, outside the first-call times
    error: str | None = None


def first_use_targets(first_use: FirstUse) -> dict:
    def verdict(seconds, limit):
        return "n/a" if seconds is None else _verdict(seconds < limit)

    return {
        f"first call of a fresh geometry, cold disk cache (new process) < {FIRST_USE_TARGET_S} s": (
            verdict(first_use.cold_first_call_s, FIRST_USE_TARGET_S), _fmt_s(first_use.cold_first_call_s)),
        f"first call in a new process, warm disk cache < {WARM_RELOAD_TARGET_S * 1e3:.0f} ms": (
            verdict(first_use.warm_first_call_s, WARM_RELOAD_TARGET_S), _fmt_s(first_use.warm_first_call_s)),
    }


def target_summary(results: list[RowResult], ceilings: Ceilings, first_use: FirstUse) -> list[tuple[str, str, str]]:
    """(target, verdict, detail) lines: a row target passes when every row it applies to passes."""
    verdicts: dict[str, list[tuple[RowResult, str]]] = {name: [] for name in TARGET_TITLES}
    for result in results:
        for name, verdict in row_metrics(result, ceilings).targets.items():
            verdicts[name].append((result, verdict))
    lines = []
    for name, title in TARGET_TITLES.items():
        entries = verdicts[name]
        passed = sum(v == "PASS" for _, v in entries)
        missed = [f"{r.row.label} T={r.row.tokens}" for r, v in entries if v == "MISS"]
        unmeasured = sum(v == "n/a" for _, v in entries)
        if not entries or passed == 0 and not missed:
            overall = "n/a"
        else:
            overall = "MISS" if missed else "PASS"
        detail = f"{passed} of {len(entries)} rows pass"
        if missed:
            detail += "; missed: " + ", ".join(missed[:6]) + (" ..." if len(missed) > 6 else "")
        if unmeasured:
            detail += f"; {unmeasured} not measured"
        lines.append((title, overall, detail))
    for title, (verdict, detail) in first_use_targets(first_use).items():
        lines.append((title, verdict, detail if first_use.error is None else f"{detail} ({first_use.error})"))
    return lines


# ---------------------------------------------------------------- formatting and writers


def _fmt_us(seconds: float | None) -> str:
    if seconds is None:
        return "n/a"
    us = seconds * 1e6
    return f"{us:.2f}" if us < 10 else f"{us:.1f}" if us < 100 else f"{us:.0f}"


def _fmt_ratio(ratio: float) -> str:
    return f"{ratio:.2f}x" if ratio < 10 else f"{ratio:.1f}x" if ratio < 100 else f"{ratio:.0f}x"


def _fmt_s(seconds: float | None) -> str:
    if seconds is None:
        return "n/a"
    return f"{seconds * 1e3:.1f} ms" if seconds < 1 else f"{seconds:.2f} s"


def _arm_cell(result: RowResult, arm: str) -> str:
    return _fmt_us(result.seconds[arm]) if arm in result.seconds else "-"


def _ratio_cell(result: RowResult, metrics: Metrics, arm: str) -> str:
    if arm not in result.seconds:
        return "-"
    return _fmt_ratio(metrics.ratios[arm]) if arm in metrics.ratios else "n/a"


def _targets_cell(metrics: Metrics) -> str:
    return ", ".join(f"{name} {verdict}" for name, verdict in metrics.targets.items())


def _host_cell(result: RowResult, metrics: Metrics) -> str:
    if result.host_s is None:
        return "-"
    ratio = f" ({_fmt_ratio(metrics.host_ratio)})" if metrics.host_ratio is not None else ""
    return _fmt_us(result.host_s) + ratio


# (header, cell) columns of the markdown tables; the short set is what stdout shows.
Column = tuple[str, Callable[[RowResult, Metrics], str]]
SHORT_COLUMNS: list[Column] = [
    ("row", lambda r, m: r.row.label),
    ("T", lambda r, m: str(r.row.tokens)),
    ("fused us", lambda r, m: _arm_cell(r, "fused")),
    ("graph us", lambda r, m: _arm_cell(r, "graph")),
    ("% copy", lambda r, m: "n/a" if m.copy_fraction is None else f"{m.copy_fraction:.0%}"),
    ("unfused", lambda r, m: _ratio_cell(r, m, "unfused")),
    ("compile", lambda r, m: _ratio_cell(r, m, "compile")),
    ("targets", lambda r, m: _targets_cell(m)),
]
FULL_COLUMNS: list[Column] = SHORT_COLUMNS[:2] + [
    ("page", lambda r, m: str(r.row.page_size)),
    ("sets", lambda r, m: str(r.input_sets)),
    ("MB", lambda r, m: f"{r.bytes / 1e6:.3g}"),
    ("floor us", lambda r, m: _fmt_us(m.floor_s)),
    ("fused us", lambda r, m: _arm_cell(r, "fused")),
    ("graph us", lambda r, m: _arm_cell(r, "graph")),
    ("unfused us", lambda r, m: _arm_cell(r, "unfused")),
    ("compile us", lambda r, m: _arm_cell(r, "compile")),
    ("GB/s", lambda r, m: "n/a" if m.gbps is None else f"{m.gbps:.0f}"),
    ("% copy", lambda r, m: "n/a" if m.copy_fraction is None else f"{m.copy_fraction:.0%}"),
    ("graph", lambda r, m: _ratio_cell(r, m, "graph")),
    ("unfused", lambda r, m: _ratio_cell(r, m, "unfused")),
    ("compile", lambda r, m: _ratio_cell(r, m, "compile")),
    ("host us (x add_)", lambda r, m: _host_cell(r, m)),
    ("targets", lambda r, m: _targets_cell(m)),
]


def markdown_table(results: list[RowResult], ceilings: Ceilings, columns: list[Column]) -> str:
    lines = ["| " + " | ".join(h for h, _ in columns) + " |", "|" + "|".join("---" for _ in columns) + "|"]
    for result in results:
        metrics = row_metrics(result, ceilings)
        lines.append("| " + " | ".join(cell(result, metrics).replace("|", "/") for _, cell in columns) + " |")
    return "\n".join(lines)


def _csv_number(value: float | None, scale: float = 1.0, digits: int = 4) -> str:
    return "n/a" if value is None else f"{value * scale:.{digits}g}"


def csv_rows(results: list[RowResult], ceilings: Ceilings) -> list[dict]:
    """One dict per row: raw numbers (us, bytes, GB/s, ratios), "n/a" for measured-but-failed or
    skipped arms, "" for arms that are not part of the row."""
    rows = []
    for result in results:
        row, metrics = result.row, row_metrics(result, ceilings)
        record = {
            "entry": row.entry, "label": row.label, "tokens": row.tokens, "heads": row.heads,
            "q_heads": row.q_heads, "page_size": row.page_size, "compress_ratio": row.ratio,
            "slot_bytes": row.slot_bytes, "input_sets": result.input_sets,
            "calls_per_batch": result.calls_per_batch, "modelled_bytes": f"{result.bytes:.0f}",
            "floor_us": _csv_number(metrics.floor_s, 1e6),
        }
        for arm in ARM_TITLES:
            record[f"{arm}_us"] = _csv_number(result.seconds[arm], 1e6) if arm in result.seconds else ""
        for arm in ("graph", "unfused", "compile"):
            record[f"{arm}_ratio"] = "" if arm not in result.seconds else _csv_number(metrics.ratios.get(arm))
        record.update({
            "achieved_GBps": _csv_number(metrics.gbps),
            "copy_fraction": _csv_number(metrics.copy_fraction, digits=3),
            "copy_GBps": _csv_number(ceilings.copy_bytes_per_s, 1e-9),
            "compile_first_call_s": "" if result.compile_first_call_s is None else _csv_number(result.compile_first_call_s),
            "host_us": "" if result.host_s is None else _csv_number(result.host_s, 1e6),
            "host_ratio_add": "" if result.host_s is None else _csv_number(metrics.host_ratio),
            "add_host_us": _csv_number(ceilings.add_host_s, 1e6),
        })
        for name in TARGET_TITLES:
            record[f"target_{name}"] = metrics.targets.get(name, "")
        record["notes"] = "; ".join(result.notes)
        rows.append(record)
    return rows


def write_csv(path: Path, results: list[RowResult], ceilings: Ceilings) -> None:
    rows = csv_rows(results, ceilings)
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]) if rows else ["entry"])
        writer.writeheader()
        writer.writerows(rows)


def ceiling_lines(ceilings: Ceilings) -> list[str]:
    copy = "n/a" if ceilings.copy_bytes_per_s is None else f"{ceilings.copy_bytes_per_s / 1e9:.0f} GB/s"
    lines = [
        f"- device copy bandwidth: **{copy}** (bytes read + written; median of `copy_` of a "
        f"{COPY_BYTES // 2**20} MiB tensor); the bandwidth floor of a row is its modelled bytes / this",
        f"- empty kernel launch: eager **{_fmt_us(ceilings.launch_eager_s)} us**, graph-replayed "
        f"**{_fmt_us(ceilings.launch_graph_s)} us** ({EMPTY_KERNEL_TITLE})",
        f"- host time of one torch `add_` launch on a 1-element tensor: **{_fmt_us(ceilings.add_host_s)} us** "
        f"(median of {HOST_BATCHES} batches of {HOST_CALLS} calls)",
    ]
    return lines + [f"- note: {note}" for note in ceilings.notes]


def first_use_lines(first_use: FirstUse) -> list[str]:
    lines = [
        f"- first call of a fresh geometry (main 8->16, page 256, T=1) in a new process with an empty "
        f"disk cache: **{_fmt_s(first_use.cold_first_call_s)}** (NVRTC compile + cubin write + module load "
        f"+ launch); `jit.compile_variant` of the same variant alone: {_fmt_s(first_use.compile_variant_s)}",
        f"- first call in a new process with the warm disk cache: **{_fmt_s(first_use.warm_first_call_s)}** "
        f"(cubin read + hash check + module load + launch)",
        f"- `import cupy`, once per process and outside both times: {_fmt_s(first_use.import_cupy_s)}",
    ]
    if first_use.error:
        lines.append(f"- error: {first_use.error}")
    return lines


def markdown_report(env: list[tuple[str, str]], run: list[tuple[str, str]], ceilings: Ceilings,
                    first_use: FirstUse, results: list[RowResult], plot_name: str | None) -> str:
    gpu = dict(env).get("GPU", "GPU")
    lines = [f"# nvfp4-mla benchmark: {gpu}", "", "## Environment", "", "| | |", "|---|---|"]
    lines += [f"| {k} | {v} |" for k, v in env + run]
    lines += ["", "## Ceilings (same run)", "", *ceiling_lines(ceilings)]
    lines += ["", "## First use", "", *first_use_lines(first_use)]
    lines += ["", "## Targets", "", "| target | verdict | detail |", "|---|---|---|"]
    lines += [f"| {t} | {v} | {d} |" for t, v, d in target_summary(results, ceilings, first_use)]
    lines += [
        "", "## Results", "",
        "Times are medians of per-call GPU time (CUDA events around back-to-back calls rotating over "
        "`sets` input sets; eager times at small T are bounded by the host's launch rate, the graph "
        "column is device time). Ratios are each arm's time / fused eager (above 1: fused is faster). "
        "`-`: not part of the row; `n/a`: see the notes.", "",
        markdown_table(results, ceilings, FULL_COLUMNS),
    ]
    notes = [f"- {r.row.label} T={r.row.tokens}: {note}" for r in results for note in r.notes]
    if notes:
        lines += ["", "Notes:", "", *notes]
    if plot_name:
        lines += ["", f"![time vs tokens, main entry 8->16 heads]({plot_name})"]
    return "\n".join(lines) + "\n"


PLOT_SERIES = (  # arm, legend, matplotlib format
    ("fused", "fused, eager", "o-"),
    ("graph", "fused, CUDA graph", "s-"),
    ("unfused", "unfused: torch RoPE + append", "^-"),
    ("compile", "torch.compile(reference)", "v-"),
)


def write_plot(path: Path, results: list[RowResult], ceilings: Ceilings, title: str) -> None:
    """Log-log time vs tokens of the main entry with 8 heads padded to 16: the arms, the bandwidth
    floor and the graph-replayed empty kernel."""
    from matplotlib.figure import Figure  # no pyplot: no global backend state

    rows = sorted((r for r in results if r.row.is_plot_row), key=lambda r: r.row.tokens)
    figure = Figure(figsize=(7.5, 4.8), layout="constrained")
    axes = figure.subplots()
    fastest_us = math.inf
    for arm, legend, style in PLOT_SERIES:
        points = [(r.row.tokens, r.seconds[arm] * 1e6) for r in rows if r.seconds.get(arm) is not None]
        if points:
            axes.plot(*zip(*points), style, label=legend)
            fastest_us = min(fastest_us, *(us for _, us in points))
    if ceilings.copy_bytes_per_s:
        axes.plot([r.row.tokens for r in rows], [r.bytes / ceilings.copy_bytes_per_s * 1e6 for r in rows], "k--",
                  label="bandwidth floor: bytes / copy bandwidth")
    if ceilings.launch_graph_s:
        axes.axhline(ceilings.launch_graph_s * 1e6, color="grey", linestyle=":", label="empty kernel, graph-replayed")
    axes.set_xscale("log")
    axes.set_yscale("log")
    if math.isfinite(fastest_us):  # the floor at T=1 is far below any call: keep the data readable
        axes.set_ylim(bottom=fastest_us / 5)
    axes.set_xlabel("tokens T")
    axes.set_ylabel("time per call (us)")
    axes.set_title(title)
    axes.grid(True, which="both", alpha=0.3)
    axes.legend(fontsize=8)
    figure.savefig(path, dpi=120)


# ---------------------------------------------------------------- measuring (needs a GPU)


@dataclass
class Context:
    device: torch.device
    cos_sin: torch.Tensor
    reps: int
    l2_bytes: int
    compile_budget_s: float
    compile_spent_s: float = 0.0


class ArmSkipped(Exception):
    """An arm left out on purpose; the message says why."""


def _reason(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    first = text[0] if text else ""
    return (first if isinstance(exc, ArmSkipped) else f"{type(exc).__name__}: {first}")[:200]


def attempt(result: RowResult, arm: str, measure: Callable[[], float]) -> None:
    """Runs one arm's measurement; a failure makes the arm n/a with its reason, not the run fail."""
    try:
        result.seconds[arm] = measure()
    except Exception as exc:
        result.seconds[arm] = None
        result.notes.append(f"{ARM_TITLES[arm]}: {'skipped' if isinstance(exc, ArmSkipped) else 'n/a'}: {_reason(exc)}")
        if isinstance(exc, torch.cuda.OutOfMemoryError):
            torch.cuda.empty_cache()


def time_compiled(row: Row, sets: list[Inputs], fused, result: RowResult, ctx: Context) -> float:
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
    return time_eager(compiled, sets, ctx.reps)[0]


def measure_row(row: Row, ctx: Context) -> RowResult:
    sets = [make_inputs(row, ctx.device) for _ in range(input_set_count(modelled_bytes(row), ctx.l2_bytes))]
    result = RowResult(row, modelled_bytes(row, inserted_rows(row, sets)), len(sets))
    fused = fused_call(row, ops, ctx.cos_sin)

    def fused_eager() -> float:
        seconds, result.calls_per_batch = time_eager(fused, sets, ctx.reps)
        return seconds

    attempt(result, "fused", fused_eager)
    if result.seconds["fused"] is None:
        return result
    attempt(result, "graph", lambda: time_graph(fused, sets, result.calls_per_batch, ctx.reps))
    unfused = unfused_call(row, ops, ctx.cos_sin)
    if unfused is not None:
        attempt(result, "unfused", lambda: time_eager(unfused, sets, ctx.reps)[0])
    if row.tokens <= COMPILE_MAX_TOKENS:
        attempt(result, "compile", lambda: time_compiled(row, sets, fused, result, ctx))
    if row.tokens == 1:
        try:
            result.host_s = host_seconds(fused, sets[0])
        except Exception as exc:
            result.notes.append(f"host time: n/a: {_reason(exc)}")
    return result


def run_grid(rows: list[Row], ctx: Context) -> list[RowResult]:
    """Measures every row (in :func:`measurement_order`) and returns the results in grid order."""
    results: list[RowResult | None] = [None] * len(rows)
    began = time.perf_counter()
    for done, i in enumerate(measurement_order(rows), 1):
        row = rows[i]
        try:
            results[i] = measure_row(row, ctx)
        except Exception as exc:  # input creation (memory) or a broken context: keep the others
            results[i] = RowResult(row, modelled_bytes(row), 0, notes=[f"row failed: {_reason(exc)}"])
        torch.cuda.empty_cache()
        r = results[i]
        arms = ", ".join(f"{arm} {_arm_cell(r, arm)} us" for arm in ARM_TITLES if arm in r.seconds)
        _progress(f"[{done}/{len(rows)}] {row.label} T={row.tokens}: {arms or '; '.join(r.notes)} "
                  f"({time.perf_counter() - began:.0f} s)")
    return results


def empty_kernel_launcher(device: torch.device) -> Callable[[], None]:
    """Launches an empty kernel on torch's current stream the way nvfp4_mla launches its own."""
    import cupy
    from cupy.cuda import driver

    with cupy.cuda.Device(device.index):
        function = cupy.RawKernel(EMPTY_KERNEL_SOURCE, EMPTY_KERNEL_NAME).kernel.ptr
    index = device.index

    def launch(_=None):
        driver.launchKernel(function, 1, 1, 1, 32, 1, 1, 0, ops._raw_stream(index), 0, 0)

    return launch


def copy_bandwidth(device: torch.device, reps: int) -> float:
    """Bytes read + written per second by ``copy_`` of a COPY_BYTES device tensor."""
    source = torch.empty(COPY_BYTES, dtype=torch.uint8, device=device)
    target = torch.empty_like(source)
    seconds, _ = time_eager(lambda _: target.copy_(source), [None], max(reps, 10))
    return 2 * COPY_BYTES / seconds


def measure_ceilings(device: torch.device, reps: int) -> Ceilings:
    ceilings = Ceilings()
    try:
        ceilings.copy_bytes_per_s = copy_bandwidth(device, reps)
        torch.cuda.empty_cache()  # 2 GiB back before the grid
    except Exception as exc:
        ceilings.notes.append(f"copy ceiling n/a: {_reason(exc)}")
    try:
        launch = empty_kernel_launcher(device)
        ceilings.launch_eager_s, _ = time_eager(launch, [None], reps)
        ceilings.launch_graph_s = time_graph(launch, [None], MAX_CALLS_PER_BATCH, reps)
    except Exception as exc:
        ceilings.notes.append(f"empty-kernel launch n/a: {_reason(exc)}")
    scalar = torch.zeros(1, device=device)
    ceilings.add_host_s = host_seconds(lambda t: t.add_(1), scalar)
    return ceilings


# ---------------------------------------------------------------- first use (subprocesses)

PROBE_ROW = main_row(1, 8, 16)


def first_call_probe(mode: str) -> dict:
    """Runs inside a fresh process (``--first-call-probe``): times its first fused call, and with
    ``mode == "cold"`` also ``jit.compile_variant`` of the same geometry afterwards."""
    device = torch.device("cuda", torch.cuda.current_device())
    inputs = make_inputs(PROBE_ROW, device)  # also creates the CUDA context
    call = fused_call(PROBE_ROW, ops, rope_table(device))
    began = time.perf_counter()
    importlib.import_module("cupy")  # timed apart: once per process, whatever the geometry
    report = {"import_cupy_s": time.perf_counter() - began, "cache_dir": str(jit.cache_dir())}
    torch.cuda.synchronize()
    began = time.perf_counter()
    call(inputs)
    torch.cuda.synchronize()
    report["first_call_s"] = time.perf_counter() - began
    if mode == "cold":
        variant = ops.Geometry("main", PROBE_ROW.page_size, num_heads=PROBE_ROW.heads, q_head_padded=PROBE_ROW.q_heads).variant()
        began = time.perf_counter()
        jit.compile_variant(variant, jit.device_arch(device.index))
        report["compile_variant_s"] = time.perf_counter() - began
    return report


def _run_probe(mode: str, cache_dir: str, timeout_s: float = 240) -> dict:
    package_root = str(Path(nvfp4_mla.__file__).resolve().parents[1])
    env = dict(os.environ, NVFP4_MLA_CACHE_DIR=cache_dir)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (package_root, env.get("PYTHONPATH")) if p)
    command = [sys.executable, "-m", "nvfp4_mla.bench", "--first-call-probe", mode]
    proc = subprocess.run(command, env=env, capture_output=True, text=True, timeout=timeout_s)
    if proc.returncode != 0:
        tail = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        raise RuntimeError(f"{mode} probe exited with {proc.returncode}: {tail}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def measure_first_use() -> FirstUse:
    """Two fresh processes sharing a new disk cache: the first compiles, the second reloads."""
    try:
        with tempfile.TemporaryDirectory(prefix="nvfp4_mla-bench-") as cache_dir:
            cold = _run_probe("cold", cache_dir)
            warm = _run_probe("warm", cache_dir)
        return FirstUse(cold["first_call_s"], cold.get("compile_variant_s"), warm["first_call_s"],
                        statistics.median([cold["import_cupy_s"], warm["import_cupy_s"]]))
    except Exception as exc:
        return FirstUse(error=_reason(exc))


# ---------------------------------------------------------------- environment


def _nvidia_smi(device: torch.device) -> str:
    fields = "driver_version,clocks.sm,clocks.max.sm,clocks.mem,clocks.max.mem,power.limit,temperature.gpu"
    query = ["nvidia-smi", f"--query-gpu={fields}", "--format=csv,noheader"]
    commands = [query]  # one line per GPU: the first is taken
    try:
        from cupy.cuda import runtime

        commands.insert(0, query + ["-i", runtime.deviceGetPCIBusId(device.index)])  # this GPU only
    except Exception:
        pass
    failure = "nvidia-smi not available"
    for command in commands:
        try:
            out = subprocess.run(command, capture_output=True, text=True, timeout=20)
        except (OSError, subprocess.TimeoutExpired) as exc:
            return f"nvidia-smi not available ({type(exc).__name__})"
        if out.returncode == 0 and out.stdout.strip():
            values = [v.strip() for v in out.stdout.strip().splitlines()[0].split(",")]
            driver, sm, sm_max, mem, mem_max, power, temperature = (values + [""] * 7)[:7]
            return (f"SM {sm} (max {sm_max}), memory {mem} (max {mem_max}), power limit {power}, "
                    f"{temperature} C, driver {driver} (sampled after the run)")
        failure = f"nvidia-smi failed: {(out.stderr or out.stdout).strip()[:120]}"
    return failure


def _git_commit() -> str:
    try:
        out = subprocess.run(["git", "-C", str(Path(__file__).parent), "rev-parse", "--short", "HEAD"],
                             capture_output=True, text=True, timeout=10)
        return out.stdout.strip() or "not a git checkout"
    except (OSError, subprocess.TimeoutExpired):
        return "git not available"


def environment(device: torch.device) -> list[tuple[str, str]]:
    props = torch.cuda.get_device_properties(device)
    l2 = getattr(props, "L2_cache_size", 0)
    env = [
        ("GPU", f"{props.name} (sm_{props.major}{props.minor}, {props.multi_processor_count} SMs, "
                f"{props.total_memory / 2**30:.0f} GiB, L2 {l2 / 2**20:.0f} MiB)"),
        ("torch", f"{torch.__version__} (CUDA {torch.version.cuda})"),
    ]
    try:
        import cupy
        from cupy.cuda import nvrtc, runtime

        driver = runtime.driverGetVersion()
        env += [("CuPy", cupy.__version__), ("NVRTC", "%d.%d" % nvrtc.getVersion()),
                ("CUDA driver API", f"{driver // 1000}.{driver % 1000 // 10}")]
    except Exception as exc:
        env.append(("CuPy", f"not available ({_reason(exc)})"))
    env += [
        ("clocks (nvidia-smi)", _nvidia_smi(device)),
        ("nvfp4_mla", f"{nvfp4_mla.__version__} (commit {_git_commit()})"),
        ("Python", f"{platform.python_version()} on {platform.machine()}"),
    ]
    return env


# ---------------------------------------------------------------- command line


def _progress(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m nvfp4_mla.bench",
        description="Benchmark of the nvfp4_mla writers against torch RoPE + append and torch.compile of "
                    "the reference, with the copy and launch ceilings and the performance targets. "
                    "Needs a CUDA GPU; about 4 minutes (--quick: under 1).",
    )
    parser.add_argument("--quick", action="store_true",
                        help=f"a short grid ({len(quick_grid())} rows), fewer repetitions, no torch.compile arm")
    parser.add_argument("--out", type=Path, default=Path("docs"),
                        help=f"directory for {OUTPUT_STEM}.csv/.md/.png (default: docs/)")
    parser.add_argument("--reps", type=int, default=None,
                        help="timed batches per arm, the median is reported (default 15; --quick 7)")
    parser.add_argument("--compile-budget", type=float, default=None, metavar="SECONDS",
                        help="stop starting torch.compile arms once their compiles took this long "
                             f"(default {DEFAULT_COMPILE_BUDGET_S:.0f}; --quick 0: no compile arm)")
    parser.add_argument("--first-call-probe", choices=("cold", "warm"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.reps is None:
        args.reps = 7 if args.quick else 15
    if args.compile_budget is None:
        args.compile_budget = 0.0 if args.quick else DEFAULT_COMPILE_BUDGET_S
    if args.reps < 1:
        parser.error("--reps must be at least 1")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.first_call_probe:
        print(json.dumps(first_call_probe(args.first_call_probe)))
        return 0
    if not torch.cuda.is_available():
        raise SystemExit("nvfp4_mla.bench needs a CUDA GPU (sm_80 or newer) with CuPy; torch sees none here")

    began = time.perf_counter()
    started = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    torch.manual_seed(0)
    device = torch.device("cuda", torch.cuda.current_device())
    props = torch.cuda.get_device_properties(device)
    rows = quick_grid() if args.quick else full_grid()
    _progress(f"nvfp4_mla.bench on {props.name}: {len(rows)} rows")

    ceilings = measure_ceilings(device, args.reps)
    _progress(f"ceilings: copy {_csv_number(ceilings.copy_bytes_per_s, 1e-9)} GB/s, empty kernel eager "
              f"{_fmt_us(ceilings.launch_eager_s)} us / graph {_fmt_us(ceilings.launch_graph_s)} us, "
              f"add_ host {_fmt_us(ceilings.add_host_s)} us")
    first_use = measure_first_use()
    _progress(f"first use: cold {_fmt_s(first_use.cold_first_call_s)}, warm {_fmt_s(first_use.warm_first_call_s)}"
              + (f" ({first_use.error})" if first_use.error else ""))
    ctx = Context(device, rope_table(device), args.reps, getattr(props, "L2_cache_size", 0) or DEFAULT_L2_BYTES,
                  args.compile_budget)
    results = run_grid(rows, ctx)

    run = [
        ("run", f"{'--quick' if args.quick else 'full'} grid, {args.reps} timed batches per arm, "
                f"compile budget {args.compile_budget:.0f} s (spent {ctx.compile_spent_s:.0f} s), "
                f"{started}, {time.perf_counter() - began:.0f} s"),
    ]
    args.out.mkdir(parents=True, exist_ok=True)
    write_csv(args.out / f"{OUTPUT_STEM}.csv", results, ceilings)
    plot_name = f"{OUTPUT_STEM}.png"
    try:
        write_plot(args.out / plot_name, results, ceilings, f"main entry, 8 heads padded to 16, page 256: {props.name}")
    except Exception as exc:  # matplotlib missing: the tables still count
        _progress(f"plot not written: {_reason(exc)}")
        plot_name = None
    report = markdown_report(environment(device), run, ceilings, first_use, results, plot_name)
    (args.out / f"{OUTPUT_STEM}.md").write_text(report)
    _progress(f"wrote {args.out}/{OUTPUT_STEM}.csv, .md" + (", .png" if plot_name else ""))

    for title, verdict, detail in target_summary(results, ceilings, first_use):
        print(f"{verdict:4}  {title}: {detail}")
    print()
    print(markdown_table(results, ceilings, SHORT_COLUMNS))
    return 0


if __name__ == "__main__":
    sys.exit(main())
