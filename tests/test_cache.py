"""The on-disk kernel cache (no GPU): it runs only what it built for the key, and every fault is a miss.

Damage is done in each way docs/format.md section 11 names: a valid kernel of another geometry
under this key's name, a truncated file, a file of another owner, an unreadable file (as another
user: root reads everything), a directory others can write. Cross-user and multi-process cases
run real processes.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
import warnings
from pathlib import Path
from typing import NamedTuple

import pytest
import torch

from nvfp4_mla import Geometry, jit, kernel_cache, launch, precompile
from nvfp4_mla.device import Device
from nvfp4_mla.ops import decode
from nvfp4_mla.ops.writer_spec import WriterSpec

pytest.importorskip("cupy", reason="CuPy is needed for NVRTC (pip install -e '.[cu12]')")

SPEC = WriterSpec.main(16, torch.int32, 8, 16, True, False)
OTHER = WriterSpec.main(64, torch.int32, 8, 16, True, False)  # another page size
ARCH = "sm_90"
NOBODY = 65534


@pytest.fixture
def compiles(monkeypatch):
    """The specs compiled in this process, in order."""
    calls: list = []
    real = jit.compile_kernel

    def counting(spec, arch, key=None):
        calls.append(spec)
        return real(spec, arch, key)

    monkeypatch.setattr(jit, "compile_kernel", counting)
    return calls


@pytest.fixture
def kdir(tmp_path):
    directory = tmp_path / "kernels"
    directory.mkdir(mode=0o700)
    return directory


def build(layers, spec=SPEC):
    """Builds in a fresh cache of ``layers``, returning (bytes, path, warnings' texts)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        data, path = kernel_cache.KernelCache(layers).build(spec, ARCH)
    return data, path, [str(w.message) for w in caught]


def proves(data: bytes, spec, arch: str = ARCH) -> bool:
    return f"nvfp4_mla-key:{jit.kernel_key(spec, arch)}".encode() in data


def test_second_lookup_reuses_the_file(kdir, compiles):
    data, path, _ = build([kdir])
    assert path == kdir / kernel_cache.KernelCache.file_name(jit.kernel_key(SPEC, ARCH), ARCH)
    assert data[:4] == b"\x7fELF" and proves(data, SPEC)
    again, same, caught = build([kdir])
    assert (again, same, caught, len(compiles)) == (data, path, [], 1)
    build([kdir], OTHER)
    assert len(compiles) == 2 and len(list(kdir.glob("*.cubin"))) == 2


def test_kernel_of_another_geometry_under_this_name_is_refused(kdir, compiles):
    """The planted file is a valid kernel with the right name (no hash in the name to match)."""
    _, path, _ = build([kdir])
    other, _, _ = build([kdir], OTHER)
    path.write_bytes(other)
    data, rebuilt, caught = build([kdir])
    assert any("not this key's kernel" in w for w in caught), caught
    assert proves(data, SPEC) and not proves(data, OTHER) and rebuilt == path
    assert proves(path.read_bytes(), SPEC) and len(compiles) == 3


@pytest.mark.parametrize("damage", ["truncate", "flip-key", "empty"])
def test_damaged_file_is_refused_and_rebuilt(kdir, compiles, damage):
    _, path, _ = build([kdir])
    data = bytearray(path.read_bytes())
    if damage == "truncate":
        del data[len(data) // 2 :]
    elif damage == "flip-key":
        at = bytes(data).index(b"nvfp4_mla-key:") + 20
        data[at] ^= 0x01
    else:
        data.clear()
    path.write_bytes(bytes(data))
    rebuilt, _, caught = build([kdir])
    assert any("refused" in w for w in caught) and proves(rebuilt, SPEC) and len(compiles) == 2


def test_symlink_and_directory_with_a_cubins_name_are_misses(kdir, tmp_path, compiles):
    name = kernel_cache.KernelCache.file_name(jit.kernel_key(SPEC, ARCH), ARCH)
    good, _, _ = build([tmp_path / "elsewhere"])
    (kdir / name).symlink_to(tmp_path / "elsewhere" / name)  # a link to a good kernel: still refused
    data, path, caught = build([kdir])
    assert any("refused" in w for w in caught) and data == good and path == kdir / name
    assert not (kdir / name).is_symlink()  # replaced by a real file
    shutil.rmtree(tmp_path / "elsewhere")
    (kdir / name).unlink()
    (kdir / name).mkdir()
    data, path, caught = build([kdir])  # cannot publish over a directory: kept in memory, no crash
    assert proves(data, SPEC) and path is None and any("kept in memory" in w for w in caught)


root_only = pytest.mark.skipif(os.geteuid() != 0, reason="needs root to make files of another user")


@root_only
def test_file_of_another_owner_is_refused(kdir, compiles):
    _, path, _ = build([kdir])
    os.chown(path, NOBODY, NOBODY)
    data, _, caught = build([kdir])
    assert any(f"owned by uid {NOBODY}" in w for w in caught), caught
    assert proves(data, SPEC) and len(compiles) == 2 and path.stat().st_uid == os.geteuid()


@pytest.mark.parametrize("mode, who", [(0o777, "others"), (0o770, "its group")])
def test_directory_others_can_write_is_ignored(tmp_path, compiles, mode, who):
    shared, private = tmp_path / "shared", tmp_path / "private"
    build([shared])  # a valid kernel in it
    shared.chmod(mode)
    data, path, caught = build([shared, private])
    assert any(f"writable by {who}" in w for w in caught), caught
    assert path is not None and path.parent == private and proves(data, SPEC) and len(compiles) == 2


def test_group_opt_in_accepts_a_group_writable_directory(tmp_path, compiles, monkeypatch):
    shared = tmp_path / "shared"
    build([shared])
    shared.chmod(0o770)
    monkeypatch.setenv("NVFP4_MLA_CACHE_TRUST_GROUP", "1")
    _, path, caught = build([shared])
    assert path is not None and path.parent == shared and caught == [] and len(compiles) == 1


def test_glob_characters_in_the_path(tmp_path, compiles):
    directory = tmp_path / "c3_glob[1]*?"
    first = build([directory])
    assert build([directory]) == first and len(compiles) == 1


def test_layers_hit_in_order_and_miss_into_the_first_writable(tmp_path, compiles, monkeypatch):
    image, user = tmp_path / "image", tmp_path / "user"
    _, in_image, _ = build([image])
    real_access = os.access  # the image is read-only (root could write a 0555 directory anyway)
    monkeypatch.setattr(os, "access", lambda path, mode: Path(path) != image and real_access(path, mode))
    _, hit, _ = build([image, user])
    _, miss, _ = build([image, user], OTHER)
    assert hit == in_image and miss is not None and miss.parent == user and len(compiles) == 2


def test_default_directory_is_private_and_persistent(tmp_path, monkeypatch, compiles):
    monkeypatch.delenv("NVFP4_MLA_CACHE_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    _, path, _ = build(None)
    assert path is not None and path.parent == tmp_path / "xdg" / "nvfp4_mla"
    assert path.parent.stat().st_mode & 0o777 == 0o700
    build(None)
    assert len(compiles) == 1


def test_no_writable_directory_compiles_in_memory_with_one_warning(tmp_path, compiles):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    before = set(Path(tempfile.gettempdir()).glob("nvfp4_mla-[!t]*"))
    cache = kernel_cache.KernelCache([blocker / "kernels"])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        first = cache.build(SPEC, ARCH)
        cache.build(SPEC, "sm_80")
    assert first[1] is None and proves(first[0], SPEC)
    assert len([w for w in caught if "no writable kernel cache" in str(w.message)]) == 1
    assert set(Path(tempfile.gettempdir()).glob("nvfp4_mla-[!t]*")) == before  # no temp dirs


def test_stale_temp_files_are_removed(kdir, compiles):
    stale, fresh = kdir / "tmpold.tmp", kdir / "tmpnew.tmp"
    stale.write_bytes(b"half")
    fresh.write_bytes(b"in flight")
    old = time.time() - 2 * kernel_cache.STALE_TEMP_SECONDS
    os.utime(stale, (old, old))
    build([kdir])
    assert not stale.exists() and fresh.exists()


def test_precompile_into_an_unusable_directory_raises_naming_it(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("x")
    with pytest.raises(kernel_cache.CacheError, match="a-file"):
        precompile([Geometry("kv", 16)], arch=ARCH, directory=blocker / "kernels")


def test_precompile_counts_unique_kernels(kdir):
    """The main entry without q is the KV entry's kernel: one file, listed once."""
    built = precompile(
        [Geometry("main", 16, 8, 0), Geometry("kv", 16), {"entry": "append", "page_size": 1}],
        arch="sm_100",
        directory=kdir,
    )
    assert len(built) == 2 and all(b.path is not None and b.path.parent == kdir for b in built)
    assert [b.description for b in built] == [
        "writer kv, compress ratio 1, page 16, int64 slots",
        "writer append, page 1, int64 slots",
    ]
    assert all(b.arch == "sm_100" and b.launcher is None for b in built)


def test_precompile_builds_the_reader_and_decode_kernels(kdir):
    built = precompile(
        [Geometry("read", 16, slot_dtype=None, dtype=torch.bfloat16), Geometry("decode"), Geometry("decode")],
        arch=ARCH,
        directory=kdir,
    )
    specs = (*Geometry("read", 16, slot_dtype=None, dtype=torch.bfloat16).specs(ARCH), *decode.specs(ARCH))
    assert len(built) == len(specs) == 5
    for b, spec in zip(built, specs):
        assert b.path is not None and proves(b.path.read_bytes(), spec)


def test_precompile_without_arch_or_gpu_says_to_pass_arch(kdir, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ValueError, match="precompile needs arch="):
        precompile([Geometry("kv", 16)], directory=kdir)


@pytest.mark.parametrize(
    "geometry, match",
    [
        (Geometry("main", 64, 8, 12), "q_head_padded must be"),
        (Geometry("prefill", 64), "entry must be one of"),
        (Geometry("kv", 0), "page_size must be a positive int"),
        (Geometry("kv", -3), "page_size must be a positive int"),
        (Geometry("kv", 16, compress_ratio=3), "compress_ratio must be one of"),
        (Geometry("kv", 16, slot_dtype="int64"), "slot_dtype must be torch.int32 or torch.int64"),  # type: ignore[arg-type]
        (Geometry("main", 16, 8, 16, apply_q_rope="False"), "apply_q_rope must be a bool"),  # type: ignore[arg-type]
        (Geometry("main", 16, 0, 16), "num_heads must be a positive int"),
        (Geometry("read", 16, dtype=torch.float16), "dtype must be torch.float32 or torch.bfloat16"),
        (Geometry("read", 0), "page_size must be a positive int"),
    ],
    ids=str,
)
def test_precompile_validates_like_the_entries(kdir, geometry, match):
    with pytest.raises(ValueError, match=match):
        precompile([geometry], arch=ARCH, directory=kdir)


@pytest.mark.parametrize(
    "arch, match", [("sm_75", "older than sm_80"), ("90", "must look like"), (90, "must look like")]
)
def test_arch_is_validated(kdir, arch, match):
    with pytest.raises(ValueError, match=match):
        precompile([Geometry("kv", 16)], arch=arch, directory=kdir)


def test_key_holds_the_full_nvrtc_identity():
    """A patch upgrade of NVRTC replaces the library file, which is part of the key."""
    identity = jit.nvrtc_identity()
    major, minor = __import__("cupy").cuda.nvrtc.getVersion()
    assert identity.startswith(f"{major}.{minor}")
    if sys.platform == "linux":
        assert "libnvrtc" in identity and identity.count(":") >= 2


def test_concurrent_threads_compile_once(kdir, compiles):
    cache, results, barrier = kernel_cache.KernelCache([kdir]), [], threading.Barrier(8)

    def worker():
        barrier.wait()
        results.append(cache.build(SPEC, ARCH))

    threads = [threading.Thread(target=worker) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(compiles) == 1 and len(set(results)) == 1 and len(results) == 8


# ---------------------------------------------------------------- real processes

_CHILD = textwrap.dedent(
    """
    import json, os, sys, time, warnings
    import torch
    from nvfp4_mla import Geometry, jit, kernel_cache
    compiled = []
    real = jit.compile_kernel
    jit.compile_kernel = lambda spec, arch, key=None: compiled.append(1) or real(spec, arch, key)
    go = sys.argv[1]
    while go and not os.path.exists(go):
        time.sleep(0.001)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        (spec,) = Geometry("main", 16, 8, 16, slot_dtype=torch.int32).specs("sm_90")
        data, path = kernel_cache.default().build(spec, "sm_90")
    print(json.dumps({"compiles": len(compiled), "path": str(path), "warnings": [str(w.message) for w in caught]}))
    """
)


def child(env: dict, go: str = "", user: int | None = None) -> subprocess.Popen:
    prefix = ["setpriv", f"--reuid={user}", f"--regid={user}", "--clear-groups"] if user is not None else []
    return subprocess.Popen(
        [*prefix, sys.executable, "-c", _CHILD, go],
        env={**os.environ, **env},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd="/",
    )


def result(process: subprocess.Popen) -> dict:
    out, err = process.communicate(timeout=300)
    assert process.returncode == 0, err
    return json.loads(out.strip().splitlines()[-1])


def test_eight_processes_compile_a_new_key_once(kdir):
    go = kdir.parent / "go"
    processes = [child({"NVFP4_MLA_CACHE_DIR": str(kdir)}, str(go)) for _ in range(8)]
    time.sleep(1.0)  # let them import; they start together on the go file
    go.touch()
    results = [result(p) for p in processes]
    assert sum(r["compiles"] for r in results) == 1, results
    assert len({r["path"] for r in results}) == 1


def _nobody_can_run_python() -> str | None:
    if os.geteuid() != 0 or shutil.which("setpriv") is None:
        return "needs root and setpriv to run a process as another user"
    probe = subprocess.run(
        [
            "setpriv",
            f"--reuid={NOBODY}",
            f"--regid={NOBODY}",
            "--clear-groups",
            sys.executable,
            "-c",
            "import nvfp4_mla",
        ],
        capture_output=True,
        cwd="/",
    )
    return None if probe.returncode == 0 else f"user {NOBODY} cannot import nvfp4_mla from this checkout"


@pytest.fixture
def shared_tmp():
    """A directory another user can reach (pytest's tmp_path sits under a private 0700 parent),
    holding that user's home."""
    reason = _nobody_can_run_python()
    if reason:
        pytest.skip(reason)
    base = Path(tempfile.mkdtemp(prefix="nvfp4_mla-test-"))
    base.chmod(0o755)
    home = base / "home"
    home.mkdir()
    os.chown(home, NOBODY, NOBODY)
    yield base, home
    shutil.rmtree(base, ignore_errors=True)


def test_read_only_precompiled_set_serves_another_user_with_zero_compiles(shared_tmp):
    base, nobody_home = shared_tmp
    image = base / "image"
    precompile([Geometry("main", 16, 8, 16, slot_dtype=torch.int32)], arch=ARCH, directory=image)
    image.chmod(0o555)
    tmp = base / "tmp"
    tmp.mkdir()
    os.chown(tmp, NOBODY, NOBODY)
    env = {"NVFP4_MLA_CACHE_DIR": str(image), "HOME": str(nobody_home), "XDG_CACHE_HOME": "", "TMPDIR": str(tmp)}
    got = result(child(env, user=NOBODY))
    assert got["compiles"] == 0 and got["path"].startswith(str(image)) and got["warnings"] == [], got
    ours = [p for p in nobody_home.rglob("*") if "nvfp4_mla" in p.name]  # (CuPy makes its own ~/.cupy)
    assert ours == [] and list(tmp.iterdir()) == []


def test_file_unreadable_to_the_user_is_a_miss(shared_tmp):
    base, nobody_home = shared_tmp
    own = base / "theirs"
    precompile([Geometry("main", 16, 8, 16, slot_dtype=torch.int32)], arch=ARCH, directory=own)
    for path in (own, *own.iterdir()):
        os.chown(path, NOBODY, NOBODY)
    for cubin in own.glob("*.cubin"):
        cubin.chmod(0)
    got = result(child({"NVFP4_MLA_CACHE_DIR": str(own), "HOME": str(nobody_home), "XDG_CACHE_HOME": ""}, user=NOBODY))
    assert got["compiles"] == 1 and any("refused" in w for w in got["warnings"]), got


def test_missing_cupy_names_the_fix(monkeypatch):
    modules = sys.modules
    for name in [m for m in modules if m == "cupy" or m.startswith("cupy.")] + ["cupy"]:
        monkeypatch.setitem(modules, name, None)  # importing CuPy now fails
    monkeypatch.setattr(jit, "_nvrtc_identity", None)
    with pytest.raises(RuntimeError, match=r"need CuPy: install CuPy .*\.\[cu12\]"):
        launch.Launcher(b"", SPEC.template, Device(0, 90, 132, 232_448))
    with pytest.raises(RuntimeError, match=r"NVRTC is not available: install"):
        jit.compile_kernel(SPEC, ARCH)


@pytest.mark.parametrize("part", ["source", "header", "options", "arch", "nvrtc"])
def test_key_changes_with_everything_that_shapes_the_kernel(monkeypatch, part):
    before = jit.kernel_key(SPEC, ARCH)
    sources = None
    if part == "source":
        sources = {SPEC.template.file: jit.source(SPEC.template.file) + "\n// edit"}
    elif part == "header":
        sources = {jit.NUMERICS_HEADER: jit.source(jit.NUMERICS_HEADER) + "\n// edit"}
    elif part == "nvrtc":
        monkeypatch.setattr(jit, "_nvrtc_identity", jit.nvrtc_identity() + " patched")
    spec = SPEC._replace(kv_rows_per_warp=2) if part == "options" else SPEC
    assert jit.kernel_key(spec, "sm_80" if part == "arch" else ARCH, sources) != before


def test_published_kernels_are_readable_by_the_users_they_serve(kdir):
    """0644 whatever the umask: a precompiled set in an image serves other users."""
    old = os.umask(0o077)
    try:
        _, path, _ = build([kdir])
    finally:
        os.umask(old)
    assert path is not None and path.stat().st_mode & 0o777 == 0o644


class _Tile(NamedTuple):
    """A spec of one kernel family (the writer's template, another function name)."""

    page_size: int

    @property
    def template(self) -> jit.Template:
        return SPEC.template._replace(function="tile_kernel", headers=(jit.NUMERICS_HEADER, "extra.cuh"))

    def defines(self) -> dict[str, int]:
        return {"PAGE_SIZE": self.page_size}

    def describe(self) -> str:
        return f"tile {self.page_size}"


class _Row(_Tile):
    """Another family whose specs have equal fields."""

    @property
    def template(self) -> jit.Template:
        return SPEC.template._replace(function="row_kernel")


def test_specs_of_two_types_with_equal_fields_get_different_kernels(monkeypatch, tmp_path):
    """NamedTuples of different classes compare equal field by field: the loaded kernels are keyed
    by the spec's type as well, so one family never gets the other's kernel."""
    assert _Tile(16) == _Row(16) and hash(_Tile(16)) == hash(_Row(16))  # the trap
    built: list = []

    class Loaded(NamedTuple):  # stands in for launch.Launcher (no GPU here)
        data: bytes
        template: jit.Template
        device: Device

    cache = kernel_cache.KernelCache([tmp_path])
    monkeypatch.setattr(kernel_cache, "Launcher", Loaded)
    monkeypatch.setattr(kernel_cache, "device_info", lambda index: Device(index, 90, 132, 232_448))
    monkeypatch.setattr(
        cache, "build", lambda spec, arch: built.append((spec, arch)) or (spec.describe().encode(), None)
    )
    tile, row = cache.launcher(0, _Tile(16)), cache.launcher(0, _Row(16))
    assert tile is not row and (tile.template.function, row.template.function) == ("tile_kernel", "row_kernel")
    assert cache.launcher(0, _Tile(16)) is tile and cache.launcher(0, _Row(16)) is row and len(built) == 2


def test_every_listed_header_is_in_the_key():
    sources = {"extra.cuh": "// one header"}
    before = jit.kernel_key(_Tile(16), ARCH, sources)
    assert jit.kernel_key(_Tile(16), ARCH, {"extra.cuh": "// another"}) != before
    assert jit.kernel_key(_Row(16), ARCH) != jit.kernel_key(SPEC, ARCH)  # the function name too


def test_a_spec_can_name_its_architecture(tmp_path, compiles):
    """A template built for sm_90a on sm_90 GPUs: the build (and its file) is sm_90a's."""
    spec = _Pinned(16)
    assert jit.target_arch(spec, "sm_90") == "sm_90a" and jit.target_arch(SPEC, "sm_90") == "sm_90"
    data, path = kernel_cache.KernelCache([tmp_path]).build(spec, "sm_90")
    assert path is not None and path.name.startswith("sm_90a-") and proves(data, spec, "sm_90a")


class _Pinned(_Row):
    """The writer's kernel, built for sm_90a whatever the GPU's arch."""

    @property
    def template(self) -> jit.Template:
        return SPEC.template._replace(arch="sm_90a")

    def defines(self) -> dict[str, int]:
        return SPEC.defines()
