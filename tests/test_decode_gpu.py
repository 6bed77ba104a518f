"""The fused sparse decode on the GPU against the reference computed in float64.

Tolerances: ``out`` within ``2^-7 |ref| + 2^-8 sum_j w_j |row_j|`` (the sink factor
included: the reference applies it to both) plus ``2^-126`` (below the smallest normal BF16 and
fp32 only absolute errors are meaningful: a peaked softmax can leave an output element near
1e-41, whose BF16 is 0), ``lse`` within ``1e-4 max(1, |lse|)``; lonely rows
exactly 0 and +inf. Every check prints its measured maxima (``pytest -s`` shows them) and a failure
names the worst element. Cases: every mask kind, one and two pools, sinks, lonely rows, every
head count, q_len 1 and > 1, int32/int64 slots, page sizes and layouts, NaN records at masked
positions, every head tile of the mma.sync kernel, every backend's work list in 1 to
MAX_LIST_PARTS parts (rows whole and cut between parts, both epilogues, most parts empty, blocks
walking many segments), ragged batches of 1 to 16,384 rows, determinism, CUDA graphs (two replayed in turn
too, and lengths that change between replays), two streams at once, ``out=``, torch.compile, and
the largest prefill (16,384 rows of 128 heads). The semantic and execution tests run on every
backend of this GPU (``backend``: the default library, whose rule picks by architecture and shape,
and a library that forces each backend of this GPU: the mma.sync kernel, and on sm_90 the Hopper
wgmma kernel's two builds).

Every backend walks a work list that the scheduler writes on the GPU from the rows' live lengths,
or without length tensors one made on the host from the tables' widths (``decode_parts``: a row is
cut where the parts' boundaries fall in its tiles). Two calls with the same list give the same
bits; other parts cut the rows elsewhere, so those are compared with the float64 answer only.
"""

from __future__ import annotations

import functools
import math

import pytest
import torch

import nvfp4_mla
import nvfp4_mla.reference.decode as exact_decode
from nvfp4_mla import abi, validation
from nvfp4_mla.device import device_info
from nvfp4_mla.ops import decode, decode_combine, decode_mma, decode_planner, decode_scheduler, decode_sm90
from nvfp4_mla.testing import dirty_allocator, make_cache
from nvfp4_mla.testing.kernels import VirtualArchKernels

pytestmark = pytest.mark.gpu

DEVICE = "cuda"
BF16 = torch.bfloat16
SM_SCALE = (abi.HEAD_DIM + abi.ROPE_DIM) ** -0.5  # DeepSeek's 1/sqrt(576)
OUT_REL, OUT_ABS, OUT_FLOOR = 2.0**-7, 2.0**-8, 2.0**-126
LSE_REL = 1e-4


class Pool:
    """A GPU cache whose every slot holds a row written by the GPU writer: normal values with a
    random power-of-two scale per group of 16 (so the E4M3 scales differ)."""

    def __init__(self, num_pages: int, page_size: int, g: torch.Generator, layout: str = "3D", pad: int = 0):
        self.cache = make_cache(num_pages, page_size, layout, pad, DEVICE)
        self.capacity = num_pages * page_size
        rows = torch.randn(self.capacity, abi.HEAD_DIM, generator=g)
        groups = torch.randint(-2, 3, (self.capacity, abi.HEAD_DIM // abi.GROUP_SIZE), generator=g)
        rows = (rows * torch.exp2(groups.float()).repeat_interleave(abi.GROUP_SIZE, 1)).to(BF16)
        nvfp4_mla.nvfp4_quantize_append_sparse_mla_cache(
            rows.to(DEVICE), torch.arange(self.capacity, device=DEVICE), self.cache
        )

    def slots(self, shape, g, dtype=torch.int64, invalid=0.0, low=0) -> torch.Tensor:
        """Random slots in ``[low, capacity)``, a fraction ``invalid`` of them replaced by invalid ones
        (negative, at and past the capacity, up to the int32 extremes)."""
        slots = torch.randint(low, self.capacity, shape, generator=g)
        bad_values = torch.tensor([-1, -5, self.capacity, self.capacity + 3, 2**31 - 1, -(2**31)])
        bad = torch.rand(shape, generator=g) < invalid
        slots = torch.where(bad, bad_values[torch.randint(0, len(bad_values), shape, generator=g)], slots)
        return slots.to(dtype).to(DEVICE)

    def poison(self, slot: int) -> None:
        """The record at ``slot`` reads as NaN: NaN scales (0x7F) and NaN RoPE bits (0xFFFF)."""
        data, scales = abi.record_views(self.cache, validation.check_cache(self.cache))
        page, entry = divmod(slot, data.shape[1])
        scales[page, entry, : abi.NUM_GROUPS] = 0x7F
        data[page, entry, abi.NOPE_BYTES :] = 0xFF


def _backends_here() -> list[str]:
    """The backends of this GPU (none without a GPU)."""
    if nvfp4_mla.gpu_unavailable_reason() is not None:
        return []
    capability = device_info(torch.cuda.current_device()).capability
    return [name for name, b in decode.BACKENDS.items() if b.supports(capability)]


@pytest.fixture(params=["default", *_backends_here()])
def backend(request) -> nvfp4_mla.KernelLibrary | None:
    """The library of a decode call: the default one (the selection rule's choice), or one
    forcing each backend of this GPU."""
    return None if request.param == "default" else nvfp4_mla.KernelLibrary(decode_backend=request.param)


def queries(batch, q_len, heads, g):
    return torch.randn(batch, q_len, heads, abi.HEAD_DIM, generator=g).to(BF16).to(DEVICE)


def lengths(batch, q_len, k, g, dtype=torch.int32):
    """Lengths from below 0 to above k (the clamp), 0 included."""
    return torch.randint(-2, k + 3, (batch, q_len), generator=g, dtype=dtype).to(DEVICE)


def run(q, pools, sm_scale=SM_SCALE, sinks=None, out=None, library=None):
    """``nvfp4_mla.sparse_mla_decode`` on ``pools``, a list of one or two ``(Pool, slots, lens)``
    (on ``library``: default the process's)."""
    (swa, swa_slots, swa_lens), *extra = pools
    kwargs = {}
    if extra:
        pool, slots, lens = extra[0]
        kwargs = {"extra_cache": pool.cache, "extra_slots": slots, "extra_lens": lens}
    if out is None and not torch.cuda.is_current_stream_capturing():
        dirty_allocator(q.numel() * q.element_size(), DEVICE)  # out starts as NaN bytes: a skipped element fails
    return nvfp4_mla.sparse_mla_decode(
        q, swa.cache, swa_slots, swa_lens=swa_lens, sm_scale=sm_scale, sinks=sinks, out=out, library=library, **kwargs
    )


def exact(q, pools, sm_scale=SM_SCALE, sinks=None):
    """float64 ``out``, ``lse`` and ``sum_j w_j |row_j|`` (times the sink factor) from the
    reference's own steps (masked records are never read there either)."""
    gathered = [exact_decode.gather_rows(p.cache, slots, lens, p.capacity) for p, slots, lens in pools]
    rows = torch.cat([r for r, _ in gathered], dim=2)
    live = torch.cat([m for _, m in gathered], dim=2)
    scores = exact_decode.masked_scores(q, rows, live, sm_scale)
    out, lse = exact_decode.attention_output(scores, rows, live, sinks)
    magnitude, _ = exact_decode.attention_output(scores, rows.abs(), live, sinks)
    return out, lse, magnitude


def check(got, want, what: str) -> tuple[float, float]:
    """Asserts the tolerances; returns (max out error / bound, max lse error / tolerance)."""
    out, lse = got
    want_out, want_lse, magnitude = want
    assert out.dtype == BF16 and out.shape == want_out.shape, (out.dtype, out.shape)
    assert lse.dtype == torch.float32 and lse.shape == want_lse.shape, (lse.dtype, lse.shape)
    err = (out.double() - want_out).abs()
    bound = OUT_REL * want_out.abs() + OUT_ABS * magnitude + OUT_FLOOR
    ratio = torch.where(bound > 0, err / bound, torch.where(err > 0, math.inf, 0.0))  # nan err -> nan ratio
    ratio = torch.nan_to_num(ratio, nan=math.inf)
    worst = int(ratio.argmax())
    out_ratio = float(ratio.flatten()[worst])
    finite = torch.isfinite(want_lse)
    lse_err = (lse.double() - want_lse).abs()
    lse_ratio = torch.where(finite, lse_err / (LSE_REL * want_lse.abs().clamp(min=1.0)), 0.0)
    lse_ratio = torch.nan_to_num(lse_ratio, nan=math.inf)
    lse_worst = int(lse_ratio.argmax())
    lse_max = float(lse_ratio.flatten()[lse_worst])
    print(
        f"{what}: out max err/bound {out_ratio:.3g} (max abs err {float(err.nan_to_num(math.inf).max()):.3g}), "
        f"lse max err/tol {lse_max:.3g}"
    )
    index = tuple(int(i) for i in torch.unravel_index(torch.tensor(worst), out.shape))
    assert out_ratio <= 1.0, (
        f"{what}: out[{index}] = {float(out.flatten()[worst])}, reference {float(want_out.flatten()[worst])}, "
        f"bound {float(bound.flatten()[worst]):.3g}: err/bound {out_ratio:.3g}"
    )
    lse_index = tuple(int(i) for i in torch.unravel_index(torch.tensor(lse_worst), lse.shape))
    assert lse_max <= 1.0, (
        f"{what}: lse[{lse_index}] = {float(lse.flatten()[lse_worst])}, "
        f"reference {float(want_lse.flatten()[lse_worst])}: err/tol {lse_max:.3g}"
    )
    lonely = ~finite
    assert torch.equal(lse[lonely], want_lse[lonely].float()), f"{what}: lonely rows must give lse = +inf"
    return out_ratio, lse_max


def bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    view = torch.int16 if a.dtype == BF16 else torch.int32
    return a.dtype == b.dtype and torch.equal(a.view(view), b.view(view))


def captured(work):
    """``work()`` captured as a CUDA graph on a side stream: (the graph, what the capture returned)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(stream), torch.cuda.graph(graph):
        result = work()
    torch.cuda.current_stream().wait_stream(stream)
    return graph, result


def head_tile_fits(head_tile: int) -> bool:
    """Whether this GPU gives a block the attention kernel's shared memory for ``head_tile``."""
    return decode_mma.shared_bytes(head_tile) <= device_info(torch.cuda.current_device()).shared_optin


def cut(name: str, n: int, **kwargs) -> nvfp4_mla.KernelLibrary:
    """A library forcing backend ``name`` with its work list in ``n`` parts (which cut the rows
    where the parts' boundaries fall in their live tiles)."""
    return nvfp4_mla.KernelLibrary(decode_backend=name, decode_parts=n, **kwargs)


def cuts(counts: tuple[int, ...], rows: int) -> tuple[int, ...]:
    """``counts``, and ``3 * rows`` parts: more parts than rows, so that most rows are cut, some
    more than once."""
    return (*counts, min(3 * rows, decode.MAX_LIST_PARTS))


def plan_of(q, pools, library=None) -> decode.DecodePlan:
    """The plan that ``run(q, pools, library=library)`` takes."""
    widths = [slots.shape[2] for _, slots, _ in pools] + [0]
    has_lengths = any(lens is not None for _, _, lens in pools)
    rows = q.shape[0] * q.shape[1]
    library = nvfp4_mla.ops.DEFAULT if library is None else library
    return decode.plan(library, q.get_device(), q.shape[2], rows, widths[0], widths[1], has_lengths)


def alone(spec):
    """A library's ``tune`` that runs every Hopper attention block alone, never in a cluster of two."""
    if isinstance(spec, decode_sm90.WgmmaAttentionSpec):
        return decode_sm90.WgmmaAttentionSpec.of(1, spec.dim_parts, spec.head_tile)
    return spec


def length_sets(rows: int, swa_k: int, extra_k: int, g: torch.Generator):
    """``(name, swa lengths, extra lengths)``, ``[rows]`` int64 on the CPU, of every kind of
    lengths the work list follows: nothing live, every entry live, one long row among rows of one
    entry, uniform, one row in eight long."""
    middle, eighth = torch.arange(rows) == rows // 2, torch.arange(rows) % 8 == 0
    yield "zeros", torch.zeros(rows, dtype=torch.int64), torch.zeros(rows, dtype=torch.int64)
    yield "full", torch.full((rows,), swa_k), torch.full((rows,), extra_k)
    yield "one long", torch.where(middle, swa_k, 1), torch.where(middle, extra_k, 0)
    uniform = torch.randint(0, swa_k + 1, (rows,), generator=g), torch.randint(0, extra_k + 1, (rows,), generator=g)
    yield "uniform", *uniform
    yield "one in eight long", torch.full((rows,), swa_k), torch.where(eighth, extra_k, 0)


def rows_at(x: torch.Tensor, sample: torch.Tensor) -> torch.Tensor:
    """``x`` (``[batch, q_len, ...]``) at the query rows ``sample`` (indices into batch * q_len),
    as ``[len(sample), 1, ...]``."""
    return x.reshape(-1, 1, *x.shape[2:])[sample]


def check_rows(got, q, pools, sample, what, sinks=None) -> tuple[float, float]:
    """:func:`check` of the query rows ``sample`` of a call's ``got`` against their float64 answer."""
    picked = [(p, rows_at(slots, sample), None if lens is None else rows_at(lens, sample)) for p, slots, lens in pools]
    want = exact(rows_at(q, sample), picked, sinks=sinks)
    return check((rows_at(got[0], sample), rows_at(got[1], sample)), want, what)


# ---------------------------------------------------------------- semantics


@pytest.mark.parametrize("q_len", [1, 3])
@pytest.mark.parametrize("heads", [8, 16, 32, 64, 128])
def test_every_head_count_one_pool(backend, seed, heads, q_len):
    g = torch.Generator().manual_seed(seed)
    pool = Pool(32, 64, g)
    q = queries(2, q_len, heads, g)
    pools = [(pool, pool.slots((2, q_len, 100), g), None)]  # 100: a partial last tile
    check(run(q, pools, library=backend), exact(q, pools), f"heads {heads} q_len {q_len}")


@pytest.mark.parametrize("heads", [16, 64, 128])
@pytest.mark.parametrize(
    ("swa_geometry", "extra_geometry"),
    [
        ((64, 64, "3D", 0, torch.int64), (64, 2, "3D", 0, torch.int32)),
        ((8, 256, "HND", 32, torch.int32), (16, 16, "NHD", 0, torch.int64)),
        ((300, 1, "NHD", 16, torch.int64), (40, 64, "HND", 0, torch.int64)),
    ],
    ids=["64+2", "256+16", "1+64"],
)
def test_two_pools_every_mask_kind_and_sinks(backend, seed, heads, swa_geometry, extra_geometry):
    """Invalid slots (-1, negative, at and past the capacity, int32 extremes), lengths below 0, 0,
    inside and above k, two pools of different page sizes, layouts, slot and length dtypes, sinks."""
    g = torch.Generator().manual_seed(seed)
    batch, q_len = 3, 2
    pools = []
    for (num_pages, page_size, layout, pad, dtype), k in ((swa_geometry, 128), (extra_geometry, 300)):
        pool = Pool(num_pages, page_size, g, layout, pad)
        lens = lengths(batch, q_len, k, g, dtype)  # int32 or int64, like the slots
        pools.append((pool, pool.slots((batch, q_len, k), g, dtype, invalid=0.2), lens))
    q = queries(batch, q_len, heads, g)
    sinks = (torch.randn(heads, generator=g) * 3).to(DEVICE)
    check(run(q, pools, sinks=sinks, library=backend), exact(q, pools, sinks=sinks), f"two pools heads {heads}, sinks")
    check(run(q, pools, library=backend), exact(q, pools), f"two pools heads {heads}")
    check(
        run(q, pools[:1], sinks=sinks, library=backend),
        exact(q, pools[:1], sinks=sinks),
        f"swa only heads {heads}, sinks",
    )


@pytest.mark.parametrize("sm_scale", [SM_SCALE, 0.5, 2e-3])
def test_peaked_and_flat_softmax(backend, seed, sm_scale):
    g = torch.Generator().manual_seed(seed)
    pool = Pool(16, 64, g)
    q = queries(2, 2, 32, g)
    pools = [(pool, pool.slots((2, 2, 512), g, invalid=0.1), None)]
    check(run(q, pools, sm_scale, library=backend), exact(q, pools, sm_scale), f"sm_scale {sm_scale}")


@pytest.mark.parametrize("heads", [16, 128])
def test_lonely_rows(backend, seed, heads):
    """Rows with nothing live: lengths 0 in both pools, every slot invalid, an empty window with
    a live extra pool (not lonely), with and without sinks."""
    g = torch.Generator().manual_seed(seed)
    swa, extra = Pool(8, 64, g), Pool(8, 16, g)
    batch, q_len = 4, 2
    swa_slots, extra_slots = swa.slots((batch, q_len, 64), g), extra.slots((batch, q_len, 40), g, torch.int32)
    swa_lens = torch.full((batch, q_len), 64, dtype=torch.int32, device=DEVICE)
    extra_lens = torch.full((batch, q_len), 40, dtype=torch.int64, device=DEVICE)  # int64 lengths
    swa_lens[0, 0] = extra_lens[0, 0] = 0  # lonely by lengths
    swa_slots[1, 1] = -1  # lonely by invalid slots
    extra_slots[1, 1] = extra.capacity
    swa_lens[2, 0] = -4  # window empty, extra live
    extra_lens[3, :] = 0  # extra empty, window live
    pools = [(swa, swa_slots, swa_lens), (extra, extra_slots, extra_lens)]
    q = queries(batch, q_len, heads, g)
    sinks = torch.randn(heads, generator=g).to(DEVICE)
    for s in (None, sinks):
        got = run(q, pools, sinks=s, library=backend)
        check(got, exact(q, pools, sinks=s), f"lonely rows, sinks {s is not None}")
        for b, i in ((0, 0), (1, 1)):
            assert torch.equal(got[0][b, i], torch.zeros_like(got[0][b, i])), f"row {(b, i)} must be exactly 0"
            assert torch.isinf(got[1][b, i]).all() and (got[1][b, i] > 0).all()
        assert torch.isfinite(got[1][2:]).all()


def test_a_table_of_nothing_but_invalid_slots(backend, seed):
    g = torch.Generator().manual_seed(seed)
    pool = Pool(4, 64, g)
    q = queries(2, 3, 64, g)
    for slots in (torch.full((2, 3, 200), -1), torch.randint(pool.capacity, 2**62, (2, 3, 200), generator=g)):
        out, lse = run(q, [(pool, slots.to(DEVICE), None)], library=backend)
        assert torch.equal(out, torch.zeros_like(out)) and torch.equal(lse, torch.full_like(lse, math.inf))


def test_nan_records_in_masked_positions_do_not_leak(backend, seed):
    """Entries past lens point at records whose scales and RoPE values are NaN: never read."""
    g = torch.Generator().manual_seed(seed)
    poisoned = 64
    swa, extra = Pool(16, 64, g), Pool(16, 64, g)
    for pool in (swa, extra):
        for slot in range(poisoned):
            pool.poison(slot)
    batch, q_len, heads, k = 3, 2, 32, 96
    pools = []
    for pool in (swa, extra):
        slots = pool.slots((batch, q_len, k), g, low=poisoned, invalid=0.1)
        lens = torch.randint(0, k, (batch, q_len), generator=g, dtype=torch.int32)
        past = torch.arange(k)[None, None, :] >= lens[..., None]
        slots = torch.where(past.to(DEVICE), torch.randint(0, poisoned, slots.shape, generator=g).to(slots), slots)
        pools.append((pool, slots, lens.to(DEVICE)))
    q = queries(batch, q_len, heads, g)
    sinks = torch.randn(heads, generator=g).to(DEVICE)
    out, lse = got = run(q, pools, sinks=sinks, library=backend)
    assert not torch.isnan(out).any() and not torch.isnan(lse).any()
    check(got, exact(q, pools, sinks=sinks), "NaN records past lens")
    # the same records at live positions do reach the output (so the records really are NaN)
    (pool, slots, lens), _ = pools
    out, _ = run(q, [(pool, slots, None)], library=backend)
    assert torch.isnan(out).any()


def test_nan_outputs_are_torchs_nan(seed):
    """NaN records at live positions make NaN outputs, stored as torch's 0x7FC0 like the
    reference's, on every backend, the work whole (the attention kernel's epilogue) and cut in three
    (parts that cut rows: the combine's)."""
    g = torch.Generator().manual_seed(seed)
    pool = Pool(8, 64, g)
    for slot in range(0, pool.capacity, 7):
        pool.poison(slot)
    q = queries(2, 2, 64, g)
    pools = [(pool, pool.slots((2, 2, 200), g), None)]
    gpu = device_info(q.get_device())
    for name in [n for n, b in decode.BACKENDS.items() if b.supports(gpu.capability)]:
        for n in (1, 3):
            out, _ = run(q, pools, library=cut(name, n))
            nan = torch.isnan(out)
            assert nan.any() and bool((out.view(torch.int16)[nan] == 0x7FC0).all()), f"{name}, cut {n} ways"


def test_decode_shapes_of_the_benchmark(backend, seed):
    """128 window + 1024 compressed selections, 128 heads, q_len 2, with lengths."""
    g = torch.Generator().manual_seed(seed)
    swa, extra = Pool(64, 64, g), Pool(256, 64, g)
    batch, q_len, heads = 4, 2, 128
    pools = [
        (swa, swa.slots((batch, q_len, 128), g, torch.int32), lengths(batch, q_len, 128, g)),
        (extra, extra.slots((batch, q_len, 1024), g, torch.int32, invalid=0.05), lengths(batch, q_len, 1024, g)),
    ]
    q = queries(batch, q_len, heads, g)
    sinks = torch.randn(heads, generator=g).to(DEVICE)
    check(run(q, pools, sinks=sinks, library=backend), exact(q, pools, sinks=sinks), "benchmark shape")


@pytest.mark.parametrize("heads", [64, 128])
def test_one_row_over_a_long_selection(backend, seed, heads):
    """One query row over 128 + 8,192 selections, with and without lengths, on each backend: the
    default plan cuts it into more partials than a warp has lanes (so the combine copies a row's
    (m, l) past lane 31), and 512 parts into 260; within the float64 answer's tolerances. Small
    enough for the sanitizers (benchmarks/gpu_check.sh)."""
    g = torch.Generator().manual_seed(seed)
    swa, extra = Pool(8, 64, g), Pool(256, 64, g)
    pools = [
        (swa, swa.slots((1, 1, 128), g, invalid=0.05), None),
        (extra, extra.slots((1, 1, 8192), g, torch.int32, invalid=0.05), None),
    ]
    q, sinks = queries(1, 1, heads, g), torch.randn(heads, generator=g).to(DEVICE)
    want = exact(q, pools, sinks=sinks)
    plan = plan_of(q, pools, backend)
    assert backend is not None or (plan.combine is not None and plan.slots > 32), plan
    check(run(q, pools, sinks=sinks, library=backend), want, f"{heads} heads, {plan.slots} partials")
    full = torch.full((1, 1), 8192, dtype=torch.int64, device=DEVICE)
    with_lengths = [pools[0], (extra, pools[1][1], full)]
    check(run(q, with_lengths, sinks=sinks, library=backend), want, f"{heads} heads, with lengths")
    if backend is None:  # 260 partials: eight or nine (m, l) copies a lane
        most = cut("mma_sync", decode.MAX_LIST_PARTS)
        check(run(q, pools, sinks=sinks, library=most), want, f"{heads} heads in {decode.MAX_LIST_PARTS} parts")


def test_the_largest_prefill(backend, seed):
    """16,384 query rows (4 x 4,096) of 128 heads over 128 + 512 selections, the largest call
    DeepSeek-V4 makes: q and out are 2 GiB each, so the byte offsets of the last rows pass 2^31.
    Every output element is written (out starts as NaN bytes), and 64 rows (the first and the
    last among them) are within the tolerances of the float64 answer."""
    if torch.cuda.get_device_properties(DEVICE).total_memory < 16 << 30:
        pytest.skip("needs 16 GiB of GPU memory (q, out and the NaN-filled allocation before out: about 5 GiB at once)")
    g = torch.Generator().manual_seed(seed)
    swa, extra = Pool(16, 64, g), Pool(64, 64, g)
    batch, q_len, heads = 4, 4096, 128
    rows = batch * q_len
    swa_slots = swa.slots((batch, q_len, 128), g, torch.int32, invalid=0.05)
    extra_slots, extra_lens = extra.slots((batch, q_len, 512), g), lengths(batch, q_len, 512, g)
    on_gpu = torch.Generator(DEVICE).manual_seed(seed)  # 268 M values: drawn where they are used
    q = torch.randn(batch, q_len, heads, abi.HEAD_DIM, device=DEVICE, dtype=BF16, generator=on_gpu)
    sinks = torch.randn(heads, generator=g).to(DEVICE)
    pools = [(swa, swa_slots, None), (extra, extra_slots, extra_lens)]
    out, lse = run(q, pools, sinks=sinks, library=backend)
    assert not torch.isnan(out).any()
    sample = torch.cat([torch.tensor([0, rows - 1]), torch.randperm(rows - 2, generator=g)[:62] + 1]).to(DEVICE)
    check_rows((out, lse), q, pools, sample, f"{rows} rows, 64 sampled", sinks)


@pytest.mark.parametrize(
    ("rows", "heads"), [*[(rows, heads) for rows in (1, 2, 7, 64, 1031) for heads in (16, 128)], (16384, 16)]
)
def test_ragged_batches_through_the_default_library(seed, rows, heads):
    """The rule's backend (the default library) on batches of 1 to 16,384 query rows whose lengths
    take every kind the work list follows (nothing live, every entry live, one long row among rows
    of one entry, uniform, one row in eight long), in both pools (int32 and int64 lengths), with
    invalid slots and sinks: every output element is written (out starts as NaN bytes), and every
    row (past 64 rows, 64 of them: the first, the middle one (the long one) and the last among
    them) is within the tolerances of the float64 answer."""
    g = torch.Generator().manual_seed(seed)
    swa, extra = Pool(16, 64, g), Pool(64, 64, g)
    swa_k, extra_k = 128, 1024
    on_gpu = torch.Generator(DEVICE).manual_seed(seed)  # up to 134 M values: drawn where they are used
    q = torch.randn(rows, 1, heads, abi.HEAD_DIM, device=DEVICE, dtype=BF16, generator=on_gpu)
    swa_lens = torch.zeros(rows, 1, dtype=torch.int32, device=DEVICE)
    extra_lens = torch.zeros(rows, 1, dtype=torch.int64, device=DEVICE)
    pools = [
        (swa, swa.slots((rows, 1, swa_k), g, torch.int32, invalid=0.05), swa_lens),
        (extra, extra.slots((rows, 1, extra_k), g, invalid=0.05), extra_lens),
    ]
    sinks = torch.randn(heads, generator=g).to(DEVICE)
    if rows <= 64:
        sample = torch.arange(rows)
    else:
        sample = torch.cat([torch.tensor([0, rows // 2, rows - 1]), torch.randperm(rows - 2, generator=g)[:61] + 1])
    sample = sample.unique().to(DEVICE)
    for name, swa_n, extra_n in length_sets(rows, swa_k, extra_k, g):
        swa_lens.copy_(swa_n.view(rows, 1))
        extra_lens.copy_(extra_n.view(rows, 1))
        out, lse = run(q, pools, sinks=sinks)
        assert not torch.isnan(out).any(), f"{name} lengths: an element of out was not written"
        check_rows((out, lse), q, pools, sample, f"{rows} rows of {heads} heads, {name} lengths", sinks)


# ---------------------------------------------------------------- head tiles and parts


def split_case(seed, heads, extra_k):
    """Batch 2, q_len 2: a window of 128 with lengths and an extra pool of ``extra_k`` (int32
    slots), both with invalid slots, and sinks; with the float64 answer."""
    g = torch.Generator().manual_seed(seed)
    swa, extra = Pool(16, 64, g), Pool(16, 16, g)
    pools = [
        (swa, swa.slots((2, 2, 128), g, invalid=0.1), lengths(2, 2, 128, g)),
        (extra, extra.slots((2, 2, extra_k), g, torch.int32, invalid=0.1), None),
    ]
    q = queries(2, 2, heads, g)
    sinks = torch.randn(heads, generator=g).to(DEVICE)
    return q, pools, sinks, exact(q, pools, sinks=sinks)


def planned(q, pools, head_tile, parts, sinks=None):
    """The decode on the mma.sync kernel with a forced head tile and parts, and its plan."""
    library = nvfp4_mla.KernelLibrary(decode_backend="mma_sync", decode_head_tile=head_tile, decode_parts=parts)
    return plan_of(q, pools, library), run(q, pools, sinks=sinks, library=library)


@pytest.mark.parametrize("heads", [8, 40, 64, 128])
@pytest.mark.parametrize("head_tile", decode_mma.HEAD_TILES)
def test_every_head_tile_whole_and_cut(seed, heads, head_tile):
    """Both epilogues (direct, and partials + combine) for each head tile, heads not a multiple of
    it: the 4 rows whole, then cut between 2, 4 and 11 parts."""
    if not head_tile_fits(head_tile):
        pytest.skip(f"this GPU's blocks cannot hold the shared memory of {head_tile} heads")
    q, pools, sinks, want = split_case(seed, heads, 200)
    for parts in (1, 2, 4, 11):
        plan, got = planned(q, pools, head_tile, parts, sinks)
        assert plan.parts == parts and (plan.combine is None) == (parts == 1) and plan.tile_tokens == 32
        check(got, want, f"heads {heads} tile {head_tile} in {parts} parts")


SM80_PTX = VirtualArchKernels("sm_80")  # compiled on first use, kept in memory


@pytest.mark.parametrize("head_tile", decode_mma.HEAD_TILES)
def test_the_mma_sync_kernel_as_sm_80_ptx(seed, head_tile):
    """The mma.sync kernel's sm_80 code, as PTX that the driver compiles for this GPU (the path of
    an A100): each head tile, whole rows and the work list in 5 parts (rows cut), against the
    float64 answer."""
    if not head_tile_fits(head_tile):
        pytest.skip(f"this GPU's blocks cannot hold the shared memory of {head_tile} heads")
    q, pools, sinks, want = split_case(seed, 40, 200)
    for parts in (1, 5):
        library = nvfp4_mla.KernelLibrary(
            SM80_PTX, decode_backend="mma_sync", decode_head_tile=head_tile, decode_parts=parts
        )
        check(run(q, pools, sinks=sinks, library=library), want, f"sm_80 PTX, tile {head_tile}, {parts} parts")


@pytest.mark.parametrize("heads", [16, 128])
def test_a_row_does_not_depend_on_the_other_rows(backend, seed, heads):
    """Batch invariance within a call shape: new queries and slots in the other rows leave a row's
    bits as they were (the backend follows from the shape, the work list from the shape and the
    lengths). New lengths in the other rows move the work list's cuts, so there the row stays
    within the tolerances of the float64 answer."""
    g = torch.Generator().manual_seed(seed)
    swa, extra = Pool(16, 64, g), Pool(32, 64, g)
    batch, q_len = 40, 1  # at 16 heads, 40 rows take the wgmma kernel on sm_90
    swa_slots, extra_slots = swa.slots((batch, q_len, 128), g, invalid=0.1), extra.slots((batch, q_len, 640), g)
    swa_lens, extra_lens = lengths(batch, q_len, 128, g), lengths(batch, q_len, 640, g, torch.int64)
    q = queries(batch, q_len, heads, g)
    sinks = torch.randn(heads, generator=g).to(DEVICE)
    pools = [(swa, swa_slots, swa_lens), (extra, extra_slots, extra_lens)]
    first = run(q, pools, sinks=sinks, library=backend)
    q[1:] = queries(batch - 1, q_len, heads, g)
    swa_slots[1:] = swa.slots((batch - 1, q_len, 128), g)
    extra_slots[1:] = extra.slots((batch - 1, q_len, 640), g, invalid=0.3)
    again = run(q, pools, sinks=sinks, library=backend)
    assert bits_equal(again[0][:1], first[0][:1]) and bits_equal(again[1][:1], first[1][:1])
    assert not bits_equal(again[0][1:], first[0][1:])  # the other rows did change
    check(again, exact(q, pools, sinks=sinks), f"heads {heads}, the other rows' queries and slots replaced")
    swa_lens[1:] = lengths(batch - 1, q_len, 128, g)
    extra_lens[1:] = lengths(batch - 1, q_len, 640, g, torch.int64)
    moved = run(q, pools, sinks=sinks, library=backend)
    check(moved, exact(q, pools, sinks=sinks), f"heads {heads}, and their lengths")


def invariant_call(q, pools, sinks, library, planned):
    """``sparse_mla_decode`` with ``batch_invariant=True``: the one-call form, or through a plan
    (``planned``) made for the call."""
    (swa, swa_slots, swa_lens), (extra, extra_slots, extra_lens) = pools
    tables = {"swa_lens": swa_lens, "extra_slots": extra_slots, "extra_lens": extra_lens}
    plan = None
    if planned:
        plan = nvfp4_mla.plan_sparse_mla_decode(q.shape[2], swa_slots, **tables, library=library, batch_invariant=True)
        library = None
    return nvfp4_mla.sparse_mla_decode(
        q,
        swa.cache,
        swa_slots,
        extra_cache=extra.cache,
        sm_scale=SM_SCALE,
        sinks=sinks,
        library=library,
        plan=plan,
        batch_invariant=None if planned else True,
        **tables,
    )


def other_lengths(kind: int, rows: int, k: int, g: torch.Generator) -> torch.Tensor:
    """``[rows, 1]`` lengths of one kind: nothing live (0), every entry live (1), random (2)."""
    if kind == 2:
        return torch.randint(0, k + 1, (rows, 1), generator=g).to(DEVICE)
    return torch.full((rows, 1), k * kind, device=DEVICE)


@pytest.mark.parametrize("heads", [1, 8, 16, 64, 100, 128])
@pytest.mark.parametrize("with_lengths", [True, False])
def test_batch_invariant_rows_keep_their_bits_in_any_batch(backend, seed, heads, with_lengths):
    """batch_invariant=True: a row's out and lse bits alone are its bits at any place of batches
    of 2 to 16,384 rows whose other rows have other queries, slots and lengths (nothing live,
    every entry live, random), in the one-call form and through a plan, with length tensors and
    without. Without batch_invariant the same row alone is split between blocks at 128 heads, and
    its bits differ from the whole row's (so this comparison can fail)."""
    g = torch.Generator().manual_seed(seed)
    swa, extra = Pool(16, 64, g), Pool(32, 64, g)
    swa_k, extra_k = 128, 640
    on_gpu = torch.Generator(DEVICE).manual_seed(seed)
    sinks = torch.randn(heads, generator=g).to(DEVICE)
    q0 = queries(1, 1, heads, g)
    tables0 = [
        swa.slots((1, 1, swa_k), g, invalid=0.05),
        extra.slots((1, 1, extra_k), g, torch.int32, invalid=0.05),
        torch.tensor([[swa_k - 3]], device=DEVICE),
        torch.tensor([[extra_k // 2 + 5]], device=DEVICE),
    ]

    def pools_of(tables):
        swa_slots, extra_slots, swa_lens, extra_lens = tables if with_lengths else (*tables[:2], None, None)
        return [(swa, swa_slots, swa_lens), (extra, extra_slots, extra_lens)]

    alone = invariant_call(q0, pools_of(tables0), sinks, backend, False)
    check(alone, exact(q0, pools_of(tables0), sinks=sinks), f"heads {heads}, one row, batch-invariant")
    for i, rows in enumerate((2, 7, 133, 1031, 16384) if heads <= 16 else (2, 7, 133, 1031)):
        at = rows * 5 // 7
        q = torch.randn(rows, 1, heads, abi.HEAD_DIM, device=DEVICE, dtype=BF16, generator=on_gpu)
        tables = [
            swa.slots((rows, 1, swa_k), g, invalid=0.05),
            extra.slots((rows, 1, extra_k), g, torch.int32),
            other_lengths(i % 3, rows, swa_k, g),
            other_lengths(i % 3, rows, extra_k, g),
        ]
        q[at] = q0[0]
        for table, row in zip(tables, tables0):
            table[at] = row[0]
        for planned in (False, True):
            out, lse = invariant_call(q, pools_of(tables), sinks, backend, planned)
            what = f"heads {heads}, row {at} of {rows}, plan {planned}"
            assert bits_equal(out[at], alone[0][0]) and bits_equal(lse[at], alone[1][0]), what
    if heads == 128 and with_lengths:  # the default plan splits the row alone
        split = run(q0, pools_of(tables0), sinks=sinks, library=backend)
        assert plan_of(q0, pools_of(tables0), backend).combine is not None
        assert not (bits_equal(split[0], alone[0]) and bits_equal(split[1], alone[1])), (
            "the split row alone gave the whole row's bits: the comparison above could not fail"
        )


def test_split_runs_are_bitwise_reproducible(backend, seed):
    g = torch.Generator().manual_seed(seed)
    swa, extra = Pool(16, 64, g), Pool(64, 64, g)
    pools = [(swa, swa.slots((1, 1, 128), g), None), (extra, extra.slots((1, 1, 1024), g, invalid=0.05), None)]
    q = queries(1, 1, 128, g)
    sinks = torch.randn(128, generator=g).to(DEVICE)
    first = run(q, pools, sinks=sinks, library=backend)
    assert plan_of(q, pools, backend).combine is not None, "batch 1 is split (or cut between parts)"
    for _ in range(3):
        again = run(q, pools, sinks=sinks, library=backend)
        assert bits_equal(again[0], first[0]) and bits_equal(again[1], first[1])
    check(first, exact(q, pools, sinks=sinks), "batch 1 split")


@pytest.mark.parametrize("heads", [16, 64, 100, 128])
def test_every_backend_with_every_split(seed, heads):
    """Each backend of this GPU, forced, over its work list in 1 to 12 parts (up to three a row:
    rows whole and cut, both epilogues), heads that do not fill its head tile, both pools with
    lengths and invalid slots."""
    q, pools, sinks, want = split_case(seed, heads, 300)
    gpu = device_info(q.get_device())
    for name in [n for n, b in decode.BACKENDS.items() if b.supports(gpu.capability)]:
        for n in cuts((1, 2, 3, 7), 4):  # batch 2 x q_len 2
            library = cut(name, n)
            plan = plan_of(q, pools, library)
            assert plan.backend == name
            assert (plan.parts, plan.num_splits) == (n, 1) and (plan.combine is None) == (n == 1)
            check(run(q, pools, sinks=sinks, library=library), want, f"{name}, heads {heads}, cut {n} ways")


def one_row_cut_most_ways(tile_tokens: int, segment_cost: int) -> int:
    """Live tokens of one row (tiles of ``tile_tokens``) that the work list in MAX_LIST_PARTS parts
    cuts into the combine's most partials of a row (MAX_PARTIALS), by the CPU model of the
    scheduler at the kernel's ``segment_cost``."""
    parts = decode.MAX_LIST_PARTS
    for tiles in range(parts, 64 * parts):
        listed = decode_scheduler.schedule([tiles], parts, segment_cost, decode.COMBINE_COST)
        segments = sum(1 for part in listed.parts for _ in decode_scheduler.segments(part, [tiles]))
        if segments == decode_combine.MAX_PARTIALS:
            return tiles * tile_tokens
    raise AssertionError("no row length is cut into MAX_PARTIALS segments")


# (warps a head, partials prefetched, loads in flight, the tail's partials at a time): the shipped
# builds and the kernel's other forms, none spilling.
FORMS = ((1, 0, 4, 1), (2, 2, 8, 2), (4, 0, 1, 1), (4, 1, 4, 3))
BUILDS = [*decode_combine.BUILDS, *(decode_combine.CombineSpec(*f) for f in FORMS)]


def test_the_combine_builds_give_the_same_bits(seed):
    """The combine's builds (a warp or four a head, prefetching no partial, one, more) add a row's
    partials in the same order: the same bits, at fewer partials a row than the prefetches hold,
    more, and on every backend of this GPU one row cut into the most (MAX_PARTIALS), within the
    float64 answer's tolerances. And the plan takes the first of the builds whose blocks fit the
    GPU at once, else the last."""
    q, pools, sinks, want = split_case(seed, 64, 8000)  # 4 rows of 128 + 8000 tokens

    def combine_build(build):
        def tune(spec):
            return build if isinstance(spec, decode_combine.CombineSpec) else spec

        return tune

    def same_bits_from_every_build(q, pools, sinks, want, what, **forced):
        got = [
            run(q, pools, sinks=sinks, library=nvfp4_mla.KernelLibrary(tune=combine_build(p), **forced)) for p in BUILDS
        ]
        for other in got[1:]:
            assert bits_equal(got[0][0], other[0]) and bits_equal(got[0][1], other[1]), what
        check(got[0], want, f"every combine build, {what}")

    prefetched = decode_combine.SPREAD_PREFETCH.prefetch
    for parts in (3, 4 * (prefetched + 1), decode.MAX_LIST_PARTS):  # up to about 128 partials a row
        same_bits_from_every_build(
            q, pools, sinks, want, f"{parts} parts", decode_backend="mma_sync", decode_parts=parts
        )
    device = q.get_device()
    gpu = device_info(device)
    for name in [n for n, b in decode.BACKENDS.items() if b.supports(gpu.capability)]:
        attention = decode.BACKENDS[name].attention(nvfp4_mla.KernelLibrary(decode_backend=name), gpu, 64, 1)
        g = torch.Generator().manual_seed(seed + 1)
        swa, extra = Pool(8, 64, g), Pool(64, 64, g)
        extra_k = one_row_cut_most_ways(attention.tile_tokens, attention.segment_cost) - 128
        swa_lens = torch.full((1, 1), 128, dtype=torch.int32, device=DEVICE)  # every entry live
        extra_lens = torch.full((1, 1), extra_k, dtype=torch.int64, device=DEVICE)
        one = [
            (swa, swa.slots((1, 1, 128), g, invalid=0.1), swa_lens),
            (extra, extra.slots((1, 1, extra_k), g, torch.int32, invalid=0.1), extra_lens),
        ]
        q_one, sinks_one = queries(1, 1, 64, g), torch.randn(64, generator=g).to(DEVICE)
        forced = {"decode_backend": name, "decode_parts": decode.MAX_LIST_PARTS}
        plan = plan_of(q_one, one, nvfp4_mla.KernelLibrary(**forced))  # type: ignore[arg-type]
        assert plan.parts == decode.MAX_LIST_PARTS and plan.schedule.segment_cost == attention.segment_cost
        assert plan.combine_blocks == decode_combine.SPREAD_PREFETCH.blocks(1, 64)
        want_one = exact(q_one, one, sinks=sinks_one)
        what = f"{name}: a row cut {decode_combine.MAX_PARTIALS} ways"
        same_bits_from_every_build(q_one, one, sinks_one, want_one, what, **forced)
    library = nvfp4_mla.KernelLibrary(decode_backend="mma_sync")
    launchers = {b: library.launcher(device, library.spec(b)) for b in decode_combine.BUILDS}
    held = [launchers[b].resident_blocks // b.blocks(1, 64) for b in decode_combine.BUILDS]  # split rows at once
    assert held == sorted(held) and held[-2] + 2 <= decode.MAX_LIST_PARTS
    builds = decode_combine.BUILDS
    taken = [(held[i] + more, builds[i + more]) for i in range(len(builds) - 1) for more in (0, 1)]
    for split_rows, build in taken:  # a split row a boundary, at most
        library = nvfp4_mla.KernelLibrary(decode_backend="mma_sync", decode_parts=split_rows + 1)
        listed = decode.plan(library, device, 64, 4096, 128, 512)
        assert listed.combine is launchers[build], split_rows
        assert listed.combine_blocks == build.blocks(split_rows, 64)


@pytest.mark.parametrize(("heads", "dim_parts"), [(65, 1), (128, 1), (256, 1), (16, 2), (64, 2), (128, 2)])
def test_wgmma_clusters_give_the_bits_of_single_blocks(seed, heads, dim_parts):
    """The Hopper kernel's clusters (two blocks of a part that gather the same tiles: two head
    tiles, or with one head tile the two halves of a row; each block dequantizes half of every tile
    into both) against the same kernel with every block alone: the same list, the same arithmetic,
    so the same bits, over masks, lengths, sinks, both pools and the work list in 1 to 12 parts
    (rows whole and cut)."""
    gpu = device_info(torch.cuda.current_device())
    if not decode.BACKENDS["wgmma_sm90"].supports(gpu.capability):
        pytest.skip(f"the wgmma kernel runs on sm_90 only, this GPU is {gpu.arch}")
    assert decode_sm90.cluster_of(heads, dim_parts) == 2
    q, pools, sinks, want = split_case(seed, heads, 300)
    for parts in cuts((1, 3, 7), 4):
        forced = functools.partial(
            nvfp4_mla.KernelLibrary, decode_backend="wgmma_sm90", decode_parts=parts, decode_dim_parts=dim_parts
        )
        paired, single = forced(), forced(tune=alone)
        assert plan_of(q, pools, paired).blocks == plan_of(q, pools, single).blocks
        got, reference = run(q, pools, sinks=sinks, library=paired), run(q, pools, sinks=sinks, library=single)
        assert bits_equal(got[0], reference[0]) and bits_equal(got[1], reference[1]), f"{parts} parts"
        check(got, want, f"clusters, heads {heads}, {dim_parts} dim parts, {parts} parts")


@pytest.fixture
def one_list(monkeypatch):
    """Every build deals a call's list at the same costs (each has its own segment cost), so that
    a kernel's forms (whole or half rows, in clusters or not) walk the same list."""
    monkeypatch.setattr(decode_planner, "list_costs", lambda attention: (1, decode.COMBINE_COST))


@pytest.mark.usefixtures("one_list")
@pytest.mark.parametrize(
    ("name", "heads"),
    [*[("wgmma_sm90", heads) for heads in (16, 64, 100, 128)], *[("wgmma_sm90_narrow", heads) for heads in (16, 40)]],
)
def test_wgmma_blocks_walking_many_segments(seed, name, heads):
    """The Hopper kernels' blocks walk their part's segments in turn: a block's producers gather a
    segment's first tile while its consumers stage the segment before's outputs in the other K/V
    buffer, and every barrier phase runs on across segments. With the work list in 1, 2 and 3
    parts, a block walks many segments of 12 rows (rows cut between parts among them) with lengths,
    invalid slots and sinks, across three rows in a row with nothing live by their lengths (a dead
    tile each) and one by its slots (its tiles all dead): within the tolerances of the float64
    answer, and at each part count the same bits on a second run; on the 64-head build also whole
    or in half rows, in clusters or with every block alone (the same list, the same arithmetic). In
    both builds (the NARROW one also over its consumer's exchange of per-head maxima and sums)."""
    gpu = device_info(torch.cuda.current_device())
    if not decode.BACKENDS[name].supports(gpu.capability):
        pytest.skip(f"the wgmma kernel runs on sm_90 only, this GPU is {gpu.arch}")
    g = torch.Generator().manual_seed(seed)
    swa, extra = Pool(16, 64, g), Pool(16, 16, g)
    batch, q_len = 4, 3
    swa_slots = swa.slots((batch, q_len, 128), g, invalid=0.1)
    extra_slots = extra.slots((batch, q_len, 300), g, torch.int32, invalid=0.1)
    swa_lens, extra_lens = lengths(batch, q_len, 128, g), lengths(batch, q_len, 300, g, torch.int64)
    swa_lens[1], extra_lens[1] = 0, 0  # rows 3-5: nothing live by their lengths
    swa_lens[2, 1], extra_lens[2, 1] = 0, 300  # row 7: its window empty, its extra entries all invalid
    extra_slots[2, 1] = -1
    pools = [(swa, swa_slots, swa_lens), (extra, extra_slots, extra_lens)]
    q = queries(batch, q_len, heads, g)
    sinks = torch.randn(heads, generator=g).to(DEVICE)
    want = exact(q, pools, sinks=sinks)
    forms = [(1, None)] if name == "wgmma_sm90_narrow" else [(d, tune) for d in (1, 2) for tune in (None, alone)]
    for parts in (1, 2, 3):
        results = []
        for dim_parts, tune in forms:
            library = nvfp4_mla.KernelLibrary(
                decode_backend=name, decode_parts=parts, decode_dim_parts=dim_parts, tune=tune
            )
            plan = plan_of(q, pools, library)
            assert plan.parts == parts and plan.dim_parts == dim_parts
            assert plan.blocks == parts * -(-heads // plan.head_tile) * dim_parts
            results.append(run(q, pools, sinks=sinks, library=library))
        results.append(run(q, pools, sinks=sinks, library=library))  # the last form again
        for (dim_parts, tune), got in zip([*forms, forms[-1]], results):
            what = f"heads {heads}, {parts} parts, {dim_parts} dim parts{', alone' if tune else ''}"
            assert bits_equal(got[0], results[0][0]) and bits_equal(got[1], results[0][1]), what
        check(results[0], want, f"blocks walking segments, {name}, heads {heads}, {parts} parts")


@pytest.mark.parametrize(("name", "heads"), [("wgmma_sm90", 16), ("wgmma_sm90", 128), ("wgmma_sm90_narrow", 16)])
def test_a_work_list_of_mostly_empty_parts(seed, name, heads):
    """The work list in 1 to 256 parts over 3 rows of 1, 1 and 3 tiles (8 tile-times of work with
    the segments' cost; the second row with nothing live): past a few parts, most parts have no
    segment (their blocks exit at once, a cluster together) and the others cut the long row where
    they fall. Within the tolerances of the float64 answer at every count, and at 256 parts the
    same bits on a second run."""
    gpu = device_info(torch.cuda.current_device())
    if not decode.BACKENDS[name].supports(gpu.capability):
        pytest.skip(f"the wgmma kernel runs on sm_90 only, this GPU is {gpu.arch}")
    g = torch.Generator().manual_seed(seed)
    swa, extra = Pool(8, 64, g), Pool(8, 16, g)
    swa_lens = torch.tensor([[1], [0], [70]], dtype=torch.int32, device=DEVICE)
    extra_lens = torch.tensor([[0], [0], [60]], dtype=torch.int64, device=DEVICE)
    pools = [
        (swa, swa.slots((3, 1, 128), g, invalid=0.1), swa_lens),
        (extra, extra.slots((3, 1, 64), g, torch.int32, invalid=0.1), extra_lens),
    ]
    tiles = decode_scheduler.row_tiles(3, 128, swa_lens, 64, extra_lens, decode_sm90.BLOCK_N)
    assert tiles == [1, 1, 3]
    q = queries(3, 1, heads, g)
    sinks = torch.randn(heads, generator=g).to(DEVICE)
    want = exact(q, pools, sinks=sinks)
    for parts in (1, 2, 5, 64, 255, 256):
        library = nvfp4_mla.KernelLibrary(decode_backend=name, decode_parts=parts)
        plan = plan_of(q, pools, library)
        assert plan.parts == parts and (plan.combine is None) == (parts == 1)
        listed = decode_scheduler.schedule(tiles, parts, *plan.schedule.costs)
        busy = sum(any(True for _ in decode_scheduler.segments(part, tiles)) for part in listed.parts)
        assert busy <= sum(tiles) + 3 * plan.schedule.segment_cost  # every other part is empty
        got = run(q, pools, sinks=sinks, library=library)
        check(got, want, f"{name}, heads {heads}, {parts} parts, {busy} of them with segments")
    again = run(q, pools, sinks=sinks, library=library)
    assert bits_equal(again[0], got[0]) and bits_equal(again[1], got[1])


@pytest.mark.parametrize("heads", [16, 128])
def test_rows_kept_whole_where_cutting_costs_more(backend, seed, heads):
    """Full rows about one a part, which the scheduler keeps whole with the combine's cost and
    would cut without it (its CPU model says which): no row is cut, the combine launched over
    nothing; within the tolerances of the float64 answer, and the bits of the host's list of the
    same rows (no length tensors)."""
    g = torch.Generator().manual_seed(seed)
    swa, extra = Pool(8, 64, g), Pool(16, 64, g)
    q = queries(7, 1, heads, g)
    slots = [swa.slots((7, 1, 64), g, invalid=0.05), extra.slots((7, 1, 576), g, torch.int32, invalid=0.05)]
    full = [torch.full((7, 1), k, dtype=torch.int32, device=DEVICE) for k in (64, 576)]
    with_lens = [(swa, slots[0], full[0]), (extra, slots[1], full[1])]
    without = [(swa, slots[0], None), (extra, slots[1], None)]
    sinks = torch.randn(heads, generator=g).to(DEVICE)
    want = exact(q, with_lens, sinks=sinks)
    forced = {} if backend is None else {"decode_backend": backend.decode_backend}
    kept = 0
    for rows, parts in ((4, 5), (6, 7), (7, 8), (7, 9), (6, 8), (7, 4)):
        library = nvfp4_mla.KernelLibrary(**forced, decode_parts=parts)
        plan = plan_of(q[:rows], with_lens, library)
        tiles = [decode_scheduler.live_tiles(640, 0, plan.tile_tokens)] * rows
        listed = decode_scheduler.schedule(tiles, parts, *plan.schedule.costs)
        cut = decode_scheduler.schedule(tiles, parts, plan.schedule.segment_cost, 0)
        whole = all(row < 0 for row, _ in listed.split_rows)
        kept += whole and any(row >= 0 for row, _ in cut.split_rows)
        picked = [(p, s[:rows], None if lens is None else lens[:rows]) for p, s, lens in with_lens]
        got = run(q[:rows], picked, sinks=sinks, library=library)
        what = f"{rows} rows in {parts} parts, whole {whole}"
        check(got, (want[0][:rows], want[1][:rows], want[2][:rows]), what)
        hosts = run(q[:rows], [(p, s[:rows], None) for p, s, _ in without], sinks=sinks, library=library)
        assert bits_equal(got[0], hosts[0]) and bits_equal(got[1], hosts[1]), what
    assert kept, "no case was kept whole by the combine's cost alone"


@pytest.mark.usefixtures("one_list")
@pytest.mark.parametrize("heads", [16, 64, 100, 128])
def test_wgmma_half_rows_give_the_bits_of_whole_rows(seed, heads):
    """The Hopper kernel with each row's output dims in two halves (a block each: the same S,
    softmax and (m, l), P.V over its half of the dims) against whole rows at the same parts: the
    same list, the same arithmetic, so the same bits, over the work list in 1 to 12 parts (rows
    whole and cut, both epilogues), clusters, heads that leave a head tile partly empty, lengths,
    invalid slots, sinks and a row with nothing live."""
    gpu = device_info(torch.cuda.current_device())
    if not decode.BACKENDS["wgmma_sm90"].supports(gpu.capability):
        pytest.skip(f"the wgmma kernel runs on sm_90 only, this GPU is {gpu.arch}")
    q, pools, sinks, _ = split_case(seed, heads, 300)
    (_, _, swa_lens), (_, extra_slots, _) = pools
    swa_lens[1, 0] = 0  # row 2: nothing live
    extra_slots[1, 0] = -1
    want = exact(q, pools, sinks=sinks)
    for parts in cuts((1, 3, 7), 4):
        forced = functools.partial(nvfp4_mla.KernelLibrary, decode_backend="wgmma_sm90", decode_parts=parts)
        whole, halves = forced(decode_dim_parts=1), forced(decode_dim_parts=2)
        whole_plan, halves_plan = plan_of(q, pools, whole), plan_of(q, pools, halves)
        assert [(p.dim_parts, p.parts) for p in (whole_plan, halves_plan)] == [(1, parts), (2, parts)]
        assert halves_plan.blocks == 2 * whole_plan.blocks == 2 * parts * -(-heads // decode_sm90.HEAD_TILE)
        reference = run(q, pools, sinks=sinks, library=whole)
        got = run(q, pools, sinks=sinks, library=halves)
        assert bits_equal(got[0], reference[0]) and bits_equal(got[1], reference[1]), f"heads {heads}, {parts} parts"
        check(got, want, f"half rows, heads {heads}, {parts} parts")


def test_a_list_plan_fills_the_gpu():
    """The wgmma kernel's work list (a call with lengths) fills the GPU: as many parts as it holds
    blocks at once (whole clusters) over a part's blocks (its head tiles times its dim parts), in
    the width split's dim parts at the tables' widths. Batch 1: half rows; 64 rows: the cost
    model's paired halves at 64 heads, whole rows at 128."""
    gpu = device_info(torch.cuda.current_device())
    if not decode.BACKENDS["wgmma_sm90"].supports(gpu.capability):
        pytest.skip(f"the wgmma kernel runs on sm_90 only, this GPU is {gpu.arch}")
    library = nvfp4_mla.KernelLibrary()
    found = []
    for heads, rows, dim_parts in ((64, 1, 2), (128, 1, 2), (64, 64, 2), (128, 64, 1)):
        plan = decode.plan(library, gpu.index, heads, rows, 128, 512)
        per_part = -(-heads // decode_sm90.HEAD_TILE) * dim_parts
        resident = plan.attend.resident_blocks
        cluster = decode_sm90.cluster_of(heads, dim_parts)
        assert (plan.backend, plan.dim_parts, plan.num_splits) == ("wgmma_sm90", dim_parts, 1)
        assert plan.parts == min((resident - resident % cluster) // per_part, decode.MAX_LIST_PARTS) > 1
        assert plan.blocks == plan.parts * per_part <= resident
        found.append((plan.parts, plan.blocks))
    if gpu.sms == 132:  # H100 SXM, H200, GH200: a block an SM (the choices are tested on the CPU)
        assert found == [(66, 132), (33, 132), (66, 132), (66, 132)]


# ---------------------------------------------------------------- execution contract


def test_out_argument(backend, seed):
    g = torch.Generator().manual_seed(seed)
    pool = Pool(8, 64, g)
    q = queries(2, 2, 16, g)
    pools = [(pool, pool.slots((2, 2, 70), g, invalid=0.2), lengths(2, 2, 70, g))]
    want = run(q, pools, library=backend)
    out = torch.full_like(q, math.nan)
    got = run(q, pools, out=out, library=backend)
    assert got[0] is out and bits_equal(out, want[0]) and bits_equal(got[1], want[1])
    with pytest.raises(ValueError, match="q overlaps out"):
        run(q, pools, out=q, library=backend)
    with pytest.raises(ValueError, match=r"out must have dtype torch\.bfloat16"):
        run(q, pools, out=out.float(), library=backend)


@pytest.mark.parametrize("heads", [64, 100, 128])
def test_q_at_a_new_address_each_call(backend, seed, heads):
    """One call shape (one plan) on q at a new address each call, once 16 bytes into a larger
    buffer: each call reads its own q (the Hopper kernel loads q through a tensor map of q's
    address, which the plan encodes again when q moves), and the first q again gives the first
    call's bits."""
    g = torch.Generator().manual_seed(seed)
    pool = Pool(16, 64, g)
    pools = [(pool, pool.slots((3, 1, 200), g, invalid=0.1), None)]
    first = queries(3, 1, heads, g)
    buffer = torch.empty(first.numel() + 8, dtype=BF16, device=DEVICE)
    moved = buffer[8:].view(first.shape)  # 16 bytes in: aligned for the loads, at no round address
    moved.copy_(queries(3, 1, heads, g))
    want = run(first, pools, library=backend)
    check(want, exact(first, pools), f"heads {heads}, first q")
    check(run(moved, pools, library=backend), exact(moved, pools), f"heads {heads}, moved q")
    again = run(first, pools, library=backend)
    assert bits_equal(again[0], want[0]) and bits_equal(again[1], want[1])


@pytest.mark.parametrize("how", ["eager", "graph"])  # the sanitizers run without torch's caching allocator: eager only
@pytest.mark.parametrize("with_lengths", [False, True])
@pytest.mark.parametrize("cut_ways", [1, 4])
@pytest.mark.parametrize("name", list(decode.BACKENDS))
@pytest.mark.parametrize("heads", [16, 128])
def test_a_chain_of_calls_each_on_the_last_ones_out(seed, heads, name, cut_ways, with_lengths, how):
    """Calls in one stream, each one's q the previous one's out, no other kernel between them:
    from sm_90 a kernel may start while the stream's previous kernel still runs (programmatic
    dependent launch), so it must read q only once the previous call wrote it, and write its
    workspace (the previous call's, freed and handed out again: the work list the scheduler writes
    from the lengths, the partials) only once the previous call's kernels read it. Each backend,
    forced, its work whole and cut in four (parts that cut rows), without lengths and with them
    (the plan's list, or the scheduler's each call), queued behind a
    sleeping kernel (so that the GPU, not the host, paces the calls) or replayed as one graph: the
    bits of the same calls with the GPU synchronised between them."""
    g = torch.Generator().manual_seed(seed)
    pool = Pool(16, 64, g)
    slots = pool.slots((1, 2, 640), g, invalid=0.05)
    lens = lengths(1, 2, 640, g) if with_lengths else None
    first = queries(1, 2, heads, g)
    gpu = device_info(first.get_device())
    if not decode.BACKENDS[name].supports(gpu.capability):
        pytest.skip(f"the {name} backend does not run on {gpu.arch}")
    library = cut(name, cut_ways)

    def chain(synchronize):
        q, calls = first, []
        for _ in range(8):
            q, lse = nvfp4_mla.sparse_mla_decode(
                q, pool.cache, slots, swa_lens=lens, sm_scale=SM_SCALE, library=library
            )
            calls.append((q, lse))
            if synchronize:
                torch.cuda.synchronize()
        return calls

    def same(got, want):
        for step, ((out, lse), (want_out, want_lse)) in enumerate(zip(got, want, strict=True)):
            assert bits_equal(out, want_out) and bits_equal(lse, want_lse), f"{how}, call {step}"

    plan = plan_of(first, [(pool, slots, lens)], library)
    launchers = [x for x in (plan.scheduler, plan.attend, plan.combine) if x is not None]
    assert (plan.scheduler is not None) == with_lengths
    assert [x.dependent_launch for x in launchers] == [gpu.capability >= 90] * len(launchers)
    want = chain(synchronize=True)
    check(want[0], exact(first, [(pool, slots, lens)]), "the first call")
    if how == "eager":
        torch.cuda._sleep(10_000_000)  # about 5 ms: the host queues every call meanwhile
        same(chain(synchronize=False), want)
        return
    graph, replayed = captured(lambda: chain(synchronize=False))
    for _ in range(2):
        graph.replay()
        torch.cuda.synchronize()
        same(replayed, want)


@pytest.mark.parametrize("heads", [16, 100])
def test_out_inside_a_larger_buffer_is_all_that_is_written(seed, heads):
    """``out`` a slice of a canary-filled buffer, on every backend of this GPU, its work whole and
    cut in three (parts that cut rows: both epilogues), with heads that leave a head tile
    partly empty: the bytes around out keep their canary, and out holds a fresh call's bits."""
    q, pools, sinks, _ = split_case(seed, heads, 300)
    gpu = device_info(q.get_device())
    margin = heads * abi.HEAD_DIM  # a query row of outputs on each side
    for name in [n for n, b in decode.BACKENDS.items() if b.supports(gpu.capability)]:
        for n in (1, 3):
            library = cut(name, n)
            want = run(q, pools, sinks=sinks, library=library)
            buffer = torch.full((q.numel() + 2 * margin,), 0x5A5A, dtype=torch.int16, device=DEVICE)
            out = buffer[margin : margin + q.numel()].view(BF16).view(q.shape)
            got = run(q, pools, sinks=sinks, out=out, library=library)
            what = f"{name}, heads {heads}, cut {n} ways"
            assert bool((buffer[:margin] == 0x5A5A).all() and (buffer[-margin:] == 0x5A5A).all()), what
            assert bits_equal(got[0], want[0]) and bits_equal(got[1], want[1]), what


@pytest.mark.parametrize("heads", [64, 128])
def test_graph_replay(backend, seed, heads):
    """Captured once, replayed on new contents of the same tensors: the eager call's bits."""
    g = torch.Generator().manual_seed(seed)
    swa, extra = Pool(16, 64, g), Pool(16, 16, g)
    batch, q_len = 1, 2  # batch 1: split (or cut between parts), so the combine and its workspace are captured too
    q = queries(batch, q_len, heads, g)
    swa_slots, extra_slots = swa.slots((batch, q_len, 128), g), extra.slots((batch, q_len, 256), g, torch.int32)
    swa_lens = lengths(batch, q_len, 128, g)
    sinks = torch.randn(heads, generator=g).to(DEVICE)
    pools = [(swa, swa_slots, swa_lens), (extra, extra_slots, None)]
    run(q, pools, sinks=sinks, library=backend)  # compile and plan outside the capture
    graph, replayed = captured(lambda: run(q, pools, sinks=sinks, library=backend))
    for _ in range(2):
        q.copy_(queries(batch, q_len, heads, g))
        swa_slots.copy_(swa.slots((batch, q_len, 128), g, invalid=0.2))
        swa_lens.copy_(lengths(batch, q_len, 128, g))
        graph.replay()
        want = run(q, pools, sinks=sinks, library=backend)
        torch.cuda.synchronize()
        assert bits_equal(replayed[0], want[0]) and bits_equal(replayed[1], want[1])
        check(replayed, exact(q, pools, sinks=sinks), "graph replay")


@pytest.mark.parametrize("heads", [16, 128])
def test_lengths_that_change_between_replays_of_one_graph(backend, seed, heads):
    """One call captured once, then replayed after new lengths are copied into its length tensors
    (int32 and int64): nothing live, every entry live, one long row among rows of one entry,
    uniform, one row in eight long. On a Hopper backend the scheduler writes each replay's work
    list from that replay's lengths, so a replay gives the bits of an eager call with the same
    lengths (the same list); on the mma.sync kernel the split follows the shapes. Every replay is
    within the tolerances of the float64 answer of its lengths."""
    g = torch.Generator().manual_seed(seed)
    swa, extra = Pool(16, 64, g), Pool(64, 64, g)
    batch, q_len, swa_k, extra_k = 3, 2, 128, 1024
    q = queries(batch, q_len, heads, g)
    swa_lens, extra_lens = lengths(batch, q_len, swa_k, g), lengths(batch, q_len, extra_k, g, torch.int64)
    pools = [
        (swa, swa.slots((batch, q_len, swa_k), g, torch.int32, invalid=0.05), swa_lens),
        (extra, extra.slots((batch, q_len, extra_k), g, invalid=0.05), extra_lens),
    ]
    sinks = torch.randn(heads, generator=g).to(DEVICE)
    run(q, pools, sinks=sinks, library=backend)  # compile and plan outside the capture
    graph, replayed = captured(lambda: run(q, pools, sinks=sinks, library=backend))
    for name, swa_n, extra_n in length_sets(batch * q_len, swa_k, extra_k, g):
        swa_lens.copy_(swa_n.view(batch, q_len))
        extra_lens.copy_(extra_n.view(batch, q_len))
        graph.replay()
        want = run(q, pools, sinks=sinks, library=backend)
        torch.cuda.synchronize()
        assert bits_equal(replayed[0], want[0]) and bits_equal(replayed[1], want[1]), f"{name} lengths"
        check(replayed, exact(q, pools, sinks=sinks), f"heads {heads}, {name} lengths replayed")


def test_full_lengths_give_the_bits_of_no_lengths(seed):
    """Lengths that leave every entry live (at and past the tables' widths: the clamp) against the
    same call without lengths, on each backend of this GPU: on the mma.sync kernel the same masks,
    so the same bits; on a Hopper backend with ``decode_parts``, the list that the plan of a call
    without lengths makes once is the one the scheduler writes from those lengths, so the same bits
    (one row cut between many parts, and six rows). Without ``decode_parts`` a call without lengths
    deals the width split of every row's tokens into parts, another list: within the tolerances of
    the float64 answer, both."""
    g = torch.Generator().manual_seed(seed)
    swa, extra = Pool(16, 64, g), Pool(32, 64, g)
    heads = 64
    sinks = torch.randn(heads, generator=g).to(DEVICE)
    gpu = device_info(torch.cuda.current_device())
    for batch, q_len in ((1, 1), (3, 2)):
        q = queries(batch, q_len, heads, g)
        swa_slots = swa.slots((batch, q_len, 128), g, invalid=0.05)
        extra_slots = extra.slots((batch, q_len, 640), g, torch.int32, invalid=0.05)
        full = [
            (swa, swa_slots, torch.full((batch, q_len), 128, dtype=torch.int32, device=DEVICE)),
            (extra, extra_slots, torch.full((batch, q_len), 10**6, dtype=torch.int64, device=DEVICE)),
        ]
        bare = [(swa, swa_slots, None), (extra, extra_slots, None)]
        want = exact(q, bare, sinks=sinks)
        for name in [n for n, b in decode.BACKENDS.items() if b.supports(gpu.capability)]:
            for parts in (1, 7, 40):
                library = cut(name, parts)
                got, bare_got = run(q, full, sinks=sinks, library=library), run(q, bare, sinks=sinks, library=library)
                what = f"{name}, batch {batch}, q_len {q_len}, cut {parts} ways"
                assert bits_equal(got[0], bare_got[0]) and bits_equal(got[1], bare_got[1]), what
                check(bare_got, want, what)
            library = nvfp4_mla.KernelLibrary(decode_backend=name)
            for pools in (full, bare):
                what = f"{name}, batch {batch}, q_len {q_len}, lengths {pools[0][2] is not None}"
                check(run(q, pools, sinks=sinks, library=library), want, what)


def test_few_rows_without_lengths_are_dealt_like_full_lengths(seed):
    """Where the width split keeps whole rows but a whole-rows block would have little work (4 rows
    of 128 heads over 128 + 1,024 entries: 1.1 tiles a block on 132 SMs), a call without lengths
    deals its rows in half rows as the scheduler deals a call with lengths, which takes half rows
    there too: with every entry live the two calls walk the same list, so they give the same bits."""
    gpu = device_info(torch.cuda.current_device())
    if not decode.BACKENDS["wgmma_sm90"].supports(gpu.capability):
        pytest.skip(f"the wgmma kernel runs on sm_90 only, this GPU is {gpu.arch}")
    g = torch.Generator().manual_seed(seed)
    heads, batch, k_extra = 128, 4, 1024
    swa, extra = Pool(16, 64, g), Pool(32, 64, g)
    q = queries(batch, 1, heads, g)
    sinks = torch.randn(heads, generator=g).to(DEVICE)
    swa_slots = swa.slots((batch, 1, 128), g, invalid=0.05)
    extra_slots = extra.slots((batch, 1, k_extra), g, torch.int32, invalid=0.05)
    bare = [(swa, swa_slots, None), (extra, extra_slots, None)]
    full = [
        (swa, swa_slots, torch.full((batch, 1), 128, dtype=torch.int32, device=DEVICE)),
        (extra, extra_slots, torch.full((batch, 1), k_extra, dtype=torch.int32, device=DEVICE)),
    ]
    library = nvfp4_mla.KernelLibrary()
    plan = decode.plan(library, gpu.index, heads, batch, 128, k_extra, lengths=False)
    if gpu.sms == 132:
        assert (plan.backend, plan.dim_parts, plan.num_splits, plan.parts) == ("wgmma_sm90", 2, 1, 33)
    tiles = [decode_scheduler.live_tiles(128, k_extra, plan.tile_tokens)] * batch
    want_list = decode_scheduler.schedule(tiles, plan.parts, *plan.schedule.costs).ints()
    assert plan.work is not None and plan.work.tolist() == want_list
    got, with_lengths = run(q, bare, sinks=sinks, library=library), run(q, full, sinks=sinks, library=library)
    assert bits_equal(got[0], with_lengths[0]) and bits_equal(got[1], with_lengths[1])
    check(got, exact(q, bare, sinks=sinks), "4 rows of 128 heads dealt in half rows")


@pytest.mark.parametrize("heads", [16, 128])
def test_two_streams_at_once_and_two_graphs_in_turn(backend, seed, heads):
    """A call's only state past its launch is its workspace (from torch's caching allocator, on
    the call's stream) read by its combine kernel. Two call sets with rows cut between parts:
    queued on two streams at once (behind a sleeping kernel each, so that the GPU runs both
    streams' calls together), and captured as two graphs replayed in turn without a
    synchronisation between them, give the bits of the same calls made one at a time."""
    g = torch.Generator().manual_seed(seed)
    pool = Pool(16, 64, g)
    cases = [(queries(1, 2, heads, g), pool.slots((1, 2, 640), g, invalid=0.05)) for _ in range(2)]
    plan = plan_of(cases[0][0], [(pool, cases[0][1], None)], backend)
    assert plan.combine is not None, "the calls must have a workspace"

    def call(q, slots):
        return nvfp4_mla.sparse_mla_decode(q, pool.cache, slots, sm_scale=SM_SCALE, library=backend)

    want = []
    for q, slots in cases:
        want.append(call(q, slots))
        torch.cuda.synchronize()
    check(want[0], exact(cases[0][0], [(pool, cases[0][1], None)]), f"heads {heads}, one at a time")

    def same(got, expected, what):
        assert bits_equal(got[0], expected[0]) and bits_equal(got[1], expected[1]), what

    main = torch.cuda.current_stream()
    streams = [torch.cuda.Stream() for _ in cases]
    torch.cuda._sleep(10_000_000)  # about 5 ms: the host queues every call meanwhile, and both streams start together
    for stream in streams:
        stream.wait_stream(main)
    results: list[list] = [[] for _ in cases]
    for _ in range(8):  # the streams' calls queued in turn
        for stream, (q, slots), calls in zip(streams, cases, results):
            with torch.cuda.stream(stream):
                calls.append(call(q, slots))
    for stream in streams:
        main.wait_stream(stream)
    torch.cuda.synchronize()
    for i, calls in enumerate(results):
        for j, got in enumerate(calls):
            same(got, want[i], f"stream {i}, call {j}")

    graphs = [captured(lambda q=q, slots=slots: call(q, slots)) for q, slots in cases]
    for _ in range(3):
        for graph, _ in graphs:
            graph.replay()
    torch.cuda.synchronize()
    for i, (_, got) in enumerate(graphs):
        same(got, want[i], f"graph {i}")


@pytest.mark.parametrize("batch_invariant", [None, True])
def test_torch_compile_matches_eager(seed, batch_invariant):
    torch._dynamo.reset()
    g = torch.Generator().manual_seed(seed)
    pool = Pool(8, 64, g)
    q = queries(2, 1, 32, g)
    slots = pool.slots((2, 1, 90), g, invalid=0.1)

    def step(q, cache, slots):
        out, lse = nvfp4_mla.sparse_mla_decode(q, cache, slots, sm_scale=SM_SCALE, batch_invariant=batch_invariant)
        return out * 2, lse

    compiled = torch.compile(step, fullgraph=True)
    got, want = compiled(q, pool.cache, slots), step(q, pool.cache, slots)
    assert bits_equal(got[0], want[0]) and bits_equal(got[1], want[1])
