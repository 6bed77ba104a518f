"""The fused decode on ragged batches: ``nvfp4-mla bench decode --ragged`` (:mod:`.decode`) also
writes ``decode_ragged.csv`` and ``.md``.

**Ragged batches**: 32 and 128
rows of 64 and 128 heads over 128 window + 2,048 compressed selections whose live counts
(``extra_lens``) follow a distribution: ``full`` (all 2,048), ``tail1of8`` (one row in eight
2,048, the rest 128), ``uniform`` (1-2,048), ``short`` (1-256). Two arms, graph-replayed: the
one-call form (``sparse_mla_decode`` with the lengths: the scheduler runs in each call) and a
reused plan (``plan_sparse_mla_decode`` once, ``plan=`` in each call). ``live_full`` is the
batch's live selections over its full batch's, ``time_full`` the one-call time over the full
batch's: a decode whose time follows its work keeps the two close.

**Other distributions** (``OTHER_DISTRIBUTIONS``, for the benchmarks' scripts, e.g.
``benchmarks/ncu_driver.py --lengths``; the bench's grid keeps the four above): ``bimodal`` (half the rows
64, half ``k``), ``geometric`` (exponential, mean ``k / 10``), ``mostly_empty`` (one row in eight ``k``,
the rest 1), ``one_long`` (one row ``k``, the rest 32) and ``ramp`` (1 to ``k`` evenly), the rows in a
random order: the batches where the decode stands furthest from FlashMLA
(docs/performance.md#against-flashmla).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

import nvfp4_mla

from .decode_arms import Inputs, Pools, fused
from .report import markdown_grid, write_suite
from .timing import Timer

RAGGED_STEM = "decode_ragged"
RAGGED_EXTRA_K = 2048
RAGGED_DISTRIBUTIONS = ("full", "tail1of8", "uniform", "short")
OTHER_DISTRIBUTIONS = ("bimodal", "geometric", "mostly_empty", "one_long", "ramp")
LENGTH_DISTRIBUTIONS = RAGGED_DISTRIBUTIONS + OTHER_DISTRIBUTIONS  # what ragged_lengths takes
RAGGED_COLUMNS = ["batch", "heads", "lens", "live_full", "one_call_us", "plan_us", "plan_speedup", "time_full"]


def ragged_lengths(dist: str, batch: int, k: int, g: torch.Generator) -> torch.Tensor:
    """int32 ``[batch, 1]`` live counts of the extra pool's ``k`` selections (see the module's
    "Ragged batches" and "Other distributions")."""
    if dist == "full":
        n = torch.full((batch,), k)
    elif dist == "tail1of8":
        n = torch.where(torch.arange(batch) % 8 == 0, k, 128)
    elif dist == "uniform":
        n = torch.randint(1, k + 1, (batch,), generator=g)
    elif dist == "short":
        n = torch.randint(1, 257, (batch,), generator=g)
    elif dist in OTHER_DISTRIBUTIONS:
        n = _other_lengths(dist, batch, k, g)
    else:
        raise ValueError(f"no length distribution {dist!r}: one of {LENGTH_DISTRIBUTIONS}")
    return n.to(torch.int32).view(batch, 1)


def _other_lengths(dist: str, batch: int, k: int, g: torch.Generator) -> torch.Tensor:
    """The live counts of one of ``OTHER_DISTRIBUTIONS``: exponential, or a fixed set of counts in a
    random order."""
    if dist == "geometric":
        return (-(k / 10) * torch.log(torch.rand(batch, generator=g))).long().clamp(1, k)
    r = torch.arange(batch)
    if dist == "bimodal":
        n = torch.where(r % 2 == 0, k, 64)
    elif dist == "mostly_empty":
        n = torch.where(r % 8 == 0, k, 1)
    elif dist == "one_long":
        n = torch.where(r == 0, k, 32)
    else:  # ramp
        n = torch.linspace(1, k, batch).long()
    return n[torch.randperm(batch, generator=g)]


def measure_ragged(
    pools: Pools, batch: int, heads: int, dist: str, g: torch.Generator, timer: Timer, sets: int = 2
) -> dict[str, Any]:
    """One ragged batch's row (``time_full`` is filled by the caller from the full batch's)."""
    device = pools.tables[0].device
    calls = []
    for _ in range(sets):
        x = Inputs(batch, 1, heads, RAGGED_EXTRA_K, g, pools)
        lens = ragged_lengths(dist, batch, RAGGED_EXTRA_K, g).to(device)
        plan = nvfp4_mla.plan_sparse_mla_decode(heads, x.slots[0], extra_slots=x.slots[1], extra_lens=lens)
        calls.append((x, lens, plan))

    def one(item: tuple[Inputs, torch.Tensor, Any], planned: bool) -> object:
        x, lens, plan = item
        return fused(pools, x, extra_lens=lens, plan=plan if planned else None)

    row: dict[str, Any] = {"batch": batch, "heads": heads, "lens": dist}
    live = sum(int(lens.sum()) for _, lens, _ in calls) / len(calls)
    row["live_full"] = live / (batch * RAGGED_EXTRA_K)
    row["one_call_us"] = timer.graph(lambda item: one(item, False), calls) * 1e6
    row["plan_us"] = timer.graph(lambda item: one(item, True), calls) * 1e6
    row["plan_speedup"] = row["one_call_us"] / row["plan_us"]
    return row


def ragged(pools: Pools, g: torch.Generator, timer: Timer, out: Path, device_name: str) -> list[dict[str, Any]]:
    """The ragged batches' rows, printed and written to ``decode_ragged.csv`` and ``.md``."""
    rows = []
    print(f"{'batch':>5} {'heads':>5} {'lens':>9} {'live/full':>9} {'one call':>9} {'plan':>8} {'time/full':>9}")
    for heads in (64, 128):
        for batch in (32, 128):
            full_us = 0.0
            for dist in RAGGED_DISTRIBUTIONS:
                r = measure_ragged(pools, batch, heads, dist, g, timer)
                full_us = full_us or r["one_call_us"]  # "full" comes first
                r["time_full"] = r["one_call_us"] / full_us
                rows.append(r)
                torch.cuda.empty_cache()
                print(
                    f"{batch:5d} {heads:5d} {dist:>9} {r['live_full']:9.2f} {r['one_call_us']:9.1f} "
                    f"{r['plan_us']:8.1f} {r['time_full']:9.2f}"
                )

    def cell(value: object) -> str:
        return f"{value:.3g}" if isinstance(value, float) else str(value)

    md = [
        f"# Fused sparse decode on {device_name}: ragged batches",
        "",
        *markdown_grid(RAGGED_COLUMNS, [[cell(r[c]) for c in RAGGED_COLUMNS] for r in rows]),
    ]
    write_suite(out, RAGGED_STEM, rows, RAGGED_COLUMNS, "\n".join(md) + "\n")
    return rows
