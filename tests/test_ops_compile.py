"""NVRTC compilation of every kernel the ops can request (the registry's catalogue: every writer
mode on the GPU tests' page sizes, the reader's builds, every decode backend's kernels), on every
architecture we ship for, and what the specs promise the compiler. Needs no GPU: NVRTC compiles
for a named arch. A local-memory spill or stack frame fails the test (ptxas -v report through
NVRTC)."""

import os
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from nvfp4_mla import Geometry, abi, jit, kernel_cache, launch
from nvfp4_mla.ops import registry
from nvfp4_mla.ops.reader import ReaderSpec
from nvfp4_mla.ops.writer_spec import QMode, WriterSpec
from nvfp4_mla.testing import VirtualArchKernels

pytest.importorskip("cupy", reason="CuPy is needed for NVRTC (pip install 'nvfp4-mla[cu12]')")

# Registers a thread may use, by kernel family: the writer's KV warps keep their next unit's loads
# in registers (about 13): 58-64 now (4 blocks of 256 threads an SM), the bound leaves room for the
# pipeline; the reader is a gather. Every kernel's block must fit an SM's 64K registers.
MAX_REGISTERS = {WriterSpec: 80, ReaderSpec: 40}
WRITERS = [s for s in registry.catalogue("sm_90") if isinstance(s, WriterSpec)]


def test_catalogue_covers_every_mode_of_every_op():
    seen = {name: {getattr(s, name) for s in WRITERS} for name in WriterSpec._fields}
    assert seen["q_mode"] == set(QMode)
    assert seen["identity_slots"] == {False, True} and seen["kv_rope"] == {False, True}
    assert seen["compress_ratio"] == {1, 2} and seen["apply_q_rope"] == {False, True}
    assert seen["q_head_padded"] >= {0, *abi.Q_HEAD_PADDINGS}
    assert len(WRITERS) > 60
    readers = [s for s in registry.catalogue("sm_90") if isinstance(s, ReaderSpec)]
    assert {(s.slot_int64, s.identity_slots, s.out_fp32) for s in readers} == {
        (i64, ident, f32)
        for i64 in (False, True)
        for ident in (False, True)
        for f32 in (False, True)
        if not (i64 and ident)
    }
    for arch in jit.ARCHS:  # the decode's kernels, the combine included, on every arch
        assert set(registry.OPS["decode"].specs(Geometry("decode"), arch)) <= set(registry.catalogue(arch))


@pytest.mark.parametrize("arch", jit.ARCHS)
def test_every_kernel_compiles_without_spills(arch):
    specs = registry.catalogue(arch)
    targets = [jit.target_arch(s, arch) for s in specs]
    with ThreadPoolExecutor(os.cpu_count()) as pool:  # NVRTC releases the GIL
        results = list(pool.map(jit.compile_kernel, specs, targets))
    for spec, result in zip(specs, results):
        assert result.cubin[:4] == b"\x7fELF", spec.describe()
    # NVRTC 13.0 drops the ptxas report of some compiles run in parallel: redo those serially.
    results = [r if r.log else jit.compile_kernel(s, a) for s, a, r in zip(specs, targets, results)]
    if not all(r.log for r in results):  # test_gpu_kernel_resources still checks on the GPU
        pytest.skip(f"NVRTC {jit.nvrtc_identity()} returned no ptxas report")
    for spec, target, result in zip(specs, targets, results):
        what = f"{spec.describe()} on {target}"
        assert f"for '{target}'" in result.log, result.log
        assert result.spill_bytes == 0 and result.stack_bytes == 0, f"{what}:\n{result.log}"
        assert "serialized" not in result.log, f"{what}: ptxas serialized its tensor-core ops:\n{result.log}"
        assert 0 < result.registers <= MAX_REGISTERS.get(type(spec), 255), f"{what}: {result.registers} registers"
        assert result.registers * spec.template.threads <= 65536, f"{what}: {result.registers} registers"


@pytest.mark.gpu
def test_gpu_kernel_resources():
    """Every kernel of this GPU's catalogue loads with no local memory (spills)."""
    index = torch.cuda.current_device()
    major, minor = torch.cuda.get_device_capability(index)
    for spec in registry.catalogue(f"sm_{major}{minor}"):
        kernel = kernel_cache.default().launcher(index, spec)
        assert kernel.local_size_bytes == 0, f"{spec.describe()}: {kernel.local_size_bytes} bytes of local memory"


def test_every_template_fits_the_launch_buffer():
    for spec in registry.catalogue("sm_90"):
        assert spec.template.params.size <= launch.PARAMS_CAPACITY, spec.describe()


def test_compile_error_names_the_kernel():
    spec = WRITERS[0]
    with pytest.raises(RuntimeError, match=f"NVRTC failed for {spec.describe()}"):
        jit.compile_kernel(spec, "sm_90", sources={spec.template.file: "this is not CUDA"})


@pytest.mark.parametrize("rows_per_warp", [1, 2, 4])
def test_work_units_cover_every_row_once(rows_per_warp):
    """Units a launch needs: ceil(rows / (2 warps x kv_rows_per_warp)) for the KV rows, then the
    query's; the KV rows' blocks are capped at the resident blocks (they loop), the query's not."""
    kv_units = -(-37 // (2 * rows_per_warp))

    def tuned(geometry):
        (spec,) = geometry.specs("sm_90")
        return spec._replace(kv_rows_per_warp=rows_per_warp)

    padded = tuned(Geometry("main", 16, 5, 8))
    assert (padded.kv_units(37), padded.q_units(40)) == (kv_units, 40 * 8 // 4)  # 4 q_out rows a unit
    in_place = tuned(Geometry("main", 16, 64, 64, q_inplace=True))
    assert in_place.q_units(40) == 40 * 64 // (8 * 4)  # 4 x 8 heads a unit
    small = tuned(Geometry("main", 16, 8, 8, q_inplace=True))
    assert (small.q_rows(41), small.q_units(41)) == (41, 11)  # 4 groups of 8 heads a unit, across tokens
    for entry in ("kv", "append", "pack"):
        variant = tuned(Geometry(entry, 16))
        assert (variant.kv_units(37), variant.q_units(40)) == (kv_units, 0)
        assert variant.grid(40, 37, 1000, 132) == (-(-kv_units // 4),) * 2
    kv_blocks = -(-kv_units // 4)
    assert padded.grid(40, 37, 1000, 132) == (kv_blocks, kv_blocks + 20)  # 80 units, 4 a block
    # A small query gets a block a unit (at most half as many units as SMs), and in place a block
    # a row (a group of 8 heads; at most as many as SMs).
    assert padded.grid(40, 37, 1000, 160) == (kv_blocks, kv_blocks + 80)
    assert padded.grid(40, 37, 1000, 159) == (kv_blocks, kv_blocks + 20)
    assert small.grid(41, 0, 1, 41) == (0, 41)
    assert small.grid(41, 0, 1, 40) == (0, 11)
    assert small.grid(41, 0, 1, 21) == (0, 3)  # 11 units: the last block partly idle
    assert padded.grid(40, 37, 1, 1) == (1, 21)  # the KV blocks loop
    # With query work the KV blocks take at most half the resident blocks; alone, all of them.
    assert padded.grid(40, 37, 8, 2)[0] == min(kv_blocks, 4)
    assert tuned(Geometry("kv", 16)).grid(40, 37, 8, 2)[0] == min(kv_blocks, 8)
    assert padded.grid(40, 0, 1, 1) == (0, 20)
    assert padded.defines()["KV_ROWS_PER_WARP"] == rows_per_warp


def test_ptx_of_an_older_gpu_takes_its_code_paths(tmp_path):
    """compile_ptx gives NUL-terminated PTX of the virtual architecture, whose ``__CUDA_ARCH__``
    branches are that GPU's: what the sm_80 runs of the GPU quantizer tests load on a newer GPU."""
    (spec,) = Geometry("append", 16).specs("sm_80")
    ptx80, ptx90 = jit.compile_ptx(spec, "sm_80"), jit.compile_ptx(spec, "sm_90")
    assert ptx80.endswith(b"\0") and ptx80.count(b"\0") == 1 and b"\n.target sm_80\n" in ptx80
    assert b"xorsign" not in ptx80 and b"xorsign" in ptx90  # the amax: masked magnitudes below sm_86
    assert b"e4m3x2" not in ptx80 and b"e4m3x2" in ptx90  # the scale's E4M3 conversions below sm_89
    with pytest.raises(kernel_cache.CacheError, match="in memory"):
        VirtualArchKernels().build(spec, "sm_90", tmp_path)
