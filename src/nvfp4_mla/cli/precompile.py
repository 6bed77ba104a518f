"""``nvfp4-mla precompile``: the kernels of one serving geometry into the disk cache."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from .. import abi, jit, kernel_cache, validation
from ..device import device_info, gpu_unavailable_reason
from .info import kernels_phrase


def _geometries(args: argparse.Namespace) -> list:
    from ..geometry import Geometry

    slot_dtype = getattr(torch, args.slot_dtype)
    geometries = []
    if args.heads:
        geometries.append(
            Geometry(
                "main",
                args.page_size,
                num_heads=args.heads,
                q_head_padded=args.q_head_padded,
                q_inplace=args.inplace,
                slot_dtype=slot_dtype,
            )
        )
    geometries += [Geometry("kv", args.page_size, compress_ratio=r, slot_dtype=slot_dtype) for r in args.kv_ratio]
    if args.append:
        geometries.append(Geometry("append", args.page_size, slot_dtype=slot_dtype))
    if args.read:
        geometries += [Geometry("read", args.page_size, slot_dtype=slot_dtype, dtype=d) for d in validation.READ_DTYPES]
    if args.decode:
        geometries.append(Geometry("decode"))
    return geometries


def _progress(jobs: list, labels: list[str]) -> Iterator:
    """Yields ``jobs`` (one a kernel). On a terminal a tqdm bar on stderr shows the current label;
    otherwise (a log file, CI) one plain line per job, so no carriage returns end up in logs."""
    if sys.stderr.isatty():
        from tqdm import tqdm

        with tqdm(total=len(jobs), file=sys.stderr, unit="kernel") as bar:
            for job, label in zip(jobs, labels):
                bar.set_description_str(label)
                yield job
                bar.update()
    else:
        for i, (job, label) in enumerate(zip(jobs, labels), 1):
            print(f"[{i}/{len(jobs)}] {label}", file=sys.stderr, flush=True)
            yield job


def cache_dir_arg(text: str) -> Path:
    """``--cache-dir``'s value: a path, never an empty one (that would mean the working directory)."""
    if not text:
        raise argparse.ArgumentTypeError("an empty path; give . for the working directory")
    return Path(text)


def cmd_precompile(args: argparse.Namespace) -> int:
    parser = args.parser
    # The entries' own bound (validation.check_page_size), checked here also for --decode alone.
    if not 1 <= args.page_size <= validation.MAX_PAGE_SIZE:
        parser.error(
            f"--page-size must be positive and below 2^30 (a cache holds fewer than 2^30 slots), got {args.page_size}"
        )
    if (args.q_head_padded or args.inplace) and not args.heads:
        parser.error("--q-head-padded and --inplace describe the main entry: give --heads too")
    geometries = _geometries(args)
    if not geometries:
        parser.error("nothing to build: give --heads (main entry), --kv-ratio, --append, --read and/or --decode")
    if args.cache_dir is not None:  # before any work: one error line, exit status 2
        reason = kernel_cache.prepare_dir(args.cache_dir, kernel_cache.IMAGE_MODE)
        if reason is not None:
            parser.error(f"--cache-dir: cannot write kernels into {args.cache_dir}: {reason}")
    archs = args.arch
    if archs:
        try:
            archs = [jit.check_arch(arch) for arch in archs]
        except ValueError as exc:
            parser.error(str(exc))
    else:  # TORCH_CUDA_ARCH_LIST when set (as torch's own builds take it), else this machine's GPU
        from ..geometry import ARCH_LIST_ENV, env_arch_list

        try:
            listed = env_arch_list()
        except ValueError as exc:
            parser.error(f"{exc}; fix it or give --arch")
        if listed is not None:
            for note in listed.notes:
                print(f"nvfp4-mla: note: {note}", file=sys.stderr)
            archs = listed.archs
        else:
            why_not = gpu_unavailable_reason()
            if why_not:
                parser.error(
                    f"give --arch (e.g. --arch sm_90) or set {ARCH_LIST_ENV}; no usable GPU to take it from: {why_not}"
                )
            archs = [device_info(torch.cuda.current_device()).arch]

    # Different requests can share a kernel (the main entry without q_out is the KV entry with
    # ratio 1): each kernel is built and counted once per architecture. One job a kernel (what
    # nvfp4_mla.precompile does for each kernel of a request), so the progress counts kernels: a
    # request like --decode has several.
    try:  # argument errors before any compile
        unique: dict[tuple, tuple[str, Any, str]] = {}
        for a in archs:
            for g in geometries:  # the first request of a kernel names it
                specs = g.specs(a)
                for spec in specs:
                    label = g.describe() if len(specs) == 1 else spec.describe()
                    unique.setdefault((a, type(spec), spec), (a, spec, f"{a}: {label}"))
        jobs = [(a, spec) for a, spec, _ in unique.values()]
    except ValueError as exc:
        parser.error(str(exc))
    cache = kernel_cache.default()
    built: list[Path | None] = []
    for arch, spec in _progress(jobs, [label for _, _, label in unique.values()]):
        try:
            built.append(cache.build(spec, arch, args.cache_dir)[1])
        except RuntimeError as exc:  # NVRTC missing, or --cache-dir cannot hold kernels (kernel_cache.CacheError)
            raise SystemExit(str(exc)) from None
    paths = [p for p in dict.fromkeys(built) if p is not None]
    if len(paths) < len(set(built)):
        raise SystemExit(
            "no writable kernel cache directory, so the kernels stayed in memory: "
            "give --cache-dir or set NVFP4_MLA_CACHE_DIR to a directory you can write"
        )
    for path in paths:
        print(path)
    print(f"{kernels_phrase(len(paths))} ready in {paths[0].parent}")
    return 0


def add_parser(sub: Any) -> None:
    """The ``precompile`` subcommand."""
    p = sub.add_parser(
        "precompile",
        help="compile kernels into the disk cache (serving start-up)",
        description=(
            "Compile the kernels of one serving geometry into the disk cache; with --arch (or "
            "TORCH_CUDA_ARCH_LIST) no GPU is needed."
        ),
    )
    p.add_argument(
        "--arch",
        nargs="+",
        metavar="SM",
        help="e.g. sm_80 sm_90 (default: TORCH_CUDA_ARCH_LIST when set, else this machine's GPU)",
    )
    p.add_argument(
        "--cache-dir",
        type=cache_dir_arg,
        metavar="D",
        help="compile into exactly this directory (e.g. for a container image), else into the kernel cache",
    )
    p.add_argument("--page-size", type=int, default=256, help="tokens per cache page (default 256)")
    p.add_argument("--heads", type=int, default=0, help="query heads per GPU: builds the main entry")
    p.add_argument("--q-head-padded", type=int, default=0, help="padded head count of q_out (0: cache only)")
    p.add_argument("--inplace", action="store_true", help="the q_inplace variant of the main entry")
    p.add_argument(
        "--slot-dtype", choices=("int32", "int64"), default="int64", help="slot_mapping dtype (default int64)"
    )
    p.add_argument(
        "--kv-ratio",
        type=int,
        nargs="+",
        default=[],
        choices=abi.COMPRESS_RATIOS,
        help="also build the KV entry for these compress ratios",
    )
    p.add_argument("--append", action="store_true", help="also build the unfused append entry")
    p.add_argument(
        "--read", action="store_true", help="also build the GPU reader (float32 and bfloat16 out, this slot dtype)"
    )
    p.add_argument("--decode", action="store_true", help="also build the kernels of sparse_mla_decode")
    p.set_defaults(func=cmd_precompile, parser=p)
