"""The soak loop of ``benchmarks/soak.py``: many mixed calls, eager and CUDA-graph replayed, sampled
against the reference.

Work goes in steps of ``calls_per_step`` calls of one geometry, chosen at random: the step's static
inputs (one input set per call, the slots of a step disjoint) are refilled with new random data by
``copy_``, then the calls run either eagerly or as one replay of the geometry's CUDA graph, captured
once on those static buffers. The step containing every ``sample_every``-th call, and a final step
of each geometry in each mode, are checked: the cache storage and every call's output must equal,
byte for byte, the reference run on a snapshot of the cache and inputs taken before the step. A
step's calls use disjoint slots and independent rows, so the reference runs them as one
concatenated call (DP padding rows get slot -1).

:func:`run_soak` also runs on the CPU, eager only, with :mod:`nvfp4_mla.reference` standing in for
the kernels (the test suite does, for a handful of calls).
"""

from __future__ import annotations

import dataclasses
import random
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

from .. import abi, ops, reference
from ..reference import rope_table
from .checks import (
    bytes_mismatch,
    cache_locator,
    clone,
    element_locator,
    flat_bytes,
    raw_bytes,
    storage_bytes,
    synchronize,
)
from .inputs import ARG_NAMES, ENTRIES, Case, Device, make_cache, random_rows

# Case.bad_slots / bad_positions switch on invalid slots / positions; Case.rows and .table are not
# used (rows are random_rows with a few specials, the table a real RoPE table).
GEOMETRIES = [
    Case(num_tokens=1, num_heads=8, q_head_padded=16, page_size=64),  # decode step
    Case(
        num_tokens=16, num_heads=5, q_head_padded=8, page_size=1, layout="HND", pad=16,
        slot_dtype=torch.int32, bad_positions=True,
    ),
    Case(num_tokens=64, num_heads=16, q_head_padded=0, q_inplace=True, page_size=256, layout="NHD"),
    Case(num_tokens=8, num_heads=128, q_head_padded=128, apply_q_rope=False, page_size=16),
    Case(num_tokens=8, num_heads=64, q_head_padded=0, page_size=3, pad=48),  # cache only
    Case(
        num_tokens=48, slots=40, num_heads=8, q_head_padded=8, q_inplace=True, page_size=32, layout="HND",
        bad_positions=True,
    ),
    Case(entry="kv", num_tokens=64, page_size=64, layout="NHD"),
    Case(
        entry="kv", num_tokens=33, compress_ratio=2, page_size=7, pad=16, slot_dtype=torch.int32,
        max_position=4097, bad_positions=True,
    ),
    Case(entry="kv", num_tokens=1, compress_ratio=2, page_size=1),
    Case(entry="append", num_tokens=100, slots=96, page_size=128, layout="HND", slot_dtype=torch.int32),
    Case(entry="append", num_tokens=5, page_size=300, pad=48),
    Case(entry="pack", page_size=64, pages=4, layout="HND"),
    Case(entry="pack", page_size=5, pages=3, layout="NHD"),
]  # fmt: skip

BAD_FRACTION = 1 / 32  # slots / positions made invalid, where the geometry asks for them
SPECIAL_FRACTION = 1e-4  # row elements set to +-inf, NaN or +-0
MAX_REPORTS = 5

Log = Callable[[str], None]

# ---------------------------------------------------------------- random step inputs
# Helpers take their constant tensors (special values, invalid slots/positions) ready-made on the
# device: a refill makes no host-to-device copy of its own.


def _scatter(t: torch.Tensor, values: torch.Tensor, fraction: float) -> None:
    """Overwrites a ``fraction`` of ``t``'s elements (at least one) with random picks of ``values``."""
    k = max(1, int(t.numel() * fraction))
    picks = values[torch.randint(len(values), (k,), device=t.device)]
    t.view(-1)[torch.randint(t.numel(), (k,), device=t.device)] = picks.to(t.dtype)


def _random_values(shape: tuple[int, ...], specials: torch.Tensor) -> torch.Tensor:
    """random_rows with a SPECIAL_FRACTION of elements (at least one) set to ``specials``."""
    x = random_rows(shape, specials.device)
    _scatter(x, specials, SPECIAL_FRACTION)
    return x


# ---------------------------------------------------------------- one geometry


class Workload:
    """One geometry: static inputs for the ``calls`` calls of a step, the cache they write, and
    (after :meth:`capture`) the CUDA graph of those calls with its static outputs. ``impl``
    provides the entries (:mod:`nvfp4_mla.ops`, or the reference on the CPU)."""

    def __init__(self, case: Case, calls: int, device: Device, impl: Any):
        self.case, self.calls, self.device = case, calls, device
        self.entry = getattr(impl, ENTRIES[case.entry])
        self.kwargs = case.kwargs()
        self.cache: torch.Tensor | None = None
        self.cos_sin: torch.Tensor | None = None
        self.capacity = 0
        if case.entry != "pack":
            pages = calls * case.num_slots * 5 // 4 // case.page_size + 2  # room for a step's slots
            self.cache = make_cache(pages, case.page_size, case.layout, case.pad, device)
            self.capacity = pages * case.page_size
        if case.entry in ("main", "kv"):
            self.cos_sin = rope_table(case.max_position, device)
        m, low = case.max_position, -(2**31) if case.slot_dtype == torch.int32 else -(2**62)
        self.specials = torch.tensor([float("inf"), float("-inf"), float("nan"), 0.0, -0.0], device=device)
        cap = self.capacity
        self.slot_junk = torch.tensor([-1, -2, low, cap, cap + 1], device=device) if case.bad_slots else None
        self.position_junk = (
            torch.tensor([-1, m, m + 1, 2**40, -(2**40)], device=device) if case.bad_positions else None
        )
        self.inputs = self.fresh_inputs()  # the static buffers
        shared = {"cache": self.cache, "cos_sin_cache": self.cos_sin}
        self.args = [  # each call's arguments: views of the static buffers
            tuple(shared[name] if name in shared else self.inputs[name][j] for name in ARG_NAMES[case.entry])
            for j in range(calls)
        ]
        self.graph: torch.cuda.CUDAGraph | None = None
        self.graph_outputs: list[Any] = []
        self.stats = {"calls": 0, "eager steps": 0, "graph steps": 0, "checks": 0, "mismatches": 0}

    def fresh_inputs(self) -> dict[str, torch.Tensor]:
        """New random inputs for a step, one leading index per call."""
        c, k = self.case, self.calls
        if c.entry == "pack":
            return {"kv": _random_values((k, c.num_pages, c.page_size, abi.HEAD_DIM), self.specials)}
        slots = torch.randperm(self.capacity, device=self.device)[: k * c.num_slots]
        if self.slot_junk is not None and slots.numel():
            _scatter(slots, self.slot_junk, BAD_FRACTION)
        made = {
            "kv": _random_values((k, c.num_tokens, abi.HEAD_DIM), self.specials),
            "slot_mapping": slots.view(k, c.num_slots).to(c.slot_dtype),
        }
        if c.entry in ("main", "kv"):
            positions = torch.randint(0, c.max_position, (k, c.num_tokens), device=self.device)
            if self.position_junk is not None:
                _scatter(positions, self.position_junk, BAD_FRACTION)
            made["positions"] = positions
        if c.entry == "main":
            made["q"] = _random_values((k, c.num_tokens, c.num_heads, abi.HEAD_DIM), self.specials)
        return made

    def refill(self) -> None:
        for name, fresh in self.fresh_inputs().items():
            self.inputs[name].copy_(fresh)

    def run_calls(self) -> list[Any]:
        return [self.entry(*args, **self.kwargs) for args in self.args]

    def capture(self) -> None:
        """Warm-up on a side stream (compiles and loads the kernel), then capture the step's calls."""
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            self.run_calls()
        torch.cuda.current_stream(self.device).wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self.graph_outputs = self.run_calls()

    def step(self, use_graph: bool) -> list[Any]:
        """Runs the step's calls on the current static inputs; returns each call's output."""
        self.stats["graph steps" if use_graph else "eager steps"] += 1
        self.stats["calls"] += self.calls
        if use_graph:
            if self.graph is None:
                raise RuntimeError("capture() the workload before replaying it")
            self.graph.replay()
            return self.graph_outputs
        return self.run_calls()

    def snapshot(self) -> tuple[dict[str, torch.Tensor], torch.Tensor | None]:
        return {name: t.clone() for name, t in self.inputs.items()}, None if self.cache is None else clone(self.cache)

    def expected(self, inputs: dict[str, torch.Tensor], cache: torch.Tensor | None) -> tuple[Any, list[Any]]:
        """The reference on a snapshot (modified in place): (the cache after the step, each
        call's output), all calls of the step run as one concatenated call."""
        c, k = self.case, self.calls
        ref = getattr(reference, ENTRIES[c.entry])
        if c.entry == "pack":
            out = ref(inputs["kv"].flatten(0, 1), **self.kwargs)
            return None, list(out.unflatten(0, (k, c.num_pages)))
        slots = inputs["slot_mapping"]  # [k, n]; a call's rows >= n are DP padding: slot -1
        padding = slots.new_full((k, c.num_tokens - slots.shape[1]), -1)
        named = {
            "kv": inputs["kv"].flatten(0, 1),
            "cache": cache,
            "cos_sin_cache": self.cos_sin,
            "slot_mapping": torch.cat((slots, padding), dim=1).flatten(),
        }
        for name in ("q", "positions"):
            if name in inputs:
                named[name] = inputs[name].flatten(0, 1)
        out = ref(*(named[name] for name in ARG_NAMES[c.entry]), **self.kwargs)
        return cache, [None] * k if out is None else list(out.unflatten(0, (k, c.num_tokens)))

    def compare(self, want_cache: torch.Tensor | None, want_outputs: list[Any], outputs: list[Any]) -> list[str]:
        """Byte differences of the cache storage and of each call's output (compared on the device;
        described on the CPU only when they differ)."""
        problems: list[str | None] = []
        cache = self.cache
        if cache is not None and want_cache is not None and not torch.equal(raw_bytes(cache), raw_bytes(want_cache)):
            got, want = storage_bytes(cache), storage_bytes(want_cache)
            problems.append(bytes_mismatch(got, want, cache_locator(want_cache), "cache"))
        for j, (got, want) in enumerate(zip(outputs, want_outputs)):
            if want is None:
                if got is not None:
                    problems.append(f"call {j}: returned {type(got).__name__}, expected None")
                continue
            if not isinstance(got, torch.Tensor) or (got.dtype, got.shape) != (want.dtype, want.shape):
                problems.append(
                    f"call {j}: returned {getattr(got, 'dtype', type(got))} {list(getattr(got, 'shape', []))}, "
                    f"expected {want.dtype} {list(want.shape)}"
                )
            elif not torch.equal(got.reshape(-1).view(torch.uint8), want.reshape(-1).view(torch.uint8)):
                want = want.clone()  # locators read offsets from the storage start
                locate = cache_locator(want) if self.case.entry == "pack" else element_locator(want)
                problems.append(bytes_mismatch(flat_bytes(got), flat_bytes(want), locate, f"call {j} output"))
        return [p for p in problems if p]


# ---------------------------------------------------------------- the run


@dataclasses.dataclass
class SoakResult:
    calls: int = 0
    checks: int = 0
    mismatches: int = 0  # checks that found a difference
    seconds: float = 0.0  # the run, checks included
    check_seconds: float = 0.0
    reports: list[str] = dataclasses.field(default_factory=list)  # the first MAX_REPORTS mismatches

    @property
    def calls_per_second(self) -> float:
        return self.calls / max(self.seconds - self.check_seconds, 1e-9)


def run_step(w: Workload, use_graph: bool, checked: bool, result: SoakResult, log: Log) -> None:
    """One step of ``w``: refill, run, and (``checked``) compare with the reference."""
    w.refill()
    if checked:
        synchronize(w.device)
        start = time.perf_counter()
        before = w.snapshot()
        result.check_seconds += time.perf_counter() - start
    outputs = w.step(use_graph)
    result.calls += w.calls
    if not checked:
        return
    synchronize(w.device)
    start = time.perf_counter()
    problems = w.compare(*w.expected(*before), outputs)
    result.checks += 1
    w.stats["checks"] += 1
    if problems:
        result.mismatches += 1
        w.stats["mismatches"] += 1
        mode, first = "graph" if use_graph else "eager", result.calls - w.calls
        report = f"{w.case} ({mode} step, calls {first}..{result.calls - 1}):\n" + "\n".join(problems)
        log(f"MISMATCH {report}")
        if len(result.reports) < MAX_REPORTS:
            result.reports.append(report)
    result.check_seconds += time.perf_counter() - start


def _print(message: str) -> None:
    print(message, flush=True)


def run_soak(
    geometries: Sequence[Case],
    *,
    calls: int,
    calls_per_step: int = 100,
    sample_every: int = 2000,
    eager_fraction: float = 0.25,
    minutes: float | None = None,
    device: Device = "cuda",
    impl: Any = ops,
    use_graphs: bool = True,
    seed: int = 0,
    log: Log = _print,
) -> SoakResult:
    """Steps of ``calls_per_step`` calls of a random geometry until ``calls`` calls (or
    ``minutes``), a fraction ``eager_fraction`` of them eager, the rest graph replays; then a
    final checked step of each geometry in each mode. ``impl`` provides the entries."""
    torch.manual_seed(seed)
    rng = random.Random(seed)
    start = time.perf_counter()
    workloads = [Workload(case, calls_per_step, device, impl) for case in geometries]
    if use_graphs:
        for w in workloads:
            w.capture()
    synchronize(device)
    log(
        f"soak: {len(workloads)} geometries set up{' and captured' if use_graphs else ''} in "
        f"{time.perf_counter() - start:.1f} s; {calls} calls in steps of {calls_per_step}, "
        f"{eager_fraction:.0%} eager, 1 in {sample_every} calls checked, seed {seed}"
    )
    result = SoakResult()
    start = time.perf_counter()
    deadline = None if minutes is None else start + 60 * minutes
    next_log = start + 10
    while result.calls < calls and (deadline is None or time.perf_counter() < deadline):
        w = rng.choice(workloads)
        use_graph = use_graphs and rng.random() >= eager_fraction
        sampled = (result.calls + w.calls) // sample_every > result.calls // sample_every
        run_step(w, use_graph, sampled, result, log)
        if time.perf_counter() > next_log:
            next_log += 10
            rate = result.calls / (time.perf_counter() - start)
            log(
                f"  {result.calls} calls, {rate:.0f} calls/s (checks included), "
                f"{result.mismatches} mismatches in {result.checks} checks"
            )
    for w in workloads:  # the last calls of each geometry, in each mode
        for use_graph in (False, True) if use_graphs else (False,):
            run_step(w, use_graph, True, result, log)
    synchronize(device)
    result.seconds = time.perf_counter() - start
    for w in workloads:
        log(f"  {w.case!s:<100} " + ", ".join(f"{k} {v}" for k, v in w.stats.items()))
    return result
