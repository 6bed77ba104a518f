"""NVRTC compilation of every kernel variant the public entries can request, for a representative
geometry set, on every architecture we ship for. Needs no GPU: NVRTC compiles for a named arch.
A local-memory spill or stack frame fails the test (ptxas -v report through NVRTC)."""

import os
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from nvfp4_mla import Geometry, abi, jit, kernel_cache
from nvfp4_mla.testing import VirtualArchKernels
from nvfp4_mla.variant import QMode, Variant

pytest.importorskip("cupy", reason="CuPy is needed for NVRTC (pip install 'nvfp4-mla[cu12]')")


def representative_geometries():
    """Every (heads, padded heads, rope, in-place) combination at page 64, every entry on the
    page sizes of the GPU tests, both slot dtypes, both compress ratios."""
    geometries = []
    for heads in (1, 5, 8, 16, 64, 128):
        for padded in (0, *abi.Q_HEAD_PADDINGS):
            if padded == 0 or padded >= heads:
                for rope in (True, False):
                    geometries.append(Geometry("main", 64, heads, padded, apply_q_rope=rope))
        if heads in abi.Q_HEAD_PADDINGS:
            for rope in (True, False):
                geometries.append(Geometry("main", 64, heads, heads, apply_q_rope=rope, q_inplace=True))
    for page_size in (1, 3, 16, 32, 128, 256):
        for slot_dtype in (torch.int32, torch.int64):
            geometries.append(Geometry("main", page_size, 8, 16, slot_dtype=slot_dtype))
            geometries.append(Geometry("append", page_size, slot_dtype=slot_dtype))
            for ratio in abi.COMPRESS_RATIOS:
                geometries.append(Geometry("kv", page_size, compress_ratio=ratio, slot_dtype=slot_dtype))
        geometries.append(Geometry("pack", page_size))
    return geometries


VARIANTS = sorted({g.variant() for g in representative_geometries()})
MAX_REGISTERS = 80


def test_variant_set_covers_every_mode():
    seen = {name: {getattr(v, name) for v in VARIANTS} for name in Variant._fields}
    assert seen["q_mode"] == set(QMode)
    assert seen["identity_slots"] == {False, True} and seen["kv_rope"] == {False, True}
    assert seen["compress_ratio"] == {1, 2} and seen["apply_q_rope"] == {False, True}
    assert seen["q_head_padded"] >= {0, *abi.Q_HEAD_PADDINGS}
    assert len(VARIANTS) > 60


@pytest.mark.parametrize("arch", jit.ARCHS)
def test_every_variant_compiles_without_spills(arch):
    with ThreadPoolExecutor(os.cpu_count()) as pool:  # NVRTC releases the GIL
        results = list(pool.map(lambda v: jit.compile_kernel(v, arch), VARIANTS))
    for variant, result in zip(VARIANTS, results):
        assert result.cubin[:4] == b"\x7fELF", variant
    # NVRTC 13.0 drops the ptxas report of some compiles run in parallel: redo those serially.
    results = [r if r.log else jit.compile_kernel(v, arch) for v, r in zip(VARIANTS, results)]
    if not all(r.log for r in results):  # test_gpu_kernel_resources still checks on the GPU
        pytest.skip(f"NVRTC {jit.nvrtc_identity()} returned no ptxas report")
    for variant, result in zip(VARIANTS, results):
        assert f"for '{arch}'" in result.log, result.log
        assert result.spill_bytes == 0 and result.stack_bytes == 0, f"{variant} on {arch}:\n{result.log}"
        # The writer's KV warps keep their next unit's loads in registers (about 13): 58-64
        # registers now (4 blocks of 256 threads an SM); the bound leaves room for the pipeline.
        assert 0 < result.registers <= MAX_REGISTERS, f"{variant}: {result.registers} registers"


@pytest.mark.gpu
def test_gpu_kernel_resources():
    """Every variant loads on this GPU with no local memory (spills)."""
    index = torch.cuda.current_device()
    for variant in VARIANTS:
        kernel = kernel_cache.default().launcher(index, variant)
        assert kernel.local_size_bytes == 0, f"{variant}: {kernel.local_size_bytes} bytes of local memory"


def test_compile_error_names_the_variant(monkeypatch):
    monkeypatch.setitem(jit._sources, VARIANTS[0].template.file, "this is not CUDA")
    with pytest.raises(RuntimeError, match="NVRTC failed"):
        jit.compile_kernel(VARIANTS[0], "sm_90")


@pytest.mark.parametrize("rows_per_warp", [1, 2, 4])
def test_work_units_cover_every_row_once(rows_per_warp):
    """Units a launch needs: ceil(rows / (2 warps x kv_rows_per_warp)) for the KV rows, then the
    query's; the KV rows' blocks are capped at the resident blocks (they loop), the query's not."""
    kv_units = -(-37 // (2 * rows_per_warp))

    def tuned(geometry):
        return geometry.variant()._replace(kv_rows_per_warp=rows_per_warp)

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


def test_params_size_is_checked_by_the_compiler(monkeypatch):
    """The host's struct format and the kernel's Params agree, or NVRTC refuses to compile."""
    variant = Geometry("kv", 16).variant()
    assert jit.compile_kernel(variant, "sm_80").cubin[:4] == b"\x7fELF"
    wrong = variant.template._replace(params=__import__("struct").Struct("<7Q4q"))
    monkeypatch.setattr(Variant, "template", wrong)
    with pytest.raises(RuntimeError, match="Params must match"):
        jit.compile_kernel(variant, "sm_80")


def test_ptx_of_an_older_gpu_takes_its_code_paths(tmp_path):
    """compile_ptx gives NUL-terminated PTX of the virtual architecture, whose ``__CUDA_ARCH__``
    branches are that GPU's: what the sm_80 runs of the GPU quantizer tests load on a newer GPU."""
    variant = Geometry("append", 16).variant()
    ptx80, ptx90 = jit.compile_ptx(variant, "sm_80"), jit.compile_ptx(variant, "sm_90")
    assert ptx80.endswith(b"\0") and ptx80.count(b"\0") == 1 and b"\n.target sm_80\n" in ptx80
    assert b"xorsign" not in ptx80 and b"xorsign" in ptx90  # the amax: masked magnitudes below sm_86
    assert b"e4m3x2" not in ptx80 and b"e4m3x2" in ptx90  # the scale's E4M3 conversions below sm_89
    with pytest.raises(kernel_cache.CacheError, match="in memory"):
        VirtualArchKernels().build(variant, "sm_90", tmp_path)
