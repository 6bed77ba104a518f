"""The on-disk format of one cached kernel, and the checks a file passes before it may run.

A kernel file is the cubin, byte for byte as NVRTC reports it (``jit.whole_cubin``), then a
trailer (integers little-endian; ``n`` is the cubin's length, ``k`` and ``a`` those of the UTF-8
key and arch)::

    b"NVFP4MLA"   8 bytes   start marker
    version       u32       FORMAT_VERSION
    n             u64       the cubin's length: the trailer starts at byte n
    k, key        u16, k    the kernel's full key
    a, arch       u16, a    "sm_90a", ...
    major, minor  u16, u16  the version of the NVRTC that compiled it (0, 0: not recorded)
    library       32 bytes  SHA-256 of that NVRTC's library file (zeros: not recorded)
    digest        32 bytes  SHA-256 of every byte before it: the cubin and the fields above
    t             u32       the trailer's length, start marker to end marker: the file is n + t bytes
    b"NVFP4END"   8 bytes   end marker

The trailer is read from the end: a cut or appended tail loses the end marker or breaks
``n + t == size``; the digest catches a changed byte; the key and arch fields, another kernel's
file. A digest is no signature (who can write a cache directory can write one), so
:func:`check_cubin` also checks what the driver loads: a whole CUDA ELF for this arch whose loaded
image holds this key's proof.

The NVRTC fields are provenance, not part of the key: a file compiled by another NVRTC is a
valid kernel of its key (docs/format.md section 11). Format 1 had no NVRTC fields (its key held
NVRTC's path, size and time); its files are named ``.v1`` and never looked up.
"""

from __future__ import annotations

import hashlib
import re
import struct
from typing import NamedTuple

FORMAT_VERSION = 2
# Far above the largest cubin of the catalogue (a few hundred KB with -lineinfo), so new kernels and
# toolkits fit, and still small enough that a huge or sparse planted file is refused before it is
# read whole (docs/format.md section 11).
MAX_FILE_BYTES = 16 << 20

# Caps on what check_cubin examines, far above what NVRTC writes (the catalogue's cubins: at most
# 44 sections, 6 segments, 228 bytes of notes, the proof once). A digest is no signature, so a
# hostile file can be re-digested: without them 65,535 overlapping note sections asked for a
# terabyte, and the proof search costs its copies times the sections. Over a cap is a refusal.
MAX_SECTIONS = 4096
MAX_SEGMENTS = 256
MAX_NOTE_BYTES = 64 << 10
MAX_PROOF_COPIES = 16

_START, _END = b"NVFP4MLA", b"NVFP4END"
_HEAD = struct.Struct("<8sIQ")  # start marker, format version, cubin length
_FIELD = struct.Struct("<H")  # the length of the key or arch bytes that follow it
_NVRTC = struct.Struct("<HH32s")  # the compiler: NVRTC's major and minor version, its library's SHA-256
_TAIL = struct.Struct("<I8s")  # trailer length, end marker
_DIGEST = 32
KEY_PREFIX = "nvfp4_mla-key:"  # followed by the 64 hex digits of the key: the string nvfp4_mla_key[] holds

# ELF64 headers (the ELF specification's layouts) and the few constants read here.
_EHDR = struct.Struct("<16sHHIQQQIHHHHHH")
_SHDR = struct.Struct("<IIQQQQIIQQ")  # name, type, flags, addr, offset, size, link, info, align, entsize
_PHDR = struct.Struct("<IIQQQQQQ")  # type, flags, offset, vaddr, paddr, filesz, memsz, align
_EM_CUDA, _SHT_NOTE, _SHT_NOBITS, _SHF_ALLOC, _PT_LOAD = 190, 7, 8, 0x2, 1

# The arch in a CUDA ELF, as observed in the cubins of a tiny kernel (e_ident[EI_ABIVERSION], e_flags):
#
#   arch      NVRTC 12.9          NVRTC 13.5
#   sm_80     7, 0x00500550       8, 0x06005004
#   sm_86     7, 0x00560556       8, 0x06005604
#   sm_90     7, 0x005a055a       8, 0x06005a04
#   sm_90a    7, 0x005a0d5a       8, 0x06005a04   <- 13.5: same e_flags as sm_90
#   sm_100    8, 0x06006402       8, 0x06006402
#   sm_100a   8, 0x0600640a       8, 0x06006402   <- 13.5: same e_flags as sm_100
#   sm_100f   8, 0x06006402       8, 0x06006402
#   sm_120    8, 0x06007802       8, 0x06007802
#
# ABI version 7: the SM in bits 0-7 (and the virtual SM in bits 16-23), 'a' in bit 11 (LLVM's
# EF_CUDA_ACCELERATORS_V1, 0x800). ABI version 8: the SM in bits 8-15, 'a' in bit 3 (0x8) as 12.9
# writes it; 13.5 never sets it, and no layout records 'f'. Those ABI-8 cubins all carry ptxas's
# note (.note.nv.tkinfo) with its option "-arch sm_100a": that names the arch in full. Any other
# ABI version is refused.
_NOTE_ARCH = re.compile(rb"-arch (sm_\d+[af]?)[ \0]")


class Compiler(NamedTuple):
    """The NVRTC that compiled a kernel, as its file records it (``jit.nvrtc_build``)."""

    major: int
    minor: int
    library: bytes  # SHA-256 of the libnvrtc file (32 bytes)

    def describe(self) -> str:
        """``12.9 sha256:3f2a9c4d5e6f`` (the digest's first 12 hex digits), or "unrecorded"."""
        if self == UNRECORDED:
            return "an unrecorded NVRTC"
        return f"{self.major}.{self.minor} sha256:{self.library.hex()[:12]}"


UNRECORDED = Compiler(0, 0, bytes(32))


class KernelFile(NamedTuple):
    """A kernel file that passed every check of :func:`read`."""

    cubin: bytes
    compiler: Compiler  # the NVRTC that compiled it: provenance, not part of the key


def proof(key: str) -> bytes:
    """What a cubin of ``key`` carries, compiled in as ``nvfp4_mla_key[]`` (kernels/nvfp4_numerics.cuh)."""
    return (KEY_PREFIX + key).encode()


class KernelFileError(ValueError):
    """A kernel file or cubin that must not be loaded; ``str(error)`` is the short reason."""


def check_size(size: int) -> str | None:
    """Why a file of ``size`` bytes is refused, else None: ask with its fstat size, before reading it.

    Returns
    -------
    str or None
        "empty file" or the cap it exceeds; None when the file may be read.
    """
    if size <= 0:
        return "empty file"
    if size > MAX_FILE_BYTES:
        return f"{size} bytes, over the {MAX_FILE_BYTES >> 20} MiB cap"
    return None


def _fields(key: str, arch: str) -> bytes:
    k, a = key.encode(), arch.encode()
    return _FIELD.pack(len(k)) + k + _FIELD.pack(len(a)) + a


def pack(cubin: bytes, key: str, arch: str, compiler: Compiler = UNRECORDED) -> bytes:
    """The bytes of a kernel file: ``cubin`` unchanged, then the trailer (module docstring).

    Parameters
    ----------
    cubin : bytes
        NVRTC's whole cubin (``jit.whole_cubin``); not checked here (see :func:`check_cubin`).
    key : str
        The kernel's full key (``jit.kernel_key``).
    arch : str
        The architecture it was compiled for, as NVRTC took it ("sm_90a").
    compiler : Compiler
        The NVRTC that compiled it (``jit.nvrtc_build()``; the cache always records it).

    Returns
    -------
    bytes
        What the cache writes, atomically, under the file's name.
    """
    if len(compiler.library) != _DIGEST:
        raise ValueError(f"the NVRTC library's digest is {len(compiler.library)} bytes, not {_DIGEST}")
    head = _HEAD.pack(_START, FORMAT_VERSION, len(cubin)) + _fields(key, arch) + _NVRTC.pack(*compiler)
    digest = hashlib.sha256(cubin)
    digest.update(head)
    return b"".join((cubin, head, digest.digest(), _TAIL.pack(len(head) + _DIGEST + _TAIL.size, _END)))


def unpack(data: bytes, key: str, arch: str) -> bytes:
    """The cubin of a kernel file of ``key`` for ``arch``, once every check has passed: :func:`read`'s."""
    return read(data, key, arch).cubin


def read(data: bytes, key: str, arch: str) -> KernelFile:
    """The cubin of a kernel file of ``key`` for ``arch`` and the NVRTC that compiled it, once
    every check has passed. Which NVRTC it was is not checked: it is not part of the key.

    Parameters
    ----------
    data : bytes
        The file's complete contents.
    key, arch : str
        What the caller looked up: the file must have been packed for both.

    Returns
    -------
    KernelFile
        The cubin, ready for the driver, and the compiler its file records.

    Raises
    ------
    KernelFileError
        With the reason: size, a cut or extended file, format version, digest, another key or
        arch, or any failure of :func:`check_cubin`.
    """
    start, nvrtc_at = _checked_trailer(data)
    fields = data[start + _HEAD.size : nvrtc_at]
    if fields != _fields(key, arch):
        (k,) = _FIELD.unpack_from(fields)
        stored_key = fields[2 : 2 + k].decode(errors="replace")
        stored_arch = fields[4 + k :].decode(errors="replace")
        if stored_key != key:
            raise KernelFileError(f"packed for key {stored_key[:16]}..., not {key[:16]}...")
        raise KernelFileError(f"packed for {stored_arch}, not {arch}")
    cubin = data[:start]
    check_cubin(cubin, key, arch)
    return KernelFile(cubin, Compiler(*_NVRTC.unpack_from(data, nvrtc_at)))


def _checked_trailer(data: bytes) -> tuple[int, int]:
    """Where the cubin ends and where the NVRTC fields start, once the size, the markers, the
    lengths, the format version and the digest pass; else :class:`KernelFileError`."""
    size = len(data)
    reason = check_size(size)
    if reason is None and (size < _TAIL.size or data[-len(_END) :] != _END):
        reason = "cut or extended: no end marker"
    if reason is not None:
        raise KernelFileError(reason)
    trailer, _ = _TAIL.unpack_from(data, size - _TAIL.size)
    start = size - trailer
    if not _HEAD.size + 2 * _FIELD.size + _NVRTC.size + _DIGEST + _TAIL.size <= trailer <= size:
        raise KernelFileError(f"cut or extended: a {trailer}-byte trailer in {size} bytes")
    marker, version, length = _HEAD.unpack_from(data, start)
    if marker != _START:
        raise KernelFileError(f"cut or extended: no start marker {trailer} bytes before the end")
    if length != start:
        raise KernelFileError(f"cut or extended: {size} bytes, not the cubin's {length} + the trailer's {trailer}")
    if version != FORMAT_VERSION:
        raise KernelFileError(f"format version {version}, not {FORMAT_VERSION}")
    fields_end = size - _TAIL.size - _DIGEST
    if hashlib.sha256(memoryview(data)[:fields_end]).digest() != data[fields_end : size - _TAIL.size]:
        raise KernelFileError("digest mismatch")
    return start, fields_end - _NVRTC.size


def packed_for(data: bytes) -> tuple[str, str]:
    """The key and arch a kernel file records, once its trailer passes :func:`read`'s checks up
    to the digest: what to pass to :func:`read` when only the file is at hand (``nvfp4-mla info``).

    Raises
    ------
    KernelFileError
        With the reason, as :func:`read` gives it, or "malformed key and arch fields".
    """
    start, nvrtc_at = _checked_trailer(data)
    fields = data[start + _HEAD.size : nvrtc_at]
    (k,) = _FIELD.unpack_from(fields)  # the trailer's length check leaves room for both lengths
    if 2 * _FIELD.size + k <= len(fields):
        (a,) = _FIELD.unpack_from(fields, _FIELD.size + k)
        if 2 * _FIELD.size + k + a == len(fields):
            try:
                return fields[_FIELD.size : _FIELD.size + k].decode(), fields[2 * _FIELD.size + k :].decode()
            except UnicodeDecodeError:
                pass
    raise KernelFileError("malformed key and arch fields")


def check_cubin(cubin: bytes, key: str, arch: str) -> None:
    """Checks that ``cubin`` is a whole CUDA ELF for ``arch`` whose loaded image holds ``key``'s proof.

    The header (ELF64, little-endian, EM_CUDA, the arch of e_flags and of ptxas's note), both
    header tables, every section's bytes but NOBITS ones and every segment's file bytes lie inside
    ``cubin``; the proof (``nvfp4_mla-key:<key>`` and its NUL: NVRTC puts it in ``.nv.global.init``)
    lies inside an allocated section that a PT_LOAD segment loads. Check fresh compiles too.
    The work is capped (:data:`MAX_SECTIONS`, :data:`MAX_SEGMENTS`, :data:`MAX_NOTE_BYTES`,
    :data:`MAX_PROOF_COPIES`): a file over a cap is refused, whatever else it holds.

    Parameters
    ----------
    cubin : bytes
        The ELF image.
    key, arch : str
        The kernel's full key and its architecture ("sm_90a").

    Raises
    ------
    KernelFileError
        With the first check that fails.
    """
    size = len(cubin)
    if size < _EHDR.size or cubin[:4] != b"\x7fELF":
        raise KernelFileError("not an ELF file")
    ident, _, machine, _, _, phoff, shoff, flags, _, phentsize, phnum, shentsize, shnum, _ = _EHDR.unpack_from(cubin)
    if ident[4:6] != b"\x02\x01":
        raise KernelFileError("not a 64-bit little-endian ELF file")
    if machine != _EM_CUDA:
        raise KernelFileError(f"not a CUDA ELF file (e_machine {machine})")
    if shentsize != _SHDR.size or phentsize != _PHDR.size or not shnum or not phnum:
        raise KernelFileError("malformed ELF header (table entry sizes or counts)")
    if shnum > MAX_SECTIONS or phnum > MAX_SEGMENTS:
        raise KernelFileError(
            f"{shnum} sections and {phnum} segments, over the caps of {MAX_SECTIONS} and {MAX_SEGMENTS}"
        )
    if shoff + shnum * _SHDR.size > size:
        raise KernelFileError("the section-header table runs past the end of the cubin")
    if phoff + phnum * _PHDR.size > size:
        raise KernelFileError("the program-header table runs past the end of the cubin")
    sections = [_SHDR.unpack_from(cubin, shoff + i * _SHDR.size) for i in range(shnum)]
    segments = [_PHDR.unpack_from(cubin, phoff + i * _PHDR.size) for i in range(phnum)]
    for i, (_, kind, _, _, offset, length, *_) in enumerate(sections):
        if kind != _SHT_NOBITS and offset + length > size:
            raise KernelFileError(f"section {i} runs past the end of the cubin")
    for i, (_, _, offset, _, _, filesz, *_) in enumerate(segments):
        if offset + filesz > size:
            raise KernelFileError(f"segment {i} runs past the end of the cubin")

    if ident[8] == 7:
        sm, accel = flags & 0xFF, bool(flags & 0x800)
    elif ident[8] == 8:
        sm, accel = (flags >> 8) & 0xFF, bool(flags & 0x8)
    else:
        raise KernelFileError(f"unknown CUDA ELF ABI version {ident[8]} (e_flags {flags:#010x})")
    built = f"sm_{sm}a" if accel else f"sm_{sm}"
    notes_bytes = sum(s[5] for s in sections if s[1] == _SHT_NOTE)  # before any copy: they may overlap
    if notes_bytes > MAX_NOTE_BYTES:
        raise KernelFileError(f"{notes_bytes} bytes of note sections, over the cap of {MAX_NOTE_BYTES}")
    notes = b"".join(cubin[s[4] : s[4] + s[5]] for s in sections if s[1] == _SHT_NOTE)
    noted = _NOTE_ARCH.search(notes)
    if noted is not None:  # it also names 'a' where e_flags do not (NVRTC 13), and 'f'
        full = noted.group(1).decode()
        if full.rstrip("af") != f"sm_{sm}" or (accel and not full.endswith("a")):
            raise KernelFileError(f"e_flags say {built}, ptxas's note says {full}")
        built = full
    if built != arch:
        raise KernelFileError(f"built for {built}, not {arch}")

    terminated = proof(key) + b"\0"
    loaded = [(s[4], s[4] + s[5]) for s in sections if s[1] != _SHT_NOBITS and s[2] & _SHF_ALLOC]
    segment_bytes = [(p[2], p[2] + p[5]) for p in segments if p[0] == _PT_LOAD]
    at, copies = cubin.find(terminated), 0
    while at >= 0:
        copies += 1
        if copies > MAX_PROOF_COPIES:  # each copy is checked against every section and segment
            raise KernelFileError(f"the key appears over {MAX_PROOF_COPIES} times")
        end = at + len(terminated)
        if any(a <= at and end <= b for a, b in loaded) and any(a <= at and end <= b for a, b in segment_bytes):
            return
        at = cubin.find(terminated, at + 1)
    raise KernelFileError("the key is not inside a loaded section")
