"""Soak run: many mixed calls of every entry, eager and CUDA-graph replayed, sampled against the reference.

    PYTHONPATH=src python3 benchmarks/soak.py [--calls 1000000] [--minutes M] [--seed S]

Thirteen fixed geometries (all four entries; page sizes 1..300; 1..128 heads; 3-D, HND and NHD
caches, padded pools; int32/int64 slots; DP padding; invalid slots and positions). Work goes in
steps of ``--calls-per-graph`` calls (default 100) of one geometry, chosen at random: the step's
static inputs (one input set per call, the slots of a step disjoint) are refilled with new random
data by ``copy_``, then the calls run either eagerly or as one replay of the geometry's CUDA
graph, captured once on those static buffers. The step containing every ``--sample-every``-th
call (default 2000), and a final eager and graph step of each geometry, are checked: the cache
storage and every call's output must equal, byte for byte, the reference run on a snapshot of the
cache and inputs taken before the step. A step's calls use disjoint slots and independent rows, so
the reference runs them as one concatenated call (DP padding rows get slot -1).

Prints calls/s (checks excluded) and the number of mismatching checks; exit status 1 on any
mismatch, 2 without a usable GPU. ``run_soak`` also runs on the CPU with ``nvfp4_mla.reference``
standing in for the kernels (tests/test_fuzz.py does, for a handful of calls).
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import random
import sys
import time
from pathlib import Path

import torch

sys.path[:0] = [str(Path(__file__).resolve().parents[1] / p) for p in ("src", "tests")]

import nvfp4_mla  # noqa: E402
from nvfp4_mla import abi, reference  # noqa: E402
from test_gpu_entries import ARG_NAMES, ENTRIES, Case, bytes_mismatch, cache_locator, clone, element_locator, flat_bytes  # noqa: E402
from util import cos_sin_table, make_cache, random_rows, storage_bytes  # noqa: E402

# Case.bad_slots / bad_positions switch on invalid slots / positions; Case.rows and .table are not
# used (rows are util.random_rows with a few specials, the table a real RoPE table).
GEOMETRIES = [
    Case(tokens=1, heads=8, q_head_padded=16, page_size=64),  # decode step
    Case(tokens=16, heads=5, q_head_padded=8, page_size=1, layout="HND", pad=16, slot_dtype=torch.int32, bad_positions=True),
    Case(tokens=64, heads=16, q_head_padded=0, q_inplace=True, page_size=256, layout="NHD"),
    Case(tokens=8, heads=128, q_head_padded=128, apply_q_rope=False, page_size=16),
    Case(tokens=8, heads=64, q_head_padded=0, page_size=3, pad=48),  # cache only
    Case(tokens=48, slots=40, heads=8, q_head_padded=8, q_inplace=True, page_size=32, layout="HND", bad_positions=True),
    Case(entry="kv", tokens=64, page_size=64, layout="NHD"),
    Case(entry="kv", tokens=33, compress_ratio=2, page_size=7, pad=16, slot_dtype=torch.int32, max_position=4097, bad_positions=True),
    Case(entry="kv", tokens=1, compress_ratio=2, page_size=1),
    Case(entry="append", tokens=100, slots=96, page_size=128, layout="HND", slot_dtype=torch.int32),
    Case(entry="append", tokens=5, page_size=300, pad=48),
    Case(entry="pack", page_size=64, pages=4, layout="HND"),
    Case(entry="pack", page_size=5, pages=3, layout="NHD"),
]

BAD_FRACTION = 1 / 32  # slots / positions made invalid, where the geometry asks for them
SPECIAL_FRACTION = 1e-4  # row elements set to +-inf, NaN or +-0
MAX_REPORTS = 5


# ---------------------------------------------------------------- random step inputs
# Helpers take their constant tensors (special values, invalid slots/positions) ready-made on the
# device: a refill makes no host-to-device copy of its own.


def random_values(shape, specials: torch.Tensor) -> torch.Tensor:
    """util.random_rows with a SPECIAL_FRACTION of elements (at least one) set to ``specials``."""
    x = random_rows(shape, specials.device)
    _scatter(x, specials, SPECIAL_FRACTION)
    return x


def _scatter(t: torch.Tensor, values: torch.Tensor, fraction: float) -> None:
    """Overwrites a ``fraction`` of ``t``'s elements (at least one) with random picks of ``values``."""
    k = max(1, int(t.numel() * fraction))
    picks = values[torch.randint(len(values), (k,), device=t.device)]
    t.view(-1)[torch.randint(t.numel(), (k,), device=t.device)] = picks.to(t.dtype)


def step_slots(calls: int, n: int, capacity: int, dtype, junk: torch.Tensor | None, device) -> torch.Tensor:
    """``[calls, n]`` slots, the valid ones distinct across the whole step; some from ``junk``."""
    slots = torch.randperm(capacity, device=device)[: calls * n]
    if junk is not None and slots.numel():
        _scatter(slots, junk, BAD_FRACTION)
    return slots.view(calls, n).to(dtype)


def step_positions(calls: int, tokens: int, max_position: int, junk: torch.Tensor | None, device) -> torch.Tensor:
    positions = torch.randint(0, max_position, (calls, tokens), device=device)
    if junk is not None:
        _scatter(positions, junk, BAD_FRACTION)
    return positions


def synchronize(device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def raw_bytes(t: torch.Tensor) -> torch.Tensor:
    """Every byte of ``t``'s storage, as a uint8 tensor on its device (no copy)."""
    return torch.empty(0, dtype=torch.uint8, device=t.device).set_(t.untyped_storage())


# ---------------------------------------------------------------- one geometry


class Workload:
    """One geometry: static inputs for the ``calls`` calls of a step, the cache they write, and
    (after :meth:`capture`) the CUDA graph of those calls with its static outputs."""

    def __init__(self, case: Case, calls: int, device, impl):
        self.case, self.calls, self.device = case, calls, device
        self.entry = getattr(impl, ENTRIES[case.entry])
        self.kwargs = case.kwargs()
        self.cache = self.cos_sin = None
        self.capacity = 0
        if case.entry != "pack":
            pages = calls * case.num_slots * 5 // 4 // case.page_size + 2  # room for a step's slots
            self.cache = make_cache(pages, case.page_size, case.layout, case.pad, device)
            self.capacity = pages * case.page_size
        if case.entry in ("main", "kv"):
            self.cos_sin = cos_sin_table(case.max_position, device)
        m = case.max_position
        low = -(2**31) if case.slot_dtype == torch.int32 else -(2**62)
        self.specials = torch.tensor([float("inf"), float("-inf"), float("nan"), 0.0, -0.0], device=device)
        self.slot_junk = torch.tensor([-1, -2, low, self.capacity, self.capacity + 1], device=device) if case.bad_slots else None
        self.position_junk = torch.tensor([-1, m, m + 1, 2**40, -(2**40)], device=device) if case.bad_positions else None
        self.inputs = self.fresh_inputs()  # the static buffers
        shared = {"cache": self.cache, "cos_sin_cache": self.cos_sin}
        self.args = [  # each call's arguments: views of the static buffers
            tuple(shared[name] if name in shared else self.inputs[name][j] for name in ARG_NAMES[case.entry])
            for j in range(calls)
        ]
        self.graph = self.graph_outputs = None
        self.stats = {"calls": 0, "eager steps": 0, "graph steps": 0, "checks": 0, "mismatches": 0}

    def fresh_inputs(self) -> dict:
        """New random inputs for a step, one leading index per call."""
        c, k = self.case, self.calls
        if c.entry == "pack":
            return {"kv": random_values((k, c.pages, c.page_size, abi.HEAD_DIM), self.specials)}
        made = {
            "kv": random_values((k, c.tokens, abi.HEAD_DIM), self.specials),
            "slot_mapping": step_slots(k, c.num_slots, self.capacity, c.slot_dtype, self.slot_junk, self.device),
        }
        if c.entry in ("main", "kv"):
            made["positions"] = step_positions(k, c.tokens, c.max_position, self.position_junk, self.device)
        if c.entry == "main":
            made["q"] = random_values((k, c.tokens, c.heads, abi.HEAD_DIM), self.specials)
        return made

    def refill(self) -> None:
        for name, fresh in self.fresh_inputs().items():
            self.inputs[name].copy_(fresh)

    def run_calls(self) -> list:
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

    def step(self, use_graph: bool) -> list:
        """Runs the step's calls on the current static inputs; returns each call's output."""
        self.stats["graph steps" if use_graph else "eager steps"] += 1
        self.stats["calls"] += self.calls
        if use_graph:
            self.graph.replay()
            return self.graph_outputs
        return self.run_calls()

    def snapshot(self):
        return {name: t.clone() for name, t in self.inputs.items()}, None if self.cache is None else clone(self.cache)

    def expected(self, inputs: dict, cache):
        """The reference on a snapshot (modified in place): (the cache after the step, each
        call's output), all calls of the step run as one concatenated call."""
        c, k = self.case, self.calls
        ref = getattr(reference, ENTRIES[c.entry])
        if c.entry == "pack":
            out = ref(inputs["kv"].flatten(0, 1), **self.kwargs)
            return None, list(out.unflatten(0, (k, c.pages)))
        slots = inputs["slot_mapping"]  # [k, n]; a call's rows >= n are DP padding: slot -1
        named = {
            "kv": inputs["kv"].flatten(0, 1),
            "cache": cache,
            "cos_sin_cache": self.cos_sin,
            "slot_mapping": torch.cat((slots, slots.new_full((k, c.tokens - slots.shape[1]), -1)), dim=1).flatten(),
        }
        for name in ("q", "positions"):
            if name in inputs:
                named[name] = inputs[name].flatten(0, 1)
        out = ref(*(named[name] for name in ARG_NAMES[c.entry]), **self.kwargs)
        return cache, [None] * k if out is None else list(out.unflatten(0, (k, c.tokens)))

    def compare(self, want_cache, want_outputs: list, outputs: list) -> list[str]:
        """Byte differences of the cache storage and of each call's output (compared on the device;
        described on the CPU only when they differ)."""
        problems = []
        if self.cache is not None and not torch.equal(raw_bytes(self.cache), raw_bytes(want_cache)):
            problems.append(bytes_mismatch(storage_bytes(self.cache), storage_bytes(want_cache), cache_locator(want_cache), "cache"))
        for j, (got, want) in enumerate(zip(outputs, want_outputs)):
            if want is None:
                if got is not None:
                    problems.append(f"call {j}: returned {type(got).__name__}, expected None")
                continue
            if not isinstance(got, torch.Tensor) or (got.dtype, got.shape) != (want.dtype, want.shape):
                problems.append(f"call {j}: returned {getattr(got, 'dtype', type(got))} {list(getattr(got, 'shape', []))}, "
                                f"expected {want.dtype} {list(want.shape)}")
            elif not torch.equal(got.reshape(-1).view(torch.uint8), want.reshape(-1).view(torch.uint8)):
                want = want.clone()  # locators read offsets from the storage start
                locate = cache_locator(want) if self.case.entry == "pack" else element_locator(want)
                problems.append(bytes_mismatch(flat_bytes(got), flat_bytes(want), locate, f"call {j} output"))
        return problems


# ---------------------------------------------------------------- the run


@dataclasses.dataclass
class SoakResult:
    calls: int = 0
    checks: int = 0
    mismatches: int = 0  # checks that found a difference
    seconds: float = 0.0  # the run, checks included
    check_seconds: float = 0.0
    reports: list = dataclasses.field(default_factory=list)  # the first MAX_REPORTS mismatches

    @property
    def calls_per_second(self) -> float:
        return self.calls / max(self.seconds - self.check_seconds, 1e-9)


def run_step(w: Workload, use_graph: bool, checked: bool, result: SoakResult, log) -> None:
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
        report = f"{w.case} ({'graph' if use_graph else 'eager'} step, calls {result.calls - w.calls}..{result.calls - 1}):\n" + "\n".join(problems)
        log(f"MISMATCH {report}")
        if len(result.reports) < MAX_REPORTS:
            result.reports.append(report)
    result.check_seconds += time.perf_counter() - start


def _print(message: str) -> None:
    print(message, flush=True)


def run_soak(geometries, *, calls: int, calls_per_step: int = 100, sample_every: int = 2000, eager_fraction: float = 0.25,
             minutes: float | None = None, device="cuda", impl=nvfp4_mla, use_graphs: bool = True, seed: int = 0,
             log=_print) -> SoakResult:
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
    log(f"soak: {len(workloads)} geometries set up{' and captured' if use_graphs else ''} in {time.perf_counter() - start:.1f} s; "
        f"{calls} calls in steps of {calls_per_step}, {eager_fraction:.0%} eager, 1 in {sample_every} calls checked, seed {seed}")

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
            log(f"  {result.calls} calls, {result.calls / (time.perf_counter() - start):.0f} calls/s (checks included), "
                f"{result.mismatches} mismatches in {result.checks} checks")
    for w in workloads:  # the last calls of each geometry, in each mode
        for use_graph in (False, True) if use_graphs else (False,):
            run_step(w, use_graph, True, result, log)
    synchronize(device)
    result.seconds = time.perf_counter() - start
    for w in workloads:
        log(f"  {str(w.case):<100} " + ", ".join(f"{k} {v}" for k, v in w.stats.items()))
    return result


def gpu_problem() -> str | None:
    if not torch.cuda.is_available():
        return "torch sees no CUDA device"
    major, minor = torch.cuda.get_device_capability()
    if major < 8:
        return f"the GPU is sm_{major}{minor}"
    if importlib.util.find_spec("cupy") is None:
        return "CuPy is not installed (pip install 'nvfp4-mla[cu12]')"
    return None


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=1_000_000, help="calls to make (default 1,000,000)")
    parser.add_argument("--minutes", type=float, default=None, help="stop the run after this long")
    parser.add_argument("--calls-per-graph", type=int, default=100, help="calls of a step / of a captured graph")
    parser.add_argument("--sample-every", type=int, default=2000, help="check the step holding every N-th call")
    parser.add_argument("--eager-fraction", type=float, default=0.25, help="share of steps run eagerly")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    problem = gpu_problem()
    if problem:
        print(f"soak: needs a CUDA GPU (sm_80 or newer) with CuPy: {problem}", file=sys.stderr)
        return 2
    print(f"soak on {torch.cuda.get_device_name()}, torch {torch.__version__}")
    result = run_soak(GEOMETRIES, calls=args.calls, calls_per_step=args.calls_per_graph, sample_every=args.sample_every,
                      eager_fraction=args.eager_fraction, minutes=args.minutes, seed=args.seed)
    print(f"soak: {result.calls} calls in {result.seconds:.1f} s ({result.check_seconds:.1f} s of it checking): "
          f"{result.calls_per_second:,.0f} calls/s without the checks; "
          f"{result.mismatches} mismatches in {result.checks} checks")
    for report in result.reports:
        print(report)
    return 1 if result.mismatches else 0


if __name__ == "__main__":
    sys.exit(main())
