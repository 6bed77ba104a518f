"""``nvfp4-mla info``: the GPU, the versions, the decode backends and the kernel cache."""

from __future__ import annotations

import argparse
import os
import stat
from collections import Counter
from pathlib import Path
from typing import Any

import torch

from .. import __version__, kernel_cache, kernel_file
from ..device import device_info, gpu_unavailable_reason
from ..ops import decode, registry

UNBOUNDED = 10**6  # a decode backend's max_capability when it has no upper end
REFUSED_SHOWN = 5  # refused kernel files named per layer, with their reasons


def gpu_name() -> str | None:
    """The current GPU as "name (sm_XY)", or None when torch sees none."""
    if not torch.cuda.is_available():
        return None
    major, minor = torch.cuda.get_device_capability()
    return f"{torch.cuda.get_device_name()} (sm_{major}{minor})"


def _versions() -> dict[str, str]:
    cuda = f" (CUDA {torch.version.cuda})" if torch.version.cuda else " (CPU build)"
    versions = {"torch": torch.__version__ + cuda}
    try:
        import cupy

        versions["CuPy"] = cupy.__version__
    except Exception as exc:  # not installed, or its CUDA libraries missing
        versions["CuPy"] = f"not available ({exc})"
    try:
        from cupy.cuda import nvrtc

        major, minor = nvrtc.getVersion()
        versions["NVRTC"] = f"{major}.{minor}"
    except Exception as exc:
        versions["NVRTC"] = f"not available ({exc})"
    return versions


def _size(num_bytes: float) -> str:
    if num_bytes < 1024:
        return f"{num_bytes:.0f} B"
    for unit in ("KiB", "MiB"):
        num_bytes /= 1024
        if num_bytes < 1024:
            return f"{num_bytes:.1f} {unit}"
    return f"{num_bytes / 1024:.1f} GiB"


def kernels_phrase(n: int) -> str:
    return f"{n} kernel" + ("s" if n != 1 else "")


def _printable(text: str) -> str:
    """``text`` on one line: a file's name and the reason it is refused come from the file system
    and the file."""
    return "".join(c if c.isprintable() else "?" for c in text)


def compiler_lines(directory: Path, names: list[str]) -> list[str]:
    """Lines giving the NVRTC that each kernel file ``names`` of ``directory`` records, newest
    first, then the files a lookup refuses, each with its reason. Each file is read as a lookup
    of the kernel it records reads it (``kernel_cache.read_recorded_kernel``): a hostile file is
    one refused."""
    built: Counter[kernel_file.Compiler] = Counter()
    refused: list[str] = []
    try:
        dir_fd, dir_st = kernel_cache.open_dir(directory)
    except (kernel_cache.Refused, OSError) as exc:  # changed since its status was taken
        return [f"    its kernels cannot be read now: {_printable(str(exc))}"]
    try:
        for name in names:
            try:
                found = kernel_cache.read_recorded_kernel(dir_fd, dir_st, name)
            except kernel_cache.Refused as exc:
                refused.append(f"{_printable(name)}: {_printable(str(exc))}")
            else:
                if found is not None:  # None: removed since it was listed
                    built[found.compiler] += 1
    finally:
        os.close(dir_fd)
    newest_first = sorted(built.items(), key=lambda item: (-item[0].major, -item[0].minor, item[0].library))
    lines = [
        f"    built by {'' if c == kernel_file.UNRECORDED else 'NVRTC '}{c.describe()}: {kernels_phrase(n)}"
        for c, n in newest_first
    ]
    if refused:
        lines.append(f"    {kernels_phrase(len(refused))} refused when read (compiled afresh at first use):")
        lines += [f"      {entry}" for entry in refused[:REFUSED_SHOWN]]
        if len(refused) > REFUSED_SHOWN:
            lines.append(f"      and {len(refused) - REFUSED_SHOWN} more")
    return lines


def cache_summary(directory: Path, status: str) -> list[str]:
    """Lines describing a kernel cache layer: whether it is used (``status``, from
    ``KernelCache.layer_status``) and, when trusted, its kernels by architecture and by the NVRTC
    that built them.

    Parameters
    ----------
    directory : Path
        A kernel cache directory; it need not exist.
    status : str
        "trusted", "not created yet" or "refused: <reason>".

    Returns
    -------
    list of str
        Lines indented by 4: the status, ``*.cubin`` entries skipped (not regular files, e.g. a
        dangling symbolic link), the total, one line per architecture, then
        :func:`compiler_lines`.
    """
    if status != "trusted":
        return [f"    {status}" + (": not used" if status.startswith("refused") else "")]
    current = f".v{kernel_file.FORMAT_VERSION}.cubin"
    file_sizes: dict[Path, int] = {}
    skipped = []  # never used: the cache opens a kernel without following links, a regular file only
    for f in sorted(directory.glob("*.cubin")):
        try:
            st = f.lstat()
        except OSError:  # removed since it was listed
            continue
        if stat.S_ISREG(st.st_mode):
            file_sizes[f] = st.st_size
        else:
            skipped.append(f.name)
    files = [f for f in file_sizes if f.name.endswith(current)]
    stale = len(file_sizes) - len(files)
    lines = [
        "    trusted" + (f"; {kernels_phrase(stale)} of an older format, never used (delete them)" if stale else "")
    ]
    if skipped:
        shown = ", ".join(skipped[:3]) + (", ..." if len(skipped) > 3 else "")
        lines.append(f"    {len(skipped)} *.cubin not a regular file (e.g. a symbolic link), never used: {shown}")
    if not files:
        return [*lines, "    empty"]
    by_arch: dict[str, list[int]] = {}
    for f in files:
        by_arch.setdefault(f.name.split("-", 1)[0], []).append(file_sizes[f])
    total = sum(sum(sizes) for sizes in by_arch.values())
    lines.append(f"    {kernels_phrase(len(files))}, {_size(total)}")
    lines += [
        f"    {arch}: {kernels_phrase(len(sizes))}, {_size(sum(sizes))}" for arch, sizes in sorted(by_arch.items())
    ]
    return lines + compiler_lines(directory, [f.name for f in files])


def arch_range(low: int, high: int) -> str:
    """The GPUs a decode backend runs on: "sm_80+" (no upper end), "sm_90" (one) or "sm_80-sm_89"."""
    if high >= UNBOUNDED:
        return f"sm_{low}+"
    return f"sm_{low}" if low == high else f"sm_{low}-sm_{high}"


def cmd_info(args: argparse.Namespace) -> int:
    name, why_not = gpu_name(), gpu_unavailable_reason()
    print(f"nvfp4-mla {__version__}")
    print(f"GPU:   {name or 'no GPU'}")
    if why_not:
        print(f"       GPU entries unavailable: {why_not}.")
    for package, version in _versions().items():
        print(f"{package + ':':6} {version}")
    capability = None if why_not else device_info(torch.cuda.current_device()).capability
    print("ops (precompile --<op>; decode backends: the GPUs each runs on):")
    for op in registry.OPS.values():
        print(f"  {op.name:7} {op.summary}")
    for backend in decode.BACKENDS.values():
        here = (
            "" if capability is None else ("  (runs here)" if backend.supports(capability) else "  (not on this GPU)")
        )
        print(f"          backend {backend.name}: {arch_range(backend.min_capability, backend.max_capability)}{here}")
    print("kernel cache, searched in order (NVFP4_MLA_CACHE_DIR, then the per-user default):")
    cache = kernel_cache.default()
    for directory in cache.layers:
        print(f"  {directory}")
        print("\n".join(cache_summary(directory, cache.layer_status(directory))))
    return 0


def add_parser(sub: Any) -> None:
    """The ``info`` subcommand."""
    p = sub.add_parser("info", help="GPU, torch/CuPy/NVRTC versions and the kernel cache")
    p.set_defaults(func=cmd_info)
