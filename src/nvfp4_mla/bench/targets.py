"""The performance targets as same-run ratios, and each row's derived metrics and verdicts.

Only rows of the kernels as shipped (``Row.ships``) count in the summary; the KV rows per warp
A/B's other rows get their verdicts in the table only.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

from .arms import EAGER_RATIO_ARMS
from .grid import KV_ONLY_ENTRIES, LONG_TOKENS, Row
from .results import Ceilings, FirstUse, RowResult, format_s

BANDWIDTH_TARGET = 0.85  # of the copy ceiling, T >= BANDWIDTH_MIN_TOKENS
BANDWIDTH_MIN_TOKENS = 4096
LATENCY_TARGETS_US = ((16, 2.0), (128, 3.0))  # T = 1, graph-replayed: (up to padded heads, limit)
HOST_RATIO_TARGET = 2.5  # eager call's host time / torch add_'s
SPEEDUP_SMALL = (64, 3.0)  # T <= 64: peers at least 3x the fused time
SPEEDUP_LARGE = (4096, 1.3)  # T >= 4096: at least 1.3x
FIRST_USE_TARGET_S = 1.5
WARM_RELOAD_TARGET_S = 0.050
PEER_ARMS = ("unfused", "compile")  # what the speedup target compares the fused arm with


class Threshold(NamedTuple):
    """A row target: one of the row's numbers (a key of ``row_metrics``' values: "copy_fraction",
    "graph_us" or "stub_ratio") against a fixed limit, on the rows ``applies`` selects."""

    title: str
    applies: Callable[[Row], bool]
    value: str
    limit: float
    at_most: bool = False  # the value must be <= limit (else >= limit)

    def verdict(self, value: float | None) -> str:
        """PASS or MISS of a measured value, "n/a" for None."""
        if value is None:
            return "n/a"
        return _verdict(value <= self.limit if self.at_most else value >= self.limit)


# The general bandwidth target, then those of "quantize at the memory floor" (graph-replayed
# device times). The % of copy ones are primary: the kernel / stub ratio (the no-quantizer arm)
# is judged only out of L2, and a slower stub must never make a row look better.
THRESHOLDS = {
    "bandwidth": Threshold(
        f"T >= {BANDWIDTH_MIN_TOKENS}: fused device time (graph-replayed) >= {BANDWIDTH_TARGET:.0%} of the "
        "copy ceiling",
        lambda r: r.num_tokens >= BANDWIDTH_MIN_TOKENS,
        "copy_fraction",
        BANDWIDTH_TARGET,
    ),
    "kv_copy": Threshold(
        f"KV ratio 1 and 2, append, pack at T >= {LONG_TOKENS}: >= 80% of the copy ceiling",
        lambda r: r.entry in KV_ONLY_ENTRIES and r.num_tokens >= LONG_TOKENS,
        "copy_fraction",
        0.80,
    ),
    "inplace_copy": Threshold(
        "in place with 8, 16 or 128 heads at T >= 16384: >= 85% of the copy ceiling",
        lambda r: r.entry == "inplace" and r.num_heads in (8, 16, 128) and r.num_tokens >= 16384,
        "copy_fraction",
        0.85,
    ),
    "main_copy": Threshold(
        "main 8->8 and 8->16 at T = 4096: >= 88% of the copy ceiling",
        lambda r: r.entry == "main" and (r.num_heads, r.q_head_padded) in ((8, 8), (8, 16)) and r.num_tokens == 4096,
        "copy_fraction",
        0.88,
    ),
    "latency_every_entry": Threshold(
        "T = 1, every entry: graph-replayed fused call <= 1.8 us",
        lambda r: r.num_tokens == 1,
        "graph_us",
        1.8,
        at_most=True,
    ),
    "stub_ratio": Threshold(
        f"T >= {LONG_TOKENS}, every entry: kernel / no-quantizer stub (both graph-replayed) <= 1.10",
        lambda r: r.num_tokens >= LONG_TOKENS,
        "stub_ratio",
        1.10,
        at_most=True,
    ),
}

TARGET_TITLES = {
    "bandwidth": THRESHOLDS["bandwidth"].title,
    "latency": "T = 1: graph-replayed fused call <= {1:.1f} us up to {0} padded heads, <= {3:.1f} us at {2}".format(
        *LATENCY_TARGETS_US[0], *LATENCY_TARGETS_US[1]
    ),
    "host": f"host time of one eager call <= {HOST_RATIO_TARGET}x a torch add_ launch",
    "speedup": f"fused eager >= {SPEEDUP_SMALL[1]}x faster than unfused and torch.compile for T <= {SPEEDUP_SMALL[0]}, "
    f">= {SPEEDUP_LARGE[1]}x for T >= {SPEEDUP_LARGE[0]}",
    **{name: threshold.title for name, threshold in THRESHOLDS.items() if name != "bandwidth"},
}


class Metrics(NamedTuple):
    """What a row's times mean against the ceilings and the targets."""

    floor_s: float | None  # bytes / copy bandwidth
    gbps: float | None  # modelled bytes / fused device time (graph-replayed, else eager), GB/s
    copy_fraction: float | None
    stub_ratio: float | None  # kernel / stub, both graph-replayed
    stub_copy_fraction: float | None  # modelled bytes / stub time, of the copy ceiling
    ratios: dict[str, float]  # arm of EAGER_RATIO_ARMS -> its time / fused eager time
    host_ratio: float | None  # host time / torch add_ host time
    targets: dict[str, str]  # target -> "PASS", "MISS", "n/a" (applies, not measured); absent: not for this row


def latency_limit_us(row: Row) -> float:
    """The T = 1 latency limit of the row's padded head count."""
    heads = row.q_head_padded if row.entry in ("main", "inplace") else 0
    return next((limit for max_heads, limit in LATENCY_TARGETS_US if heads <= max_heads), LATENCY_TARGETS_US[-1][1])


def speedup_needed(num_tokens: int) -> float | None:
    """The speedup over the peers a row of ``num_tokens`` must reach, None between the two ranges."""
    if num_tokens <= SPEEDUP_SMALL[0]:
        return SPEEDUP_SMALL[1]
    if num_tokens >= SPEEDUP_LARGE[0]:
        return SPEEDUP_LARGE[1]
    return None


def _verdict(ok: bool) -> str:
    return "PASS" if ok else "MISS"


def row_metrics(result: RowResult, ceilings: Ceilings) -> Metrics:
    """The row's floor, bandwidth, ratios and target verdicts."""
    row, fused = result.row, result.seconds.get("fused")
    copy_bw = ceilings.copy_bytes_per_s
    floor = result.bytes / copy_bw if copy_bw else None
    # Bandwidth from the graph-replayed time: back-to-back eager calls are bounded by the host's
    # launch rate whenever one call's device time is shorter than its host time.
    device = result.seconds.get("graph") or fused
    gbps = result.bytes / device / 1e9 if device else None
    fraction = result.bytes / device / copy_bw if device and copy_bw else None
    graph, stub = result.seconds.get("graph"), result.seconds.get("stub")
    stub_ratio = graph / stub if graph and stub else None
    stub_fraction = result.bytes / stub / copy_bw if stub and copy_bw else None
    ratios = {arm: s / fused for arm in EAGER_RATIO_ARMS if (s := result.seconds.get(arm)) is not None and fused}
    host_ratio = result.host_s / ceilings.add_host_s if result.host_s and ceilings.add_host_s else None

    targets = {}
    values = {"copy_fraction": fraction, "graph_us": graph * 1e6 if graph else None, "stub_ratio": stub_ratio}
    for name, threshold in THRESHOLDS.items():
        if threshold.applies(row):
            targets[name] = threshold.verdict(values[threshold.value])
    if row.num_tokens == 1:
        targets["latency"] = "n/a" if graph is None else _verdict(graph * 1e6 <= latency_limit_us(row))
        targets["host"] = "n/a" if host_ratio is None else _verdict(host_ratio <= HOST_RATIO_TARGET)
    needed = speedup_needed(row.num_tokens)
    peers = [arm for arm in PEER_ARMS if arm in result.seconds]
    if needed is not None and peers:
        measured = [ratios[arm] for arm in peers if arm in ratios]
        targets["speedup"] = _verdict(min(measured) >= needed) if measured else "n/a"
    ordered = {name: targets[name] for name in TARGET_TITLES if name in targets}
    return Metrics(floor, gbps, fraction, stub_ratio, stub_fraction, ratios, host_ratio, ordered)


def first_use_targets(first_use: FirstUse) -> dict[str, tuple[str, str]]:
    """Target title -> (verdict, measured time) of the two first-use targets."""

    def verdict(seconds: float | None, limit: float) -> str:
        return "n/a" if seconds is None else _verdict(seconds < limit)

    return {
        f"first call of a fresh geometry, cold disk cache (new process) < {FIRST_USE_TARGET_S} s": (
            verdict(first_use.cold_first_call_s, FIRST_USE_TARGET_S),
            format_s(first_use.cold_first_call_s),
        ),
        f"first call in a new process, warm disk cache < {WARM_RELOAD_TARGET_S * 1e3:.0f} ms": (
            verdict(first_use.warm_first_call_s, WARM_RELOAD_TARGET_S),
            format_s(first_use.warm_first_call_s),
        ),
    }


def target_summary(results: list[RowResult], ceilings: Ceilings, first_use: FirstUse) -> list[tuple[str, str, str]]:
    """(target, verdict, detail) lines: a row target passes when every shipped row it applies to
    passes."""
    verdicts: dict[str, list[tuple[RowResult, str]]] = {name: [] for name in TARGET_TITLES}
    for result in (r for r in results if r.row.ships):
        for name, verdict in row_metrics(result, ceilings).targets.items():
            verdicts[name].append((result, verdict))
    lines = []
    for name, title in TARGET_TITLES.items():
        entries = verdicts[name]
        passed = sum(v == "PASS" for _, v in entries)
        missed = [f"{r.row.label} T={r.row.num_tokens}" for r, v in entries if v == "MISS"]
        unmeasured = sum(v == "n/a" for _, v in entries)
        if not entries or (passed == 0 and not missed):
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
