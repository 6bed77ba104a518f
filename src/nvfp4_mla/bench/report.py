"""The run's outputs: the CSV (every number of every row), the markdown report and its tables."""

from __future__ import annotations

import csv
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path

from .arms import ARM_TITLES, EAGER_RATIO_ARMS
from .ceilings import COPY_BYTES, EMPTY_KERNEL_TITLE
from .results import Ceilings, FirstUse, RowResult, format_ratio, format_s, format_us
from .stub import STUBS
from .targets import TARGET_TITLES, Metrics, row_metrics, target_summary
from .timing import HOST_BATCHES, HOST_CALLS

# (header, cell) columns of the markdown tables.
Column = tuple[str, Callable[[RowResult, Metrics], str]]


def _arm_cell(result: RowResult, arm: str) -> str:
    return format_us(result.seconds[arm]) if arm in result.seconds else "-"


def _ratio_cell(result: RowResult, metrics: Metrics, arm: str) -> str:
    if arm not in result.seconds:
        return "-"
    return format_ratio(metrics.ratios[arm]) if arm in metrics.ratios else "n/a"


def _targets_cell(metrics: Metrics) -> str:
    return ", ".join(f"{name} {verdict}" for name, verdict in metrics.targets.items())


def _host_cell(result: RowResult, metrics: Metrics) -> str:
    if result.host_s is None:
        return "-"
    ratio = f" ({format_ratio(metrics.host_ratio)})" if metrics.host_ratio is not None else ""
    return format_us(result.host_s) + ratio


def _fraction_cell(fraction: float | None) -> str:
    return "n/a" if fraction is None else f"{fraction:.0%}"


def _stub_cell(result: RowResult, text: str) -> str:
    """``text`` for a row with a no-quantizer arm, "-" for one without."""
    return text if "stub" in result.seconds else "-"


def _stub_ratio_cell(result: RowResult, metrics: Metrics) -> str:
    return _stub_cell(result, "n/a" if metrics.stub_ratio is None else f"{metrics.stub_ratio:.2f}")


def _arm_column(arm: str) -> Column:
    return (f"{arm} us", lambda r, m: _arm_cell(r, arm))


def _ratio_column(arm: str) -> Column:
    return (arm, lambda r, m: _ratio_cell(r, m, arm))


# The short set is what stdout shows.
SHORT_COLUMNS: list[Column] = [
    ("row", lambda r, m: r.row.label),
    ("T", lambda r, m: str(r.row.num_tokens)),
    _arm_column("fused"),
    _arm_column("graph"),
    ("% copy", lambda r, m: _fraction_cell(m.copy_fraction)),
    _arm_column("stub"),
    ("stub % copy", lambda r, m: _stub_cell(r, _fraction_cell(m.stub_copy_fraction))),
    ("kernel/stub", _stub_ratio_cell),
    _ratio_column("unfused"),
    _ratio_column("compile"),
    ("targets", lambda r, m: _targets_cell(m)),
]
FULL_COLUMNS: list[Column] = [
    *SHORT_COLUMNS[:2],
    ("page", lambda r, m: str(r.row.page_size)),
    ("sets", lambda r, m: str(r.input_sets)),
    ("MB", lambda r, m: f"{r.bytes / 1e6:.3g}"),
    ("floor us", lambda r, m: format_us(m.floor_s)),
    *(_arm_column(arm) for arm in ARM_TITLES),
    ("GB/s", lambda r, m: "n/a" if m.gbps is None else f"{m.gbps:.0f}"),
    ("% copy", lambda r, m: _fraction_cell(m.copy_fraction)),
    ("stub % copy", lambda r, m: _stub_cell(r, _fraction_cell(m.stub_copy_fraction))),
    ("kernel/stub", _stub_ratio_cell),
    *(_ratio_column(arm) for arm in EAGER_RATIO_ARMS),
    ("host us (x add_)", _host_cell),
    ("targets", lambda r, m: _targets_cell(m)),
]


def markdown_table(results: list[RowResult], ceilings: Ceilings, columns: list[Column]) -> str:
    """A markdown table of ``columns``, one line per result."""
    cells = []
    for result in results:
        metrics = row_metrics(result, ceilings)
        cells.append([cell(result, metrics).replace("|", "/") for _, cell in columns])
    return "\n".join(markdown_grid([header for header, _ in columns], cells))


def markdown_grid(header: Sequence[str], rows: Iterable[Sequence[str]]) -> list[str]:
    """The lines of a markdown table: ``header``, the rule, then one line per row of cells."""
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return lines + ["| " + " | ".join(row) + " |" for row in rows]


def _csv_number(value: float | None, scale: float = 1.0, digits: int = 4) -> str:
    return "n/a" if value is None else f"{value * scale:.{digits}g}"


def csv_rows(results: list[RowResult], ceilings: Ceilings) -> list[dict[str, object]]:
    """One dict per row: raw numbers (us, bytes, GB/s, ratios), "n/a" for measured-but-failed or
    skipped arms, "" for arms that are not part of the row. Column names are those of the published
    CSVs (``tokens``, ``heads``, ``q_heads``: the rows' ``num_tokens``, ``num_heads``,
    ``q_head_padded``), in their order, with the no-quantizer arm's and the A/B's columns added."""
    rows = []
    for result in results:
        row, metrics = result.row, row_metrics(result, ceilings)
        record: dict[str, object] = {
            "entry": row.entry,
            "label": row.label,
            "tokens": row.num_tokens,
            "heads": row.num_heads,
            "q_heads": row.q_head_padded,
            "page_size": row.page_size,
            "compress_ratio": row.compress_ratio,
            "kv_rows_per_warp": row.kv_rows_per_warp,
            "slot_bytes": row.slot_bytes,
            "input_sets": result.input_sets,
            "calls_per_batch": result.calls_per_batch,
            "modelled_bytes": f"{result.bytes:.0f}",
            "floor_us": _csv_number(metrics.floor_s, 1e6),
        }
        for arm in ARM_TITLES:
            record[f"{arm}_us"] = _csv_number(result.seconds[arm], 1e6) if arm in result.seconds else ""
        for arm in EAGER_RATIO_ARMS:
            record[f"{arm}_ratio"] = "" if arm not in result.seconds else _csv_number(metrics.ratios.get(arm))
        host, stub = result.host_s is not None, "stub" in result.seconds
        record.update(
            {
                "achieved_GBps": _csv_number(metrics.gbps),
                "copy_fraction": _csv_number(metrics.copy_fraction, digits=3),
                "stub_copy_fraction": _csv_number(metrics.stub_copy_fraction, digits=3) if stub else "",
                "kernel_stub_ratio": _csv_number(metrics.stub_ratio) if stub else "",
                "copy_GBps": _csv_number(ceilings.copy_bytes_per_s, 1e-9),
                "compile_first_call_s": ""
                if result.compile_first_call_s is None
                else _csv_number(result.compile_first_call_s),
                "host_us": _csv_number(result.host_s, 1e6) if host else "",
                "host_ratio_add": _csv_number(metrics.host_ratio) if host else "",
                "add_host_us": _csv_number(ceilings.add_host_s, 1e6),
            }
        )
        for name in TARGET_TITLES:
            record[f"target_{name}"] = metrics.targets.get(name, "")
        record["notes"] = "; ".join(result.notes)
        rows.append(record)
    return rows


def write_csv(path: Path, results: list[RowResult], ceilings: Ceilings) -> None:
    """Writes :func:`csv_rows` with a header line."""
    rows = csv_rows(results, ceilings)
    write_dicts_csv(path, rows, list(rows[0]) if rows else ["entry"])


def write_dicts_csv(path: Path, rows: Sequence[Mapping[str, object]], columns: list[str]) -> None:
    """``rows`` as CSV with a header line of ``columns`` (keys outside ``columns`` are left out)."""
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=columns, extrasaction="ignore")
        writer.writeheader()
        writer.writerows(rows)


def write_suite(out: Path, stem: str, rows: Sequence[Mapping[str, object]], columns: list[str], markdown: str) -> None:
    """A suite's ``stem.csv`` (``rows`` under ``columns``) and ``stem.md`` in ``out`` (created when missing)."""
    out.mkdir(parents=True, exist_ok=True)
    write_dicts_csv(out / f"{stem}.csv", rows, columns)
    (out / f"{stem}.md").write_text(markdown)


def ceiling_lines(ceilings: Ceilings) -> list[str]:
    """The report's ceilings section."""
    copy = "n/a" if ceilings.copy_bytes_per_s is None else f"{ceilings.copy_bytes_per_s / 1e9:.0f} GB/s"
    lines = [
        f"- device copy bandwidth: **{copy}** (bytes read + written; median of `copy_` of a "
        f"{COPY_BYTES // 2**20} MiB tensor); the bandwidth floor of a row is its modelled bytes / this",
        f"- empty kernel launch: eager **{format_us(ceilings.launch_eager_s)} us**, graph-replayed "
        f"**{format_us(ceilings.launch_graph_s)} us** ({EMPTY_KERNEL_TITLE})",
        f"- host time of one torch `add_` launch on a 1-element tensor: **{format_us(ceilings.add_host_s)} us** "
        f"(median of {HOST_BATCHES} batches of {HOST_CALLS} calls)",
    ]
    return lines + [f"- note: {note}" for note in ceilings.notes]


def first_use_lines(first_use: FirstUse) -> list[str]:
    """The report's first-use section."""
    lines = [
        f"- first call of a fresh geometry (main 8->16, page 256, T=1) in a new process with an empty "
        f"disk cache: **{format_s(first_use.cold_first_call_s)}** (NVRTC compile + cubin write + module load "
        f"+ launch); `jit.compile_kernel` of the same kernel alone: {format_s(first_use.compile_kernel_s)}",
        f"- first call in a new process with the warm disk cache: **{format_s(first_use.warm_first_call_s)}** "
        f"(cubin read + hash check + module load + launch)",
        f"- `import cupy`, once per process and outside both times: {format_s(first_use.import_cupy_s)}",
    ]
    if first_use.error:
        lines.append(f"- error: {first_use.error}")
    return lines


def markdown_report(
    env: list[tuple[str, str]],
    run: list[tuple[str, str]],
    ceilings: Ceilings,
    first_use: FirstUse,
    results: list[RowResult],
    plot_name: str | None,
) -> str:
    """The whole report: environment, ceilings, first use, targets, the full table and notes.

    Parameters
    ----------
    env, run
        (name, value) lines of the environment table.
    ceilings, first_use, results
        What the run measured.
    plot_name
        The plot's file name next to the report, or None when there is no plot.
    """
    gpu = dict(env).get("GPU", "GPU")
    lines = [f"# nvfp4-mla benchmark: {gpu}", "", "## Environment", "", "| | |", "|---|---|"]
    lines += [f"| {k} | {v} |" for k, v in env + run]
    lines += ["", "## Ceilings (same run)", "", *ceiling_lines(ceilings)]
    lines += ["", "## First use", "", *first_use_lines(first_use)]
    lines += ["", "## Targets", "", "| target | verdict | detail |", "|---|---|---|"]
    lines += [f"| {t} | {v} | {d} |" for t, v, d in target_summary(results, ceilings, first_use)]
    lines += [
        "",
        "## Results",
        "",
        "Times are medians of per-call time over batches of back-to-back calls rotating over `sets` "
        "input sets (eager: torch.utils.benchmark, bounded by the host's launch rate at small T; graph: "
        "triton's do_bench_cudagraph, device time). Ratios are each arm's time / fused eager (above 1: "
        "fused is faster). `stub`: the same launch from kernels whose quantizer functions ("
        + ", ".join(f"`{name}`" for name in STUBS)
        + ") are trivial bit operations, graph-replayed; `kernel/stub` = graph / stub. "
        "`-`: not part of the row; `n/a`: see the notes.",
        "",
        markdown_table(results, ceilings, FULL_COLUMNS),
    ]
    notes = [f"- {r.row.label} T={r.row.num_tokens}: {note}" for r in results for note in r.notes]
    if notes:
        lines += ["", "Notes:", "", *notes]
    if plot_name:
        lines += ["", f"![time vs tokens, main entry 8->16 heads]({plot_name})"]
    return "\n".join(lines) + "\n"
