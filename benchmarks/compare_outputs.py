"""Every entry's outputs on fixed seeded inputs, for comparing two trees bit for bit on a GPU.

Runs the writers (every mode, canary-filled caches: the whole storage is an output), the reader
(both dtypes, int32, int64 and no slots, invalid slots) and the decode (every backend this GPU
runs, forced, its work list whole and cut in five parts; at 16, 64 and 128 heads, both pools
with lengths, sinks, and the rule's own choice over 1-4 and 64 rows) on inputs drawn on the CPU
from fixed seeds, and saves what each call wrote. Only the public entries and ``KernelLibrary`` are used, so any tree's
``nvfp4_mla`` on the path runs it::

    PYTHONPATH=src python benchmarks/compare_outputs.py --out new.pt
    PYTHONPATH=/old/tree/src python benchmarks/compare_outputs.py --out old.pt
    python benchmarks/compare_outputs.py --compare old.pt new.pt

``--compare`` prints each case that differs (or is missing) and exits 1 if any does.
"""

from __future__ import annotations

import argparse
import sys
import zlib
from typing import Any

import torch

CUDA = "cuda"


def generator(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def bf16_rows(shape, g):
    return (torch.randn(shape, generator=g) * 3).to(torch.bfloat16)


def canary_cache(num_pages, page_size):
    return torch.full((num_pages, page_size, 384), 0xA5, dtype=torch.uint8, device=CUDA)


def slot_table(capacity, count, dtype, g):
    """Unique slots (a writer's), three of them masked, out of range and the pool's last."""
    slots = torch.randperm(capacity - 1, generator=g)[:count]
    slots[:3] = torch.tensor([-1, capacity, capacity - 1])
    return slots.to(dtype).to(CUDA)


def read_slots(capacity, shape, dtype, g):
    """Slots to read (repeats allowed), some masked or out of range."""
    return torch.randint(-1, capacity + 2, shape, generator=g).to(dtype).to(CUDA)


def writers(results):
    import nvfp4_mla

    cos_sin = torch.randn(97, 64, generator=generator(1)).to(CUDA)
    for case, (tokens, heads, padded, inplace, page_size, dtype) in enumerate(
        [(37, 8, 16, False, 64, torch.int64), (5, 128, 128, False, 3, torch.int32), (64, 16, 0, True, 256, torch.int64)]
    ):
        g = generator(100 + case)
        q, kv = bf16_rows((tokens, heads, 512), g).to(CUDA), bf16_rows((tokens, 512), g).to(CUDA)
        num_pages = tokens // page_size + 2
        slots = slot_table(num_pages * page_size, tokens, dtype, g)
        positions = torch.randint(-1, 98, (tokens,), generator=g).to(CUDA)
        cache = canary_cache(num_pages, page_size)
        q_out = nvfp4_mla.cake_dsv4_nvfp4_rope_quantize_insert(
            q, kv, cache, slots, positions, cos_sin, q_head_padded=padded, q_inplace=inplace
        )
        results[f"main {case}"] = (cache, q_out, q)
        for ratio in (1, 2):
            cache = canary_cache(num_pages, page_size)
            nvfp4_mla.cake_dsv4_nvfp4_kv_rope_quantize_insert(
                kv, cache, slots, positions, cos_sin, compress_ratio=ratio
            )
            results[f"kv {case} ratio {ratio}"] = (cache,)
        cache = canary_cache(num_pages, page_size)
        nvfp4_mla.nvfp4_quantize_append_sparse_mla_cache(kv, slots, cache)
        results[f"append {case}"] = (cache,)
    pages = bf16_rows((3, 64, 512), generator(7)).to(CUDA)
    results["pack"] = (nvfp4_mla.nvfp4_quantize_pack_sparse_mla_cache(pages),)


def full_cache(num_pages, page_size, seed):
    import nvfp4_mla

    rows = bf16_rows((num_pages, page_size, 512), generator(seed)).to(CUDA)
    return nvfp4_mla.nvfp4_quantize_pack_sparse_mla_cache(rows, kv_layout="HND").view(num_pages, page_size, 384)


def reader(results):
    import nvfp4_mla

    cache = full_cache(8, 64, 11)
    for dtype in (torch.float32, torch.bfloat16):
        for slot_dtype in (torch.int32, torch.int64, None):
            slots = None if slot_dtype is None else read_slots(8 * 64, (300,), slot_dtype, generator(12))
            out = nvfp4_mla.nvfp4_dequantize_sparse_mla_cache(cache, slots, dtype=dtype)
            results[f"read {dtype} {slot_dtype}"] = (out,)


def decode(results):
    import nvfp4_mla
    from nvfp4_mla.device import device_info
    from nvfp4_mla.ops import decode as decode_op

    gpu = device_info(torch.cuda.current_device())
    names = [name for name, b in decode_op.BACKENDS.items() if b.supports(gpu.capability)]
    swa_cache, extra_cache = full_cache(16, 64, 21), full_cache(64, 64, 22)

    def call(label, batch, q_len, heads, k_extra, library=None):
        g = generator(zlib.crc32(label.encode()))
        q = bf16_rows((batch, q_len, heads, 512), g).to(CUDA)
        swa_slots = read_slots(16 * 64, (batch, q_len, 128), torch.int32, g)
        extra_slots = read_slots(64 * 64, (batch, q_len, k_extra), torch.int64, g)
        swa_lens = torch.randint(0, 129, (batch, q_len), generator=g).to(CUDA)
        extra_lens = torch.randint(0, k_extra + 1, (batch, q_len), generator=g).to(torch.int64).to(CUDA)
        sinks = torch.randn(heads, generator=g).to(CUDA)
        out, lse = nvfp4_mla.sparse_mla_decode(
            q,
            swa_cache,
            swa_slots,
            swa_lens=swa_lens,
            extra_cache=extra_cache,
            extra_slots=extra_slots,
            extra_lens=extra_lens,
            sm_scale=512**-0.5,
            sinks=sinks,
            library=library,
        )
        results[label] = (out, lse)

    for name in names:
        # A backend cuts the rows n ways by its work list's parts (decode_parts), or in a tree from
        # before its kernel walked one, by its splits (decode_splits, where it declares them).
        splits = "decode_splits" in getattr(decode_op.BACKENDS[name], "overrides", ())
        field = "decode_splits" if splits else "decode_parts"
        for heads in (16, 64, 128):
            for n in (1, 5):
                forced: dict[str, Any] = {field: n}
                library = nvfp4_mla.KernelLibrary(decode_backend=name, **forced)
                call(f"decode {name} {heads} heads cut {n} ways", 3, 2, heads, 512, library)
    for rows in (1, 2, 3, 4, 64):
        for heads in (16, 64, 128):
            call(f"decode rule {rows} rows {heads} heads", rows, 1, heads, 1024)


def collect() -> dict[str, tuple]:
    results: dict[str, tuple] = {}
    for part in (writers, reader, decode):
        part(results)
    torch.cuda.synchronize()
    return {k: tuple(t.cpu().contiguous().view(torch.uint8) for t in v) for k, v in results.items()}


def compare(old: dict, new: dict) -> int:
    bad = 0
    for key in sorted(old.keys() | new.keys()):
        if key not in old or key not in new:
            print(f"only in {'the second' if key in new else 'the first'}: {key}")
            bad += 1
        elif len(old[key]) != len(new[key]) or not all(torch.equal(a, b) for a, b in zip(old[key], new[key])):
            print(f"differs: {key}")
            bad += 1
    print(f"{len(old.keys() & new.keys())} cases in both, {bad} differ or are missing")
    return 1 if bad else 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out")
    parser.add_argument("--compare", nargs=2, metavar=("OLD", "NEW"))
    args = parser.parse_args()
    if args.compare:
        return compare(*(torch.load(p) for p in args.compare))
    torch.save(collect(), args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
