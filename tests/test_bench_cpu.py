"""The benchmark's CPU parts: grid, bytes model, arms' plumbing (with the reference as the library),
targets and the CSV / markdown / PNG writers. The timing itself needs a GPU and is not run here."""

from __future__ import annotations

import csv
import time

import pytest
import torch

from nvfp4_mla import bench, reference

# ---------------------------------------------------------------- grid and bytes model


def test_full_grid_holds_the_issue_rows():
    rows = set(bench.full_grid())
    for t in (1, 8, 64, 384, 4096, 16384):
        assert bench.Row("main", t, 8, 16) in rows and bench.Row("main", t, 8, 8) in rows
    for h in (64, 128):
        assert {bench.Row("main", t, h, h) for t in (1, 64, 4096)} <= rows
    for h in (8, 16, 64, 128):
        assert {bench.Row("inplace", t, h, h) for t in (1, 64, 4096)} <= rows
    assert {bench.Row("inplace", 16384, h, h) for h in (8, 16)} <= rows
    for r in (1, 2):
        assert {bench.Row("kv", t, page_size=128, ratio=r) for t in (1, 64, 4096, 16384)} <= rows
    assert {bench.Row("append", t, page_size=128) for t in (1, 64, 4096, 16384)} <= rows
    assert all(r.page_size == 256 for r in rows if r.entry in ("main", "inplace"))
    assert not any(r.tokens == 16384 and r.heads >= 64 for r in rows)  # memory stays modest
    assert len(rows) == len(bench.full_grid())  # no duplicates


def test_quick_grid_is_a_subset_and_measurement_order_serves_the_plot_first():
    assert set(bench.quick_grid()) <= set(bench.full_grid())
    rows = bench.full_grid()
    order = bench.measurement_order(rows)
    assert sorted(order) == list(range(len(rows)))
    first = [rows[i] for i in order[:6]]
    assert all(r.is_plot_row for r in first)
    assert [r.tokens for r in first] == [1, 4096, 64, 8, 384, 16384]


def test_bytes_model_main_entry_matches_the_smoke_run():
    # Smoke run on the H200: T=4096, 8 -> 16 heads, 34.3 us, 3135 GB/s modelled.
    row = bench.Row("main", 4096, 8, 16)
    expected = 4096 * (8 * 1024 + 16 * 1024 + 1024 + 384 + 256 + 8 + 8)
    assert bench.modelled_bytes(row) == expected
    assert expected / 34.3e-6 / 1e9 == pytest.approx(3135, rel=2e-3)


def test_bytes_model_other_entries():
    t = 64
    assert bench.modelled_bytes(bench.Row("inplace", t, 16, 16)) == t * (16 * 256 + 1024 + 384 + 256 + 8 + 8)
    assert bench.modelled_bytes(bench.Row("kv", t, page_size=128)) == t * (1024 + 384 + 256 + 8 + 8)
    # Ratio 2: only inserted rows read kv and cos/sin and write a record; every row reads its
    # position and slot.
    kv2 = bench.Row("kv", t, page_size=128, ratio=2)
    assert bench.modelled_bytes(kv2) == 32 * (1024 + 384 + 256) + t * 16
    assert bench.modelled_bytes(kv2, inserted_rows=30) == 30 * (1024 + 384 + 256) + t * 16
    assert bench.modelled_bytes(bench.Row("append", t, page_size=128)) == t * (1024 + 384 + 8)
    assert bench.modelled_bytes(bench.Row("append", t, page_size=128, slot_bytes=4)) == t * (1024 + 384 + 4)


def test_input_sets_rotate_only_when_a_set_fits_in_l2():
    l2 = 50 * 2**20
    assert bench.input_set_count(200e6, l2) == 1
    assert bench.input_set_count(10e6, l2) == 16  # 3 x 52.4 MB / 10 MB
    assert bench.input_set_count(1e3, l2) == bench.MAX_INPUT_SETS


# ---------------------------------------------------------------- arms on the CPU


def _small(row: bench.Row, **changes) -> bench.Row:
    return row._replace(**{"page_size": 16, **changes})


@pytest.mark.parametrize(
    "row",
    [
        bench.Row("main", 7, 5, 8),
        bench.Row("main", 5, 8, 8),
        bench.Row("inplace", 6, 8, 8),
        bench.Row("kv", 9, ratio=1),
        bench.Row("kv", 9, ratio=2),
        bench.Row("append", 4),
    ],
    ids=lambda r: f"{r.label} T={r.tokens}",
)
def test_arms_do_the_same_work_with_the_reference_library(row):
    torch.manual_seed(1)
    row = _small(row)
    cos_sin = bench.rope_table("cpu", max_position=4096)
    inputs = bench.make_inputs(row, "cpu", max_position=4096)
    pages = -(-row.tokens // row.page_size) + 1
    assert inputs.cache.shape == (pages, row.page_size, 384)
    assert len(set(inputs.slots.tolist())) == row.tokens and int(inputs.positions.max()) < 4096

    fused = bench.fused_call(row, reference, cos_sin)
    assert bench.same_outputs(fused, fused, inputs)
    unfused = bench.unfused_call(row, reference, cos_sin)
    if row.entry == "append":
        assert unfused is None
        return
    a, b = inputs.clone_written(), inputs.clone_written()
    out_a, out_b = fused(a), unfused(b)
    # torch_rope is plain fp32 (no fma): equal up to rare last-bit differences of the RoPE dims.
    if isinstance(out_a, torch.Tensor):
        assert out_a.shape == out_b.shape
        torch.testing.assert_close(out_a.float(), out_b.float(), atol=2e-2, rtol=1e-2)
    torch.testing.assert_close(
        reference.nvfp4_dequantize_sparse_mla_cache(a.cache), reference.nvfp4_dequantize_sparse_mla_cache(b.cache),
        atol=2e-2, rtol=1e-2, equal_nan=True,
    )
    written = (a.cache != 0).flatten(1).any(1).sum()
    assert written > 0


def test_inserted_rows_counts_the_ratio_test():
    row = bench.Row("kv", 10, page_size=16, ratio=2)
    inputs = bench.make_inputs(row, "cpu", max_position=64)
    inputs = inputs._replace(positions=torch.tensor([1, 3, 5, 0, 2, 4, 6, 8, 7, 9]))
    assert bench.inserted_rows(row, [inputs]) == 5.0
    assert bench.inserted_rows(bench.Row("kv", 10), [inputs]) == 10.0


def test_torch_rope_is_close_to_the_bit_exact_reference():
    torch.manual_seed(2)
    x = torch.randn(32, 64).to(torch.bfloat16)
    table = bench.rope_table("cpu", max_position=1000)[torch.randint(0, 1000, (32,))]
    cos, sin = table[:, :32], table[:, 32:]
    ours, exact = bench.torch_rope(x, cos, sin), reference.rope(x, cos, sin)
    torch.testing.assert_close(ours.float(), exact.float(), atol=1e-2, rtol=1e-2)
    assert (ours.view(torch.int16) == exact.view(torch.int16)).float().mean() > 0.99


# ---------------------------------------------------------------- targets and writers


def _fake_results():
    us = 1e-6
    main4096 = bench.RowResult(bench.Row("main", 4096, 8, 16), 107.5e6, 1, calls_per_batch=40,
                               seconds={"fused": 30 * us, "graph": 30.5 * us, "unfused": 120 * us, "compile": 900 * us})
    main1 = bench.RowResult(bench.Row("main", 1, 8, 16), 26256, 64, calls_per_batch=200,
                            seconds={"fused": 9 * us, "graph": 2.5 * us, "unfused": 80 * us, "compile": None},
                            host_s=12 * us, compile_first_call_s=31.0,
                            notes=["torch.compile(reference): n/a: BackendCompilerFailed: boom | x"])
    main64 = bench.RowResult(bench.Row("main", 64, 8, 16), 64 * 26256, 64, seconds={"fused": 8 * us, "graph": 3 * us,
                             "unfused": 90 * us, "compile": None}, notes=["torch.compile(reference): skipped: budget"])
    wide1 = bench.RowResult(bench.Row("main", 1, 128, 128), 1e5, 64, seconds={"fused": 10 * us, "graph": 2.9 * us,
                            "unfused": 50 * us}, host_s=14 * us)
    append = bench.RowResult(bench.Row("append", 16384, page_size=128), 23.3e6, 1, seconds={"fused": 7 * us, "graph": 6.5 * us})
    failed = bench.RowResult(bench.Row("kv", 64, page_size=128, ratio=2), 1e5, 0, notes=["row failed: OutOfMemoryError: x"])
    ceilings = bench.Ceilings(copy_bytes_per_s=4.3e12, launch_eager_s=2.1 * us, launch_graph_s=0.9 * us, add_host_s=6 * us)
    first_use = bench.FirstUse(cold_first_call_s=1.2, compile_variant_s=0.8, warm_first_call_s=0.07, import_cupy_s=0.3)
    return [main1, main64, main4096, wide1, append, failed], ceilings, first_use


def test_row_targets():
    (main1, main64, main4096, wide1, append, failed), ceilings, _ = _fake_results()
    m = bench.row_metrics(main4096, ceilings)
    assert m.copy_fraction == pytest.approx(107.5e6 / 30.5e-6 / 4.3e12)  # from the graph-replayed time
    assert m.targets == {"bandwidth": "MISS", "speedup": "PASS"}  # 82% of copy; 4x and 30x
    assert m.ratios["unfused"] == pytest.approx(4.0)
    m = bench.row_metrics(main1, ceilings)
    assert m.targets == {"latency": "MISS", "host": "PASS", "speedup": "PASS"}  # 2.5 us > 2.0; 2x add_
    assert m.host_ratio == pytest.approx(2.0) and "compile" not in m.ratios
    assert bench.row_metrics(wide1, ceilings).targets["latency"] == "PASS"  # 2.9 us <= 3.0 at 128 heads
    assert bench.row_metrics(append, ceilings).targets == {"bandwidth": "MISS"}  # 83%; no peers: no speedup target
    assert bench.row_metrics(failed, ceilings).targets == {}
    assert bench.latency_limit_us(bench.Row("inplace", 1, 16, 16)) == 2.0
    assert bench.latency_limit_us(bench.Row("main", 1, 64, 64)) == 3.0
    assert bench.speedup_needed(384) is None


def test_target_summary():
    results, ceilings, first_use = _fake_results()
    summary = {title.split(":")[0]: (verdict, detail) for title, verdict, detail in bench.target_summary(results, ceilings, first_use)}
    assert summary["T >= 4096"][0] == "MISS" and "main 8->16 T=4096" in summary["T >= 4096"][1]
    assert summary["T = 1"][0] == "MISS"
    assert summary["host time of one eager call <= 2.5x a torch add_ launch"][0] == "PASS"
    verdicts = [v for t, v, d in bench.target_summary(results, ceilings, first_use) if "first call" in t]
    assert verdicts == ["PASS", "MISS"]  # 1.2 s < 1.5 s; 70 ms >= 50 ms
    assert all(v == "n/a" for t, v, d in bench.target_summary(results, ceilings, bench.FirstUse(error="boom")) if "first call" in t)


def test_csv_writer(tmp_path):
    results, ceilings, _ = _fake_results()
    path = tmp_path / "bench.csv"
    bench.write_csv(path, results, ceilings)
    rows = list(csv.DictReader(path.open()))
    assert len(rows) == len(results)
    main1, main4096, append, failed = rows[0], rows[2], rows[4], rows[5]
    assert main1["fused_us"] == "9" and main1["compile_us"] == "n/a" and main1["compile_ratio"] == "n/a"
    assert float(main1["host_ratio_add"]) == pytest.approx(2.0) and main1["target_latency"] == "MISS"
    assert float(main4096["unfused_ratio"]) == pytest.approx(4.0) and main4096["target_bandwidth"] == "MISS"
    assert float(main4096["floor_us"]) == pytest.approx(107.5e6 / 4.3e12 * 1e6, rel=1e-3)
    assert append["unfused_us"] == "" and append["unfused_ratio"] == "" and append["host_us"] == ""
    assert failed["fused_us"] == "" and "OutOfMemoryError" in failed["notes"]
    assert main1["notes"].startswith("torch.compile(reference): n/a")


def test_markdown_report_and_short_table():
    results, ceilings, first_use = _fake_results()
    env = [("GPU", "NVIDIA H200 (sm_90)"), ("torch", "2.11.0 (CUDA 13.0)")]
    text = bench.markdown_report(env, [("run", "full grid")], ceilings, first_use, results, "bench_h200.png")
    assert text.startswith("# nvfp4-mla benchmark: NVIDIA H200 (sm_90)")
    assert text.index("## Environment") < text.index("| torch | 2.11.0 (CUDA 13.0) |") < text.index("## Results")
    assert "4300 GB/s" in text and "0.90 us" in text and "1.20 s" in text and "70.0 ms" in text
    assert "| MISS |" in text and "| PASS |" in text
    assert "- main 8->16 T=1: torch.compile(reference): n/a: BackendCompilerFailed: boom | x" in text.split("Notes:")[1]
    assert "![time vs tokens" in text
    table_lines = [line for line in text.splitlines() if line.startswith("| main 8->16 |")]
    assert len(table_lines) == 3 and all(line.count("|") == len(bench.FULL_COLUMNS) + 1 for line in table_lines)
    short = bench.markdown_table(results, ceilings, bench.SHORT_COLUMNS).splitlines()
    assert short[0].startswith("| row | T | fused us | graph us |") and len(short) == 2 + len(results)
    assert "| append | 16384 | 7.00 | 6.50 | 83% | - | - | bandwidth MISS |" in short


def test_plot_writer(tmp_path):
    pytest.importorskip("matplotlib")
    results, ceilings, _ = _fake_results()
    path = tmp_path / "bench.png"
    bench.write_plot(path, results, ceilings, "main entry, 8 heads padded to 16")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and path.stat().st_size > 10_000


# ---------------------------------------------------------------- command line


def test_help_runs_without_a_gpu(capsys):
    with pytest.raises(SystemExit) as exit_info:
        bench.main(["--help"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    assert "--quick" in out and "--out" in out and "--reps" in out and "--compile-budget" in out


def test_defaults():
    args = bench.parse_args([])
    assert (args.quick, str(args.out), args.reps, args.compile_budget) == (False, "docs", 15, bench.DEFAULT_COMPILE_BUDGET_S)
    args = bench.parse_args(["--quick", "--reps", "3"])
    assert (args.reps, args.compile_budget) == (3, 0.0)


@pytest.mark.skipif(torch.cuda.is_available(), reason="would run the benchmark")
def test_main_says_it_needs_a_gpu():
    with pytest.raises(SystemExit, match="needs a CUDA GPU"):
        bench.main(["--quick"])


# ---------------------------------------------------------------- the GPU code paths' plumbing


class _FakeEvent:
    def __init__(self, enable_timing=False):
        self.at = 0.0

    def record(self):
        self.at = time.perf_counter()

    def synchronize(self):
        pass

    def elapsed_time(self, end):
        return (end.at - self.at) * 1e3


class _FakeGraph:
    def replay(self):
        pass


class _FakeCapture:
    def __init__(self, graph):
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


@pytest.fixture
def fake_cuda(monkeypatch):
    """CUDA events, graphs and synchronisation as host no-ops, the reference as the fused
    library, and small batches: runs the measuring code paths on the CPU."""
    monkeypatch.setattr(torch.cuda, "Event", _FakeEvent)
    monkeypatch.setattr(torch.cuda, "CUDAGraph", _FakeGraph)
    monkeypatch.setattr(torch.cuda, "graph", _FakeCapture)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: None)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    monkeypatch.setattr(bench, "ops", reference)
    for name, value in (("MAX_INPUT_SETS", 2), ("TARGET_BATCH_S", 1e-9), ("HOST_CALLS", 2), ("HOST_BATCHES", 1), ("COPY_BYTES", 2**20)):
        monkeypatch.setattr(bench, name, value)


def test_run_grid_and_ceilings_with_fake_cuda(fake_cuda, monkeypatch, tmp_path):
    torch.manual_seed(3)
    monkeypatch.setattr(bench, "COMPILE_MAX_TOKENS", 4)
    rows = [bench.Row("main", 1, 8, 16), bench.Row("inplace", 4, 8, 8), bench.Row("kv", 5, page_size=128, ratio=2),
            bench.Row("append", 3, page_size=128)]
    ctx = bench.Context(torch.device("cpu"), bench.rope_table("cpu"), reps=1, l2_bytes=50 * 2**20, compile_budget_s=0)
    results = bench.run_grid(rows, ctx)
    assert [r.row for r in results] == rows
    main1, inplace, kv2, append = results
    assert set(main1.seconds) == {"fused", "graph", "unfused", "compile"} and main1.seconds["compile"] is None
    assert main1.notes == ["torch.compile(reference): skipped: --compile-budget 0"]
    assert main1.host_s is not None and main1.input_sets == 2 and main1.calls_per_batch >= 1
    assert all(main1.seconds[arm] is not None for arm in ("fused", "graph", "unfused"))
    assert inplace.host_s is None and set(append.seconds) == {"fused", "graph", "compile"}
    assert 5 * 16 <= kv2.bytes <= bench.modelled_bytes(kv2.row._replace(ratio=1))  # inserted rows counted
    assert "compile" not in kv2.seconds  # T above COMPILE_MAX_TOKENS: no compile arm

    ceilings = bench.measure_ceilings(torch.device("cpu"), reps=1)
    assert ceilings.copy_bytes_per_s > 0 and ceilings.add_host_s > 0
    assert ceilings.launch_eager_s is None and "empty-kernel launch n/a" in ceilings.notes[0]  # no CuPy GPU here

    env = [("GPU", "fake")]
    text = bench.markdown_report(env, [("run", "test")], ceilings, bench.FirstUse(error="no GPU"), results, None)
    assert "| main 8->16 | 1 |" in text and "skipped: --compile-budget 0" in text
    bench.write_csv(tmp_path / "b.csv", results, ceilings)
    pytest.importorskip("matplotlib")
    bench.write_plot(tmp_path / "b.png", results, ceilings, "fake")


def test_compile_budget_is_checked_before_compiling(fake_cuda):
    row = bench.Row("main", 1, 8, 16)
    ctx = bench.Context(torch.device("cpu"), bench.rope_table("cpu"), reps=1, l2_bytes=1, compile_budget_s=5, compile_spent_s=6)
    result = bench.measure_row(row, ctx)
    assert result.seconds["compile"] is None and result.notes == ["torch.compile(reference): skipped: compile budget of 5 s spent"]


@pytest.mark.skipif(torch.cuda.is_available(), reason="would compile on the GPU")
def test_first_use_probe_subprocess_reports_its_failure_without_a_gpu():
    first_use = bench.measure_first_use()
    assert first_use.cold_first_call_s is None and first_use.error.startswith("RuntimeError: cold probe exited with 1")
