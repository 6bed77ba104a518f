"""A small run of every entry and mode, for compute-sanitizer (memcheck, racecheck, initcheck).

Edge cases that touch the bounds: page size 1 and 3, padded pools, the last slot of the pool,
negative and out-of-range slots and positions, data-parallel padding rows, T = 1, and one block
taking several compress-ratio tiles in turn. Each call is
also compared with the reference, so the run fails loudly on a wrong byte too.

    PYTHONPATH=src python3 benchmarks/sanitizer_workload.py
"""

import sys

import torch

import nvfp4_mla
from nvfp4_mla import reference
from nvfp4_mla.testing import (
    ENTRIES,
    args_of,
    make_cache,
    one_kv_block,
    random_rows,
    rope_table,
    storage_bytes,
)

DEVICE = "cuda"
MAX_POSITION = 97


def inputs(num_tokens, num_heads, page_size, slot_dtype):
    num_pages = num_tokens // page_size + 2
    capacity = num_pages * page_size
    slots = torch.randperm(capacity - 1)[: max(num_tokens - 1, 0)]  # the last row is DP padding
    if slots.numel() >= 3:  # capacity - 1 is not drawn above, so slots stay unique
        slots[0], slots[1], slots[2] = -1, capacity, capacity - 1  # skipped, skipped, last slot
    positions = torch.randint(0, MAX_POSITION, (num_tokens,))
    if num_tokens >= 5:
        positions[3], positions[4] = -1, MAX_POSITION  # outside cos_sin_cache
    q = random_rows((num_tokens, num_heads, 512), DEVICE)
    kv = random_rows((num_tokens, 512), DEVICE)
    return q, kv, num_pages, slots.to(slot_dtype).to(DEVICE), positions.to(DEVICE)


def run_both(entry, named, num_pages, page_size, layout, pad, library=None, **kwargs):
    """Runs ``entry`` through the kernels (on ``library``: default the process's) and the reference,
    each on a fresh cache and its own copy of ``q`` (in place mutates it); returns 1 on any
    differing byte."""
    caches = [make_cache(num_pages, page_size, layout, pad, DEVICE) for _ in range(2)]
    outs = []
    for module, cache in zip((nvfp4_mla, reference), caches):
        args = args_of(entry, {**named, "cache": cache, "q": named["q"].clone()})
        options = dict(kwargs, library=library) if module is nvfp4_mla else kwargs
        outs.append(getattr(module, ENTRIES[entry])(*args, **options))
    same = torch.equal(storage_bytes(caches[0]), storage_bytes(caches[1]))
    if isinstance(outs[0], torch.Tensor):
        same &= torch.equal(outs[0].view(torch.int16).cpu(), outs[1].view(torch.int16).cpu())
    return 0 if same else 1


def one_block_tiles(cos_sin):
    """The KV entry at compress ratio 2 over 1000 rows from a single block: four tiles of 256 rows
    reuse its shared list of inserted rows (what racecheck must see). Returns 1 on a differing byte."""
    one_block = nvfp4_mla.KernelLibrary(writer_grid=one_kv_block)
    q, kv, num_pages, slots, positions = inputs(1000, 8, 16, torch.int64)
    named = {"q": q, "kv": kv, "slot_mapping": slots, "positions": positions, "cos_sin_cache": cos_sin}
    return run_both("kv", named, num_pages, 16, "3D", 0, library=one_block, compress_ratio=2)


def main():
    torch.manual_seed(0)
    cos_sin = rope_table(MAX_POSITION, DEVICE)
    bad = 0
    geometries = [
        (1, 1, "3D", 0, torch.int64),
        (37, 3, "HND", 16, torch.int32),
        (37, 64, "NHD", 0, torch.int64),
        (9, 256, "3D", 48, torch.int32),
    ]
    q_modes = (
        (5, 8, False, True),
        (8, 16, False, False),
        (16, 0, False, True),
        (8, 8, True, True),
        (128, 128, True, False),
    )
    for num_tokens, page_size, layout, pad, slot_dtype in geometries:
        geometry = (page_size, layout, pad)
        for num_heads, padded, inplace, rope in q_modes:
            q, kv, pages, slots, pos = inputs(num_tokens, num_heads, page_size, slot_dtype)
            named = {"q": q, "kv": kv, "slot_mapping": slots, "positions": pos, "cos_sin_cache": cos_sin}
            options = dict(q_head_padded=padded, apply_q_rope=rope, q_inplace=inplace)
            bad += run_both("main", named, pages, *geometry, **options)
        for ratio in (1, 2):
            bad += run_both("kv", named, pages, *geometry, compress_ratio=ratio)
        bad += run_both("append", named, pages, *geometry)
    bad += one_block_tiles(cos_sin)
    pages = random_rows((3, 5, 512), DEVICE)
    packed = (module.nvfp4_quantize_pack_sparse_mla_cache(pages).cpu() for module in (nvfp4_mla, reference))
    bad += int(not torch.equal(*packed))
    torch.cuda.synchronize()
    print(f"sanitizer workload: {bad} mismatching calls")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
