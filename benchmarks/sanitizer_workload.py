"""A small run of every entry and mode, for compute-sanitizer (memcheck, racecheck, initcheck).

Edge cases that touch the bounds: page size 1 and 3, padded pools, the last slot of the pool,
negative and out-of-range slots and positions, data-parallel padding rows, T = 1. Each call is
also compared with the reference, so the run fails loudly on a wrong byte too.
"""

import sys
from pathlib import Path

import torch

sys.path[:0] = [str(Path(__file__).resolve().parents[1] / p) for p in ("src", "tests")]

import nvfp4_mla  # noqa: E402
from nvfp4_mla import reference  # noqa: E402
from util import cos_sin_table, make_cache, random_rows, storage_bytes  # noqa: E402

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


def run_both(entry, args_of, q, num_pages, page_size, layout, pad, **kwargs):
    """Runs ``entry`` through the kernels and the reference, each on a fresh cache and its own
    copy of ``q`` (in place mutates it); returns 1 on any differing byte."""
    caches = [make_cache(num_pages, page_size, layout, pad, DEVICE) for _ in range(2)]
    outs = [getattr(module, entry)(*args_of(cache, q.clone()), **kwargs) for module, cache in zip((nvfp4_mla, reference), caches)]
    same = torch.equal(storage_bytes(caches[0]), storage_bytes(caches[1]))
    if isinstance(outs[0], torch.Tensor):
        same &= torch.equal(outs[0].view(torch.int16).cpu(), outs[1].view(torch.int16).cpu())
    return 0 if same else 1


def main():
    torch.manual_seed(0)
    cos_sin = cos_sin_table(MAX_POSITION, DEVICE)
    bad = 0
    cases = [(1, 1, "3D", 0, torch.int64), (37, 3, "HND", 16, torch.int32), (37, 64, "NHD", 0, torch.int64), (9, 256, "3D", 48, torch.int32)]
    for num_tokens, page_size, layout, pad, slot_dtype in cases:
        for num_heads, padded, inplace, rope in ((5, 8, False, True), (8, 16, False, False), (16, 0, False, True), (8, 8, True, True), (128, 128, True, False)):
            q, kv, pages, slots, pos = inputs(num_tokens, num_heads, page_size, slot_dtype)
            bad += run_both(
                "cake_dsv4_nvfp4_rope_quantize_insert", lambda cache, q: (q, kv, cache, slots, pos, cos_sin), q,
                pages, page_size, layout, pad, q_head_padded=padded, apply_q_rope=rope, q_inplace=inplace,
            )
        for ratio in (1, 2):
            bad += run_both("cake_dsv4_nvfp4_kv_rope_quantize_insert", lambda cache, q: (kv, cache, slots, pos, cos_sin), q, pages, page_size, layout, pad, compress_ratio=ratio)
        bad += run_both("nvfp4_quantize_append_sparse_mla_cache", lambda cache, q: (kv, slots, cache), q, pages, page_size, layout, pad)
    pages = random_rows((3, 5, 512), DEVICE)
    bad += int(not torch.equal(nvfp4_mla.nvfp4_quantize_pack_sparse_mla_cache(pages).cpu(), reference.nvfp4_quantize_pack_sparse_mla_cache(pages).cpu()))
    torch.cuda.synchronize()
    print(f"sanitizer workload: {bad} mismatching calls")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
