"""The ``nvfp4-mla`` command line (also ``python -m nvfp4_mla``).

Subcommands: ``info`` (GPU, versions, kernel cache), ``precompile`` (build kernels for serving
start-up, no GPU needed with ``--arch``), ``bench`` (the benchmark), ``demo`` (one small call,
fused on a GPU or the reference on the CPU) and ``inspect`` (pretty-print one record of a saved
cache; the record printer is :func:`nvfp4_mla.format_record`).
"""

from __future__ import annotations

import argparse
import io
import os
import stat
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any, NoReturn

import torch

from . import __version__, abi, jit, kernel_cache, kernel_file, reference, validation
from .device import device_info, gpu_unavailable_reason
from .ops import decode, nvfp4_dequantize_sparse_mla_cache, registry
from .records import first_written_slot, format_record, summarize_record

SIGPIPE_EXIT = 141  # 128 + SIGPIPE: what a shell reports for a writer whose reader went away
INTERRUPTED_EXIT = 130  # 128 + SIGINT: what a shell reports for a command stopped with Ctrl-C
UNBOUNDED = 10**6  # a decode backend's max_capability when it has no upper end

# ---------------------------------------------------------------- info


def _gpu_name() -> str | None:
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


def _kernels(n: int) -> str:
    return f"{n} kernel" + ("s" if n != 1 else "")


def cache_summary(directory: Path, status: str) -> list[str]:
    """Lines describing a kernel cache layer: whether it is used (``status``, from
    ``KernelCache.layer_status``) and, when trusted, its kernels by architecture.

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
        dangling symbolic link), the total, then one line per architecture.
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
    lines = ["    trusted" + (f"; {_kernels(stale)} of an older format, never used (delete them)" if stale else "")]
    if skipped:
        shown = ", ".join(skipped[:3]) + (", ..." if len(skipped) > 3 else "")
        lines.append(f"    {len(skipped)} *.cubin not a regular file (e.g. a symbolic link), never used: {shown}")
    if not files:
        return [*lines, "    empty"]
    by_arch: dict[str, list[int]] = {}
    for f in files:
        by_arch.setdefault(f.name.split("-", 1)[0], []).append(file_sizes[f])
    total = sum(sum(sizes) for sizes in by_arch.values())
    lines.append(f"    {_kernels(len(files))}, {_size(total)}")
    lines += [f"    {arch}: {_kernels(len(sizes))}, {_size(sum(sizes))}" for arch, sizes in sorted(by_arch.items())]
    return lines


def arch_range(low: int, high: int) -> str:
    """The GPUs a decode backend runs on: "sm_80+" (no upper end), "sm_90" (one) or "sm_80-sm_89"."""
    if high >= UNBOUNDED:
        return f"sm_{low}+"
    return f"sm_{low}" if low == high else f"sm_{low}-sm_{high}"


def cmd_info(args: argparse.Namespace) -> int:
    name, why_not = _gpu_name(), gpu_unavailable_reason()
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


# ---------------------------------------------------------------- precompile


def _geometries(args: argparse.Namespace) -> list:
    from .geometry import Geometry

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
        from .geometry import ARCH_LIST_ENV, env_arch_list

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
    print(f"{_kernels(len(paths))} ready in {paths[0].parent}")
    return 0


# ---------------------------------------------------------------- inspect


def cmd_inspect(args: argparse.Namespace) -> int:
    parser: argparse.ArgumentParser = args.parser

    def fail(message: str) -> NoReturn:  # one line and exit status 2, like argparse's own errors
        parser.exit(2, f"{parser.prog}: error: {message}\n")

    try:
        cache = torch.load(args.path, map_location="cpu", weights_only=True)
    except FileNotFoundError:
        fail(f"{args.path}: no such file")
    except OSError as exc:
        fail(f"{args.path}: cannot read it ({exc.strerror or exc})")
    except Exception:  # unpickling foreign bytes (/etc/passwd) raises about anything: IndexError, KeyError, ...
        fail(f"{args.path}: not a tensor saved with torch.save")
    if not isinstance(cache, torch.Tensor):
        fail(f"{args.path} holds a {type(cache).__name__}, not a cache tensor")
    if cache.is_nested or cache.layout is not torch.strided:  # (a nested tensor's layout may be strided)
        kind = "nested" if cache.is_nested else str(cache.layout).removeprefix("torch.")
        fail(f"{args.path} holds a {kind} tensor, not a cache tensor (a dense torch.uint8 tensor)")
    if cache.is_meta:
        fail(f"{args.path} holds a tensor on the meta device: a shape without data, nothing to show")
    try:
        slot = args.slot
        if slot is None:
            slot = first_written_slot(cache)
            if slot is None:
                fail(f"{args.path}: no record of it has been written; --slot N shows one anyway")
            print(f"(slot {slot}: the first written record; --slot N shows another)")
        print(format_record(cache, slot))
    except ValueError as exc:
        fail(f"{args.path}: {exc}")
    return 0


# ---------------------------------------------------------------- demo


def _check_save_path(parser: argparse.ArgumentParser, path: str) -> None:
    """--save's file must be writable before the demo runs: one error line and exit status 2."""
    target = Path(path)
    folder = target.parent
    if target.is_dir():
        parser.exit(2, f"{parser.prog}: error: --save {path}: a directory, not a file\n")
    if not folder.is_dir():
        parser.exit(2, f"{parser.prog}: error: --save {path}: no such directory {folder}\n")
    if not os.access(folder, os.W_OK | os.X_OK) or (target.exists() and not os.access(target, os.W_OK)):
        parser.exit(2, f"{parser.prog}: error: --save {path}: not writable by this user\n")


def _save(parser: argparse.ArgumentParser, cache: torch.Tensor, path: str) -> None:
    """``torch.save`` into ``path``; a failed write (a full disk) is one error line, exit status 2.
    Serialized in memory first: torch.save's own writer reports a failed write as an obscure
    RuntimeError, a plain file write as an OSError with its reason."""
    buffer = io.BytesIO()
    torch.save(cache, buffer)
    try:
        with open(path, "wb") as file:
            file.write(buffer.getbuffer())
    except OSError as exc:
        parser.exit(2, f"{parser.prog}: error: --save {path}: cannot write it ({exc.strerror or exc})\n")


def cmd_demo(args: argparse.Namespace) -> int:
    import nvfp4_mla

    if args.save:
        _check_save_path(args.parser, args.save)
    num_tokens, num_heads, q_head_padded, page_size, num_pages = 4, 8, 16, 16, 2
    gen = torch.Generator().manual_seed(args.seed)
    q = torch.randn(num_tokens, num_heads, abi.HEAD_DIM, generator=gen).to(torch.bfloat16)
    kv = torch.randn(num_tokens, abi.HEAD_DIM, generator=gen).to(torch.bfloat16)
    cache = torch.zeros(num_pages, page_size, abi.RECORD_BYTES, dtype=torch.uint8)
    slots = torch.tensor([5, 17, 30, 12])  # not in order; slot 5 first in the cache, what inspect shows first
    positions = torch.tensor([0, 1, 7, 63])
    inputs = (q, kv, cache, slots, positions, reference.rope_table(64, "cpu"))

    why_not = "--cpu was given" if args.cpu else gpu_unavailable_reason()
    if why_not:
        print(f"Ran nvfp4_mla.reference on the CPU, not the GPU kernels: {why_not}.")
        q_out = reference.cake_dsv4_nvfp4_rope_quantize_insert(*inputs, q_head_padded=q_head_padded)
    else:
        gpu_inputs = tuple(t.cuda() for t in inputs)
        q_out = nvfp4_mla.cake_dsv4_nvfp4_rope_quantize_insert(*gpu_inputs, q_head_padded=q_head_padded)
        print(f"Ran the fused GPU entry cake_dsv4_nvfp4_rope_quantize_insert on {_gpu_name()}.")
        q_ref = reference.cake_dsv4_nvfp4_rope_quantize_insert(*inputs, q_head_padded=q_head_padded)
        same = torch.equal(gpu_inputs[2].cpu(), cache) and torch.equal(
            q_out.cpu().view(torch.int16), q_ref.view(torch.int16)
        )
        print(f"Cache and q_out bytes equal to nvfp4_mla.reference on the CPU: {'yes' if same else 'NO'}")
        cache, q_out = gpu_inputs[2].cpu(), q_out.cpu()
    print(
        f"{num_tokens} tokens, {num_heads} heads padded to {q_out.shape[1]}, written into a "
        f"[{num_pages}, {page_size}, {abi.RECORD_BYTES}] cache at slots {slots.tolist()}"
    )
    # The record inspect shows by default (the first written one), so demo --save, then inspect,
    # shows the record summarised here.
    slot = first_written_slot(cache)
    assert slot is not None  # four rows were written
    row = slots.tolist().index(slot)
    print(format_record(cache, slot) if args.full else summarize_record(cache, slot))
    decoded = nvfp4_dequantize_sparse_mla_cache(cache, slots[row : row + 1])[0]
    nope_in = kv[row, : abi.NOPE_DIM].float()
    error = (decoded[: abi.NOPE_DIM] - nope_in).abs().max().item()
    print(
        f"max |quantization error| of row {row} (slot {slot}) over its {abi.NOPE_DIM} NoPE values: {error:.4g} "
        f"(max |input| {nope_in.abs().max().item():.4g}); the {abi.ROPE_DIM} RoPE values are stored as BF16."
    )
    if args.save:
        _save(args.parser, cache, args.save)
        print(f"cache saved to {args.save}; try: nvfp4-mla inspect {args.save}")
    elif not args.full:
        print("The whole record: nvfp4-mla demo --full (or --save FILE, then nvfp4-mla inspect FILE).")
    return 0


# ---------------------------------------------------------------- bench and main


def plain(text: str) -> str:
    """A docstring paragraph as help text: without reST's double backticks."""
    return text.replace("``", "")


def cmd_bench(argv: list[str]) -> int:
    from .bench import main as bench_main  # imported only when asked for

    return bench_main(argv)


def build_parser() -> argparse.ArgumentParser:
    """The ``nvfp4-mla`` argument parser (``bench`` is listed here, parsed by the benchmark)."""
    parser = argparse.ArgumentParser(prog="nvfp4-mla", description=plain((__doc__ or "").split("\n\n")[0]))
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("info", help="GPU, torch/CuPy/NVRTC versions and the kernel cache")
    p.set_defaults(func=cmd_info)

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

    sub.add_parser("bench", help="the benchmark on this GPU (nvfp4-mla bench -h for its options)", add_help=False)

    p = sub.add_parser("demo", help="one small call: fused on a GPU, else the reference on the CPU")
    p.add_argument("--cpu", action="store_true", help="use the reference even when a GPU is usable")
    p.add_argument("--seed", type=int, default=0, help="seed of the random query and KV rows (default 0)")
    p.add_argument("--save", metavar="PATH", help="torch.save the cache (for inspect)")
    p.add_argument("--full", action="store_true", help="print the whole record, every group's codes and values")
    p.set_defaults(func=cmd_demo, parser=p)

    p = sub.add_parser("inspect", help="pretty-print one record of a torch.save'd cache")
    p.add_argument("path", help="a cache tensor saved with torch.save (e.g. by demo --save)")
    p.add_argument(
        "--slot", type=int, default=None, help="slot = page * page_size + entry (default: the first written record)"
    )
    p.set_defaults(func=cmd_inspect, parser=p)
    return parser


def print_interrupted() -> None:
    """What a Ctrl-C leaves on stderr: one line, not a traceback."""
    print("nvfp4-mla: interrupted", file=sys.stderr, flush=True)


def main(argv: list[str] | None = None) -> int:
    """Runs the command line on ``argv`` (default ``sys.argv[1:]``) and returns the exit status."""
    argv = list(sys.argv[1:] if argv is None else argv)
    try:  # (a Ctrl-C anywhere in a command, its imports included, ends here)
        if argv[:1] == ["bench"]:  # forwarded untouched, --help included
            status = cmd_bench(argv[1:])
        else:
            args = build_parser().parse_args(argv)
            status = args.func(args)
        sys.stdout.flush()  # a closed pipe shows up here rather than at interpreter exit
    except BrokenPipeError:
        # The reader went away (``nvfp4-mla demo | head``): stop quietly. Point stdout at devnull
        # so the interpreter's final flush does not raise again.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return SIGPIPE_EXIT
    except KeyboardInterrupt:
        print_interrupted()
        return INTERRUPTED_EXIT
    return status
