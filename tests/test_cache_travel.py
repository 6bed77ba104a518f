"""Precompiled kernels travel (docs/format.md section 11): the key holds what NVRTC is given and
nothing of NVRTC itself, so a directory of kernels hits wherever it is copied, whatever NVRTC is
installed (or none: a lookup and a load never import or load it) and whatever happens to NVRTC's
library file's path, size or time. The file records the NVRTC that compiled it; a process that
has compiled compares it, and another NVRTC's file is used all the same. Also: the default
architectures of ``nvfp4-mla precompile`` from ``TORCH_CUDA_ARCH_LIST``.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path
from typing import NamedTuple, cast

import pytest
import torch

import nvfp4_mla
from nvfp4_mla import Geometry, jit, kernel_cache, kernel_file, launch, precompile
from nvfp4_mla.cli import main
from nvfp4_mla.device import Device, device_info
from nvfp4_mla.geometry import ARCH_LIST_ENV, parse_arch_list
from nvfp4_mla.ops import writers

pytest.importorskip("cupy", reason="CuPy is needed for NVRTC (pip install -e '.[cu12]')")

SPEC = writers.main_spec(16, torch.int32, 8, 16, True, False)
ARCH = "sm_90"
SRC = str(Path(nvfp4_mla.__file__).resolve().parents[1])  # so a subprocess imports this checkout
ANOTHER_NVRTC = kernel_file.Compiler(11, 8, bytes(range(32)))


@pytest.fixture
def compiles(monkeypatch):
    """The specs compiled in this process, in order."""
    calls: list = []
    real = jit.compile_kernel

    def counting(spec, arch, key=None, sources=None):
        calls.append(spec)
        return real(spec, arch, key, sources)

    monkeypatch.setattr(jit, "compile_kernel", counting)
    return calls


def _forget_nvrtc() -> None:
    """Drops what this process worked out about NVRTC (the next compile works it out again)."""
    for name in ("nvrtc_build", "nvrtc_identity", "nvrtc_library"):  # (nvrtc_identity: the former cached one)
        clear = getattr(getattr(jit, name, None), "cache_clear", None)
        if clear is not None:
            clear()


@pytest.fixture
def no_nvrtc(monkeypatch):
    """NVRTC cannot be imported or loaded, and this process has not worked anything out about it."""

    def unavailable(*args):
        raise RuntimeError("NVRTC is not available (test)")

    _forget_nvrtc()
    monkeypatch.setitem(sys.modules, "cupy.cuda.nvrtc", None)  # importing it now fails
    monkeypatch.setattr(jit, "nvrtc_module", unavailable)
    monkeypatch.setattr(jit, "nvrtc_library", unavailable)
    yield
    monkeypatch.undo()
    _forget_nvrtc()


@pytest.fixture(scope="module")
def image(tmp_path_factory) -> Path:
    """A precompiled directory, as a container image's build makes it (mode 0755, files 0644)."""
    directory = tmp_path_factory.mktemp("image") / "kernels"
    kernel_cache.KernelCache([]).build(SPEC, ARCH, directory)
    return directory


def _name(spec=SPEC, arch: str = ARCH) -> str:
    return kernel_cache.KernelCache.file_name(jit.kernel_key(spec, arch), arch)


def _build(layers, spec=SPEC, arch: str = ARCH) -> tuple[bytes, Path | None, list[str]]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        data, path = kernel_cache.KernelCache(layers).build(spec, arch)
    return data, path, [str(w.message) for w in caught]


def _cubin(path: Path) -> bytes:
    return kernel_file.unpack(path.read_bytes(), jit.kernel_key(SPEC, ARCH), ARCH)


# ---------------------------------------------------------------- the key


def test_the_key_needs_no_nvrtc(no_nvrtc):
    """Every input of the compile, nothing of the compiler: worked out with NVRTC unavailable."""
    key = jit.kernel_key(SPEC, ARCH)
    assert len(key) == 64 and jit.loaded_nvrtc() is None


def test_a_directory_copied_to_another_path_hits_with_no_compile(image, tmp_path, compiles):
    copy = tmp_path / "elsewhere" / "kernels"
    shutil.copytree(image, copy)
    data, path, caught = _build([copy])
    assert (path, caught, compiles) == (copy / _name(), [], [])
    assert data == _cubin(image / _name())
    # precompile into the copy finds everything there too
    built = precompile(
        [Geometry("main", 16, num_heads=8, q_head_padded=16, slot_dtype=torch.int32)], arch=ARCH, directory=copy
    )
    assert [p.path for p in built] == [copy / _name()] and compiles == []


def test_touching_the_nvrtc_library_changes_nothing(image, compiles, monkeypatch):
    """``touch libnvrtc.so.12`` (and a patch upgrade that keeps the bytes' size) as ``os.stat``
    reports it: the same key, a hit with no compile, the same recorded NVRTC."""
    before = jit.kernel_key(SPEC, ARCH)
    jit.compile_kernel(SPEC, ARCH)  # NVRTC loaded, as after any compile
    compiles.clear()
    library = os.path.realpath(jit.nvrtc_library()[1])
    recorded = getattr(jit, "nvrtc_build", lambda: None)()
    real_stat = os.stat

    def touched(path, *args, **kwargs):
        st = real_stat(path, *args, **kwargs)
        if isinstance(path, (str, os.PathLike)) and os.path.realpath(path) == library:
            later = 3600 * 10**9
            times = (st.st_atime + 3600, st.st_mtime + 3600, st.st_ctime + 3600)
            ns = {"st_atime_ns": st.st_atime_ns + later, "st_mtime_ns": st.st_mtime_ns + later}
            return os.stat_result((*tuple(st)[:7], *times), {**ns, "st_ctime_ns": st.st_ctime_ns + later})
        return st

    monkeypatch.setattr(os, "stat", touched)
    _forget_nvrtc()
    assert os.stat(library).st_mtime_ns != real_stat(library).st_mtime_ns  # the stand-in works
    assert jit.kernel_key(SPEC, ARCH) == before
    _, path, caught = _build([image])
    assert (path, caught, compiles) == (image / _name(), [], [])
    assert getattr(jit, "nvrtc_build", lambda: None)() == recorded  # the library's bytes, not its time


def test_nvrtc_installed_at_another_path_changes_nothing(image, tmp_path, compiles, monkeypatch):
    """The same libnvrtc at another path (a venv elsewhere than the image's build): the same key,
    a hit with no compile, the same recorded NVRTC (its bytes' digest)."""
    jit.compile_kernel(SPEC, ARCH)  # NVRTC loaded, as after any compile
    compiles.clear()
    before, recorded = jit.kernel_key(SPEC, ARCH), getattr(jit, "nvrtc_build", lambda: None)()
    lib, path = jit.nvrtc_library()
    elsewhere = tmp_path / "venv" / "lib" / Path(path).name
    elsewhere.parent.mkdir(parents=True)
    elsewhere.symlink_to(path)
    _forget_nvrtc()
    monkeypatch.setattr(jit, "nvrtc_library", lambda: (lib, str(elsewhere)))
    assert jit.kernel_key(SPEC, ARCH) == before
    _, found, caught = _build([image])
    assert (found, caught, compiles) == (image / _name(), [], [])
    assert getattr(jit, "nvrtc_build", lambda: None)() == recorded
    monkeypatch.undo()
    _forget_nvrtc()


# ---------------------------------------------------------------- no NVRTC


def test_a_lookup_finds_and_verifies_a_file_without_nvrtc(image, tmp_path, no_nvrtc):
    copy = tmp_path / "kernels"
    shutil.copytree(image, copy)
    cache = kernel_cache.KernelCache([copy])
    found = cache.lookup(jit.kernel_key(SPEC, ARCH), ARCH)
    assert found is not None and found == (_cubin(copy / _name()), copy / _name())
    data, path, caught = _build([copy])
    assert (data, path, caught) == (found[0], copy / _name(), [])
    assert jit.loaded_nvrtc() is None
    with pytest.raises(RuntimeError, match="NVRTC is not available"):  # a miss does need it
        _build([tmp_path / "empty"], SPEC._replace(page_size=32))


def test_a_process_without_cupy_finds_a_precompiled_kernel(image):
    """A fresh interpreter where CuPy (so NVRTC) cannot be imported finds and verifies the file,
    and no libnvrtc is ever mapped into it."""
    code = textwrap.dedent(
        """
        import json, sys
        from pathlib import Path
        for name in ("cupy", "cupy.cuda", "cupy.cuda.nvrtc", "cupy_backends", "cuda.pathfinder"):
            sys.modules[name] = None  # importing it now fails
        import torch
        from nvfp4_mla import jit, kernel_cache
        from nvfp4_mla.ops import writers

        spec = writers.main_spec(16, torch.int32, 8, 16, True, False)
        data, path = kernel_cache.KernelCache([Path(sys.argv[1])]).build(spec, "sm_90")
        with open("/proc/self/maps") as maps:
            mapped = "libnvrtc" in maps.read()
        print(json.dumps({"path": str(path), "elf": data[:4] == b"\\x7fELF", "mapped": mapped}))
        """
    )
    env = {**os.environ, "PYTHONPATH": SRC}
    done = subprocess.run([sys.executable, "-c", code, str(image)], env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout.splitlines()[-1])
    assert result == {"path": str(image / _name()), "elf": True, "mapped": False}


# ---------------------------------------------------------------- the NVRTC a file records


def _planted_by_another_nvrtc(directory: Path) -> bytes:
    """This key's file, its NVRTC fields those of another NVRTC (11.8); returns its cubin."""
    directory.mkdir(mode=0o700)
    cubin = jit.compile_kernel(SPEC, ARCH).cubin
    (directory / _name()).write_bytes(kernel_file.pack(cubin, jit.kernel_key(SPEC, ARCH), ARCH, ANOTHER_NVRTC))
    return cubin


def test_a_file_of_another_nvrtc_is_used_and_logged(tmp_path, compiles, caplog):
    """Compared only when this process has NVRTC loaded (it compiled): a mismatch is a DEBUG line,
    not a miss. Its cubin is the product of the same sources and options."""
    cubin = _planted_by_another_nvrtc(tmp_path / "kernels")
    compiles.clear()
    ours = jit.nvrtc_build()
    with caplog.at_level(logging.DEBUG, logger="nvfp4_mla"):
        data, path, caught = _build([tmp_path / "kernels"])
    assert (data, path, caught, compiles) == (cubin, tmp_path / "kernels" / _name(), [], [])
    lines = [r.getMessage() for r in caplog.records if "compiled by NVRTC" in r.getMessage()]
    assert len(lines) == 1 and f"NVRTC 11.8 sha256:{bytes(range(32)).hex()[:12]}" in lines[0]
    assert f"this process has {ours.describe()}" in lines[0]


def test_a_file_of_another_nvrtc_without_nvrtc_is_used_silently(tmp_path, caplog, monkeypatch):
    cubin = _planted_by_another_nvrtc(tmp_path / "kernels")
    _forget_nvrtc()
    monkeypatch.setattr(jit, "nvrtc_module", lambda: (_ for _ in ()).throw(RuntimeError("NVRTC is not available")))
    with caplog.at_level(logging.DEBUG, logger="nvfp4_mla"):
        data, _, caught = _build([tmp_path / "kernels"])
    assert (data, caught) == (cubin, []) and not [r for r in caplog.records if "compiled by NVRTC" in r.getMessage()]
    monkeypatch.undo()
    _forget_nvrtc()


def test_files_of_the_former_format_are_ignored(tmp_path, compiles):
    """Format 1 (the key held NVRTC's path, size and time): its files are named .v1 and never
    looked up; its trailer under this format's name is refused by its version."""
    directory = tmp_path / "kernels"
    directory.mkdir(mode=0o700)
    key = jit.kernel_key(SPEC, ARCH)
    (directory / f"{ARCH}-{key[:32]}.v1.cubin").write_bytes(b"a kernel of format 1")
    _, path, caught = _build([directory])
    assert caught == [] and path == directory / _name() and len(compiles) == 1
    assert kernel_file.FORMAT_VERSION == 2 and _name().endswith(".v2.cubin")


# ---------------------------------------------------------------- the driver refuses an image's file


def test_a_file_the_driver_refuses_falls_through_to_the_next_layer(tmp_path, compiles, monkeypatch):
    """An image's file this driver will not take (built by a newer NVRTC, say) stays in its
    read-only layer: the kernel compiled afresh into the next layer is found there by every later
    process, not compiled again."""
    image_dir, own = tmp_path / "image", tmp_path / "own"
    image_dir.mkdir(mode=0o755)
    marked = jit.source(SPEC.template.file) + '\nextern "C" __device__ const int nvfp4_mla_image_build = 1;\n'
    key = jit.kernel_key(SPEC, ARCH)
    cubin = jit.compile_kernel(SPEC, ARCH, key, {SPEC.template.file: marked}).cubin
    (image_dir / _name()).write_bytes(kernel_file.pack(cubin, key, ARCH, ANOTHER_NVRTC))
    compiles.clear()

    class Loaded(NamedTuple):
        data: bytes

    def load(data, template, device):
        if b"nvfp4_mla_image_build" in data:
            raise launch.LoadError("CUDA_ERROR_UNSUPPORTED_PTX_VERSION (test)")
        return Loaded(data)

    prepare = kernel_cache.prepare_dir
    read_only = lambda d, *a: "read-only (test)" if d == image_dir else prepare(d, *a)  # noqa: E731 (root writes anything)
    monkeypatch.setattr(kernel_cache, "prepare_dir", read_only)
    monkeypatch.setattr(kernel_cache, "Launcher", load)
    monkeypatch.setattr(kernel_cache, "device_info", lambda index: Device(index, 90, 132, 232_448))
    for expected in (1, 0):  # the first process compiles into its own layer; the next finds it there
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            loaded = cast(Loaded, kernel_cache.KernelCache([image_dir, own]).launcher(0, SPEC))
        assert b"nvfp4_mla_image_build" not in loaded.data and len(compiles) == expected
        assert [str(w.message) for w in caught if "refused by the driver" in str(w.message)]
        compiles.clear()
    assert (own / _name()).exists() and (image_dir / _name()).read_bytes().startswith(cubin)  # left as it was


# ---------------------------------------------------------------- TORCH_CUDA_ARCH_LIST


@pytest.mark.parametrize(
    ("text", "archs", "ptx"),
    [
        ("8.0 8.6 9.0 9.0a", ["sm_80", "sm_86", "sm_90", "sm_90a"], 0),
        ("8.0;9.0+PTX", ["sm_80", "sm_90"], 1),
        (" 10.0a ; 12.0 ;; 9.0 9.0 ", ["sm_100a", "sm_120", "sm_90"], 0),
        ("8.9+ptx;10.0f", ["sm_89", "sm_100f"], 1),
    ],
)
def test_torch_cuda_arch_list_is_parsed(text, archs, ptx):
    listed = parse_arch_list(text)
    assert listed.archs == archs and len(listed.notes) == ptx
    assert all(ARCH_LIST_ENV in note and "+PTX" in note and "ignored" in note for note in listed.notes)


@pytest.mark.parametrize(
    ("text", "match"),
    [
        ("7.5 8.0", r"TORCH_CUDA_ARCH_LIST=.*7\.5 \(sm_75\).*older than sm_80"),
        ("6.0+PTX", r"TORCH_CUDA_ARCH_LIST=.*older than sm_80"),
        ("Hopper", r"TORCH_CUDA_ARCH_LIST=.*cannot read 'Hopper'"),
        ("9,0", r"TORCH_CUDA_ARCH_LIST=.*cannot read '9,0'"),
        (" ; ", r"TORCH_CUDA_ARCH_LIST=.*names no architecture"),
    ],
)
def test_torch_cuda_arch_list_errors_name_the_variable(text, match):
    with pytest.raises(ValueError, match=match):
        parse_arch_list(text)


@pytest.fixture
def no_gpu(monkeypatch):
    """The command sees no usable GPU, here or on a GPU machine."""
    from nvfp4_mla.cli import precompile as command

    monkeypatch.setattr(command, "gpu_unavailable_reason", lambda *a: "no GPU (test)")
    monkeypatch.setattr(command, "device_info", lambda *a: pytest.fail("the GPU was asked for its arch"))


KV_ARGV = ["precompile", "--kv-ratio", "1", "--page-size", "16", "--slot-dtype", "int32"]


def test_precompile_takes_its_architectures_from_torch_cuda_arch_list(tmp_path, monkeypatch, capsys, no_gpu):
    monkeypatch.setenv(ARCH_LIST_ENV, "9.0;8.0+PTX")
    assert main([*KV_ARGV, "--cache-dir", str(tmp_path / "kernels")]) == 0
    captured = capsys.readouterr()
    archs = sorted(p.name.split("-")[0] for p in (tmp_path / "kernels").glob("*.cubin"))
    assert archs == ["sm_80", "sm_90"] and captured.out.splitlines()[-1] == f"2 kernels ready in {tmp_path / 'kernels'}"
    assert "nvfp4-mla: note: TORCH_CUDA_ARCH_LIST: the +PTX of 8.0+PTX is ignored" in captured.err


def test_arch_beats_torch_cuda_arch_list(tmp_path, monkeypatch, capsys, no_gpu):
    monkeypatch.setenv(ARCH_LIST_ENV, "7.0")  # not even read
    assert main([*KV_ARGV, "--arch", "sm_90", "--cache-dir", str(tmp_path / "kernels")]) == 0
    assert [p.name.split("-")[0] for p in (tmp_path / "kernels").glob("*.cubin")] == ["sm_90"]


@pytest.mark.parametrize(("value", "message"), [("7.0 9.0", "older than sm_80"), ("ampere", "cannot read")])
def test_precompile_refuses_a_bad_torch_cuda_arch_list(tmp_path, monkeypatch, capsys, no_gpu, value, message):
    monkeypatch.setenv(ARCH_LIST_ENV, value)
    with pytest.raises(SystemExit) as exit_info:
        main([*KV_ARGV, "--cache-dir", str(tmp_path / "kernels")])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and ARCH_LIST_ENV in err and message in err and "give --arch" in err


@pytest.mark.parametrize("value", [None, "", "  "])
def test_without_torch_cuda_arch_list_or_gpu_precompile_asks_for_arch(tmp_path, monkeypatch, capsys, no_gpu, value):
    if value is None:
        monkeypatch.delenv(ARCH_LIST_ENV, raising=False)
    else:
        monkeypatch.setenv(ARCH_LIST_ENV, value)
    with pytest.raises(SystemExit):
        main([*KV_ARGV, "--cache-dir", str(tmp_path / "kernels")])
    assert f"give --arch (e.g. --arch sm_90) or set {ARCH_LIST_ENV}" in capsys.readouterr().err


# ---------------------------------------------------------------- the load (GPU)


@pytest.mark.gpu
def test_a_precompiled_kernel_loads_and_runs_without_nvrtc(tmp_path):
    """Precompiled here, then loaded and run in a fresh process whose NVRTC cannot load: the
    reference's bytes, no compile, no libnvrtc mapped by the load (torch's CUDA may map its own)."""
    arch = device_info(torch.cuda.current_device()).arch
    directory = tmp_path / "kernels"
    precompile([Geometry("append", 16, slot_dtype=torch.int32)], arch=arch, directory=directory)
    code = textwrap.dedent(
        """
        import json, sys
        from pathlib import Path
        import torch
        import nvfp4_mla
        from nvfp4_mla import jit, kernel_cache, reference
        from nvfp4_mla.testing import make_cache, random_rows, random_slots

        def unavailable(*args):
            raise RuntimeError("NVRTC is not available (test)")

        def nvrtc_mapped():
            with open("/proc/self/maps") as maps:
                return {line.split()[-1] for line in maps if "libnvrtc" in line}

        jit.nvrtc_module = jit.nvrtc_library = jit.nvrtc_build = jit.compile_kernel = unavailable
        jit.loaded_nvrtc = lambda: None
        import cupy  # what CuPy and torch's CUDA map themselves is theirs, not the load's
        rows, slots = random_rows((5, 512), "cuda"), random_slots(5, 32, torch.int32).cuda()
        before = nvrtc_mapped()
        want = make_cache(2, 16)
        reference.nvfp4_quantize_append_sparse_mla_cache(rows.cpu(), slots.cpu(), want)
        cache = make_cache(2, 16, device="cuda")
        library = nvfp4_mla.KernelLibrary(kernel_cache.KernelCache([Path(sys.argv[1])]))
        nvfp4_mla.nvfp4_quantize_append_sparse_mla_cache(rows, slots, cache, library=library)
        mapped = bool(nvrtc_mapped() - before)
        print(json.dumps({"equal": torch.equal(cache.cpu(), want), "mapped": mapped}))
        """
    )
    env = {**os.environ, "PYTHONPATH": SRC}
    done = subprocess.run([sys.executable, "-c", code, str(directory)], env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout.splitlines()[-1]) == {"equal": True, "mapped": False}
