"""The on-disk kernel cache (no GPU): reuse, corruption, unwritable directory, concurrent first use."""

import threading
import warnings

import pytest
import torch

from nvfp4_mla import Geometry, jit, precompile

pytest.importorskip("cupy", reason="CuPy is needed for NVRTC (pip install 'nvfp4-mla[cu12]')")

VARIANT = Geometry("main", 16, 8, 16, slot_dtype=torch.int32).variant()


@pytest.fixture
def cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("NVFP4_MLA_CACHE_DIR", str(tmp_path / "kernels"))
    monkeypatch.setattr(jit, "_fallback_dir", None)
    return tmp_path / "kernels"


@pytest.fixture
def compile_count(monkeypatch):
    calls = []
    real = jit.compile_variant

    def counting(variant, arch):
        calls.append((variant, arch))
        return real(variant, arch)

    monkeypatch.setattr(jit, "compile_variant", counting)
    return calls


def test_cache_dir_follows_environment(cache_dir):
    assert jit.cache_dir() == cache_dir


def test_second_lookup_reuses_the_file(cache_dir, compile_count):
    first = jit.cubin_path(VARIANT, "sm_90")
    assert first.parent == cache_dir and first.read_bytes()[:4] == b"\x7fELF"
    assert jit.cubin_path(VARIANT, "sm_90") == first
    assert len(compile_count) == 1
    jit.cubin_path(VARIANT, "sm_80")  # another architecture is another file
    assert len(compile_count) == 2 and len(list(cache_dir.glob("*.cubin"))) == 2


@pytest.mark.parametrize("damage", ["truncate", "flip"])
def test_damaged_file_is_rebuilt(cache_dir, compile_count, damage):
    path = jit.cubin_path(VARIANT, "sm_90")
    data = bytearray(path.read_bytes())
    if damage == "truncate":
        del data[len(data) // 2 :]
    else:
        data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))
    rebuilt = jit.cubin_path(VARIANT, "sm_90")
    assert len(compile_count) == 2
    assert rebuilt.read_bytes()[:4] == b"\x7fELF" and len(rebuilt.read_bytes()) > len(data) // 2


def test_unwritable_directory_falls_back_with_one_warning(tmp_path, monkeypatch):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    monkeypatch.setenv("NVFP4_MLA_CACHE_DIR", str(blocker / "kernels"))
    monkeypatch.setattr(jit, "_fallback_dir", None)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        first = jit.cubin_path(VARIANT, "sm_90")
        jit.cubin_path(VARIANT, "sm_80")
    assert [str(w.message) for w in caught if "not writable" in str(w.message)].__len__() == 1
    assert first.exists() and blocker.as_posix() not in first.as_posix()


def test_concurrent_first_use_compiles_once(cache_dir, compile_count):
    paths, barrier = [], threading.Barrier(16)

    def worker():
        barrier.wait()
        paths.append(jit.cubin_path(VARIANT, "sm_90"))

    threads = [threading.Thread(target=worker) for _ in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(compile_count) == 1 and len(set(paths)) == 1 and len(paths) == 16


def test_precompile_for_a_named_arch_needs_no_gpu(cache_dir):
    paths = precompile([Geometry("kv", 128, compress_ratio=2), {"entry": "append", "page_size": 1}], arch="sm_100")
    assert len(paths) == 2 and all(p.exists() for p in paths)


def test_precompile_rejects_bad_geometry(cache_dir):
    with pytest.raises(ValueError, match="q_head_padded must be"):
        precompile([Geometry("main", 64, 8, 12)], arch="sm_90")
    with pytest.raises(ValueError, match="entry must be one of"):
        precompile([Geometry("decode", 64)], arch="sm_90")


def test_missing_cupy_names_the_fix(monkeypatch):
    modules = __import__("sys").modules
    for name in [m for m in modules if m == "cupy" or m.startswith("cupy.")] + ["cupy"]:
        monkeypatch.setitem(modules, name, None)  # importing CuPy now fails
    monkeypatch.setattr(jit, "_driver", None)
    monkeypatch.setattr(jit, "_launchers", {})  # nothing loaded yet, as in a fresh process
    with pytest.raises(RuntimeError, match=r"need CuPy: install CuPy .*nvfp4-mla\[cu12\]"):
        jit.launcher((0, *VARIANT))
    with pytest.raises(RuntimeError, match=r"NVRTC is not available: install"):
        jit.compile_variant(VARIANT, "sm_90")
