"""The performance targets as same-run ratios, and each row's derived metrics and verdicts."""

from __future__ import annotations

from typing import NamedTuple

from .grid import Row
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

TARGET_TITLES = {
    "bandwidth": f"T >= {BANDWIDTH_MIN_TOKENS}: fused device time (graph-replayed) >= {BANDWIDTH_TARGET:.0%} of the "
    "copy ceiling",
    "latency": "T = 1: graph-replayed fused call <= {1:.1f} us up to {0} padded heads, <= {3:.1f} us at {2}".format(
        *LATENCY_TARGETS_US[0], *LATENCY_TARGETS_US[1]
    ),
    "host": f"host time of one eager call <= {HOST_RATIO_TARGET}x a torch add_ launch",
    "speedup": f"fused eager >= {SPEEDUP_SMALL[1]}x faster than unfused and torch.compile for T <= {SPEEDUP_SMALL[0]}, "
    f">= {SPEEDUP_LARGE[1]}x for T >= {SPEEDUP_LARGE[0]}",
}


class Metrics(NamedTuple):
    """What a row's times mean against the ceilings and the targets."""

    floor_s: float | None  # bytes / copy bandwidth
    gbps: float | None  # modelled bytes / fused device time (graph-replayed, else eager), GB/s
    copy_fraction: float | None
    ratios: dict[str, float]  # arm -> arm time / fused eager time
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
    ratios = {arm: s / fused for arm, s in result.seconds.items() if arm != "fused" and s is not None and fused}
    host_ratio = result.host_s / ceilings.add_host_s if result.host_s and ceilings.add_host_s else None

    targets = {}
    if row.num_tokens >= BANDWIDTH_MIN_TOKENS:
        targets["bandwidth"] = "n/a" if fraction is None else _verdict(fraction >= BANDWIDTH_TARGET)
    if row.num_tokens == 1:
        graph = result.seconds.get("graph")
        targets["latency"] = "n/a" if graph is None else _verdict(graph * 1e6 <= latency_limit_us(row))
        targets["host"] = "n/a" if host_ratio is None else _verdict(host_ratio <= HOST_RATIO_TARGET)
    needed = speedup_needed(row.num_tokens)
    peers = [arm for arm in PEER_ARMS if arm in result.seconds]
    if needed is not None and peers:
        measured = [ratios[arm] for arm in peers if arm in ratios]
        targets["speedup"] = _verdict(min(measured) >= needed) if measured else "n/a"
    return Metrics(floor, gbps, fraction, ratios, host_ratio, targets)


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
    """(target, verdict, detail) lines: a row target passes when every row it applies to passes."""
    verdicts: dict[str, list[tuple[RowResult, str]]] = {name: [] for name in TARGET_TITLES}
    for result in results:
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
