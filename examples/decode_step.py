"""One DeepSeek-V4-shaped decode step, run the way a serving engine runs it, on the NVFP4 latent cache.

Every layer of the step does what an engine's attention backend does for a batch of decoding
requests (docs/serving.md explains each piece):

1. the cache-update hook writes the new token's latent row into the layer's sliding-window pool
   with the main fused entry, which also hands back the rotated query;
2. ``sparse_mla_decode`` attends over the request's sliding window plus its top-k rows of the
   compressed pool, in one call per layer.

The step's work list is planned once: ``plan_sparse_mla_decode`` is made with the step's tables and
length tensors, ``plan.update()`` runs at the step's start (one scheduler launch, inside the graph),
and every layer's call passes ``plan=`` and deals no list of its own (``--one-call``: each call
deals its own, for comparison).

The batch is ragged: every request has its own context length, so its own number of live window
entries (``swa_lens``) and of live top-k selections (``extra_lens``). On a GPU the whole step (all
layers) is captured once in one CUDA graph; the lengths then change between replays without a new
capture, as they do from one decode step to the next.

On a GPU it prints the step's time (graph-replayed), the attention's share of it, and the cache
size against FlashMLA's FP8 layout. Without a usable GPU (or with ``--cpu``) it runs a small step
on CPU tensors, where the same entries run the pure-torch reference (``nvfp4_mla.reference``), and
says so.

    python examples/decode_step.py                       # 61 layers, batch 32, 16 heads a rank
    python examples/decode_step.py --layers 4 --batch 8  # a smaller step
    python examples/decode_step.py --cpu                 # the reference on the CPU (2 layers, batch 3)

The step holds only what this library does (the cache writes and the attention); the model's
projections, MoE, the indexer and the compressor are left out, so their outputs are stand-ins.
"""

from __future__ import annotations

import argparse
import math
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

import nvfp4_mla
from nvfp4_mla.abi import HEAD_DIM, RECORD_BYTES, ROPE_DIM  # 512 latent dims, 384 bytes a token, 64 RoPE dims
from nvfp4_mla.fp8_cache import FP8_RECORD_BYTES  # 584: FlashMLA's FP8 record of the same row

PAGE_SIZE = 64  # tokens a page (slot = page * PAGE_SIZE + entry)
WINDOW = 128  # sliding-window entries a request attends to (the swa table's width)
TOPK = 512  # compressed-pool rows the indexer selects (the extra table's width)
COMPRESS = 4  # tokens per compressed row in this example's compressed pool (illustrative)
SM_SCALE = (HEAD_DIM + ROPE_DIM) ** -0.5  # 1/sqrt(576), the softmax scale of DeepSeek's MLA
HEAD_COUNTS = (8, 16, 32, 64, 128)  # heads a rank; the main entry pads q to one of these


@dataclass
class Layer:
    """One layer's state: its two caches (the engine allocates them once) and its sinks."""

    swa_cache: torch.Tensor  # uint8 [num_pages, 1, PAGE_SIZE, 384]: the sliding-window pool
    extra_cache: torch.Tensor  # uint8 [num_pages, 1, PAGE_SIZE, 384]: the compressed pool
    sinks: torch.Tensor  # fp32 [heads]: the attention-sink logits


@dataclass
class StepInputs:
    """What changes from one step to the next. Under a CUDA graph these are fixed buffers: each step
    copies its values into them, and the graph reads them at the same addresses."""

    q: torch.Tensor  # BF16 [batch, heads, 512]: stand-in for the layer's query projection
    kv: torch.Tensor  # BF16 [batch, 512]: stand-in for the layer's new latent row
    positions: torch.Tensor  # int64 [batch]: the new token's position
    slot_mapping: torch.Tensor  # int64 [batch]: where the new token's record goes (swa pool)
    swa_slots: torch.Tensor  # int32 [batch, 1, WINDOW]: the window's slots, -1 past the live ones
    swa_lens: torch.Tensor  # int32 [batch, 1]: live window entries
    extra_slots: torch.Tensor  # int32 [batch, 1, TOPK]: the top-k compressed rows' slots, -1 padded
    extra_lens: torch.Tensor  # int32 [batch, 1]: live top-k selections


class Pages:
    """A block table: each request owns ``pages`` pages of a pool, scattered over the pool as a
    paged allocator leaves them."""

    def __init__(self, batch: int, pages: int, g: torch.Generator):
        self.table = torch.randperm(batch * pages, generator=g).view(batch, pages)

    def slots(self, request: int, indices: torch.Tensor) -> torch.Tensor:
        """The slots of a request's token (or compressed-row) indices: page * PAGE_SIZE + entry."""
        return self.table[request, indices // PAGE_SIZE] * PAGE_SIZE + indices % PAGE_SIZE


def host_batch(
    seq_lens: list[int], swa_pages: Pages, extra_pages: Pages, g: torch.Generator
) -> dict[str, torch.Tensor]:
    """The index tensors of one step, as an engine's metadata builder makes them (on the CPU here).

    Request ``b`` has ``seq_lens[b]`` tokens, the newest at position ``seq_lens[b] - 1``. Its window
    is its last ``WINDOW`` tokens; its compressed pool holds one row per ``COMPRESS`` tokens, of
    which a stand-in indexer selects up to ``TOPK``.
    """
    batch = len(seq_lens)
    swa_slots = torch.full((batch, 1, WINDOW), -1, dtype=torch.int32)
    extra_slots = torch.full((batch, 1, TOPK), -1, dtype=torch.int32)
    swa_lens = torch.zeros(batch, 1, dtype=torch.int32)
    extra_lens = torch.zeros(batch, 1, dtype=torch.int32)
    positions = torch.tensor(seq_lens, dtype=torch.int64) - 1
    for b, seq_len in enumerate(seq_lens):
        window = torch.arange(max(0, seq_len - WINDOW), seq_len)  # oldest first, the new token last
        swa_slots[b, 0, : len(window)] = swa_pages.slots(b, window).int()
        swa_lens[b, 0] = len(window)
        compressed = seq_len // COMPRESS
        chosen = torch.randperm(compressed, generator=g)[:TOPK].sort().values  # the indexer's top-k
        extra_slots[b, 0, : len(chosen)] = extra_pages.slots(b, chosen).int()
        extra_lens[b, 0] = len(chosen)
    slot_mapping = torch.stack([swa_pages.slots(b, positions[b]) for b in range(batch)])
    return {
        "positions": positions,
        "slot_mapping": slot_mapping,
        "swa_slots": swa_slots,
        "swa_lens": swa_lens,
        "extra_slots": extra_slots,
        "extra_lens": extra_lens,
    }


def load(inputs: StepInputs, values: dict[str, torch.Tensor]) -> None:
    """Copy one step's index tensors into the fixed buffers (what happens before each replay)."""
    for name, value in values.items():
        getattr(inputs, name).copy_(value)


def new_layer(swa_pages: int, extra_pages: int, heads: int, device: str) -> Layer:
    """A layer's two pools, filled with rows as prefill and earlier steps would have written them."""

    def pool(num_pages: int) -> torch.Tensor:
        rows = torch.randn(num_pages, PAGE_SIZE, HEAD_DIM, device=device).bfloat16()
        return nvfp4_mla.nvfp4_quantize_pack_sparse_mla_cache(rows)  # HND [num_pages, 1, PAGE_SIZE, 384]

    sinks = torch.randn(heads, device=device)
    return Layer(pool(swa_pages), pool(extra_pages), sinks)


def layer_write(layer: Layer, inputs: StepInputs, cos_sin: torch.Tensor) -> torch.Tensor:
    """The cache-update hook: the new token's row into the window pool, and the rotated query back.

    Why the main entry: per layer and per step the engine has the query heads and the new latent
    row, both still unrotated. ``cake_dsv4_nvfp4_rope_quantize_insert`` applies RoPE to both,
    quantizes and inserts the row and returns the rotated query padded to the head count the
    attention takes, in one launch. The KV-only entry (``cake_dsv4_nvfp4_kv_rope_quantize_insert``)
    has no query: it is for rows without one (the compressed pool's writes, speculative context).
    """
    heads = inputs.q.shape[1]
    return nvfp4_mla.cake_dsv4_nvfp4_rope_quantize_insert(
        inputs.q, inputs.kv, layer.swa_cache, inputs.slot_mapping, inputs.positions, cos_sin, q_head_padded=heads
    )


def layer_attend(
    layer: Layer,
    inputs: StepInputs,
    q_rot: torch.Tensor,
    plan: nvfp4_mla.SparseMlaDecodePlan | None,
    attend: Callable[..., tuple[torch.Tensor, torch.Tensor]] = nvfp4_mla.sparse_mla_decode,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The decode attention of one layer: one call over both pools, on the step's plan (None: the
    call deals its own work list). ``attend`` is the entry (the check passes the reference's, which
    takes no plan)."""
    batch, heads = q_rot.shape[0], q_rot.shape[1]
    options = {} if plan is None else {"plan": plan}
    return attend(
        q_rot.view(batch, 1, heads, HEAD_DIM),  # [batch, q_len = 1, heads, 512]
        layer.swa_cache,
        inputs.swa_slots,
        swa_lens=inputs.swa_lens,
        extra_cache=layer.extra_cache,
        extra_slots=inputs.extra_slots,
        extra_lens=inputs.extra_lens,
        sm_scale=SM_SCALE,
        sinks=layer.sinks,
        **options,
    )


def decode_step(
    layers: list[Layer],
    inputs: StepInputs,
    cos_sin: torch.Tensor,
    plan: nvfp4_mla.SparseMlaDecodePlan | None,
    q_rot: torch.Tensor | None = None,
) -> list:
    """All layers of one step: the plan's work list from this step's lengths, then each layer's
    write and attention. (In the model, layer l's output feeds layer l+1 through projections and the
    MoE; here every layer reuses the same stand-in q and kv.) With ``q_rot``, the attention alone:
    no writes, every layer attends with that query."""
    if plan is not None:
        plan.update()  # one scheduler launch; a CUDA graph replays it with the step
    outputs = []
    for layer in layers:
        q_layer = layer_write(layer, inputs, cos_sin) if q_rot is None else q_rot
        outputs.append(layer_attend(layer, inputs, q_layer, plan))
    return outputs


def capture(work) -> tuple[torch.cuda.CUDAGraph, object]:
    """``work()`` warmed up once (first calls compile or load kernels: never inside a capture),
    then captured as one CUDA graph."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        work()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        result = work()
    return graph, result


def replay_ms(graph: torch.cuda.CUDAGraph, replays: int) -> float:
    """Mean milliseconds of one replay."""
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / replays


def check_against_reference(out: torch.Tensor, inputs: StepInputs, layer: Layer, cos_sin: torch.Tensor) -> float:
    """A layer's graph output against the float64 reference on the same inputs: the largest
    difference over the largest value (the kernel rounds probabilities to BF16 for P.V)."""
    heads = inputs.q.shape[1]
    # The query only: a copy of the pool takes the write, so the layer's pool is not written twice.
    q_rot = nvfp4_mla.reference.cake_dsv4_nvfp4_rope_quantize_insert(
        inputs.q,
        inputs.kv,
        layer.swa_cache.clone(),
        inputs.slot_mapping,
        inputs.positions,
        cos_sin,
        q_head_padded=heads,
    )
    want, _ = layer_attend(layer, inputs, q_rot, None, nvfp4_mla.reference.sparse_mla_decode)
    return ((out.float() - want.float()).abs().max() / want.float().abs().max()).item()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, help="layers in the step (default 61 on a GPU, 2 on the CPU)")
    parser.add_argument("--batch", type=int, help="decoding requests (default 32 on a GPU, 3 on the CPU)")
    parser.add_argument("--heads", type=int, default=16, choices=HEAD_COUNTS, help="query heads of this rank")
    parser.add_argument("--max-len", type=int, help="longest context (default 4096 on a GPU, 512 on the CPU)")
    parser.add_argument("--replays", type=int, default=50, help="graph replays timed (GPU)")
    parser.add_argument("--cpu", action="store_true", help="run the reference on the CPU even with a GPU")
    parser.add_argument("--one-call", action="store_true", help="no plan: each layer's call deals its own work")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)

    reason = "--cpu" if args.cpu else nvfp4_mla.gpu_unavailable_reason()
    on_gpu = reason is None
    device = "cuda" if on_gpu else "cpu"
    num_layers = args.layers or (61 if on_gpu else 2)
    batch = args.batch or (32 if on_gpu else 3)
    max_len = args.max_len or (4096 if on_gpu else 512)
    heads = args.heads
    if max_len < 16:
        parser.error("--max-len must be at least 16")
    if on_gpu:
        print(f"device: {torch.cuda.get_device_name()}: the CUDA kernels, the step captured in one CUDA graph")
    else:
        print(f"device: cpu ({reason}): the pure-torch reference, eager, no CUDA graph")

    g = torch.Generator().manual_seed(args.seed)
    torch.manual_seed(args.seed)
    pages_per_request = math.ceil(max_len / PAGE_SIZE)
    extra_pages_per_request = math.ceil(max_len // COMPRESS / PAGE_SIZE)
    swa_pages = Pages(batch, pages_per_request, g)
    extra_pages = Pages(batch, extra_pages_per_request, g)
    layers = [
        new_layer(batch * pages_per_request, batch * extra_pages_per_request, heads, device) for _ in range(num_layers)
    ]
    cos_sin = nvfp4_mla.rope_table(max_len, device)  # the engine passes its model's own table

    # A ragged batch: one short request (3 tokens), the others anywhere up to max_len - 2.
    seq_lens = [3, *torch.randint(min(WINDOW // 2, max_len // 2), max_len - 2, (batch - 1,), generator=g).tolist()]
    index_tensors = host_batch(seq_lens, swa_pages, extra_pages, g)
    inputs = StepInputs(
        q=torch.randn(batch, heads, HEAD_DIM, device=device).bfloat16(),
        kv=torch.randn(batch, HEAD_DIM, device=device).bfloat16(),
        **{name: torch.empty_like(value, device=device) for name, value in index_tensors.items()},
    )
    load(inputs, index_tensors)
    # Once for the batch shape, with the buffers every layer's call passes (on CPU tensors it is
    # checked, and the reference runs).
    plan = None
    if not args.one_call:
        plan = nvfp4_mla.plan_sparse_mla_decode(
            heads,
            inputs.swa_slots,
            swa_lens=inputs.swa_lens,
            extra_slots=inputs.extra_slots,
            extra_lens=inputs.extra_lens,
        )
    print(
        f"step: {num_layers} layers, batch {batch} (context lengths {min(seq_lens)}..{max(seq_lens)}), "
        f"{heads} heads, window {WINDOW} + top-{TOPK} compressed, page size {PAGE_SIZE}, "
        + ("each call deals its own work" if plan is None else "one plan a step")
    )

    if on_gpu:
        step_graph, outputs = capture(lambda: decode_step(layers, inputs, cos_sin, plan))
        q_rot = torch.randn(batch, heads, HEAD_DIM, device=device).bfloat16()
        attention_graph, _ = capture(lambda: decode_step(layers, inputs, cos_sin, plan, q_rot))
        # The next step: every request one token longer, new top-k selections. Copy, replay: no recapture.
        seq_lens = [n + 1 for n in seq_lens]
        load(inputs, host_batch(seq_lens, swa_pages, extra_pages, g))
        step_ms = replay_ms(step_graph, args.replays)
        attention_ms = replay_ms(attention_graph, args.replays)
        timing = "graph-replayed"
        error = check_against_reference(outputs[0][0], inputs, layers[0], cos_sin)
        print(f"check: layer 0 against the float64 reference, largest difference {error:.1e} of the largest value")
    else:
        write_s = attend_s = 0.0
        for layer in layers:  # the same step, eager, each half timed
            t0 = time.perf_counter()
            q_rot = layer_write(layer, inputs, cos_sin)
            t1 = time.perf_counter()
            layer_attend(layer, inputs, q_rot, plan)
            t2 = time.perf_counter()
            write_s, attend_s = write_s + t1 - t0, attend_s + t2 - t1
        step_ms, attention_ms = 1e3 * (write_s + attend_s), 1e3 * attend_s
        timing = "eager, reference on the CPU: not a GPU number"

    print(f"step time: {step_ms:.3f} ms ({timing}), {1e3 * step_ms / num_layers:.1f} us a layer")
    print(f"attention: {attention_ms:.3f} ms, {100 * attention_ms / step_ms:.0f}% of the step (writes: the rest)")
    tokens = sum(layer.swa_cache.shape[0] + layer.extra_cache.shape[0] for layer in layers) * PAGE_SIZE
    print(
        f"cache: {RECORD_BYTES} B a token (NVFP4) vs {FP8_RECORD_BYTES} B (FlashMLA FP8), "
        f"{RECORD_BYTES / FP8_RECORD_BYTES:.3f}x; this step's pools: {tokens * RECORD_BYTES / 2**20:.1f} MiB "
        f"vs {tokens * FP8_RECORD_BYTES / 2**20:.1f} MiB"
    )


if __name__ == "__main__":
    main()
