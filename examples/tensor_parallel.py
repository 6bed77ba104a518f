"""Tensor-parallel decode attention: the query heads split over the ranks, the latent cache replicated.

DeepSeek-V4's attention has one latent KV head that every query head reads, so tensor parallelism
splits the query heads and every rank keeps a whole copy of the cache (docs/serving.md, section 8).
Each rank does what an engine's rank does in one layer of a decode step:

1. its two pools hold what prefill wrote: the pack entry, from the same seeded rows on every rank;
2. the main entry writes the step's new latent rows into its own copy and rotates its own heads
   of the query, ``q[:, rank * H/tp : (rank + 1) * H/tp]``: every rank writes the same records,
   so the copies stay equal without any communication;
3. ``sparse_mla_decode`` attends over its heads, and ``all_gather`` collects every rank's heads.

Then every rank checks that its pools hold rank 0's bytes; that each rank's gathered heads have
the bits of the same calls made on this GPU alone (the same head count, so the same kernel and
work list: on identical GPUs, the same bits); and that the gathered output of all heads is
within the decode's tolerance of the float64 reference of the unsplit attention (docs/format.md,
section 9). It prints one verdict line a rank, then ``tensor_parallel: OK`` from rank 0, and
exits 1 on any mismatch.

    torchrun --standalone --nproc-per-node 2 examples/tensor_parallel.py             # 64 heads a rank
    torchrun --standalone --nproc-per-node 1 examples/tensor_parallel.py             # one GPU, all 128 heads
    torchrun --standalone --nproc-per-node 8 examples/tensor_parallel.py --batch 16  # 16 heads a rank

One process a GPU, NCCL. Without a usable CUDA GPU it prints that it needs one and exits 0,
having run nothing.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.distributed as dist

import nvfp4_mla
import nvfp4_mla.reference.decode as exact  # the float64 steps of nvfp4_mla.reference.sparse_mla_decode
from nvfp4_mla.abi import HEAD_DIM, ROPE_DIM  # 512 latent dims, the last 64 of them RoPE

PAGE_SIZE = 64  # tokens a page (slot = page * PAGE_SIZE + entry)
NUM_PAGES = 32  # pages of each pool
WINDOW = 128  # sliding-window entries a request attends to
TOPK = 256  # compressed-pool rows a request attends to, -1 padded past extra_lens
MAX_POSITION = 4096
SM_SCALE = (HEAD_DIM + ROPE_DIM) ** -0.5  # 1/sqrt(576), DeepSeek's MLA softmax scale
HEAD_COUNTS = (8, 16, 32, 64, 128)  # the main entry pads a rank's rotated query to one of these
# The decode against the float64 reference (docs/format.md, section 9): out within
# OUT_REL |ref| + OUT_ABS sum_j w_j |row_j| + OUT_FLOOR, lse within LSE_REL max(1, |lse|).
OUT_REL, OUT_ABS, OUT_FLOOR, LSE_REL = 2.0**-7, 2.0**-8, 2.0**-126, 1e-4


def make_step(batch: int, heads: int, seed: int, device: torch.device) -> dict[str, torch.Tensor]:
    """One layer's decode step, drawn on the CPU from ``seed``: the same values on every rank."""
    g = torch.Generator().manual_seed(seed)
    capacity = NUM_PAGES * PAGE_SIZE
    slot_mapping = torch.randperm(capacity, generator=g)[:batch]  # the new tokens' slots: distinct
    swa_slots = torch.randint(0, capacity, (batch, 1, WINDOW), generator=g, dtype=torch.int32)
    swa_slots[:, 0, -1] = slot_mapping  # each window ends with its request's new token
    extra_slots = torch.randint(0, capacity, (batch, 1, TOPK), generator=g, dtype=torch.int32)
    extra_lens = torch.randint(0, TOPK + 1, (batch, 1), generator=g, dtype=torch.int32)
    extra_lens[0] = 0  # a request whose indexer selected nothing yet
    extra_slots[torch.arange(TOPK) >= extra_lens[..., None]] = -1
    step = {
        "swa_rows": torch.randn(NUM_PAGES, PAGE_SIZE, HEAD_DIM, generator=g).bfloat16(),
        "extra_rows": torch.randn(NUM_PAGES, PAGE_SIZE, HEAD_DIM, generator=g).bfloat16(),
        "q": torch.randn(batch, heads, HEAD_DIM, generator=g).bfloat16(),  # unrotated, all heads
        "kv": torch.randn(batch, HEAD_DIM, generator=g).bfloat16(),  # the new latent rows, unrotated
        "positions": torch.randint(WINDOW, MAX_POSITION, (batch,), generator=g),
        "slot_mapping": slot_mapping,
        "swa_slots": swa_slots,
        "swa_lens": torch.full((batch, 1), WINDOW, dtype=torch.int32),
        "extra_slots": extra_slots,
        "extra_lens": extra_lens,
        "sinks": torch.randn(heads, generator=g),
        "cos_sin": nvfp4_mla.rope_table(MAX_POSITION),
    }
    return {name: value.to(device) for name, value in step.items()}


def write_and_attend(
    step: dict[str, torch.Tensor], swa_cache: torch.Tensor, extra_cache: torch.Tensor, lo: int, hi: int
) -> tuple[torch.Tensor, ...]:
    """One rank's layer for heads ``lo:hi``: the cache-update hook (writes the new rows, rotates
    these heads), then the decode over both pools. Returns (out, lse, the rotated query)."""
    batch, heads = step["q"].shape[0], hi - lo
    q_rot = nvfp4_mla.cake_dsv4_nvfp4_rope_quantize_insert(
        step["q"][:, lo:hi].contiguous(),
        step["kv"],
        swa_cache,
        step["slot_mapping"],
        step["positions"],
        step["cos_sin"],
        q_head_padded=heads,
    )
    out, lse = nvfp4_mla.sparse_mla_decode(
        q_rot.view(batch, 1, heads, HEAD_DIM),
        swa_cache,
        step["swa_slots"],
        swa_lens=step["swa_lens"],
        extra_cache=extra_cache,
        extra_slots=step["extra_slots"],
        extra_lens=step["extra_lens"],
        sm_scale=SM_SCALE,
        sinks=step["sinks"][lo:hi],
    )
    return out, lse, q_rot


def reference_errors(
    out: torch.Tensor, lse: torch.Tensor, q_rot: torch.Tensor, step: dict[str, torch.Tensor], pools: list
) -> tuple[float, float]:
    """The largest error of ``out`` and of ``lse`` over its tolerance (at most 1 passes), against
    the float64 reference of the same attention; ``pools`` is [(cache, slots, lens)] of both."""
    gathered = [exact.gather_rows(cache, slots, lens, cache.shape[0] * PAGE_SIZE) for cache, slots, lens in pools]
    rows = torch.cat([r for r, _ in gathered], dim=2).double()
    live = torch.cat([m for _, m in gathered], dim=2)
    q = q_rot.view(out.shape)
    scores = exact.masked_scores(q, rows, live, SM_SCALE)
    want, want_lse = exact.attention_output(scores, rows, live, step["sinks"])
    magnitude, _ = exact.attention_output(scores, rows.abs(), live, step["sinks"])  # sum_j w_j |row_j|
    bound = OUT_REL * want.abs() + OUT_ABS * magnitude + OUT_FLOOR
    out_error = ((out.double() - want).abs() / bound).max()  # NaN stays NaN: not <= 1
    finite = torch.isfinite(want_lse)  # +inf for a row with nothing live: lse must be +inf too
    lse_error = (lse.double() - want_lse).abs() / (LSE_REL * want_lse.abs().clamp(min=1.0))
    lse_error = torch.where(finite, lse_error, torch.where(lse.double() == want_lse, 0.0, torch.inf)).max()
    return out_error.item(), lse_error.item()


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise equality (NaN included): BF16 as int16, fp32 as int32."""
    view = torch.int16 if a.dtype == torch.bfloat16 else torch.int32
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.view(view), b.view(view))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--heads", type=int, default=128, help="query heads of the layer, split over the ranks")
    parser.add_argument("--batch", type=int, default=4, help="decoding requests")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)

    reason = nvfp4_mla.gpu_unavailable_reason(0)
    if reason is not None:  # a skip, not a failure: exit 0 with nothing run
        if os.environ.get("RANK", "0") == "0":
            print(f"tensor_parallel: needs CUDA ({reason}); nothing run")
        return 0
    if "LOCAL_RANK" not in os.environ:
        parser.error("run it with torchrun, one process a GPU: torchrun --standalone --nproc-per-node 2 " + sys.argv[0])
    local_rank, world = int(os.environ["LOCAL_RANK"]), int(os.environ["WORLD_SIZE"])
    if local_rank >= torch.cuda.device_count():
        parser.error(f"a rank on GPU {local_rank}, but {torch.cuda.device_count()} are visible: fewer --nproc-per-node")
    local = args.heads // world  # this rank's heads
    if args.heads % world or local not in HEAD_COUNTS:
        parser.error(f"--heads {args.heads} over {world} ranks: each rank's heads must be one of {HEAD_COUNTS}")
    device = torch.device("cuda", local_rank)
    torch.cuda.set_device(device)
    dist.init_process_group("nccl", device_id=device)
    rank = dist.get_rank()
    lo, hi = rank * local, (rank + 1) * local

    # The rank's layer: prefill's pools, then the step's write and decode over this rank's heads.
    step = make_step(args.batch, args.heads, args.seed, device)
    swa_cache = nvfp4_mla.nvfp4_quantize_pack_sparse_mla_cache(step["swa_rows"])  # HND [pages, 1, 64, 384]
    extra_cache = nvfp4_mla.nvfp4_quantize_pack_sparse_mla_cache(step["extra_rows"])
    prefilled = swa_cache.clone()  # for the one-GPU calls below
    out, lse, _ = write_and_attend(step, swa_cache, extra_cache, lo, hi)
    outs, lses = [torch.empty_like(out) for _ in range(world)], [torch.empty_like(lse) for _ in range(world)]
    dist.all_gather(outs, out)
    dist.all_gather(lses, lse)

    problems = []
    for name, cache in (("sliding-window", swa_cache), ("compressed", extra_cache)):
        rank0_cache = cache.clone()
        dist.broadcast(rank0_cache, src=0)
        if not torch.equal(rank0_cache, cache):
            problems.append(f"its {name} pool differs from rank 0's")

    # The same layer on this GPU alone, each rank's heads in turn (same head count: same bits).
    alone = [write_and_attend(step, prefilled, extra_cache, r * local, (r + 1) * local) for r in range(world)]
    differ = [r for r, (o, s, _) in enumerate(alone) if not (same_bits(outs[r], o) and same_bits(lses[r], s))]
    if differ:
        problems.append(f"the heads of rank(s) {differ} differ from this GPU's own calls")

    q_rot = torch.cat([q for _, _, q in alone], dim=1)  # all heads, rotated
    pools = [(swa_cache, step["swa_slots"], step["swa_lens"]), (extra_cache, step["extra_slots"], step["extra_lens"])]
    out_error, lse_error = reference_errors(torch.cat(outs, dim=2), torch.cat(lses, dim=2), q_rot, step, pools)
    if not (out_error <= 1 and lse_error <= 1):
        problems.append("the gathered output is outside the tolerance of the float64 reference")

    checks = "pools equal rank 0's, every rank's heads bitwise equal to this GPU's calls, all heads within tolerance"
    verdict = f"OK: {checks}" if not problems else "MISMATCH: " + "; ".join(problems)
    where = f"heads {lo}-{hi - 1} of {args.heads}, {torch.cuda.get_device_name(device)}"
    errors = f"out {out_error:.3f}, lse {lse_error:.3f} of the float64 reference's tolerance"
    print(f"rank {rank}/{world} ({where}): {verdict} ({errors})", flush=True)
    passed = torch.tensor([0 if problems else 1], device=device)
    dist.all_reduce(passed, op=dist.ReduceOp.MIN)
    ok = bool(passed.item())
    if rank == 0:
        print("tensor_parallel: OK" if ok else "tensor_parallel: MISMATCH (see the ranks' lines)", flush=True)
    dist.destroy_process_group()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
