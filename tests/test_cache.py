"""The on-disk kernel cache (no GPU): it runs only what it built for the key, and every fault is a miss.

Damage is done in each way docs/format.md section 11 names: a valid kernel of another geometry
under this key's name, a truncated file, a file of another owner, an unreadable file (as another
user: root reads everything), a directory others can write. Cross-user and multi-process cases
run real processes.
"""

from __future__ import annotations

import hashlib
import json
import os
import pwd
import shutil
import stat
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
import warnings
from pathlib import Path
from typing import NamedTuple, cast

import pytest
import torch

import nvfp4_mla
from nvfp4_mla import Geometry, jit, kernel_cache, kernel_file, launch, precompile
from nvfp4_mla.device import Device, device_info
from nvfp4_mla.ops import decode, writers

pytest.importorskip("cupy", reason="CuPy is needed for NVRTC (pip install -e '.[cu12]')")

SPEC = writers.main_spec(16, torch.int32, 8, 16, True, False)
OTHER = writers.main_spec(64, torch.int32, 8, 16, True, False)  # another page size
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
    """Whether ``data`` holds the whole proof of ``spec``'s key, NUL-terminated as compiled in."""
    return f"nvfp4_mla-key:{jit.kernel_key(spec, arch)}\0".encode() in data


def test_second_lookup_reuses_the_file(kdir, compiles):
    data, path, _ = build([kdir])
    assert path == kdir / kernel_cache.KernelCache.file_name(jit.kernel_key(SPEC, ARCH), ARCH)
    assert data[:4] == b"\x7fELF" and proves(data, SPEC)
    again, same, caught = build([kdir])
    assert (again, same, caught, len(compiles)) == (data, path, [], 1)
    build([kdir], OTHER)
    assert len(compiles) == 2 and len(list(kdir.glob("*.cubin"))) == 2


def _planted(kind: str, spec=SPEC, other_spec=OTHER, arch: str = ARCH) -> bytes:
    """The bytes of a damaged or foreign file put under ``spec``'s name (an audit's cases and more);
    ``other_spec`` is another kernel of the same family."""
    key, other_key = jit.kernel_key(spec, arch), jit.kernel_key(other_spec, arch)
    good = kernel_file.pack(jit.compile_kernel(spec, arch).cubin, key, arch)
    other = jit.compile_kernel(other_spec, arch).cubin
    if kind == "cut 512":
        return good[:-512]
    if kind == "cut to 4 KiB":
        return good[: (len(good) - 1) // 4096 * 4096]
    if kind == "appended":
        return good + b"\0" * 4096
    if kind == "key only":
        return kernel_file.proof(key)
    if kind == "other kernel":
        return kernel_file.pack(other, other_key, arch)
    if kind == "other + key":  # the audit's wrong kernel that ran: another cubin, this key appended
        return kernel_file.pack(other + kernel_file.proof(key) + b"\0", key, arch)
    if kind == "sm_80 build":
        return kernel_file.pack(jit.compile_kernel(spec, "sm_80", key).cubin, key, arch)
    if kind == "key's other half":  # the file name holds key[:32]: the proof must be the whole key
        twin = key[:32] + "0" * 32
        return kernel_file.pack(jit.compile_kernel(spec, arch, twin).cubin, key, arch)
    if kind == "renamed kernel":  # passes every file check; the driver finds no such kernel
        source = jit.source(spec.template.file)
        renamed = source.replace(f" {spec.template.function}(", f" {spec.template.function}_x(")
        return kernel_file.pack(jit.compile_kernel(spec, arch, key, {spec.template.file: renamed}).cubin, key, arch)
    if kind == "flipped byte":
        flipped = bytearray(good)
        flipped[len(good) // 3] ^= 0x10
        return bytes(flipped)
    return b""


DAMAGE = {
    "cut 512": "cut or extended",
    "cut to 4 KiB": "cut or extended",
    "appended": "cut or extended",
    "key only": "cut or extended",
    "other kernel": "packed for key",
    "other + key": "the key is not inside a loaded section",
    "sm_80 build": "built for sm_80, not sm_90",
    "key's other half": "the key is not inside a loaded section",
    "flipped byte": "digest mismatch",
    "empty": "empty file",
}


@pytest.mark.parametrize("kind", DAMAGE)
def test_damaged_or_foreign_file_is_refused_rebuilt_then_hit(kdir, compiles, kind):
    """Each damaged or planted file, in a trusted directory under the right name, is refused with
    one warning naming the file and the reason, compiled afresh, and the next run is a hit."""
    path = kdir / kernel_cache.KernelCache.file_name(jit.kernel_key(SPEC, ARCH), ARCH)
    path.write_bytes(_planted(kind))
    planted = len(compiles)
    data, rebuilt, caught = build([kdir])
    assert [w for w in caught if str(path) in w and DAMAGE[kind] in w], caught
    assert proves(data, SPEC) and rebuilt == path and len(compiles) == planted + 1
    assert build([kdir]) == (data, path, []) and len(compiles) == planted + 1  # a hit, no warning


def test_the_file_is_the_whole_cubin_then_its_trailer(kdir):
    data, path, _ = build([kdir])
    on_disk = path.read_bytes()
    assert on_disk.startswith(data) and kernel_file.unpack(on_disk, jit.kernel_key(SPEC, ARCH), ARCH) == data


def test_files_of_the_former_format_are_never_looked_up(kdir, compiles):
    key = jit.kernel_key(SPEC, ARCH)
    (kdir / f"{ARCH}-{key[:32]}.cubin").write_bytes(b"a short cubin of an older version")
    _, path, caught = build([kdir])
    assert caught == [] and path.name.endswith(f".v{kernel_file.FORMAT_VERSION}.cubin") and len(compiles) == 1


def test_a_fifo_or_a_device_node_is_refused_without_reading(kdir, compiles):
    """Opened without blocking and refused by its type (the size cap would also say no; the
    reason names the type)."""
    path = kdir / kernel_cache.KernelCache.file_name(jit.kernel_key(SPEC, ARCH), ARCH)
    os.mkfifo(path)
    _, rebuilt, caught = build([kdir])
    assert any("not a regular file" in w for w in caught) and rebuilt == path
    assert not stat.S_ISFIFO(path.stat().st_mode)
    if os.geteuid() == 0:
        path.unlink()
        os.mknod(path, 0o600 | stat.S_IFCHR, os.makedev(1, 5))  # /dev/zero: would read forever
        _, _, caught = build([kdir])
        assert any("not a regular file" in w for w in caught)


def test_a_huge_sparse_file_is_refused_by_its_size(kdir, compiles):
    path = kdir / kernel_cache.KernelCache.file_name(jit.kernel_key(SPEC, ARCH), ARCH)
    with path.open("wb") as f:
        f.truncate(6 << 30)  # 6 GiB, sparse
    _, _, caught = build([kdir])
    assert any("over the 16 MiB cap" in w for w in caught)


def _with_note_sections(cubin: bytes, count: int, length: int) -> bytes:
    """``cubin`` with a section-header table appended: its own sections, then ``count`` note
    sections that all overlap its first ``length`` bytes (a hostile file, digested like any other)."""
    header = list(kernel_file._EHDR.unpack_from(cubin))
    shoff, shnum = header[6], header[12]
    table = cubin[shoff : shoff + shnum * kernel_file._SHDR.size]
    note = kernel_file._SHDR.pack(0, kernel_file._SHT_NOTE, 0, 0, 0, length, 0, 0, 1, 0)
    header[6], header[12] = len(cubin), shnum + count
    return kernel_file._EHDR.pack(*header) + cubin[kernel_file._EHDR.size :] + table + note * count


def test_a_file_of_many_overlapping_note_sections_is_a_miss(kdir, compiles):
    """A re-digested file (a digest is no signature) with 65,535 sections, nearly all overlapping
    notes: refused by the cap on sections before they cost anything, then compiled afresh.
    (test_cache_files reproduces the audit's file, whose notes cover 12 MiB each.)"""
    key = jit.kernel_key(SPEC, ARCH)
    path = kdir / kernel_cache.KernelCache.file_name(key, ARCH)
    cubin = jit.compile_kernel(SPEC, ARCH).cubin
    hostile = _with_note_sections(cubin, 0xFFFF - kernel_file._EHDR.unpack_from(cubin)[12], 64)
    path.write_bytes(kernel_file.pack(hostile, key, ARCH))
    data, rebuilt, caught = build([kdir])
    assert any(str(path) in w and "65535 sections" in w and "over the caps" in w for w in caught), caught
    assert data == cubin and rebuilt == path and len(compiles) == 2


def test_a_lock_file_planted_as_a_symlink_is_not_followed(kdir, tmp_path, compiles):
    victim = tmp_path / "victim"
    victim.write_bytes(b"precious")
    name = kernel_cache.KernelCache.file_name(jit.kernel_key(SPEC, ARCH), ARCH)
    (kdir / (name + kernel_cache.LOCK_SUFFIX)).symlink_to(victim)
    data, path, caught = build([kdir])
    assert path is None and proves(data, SPEC) and any("kept in memory" in w for w in caught)
    assert victim.read_bytes() == b"precious"


def test_a_lock_file_that_is_not_a_regular_file_is_refused(kdir, compiles):
    """A FIFO planted as the lock file: flock would take it, but only a regular file of ours is a
    lock, so the kernel is kept in memory and nothing is written."""
    name = kernel_cache.KernelCache.file_name(jit.kernel_key(SPEC, ARCH), ARCH)
    os.mkfifo(kdir / (name + kernel_cache.LOCK_SUFFIX))
    data, path, caught = build([kdir])
    assert path is None and proves(data, SPEC) and len(compiles) == 1
    assert any("is not a regular file" in w and "kept in memory" in w for w in caught), caught
    assert not (kdir / name).exists()


# Holds a flock on argv[1] until its stdin closes, or for two minutes at most: a build that waits
# for the lock for ever then fails its test instead of hanging it.
_HOLDER = textwrap.dedent(
    """
    import fcntl, os, select, sys
    fd = os.open(sys.argv[1], os.O_RDONLY | os.O_CREAT, 0o644)
    fcntl.flock(fd, fcntl.LOCK_EX)
    print("held", flush=True)
    select.select([sys.stdin], [], [], 120)
    """
)


def test_a_lock_held_by_another_process_is_waited_for_a_bounded_time(kdir, compiles, monkeypatch):
    """Another process holds the key's lock and never lets go (hung, stopped): after
    NVFP4_MLA_LOCK_TIMEOUT seconds the kernel is compiled in memory, not written, with a warning;
    precompile into a directory raises instead. Once the lock is free, the next build writes."""
    name = kernel_cache.KernelCache.file_name(jit.kernel_key(SPEC, ARCH), ARCH)
    monkeypatch.setenv("NVFP4_MLA_LOCK_TIMEOUT", "0.2")
    holder = subprocess.Popen(
        [sys.executable, "-c", _HOLDER, str(kdir / (name + kernel_cache.LOCK_SUFFIX))],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert holder.stdin is not None and holder.stdout is not None
    try:
        assert holder.stdout.readline() == "held\n"
        data, path, caught = build([kdir])
        with pytest.raises(kernel_cache.CacheError, match=r"held by another process for over 0\.2 s"):
            kernel_cache.KernelCache([]).build(SPEC, ARCH, directory=kdir)
    finally:
        holder.stdin.close()
        holder.wait()
    assert path is None and proves(data, SPEC) and len(compiles) == 1  # precompile raised before compiling
    assert any("held by another process for over 0.2 s" in w and "not written" in w for w in caught), caught
    assert not (kdir / name).exists()
    assert build([kdir])[1:] == (kdir / name, []) and len(compiles) == 2


def test_a_symlinked_layer_of_another_user_is_refused(tmp_path, compiles):
    if os.geteuid() != 0:
        pytest.skip("needs root to make a link of another user")
    mine, planted = tmp_path / "mine", tmp_path / "planted"
    build([mine])
    planted.symlink_to(mine)
    os.chown(planted, NOBODY, NOBODY, follow_symlinks=False)
    _, path, caught = build([planted, tmp_path / "own"])
    assert any("symbolic link owned by uid" in w for w in caught) and path.parent == tmp_path / "own"


def test_the_driver_refusing_a_cached_image_is_a_miss(kdir, compiles, monkeypatch):
    """A load failure (an image the driver will not take) warns once, compiles afresh over the
    file and carries on; a kernel compiled just now and still refused is an error."""
    loads: list = []

    class Loaded(NamedTuple):
        data: bytes
        template: jit.Template
        device: Device

    def load(data, template, device):
        loads.append(data)
        if len(loads) == 1:
            raise launch.LoadError("CUDA_ERROR_INVALID_IMAGE: device kernel image is invalid")
        return Loaded(data, template, device)

    build([kdir])  # a file the (stand-in) driver will refuse once
    monkeypatch.setattr(kernel_cache, "Launcher", load)
    monkeypatch.setattr(kernel_cache, "device_info", lambda index: Device(index, 90, 132, 232_448))
    cache = kernel_cache.KernelCache([kdir])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        loaded = cast(Loaded, cache.launcher(0, SPEC))  # the stand-in Launcher
    assert any("refused by the driver (CUDA_ERROR_INVALID_IMAGE" in str(w.message) for w in caught)
    assert len(loads) == 2 and len(compiles) == 2 and proves(loaded.data, SPEC)

    def refuse(*args):
        raise launch.LoadError("still refused")

    monkeypatch.setattr(kernel_cache, "Launcher", refuse)
    with warnings.catch_warnings(record=True), pytest.raises(launch.LoadError, match="still refused"):
        warnings.simplefilter("always")
        kernel_cache.KernelCache([kdir]).launcher(0, OTHER)


def test_stale_temp_files_of_ours_are_removed_and_no_others(kdir, compiles):
    ours, fresh = kdir / f"{kernel_cache.TEMP_PREFIX}old.tmp", kdir / f"{kernel_cache.TEMP_PREFIX}new.tmp"
    theirs = kdir / "tmpold.tmp"
    for path in (ours, fresh, theirs):
        path.write_bytes(b"half")
    old = time.time() - 2 * kernel_cache.STALE_TEMP_SECONDS
    for path in (ours, theirs):
        os.utime(path, (old, old))
    build([kdir])
    assert not ours.exists() and fresh.exists() and theirs.exists()


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to make files of another user")
def test_stale_temp_files_of_another_user_are_kept(kdir, compiles):
    """A temp file of our name and age, but another user's (a group-shared directory): not ours
    to remove."""
    theirs = kdir / f"{kernel_cache.TEMP_PREFIX}theirs.tmp"
    theirs.write_bytes(b"half")
    os.chown(theirs, NOBODY, NOBODY)
    old = time.time() - 2 * kernel_cache.STALE_TEMP_SECONDS
    os.utime(theirs, (old, old))
    _, path, _ = build([kdir])
    assert path is not None and theirs.exists() and theirs.stat().st_uid == NOBODY


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


def test_a_created_directory_gets_its_mode_whatever_the_umask(tmp_path):
    old = os.umask(0o077)
    try:
        assert kernel_cache.prepare_dir(tmp_path / "parent" / "image", kernel_cache.IMAGE_MODE) is None
    finally:
        os.umask(old)
    assert (tmp_path / "parent" / "image").stat().st_mode & 0o777 == 0o755


@pytest.mark.parametrize("swap", ["symbolic link", "directory of another user"])
def test_a_created_directory_swapped_after_the_mkdir_changes_no_other_mode(tmp_path, monkeypatch, swap):
    """precompile --cache-dir run as root under a parent others can write: between the mkdir and
    the mode change, the new directory is swapped for a link to a file, or for another user's
    directory. The mode is set through a descriptor of what was created (never by path, never
    through a link), so nothing else changes mode and the directory is refused."""
    if swap != "symbolic link" and os.geteuid() != 0:
        pytest.skip("needs root to make a directory of another user")
    victim = tmp_path / "victim"
    if swap == "symbolic link":
        victim.write_bytes(b"precious")
    else:
        victim.mkdir()
        os.chown(victim, NOBODY, NOBODY)
    victim.chmod(0o600)
    target = tmp_path / "parent" / "kernels"
    real_mkdir = os.mkdir

    def mkdir_then_swap(path, mode=0o777, *, dir_fd=None):
        real_mkdir(path, mode, dir_fd=dir_fd)
        if os.fspath(path) == str(target):
            os.rmdir(path)
            if swap == "symbolic link":
                os.symlink(victim, path)
            else:
                os.rename(victim, path)

    monkeypatch.setattr(os, "mkdir", mkdir_then_swap)
    reason = kernel_cache.prepare_dir(target, kernel_cache.IMAGE_MODE)
    monkeypatch.undo()
    moved = victim if swap == "symbolic link" else target
    assert moved.stat().st_mode & 0o777 == 0o600
    assert reason is not None and str(target) in reason, reason


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
    # the reader, the sm_90a wgmma kernel's NARROW build and its 64-head build alone and in
    # clusters (whole rows, then half rows), three mma.sync head tiles, the combine's four builds,
    # the scheduler's two
    assert len(built) == len(specs) == 15
    assert [b.arch for b in built] == ["sm_90"] + ["sm_90a"] * 5 + ["sm_90"] * 9
    for b, spec in zip(built, specs):
        assert b.path is not None and proves(b.path.read_bytes(), spec, b.arch)


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


def test_files_record_the_nvrtc_that_compiled_them(kdir):
    """Not in the key (test_cache_travel): the file records NVRTC's version and its library's
    SHA-256, the bytes of the libnvrtc CuPy loaded."""
    _, path, _ = build([kdir])
    compiler = kernel_file.read(path.read_bytes(), jit.kernel_key(SPEC, ARCH), ARCH).compiler
    major, minor = __import__("cupy").cuda.nvrtc.getVersion()
    library = jit.nvrtc_library()[1]
    digest = hashlib.sha256(Path(library).read_bytes()).digest()
    assert compiler == kernel_file.Compiler(major, minor, digest) == jit.nvrtc_build()
    assert jit.nvrtc_identity() == f"{major}.{minor} sha256:{digest.hex()[:12]} ({library})"


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


SOURCE_ROOT = str(Path(nvfp4_mla.__file__).resolve().parents[1])


def child(env: dict, go: str = "", user: int | None = None, unset: tuple[str, ...] = ()) -> subprocess.Popen:
    """A process that builds SPEC through the default cache, as ``user``, with ``env`` added to this
    process's environment and the variables ``unset`` removed from it."""
    prefix = ["setpriv", f"--reuid={user}", f"--regid={user}", "--clear-groups"] if user is not None else []
    inherited = {name: value for name, value in os.environ.items() if name not in unset}
    return subprocess.Popen(
        [*prefix, sys.executable, "-c", _CHILD, go],
        env={**inherited, "PYTHONPATH": SOURCE_ROOT, **env},  # cwd is /: the package by its absolute path
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
    """precompile(directory=D) makes D readable by others (0755, whatever the umask) and leaves no
    lock file in it; read-only, it serves another user with zero compiles."""
    base, nobody_home = shared_tmp
    image = base / "image"
    old = os.umask(0o077)
    try:
        precompile([Geometry("main", 16, 8, 16, slot_dtype=torch.int32)], arch=ARCH, directory=image)
    finally:
        os.umask(old)
    assert image.stat().st_mode & 0o777 == 0o755 and [p.suffix for p in image.iterdir()] == [".cubin"]
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


def _uid_without_passwd_entry() -> int:
    for uid in range(4242, 5000):
        try:
            pwd.getpwuid(uid)
        except KeyError:
            return uid
    raise LookupError("every uid from 4242 to 4999 has a passwd entry")


def test_no_home_still_serves_the_listed_directory(shared_tmp):
    """HOME unset and a uid with no passwd entry (``Path.home()`` raises): the per-user layer is
    skipped with one warning, and NVFP4_MLA_CACHE_DIR still takes the kernel."""
    base, _ = shared_tmp
    uid = _uid_without_passwd_entry()
    kernels, cupy_cache = base / "kernels", base / "cupy"  # CuPy's own cache needs a home too
    for directory in (kernels, cupy_cache):
        directory.mkdir()
        os.chown(directory, uid, uid)
    env = {"NVFP4_MLA_CACHE_DIR": str(kernels), "CUPY_CACHE_DIR": str(cupy_cache)}
    got = result(child(env, user=uid, unset=("HOME", "XDG_CACHE_HOME")))
    assert got["compiles"] == 1 and got["path"].startswith(str(kernels)), got
    assert len(got["warnings"]) == 1 and "the per-user kernel cache is skipped" in got["warnings"][0], got


def test_missing_cupy_names_the_fix(monkeypatch):
    modules = sys.modules
    for name in [m for m in modules if m == "cupy" or m.startswith("cupy.")] + ["cupy"]:
        monkeypatch.setitem(modules, name, None)  # importing CuPy now fails
    jit.nvrtc_build.cache_clear()
    jit.nvrtc_library.cache_clear()
    with pytest.raises(RuntimeError, match=r"need CuPy: install CuPy .*\.\[cu12\]"):
        launch.Launcher(b"", SPEC.template, Device(0, 90, 132, 232_448))
    with pytest.raises(RuntimeError, match=r"NVRTC is not available: install"):
        jit.compile_kernel(SPEC, ARCH)


@pytest.mark.parametrize("part", ["source", "header", "params header", "options", "arch"])
def test_key_changes_with_everything_that_shapes_the_kernel(monkeypatch, part):
    """What NVRTC is given; NVRTC itself is not in the key (test_cache_travel)."""
    before = jit.kernel_key(SPEC, ARCH)
    sources = None
    if part == "source":
        sources = {SPEC.template.file: jit.source(SPEC.template.file) + "\n// edit"}
    elif part == "header":
        sources = {jit.NUMERICS_HEADER: jit.source(jit.NUMERICS_HEADER) + "\n// edit"}
    elif part == "params header":
        sources = {jit.PARAMS_HEADER: SPEC.template.params.header() + "\n// edit"}
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
        cache, "build", lambda spec, arch, skip=(): built.append((spec, arch)) or (spec.describe().encode(), None)
    )
    tile, row = cast(Loaded, cache.launcher(0, _Tile(16))), cast(Loaded, cache.launcher(0, _Row(16)))
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


def test_a_layer_the_user_cannot_enter_is_skipped(shared_tmp):
    """A 0700 directory of root as the first layer: skipped with a warning naming it, never a
    crash, and the kernel compiles into the user's own layer."""
    base, nobody_home = shared_tmp
    locked = base / "locked"
    precompile([Geometry("main", 16, 8, 16, slot_dtype=torch.int32)], arch=ARCH, directory=locked)
    locked.chmod(0o700)
    env = {"NVFP4_MLA_CACHE_DIR": str(locked), "HOME": str(nobody_home), "XDG_CACHE_HOME": str(nobody_home / "xdg")}
    got = result(child(env, user=NOBODY))
    assert got["compiles"] == 1 and got["path"].startswith(str(nobody_home)), got
    assert any(f"kernel cache {locked} ignored: it cannot be opened (Permission denied)" in w for w in got["warnings"])


@root_only
def test_the_group_opt_in_trusts_only_this_users_groups(tmp_path, compiles, monkeypatch):
    """NVFP4_MLA_CACHE_TRUST_GROUP=1: a group-writable directory is trusted only when its group is
    one of this user's; another user's file only when its group is one of this user's and it sits
    in such a directory."""
    mine = os.getegid()
    foreign = next(g for g in (NOBODY, 65533, 12345) if g not in os.getgroups() and g != mine)
    monkeypatch.setenv("NVFP4_MLA_CACHE_TRUST_GROUP", "1")
    shared = tmp_path / "shared"
    _, path, _ = build([shared])
    assert path is not None
    shared.chmod(0o770)
    os.chown(shared, -1, foreign)
    _, elsewhere, caught = build([shared, tmp_path / "own"])
    assert any(f"writable by its group, gid {foreign} (not one of this user's groups)" in w for w in caught)
    assert elsewhere is not None and elsewhere.parent == tmp_path / "own"
    os.chown(shared, -1, mine)
    os.chown(path, NOBODY, mine)  # another member's file, in the group's directory: trusted
    assert build([shared])[1:] == (path, []) and len(compiles) == 2
    os.chown(path, NOBODY, foreign)  # a file of a group not ours
    _, _, caught = build([shared])
    assert any(f"owned by uid {NOBODY}" in w for w in caught) and len(compiles) == 3
    private = tmp_path / "private"
    _, own_file, _ = build([private])
    assert own_file is not None
    os.chown(own_file, NOBODY, mine)  # another user's file in a directory that is not the group's
    _, _, caught = build([private])
    assert any(f"owned by uid {NOBODY}" in w for w in caught)


def test_an_unusable_home_names_itself_and_the_fix(shared_tmp):
    """CuPy creates ~/.cupy when it is imported: with HOME=/ that fails, and the message says so."""
    base, _ = shared_tmp
    env = {"HOME": "/", "XDG_CACHE_HOME": "", "NVFP4_MLA_CACHE_DIR": str(base / "none"), "PATH": os.environ["PATH"]}
    code = "from nvfp4_mla import Geometry, precompile\nprecompile([Geometry('kv', 16)], arch='sm_90')"
    prefix = ["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups"]
    done = subprocess.run([*prefix, sys.executable, "-c", code], env=env, capture_output=True, text=True, cwd="/")
    assert done.returncode != 0 and "CUPY_CACHE_DIR" in done.stderr.splitlines()[-1], done.stderr


# ---------------------------------------------------------------- the load path (GPU)


@pytest.mark.gpu
@pytest.mark.parametrize("kind", [*DAMAGE, "renamed kernel"])
def test_damaged_files_on_the_load_path(tmp_path, monkeypatch, kind):
    """Each damaged file under the right name, in a trusted directory, on a real entry call: one
    warning naming the file, one compile, the reference's bytes; a new process's cache then loads
    it with no compile. The renamed kernel passes every file check and the driver refuses it (a
    load failure is a miss too)."""
    from nvfp4_mla import reference
    from nvfp4_mla.testing import make_cache, random_rows, random_slots

    arch = device_info(torch.cuda.current_device()).arch
    spec, other = writers.append_spec(16, torch.int32), writers.append_spec(32, torch.int32)
    kdir = tmp_path / "kernels"
    kdir.mkdir(mode=0o700)
    path = kdir / kernel_cache.KernelCache.file_name(jit.kernel_key(spec, arch), arch)
    path.write_bytes(_planted(kind, spec, other, arch))
    compiled: list = []
    real = jit.compile_kernel
    monkeypatch.setattr(jit, "compile_kernel", lambda s, a, k=None: compiled.append(s) or real(s, a, k))
    rows, slots = random_rows((5, 512), "cuda"), random_slots(5, 32, torch.int32).cuda()
    want = make_cache(2, 16)
    reference.nvfp4_quantize_append_sparse_mla_cache(rows.cpu(), slots.cpu(), want)
    for expected in (1, 0):  # a miss with one warning, then (a new process's cache) a hit
        cache = make_cache(2, 16, device="cuda")
        library = nvfp4_mla.KernelLibrary(kernel_cache.KernelCache([kdir]))
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            nvfp4_mla.nvfp4_quantize_append_sparse_mla_cache(rows, slots, cache, library=library)
        assert torch.equal(cache.cpu(), want) and len(compiled) == expected, (kind, expected, compiled)
        refusals = [str(w.message) for w in caught if str(path) in str(w.message)]
        assert len(refusals) == expected, (kind, refusals)
        if expected:
            driver = "refused by the driver" in refusals[0]
            assert driver == (kind == "renamed kernel"), refusals
        compiled.clear()
