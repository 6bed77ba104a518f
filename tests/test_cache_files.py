"""The kernel file format (nvfp4_mla.kernel_file): NVRTC's whole cubin first, then a trailer; every
cut, extended, damaged, foreign or planted file is refused with its reason. Needs no GPU: NVRTC
compiles for a named arch. The kernels are tiny self-contained sources that carry the proof the
way kernels/nvfp4_numerics.cuh declares it (the last test checks that they still agree)."""

from __future__ import annotations

import ctypes
import functools
import hashlib
import re
import shutil
import struct
import subprocess
import sys
import textwrap
from collections.abc import Sequence
from pathlib import Path

import pytest

from nvfp4_mla import jit, kernel_file
from nvfp4_mla.kernel_file import KernelFileError

cupy = pytest.importorskip("cupy", reason="CuPy is needed for NVRTC (pip install 'nvfp4-mla[cu12]')")
nvrtc = cupy.cuda.nvrtc
try:
    nvrtc.getVersion()
except Exception as exc:  # CuPy without a loadable libnvrtc
    pytest.skip(f"NVRTC is not available: {exc}", allow_module_level=True)

KEY = hashlib.sha256(b"test_kernel_file: scale").hexdigest()
OTHER_KEY = hashlib.sha256(b"test_kernel_file: shift").hexdigest()
PROOF_LINE = 'extern "C" __device__ const char nvfp4_mla_key[] = NVFP4_MLA_KEY;'
# The table makes the file larger than 8 KiB, so that a cut to a 4 KiB boundary keeps most of it.
SCALE = f"""{PROOF_LINE}
extern "C" __device__ const unsigned table[1536] = {{3, 1, 4, 1, 5, 9, 2, 6}};
extern "C" __global__ void scale(float* x, float s) {{ x[threadIdx.x] *= s * table[threadIdx.x]; }}
"""
SHIFT = f"""{PROOF_LINE}
extern "C" __global__ void shift(float* x, float s) {{ x[threadIdx.x] += s; }}
"""


def proof(key: str) -> bytes:
    return b"nvfp4_mla-key:" + key.encode()


def compiled(source: str, arch: str, key: str, headers: dict[str, str] | None = None) -> int:
    """A compiled NVRTC program handle (the caller destroys it), with jit.py's proof define."""
    headers = headers or {}
    program = nvrtc.createProgram(
        source, "test_kernel_file.cu", [h.encode() for h in headers.values()], [n.encode() for n in headers]
    )
    try:
        nvrtc.compileProgram(
            program, [f"--gpu-architecture={arch}", "-std=c++17", f'-DNVFP4_MLA_KEY="{proof(key).decode()}"']
        )
    except BaseException:
        nvrtc.destroyProgram(program)
        raise
    return program


@functools.cache
def build(source: str, arch: str, key: str) -> bytes:
    program = compiled(source, arch, key)
    try:
        return jit.whole_cubin(program)
    finally:
        nvrtc.destroyProgram(program)


def section(cubin: bytes, name: str) -> tuple[int, int, int]:
    """(offset of its section header, offset of its bytes, size) of a named section."""
    (shoff,) = struct.unpack_from("<Q", cubin, 0x28)
    shnum, shstrndx = struct.unpack_from("<HH", cubin, 0x3C)
    headers = [struct.unpack_from("<IIQQQQ", cubin, shoff + 64 * i) for i in range(shnum)]
    names = headers[shstrndx][4]
    for i, header in enumerate(headers):
        if cubin[names + header[0] :].split(b"\0", 1)[0] == name.encode():
            return shoff + 64 * i, header[4], header[5]
    raise KeyError(name)


def packed(arch: str = "sm_90") -> bytes:
    return kernel_file.pack(build(SCALE, arch, KEY), KEY, arch)


def refused(data: bytes, key: str = KEY, arch: str = "sm_90") -> str:
    with pytest.raises(KernelFileError) as info:
        kernel_file.unpack(data, key, arch)
    return str(info.value)


@pytest.mark.parametrize("arch", ["sm_80", "sm_90", "sm_90a", "sm_100a", "sm_120"])
def test_round_trip(arch):
    cubin = build(SCALE, arch, KEY)
    data = kernel_file.pack(cubin, KEY, arch)
    assert data.startswith(cubin) and len(data) > len(cubin)  # the cubin first, byte for byte
    assert kernel_file.unpack(data, KEY, arch) == cubin


def test_whole_cubin_is_nvrtcs_size_one_byte_more_than_cupys():
    # The size as NVRTC reports it, through this test's own look-up of the mapped libnvrtc.
    with open("/proc/self/maps") as maps:
        paths = {line.split()[-1] for line in maps if re.search(r"/libnvrtc\.so[.\d]*$", line.strip())}
    if len(paths) != 1:
        pytest.skip(f"not exactly one libnvrtc mapped: {sorted(paths)}")
    program = compiled(SCALE, "sm_90", KEY)
    try:
        reported = ctypes.c_size_t()
        lib = ctypes.CDLL(paths.pop())
        assert lib.nvrtcGetCUBINSize(ctypes.c_void_p(program), ctypes.byref(reported)) == 0
        whole, short = jit.whole_cubin(program), nvrtc.getCUBIN(program)
    finally:
        nvrtc.destroyProgram(program)
    assert len(whole) == reported.value
    assert len(short) == len(whole) - 1 and whole.startswith(short)  # CuPy's getCUBIN drops the last byte
    # The ELF's own extent: its program-header table ends at the whole cubin's last byte.
    phoff, shoff = struct.unpack_from("<QQ", whole, 0x20)
    phnum, shnum = struct.unpack_from("<H", whole, 0x38)[0], struct.unpack_from("<H", whole, 0x3C)[0]
    assert max(phoff + 56 * phnum, shoff + 64 * shnum) == len(whole)
    kernel_file.check_cubin(whole, KEY, "sm_90")
    with pytest.raises(KernelFileError, match="program-header table runs past the end"):
        kernel_file.check_cubin(short, KEY, "sm_90")


def test_whole_cubin_refuses_a_program_without_a_cubin():
    program = compiled(SCALE, "compute_90", KEY)  # PTX only
    try:
        with pytest.raises(RuntimeError, match="no cubin"):
            jit.whole_cubin(program)
    finally:
        nvrtc.destroyProgram(program)


@pytest.mark.parametrize("cut", ["last 512 bytes", "to a 4 KiB boundary", "one byte"])
def test_a_cut_file_is_refused(cut):
    data = packed()
    kept = {"last 512 bytes": len(data) - 512, "to a 4 KiB boundary": len(data) // 4096 * 4096}.get(cut, len(data) - 1)
    assert len(data) > 8192 and 0 < kept < len(data)
    assert refused(data[:kept]) == "cut or extended: no end marker"


@pytest.mark.parametrize("tail", ["one byte", "4 KiB of zeros", "a second trailer", "a second copy"])
def test_an_extended_file_is_refused(tail):
    data = packed()
    trailer = data[len(build(SCALE, "sm_90", KEY)) :]
    extra = {"one byte": b"\0", "4 KiB of zeros": bytes(4096), "a second trailer": trailer}.get(tail, data)
    assert refused(data + extra).startswith("cut or extended: ")


def test_a_text_file_holding_only_the_key_is_refused():
    assert refused(proof(KEY)) == "cut or extended: no end marker"
    assert refused(kernel_file.pack(proof(KEY), KEY, "sm_90")) == "not an ELF file"


def test_another_kernels_cubin_with_this_keys_proof_is_refused():
    other = build(SHIFT, "sm_90", OTHER_KEY)
    planted = other + proof(KEY) + b"\0"
    assert refused(planted) == "cut or extended: no end marker"  # the raw file of the audit
    assert refused(kernel_file.pack(planted, KEY, "sm_90")) == "the key is not inside a loaded section"
    assert refused(kernel_file.pack(other, KEY, "sm_90")) == "the key is not inside a loaded section"
    assert refused(kernel_file.pack(other, OTHER_KEY, "sm_90")).startswith(f"packed for key {OTHER_KEY[:16]}")
    assert kernel_file.unpack(kernel_file.pack(other, OTHER_KEY, "sm_90"), OTHER_KEY, "sm_90") == other
    # A key that starts with this one is another key: the proof ends with its NUL.
    longer = build(SCALE, "sm_90", KEY + "0")
    assert proof(KEY) in longer
    assert refused(kernel_file.pack(longer, KEY, "sm_90")) == "the key is not inside a loaded section"


def test_the_proof_counts_only_inside_the_loaded_image():
    other = build(SHIFT, "sm_90", OTHER_KEY)
    _, start, size = section(other, ".nv.global.init")  # where NVRTC puts nvfp4_mla_key[]
    assert start <= other.index(proof(OTHER_KEY)) < start + size
    # The same bytes pass in .nv.global.init (a digest or a check is no signature: a forged cubin
    # passes) and fail in .strtab, which the driver does not load.
    kernel_file.check_cubin(other.replace(proof(OTHER_KEY), proof(KEY)), KEY, "sm_90")
    _, strtab, size = section(other, ".strtab")
    assert size > len(proof(KEY))
    planted = other[:strtab] + proof(KEY) + b"\0" + other[strtab + len(proof(KEY)) + 1 :]
    with pytest.raises(KernelFileError, match=r"^the key is not inside a loaded section$"):
        kernel_file.check_cubin(planted, KEY, "sm_90")


def test_the_sm80_build_is_refused_for_sm90():
    cubin = build(SCALE, "sm_80", KEY)
    assert refused(kernel_file.pack(cubin, KEY, "sm_90")) == "built for sm_80, not sm_90"
    assert refused(kernel_file.pack(cubin, KEY, "sm_80")) == "packed for sm_80, not sm_90"


@pytest.mark.parametrize(
    ("built", "wanted"),
    [("sm_90", "sm_90a"), ("sm_90a", "sm_90"), ("sm_100", "sm_100a"), ("sm_100a", "sm_100"), ("sm_90", "sm_100")],
)
def test_another_arch_variant_is_refused(built, wanted):
    data = kernel_file.pack(build(SCALE, built, KEY), KEY, wanted)
    assert refused(data, arch=wanted) == f"built for {built}, not {wanted}"


@pytest.mark.parametrize("where", ["ELF header", "code", "proof", "last cubin byte", "trailer's key", "digest"])
def test_a_flipped_byte_is_refused(where):
    cubin, data = build(SCALE, "sm_90", KEY), bytearray(packed())
    at = {
        "ELF header": 0x30,
        "code": section(cubin, ".text.scale")[1] + 8,
        "proof": cubin.index(proof(KEY)) + 20,
        "last cubin byte": len(cubin) - 1,
        "trailer's key": len(cubin) + 30,
        "digest": len(data) - 12 - 5,
    }[where]
    data[at] ^= 0x10
    assert refused(bytes(data)) == "digest mismatch"


def test_a_damaged_trailer_frame_is_refused():
    data = packed()
    assert refused(data[:-1] + b"X") == "cut or extended: no end marker"
    length = len(data) - len(build(SCALE, "sm_90", KEY))
    for wrong in (length - 1, length + 1, len(data) + 1, 3):
        damaged = data[:-12] + struct.pack("<I", wrong) + data[-8:]
        assert refused(damaged).startswith("cut or extended: ")


def test_another_format_version_is_refused(monkeypatch):
    version = kernel_file.FORMAT_VERSION
    monkeypatch.setattr(kernel_file, "FORMAT_VERSION", version + 1)
    data = packed()
    monkeypatch.undo()
    assert refused(data) == f"format version {version + 1}, not {version}"


def test_the_file_records_the_compiler_and_the_digest_covers_it():
    """Format 2: NVRTC's version and its library's SHA-256 after the arch, under the digest."""
    compiler = kernel_file.Compiler(12, 9, hashlib.sha256(b"libnvrtc").digest())
    data = kernel_file.pack(build(SCALE, "sm_90", KEY), KEY, "sm_90", compiler)
    assert kernel_file.read(data, KEY, "sm_90") == (build(SCALE, "sm_90", KEY), compiler)
    assert compiler.describe() == f"12.9 sha256:{compiler.library.hex()[:12]}"
    at = data.index(compiler.library)
    assert data[at - 9 : at] == b"sm_90" + struct.pack("<HH", 12, 9)  # right after the arch
    for where in (at - 4, at - 2, at, at + 31):  # the version, either half, the library's digest
        changed = bytearray(data)
        changed[where] ^= 0x01
        assert refused(bytes(changed)) == "digest mismatch"
    unrecorded = kernel_file.read(packed(), KEY, "sm_90").compiler
    assert unrecorded == kernel_file.UNRECORDED and unrecorded.describe() == "an unrecorded NVRTC"
    with pytest.raises(ValueError, match="digest is 4 bytes"):
        kernel_file.pack(b"", KEY, "sm_90", kernel_file.Compiler(12, 9, b"abcd"))


def test_a_file_of_format_1_is_refused_by_its_version():
    """Format 1's trailer (no NVRTC fields) under this format's name: refused by its version, not
    misread (its files are named .v1 and never looked up anyway)."""
    cubin = build(SCALE, "sm_90", KEY)
    fields = struct.pack("<H", len(KEY)) + KEY.encode() + struct.pack("<H", 5) + b"sm_90"  # k, key, a, arch
    head = struct.pack("<8sIQ", b"NVFP4MLA", 1, len(cubin)) + fields
    digest = hashlib.sha256(cubin + head).digest()
    old = cubin + head + digest + struct.pack("<I8s", len(head) + 32 + 12, b"NVFP4END")
    assert refused(old) == f"format version 1, not {kernel_file.FORMAT_VERSION}"


def redigested(data: bytes, at: int, value: bytes) -> bytes:
    """``data`` (a kernel file) with ``value`` written at ``at`` and its digest made anew: a digest
    is no signature, so only the other checks can refuse it."""
    changed = bytearray(data)
    changed[at : at + len(value)] = value
    end = len(changed) - 12 - 32  # the digest, then the trailer's length and the end marker
    changed[end : end + 32] = hashlib.sha256(changed[:end]).digest()
    return bytes(changed)


def test_the_key_and_arch_a_file_records():
    """What ``nvfp4-mla info`` reads a file by: read's trailer checks first, then exactly two
    length-prefixed UTF-8 fields; fields malformed under a valid digest are refused, not misread."""
    data = packed("sm_90a")
    assert kernel_file.packed_for(data) == (KEY, "sm_90a")
    key_length = len(build(SCALE, "sm_90a", KEY)) + 20  # after the start marker, the version, the cubin's length
    arch_length = key_length + 2 + len(KEY)
    malformed = {
        "key past the fields": (key_length, b"\xff\xff"),
        "key one byte longer": (key_length, struct.pack("<H", len(KEY) + 1)),
        "arch one byte shorter": (arch_length, struct.pack("<H", 5)),
        "key not UTF-8": (key_length + 2, b"\xff"),
        "arch not UTF-8": (arch_length + 2, b"\xc3"),
    }
    for at, value in malformed.values():
        with pytest.raises(KernelFileError, match=r"^malformed key and arch fields$"):
            kernel_file.packed_for(redigested(data, at, value))
    for damaged, reason in [
        (data[:-1], "cut or extended: no end marker"),
        (data[:7] + b"!" + data[8:], "digest mismatch"),
    ]:
        with pytest.raises(KernelFileError, match=rf"^{reason}$"):
            kernel_file.packed_for(damaged)


def key_segment(cubin: bytes) -> int:
    """The offset of the program header of the PT_LOAD segment that holds the key's proof."""
    (phoff,) = struct.unpack_from("<Q", cubin, 0x20)
    (phnum,) = struct.unpack_from("<H", cubin, 0x38)
    at = cubin.index(proof(KEY))
    for header in range(phoff, phoff + 56 * phnum, 56):
        kind, _, offset, _, _, filesz = struct.unpack_from("<IIQQQQ", cubin, header)
        if kind == 1 and offset <= at < offset + filesz:
            return header
    raise LookupError("no PT_LOAD segment holds the proof")


def unallocated(cubin: bytearray) -> None:
    section_header, _, _ = section(bytes(cubin), ".nv.global.init")
    (flags,) = struct.unpack_from("<Q", cubin, section_header + 8)
    struct.pack_into("<Q", cubin, section_header + 8, flags & ~0x2)  # SHF_ALLOC


# Each change to the sm_90 cubin (then packed with a valid trailer), and the reason it is refused.
ELF_DAMAGE = {
    "EI_CLASS 32-bit": (lambda c: c.__setitem__(4, 1), r"^not a 64-bit little-endian ELF file$"),
    "e_machine x86-64": (lambda c: struct.pack_into("<H", c, 18, 62), r"^not a CUDA ELF file \(e_machine 62\)$"),
    "EI_ABIVERSION 9": (lambda c: c.__setitem__(8, 9), r"^unknown CUDA ELF ABI version 9 "),
    # NVRTC 12.9's sm_86 header; NVRTC 13 adds ptxas's note: "e_flags say sm_86, ptxas's note says sm_90".
    "e_flags of sm_86": (lambda c: (struct.pack_into("<I", c, 0x30, 0x00560556), c.__setitem__(8, 7)), r"sm_86"),
    "e_shoff at the end": (
        lambda c: struct.pack_into("<Q", c, 0x28, len(c) - 64),
        r"^the section-header table runs past the end of the cubin$",
    ),
    "a section past the end": (
        lambda c: struct.pack_into("<Q", c, section(bytes(c), ".nv.global.init")[0] + 0x20, len(c)),
        r"^section \d+ runs past the end of the cubin$",
    ),
    "a segment past the end": (
        lambda c: struct.pack_into("<Q", c, key_segment(bytes(c)) + 0x20, len(c)),
        r"^segment \d+ runs past the end of the cubin$",
    ),
    "the key's segment empty": (
        lambda c: struct.pack_into("<Q", c, key_segment(bytes(c)) + 0x20, 0),
        r"^the key is not inside a loaded section$",
    ),
    "the key's section not allocated": (unallocated, r"^the key is not inside a loaded section$"),
}


@pytest.mark.parametrize("change", ELF_DAMAGE)
def test_a_malformed_elf_is_refused(change):
    damage, reason = ELF_DAMAGE[change]
    cubin = bytearray(build(SCALE, "sm_90", KEY))
    damage(cubin)
    assert re.search(reason, refused(kernel_file.pack(bytes(cubin), KEY, "sm_90")))


def with_tables(cubin: bytes, sections: Sequence[tuple] = (), segments: Sequence[tuple] = (), size: int = 0) -> bytes:
    """``cubin`` padded with zeros to ``size`` bytes, then new section- and program-header tables
    appended: its own entries followed by the extra ``sections`` and ``segments`` (field tuples)."""
    shoff, shnum = struct.unpack_from("<Q", cubin, 0x28)[0], struct.unpack_from("<H", cubin, 0x3C)[0]
    phoff, phnum = struct.unpack_from("<Q", cubin, 0x20)[0], struct.unpack_from("<H", cubin, 0x38)[0]
    body = bytearray(cubin.ljust(size, b"\0"))
    section_table = cubin[shoff : shoff + 64 * shnum] + b"".join(struct.pack("<IIQQQQIIQQ", *s) for s in sections)
    segment_table = cubin[phoff : phoff + 56 * phnum] + b"".join(struct.pack("<IIQQQQQQ", *p) for p in segments)
    struct.pack_into("<QQ", body, 0x20, len(body) + len(section_table), len(body))  # e_phoff, e_shoff
    struct.pack_into("<H", body, 0x38, phnum + len(segments))
    struct.pack_into("<H", body, 0x3C, shnum + len(sections))
    return bytes(body) + section_table + segment_table


def note(offset: int, size: int) -> tuple:
    return (0, 7, 0, 0, offset, size, 0, 0, 1, 0)  # SHT_NOTE, not allocated


def test_the_tables_helper_keeps_a_valid_cubin_valid():
    cubin = build(SCALE, "sm_90", KEY)
    kernel_file.check_cubin(with_tables(cubin, [note(0, 64)], [(0,) * 8], size=len(cubin) + 100), KEY, "sm_90")


def test_the_work_of_the_checks_is_capped():
    """A digest is no signature: a re-digested file may hold any tables. What the checks examine is
    capped (each copy of the proof was checked against every section, every note was copied), and
    a file over a cap is refused even when it also holds the real kernel."""
    cubin = build(SCALE, "sm_90", KEY)
    shnum = struct.unpack_from("<H", cubin, 0x3C)[0]
    caps = f"over the caps of {kernel_file.MAX_SECTIONS} and {kernel_file.MAX_SEGMENTS}"
    sections = with_tables(cubin, [note(0, 64)] * (kernel_file.MAX_SECTIONS + 1 - shnum))
    assert refused(kernel_file.pack(sections, KEY, "sm_90")).endswith(caps)
    segments = with_tables(cubin, segments=[(0,) * 8] * kernel_file.MAX_SEGMENTS)
    assert refused(kernel_file.pack(segments, KEY, "sm_90")).endswith(caps)
    notes = with_tables(cubin, [note(0, len(cubin))] * (kernel_file.MAX_NOTE_BYTES // len(cubin) + 1))
    assert "bytes of note sections, over the cap" in refused(kernel_file.pack(notes, KEY, "sm_90"))
    copies = build(SHIFT, "sm_90", OTHER_KEY) + (proof(KEY) + b"\0") * (kernel_file.MAX_PROOF_COPIES + 1)
    assert (
        refused(kernel_file.pack(copies, KEY, "sm_90")) == f"the key appears over {kernel_file.MAX_PROOF_COPIES} times"
    )
    kernel_file.check_cubin(cubin + (proof(KEY) + b"\0") * 1000, KEY, "sm_90")  # the real one is found first


# Unpacks argv[1] with kernel_file.py loaded alone (no torch: a small address space suffices) in a
# process limited to 1 GiB of address space; prints the refusal.
_BOUNDED = textwrap.dedent(
    """
    import importlib.util, resource, sys
    resource.setrlimit(resource.RLIMIT_AS, (1 << 30, 1 << 30))
    spec = importlib.util.spec_from_file_location("kernel_file", sys.argv[2])
    kernel_file = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(kernel_file)
    with open(sys.argv[1], "rb") as f:
        data = f.read()
    try:
        kernel_file.unpack(data, sys.argv[3], "sm_90")
    except kernel_file.KernelFileError as exc:
        print(exc)
    """
)


def test_the_audits_file_of_overlapping_notes_is_refused_in_bounded_memory(tmp_path):
    """The audit's file: 16 MiB, 65,535 note sections each over nearly 12 MiB of it, re-digested. The
    notes were joined (a terabyte) and MemoryError escaped the read path; now the cap on sections
    refuses it, in a process that could not even hold 100 of those copies."""
    cubin = build(SCALE, "sm_90", KEY)
    shnum = struct.unpack_from("<H", cubin, 0x3C)[0]
    size = (12 << 20) - (64 << 10)  # with the 4 MiB section table, just under the size cap
    hostile = kernel_file.pack(with_tables(cubin, [note(0, size)] * (0xFFFF - shnum), size=size), KEY, "sm_90")
    assert kernel_file.check_size(len(hostile)) is None
    path = tmp_path / "hostile.cubin"
    path.write_bytes(hostile)
    done = subprocess.run(
        [sys.executable, "-c", _BOUNDED, str(path), kernel_file.__file__, KEY], capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr
    caps = f"over the caps of {kernel_file.MAX_SECTIONS} and {kernel_file.MAX_SEGMENTS}"
    assert done.stdout.strip().startswith("65535 sections and ") and done.stdout.strip().endswith(caps), done.stdout


def test_the_arch_from_e_flags_and_ptxas_note():
    cubin = bytearray(build(SCALE, "sm_100", KEY))
    assert cubin[8] == 8  # the ELF ABI of sm_100 and newer: the SM in bits 8-15, 'a' in bit 3
    flags = struct.unpack_from("<I", cubin, 0x30)[0]
    struct.pack_into("<I", cubin, 0x30, flags | 0x8)  # as NVRTC 12.9 marks sm_100a
    with pytest.raises(KernelFileError, match=r"^e_flags say sm_100a, ptxas's note says sm_100$"):
        kernel_file.check_cubin(bytes(cubin), KEY, "sm_100a")
    # Without ptxas's note (NVRTC 12.9 writes none for sm_90 and older), e_flags alone decide.
    note = bytes(cubin).index(b"-arch sm_100 ")
    cubin[note : note + 6] = b"-xxxx "
    kernel_file.check_cubin(bytes(cubin), KEY, "sm_100a")
    with pytest.raises(KernelFileError, match=r"^built for sm_100a, not sm_100$"):
        kernel_file.check_cubin(bytes(cubin), KEY, "sm_100")


def test_an_empty_file_is_refused():
    assert kernel_file.check_size(0) == "empty file"
    assert refused(b"") == "empty file"


def test_the_size_cap():
    cap = kernel_file.MAX_FILE_BYTES
    assert 1 << 20 <= cap <= 64 << 20  # a project cubin is a few hundred KB; a read stays bounded
    assert kernel_file.check_size(len(packed())) is None and kernel_file.check_size(cap) is None
    assert kernel_file.check_size(cap + 1) == f"{cap + 1} bytes, over the {cap >> 20} MiB cap"
    assert refused(packed() + bytes(cap)).endswith("MiB cap")  # before anything else


def test_the_project_header_declares_the_proof_as_these_kernels_do():
    header = (Path(__file__).resolve().parents[1] / "kernels" / "nvfp4_numerics.cuh").read_text()
    assert PROOF_LINE in header
    source = '#include "nvfp4_numerics.cuh"\nextern "C" __global__ void k(u32* x) { x[0] = bf16x2_bits(1.0f, 2.0f); }\n'
    program = compiled(source, "sm_90", KEY, {"nvfp4_numerics.cuh": header})
    try:
        cubin = jit.whole_cubin(program)
    finally:
        nvrtc.destroyProgram(program)
    assert kernel_file.unpack(kernel_file.pack(cubin, KEY, "sm_90"), KEY, "sm_90") == cubin


@pytest.mark.skipif(shutil.which("nvdisasm") is None, reason="nvdisasm (CUDA toolkit) is not on PATH")
def test_nvdisasm_takes_the_whole_cubin_and_not_cupys_copy(tmp_path):
    """Every kernel the cache writes is NVRTC's whole cubin, a valid ELF for nvdisasm; CuPy's copy,
    one byte short, is not."""
    program = compiled(SCALE, "sm_90", KEY)
    try:
        whole, short = jit.whole_cubin(program), nvrtc.getCUBIN(program)
    finally:
        nvrtc.destroyProgram(program)
    for name, data, ok in (("whole", whole, True), ("short", short, False)):
        path = tmp_path / f"{name}.cubin"
        path.write_bytes(data)
        done = subprocess.run(["nvdisasm", str(path)], capture_output=True, text=True)
        assert (done.returncode == 0) == ok, (name, done.stderr)
