"""The benchmark's no-quantizer arm and the KV rows per warp A/B: the header transform, the stub
kernels' compile (NVRTC, no GPU needed), their key and cache, the library the arm runs on, the arm in
the measuring loop and the options. GPU tests (marked ``gpu``) run the stub and A/B kernels."""

from __future__ import annotations

import functools
import re
from typing import NamedTuple, cast

import pytest
import torch

import nvfp4_mla
from nvfp4_mla import abi, jit, kernel_cache, kernel_file, ops, reference, validation
from nvfp4_mla.bench import grid, run, stub
from nvfp4_mla.bench.arms import Entries
from nvfp4_mla.bench.grid import Row
from nvfp4_mla.device import Device
from nvfp4_mla.ops import library as library_module
from nvfp4_mla.ops import writers
from nvfp4_mla.ops.writer_spec import WriterSpec
from nvfp4_mla.testing import Case, check_case, one_kv_block, record_offsets, rope_table

HEADER = stub.shipped_header()
# One writer variant of each entry the benchmark measures.
VARIANTS = [
    writers.main_spec(256, torch.int64, 8, 16, True, False),
    writers.main_spec(256, torch.int64, 16, 16, True, True),
    writers.kv_spec(128, torch.int64, 1),
    writers.kv_spec(128, torch.int64, 2),
    writers.append_spec(128, torch.int64),
    writers.pack_spec(128),
]


def _without_stubbed_bodies(header: str) -> str:
    """``header`` with the body of every stubbed function cut out."""
    for name in stub.STUBS:
        _, start, end = stub.definition(header, name)
        header = header[:start] + header[end:]
    return header


# ---------------------------------------------------------------- the transform


def test_stub_header_replaces_exactly_the_listed_bodies():
    stubbed = stub.stub_header(HEADER)
    assert _without_stubbed_bodies(stubbed) == _without_stubbed_bodies(HEADER)  # all else is the shipped text
    assert list(stub.STUBS) == ["group_amax", "scale_code", "group_codes"]
    for name, body in stub.STUBS.items():
        params, start, end = stub.definition(stubbed, name)
        shipped_params, shipped_start, shipped_end = stub.definition(HEADER, name)
        assert params == shipped_params
        assert stubbed[start:end] == "{\n    " + body(*params) + "\n}" != HEADER[shipped_start:shipped_end]
        for param in params:  # the stub still depends on every input
            assert re.search(rf"\b{param}\b", stubbed[start:end]), (name, param)


@pytest.mark.parametrize("name", list(stub.STUBS))
def test_a_missing_function_fails_naming_it(name):
    renamed = re.sub(rf"\b{name}\(", f"{name}_renamed(", HEADER, count=1)
    with pytest.raises(ValueError, match=rf"quantizer function {name} is defined 0 times in nvfp4_numerics.cuh"):
        stub.stub_header(renamed)


@pytest.mark.parametrize("name", list(stub.STUBS))
def test_a_duplicated_function_fails_naming_it(name):
    _, start, end = stub.definition(HEADER, name)
    line_start = HEADER.rindex("\n", 0, start) + 1
    duplicated = HEADER + "\n" + HEADER[line_start:end] + "\n"
    with pytest.raises(ValueError, match=rf"quantizer function {name} is defined 2 times"):
        stub.stub_header(duplicated)


def test_a_changed_parameter_list_fails_naming_the_function():
    changed = HEADER.replace("u32 scale_code(float amax)", "u32 scale_code(float amax, int bias)")
    assert changed != HEADER
    with pytest.raises(ValueError, match=r"scale_code takes parameters \['amax', 'bias'\]"):
        stub.stub_header(changed)


def test_definition_counts_braces_outside_comments_and_literals():
    text = (
        "__device__ float other(float a) { return a; }\n"
        "// __device__ float half_amax(uint4 x) { in a comment: not a definition\n"
        "__device__ __forceinline__ float half_amax(uint4 x) {\n"
        "    if (x.x) { return 1.0f; }  // a } in a comment\n"
        '    const char* s = "}{"; /* { */\n'
        "    return 0.0f;\n"
        "}\n"
        "__device__ float after(float a) { return a; }\n"
    )
    params, start, end = stub.definition(text, "half_amax")
    assert params == ["x"]
    assert text[start:end].startswith("{\n    if (x.x)") and text[end:].startswith("\n__device__ float after")


# ---------------------------------------------------------------- stub kernels: compile, key, cache


@pytest.fixture(scope="module")
def nvrtc():
    pytest.importorskip("cupy", reason="CuPy is needed for NVRTC (pip install 'nvfp4-mla[cu12]')")


@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
def test_stub_kernels_compile_with_their_own_key(nvrtc, arch):
    stubbed = stub.stub_header(HEADER)
    for variant in VARIANTS:
        shipped_key = jit.kernel_key(variant, arch)
        stub_key = jit.kernel_key(variant, arch, {jit.NUMERICS_HEADER: stubbed})
        assert stub_key != shipped_key and jit.kernel_key(variant, arch, {jit.NUMERICS_HEADER: HEADER}) == shipped_key
        result = jit.compile_kernel(variant, arch, sources={jit.NUMERICS_HEADER: stubbed})
        assert result.cubin[:4] == b"\x7fELF" and result.spill_bytes == 0, variant
        assert kernel_file.proof(stub_key) in result.cubin and kernel_file.proof(shipped_key) not in result.cubin
        assert result.cubin != jit.compile_kernel(variant, arch).cubin
    # The shipped source is untouched: the file, jit's copy and the shipped keys.
    assert stub.shipped_header() == HEADER == (jit.kernel_dir() / jit.NUMERICS_HEADER).read_text()


def test_stub_kernel_cache_compiles_in_memory_only(nvrtc, tmp_path, monkeypatch):
    monkeypatch.setenv("NVFP4_MLA_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    cache = stub.StubKernelCache(stub.stub_header(HEADER))
    assert cache.layers == []
    cubin, where = cache.build(VARIANTS[2], "sm_90")
    assert (
        where is None
        and kernel_file.proof(jit.kernel_key(VARIANTS[2], "sm_90", {jit.NUMERICS_HEADER: cache.header})) in cubin
    )
    assert list(tmp_path.iterdir()) == []  # nothing written, not even the user's default directory
    with pytest.raises(kernel_cache.CacheError, match="kept in memory"):
        cache.build(VARIANTS[2], "sm_90", tmp_path)


# ---------------------------------------------------------------- the library the arms run on


class _StandInLauncher(NamedTuple):
    resident_blocks: int  # as launch.Launcher's: blocks the GPU holds at once
    device: Device

    def launch(self, *args: int) -> None:
        raise AssertionError("a plan is built, never launched, here")


STAND_IN = _StandInLauncher(resident_blocks=1, device=Device(5, 90, 1, 232_448))


class _RecordingCache:
    """Stands in for a KernelCache: records what the library loads."""

    def __init__(self) -> None:
        self.bound: list[tuple[int, WriterSpec]] = []

    def launcher(self, device_index: int, spec: WriterSpec) -> _StandInLauncher:
        self.bound.append((device_index, spec))
        return STAND_IN


LAYOUT = validation.CacheLayout(4, 128, 128 * 384)


@pytest.mark.parametrize("kv_rows_per_warp", [None, 1, 3])
def test_a_library_plans_with_its_cache_and_tune_in_its_own_table(kv_rows_per_warp):
    cache = _RecordingCache()
    tune = None if kv_rows_per_warp is None else (lambda s: s._replace(kv_rows_per_warp=kv_rows_per_warp))
    library = nvfp4_mla.KernelLibrary(cache, tune=tune)  # type: ignore[arg-type]  # a stand-in cache
    spec = writers.kv_spec(128, torch.int64, 2)
    shipped = dict(ops.DEFAULT.plans)
    plan = writers.make_plan(library, ("signature",), 5, spec, None, LAYOUT, 0, 0, 10)  # type: ignore[arg-type]  # no checks: never run
    assert library.plans == {("signature",): plan} and ops.DEFAULT.plans == shipped
    expected = spec if kv_rows_per_warp is None else spec._replace(kv_rows_per_warp=kv_rows_per_warp)
    assert plan.launch is not None
    assert plan.launch.func == STAND_IN.launch and cache.bound == [(5, expected)]
    assert plan.launch.args == (expected.grid(0, 10, STAND_IN.resident_blocks, STAND_IN.device.sms)[1], 1, 1, 0)


def test_a_library_plans_with_its_writer_grid():
    """The tests' and the sanitizer run's forced layouts: a plan uses the library's grid (here
    one_kv_block's single KV block), the shipped grid elsewhere."""
    spec = writers.kv_spec(128, torch.int64, 1)
    many = STAND_IN._replace(resident_blocks=528, device=Device(5, 90, 132, 232_448))
    forced = nvfp4_mla.KernelLibrary(writer_grid=one_kv_block)
    assert forced.grid(spec, 0, 10_000, many) == (1, 1)  # type: ignore[arg-type]  # a stand-in launcher; 5000 units, one block
    assert nvfp4_mla.KernelLibrary().grid(spec, 0, 10_000, many) == (528, 528) == spec.grid(0, 10_000, 528, 132)  # type: ignore[arg-type]


def test_a_plan_with_nothing_to_launch_has_no_launch():
    """Even when the kernel is already loaded: a grid of 0 blocks is a launch error."""
    cache = _RecordingCache()
    library = nvfp4_mla.KernelLibrary(cache)  # type: ignore[arg-type]  # a stand-in cache
    spec = writers.kv_spec(128, torch.int64, 2)
    work = writers.make_plan(library, ("some",), 5, spec, None, LAYOUT, 0, 0, 10)  # type: ignore[arg-type]  # no checks
    empty = writers.make_plan(library, ("none",), 5, spec, None, LAYOUT, 0, 0, 0)  # type: ignore[arg-type]  # no checks
    assert work.launch is not None
    assert work.launch.func == STAND_IN.launch and empty.launch is None and len(cache.bound) == 1


def test_the_plan_table_is_bounded():
    library = nvfp4_mla.KernelLibrary()
    for i in range(library_module.MAX_PLANS + 3):
        library.remember(("plan", i), i)
    assert (
        len(library.plans) == 3
        and library.plans[("plan", library_module.MAX_PLANS + 2)] == library_module.MAX_PLANS + 2
    )


def test_kernel_library_of_the_shipped_kernels_is_ops():
    assert stub.kernel_library(grid.SHIPPED_KV_ROWS_PER_WARP, False) is ops


@pytest.mark.parametrize(("kv_rows_per_warp", "stubbed"), [(2, False), (1, True), (4, True)])
def test_kernel_library_binds_each_entry_to_its_library(kv_rows_per_warp, stubbed, monkeypatch):
    monkeypatch.setattr(stub, "stub_kernel_cache", lambda: "stub cache")
    stub.kernel_library.cache_clear()
    try:
        entries = stub.kernel_library(kv_rows_per_warp, stubbed)
    finally:
        stub.kernel_library.cache_clear()
    assert isinstance(entries, Entries)
    libraries = {cast(functools.partial, entry).keywords["library"] for entry in entries}  # entries are partials
    assert len(libraries) == 1
    (library,) = libraries
    assert library.cache == ("stub cache" if stubbed else kernel_cache.default())
    spec = writers.main_spec(16, torch.int64, 8, 16, True, False)
    assert library.spec(spec) == spec._replace(kv_rows_per_warp=kv_rows_per_warp)
    kv = torch.zeros(4, 512, dtype=torch.bfloat16)
    cache = reference.new_cache(2, 16, "HND", "cpu")
    with pytest.raises(ValueError):  # the same validation as the shipped entries
        entries.nvfp4_quantize_append_sparse_mla_cache(kv, torch.arange(4.0), cache)
    with pytest.raises(ValueError):
        entries.nvfp4_quantize_pack_sparse_mla_cache(kv)


# ---------------------------------------------------------------- the arm in the measuring loop


class _Timer:
    """Runs each call once; times are fixed per method."""

    def eager(self, call, sets):
        call(sets[0])
        return 10e-6, 7

    def graph(self, call, sets):
        call(sets[0])
        return 2e-6

    def host(self, call, x):
        return 5e-6


def test_the_stub_arm_calls_the_stubbed_library_of_the_rows_kernels(seed):
    asked: list[tuple[int, bool]] = []
    called: list[tuple[int, bool]] = []

    def libraries(kv_rows_per_warp: int, stubbed: bool):
        asked.append((kv_rows_per_warp, stubbed))

        def append(*args, **kwargs):
            called.append((kv_rows_per_warp, stubbed))
            return reference.nvfp4_quantize_append_sparse_mla_cache(*args, **kwargs)

        return Entries(
            reference.cake_dsv4_nvfp4_rope_quantize_insert,
            reference.cake_dsv4_nvfp4_kv_rope_quantize_insert,
            append,
            reference.nvfp4_quantize_pack_sparse_mla_cache,
        )

    ctx = run.Context(torch.device("cpu"), rope_table(grid.MAX_POSITION), _Timer(), 350_000, 0.0, libraries)
    result = run.measure_row(Row.append(3)._replace(kv_rows_per_warp=2), ctx)
    assert result.seconds == {"fused": 10e-6, "graph": 2e-6, "stub": 2e-6, "compile": None}
    assert asked == [(2, False), (2, True)]
    assert called == [(2, False), (2, False), (2, True)]  # eager, graph, then the stub arm's graph


def test_a_failing_stub_transform_is_the_arms_note(seed):
    def libraries(kv_rows_per_warp: int, stubbed: bool):
        if stubbed:
            stub.stub_header("no quantizer here")
        return reference

    ctx = run.Context(torch.device("cpu"), rope_table(grid.MAX_POSITION), _Timer(), 350_000, 0.0, libraries)
    result = run.measure_row(Row.kv(4, 1), ctx)
    assert result.seconds["stub"] is None and result.seconds["graph"] == 2e-6
    assert (
        "no quantizer (stub kernels), CUDA graph: n/a: ValueError: the quantizer function group_amax is defined 0 times"
        in result.notes[0]
    )


def test_entries_and_kv_rows_per_warp_options(capsys):
    args = run.parse_args([])
    assert (args.entries, args.kv_rows_per_warp) == (list(grid.ENTRIES), [grid.SHIPPED_KV_ROWS_PER_WARP])
    args = run.parse_args(["--quick", "--entries", "kv", "pack", "--kv-rows-per-warp", "1", "2", "4"])
    assert (args.entries, args.kv_rows_per_warp) == (["kv", "pack"], [1, 2, 4])
    for bad in (["--kv-rows-per-warp", "0"], ["--entries", "gather"]):
        with pytest.raises(SystemExit):
            run.parse_args(bad)
    with pytest.raises(SystemExit):
        run.parse_args(["--help"])
    out = capsys.readouterr().out
    assert "--entries" in out and "--kv-rows-per-warp" in out and "quantizer stubbed" in out


# ---------------------------------------------------------------- on the GPU


def _record_bytes(cache: torch.Tensor, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The data rows and scale slots of ``slots`` (all valid), on the CPU."""
    data, scales = abi.record_views(cache, validation.check_cache(cache))
    pages, entries = slots // cache.shape[1], slots % cache.shape[1]
    return data[pages, entries].cpu(), scales[pages, entries].cpu()


@pytest.mark.gpu
def test_gpu_stub_kernels_keep_the_memory_pattern_not_the_codes(seed):
    """The stub append writes every record the real one writes: the same RoPE bytes (copied) and
    zero padding, other codes; the shipped entries write the reference bytes after it."""
    rows, page_size = 300, 16
    kv = torch.randn(rows, abi.HEAD_DIM, device="cuda").to(torch.bfloat16)
    slots = torch.randperm(rows + 2 * page_size, device="cuda")[:rows]
    caches = [torch.zeros(rows // page_size + 3, page_size, abi.RECORD_BYTES, dtype=torch.uint8, device="cuda")]
    caches.append(caches[0].clone())
    stub.kernel_library(grid.SHIPPED_KV_ROWS_PER_WARP, True).nvfp4_quantize_append_sparse_mla_cache(
        kv, slots, caches[0]
    )
    ops.nvfp4_quantize_append_sparse_mla_cache(kv, slots, caches[1])
    (stub_data, stub_scales), (real_data, real_scales) = (_record_bytes(c, slots) for c in caches)
    assert torch.equal(stub_data[:, abi.NOPE_BYTES :], real_data[:, abi.NOPE_BYTES :])  # RoPE dims, bitwise
    assert torch.equal(stub_scales[:, abi.NUM_GROUPS :], real_scales[:, abi.NUM_GROUPS :])  # the zero bytes
    assert not torch.equal(stub_data[:, : abi.NOPE_BYTES], real_data[:, : abi.NOPE_BYTES])  # stubbed codes
    assert not torch.equal(stub_scales[:, : abi.NUM_GROUPS], real_scales[:, : abi.NUM_GROUPS])  # stubbed scales
    written = torch.zeros(caches[0].numel(), dtype=torch.bool)
    written[record_offsets(caches[0], slots).view(-1)] = True
    assert not caches[0].view(-1).cpu()[~written].any()  # nothing outside the records
    check_case(Case(entry="append", num_tokens=rows), "cuda")  # the shipped kernels are back


@pytest.mark.gpu
@pytest.mark.parametrize("kv_rows_per_warp", [2, 3, 4])
@pytest.mark.parametrize(
    "case",
    [
        Case(entry="kv", num_tokens=37),
        Case(entry="kv", num_tokens=37, compress_ratio=2),
        Case(entry="append", num_tokens=37),
        Case(entry="pack", pages=5, layout="HND"),
        Case(num_tokens=37, q_head_padded=16),
    ],
    ids=str,
)
def test_gpu_kv_rows_per_warp_kernels_write_the_reference_bytes(case, kv_rows_per_warp, seed):
    """The A/B's kernels are correct (canary caches, bad slots, rows not a multiple of the count)."""
    check_case(case, "cuda", impl=stub.kernel_library(kv_rows_per_warp, False))


@pytest.mark.gpu
def test_gpu_benchmark_rows_measure_the_stub_arm(seed):
    """A smoke run of the measuring loop with the device timer: every arm of a few rows, the
    no-quantizer arm included, measured without a note."""
    from nvfp4_mla.bench.timing import DeviceTimer

    device = torch.device("cuda", torch.cuda.current_device())
    ctx = run.Context(device, rope_table(grid.MAX_POSITION, device), DeviceTimer(reps=1), 50 * 2**20, 0.0)
    rows = [Row.main(64, 8, 16), Row.kv(4096, 2), Row.pack(4096), Row.append(4096)._replace(kv_rows_per_warp=2)]
    for result in run.run_grid(rows, ctx):
        assert result.notes == ["torch.compile(reference): skipped: --compile-budget 0"], result.notes
        assert all(result.seconds[arm] for arm in ("fused", "graph", "stub")), result.seconds
