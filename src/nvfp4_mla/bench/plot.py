"""The report's plot: time vs tokens of the main entry with 8 heads padded to 16."""

from __future__ import annotations

import math
from pathlib import Path

from .results import Ceilings, RowResult

PLOT_SERIES = (  # arm, legend, matplotlib format
    ("fused", "fused, eager", "o-"),
    ("graph", "fused, CUDA graph", "s-"),
    ("unfused", "unfused: torch RoPE + append", "^-"),
    ("compile", "torch.compile(reference)", "v-"),
    ("stub", "no quantizer (stub kernels), CUDA graph", "d--"),
)


def write_plot(path: Path, results: list[RowResult], ceilings: Ceilings, title: str) -> None:
    """Log-log time vs tokens of the plot rows (``Row.is_plot_row``): the arms, the bandwidth floor
    and the graph-replayed empty kernel. Needs matplotlib."""
    from matplotlib.figure import Figure  # no pyplot: no global backend state

    rows = sorted((r for r in results if r.row.is_plot_row), key=lambda r: r.row.num_tokens)
    figure = Figure(figsize=(7.5, 4.8), layout="constrained")
    axes = figure.subplots()
    fastest_us = math.inf
    for arm, legend, style in PLOT_SERIES:
        points = [(r.row.num_tokens, seconds * 1e6) for r in rows if (seconds := r.seconds.get(arm)) is not None]
        if points:
            axes.plot(*zip(*points), style, label=legend)
            fastest_us = min(fastest_us, *(us for _, us in points))
    if ceilings.copy_bytes_per_s:
        floors_us = [r.bytes / ceilings.copy_bytes_per_s * 1e6 for r in rows]
        axes.plot([r.row.num_tokens for r in rows], floors_us, "k--", label="bandwidth floor: bytes / copy bandwidth")
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
