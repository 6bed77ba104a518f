"""The ``nvfp4-mla`` command line (also ``python -m nvfp4_mla``).

Subcommands: ``info`` (GPU, versions, kernel cache), ``precompile`` (build kernels for serving
start-up, no GPU needed with ``--arch``), ``bench`` (the benchmark), ``demo`` (one small call,
fused on a GPU or the reference on the CPU) and ``inspect`` (pretty-print one record of a saved
cache).
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import NamedTuple

import torch

from . import abi, jit, reference, validation


# ---------------------------------------------------------------- environment


class GpuStatus(NamedTuple):
    name: str | None  # the current GPU's name, None without one
    arch: str | None  # "sm_90", ...
    why_not: str | None  # None when the GPU kernels can run here, else why not (one clause)


def gpu_status() -> GpuStatus:
    """Whether the GPU entries can run here: a CUDA GPU of sm_80 or newer, CuPy and NVRTC."""
    if not torch.cuda.is_available():
        return GpuStatus(None, None, "torch sees no CUDA GPU on this machine")
    major, minor = torch.cuda.get_device_capability()
    name, arch = torch.cuda.get_device_name(), f"sm_{major}{minor}"
    if major < 8:
        return GpuStatus(name, arch, f"{name} is {arch}, older than the sm_80 the kernels need")
    try:
        from cupy.cuda import nvrtc

        nvrtc.getVersion()
    except Exception as exc:  # CuPy missing, or libnvrtc not found
        return GpuStatus(name, arch, f"CuPy with NVRTC is not usable ({exc}); pip install 'nvfp4-mla[cu12]'")
    return GpuStatus(name, arch, None)


def _versions() -> dict:
    versions = {"torch": torch.__version__ + (f" (CUDA {torch.version.cuda})" if torch.version.cuda else " (CPU build)")}
    try:
        import cupy

        versions["CuPy"] = cupy.__version__
    except Exception as exc:
        versions["CuPy"] = f"not available ({exc})"
    try:
        from cupy.cuda import nvrtc

        versions["NVRTC"] = "%d.%d" % nvrtc.getVersion()
    except Exception as exc:
        versions["NVRTC"] = f"not available ({exc})"
    return versions


def _size(num_bytes: int) -> str:
    for unit in ("B", "KiB", "MiB"):
        if num_bytes < 1024:
            return f"{num_bytes:.0f} {unit}" if unit == "B" else f"{num_bytes:.1f} {unit}"
        num_bytes /= 1024
    return f"{num_bytes:.1f} GiB"


def _kernels(n: int) -> str:
    return f"{n} kernel" + ("s" if n != 1 else "")


def cache_summary(directory: Path) -> list[str]:
    """Lines describing the cubins in ``directory`` (named ``<arch>-<key>-<hash>.cubin``)."""
    files = sorted(directory.glob("*.cubin")) if directory.is_dir() else []
    if not files:
        return ["  empty" + ("" if directory.is_dir() else " (not created yet)")]
    by_arch: dict[str, list[int]] = {}
    for f in files:
        by_arch.setdefault(f.name.split("-", 1)[0], []).append(f.stat().st_size)
    total = sum(sum(sizes) for sizes in by_arch.values())
    lines = [f"  {_kernels(len(files))}, {_size(total)}"]
    lines += [f"  {arch}: {_kernels(len(sizes))}, {_size(sum(sizes))}" for arch, sizes in sorted(by_arch.items())]
    return lines


def cmd_info(args) -> int:
    from . import __version__

    status = gpu_status()
    print(f"nvfp4-mla {__version__}")
    if status.name is None:
        print("GPU:   no GPU")
    else:
        print(f"GPU:   {status.name} ({status.arch})")
    if status.why_not:
        print(f"       GPU entries unavailable: {status.why_not}.")
    for name, version in _versions().items():
        print(f"{name + ':':6} {version}")
    directory = jit.cache_dir()
    moved = "NVFP4_MLA_CACHE_DIR" in os.environ
    print(f"kernel cache: {directory}" + ("" if moved else " (set NVFP4_MLA_CACHE_DIR to move it)"))
    print("\n".join(cache_summary(directory)))
    return 0


# ---------------------------------------------------------------- precompile


def _geometries(args) -> list:
    from .ops import Geometry

    slot_dtype = getattr(torch, args.slot_dtype)
    geometries = []
    if args.heads:
        geometries.append(
            Geometry("main", args.page_size, num_heads=args.heads, q_head_padded=args.q_head_padded,
                     q_inplace=args.inplace, slot_dtype=slot_dtype)
        )
    geometries += [Geometry("kv", args.page_size, compress_ratio=r, slot_dtype=slot_dtype) for r in args.kv_ratio]
    if args.append:
        geometries.append(Geometry("append", args.page_size, slot_dtype=slot_dtype))
    return geometries


def _describe(g) -> str:
    what = {"main": f"main heads={g.num_heads} q_head_padded={g.q_head_padded}" + (" inplace" if g.q_inplace else ""),
            "kv": f"kv ratio={g.compress_ratio}"}.get(g.entry, g.entry)
    return f"{what} page_size={g.page_size} {str(g.slot_dtype).removeprefix('torch.')}"


def _progress(done: int, total: int, label: str, width: int = 30) -> None:
    filled = width * done // total
    end = "\n" if done == total else ""
    sys.stderr.write(f"\r[{'#' * filled}{'.' * (width - filled)}] {done}/{total} {label:<55}{end}")
    sys.stderr.flush()


def cmd_precompile(args) -> int:
    from .ops import precompile

    parser = args.parser
    if args.page_size < 1:
        parser.error(f"--page-size must be positive, got {args.page_size}")
    if (args.q_head_padded or args.inplace) and not args.heads:
        parser.error("--q-head-padded and --inplace describe the main entry: give --heads too")
    geometries = _geometries(args)
    if not geometries:
        parser.error("nothing to build: give --heads (main entry), --kv-ratio and/or --append")
    try:
        for g in geometries:
            g.variant()  # argument errors before any compile
    except ValueError as exc:
        parser.error(str(exc))
    archs = args.arch
    if not archs:
        status = gpu_status()
        if status.why_not:
            parser.error(f"give --arch (e.g. --arch sm_90); no usable GPU to take it from: {status.why_not}")
        archs = [status.arch]

    jobs = [(arch, g) for arch in archs for g in geometries]
    paths = []
    for i, (arch, g) in enumerate(jobs):
        _progress(i, len(jobs), f"{arch} {_describe(g)}")
        try:
            paths += precompile([g], arch=arch)
        except RuntimeError as exc:  # NVRTC missing or an unknown arch
            raise SystemExit(f"\n{exc}") from None
    _progress(len(jobs), len(jobs), "done")
    for path in paths:
        print(path)
    print(f"{_kernels(len(paths))} ready in {paths[0].parent}")
    return 0


# ---------------------------------------------------------------- inspect


def _row(label: str, items, width: int) -> str:
    return f"  {label:<6}" + "".join(f"{x:>{width}}" for x in items)


def format_record(cache: torch.Tensor, slot: int) -> str:
    """One record of ``cache`` as text: the 28 group scales, each group's E2M1 codes and their
    values, and the 64 RoPE values."""
    num_pages, page_size, page_stride = validation.check_cache(cache)
    if not 0 <= slot < num_pages * page_size:
        raise ValueError(f"slot {slot} is outside the cache's {num_pages * page_size} slots")
    page, entry = divmod(slot, page_size)
    page_bytes = cache.detach().cpu().flatten(1)[page]  # the page's page_size * 384 bytes
    data_at, scales_at = entry * abi.DATA_BYTES, page_size * abi.DATA_BYTES + entry * abi.SCALE_BYTES
    packed = page_bytes[data_at : data_at + abi.NOPE_BYTES]
    scale_slot = page_bytes[scales_at : scales_at + abi.SCALE_BYTES]
    codes = torch.stack((packed & 0xF, packed >> 4), dim=-1).flatten()  # element 2j: low nibble
    code_values = reference.e2m1_value(codes).tolist()
    scales = scale_slot[: abi.NUM_GROUPS].tolist()
    scale_values = reference.e4m3_value(scale_slot[: abi.NUM_GROUPS]).tolist()
    values = reference.nvfp4_dequantize_sparse_mla_cache(cache.detach().cpu(), torch.tensor([slot]))[0].tolist()

    lines = [
        f"slot {slot} = page {page}, entry {entry}  (cache: {num_pages} pages of {page_size}, "
        f"page stride {page_stride} B)",
        f"data row at page byte {data_at}, scale slot at page byte {scales_at} "
        f"(padding bytes {' '.join(f'{b:02X}' for b in scale_slot[abi.NUM_GROUPS:].tolist())})",
        "NoPE, 28 groups of 16: value = E2M1 code value x E4M3 group scale",
    ]
    for g in range(abi.NUM_GROUPS):
        group = slice(g * abi.GROUP_SIZE, (g + 1) * abi.GROUP_SIZE)
        amax = max(abs(v) for v in values[group])
        lines.append(f"group {g:2}  scale 0x{scales[g]:02X} = {scale_values[g]:g}  (max |value| {amax:g})")
        lines.append(_row("code", (f"{c:X}" for c in codes[group].tolist()), 5))
        lines.append(_row("e2m1", (f"{v:g}" for v in code_values[group]), 5))
    lines.append("RoPE, 64 BF16 values:")
    rope = values[abi.NOPE_DIM :]
    lines += [_row(f"{i:3}", (f"{v:.4g}" for v in rope[i : i + 8]), 10) for i in range(0, abi.ROPE_DIM, 8)]
    return "\n".join(lines)


def cmd_inspect(args) -> int:
    cache = torch.load(args.path, map_location="cpu", weights_only=True)
    if not isinstance(cache, torch.Tensor):
        raise SystemExit(f"{args.path} holds a {type(cache).__name__}, not a cache tensor")
    try:
        print(format_record(cache, args.slot))
    except ValueError as exc:
        raise SystemExit(f"{args.path}: {exc}") from None
    return 0


# ---------------------------------------------------------------- demo


def _cos_sin_table(max_position: int) -> torch.Tensor:
    """A real RoPE table: cos[32] | sin[32] of position * inv_freq (fp32)."""
    inv_freq = 1.0 / 10000.0 ** (torch.arange(0, abi.ROPE_DIM, 2, dtype=torch.float64) / abi.ROPE_DIM)
    angles = torch.arange(max_position, dtype=torch.float64)[:, None] * inv_freq
    return torch.cat((angles.cos(), angles.sin()), dim=1).float()


def cmd_demo(args) -> int:
    import nvfp4_mla

    num_tokens, num_heads, q_head_padded, page_size, num_pages = 4, 8, 16, 16, 2
    gen = torch.Generator().manual_seed(args.seed)
    q = torch.randn(num_tokens, num_heads, abi.HEAD_DIM, generator=gen).to(torch.bfloat16)
    kv = torch.randn(num_tokens, abi.HEAD_DIM, generator=gen).to(torch.bfloat16)
    cache = torch.zeros(num_pages, page_size, abi.RECORD_BYTES, dtype=torch.uint8)
    slots = torch.tensor([5, 17, 30, 2])
    positions = torch.tensor([0, 1, 7, 63])
    cos_sin = _cos_sin_table(64)
    inputs = (q, kv, cache, slots, positions, cos_sin)

    status = gpu_status()
    if args.cpu or status.why_not:
        why = "--cpu was given" if args.cpu else status.why_not
        print(f"Ran nvfp4_mla.reference on the CPU, not the GPU kernels: {why}.")
        q_out = reference.cake_dsv4_nvfp4_rope_quantize_insert(*inputs, q_head_padded=q_head_padded)
    else:
        gpu_inputs = tuple(t.cuda() for t in inputs)
        q_out = nvfp4_mla.cake_dsv4_nvfp4_rope_quantize_insert(*gpu_inputs, q_head_padded=q_head_padded)
        print(f"Ran the fused GPU entry cake_dsv4_nvfp4_rope_quantize_insert on {status.name} ({status.arch}).")
        q_ref = reference.cake_dsv4_nvfp4_rope_quantize_insert(*inputs, q_head_padded=q_head_padded)
        same = torch.equal(gpu_inputs[2].cpu(), cache) and torch.equal(q_out.cpu().view(torch.int16), q_ref.view(torch.int16))
        print(f"Cache and q_out bytes equal to nvfp4_mla.reference on the CPU: {'yes' if same else 'NO'}")
        cache, q_out = gpu_inputs[2].cpu(), q_out.cpu()
    print(f"{num_tokens} tokens, {num_heads} heads padded to {q_out.shape[1]}, written into a "
          f"[{num_pages}, {page_size}, {abi.RECORD_BYTES}] cache at slots {slots.tolist()}\n")

    row, slot = 0, int(slots[0])
    print(format_record(cache, slot))
    decoded = reference.nvfp4_dequantize_sparse_mla_cache(cache, slots[row : row + 1])[0]
    nope_in = kv[row, : abi.NOPE_DIM].float()
    error = (decoded[: abi.NOPE_DIM] - nope_in).abs().max().item()
    print(f"\nmax |quantization error| of row {row} (slot {slot}) over its 448 NoPE values: {error:.4g} "
          f"(max |input| {nope_in.abs().max().item():.4g}); the 64 RoPE values are stored as BF16.")
    if args.save:
        torch.save(cache, args.save)
        print(f"cache saved to {args.save}; try: python -m nvfp4_mla inspect {args.save} --slot {slot}")
    return 0


# ---------------------------------------------------------------- bench and main


def cmd_bench(argv: list[str]) -> int:
    from . import bench  # written separately; imported only when asked for

    return bench.main(argv) or 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="nvfp4-mla", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("info", help="GPU, torch/CuPy/NVRTC versions and the kernel cache")
    p.set_defaults(func=cmd_info)

    p = sub.add_parser("precompile", help="compile kernels into the disk cache (serving start-up)",
                       description="Compile kernels for one serving geometry into the disk cache; "
                                   "with --arch no GPU is needed.")
    p.add_argument("--arch", nargs="+", metavar="SM", help="e.g. sm_80 sm_90 (default: this machine's GPU)")
    p.add_argument("--page-size", type=int, default=256, help="tokens per cache page (default 256)")
    p.add_argument("--heads", type=int, default=0, help="query heads per GPU: builds the main entry")
    p.add_argument("--q-head-padded", type=int, default=0, help="padded head count of q_out (0: cache only)")
    p.add_argument("--inplace", action="store_true", help="the q_inplace variant of the main entry")
    p.add_argument("--slot-dtype", choices=("int32", "int64"), default="int64", help="slot_mapping dtype (default int64)")
    p.add_argument("--kv-ratio", type=int, nargs="+", default=[], choices=abi.COMPRESS_RATIOS,
                   help="also build the KV entry for these compress ratios")
    p.add_argument("--append", action="store_true", help="also build the unfused append entry")
    p.set_defaults(func=cmd_precompile, parser=p)

    sub.add_parser("bench", help="the benchmark (arguments go to nvfp4_mla.bench)", add_help=False)

    p = sub.add_parser("demo", help="one small call: fused on a GPU, else the reference on the CPU")
    p.add_argument("--cpu", action="store_true", help="use the reference even when a GPU is usable")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--save", metavar="PATH", help="torch.save the cache (for inspect)")
    p.set_defaults(func=cmd_demo)

    p = sub.add_parser("inspect", help="pretty-print one record of a torch.save'd cache")
    p.add_argument("path")
    p.add_argument("--slot", type=int, default=0, help="slot = page * page_size + entry (default 0)")
    p.set_defaults(func=cmd_inspect)
    return parser


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["bench"]:  # forwarded untouched, --help included
        return cmd_bench(argv[1:])
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
