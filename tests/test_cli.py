"""The command line, on the CPU: info, demo (reference path), inspect, precompile (NVRTC, no GPU)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import nvfp4_mla
from nvfp4_mla import abi, reference
from nvfp4_mla.__main__ import gpu_status, main
from util import cos_sin_table, make_cache, random_rows

SRC = str(Path(nvfp4_mla.__file__).resolve().parents[1])  # so a subprocess imports this checkout


def test_info(capsys, monkeypatch, tmp_path):
    monkeypatch.setenv("NVFP4_MLA_CACHE_DIR", str(tmp_path))
    (tmp_path / "sm_90-abc-def.cubin").write_bytes(b"x" * 100)
    assert main(["info"]) == 0
    out = capsys.readouterr().out
    for word in ("GPU:", "torch:", "CuPy:", "NVRTC:", f"kernel cache: {tmp_path}", "sm_90: 1 kernel, 100 B"):
        assert word in out
    if gpu_status().name is None:
        assert "no GPU" in out


def test_info_subprocess(tmp_path):
    env = {**os.environ, "PYTHONPATH": SRC, "NVFP4_MLA_CACHE_DIR": str(tmp_path / "none")}
    done = subprocess.run([sys.executable, "-m", "nvfp4_mla", "info"], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "nvfp4-mla" in done.stdout and "empty (not created yet)" in done.stdout


@pytest.mark.parametrize("force_cpu", [True, False])
def test_demo(capsys, tmp_path, force_cpu):
    saved = tmp_path / "demo.pt"
    assert main(["demo", "--save", str(saved)] + (["--cpu"] if force_cpu else [])) == 0
    out = capsys.readouterr().out
    if force_cpu or gpu_status().why_not:
        assert "Ran nvfp4_mla.reference on the CPU, not the GPU kernels: " in out
    else:
        assert "Ran the fused GPU entry" in out and "reference on the CPU: yes" in out
    assert "group 27" in out and "max |quantization error|" in out
    assert torch.load(saved, weights_only=True).shape == (2, 16, abi.RECORD_BYTES)


def test_inspect(capsys, tmp_path):
    cache = make_cache(3, 4, "HND", pad=32)  # padded pool in HND layout: inspect must follow the strides
    row = torch.zeros(1, abi.HEAD_DIM)
    row[0, :16] = torch.tensor([0, -0.0, 0.5, -0.5, 1, -1, 1.5, -1.5, 2, -2, 3, -3, 4, -4, 6, -6])  # SPEC's known answer
    row[0, abi.NOPE_DIM] = 1.25
    reference.nvfp4_quantize_append_sparse_mla_cache(row.to(torch.bfloat16), torch.tensor([6]), cache)
    path = tmp_path / "cache.pt"
    torch.save(cache, path)

    assert main(["inspect", str(path), "--slot", "6"]) == 0
    out = capsys.readouterr().out
    assert "slot 6 = page 1, entry 2" in out
    assert "group  0  scale 0x38 = 1 " in out
    assert "  code      0    8    1    9    2    A    3    B    4    C    5    D    6    E    7    F" in out
    assert "  e2m1      0   -0  0.5 -0.5    1   -1  1.5 -1.5    2   -2    3   -3    4   -4    6   -6" in out
    assert "group 27  scale 0x00 = 0" in out
    assert "padding bytes 00 00 00 00" in out
    assert "1.25" in out.split("RoPE")[1]

    with pytest.raises(SystemExit, match="outside the cache's 12 slots"):
        main(["inspect", str(path), "--slot", "12"])


def test_inspect_matches_dequantize(capsys, tmp_path):
    cache = make_cache(2, 8)
    rows = random_rows((3, abi.HEAD_DIM))
    slots = torch.tensor([1, 9, 14])
    reference.cake_dsv4_nvfp4_kv_rope_quantize_insert(rows, cache, slots, torch.tensor([0, 5, 9]), cos_sin_table(16))
    torch.save(cache, tmp_path / "c.pt")
    main(["inspect", str(tmp_path / "c.pt"), "--slot", "9"])
    out = capsys.readouterr().out
    values = reference.nvfp4_dequantize_sparse_mla_cache(cache, torch.tensor([9]))[0]
    scale_lines = [line for line in out.splitlines() if line.startswith("group")]
    assert len(scale_lines) == abi.NUM_GROUPS
    for g, line in enumerate(scale_lines):  # the printed max |value| is the dequantized group's
        assert f"(max |value| {values[16 * g : 16 * g + 16].abs().max().item():g})" in line


def test_precompile(capsys, monkeypatch, tmp_path):
    monkeypatch.setenv("NVFP4_MLA_CACHE_DIR", str(tmp_path))
    argv = ["precompile", "--heads", "8", "--q-head-padded", "16", "--page-size", "64", "--kv-ratio", "1", "2",
            "--append", "--slot-dtype", "int32", "--arch", "sm_80", "sm_90"]
    assert main(argv) == 0
    captured = capsys.readouterr()
    assert "8/8 done" in captured.err
    assert "8 kernels ready" in captured.out
    cubins = sorted(tmp_path.glob("*.cubin"))
    assert len(cubins) == 8 and {p.name.split("-")[0] for p in cubins} == {"sm_80", "sm_90"}

    assert main(argv) == 0  # already cached: same files, nothing new
    assert sorted(tmp_path.glob("*.cubin")) == cubins
    main(["info"])
    assert "sm_80: 4 kernels" in capsys.readouterr().out


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--heads", "8", "--q-head-padded", "16", "--inplace", "--arch", "sm_90"], "q_inplace needs"),
        (["--arch", "sm_90"], "nothing to build"),
        (["--q-head-padded", "16", "--arch", "sm_90"], "give --heads too"),
        (["--heads", "8", "--page-size", "0", "--arch", "sm_90"], "--page-size must be positive"),
    ],
)
def test_precompile_errors(capsys, argv, message):
    with pytest.raises(SystemExit):
        main(["precompile", *argv])
    assert message in capsys.readouterr().err


@pytest.mark.skipif(gpu_status().arch is not None, reason="checks the message given without a GPU")
def test_precompile_needs_arch_without_gpu(capsys):
    with pytest.raises(SystemExit):
        main(["precompile", "--heads", "8"])
    assert "give --arch" in capsys.readouterr().err


def test_bench_is_forwarded(monkeypatch):
    import types

    seen = []
    fake = types.ModuleType("nvfp4_mla.bench")
    fake.main = lambda argv: seen.append(argv) or 0
    monkeypatch.setitem(sys.modules, "nvfp4_mla.bench", fake)
    monkeypatch.setattr(nvfp4_mla, "bench", fake, raising=False)
    assert main(["bench", "--quick", "--help"]) == 0
    assert seen == [["--quick", "--help"]]
