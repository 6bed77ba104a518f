"""Kernels built ahead of time: :class:`Geometry` names what fixes a kernel, :func:`precompile`
builds (and optionally loads) them, e.g. while building a container image or at server start-up."""

from __future__ import annotations

import os
import re
from collections.abc import Iterable
from pathlib import Path
from typing import Any, NamedTuple

import torch

from . import jit, kernel_cache
from .device import device_info, gpu_unavailable_reason
from .launch import Launcher
from .ops import registry
from .ops.registry import Geometry

ENTRIES = tuple(registry.OPS)  # "main", "kv", "append", "pack", "read", "decode"
ARCH_LIST_ENV = "TORCH_CUDA_ARCH_LIST"  # nvfp4-mla precompile's default architectures, as torch's builds take them
_ARCH_ENTRY = re.compile(r"(\d+)\.(\d)([af]?)(\+PTX)?", re.IGNORECASE)


class ArchList(NamedTuple):
    """The architectures a ``TORCH_CUDA_ARCH_LIST`` value names, and what was set aside of it."""

    archs: list[str]  # "sm_90a", ... in its order, each once
    notes: list[str]  # one line for each part ignored (a +PTX suffix)


def parse_arch_list(text: str) -> ArchList:
    """The architectures of a ``TORCH_CUDA_ARCH_LIST`` value: entries like ``8.0 8.6 9.0 9.0a`` or
    ``8.0;9.0+PTX``, separated by spaces or semicolons; ``9.0`` is sm_90, ``9.0a`` sm_90a. A
    ``+PTX`` suffix is ignored with a note (the kernel cache holds cubins only: a kernel is built
    for the architecture of the GPU it runs on).

    Raises
    ------
    ValueError
        Naming the variable, for an entry of another form or older than sm_80, or no entry.
    """
    archs: dict[str, None] = {}
    notes = []
    for entry in re.split(r"[\s;]+", text.strip()):
        if not entry:
            continue
        match = _ARCH_ENTRY.fullmatch(entry)
        if match is None:
            raise ValueError(
                f"{ARCH_LIST_ENV}={text!r}: cannot read {entry!r} (entries look like 8.0, 9.0a or 9.0+PTX, "
                "separated by spaces or semicolons)"
            )
        major, minor, variant, ptx = match.groups()
        arch = f"sm_{int(major)}{minor}{variant.lower()}"
        try:
            jit.check_arch(arch)
        except ValueError as exc:
            raise ValueError(f"{ARCH_LIST_ENV}={text!r}: {entry} ({arch}): {exc}") from None
        if ptx:
            notes.append(
                f"{ARCH_LIST_ENV}: the +PTX of {entry} is ignored (nvfp4_mla builds cubins only); {arch} is built"
            )
        archs[arch] = None
    if not archs:
        raise ValueError(f"{ARCH_LIST_ENV}={text!r} names no architecture")
    return ArchList(list(archs), notes)


def env_arch_list() -> ArchList | None:
    """:func:`parse_arch_list` of ``TORCH_CUDA_ARCH_LIST``; None when it is unset or blank. The
    default architectures of ``nvfp4-mla precompile`` without ``--arch``."""
    text = os.environ.get(ARCH_LIST_ENV, "")
    return parse_arch_list(text) if text.strip() else None


class Precompiled(NamedTuple):
    """One kernel :func:`precompile` built: what it is, where its file lies (None: compiled into
    memory only) and, when loaded on a GPU, its launcher."""

    description: str
    arch: str  # the architecture of the build (e.g. "sm_90a")
    path: Path | None
    launcher: Launcher | None


def _request(g: Geometry | dict[str, Any]) -> Geometry:
    return g if isinstance(g, Geometry) else Geometry(**g)


def precompile(
    geometries: Iterable[Geometry | dict[str, Any]],
    *,
    device: torch.device | str | int | None = None,
    arch: str | None = None,
    directory: str | Path | None = None,
) -> list[Precompiled]:
    """Builds kernels ahead of time (serving start-up, container images), e.g.
    ``precompile([Geometry("main", 256, num_heads=8, q_head_padded=16), Geometry("decode")])``.

    Parameters
    ----------
    geometries
        The requests (:class:`Geometry`, or dicts of its fields).
    device
        The GPU to load the kernels on (default: the current one), so the first real call does no
        compile and no file I/O. Ignored with ``arch``.
    arch
        Compile only, for this architecture ("sm_90", ...): no GPU needed.
    directory
        Write the kernels into exactly this directory (``kernel_cache.CacheError`` when it cannot
        hold them); else into the kernel cache's writable layer (docs/format.md section 11).

    Returns
    -------
    list of Precompiled
        One per unique kernel, in request order.

    Raises
    ------
    ValueError
        For a request the entry would refuse, or without ``arch`` when no GPU is usable.
    """
    requests = [_request(g) for g in geometries]
    cache = kernel_cache.default()
    target = None if directory is None else Path(directory)
    if arch is None:
        index = torch.device("cuda" if device is None else device).index
        why_not = gpu_unavailable_reason(index)
        if why_not is not None:
            raise ValueError(f"precompile needs arch= (e.g. arch='sm_90') when no GPU is usable: {why_not}")
        index = torch.cuda.current_device() if index is None else index
        gpu_arch = device_info(index).arch
    else:
        gpu_arch = jit.check_arch(arch)
    specs = jit.unique(s for g in requests for s in g.specs(gpu_arch))
    built = []
    for spec in specs:
        build_arch = jit.target_arch(spec, gpu_arch)
        path = None
        if arch is not None or target is not None:
            path = cache.build(spec, gpu_arch, target)[1]
        launcher = None if arch is not None else cache.launcher(index, spec)
        built.append(Precompiled(spec.describe(), build_arch, path, launcher))
    return built
