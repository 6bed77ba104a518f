"""``nvfp4-mla demo`` (one small call, its record summarised) and ``nvfp4-mla inspect`` (one record of
a saved cache, pretty-printed)."""

from __future__ import annotations

import argparse
import io
import os
from pathlib import Path
from typing import Any, NoReturn

import torch

from .. import abi, reference
from ..device import gpu_unavailable_reason
from ..ops import nvfp4_dequantize_sparse_mla_cache
from ..records import first_written_slot, format_record, summarize_record
from .info import gpu_name


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
        print(f"Ran the fused GPU entry cake_dsv4_nvfp4_rope_quantize_insert on {gpu_name()}.")
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


def add_parser(sub: Any) -> None:
    """The ``demo`` and ``inspect`` subcommands."""
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
