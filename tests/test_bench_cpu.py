"""The benchmark's pieces on the CPU: grid, bytes model, inputs, arms (with the reference as the
library), the measuring loop with a stand-in timer, targets and the CSV / markdown / PNG writers.
Timing itself needs a GPU and is not run here."""

from __future__ import annotations

import csv
import dataclasses
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import nvfp4_mla.bench.decode as bench_decode
import nvfp4_mla.bench.reader as bench_reader
from nvfp4_mla import cli, gpu_unavailable_reason, reference
from nvfp4_mla.bench import arms, ceilings, decode_arms, decode_ragged, grid, inputs, probes, report, run, targets
from nvfp4_mla.bench.grid import Row
from nvfp4_mla.bench.plot import write_plot
from nvfp4_mla.bench.results import Ceilings, FirstUse, RowResult
from nvfp4_mla.bench.timing import rotation
from nvfp4_mla.testing import rope_table

DOCS = Path(__file__).resolve().parents[1] / "docs"
PUBLISHED_CSV = DOCS / "bench_h200.csv"
PUBLISHED_READER_MD = DOCS / "bench_reader_h200.md"
PUBLISHED_DECODE_MD = DOCS / "bench_decode_h200.md"
GPU_USABLE = gpu_unavailable_reason() is None

# ---------------------------------------------------------------- grid and bytes model


def test_named_rows_use_the_entries_arguments():
    assert Row.main(4, 8, 16) == Row("main", 4, num_heads=8, q_head_padded=16, page_size=256)
    assert Row.in_place(4, 8) == Row("inplace", 4, num_heads=8, q_head_padded=8, page_size=256)
    assert Row.kv(4, 2) == Row("kv", 4, page_size=128, compress_ratio=2)
    assert Row.append(4) == Row("append", 4, page_size=128)
    assert Row.pack(256) == Row("pack", 256, page_size=128)
    assert Row.append(4).slot_bytes == 8 and Row.append(4)._replace(slot_dtype=torch.int32).slot_bytes == 4
    labels = [Row.main(1, 8, 16).label, Row.in_place(1, 8).label, Row.kv(1, 2).label, Row.append(1).label]
    assert labels == ["main 8->16", "in place 8", "kv r2", "append"]
    assert Row.pack(256).label == "pack" and Row.pack(256).kv_rows_per_warp == 1 and Row.pack(256).ships
    ab = Row.kv(4, 1)._replace(kv_rows_per_warp=2)
    assert ab.label == "kv r1 (2 rows/warp)" and not ab.ships


def test_full_grid_holds_the_issue_rows():
    rows = set(grid.full_grid())
    for t in (1, 8, 64, 384, 4096, 16384):
        assert Row.main(t, 8, 16) in rows and Row.main(t, 8, 8) in rows
    for h in (64, 128):
        assert {Row.main(t, h, h) for t in (1, 64, 4096)} <= rows
    for h in (8, 16, 64, 128):
        assert {Row.in_place(t, h) for t in (1, 64, 4096)} <= rows
    assert {Row.in_place(16384, h) for h in (8, 16, 128)} <= rows  # the in-place target's heads
    for r in (1, 2):
        assert {Row.kv(t, r) for t in (1, 64, 4096, 16384, 65536)} <= rows
    assert Row.kv(262144, 1) in rows
    assert {Row.append(t) for t in (1, 64, 4096, 16384, 65536)} <= rows
    assert {Row.pack(t) for t in (4096, 16384, 65536)} <= rows
    # memory stays modest: no main rows with 64 or 128 heads at T = 16384, no in place 64 there
    assert not any(r.num_tokens == 16384 and r.num_heads >= 64 and r != Row.in_place(16384, 128) for r in rows)
    assert all(r.num_tokens % r.page_size == 0 for r in rows if r.entry == "pack")  # whole pages
    assert all(r.ships for r in rows)
    assert len(rows) == len(grid.full_grid())  # no duplicates


def test_quick_grid_holds_a_row_of_every_target():
    rows = grid.quick_grid()
    for title in targets.THRESHOLDS.values():
        assert any(title.applies(r) for r in rows), title
    assert {Row.kv(65536, 1), Row.append(65536), Row.pack(65536)} <= set(rows)


def test_select_rows_keeps_the_entries_and_repeats_the_kv_only_rows_per_count():
    rows = [Row.main(64, 8, 16), Row.in_place(64, 8), Row.kv(64, 2), Row.append(64), Row.pack(128)]
    assert grid.select_rows(rows, grid.ENTRIES, (1,)) == rows
    assert grid.select_rows(rows, ("kv", "main"), (1,)) == [Row.main(64, 8, 16), Row.kv(64, 2)]
    ab = grid.select_rows(rows, grid.ENTRIES, (1, 2, 4))
    assert ab[:2] == rows[:2]
    assert [(r.entry, r.kv_rows_per_warp) for r in ab[2:]] == [
        (entry, n) for entry in ("kv", "append", "pack") for n in (1, 2, 4)
    ]


def test_quick_grid_is_a_subset_and_measurement_order_serves_the_plot_first():
    assert set(grid.quick_grid()) <= set(grid.full_grid())
    rows = grid.full_grid()
    order = grid.measurement_order(rows)
    assert sorted(order) == list(range(len(rows)))
    first = [rows[i] for i in order[:6]]
    assert all(r.is_plot_row for r in first)
    assert [r.num_tokens for r in first] == [1, 4096, 64, 8, 384, 16384]
    tiers = [grid.TOKEN_PRIORITY.index(rows[i].num_tokens) for i in order[6:]]
    assert tiers == sorted(tiers)


def test_bytes_model_main_entry_matches_the_smoke_run():
    # Smoke run on the H200: T=4096, 8 -> 16 heads, 34.3 us, 3135 GB/s modelled.
    expected = 4096 * (8 * 1024 + 16 * 1024 + 1024 + 384 + 256 + 8 + 8)
    assert grid.modelled_bytes(Row.main(4096, 8, 16)) == expected
    assert expected / 34.3e-6 / 1e9 == pytest.approx(3135, rel=2e-3)


def test_bytes_model_other_entries():
    t = 64
    assert grid.modelled_bytes(Row.in_place(t, 16)) == t * (16 * 256 + 1024 + 384 + 256 + 8 + 8)
    assert grid.modelled_bytes(Row.kv(t, 1)) == t * (1024 + 384 + 256 + 8 + 8)
    # Ratio 2: only inserted rows read kv and cos/sin and write a record; every row reads its
    # position and slot.
    assert grid.modelled_bytes(Row.kv(t, 2)) == 32 * (1024 + 384 + 256) + t * 16
    assert grid.modelled_bytes(Row.kv(t, 2), inserted_rows=30) == 30 * (1024 + 384 + 256) + t * 16
    assert grid.modelled_bytes(Row.append(t)) == t * (1024 + 384 + 8)
    assert grid.modelled_bytes(Row.append(t)._replace(slot_dtype=torch.int32)) == t * (1024 + 384 + 4)
    assert grid.modelled_bytes(Row.pack(256)) == 256 * (1024 + 384)  # whole pages: no slots
    with pytest.raises(ValueError, match="unknown entry"):
        grid.modelled_bytes(Row("gather", t))


def test_input_sets_rotate_only_when_a_set_fits_in_l2():
    l2 = 50 * 2**20
    assert grid.input_set_count(200e6, l2) == 1
    assert grid.input_set_count(10e6, l2) == 16  # 3 x 52.4 MB / 10 MB
    assert grid.input_set_count(1e3, l2) == grid.MAX_INPUT_SETS


# ---------------------------------------------------------------- inputs


@pytest.mark.parametrize(
    "row",
    [Row.main(7, 5, 8), Row.in_place(6, 8), Row.kv(9, 2), Row.append(40)._replace(slot_dtype=torch.int32)],
    ids=lambda r: f"{r.label} T={r.num_tokens}",
)
def test_inputs_fit_the_row(row, seed):
    row = row._replace(page_size=16)
    x = inputs.make_inputs(row, "cpu", max_position=100)
    num_pages = -(-row.num_tokens // 16) + 1
    assert x.cache.shape == (num_pages, 16, 384) and not x.cache.any()
    assert x.kv.shape == (row.num_tokens, 512) and x.kv.dtype == torch.bfloat16
    assert (x.q is None) == (row.num_heads == 0)
    if x.q is not None:
        assert x.q.shape == (row.num_tokens, row.num_heads, 512) and x.q.dtype == torch.bfloat16
    assert x.slot_mapping.dtype == row.slot_dtype
    slots = x.slot_mapping.tolist()
    assert len(set(slots)) == row.num_tokens and min(slots) >= 0 and max(slots) < num_pages * 16
    assert int(x.positions.min()) >= 0 and int(x.positions.max()) < 100


def test_clone_written_copies_only_what_an_entry_writes(seed):
    x = inputs.make_inputs(Row.in_place(3, 8)._replace(page_size=16), "cpu")
    copy = x.clone_written()
    assert copy.q is not None and x.q is not None
    assert copy.cache.data_ptr() != x.cache.data_ptr() and copy.q.data_ptr() != x.q.data_ptr()
    assert copy.kv is x.kv and copy.slot_mapping is x.slot_mapping and copy.positions is x.positions


def test_inserted_rows_counts_the_ratio_test(seed):
    row = Row.kv(10, 2)._replace(page_size=16)
    x = inputs.make_inputs(row, "cpu", max_position=64)._replace(positions=torch.tensor([1, 3, 5, 0, 2, 4, 6, 8, 7, 9]))
    assert inputs.inserted_rows(row, [x]) == 5.0  # positions 1, 3, 5, 7, 9
    assert inputs.inserted_rows(row, [x, x._replace(positions=torch.arange(10))]) == 5.0
    assert inputs.inserted_rows(Row.kv(10, 1), [x]) == 10.0


# ---------------------------------------------------------------- arms on the CPU

ARM_ROWS = [
    Row.main(7, 5, 8), Row.main(5, 8, 8), Row.in_place(6, 8), Row.kv(9, 1), Row.kv(9, 2), Row.append(4), Row.pack(32)
]  # fmt: skip


def _row_inputs(row: Row) -> tuple[Row, inputs.Inputs, torch.Tensor]:
    row = row._replace(page_size=16)
    x = inputs.make_inputs(row, "cpu", max_position=4096)
    x.positions[0] = 1  # with ratio 2, at least row 0 is inserted
    return row, x, rope_table(4096)


def _entry_call(row: Row, cos_sin: torch.Tensor) -> arms.Call:
    """The row's reference entry called with its arguments spelled out."""
    if row.entry == "main":

        def main(x: inputs.Inputs) -> object:
            assert x.q is not None  # rows with heads
            return reference.cake_dsv4_nvfp4_rope_quantize_insert(
                x.q, x.kv, x.cache, x.slot_mapping, x.positions, cos_sin, q_head_padded=row.q_head_padded
            )

        return main
    if row.entry == "inplace":

        def inplace(x: inputs.Inputs) -> object:
            assert x.q is not None  # rows with heads
            return reference.cake_dsv4_nvfp4_rope_quantize_insert(
                x.q, x.kv, x.cache, x.slot_mapping, x.positions, cos_sin, q_head_padded=row.num_heads, q_inplace=True
            )

        return inplace
    if row.entry == "kv":
        return lambda x: reference.cake_dsv4_nvfp4_kv_rope_quantize_insert(
            x.kv, x.cache, x.slot_mapping, x.positions, cos_sin, compress_ratio=row.compress_ratio
        )
    if row.entry == "pack":
        return lambda x: reference.nvfp4_quantize_pack_sparse_mla_cache(x.kv.reshape(-1, 16, 512))
    return lambda x: reference.nvfp4_quantize_append_sparse_mla_cache(x.kv, x.slot_mapping, x.cache)


@pytest.mark.parametrize("row", ARM_ROWS, ids=lambda r: f"{r.label} T={r.num_tokens}")
def test_fused_arm_is_the_rows_entry(row, seed):
    row, x, cos_sin = _row_inputs(row)
    fused = arms.fused_call(row, reference, cos_sin)
    assert arms.same_outputs(fused, _entry_call(row, cos_sin), x)
    written = x.clone_written()
    out = fused(written)
    if row.entry == "pack":  # a new cache of every row
        assert isinstance(out, torch.Tensor) and out.shape == (row.num_tokens // 16, 1, 16, 384)
        return
    assert written.cache.flatten(1).any(1).sum() > 0  # the comparison above saw written records
    if row.entry == "main":
        assert isinstance(out, torch.Tensor) and out.shape == (row.num_tokens, row.q_head_padded, 512)
        assert not out[:, row.num_heads :].any()


def _flip_after(call: arms.Call, where: str) -> arms.Call:
    """``call``, then one bit flipped in the cache, in q or in the returned q_out."""

    def flipped(x: inputs.Inputs) -> object:
        out = call(x)
        target = {"cache": x.cache, "q": x.q, "q_out": out}[where]
        assert isinstance(target, torch.Tensor)
        target.view(torch.uint8).view(-1)[-1] ^= 1
        return out

    return flipped


@pytest.mark.parametrize(
    ("row", "where"),
    [(Row.main(3, 8, 16), "cache"), (Row.main(3, 8, 16), "q_out"), (Row.in_place(3, 8), "q"), (Row.append(3), "cache")],
    ids=lambda v: v if isinstance(v, str) else v.label,
)
def test_same_outputs_sees_one_flipped_bit(row, where, seed):
    row, x, cos_sin = _row_inputs(row)
    fused = arms.fused_call(row, reference, cos_sin)
    assert not arms.same_outputs(fused, _flip_after(fused, where), x)
    assert not arms.same_outputs(_flip_after(fused, where), fused, x)


@pytest.mark.parametrize("row", ARM_ROWS, ids=lambda r: f"{r.label} T={r.num_tokens}")
def test_unfused_arm_does_the_same_work(row, seed):
    row, x, cos_sin = _row_inputs(row)
    unfused = arms.unfused_call(row, reference, cos_sin)
    if row.entry in ("append", "pack"):
        assert unfused is None
        return
    assert unfused is not None
    a, b = x.clone_written(), x.clone_written()
    out_a, out_b = arms.fused_call(row, reference, cos_sin)(a), unfused(b)
    # torch_rope is plain fp32 (no fma): equal up to rare last-bit differences of the RoPE dims.
    if isinstance(out_a, torch.Tensor):
        assert isinstance(out_b, torch.Tensor) and out_a.shape == out_b.shape
        torch.testing.assert_close(out_a.float(), out_b.float(), atol=2e-2, rtol=1e-2)
    assert torch.equal(a.cache.flatten(1).any(1), b.cache.flatten(1).any(1))  # the same records written
    torch.testing.assert_close(
        reference.nvfp4_dequantize_sparse_mla_cache(a.cache),
        reference.nvfp4_dequantize_sparse_mla_cache(b.cache),
        atol=2e-2,
        rtol=1e-2,
        equal_nan=True,
    )


def test_torch_rope_is_close_to_the_bit_exact_reference(seed):
    x = torch.randn(32, 64).to(torch.bfloat16)
    table = rope_table(1000)[torch.randint(0, 1000, (32,))]
    cos, sin = table[:, :32], table[:, 32:]
    ours, exact = arms.torch_rope(x, cos, sin), reference.rope(x, cos, sin)
    torch.testing.assert_close(ours.float(), exact.float(), atol=1e-2, rtol=1e-2)
    assert (ours.view(torch.int16) == exact.view(torch.int16)).float().mean() > 0.99


def test_rotation_takes_the_sets_in_turn():
    seen: list[int] = []
    call = rotation(seen.append, [0, 1, 2])
    for _ in range(7):
        call()
    assert seen == [0, 1, 2, 0, 1, 2, 0]


# ---------------------------------------------------------------- the measuring loop, a stand-in timer

EAGER_S, GRAPH_S, HOST_S, CALLS = 10e-6, 2e-6, 5e-6, 7
L2_BYTES = 350_000  # main 8->16 at T = 1 rotates 40 input sets


class StandInTimer:
    """Runs each call once (so the arms' plumbing runs) and returns fixed times; ``fail`` names the
    methods that raise instead."""

    def __init__(self, fail: tuple[str, ...] = ()):
        self.fail = fail

    def _run(self, method: str, call, x) -> None:
        if method in self.fail:
            raise RuntimeError(f"{method} broke")
        call(x)

    def eager(self, call, sets):
        self._run("eager", call, sets[0])
        return EAGER_S, CALLS

    def graph(self, call, sets):
        self._run("graph", call, sets[0])
        return GRAPH_S

    def host(self, call, x):
        self._run("host", call, x)
        return HOST_S


def _context(timer=None, compile_budget_s: float = 0.0, compile_spent_s: float = 0.0, libraries=None) -> run.Context:
    """The reference as every library (default), on the CPU."""
    cos_sin = rope_table(grid.MAX_POSITION)
    timer = timer or StandInTimer()
    libraries = libraries or (lambda kv_rows_per_warp, stubbed: reference)
    return run.Context(torch.device("cpu"), cos_sin, timer, L2_BYTES, compile_budget_s, libraries, compile_spent_s)


def test_run_grid_measures_every_arm_of_every_row(monkeypatch, seed):
    monkeypatch.setattr(run, "COMPILE_MAX_TOKENS", 4)
    rows = [Row.main(1, 8, 16), Row.in_place(4, 8), Row.kv(5, 2), Row.append(3), Row.pack(2)._replace(page_size=1)]
    results = run.run_grid(rows, _context())
    assert [r.row for r in results] == rows  # grid order, whatever the measuring order
    main1, in_place, kv2, append, pack = results
    assert main1.seconds == {"fused": EAGER_S, "graph": GRAPH_S, "stub": GRAPH_S, "unfused": EAGER_S, "compile": None}
    assert main1.notes == ["torch.compile(reference): skipped: --compile-budget 0"]
    assert main1.host_s == HOST_S and main1.calls_per_batch == CALLS  # host time at T = 1 only
    assert main1.input_sets == grid.input_set_count(grid.modelled_bytes(rows[0]), L2_BYTES) == 40
    assert in_place.host_s is None and set(in_place.seconds) == {"fused", "graph", "stub", "unfused", "compile"}
    assert set(append.seconds) == set(pack.seconds) == {"fused", "graph", "stub", "compile"}  # no unfused arm
    assert pack.bytes == 2 * (1024 + 384) and pack.notes == main1.notes  # the compile arm's skip only
    assert "compile" not in kv2.seconds  # T above COMPILE_MAX_TOKENS
    inserted = (kv2.bytes - 5 * 16) / (1024 + 384 + 256)  # every row reads position and slot
    assert inserted == pytest.approx(round(inserted * kv2.input_sets) / kv2.input_sets) and 0 <= inserted <= 5


def test_a_failed_arm_is_noted_and_the_others_still_run(seed):
    result = run.measure_row(Row.main(1, 8, 16), _context(StandInTimer(fail=("graph", "host"))))
    assert result.seconds["graph"] is None and result.seconds["unfused"] == EAGER_S
    assert result.notes[0] == "fused, CUDA graph: n/a: RuntimeError: graph broke"
    assert result.notes[-1] == "host time: n/a: RuntimeError: host broke" and result.host_s is None
    result = run.measure_row(Row.main(1, 8, 16), _context(StandInTimer(fail=("eager",))))
    assert result.seconds == {"fused": None}  # nothing else is timed without the fused arm


def test_a_failed_row_keeps_the_others(seed):
    broken = Row.append(3)._replace(page_size=0)
    results = run.run_grid([broken, Row.append(3)], _context())
    assert results[0].input_sets == 0 and results[0].notes[0].startswith("row failed: ZeroDivisionError")
    assert results[1].seconds["fused"] == EAGER_S


def test_compile_budget_is_checked_before_compiling(seed):
    ctx = _context(compile_budget_s=5, compile_spent_s=6)
    result = run.measure_row(Row.main(1, 8, 16), ctx)
    assert result.seconds["compile"] is None and result.compile_first_call_s is None
    assert result.notes == ["torch.compile(reference): skipped: compile budget of 5 s spent"]


class _CorruptingReference:
    """The reference entries, with one bit of every written cache flipped."""

    def __getattr__(self, name):
        entry = getattr(reference, name)

        def call(*args, **kwargs):
            out = entry(*args, **kwargs)
            cache = next(a for a in args if isinstance(a, torch.Tensor) and a.dtype == torch.uint8)
            cache.view(-1)[0] ^= 1
            return out

        return call


@pytest.mark.parametrize("agree", [True, False])
def test_compile_arm_counts_its_compile_and_checks_the_bytes(monkeypatch, agree, seed):
    monkeypatch.setattr(run, "compiled_reference", lambda: reference if agree else _CorruptingReference())
    ctx = _context(compile_budget_s=60, compile_spent_s=1.0)
    result = run.measure_row(Row.kv(3, 1), ctx)
    assert result.seconds["compile"] == EAGER_S
    assert result.compile_first_call_s is not None and ctx.compile_spent_s == 1.0 + result.compile_first_call_s
    differ = "torch.compile(reference) wrote different bytes from the fused kernel"
    assert (differ in result.notes) == (not agree)


@pytest.mark.skipif(GPU_USABLE, reason="the empty kernel would launch")
def test_ceilings_from_the_timer_without_a_gpu():
    found = ceilings.measure_ceilings(torch.device("cpu"), StandInTimer(), copy_bytes=2**20)
    assert found.copy_bytes_per_s == 2 * 2**20 / EAGER_S and found.add_host_s == HOST_S
    assert found.launch_eager_s is None and found.launch_graph_s is None
    assert len(found.notes) == 1 and found.notes[0].startswith("empty-kernel launch n/a: ")


# ---------------------------------------------------------------- targets and writers


def _fake_results() -> tuple[list[RowResult], Ceilings, FirstUse]:
    us = 1e-6
    main4096 = RowResult(
        Row.main(4096, 8, 16), 107.5e6, 1, calls_per_batch=40,
        seconds={"fused": 30 * us, "graph": 30.5 * us, "stub": 25 * us, "unfused": 120 * us, "compile": 900 * us},
    )  # fmt: skip
    main1 = RowResult(
        Row.main(1, 8, 16), 26256, 64, calls_per_batch=200,
        seconds={"fused": 9 * us, "graph": 2.5 * us, "stub": None, "unfused": 80 * us, "compile": None},
        host_s=12 * us, compile_first_call_s=31.0,
        notes=["torch.compile(reference): n/a: BackendCompilerFailed: boom | x"],
    )  # fmt: skip
    main64 = RowResult(
        Row.main(64, 8, 16), 64 * 26256, 64,
        seconds={"fused": 8 * us, "graph": 3 * us, "unfused": 90 * us, "compile": None},
        notes=["torch.compile(reference): skipped: budget"],
    )  # fmt: skip
    wide1 = RowResult(
        Row.main(1, 128, 128), 1e5, 64,
        seconds={"fused": 10 * us, "graph": 2.9 * us, "unfused": 50 * us}, host_s=14 * us,
    )  # fmt: skip
    append = RowResult(Row.append(16384), 23.3e6, 1, seconds={"fused": 7 * us, "graph": 6.5 * us})
    failed = RowResult(Row.kv(64, 2), 1e5, 0, notes=["row failed: OutOfMemoryError: x"])
    # 86 MB at 4.3 TB/s is 20 us: kernel 25 us (80%), stub 23 us (87%), kernel / stub 1.087
    kv = RowResult(Row.kv(65536, 1), 86e6, 1, seconds={"fused": 26 * us, "graph": 25 * us, "stub": 23 * us})
    # the A/B's other kernels: every target misses, but the summary does not judge them
    kv_ab = RowResult(
        Row.kv(65536, 1)._replace(kv_rows_per_warp=2), 86e6, 1,
        seconds={"fused": 41 * us, "graph": 40 * us, "stub": 20 * us},
    )  # fmt: skip
    found = Ceilings(copy_bytes_per_s=4.3e12, launch_eager_s=2.1 * us, launch_graph_s=0.9 * us, add_host_s=6 * us)
    first_use = FirstUse(cold_first_call_s=1.2, compile_kernel_s=0.8, warm_first_call_s=0.07, import_cupy_s=0.3)
    return [main1, main64, main4096, wide1, append, failed, kv, kv_ab], found, first_use


def test_row_targets():
    (main1, _, main4096, wide1, append, failed, kv, kv_ab), found, _ = _fake_results()
    m = targets.row_metrics(main4096, found)
    assert m.copy_fraction == pytest.approx(107.5e6 / 30.5e-6 / 4.3e12)  # from the graph-replayed time
    assert m.targets == {"bandwidth": "MISS", "speedup": "PASS", "main_copy": "MISS"}  # 82% of copy; 4x and 30x
    assert m.ratios == pytest.approx({"graph": 30.5 / 30, "unfused": 4.0, "compile": 30.0})  # no stub / eager
    assert m.stub_ratio == pytest.approx(30.5 / 25) and m.stub_copy_fraction == pytest.approx(107.5e6 / 25e-6 / 4.3e12)
    m = targets.row_metrics(main1, found)
    # 2.5 us > 2.0 and > 1.8; 2x add_
    assert m.targets == {"latency": "MISS", "host": "PASS", "speedup": "PASS", "latency_every_entry": "MISS"}
    assert m.host_ratio == pytest.approx(2.0) and "compile" not in m.ratios
    assert m.stub_ratio is None and m.stub_copy_fraction is None  # the stub arm failed
    wide = targets.row_metrics(wide1, found).targets
    assert (wide["latency"], wide["latency_every_entry"]) == ("PASS", "MISS")  # 2.9 us: <= 3.0 at 128 heads, > 1.8
    assert targets.row_metrics(append, found).targets == {"bandwidth": "MISS"}  # 83%; no peers: no speedup
    assert targets.row_metrics(failed, found).targets == {}
    m = targets.row_metrics(kv, found)
    assert m.copy_fraction == pytest.approx(0.8) and m.stub_copy_fraction == pytest.approx(86 / 23 / 4.3)
    assert m.stub_ratio == pytest.approx(25 / 23)
    assert m.targets == {"bandwidth": "MISS", "kv_copy": "PASS", "stub_ratio": "PASS"}  # 80% < 85%; >= 80%; 1.09
    # A slower stub improves kernel / stub, never the primary (% of copy) verdicts.
    slower = targets.row_metrics(dataclasses.replace(kv, seconds={**kv.seconds, "stub": 50e-6}), found)
    assert slower.copy_fraction == m.copy_fraction and slower.targets == m.targets
    assert targets.row_metrics(kv_ab, found).targets == {"bandwidth": "MISS", "kv_copy": "MISS", "stub_ratio": "MISS"}
    assert targets.latency_limit_us(Row.in_place(1, 16)) == 2.0
    assert targets.latency_limit_us(Row.main(1, 64, 64)) == 3.0
    assert targets.speedup_needed(384) is None


def test_target_summary():
    results, found, first_use = _fake_results()
    lines = targets.target_summary(results, found, first_use)
    summary = {title.split(":")[0]: (verdict, detail) for title, verdict, detail in lines}
    assert summary["T >= 4096"][0] == "MISS" and "main 8->16 T=4096" in summary["T >= 4096"][1]
    assert summary["T = 1"][0] == "MISS"
    assert summary["host time of one eager call <= 2.5x a torch add_ launch"] == ("PASS", "2 of 2 rows pass")
    # the A/B's row (2 KV rows a warp) is not judged: the shipped kv row passes alone
    assert summary["KV ratio 1 and 2, append, pack at T >= 65536"] == ("PASS", "1 of 1 rows pass")
    assert summary["T >= 65536, every entry"] == ("PASS", "1 of 1 rows pass")
    assert summary["main 8->8 and 8->16 at T = 4096"] == ("MISS", "0 of 1 rows pass; missed: main 8->16 T=4096")
    assert summary["T = 1, every entry"] == ("MISS", "0 of 2 rows pass; missed: main 8->16 T=1, main 128->128 T=1")
    assert summary["in place with 8, 16 or 128 heads at T >= 16384"][0] == "n/a"  # no such row
    titles = [title for title, _, _ in lines]
    assert titles.index(targets.TARGET_TITLES["kv_copy"]) < titles.index(targets.TARGET_TITLES["stub_ratio"])
    assert [v for t, v, _ in lines if "first call" in t] == ["PASS", "MISS"]  # 1.2 s < 1.5 s; 70 ms >= 50 ms
    failed = targets.target_summary(results, found, FirstUse(error="boom"))
    assert all(v == "n/a" and d == "n/a (boom)" for t, v, d in failed if "first call" in t)


def test_csv_columns_keep_the_published_ones_in_order(tmp_path):
    results, found, _ = _fake_results()
    path = tmp_path / "bench.csv"
    report.write_csv(path, results, found)
    with path.open() as f, PUBLISHED_CSV.open() as published:
        header, published_header = next(csv.reader(f)), next(csv.reader(published))
    assert header == published_header


def test_csv_values(tmp_path):
    results, found, _ = _fake_results()
    path = tmp_path / "bench.csv"
    report.write_csv(path, results, found)
    with path.open() as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == len(results)
    main1, main4096, wide1, append, failed = rows[0], rows[2], rows[3], rows[4], rows[5]
    assert (main1["tokens"], main1["heads"], main1["q_heads"], main1["slot_bytes"]) == ("1", "8", "16", "8")
    assert (wide1["heads"], wide1["q_heads"]) == ("128", "128")
    assert (append["page_size"], failed["compress_ratio"]) == ("128", "2")
    assert main1["fused_us"] == "9" and main1["compile_us"] == "n/a" and main1["compile_ratio"] == "n/a"
    assert float(main1["host_ratio_add"]) == pytest.approx(2.0) and main1["target_latency"] == "MISS"
    assert float(main4096["unfused_ratio"]) == pytest.approx(4.0) and main4096["target_bandwidth"] == "MISS"
    assert float(main4096["floor_us"]) == pytest.approx(107.5e6 / 4.3e12 * 1e6, rel=1e-3)
    assert append["unfused_us"] == "" and append["unfused_ratio"] == "" and append["host_us"] == ""
    assert failed["fused_us"] == "" and "OutOfMemoryError" in failed["notes"]
    assert main1["notes"].startswith("torch.compile(reference): n/a")
    # the no-quantizer arm: failed (n/a), not part of the row (""), measured
    assert (main1["stub_us"], main1["kernel_stub_ratio"], main1["stub_copy_fraction"]) == ("n/a", "n/a", "n/a")
    assert (append["stub_us"], append["kernel_stub_ratio"], append["stub_copy_fraction"]) == ("", "", "")
    assert main4096["stub_us"] == "25" and float(main4096["kernel_stub_ratio"]) == pytest.approx(1.22)
    assert float(main4096["stub_copy_fraction"]) == pytest.approx(1.0)  # 107.5 MB / 25 us / 4.3 TB/s
    kv, kv_ab = rows[6], rows[7]
    assert (kv["kv_rows_per_warp"], kv_ab["kv_rows_per_warp"], kv_ab["label"]) == ("1", "2", "kv r1 (2 rows/warp)")
    assert (kv["target_kv_copy"], kv["target_stub_ratio"], kv["target_main_copy"]) == ("PASS", "PASS", "")
    assert float(kv["copy_fraction"]) == pytest.approx(0.8) and float(kv["kernel_stub_ratio"]) == pytest.approx(1.087)


def test_markdown_report_and_short_table():
    results, found, first_use = _fake_results()
    env = [("GPU", "NVIDIA H200 (sm_90)"), ("torch", "2.11.0 (CUDA 13.0)")]
    text = report.markdown_report(env, [("run", "full grid")], found, first_use, results, "bench.png")
    assert text.startswith("# nvfp4-mla benchmark: NVIDIA H200 (sm_90)")
    assert text.index("## Environment") < text.index("| torch | 2.11.0 (CUDA 13.0) |") < text.index("## Results")
    assert "4300 GB/s" in text and "0.90 us" in text and "1.20 s" in text and "70.0 ms" in text
    assert "| MISS |" in text and "| PASS |" in text
    assert "- main 8->16 T=1: torch.compile(reference): n/a: BackendCompilerFailed: boom | x" in text.split("Notes:")[1]
    assert "![time vs tokens, main entry 8->16 heads](bench.png)" in text
    table_lines = [line for line in text.splitlines() if line.startswith("| main 8->16 |")]
    assert len(table_lines) == 3 and all(line.count("|") == len(report.FULL_COLUMNS) + 1 for line in table_lines)
    short = report.markdown_table(results, found, report.SHORT_COLUMNS).splitlines()
    assert short[0] == (
        "| row | T | fused us | graph us | % copy | stub us | stub % copy | kernel/stub | unfused | compile | targets |"
    )
    assert len(short) == 2 + len(results)
    assert "| append | 16384 | 7.00 | 6.50 | 83% | - | - | - | - | - | bandwidth MISS |" in short
    kv_line = "| kv r1 | 65536 | 26.0 | 25.0 | 80% | 23.0 | 87% | 1.09 | - | - |"
    assert f"{kv_line} bandwidth MISS, kv_copy PASS, stub_ratio PASS |" in short
    assert short[2].startswith("| main 8->16 | 1 | 9.00 | 2.50 | 0% | n/a | n/a | n/a | 8.89x | n/a |")
    assert "`group_amax`, `scale_code`, `group_codes`" in text
    assert "![" not in report.markdown_report(env, [], found, first_use, results, None)


def test_plot_writer(tmp_path):
    pytest.importorskip("matplotlib")
    results, found, _ = _fake_results()
    path = tmp_path / "bench.png"
    write_plot(path, results, found, "main entry, 8 heads padded to 16")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and path.stat().st_size > 10_000


def test_write_outputs_names_the_plot_in_the_report(tmp_path):
    results, found, _ = _fake_results()
    seen: list[str | None] = []

    def markdown(plot_name):
        seen.append(plot_name)
        return "report\n"

    run.write_outputs(tmp_path / "new" / "dir", results, found, markdown, "test GPU")
    written = sorted(p.name for p in (tmp_path / "new" / "dir").iterdir())
    has_plot = seen == ["bench.png"]
    assert has_plot or seen == [None]
    assert written == (["bench.csv", "bench.md", "bench.png"] if has_plot else ["bench.csv", "bench.md"])
    assert (tmp_path / "new" / "dir" / "bench.md").read_text() == "report\n"


# ---------------------------------------------------------------- command line and probes


def test_help_shows_the_command(capsys):
    with pytest.raises(SystemExit) as exit_info:
        run.main(["--help"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: nvfp4-mla bench ")
    assert all(option in out for option in ("--quick", "--out", "--reps", "--compile-budget"))


def test_defaults():
    args = run.parse_args([])
    assert (args.quick, args.out, args.reps, args.compile_budget) == (False, None, 15, run.DEFAULT_COMPILE_BUDGET_S)
    args = run.parse_args(["--quick", "--reps", "3", "--out", "x"])
    assert (args.reps, args.compile_budget, args.out) == (3, 0.0, Path("x"))
    with pytest.raises(SystemExit):
        run.parse_args(["--reps", "0"])


def test_results_go_to_a_folder_named_after_the_gpu():
    assert probes.gpu_slug("NVIDIA H200") == "nvidia-h200"
    assert probes.gpu_slug("NVIDIA GeForce RTX 4090 (24 GB)") == "nvidia-geforce-rtx-4090-24-gb"
    assert probes.gpu_slug("???") == "gpu"
    assert run.results_dir(None, "NVIDIA H200") == Path("bench-results/nvidia-h200")
    assert run.results_dir(Path("docs"), "NVIDIA H200") == Path("docs")


def test_the_commit_line_marks_an_uncommitted_tree(tmp_path):
    def git(*args: str) -> None:
        subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", "-C", str(tmp_path), *args], check=True)

    assert probes.git_commit(tmp_path) == "not a git checkout"
    git("init", "-q")
    (tmp_path / "kernel.cu").write_text("v1")
    git("add", "kernel.cu")
    git("commit", "-q", "-m", "v1")
    head = probes.git_commit(tmp_path)
    assert len(head) >= 7 and all(c in "0123456789abcdef" for c in head)
    (tmp_path / "notes.txt").write_text("untracked files do not count")
    assert probes.git_commit(tmp_path) == head
    (tmp_path / "kernel.cu").write_text("v2")
    assert probes.git_commit(tmp_path) == f"{head} with uncommitted changes"


@pytest.mark.skipif(GPU_USABLE, reason="would run the benchmark")
def test_main_says_it_needs_a_gpu():
    with pytest.raises(SystemExit, match="needs a CUDA GPU"):
        run.main(["--quick"])


@pytest.mark.skipif(GPU_USABLE, reason="would compile on the GPU")
def test_first_use_probe_subprocess_reports_its_failure_without_a_gpu():
    first_use = probes.measure_first_use()
    assert first_use.cold_first_call_s is None and first_use.error is not None
    assert first_use.error.startswith("RuntimeError: cold probe exited with 1")


# ---------------------------------------------------------------- the reader and decode suites


def test_top_level_help_names_every_suite(capsys):
    with pytest.raises(SystemExit) as exit_info:
        run.main(["-h"])
    assert exit_info.value.code == 0
    out = " ".join(capsys.readouterr().out.split())  # argparse wraps the epilog
    assert "nvfp4-mla bench reader [--out DIR]" in out
    assert "nvfp4-mla bench decode [--out DIR] [--quick] [--head-tiles]" in out


@pytest.mark.parametrize(
    ("suite", "options"), [("reader", ("--out",)), ("decode", ("--out", "--quick", "--head-tiles"))]
)
def test_suite_help_through_the_command_line(suite, options, capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["bench", suite, "-h"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith(f"usage: nvfp4-mla bench {suite} [-h]")
    assert all(option in out for option in options)
    assert "--reps" not in out and "--compile-budget" not in out  # the writers' options stay theirs


def test_python_m_reaches_a_suite():
    done = subprocess.run(
        [sys.executable, "-m", "nvfp4_mla.bench", "decode", "-h"], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("usage: nvfp4-mla bench decode")


@pytest.mark.parametrize("suite", [bench_reader, bench_decode], ids=["reader", "decode"])
def test_a_suite_name_dispatches_with_the_rest_of_the_arguments(suite, monkeypatch):
    seen: list[list[str]] = []
    monkeypatch.setattr(suite, "main", lambda argv: seen.append(argv) or 3)
    name = suite.__name__.rsplit(".", 1)[1]
    assert run.main([name, "--out", "x"]) == 3
    assert seen == [["--out", "x"]]
    with pytest.raises(SystemExit):  # a suite's options are not the writers' grid's
        run.parse_args(["--head-tiles"])


def test_suite_options():
    assert bench_reader.parse_args([]).out is None
    assert bench_reader.parse_args(["--out", "d"]).out == Path("d")
    args = bench_decode.parse_args([])
    assert (args.out, args.quick, args.head_tiles) == (None, False, False)
    args = bench_decode.parse_args(["--quick", "--head-tiles", "--out", "d"])
    assert (args.out, args.quick, args.head_tiles) == (Path("d"), True, True)
    with pytest.raises(SystemExit):
        bench_reader.parse_args(["--quick"])


@pytest.mark.skipif(GPU_USABLE, reason="would run the benchmark")
@pytest.mark.parametrize("argv", [["reader"], ["decode", "--quick"]])
def test_suites_say_they_need_a_gpu(argv):
    with pytest.raises(SystemExit, match=f"nvfp4-mla bench {argv[0]} needs a CUDA GPU"):
        run.main(argv)


def test_reader_bytes_model_matches_the_published_run():
    assert bench_reader.row_bytes(torch.bfloat16) == 384 + 512 * 2 + 8
    assert bench_reader.row_bytes(torch.float32) == 384 + 512 * 4 + 8
    # docs/bench_reader_h200.md: 65536 rows bf16 in 28.6 us at a 4.230 TB/s copy ceiling: 76.742%.
    assert bench_reader.copy_percent(65_536, torch.bfloat16, 28.6e-6, 4.230e12) == pytest.approx(76.742, rel=2e-3)


def _published_rows(path: Path) -> tuple[list[str], list[list[str]]]:
    """The first markdown table of a published result: header and rows of cells."""
    table = [line for line in path.read_text().splitlines() if line.startswith("| ")]
    cells = [line[2:-2].split(" | ") for line in table]  # a cell's own leading spaces stay
    return cells[0], cells[1:]


def test_reader_writer_reproduces_the_published_table(tmp_path, capsys):
    header, published = _published_rows(PUBLISHED_READER_MD)
    assert header == bench_reader.COLUMNS
    results = bench_reader.Results()
    for measure, value, unit, target, note in published:
        results.add(measure, float(value), unit, target, note)
    assert "1 row, graph-replayed" in capsys.readouterr().out
    bench_reader.write(results, tmp_path / "out", "NVIDIA H200")
    assert (tmp_path / "out" / "reader_bench.md").read_text() == PUBLISHED_READER_MD.read_text()
    with (tmp_path / "out" / "reader_bench.csv").open() as f:
        rows = list(csv.DictReader(f))
    assert list(rows[0]) == bench_reader.COLUMNS and len(rows) == len(published)
    assert rows[-1]["measure"] == "4096 rows: reference / kernel (eager, back to back)"
    assert float(rows[-1]["value"]) == pytest.approx(39.326) and rows[-1]["target"] == ">= 20"


def test_decode_shapes_and_set_counts():
    full, quick = bench_decode.shapes(False), bench_decode.shapes(True)
    assert len(full) == 4 * 2 * 3 * 2 == len(set(full)) and set(quick) <= set(full)
    assert {s[0] for s in quick} == {1, 64} and {s[0] for s in full} == {1, 8, 64, 128}
    assert bench_decode.prefill_shapes() == [(4096, 1, 128, 512), (16384, 1, 128, 512)]  # the prefill shapes
    # The published H200 run (60 MiB of L2): the sets column of docs/bench_decode_h200.md.
    l2 = 60 << 20
    assert bench_decode.set_count((1, 1, 128, 512), l2) == bench_decode.MAX_SETS == 8  # 240 KiB of records
    assert bench_decode.set_count((64, 1, 16, 512), l2) == 8
    assert bench_decode.set_count((64, 2, 16, 512), l2) == 4
    assert bench_decode.set_count((128, 2, 16, 1024), l2) == 2
    assert bench_decode.set_count((128, 2, 16, 1024), 10 << 20) == 1


def test_decode_bytes_flops_and_rooflines_match_the_published_run():
    # batch 1, q_len 1, 128 heads, 128 + 512 tokens: q and out in BF16, lse in fp32; 384 B of
    # record and a 4-byte slot per selected token; 2 MMAs of 2 x 512 flops per token and head.
    nbytes, flops = bench_decode.useful(1, 1, 128, 512)
    assert nbytes == 2 * 128 * 512 * 2 + 128 * 4 + 640 * (384 + 4)
    assert flops == 4 * 512 * 640 * 128
    # docs/bench_decode_h200.md: 15.7 us -> 10.7 TFLOP/s, 0.766% bytes, 1.56% flops (binding).
    ceilings = {"copy": 4.25e12, "matmul": 687e12, "launch": 2.0e-6}
    row = {"fused_graph_us": 15.7}
    bench_decode.add_rooflines(row, (1, 1, 128, 512), ceilings)
    assert row["fused_tflops"] == pytest.approx(10.69, rel=1e-3)
    assert row["bytes_pct"] == pytest.approx(0.766, rel=1e-3) and row["flops_pct"] == pytest.approx(1.555, rel=1e-3)
    assert row["binding"] == "flops" and row["roofline_pct"] == row["flops_pct"]
    # The byte roofline with a launch adds one empty launch to the bytes' time: (0.120 + 2.0) / 15.7 us.
    assert row["byte_roofline_pct"] == pytest.approx(row["bytes_pct"] + 100 * 2.0 / 15.7, rel=1e-9)
    row = {"fused_graph_us": 11.0}
    bench_decode.add_rooflines(row, (1, 1, 16, 512), ceilings)
    assert row["binding"] == "bytes" and row["roofline_pct"] == row["bytes_pct"] == pytest.approx(0.603, rel=1e-2)


def _decode_row(batch: int, heads: int, choice: str = "rule", **values: float) -> dict:
    return {"batch": batch, "q_len": 1, "heads": heads, "tokens": 640, "choice": choice, **values}


def test_decode_verdicts():
    rows = [
        _decode_row(1, 16, vs_torch_bf16=4.5, roofline_pct=1.0, fused_graph_us=13.0),
        _decode_row(64, 16, vs_torch_bf16=3.9, roofline_pct=45.0, byte_roofline_pct=51.0, fused_graph_us=40.0),
        _decode_row(1, 128, vs_torch_bf16=2.5, roofline_pct=2.0, fused_graph_us=16.0),
        _decode_row(64, 128, vs_torch_bf16=2.0, roofline_pct=41.0, flops_pct=41.0, fused_graph_us=90.0),
        # Forced rows (a head tile, another backend): no comparison, no Hopper target verdict.
        _decode_row(64, 128, "forced", fused_graph_us=1.0, roofline_pct=1.0, flops_pct=99.0),
        _decode_row(64, 16, "forced", fused_graph_us=1.0, roofline_pct=1.0, byte_roofline_pct=1.0),
        _decode_row(1, 128, "forced", fused_graph_us=99.0),
        # Prefill (the fused arm alone): 16384 rows at 0.99 of 4096's TFLOP/s.
        _decode_row(4096, 128, fused_tflops=400.0, flops_pct=55.0, fused_graph_us=900.0),
        _decode_row(16384, 128, fused_tflops=396.0, flops_pct=54.0, fused_graph_us=3600.0),
    ]
    assert bench_decode.verdicts(rows) == [
        "vs torch_bf16, heads <= 32 (min speedup): 3.9 (goal 4) MISSED",
        "vs torch_bf16, heads 128 (min speedup): 2 (goal 2) met",
        "batch >= 32, % of binding roofline (min): 41 (goal 40) met",
        "batch 1, heads 128, graph us (max): 16 (goal 15) MISSED",
        "Hopper target: heads 128, >= 64 rows, % of the matmul (min): 41 (goal 50) MISSED",
        "Hopper target: heads 16, >= 64 rows, % of the byte roofline with a launch (min): 51 (goal 50) met",
        "Hopper target: 1 row, heads 128, 640 tokens, graph us (max): 16 (goal 10) MISSED",
        "Hopper target: prefill TFLOP/s, 16384 rows / 4096: 0.99 (goal 1) MISSED",
    ]
    assert bench_decode.verdicts(rows[2:3]) == [
        "vs torch_bf16, heads 128 (min speedup): 2.5 (goal 2) met",
        "batch 1, heads 128, graph us (max): 16 (goal 15) MISSED",
        "Hopper target: 1 row, heads 128, 640 tokens, graph us (max): 16 (goal 10) MISSED",
    ]  # a target without rows has no verdict
    assert bench_decode.verdicts(rows[-1:]) == [
        "Hopper target: heads 128, >= 64 rows, % of the matmul (min): 54 (goal 50) met",
    ]  # the prefill ratio needs both row counts


def _cell_value(text: str) -> int | float | str:
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text


def test_decode_writer_reproduces_the_published_report(tmp_path):
    header, published = _published_rows(PUBLISHED_DECODE_MD)
    assert header == bench_decode.COLUMNS
    rows = [{c: _cell_value(v) for c, v in zip(header, cells) if v != ""} for cells in published]
    for row in rows:  # the writer prints integers as written and every other number with 3 digits
        for column in ("fused_graph_us", "vs_torch_bf16", "roofline_pct", "byte_roofline_pct", "diff"):
            if isinstance(row.get(column), int):
                row[column] = float(row[column])
    found = re.search(
        r"copy ceiling ([\d.]+) TB/s, matmul ceiling (\d+) TFLOP/s, empty launch ([\d.]+) us",
        PUBLISHED_DECODE_MD.read_text(),
    )
    assert found is not None
    copy, matmul, launch = found.groups()
    ceilings = {"copy": float(copy) * 1e12, "matmul": float(matmul) * 1e12, "launch": float(launch) * 1e-6}
    bench_decode.write(rows, ceilings, bench_decode.verdicts(rows), tmp_path, "NVIDIA H200")
    assert (tmp_path / "decode_bench.md").read_text() == PUBLISHED_DECODE_MD.read_text()
    with (tmp_path / "decode_bench.csv").open() as f:
        written = list(csv.DictReader(f))
    assert list(written[0]) == bench_decode.COLUMNS and len(written) == len(rows)
    assert written[0]["binding"] == "bytes" and float(written[0]["fused_graph_us"]) == rows[0]["fused_graph_us"]


def test_decode_torch_arms_do_the_same_work_as_the_reference(seed):
    pools = decode_arms.Pools("cpu", (256, 512), reference)
    # Not the global seed: q would repeat the tables' first rows.
    x = decode_arms.Inputs(2, 2, 16, 64, torch.Generator().manual_seed(seed + 1), pools)
    # Invalid slots, enough that scoring them as zero rows would move lse by about 0.3.
    x.slots[0][0, 0, :64] = -1
    x.slots[1][1, 1, -32:] = 512
    fused_out, fused_lse = decode_arms.fused(pools, x)  # the reference on the CPU
    reader_out, reader_lse = decode_arms.torch_reader(pools, x)
    assert fused_out.shape == reader_out.shape == x.q.shape and fused_lse.shape == reader_lse.shape == x.q.shape[:3]
    torch.testing.assert_close(reader_out.float(), fused_out.float(), atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(reader_lse, fused_lse, atol=1e-2, rtol=1e-2)  # BF16 scores in the torch arm
    # On tables holding exactly the records' values, the BF16-cache arm is the reader arm.
    pools.tables = [
        reference.nvfp4_dequantize_sparse_mla_cache(c, dtype=torch.bfloat16).view(-1, 512) for c in pools.caches
    ]
    bf16_out, bf16_lse = decode_arms.torch_bf16(pools, x)
    assert torch.equal(bf16_out, reader_out) and torch.equal(bf16_lse, reader_lse)


def test_ragged_lengths_follow_their_distributions():
    g = torch.Generator().manual_seed(0)
    k = decode_ragged.RAGGED_EXTRA_K
    full, tail, uniform, short = (decode_ragged.ragged_lengths(d, 64, k, g) for d in decode_ragged.RAGGED_DISTRIBUTIONS)
    assert full.shape == (64, 1) and full.dtype == torch.int32 and bool((full == k).all())
    assert tail.view(-1).tolist() == [k if r % 8 == 0 else 128 for r in range(64)]
    assert int(uniform.min()) >= 1 and int(uniform.max()) <= k and int(short.min()) >= 1 and int(short.max()) <= 256
    with pytest.raises(ValueError, match="no length distribution 'long'"):
        decode_ragged.ragged_lengths("long", 4, k, g)
    other = {d: decode_ragged.ragged_lengths(d, 64, k, g).view(-1) for d in decode_ragged.OTHER_DISTRIBUTIONS}
    assert all(n.dtype == torch.int32 and int(n.min()) >= 1 and int(n.max()) <= k for n in other.values())
    assert sorted(other["bimodal"].tolist()) == [64] * 32 + [k] * 32
    assert sorted(other["mostly_empty"].tolist()) == [1] * 56 + [k] * 8
    assert sorted(other["one_long"].tolist()) == [32] * 63 + [k]
    assert sorted(other["ramp"].tolist()) == torch.linspace(1, k, 64).long().tolist()
    assert other["ramp"].tolist() != sorted(other["ramp"].tolist())  # in a random order
    mean = float(decode_ragged.ragged_lengths("geometric", 4096, k, g).float().mean())
    assert 0.8 * k / 10 < mean < 1.2 * k / 10  # exponential, mean k / 10 (the clamp barely moves it)


def test_a_ragged_row_times_both_forms_on_the_same_lengths(seed):
    """Both arms run (here the reference on the CPU, through a plan made on CPU tensors) and the
    row says how much of the full batch is live."""
    pools = decode_arms.Pools("cpu", (256, 512), reference)
    row = decode_ragged.measure_ragged(pools, 4, 16, "tail1of8", torch.Generator().manual_seed(seed), StandInTimer())
    assert row["live_full"] == (2048 + 3 * 128) / (4 * 2048)  # row 0 full, rows 1-3 128 live
    assert (row["one_call_us"], row["plan_us"], row["plan_speedup"]) == (GRAPH_S * 1e6, GRAPH_S * 1e6, 1.0)


def test_the_ragged_report_divides_by_the_full_batch(monkeypatch, tmp_path):
    times = {"full": 20.0, "tail1of8": 10.0, "uniform": 12.0, "short": 5.0}

    def measured(pools, batch, heads, dist, g, timer):
        return {"batch": batch, "heads": heads, "lens": dist, "live_full": 0.5, "one_call_us": times[dist],
                "plan_us": times[dist] / 2, "plan_speedup": 2.0}  # fmt: skip

    monkeypatch.setattr(decode_ragged, "measure_ragged", measured)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    rows = decode_ragged.ragged(None, None, None, tmp_path, "a GPU")  # type: ignore[arg-type]
    assert len(rows) == 2 * 2 * len(decode_ragged.RAGGED_DISTRIBUTIONS)
    assert [r["time_full"] for r in rows[:4]] == [1.0, 0.5, 0.6, 0.25]
    csv_text = (tmp_path / "decode_ragged.csv").read_text()
    assert csv_text.splitlines()[0] == ",".join(decode_ragged.RAGGED_COLUMNS)
    assert "# Fused sparse decode on a GPU: ragged batches" in (tmp_path / "decode_ragged.md").read_text()
