"""The reference sparse MLA decode (nvfp4_mla.reference.sparse_mla_decode) against a dense float64
computation on the BF16 rows: rows on the NVFP4 grid are stored exactly, so the dense side needs
no reader. Covered: lengths (clamped), invalid slots, the sink, two pools, lonely rows, NaN records
in masked positions, validation."""

from __future__ import annotations

import math

import pytest
import torch

from nvfp4_mla import abi, reference, validation
from nvfp4_mla.testing import flat_bytes, make_cache

decode = reference.sparse_mla_decode
SM_SCALE = abi.HEAD_DIM**-0.5
OUT_RTOL = 2.0**-8  # BF16 rounding of out (2^-9) plus fp32 on the way
LSE_RTOL = 2.0**-23


def grid_rows(n: int, g: torch.Generator) -> torch.Tensor:
    """BF16 rows that NVFP4 stores exactly: every group is E2M1 values times 2^e with one +-6."""
    signed = torch.tensor([*reference.E2M1_VALUES, *(-v for v in reference.E2M1_VALUES)])
    groups = signed[torch.randint(0, 16, (n, abi.NUM_GROUPS, abi.GROUP_SIZE), generator=g)]
    spot = torch.randint(0, abi.GROUP_SIZE, (n, abi.NUM_GROUPS, 1), generator=g)
    groups.scatter_(2, spot, 6.0 * torch.sign(torch.randn(n, abi.NUM_GROUPS, 1, generator=g)))
    groups = groups * torch.exp2(torch.randint(-6, 1, (n, abi.NUM_GROUPS, 1), generator=g).float())
    return torch.cat((groups.view(n, abi.NOPE_DIM), torch.randn(n, abi.ROPE_DIM, generator=g)), 1).to(torch.bfloat16)


class Pool:
    """A cache holding grid rows at every slot, and the same rows as a table for the dense side."""

    def __init__(self, num_pages: int, page_size: int, layout: str, pad: int, g: torch.Generator):
        self.cache = make_cache(num_pages, page_size, layout, pad)
        self.capacity = num_pages * page_size
        self.table = grid_rows(self.capacity, g)
        reference.nvfp4_quantize_append_sparse_mla_cache(self.table, torch.arange(self.capacity), self.cache)

    def slots(self, batch: int, q_len: int, k: int, g: torch.Generator, dtype=torch.int64) -> torch.Tensor:
        """Random valid slots, about one in six replaced by an invalid one."""
        slots = torch.randint(0, self.capacity, (batch, q_len, k), generator=g)
        bad_values = torch.tensor([-1, -7, self.capacity, self.capacity + 5, 2**31 - 1, -(2**31)])
        bad = torch.rand(batch, q_len, k, generator=g) < 1 / 6
        slots = torch.where(bad, bad_values[torch.randint(0, len(bad_values), (batch, q_len, k), generator=g)], slots)
        return slots.to(dtype)

    def poison(self, slot: int) -> None:
        """Makes the record at ``slot`` read as NaN (E4M3 NaN scales) in the cache and the table."""
        geometry = validation.check_cache(self.cache)
        _, scales = abi.record_views(self.cache, geometry)
        page, entry = divmod(slot, geometry.page_size)
        scales[page, entry, : abi.NUM_GROUPS] = 0x7F
        self.table[slot, : abi.NOPE_DIM] = math.nan


def dense(q, pools, sm_scale, sinks=None):
    """float64 attention of each query row over the BF16 rows of its live entries, picked one by one."""
    batch, q_len, heads, _ = q.shape
    out = torch.zeros(batch, q_len, heads, abi.HEAD_DIM, dtype=torch.float64)
    lse = torch.full((batch, q_len, heads), math.inf, dtype=torch.float64)
    for b in range(batch):
        for i in range(q_len):
            keys = []
            for pool, slots, lens in pools:
                k = slots.shape[-1]
                count = k if lens is None else min(max(int(lens[b, i]), 0), k)
                keys += [pool.table[s] for s in slots[b, i, :count].tolist() if 0 <= s < pool.capacity]
            if not keys:
                continue
            rows = torch.stack(keys).double()
            scores = q[b, i].double() @ rows.T * sm_scale
            lse[b, i] = torch.logsumexp(scores, dim=-1)
            o = torch.softmax(scores, dim=-1) @ rows
            if sinks is not None:
                o = o / (1 + torch.exp(sinks.double() - lse[b, i]))[:, None]
            out[b, i] = o
    return out, lse


def assert_close(got, want):
    out, lse = got
    want_out, want_lse = want
    assert out.dtype == torch.bfloat16 and lse.dtype == torch.float32
    assert out.shape == want_out.shape and lse.shape == want_lse.shape
    err = (out.double() - want_out).abs()
    bound = OUT_RTOL * want_out.abs() + 1e-30
    assert (err <= bound).all(), f"out: max excess {(err - bound).max().item():.3g}"
    finite = torch.isfinite(want_lse)
    assert torch.equal(lse[~finite], want_lse[~finite].float())
    lse_err = (lse[finite].double() - want_lse[finite]).abs()
    assert (lse_err <= LSE_RTOL * want_lse[finite].abs() + 1e-12).all(), f"lse: max error {lse_err.max().item():.3g}"


def queries(batch, q_len, heads, g):
    return (torch.randn(batch, q_len, heads, abi.HEAD_DIM, generator=g) * 2).to(torch.bfloat16)


# ------------------------------------------------------------------ against the dense computation


@pytest.mark.parametrize("slot_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize(("layout", "pad"), [("3D", 0), ("HND", 32), ("NHD", 0)])
def test_one_pool_with_lengths_and_sinks(seed, slot_dtype, layout, pad):
    g = torch.Generator().manual_seed(seed)
    pool = Pool(5, 16, layout, pad, g)
    batch, q_len, heads, k = 2, 3, 4, 24
    q = queries(batch, q_len, heads, g)
    slots = pool.slots(batch, q_len, k, g, slot_dtype)
    lens = torch.randint(-3, k + 4, (batch, q_len), generator=g, dtype=torch.int32)
    sinks = torch.randn(heads, generator=g) * 3
    got = decode(q, pool.cache, slots, swa_lens=lens, sm_scale=SM_SCALE, sinks=sinks)
    assert_close(got, dense(q, [(pool, slots, lens)], SM_SCALE, sinks))
    got = decode(q, pool.cache, slots, sm_scale=SM_SCALE)
    assert_close(got, dense(q, [(pool, slots, None)], SM_SCALE))


def test_lengths_are_clamped(seed):
    g = torch.Generator().manual_seed(seed)
    pool = Pool(2, 16, "3D", 0, g)
    q = queries(1, 4, 2, g)
    slots = torch.randint(0, 32, (1, 4, 8), generator=g)
    lens = torch.tensor([[-5, 0, 8, 1000]], dtype=torch.int32)
    out, lse = decode(q, pool.cache, slots, swa_lens=lens, sm_scale=SM_SCALE)
    full_out, full_lse = decode(q, pool.cache, slots, sm_scale=SM_SCALE)
    assert (out[0, :2] == 0).all() and (lse[0, :2] == math.inf).all()  # negative and zero: nothing
    assert torch.equal(out[0, 2:], full_out[0, 2:]) and torch.equal(lse[0, 2:], full_lse[0, 2:])  # k and above: all
    wide = torch.tensor([[-(2**40), 0, 8, 2**40]], dtype=torch.int64)  # int64 lengths, past the int32 range
    assert all(
        torch.equal(a, b) for a, b in zip(decode(q, pool.cache, slots, swa_lens=wide, sm_scale=SM_SCALE), (out, lse))
    )


def test_two_pools(seed):
    g = torch.Generator().manual_seed(seed)
    swa, extra = Pool(4, 8, "NHD", 16, g), Pool(3, 32, "HND", 0, g)
    batch, q_len, heads = 3, 2, 8
    q = queries(batch, q_len, heads, g)
    swa_slots, extra_slots = swa.slots(batch, q_len, 16, g), extra.slots(batch, q_len, 40, g, torch.int32)
    swa_lens = torch.randint(0, 17, (batch, q_len), generator=g, dtype=torch.int32)
    extra_lens = torch.randint(0, 41, (batch, q_len), generator=g, dtype=torch.int32)
    sinks = torch.randn(heads, generator=g)
    got = decode(
        q,
        swa.cache,
        swa_slots,
        swa_lens=swa_lens,
        extra_cache=extra.cache,
        extra_slots=extra_slots,
        extra_lens=extra_lens,
        sm_scale=0.1,
        sinks=sinks,
    )
    assert_close(got, dense(q, [(swa, swa_slots, swa_lens), (extra, extra_slots, extra_lens)], 0.1, sinks))
    # the softmax is joint: not the same as either pool alone
    alone = decode(q, swa.cache, swa_slots, swa_lens=swa_lens, sm_scale=0.1, sinks=sinks)
    both_live = (swa_lens > 0) & (extra_lens > 0)
    assert not torch.equal(alone[1][both_live], got[1][both_live]) or not both_live.any()


def test_lonely_rows(seed):
    """Nothing live (all slots invalid, or lengths 0 in every pool): out +0 and lse +inf, sinks or
    not (even an infinite sink); a row with something live in the other pool is not lonely."""
    g = torch.Generator().manual_seed(seed)
    swa, extra = Pool(2, 16, "3D", 0, g), Pool(2, 16, "3D", 0, g)
    q = queries(2, 2, 4, g)
    swa_slots = swa.slots(2, 2, 8, g)
    swa_slots[0, 0] = -1  # row (0, 0): invalid slots only
    swa_lens = torch.tensor([[8, 0], [8, 8]], dtype=torch.int32)  # row (0, 1): length 0
    extra_slots = extra.slots(2, 2, 4, g)
    extra_lens = torch.tensor([[0, 0], [4, 0]], dtype=torch.int32)
    for sinks in (None, torch.tensor([0.0, 5.0, math.inf, -math.inf])):
        out, lse = decode(
            q,
            swa.cache,
            swa_slots,
            swa_lens=swa_lens,
            extra_cache=extra.cache,
            extra_slots=extra_slots,
            extra_lens=extra_lens,
            sm_scale=SM_SCALE,
            sinks=sinks,
        )
        assert (out[0].view(torch.int16) == 0).all() and (lse[0] == math.inf).all()
        if sinks is None:
            assert torch.isfinite(lse[1]).all() and out[1].abs().sum() > 0
    extra_lens[0, 1] = 1
    extra_slots[0, 1, 0] = 3  # one valid entry in the extra pool only
    out, lse = decode(
        q,
        swa.cache,
        swa_slots,
        swa_lens=torch.zeros_like(swa_lens),
        extra_cache=extra.cache,
        extra_slots=extra_slots,
        extra_lens=extra_lens,
        sm_scale=SM_SCALE,
    )
    want = dense(q, [(swa, swa_slots, torch.zeros_like(swa_lens)), (extra, extra_slots, extra_lens)], SM_SCALE)
    assert_close((out, lse), want)
    assert torch.isfinite(lse[0, 1]).all()


def test_sink_factor(seed):
    """sink = -inf changes nothing; otherwise out is scaled by 1 / (1 + exp(sink - lse)), lse is not."""
    g = torch.Generator().manual_seed(seed)
    pool = Pool(2, 16, "3D", 0, g)
    q = queries(2, 1, 3, g)
    slots = torch.randint(0, 32, (2, 1, 12), generator=g)
    plain = decode(q, pool.cache, slots, sm_scale=SM_SCALE)
    none = decode(q, pool.cache, slots, sm_scale=SM_SCALE, sinks=torch.full((3,), -math.inf))
    assert torch.equal(plain[0].view(torch.int16), none[0].view(torch.int16)) and torch.equal(plain[1], none[1])
    sinks = plain[1][0, 0] + torch.tensor([0.0, math.log(3.0), 50.0])  # factors 1/2, 1/4, ~0 on batch 0
    out, lse = decode(q, pool.cache, slots, sm_scale=SM_SCALE, sinks=sinks)
    assert torch.equal(lse, plain[1])
    ratio = out[0, 0].double() / plain[0][0, 0].double()
    nonzero = plain[0][0, 0] != 0
    assert torch.allclose(ratio[0][nonzero[0]], torch.tensor(0.5, dtype=torch.float64), rtol=2**-7)
    assert torch.allclose(ratio[1][nonzero[1]], torch.tensor(0.25, dtype=torch.float64), rtol=2**-7)
    assert out[0, 0, 2].abs().max() < 1e-18


def test_masked_nan_records_never_leak(seed):
    """NaN records at masked positions (past the lengths, in either pool) leave the result as if
    they were absent; the same record at a live position turns its query row into NaN."""
    g = torch.Generator().manual_seed(seed)
    swa, extra = Pool(2, 16, "HND", 16, g), Pool(2, 8, "3D", 0, g)
    swa.poison(5)
    extra.poison(3)
    q = queries(2, 2, 4, g)
    swa_slots = torch.randint(6, 32, (2, 2, 10), generator=g)  # live part avoids the NaN record
    extra_slots = torch.randint(4, 16, (2, 2, 6), generator=g)
    swa_slots[..., 7:] = 5  # masked by the lengths below
    extra_slots[..., 2:] = 3
    swa_lens = torch.full((2, 2), 7, dtype=torch.int32)
    extra_lens = torch.full((2, 2), 2, dtype=torch.int32)
    args = dict(extra_cache=extra.cache, extra_slots=extra_slots, sm_scale=SM_SCALE, sinks=torch.randn(4, generator=g))
    out, lse = decode(q, swa.cache, swa_slots, swa_lens=swa_lens, extra_lens=extra_lens, **args)
    assert torch.isfinite(out).all() and torch.isfinite(lse).all()
    pools = [(swa, swa_slots, swa_lens), (extra, extra_slots, extra_lens)]
    assert_close((out, lse), dense(q, pools, SM_SCALE, args["sinks"]))
    # positive control: one more entry of row (1, 0) is live and it is the NaN record
    swa_lens[1, 0] = 8
    out, lse = decode(q, swa.cache, swa_slots, swa_lens=swa_lens, extra_lens=extra_lens, **args)
    assert (out[1, 0].view(torch.int16) == 0x7FC0).all() and (lse[1, 0].view(torch.int32) == 0x7FC00000).all()
    nan_row = torch.zeros(2, 2, dtype=torch.bool)
    nan_row[1, 0] = True
    assert torch.isfinite(out[~nan_row]).all()


# ------------------------------------------------------------------ validation


def _good():
    return dict(
        q=torch.zeros(2, 1, 4, 512, dtype=torch.bfloat16),
        swa_cache=make_cache(2, 8),
        swa_slots=torch.zeros(2, 1, 8, dtype=torch.int64),
        sm_scale=SM_SCALE,
    )


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (dict(q=torch.zeros(2, 1, 4, 512)), "q must have dtype torch.bfloat16"),
        (dict(q=torch.zeros(2, 4, 512, dtype=torch.bfloat16)), "q must be \\[batch, q_len, num_heads, 512\\]"),
        (dict(q=torch.zeros(2, 1, 4, 256, dtype=torch.bfloat16)), "q must be \\[batch, q_len, num_heads, 512\\]"),
        (dict(q=torch.zeros(2, 1, 4, 1024, dtype=torch.bfloat16)[..., :512]), "q must be contiguous"),
        (dict(q=torch.zeros(2, 1, 0, 512, dtype=torch.bfloat16)), "at least one head"),
        (dict(swa_cache=torch.zeros(2, 8, 384, dtype=torch.int8)), "swa_cache: cache must have dtype"),
        (dict(swa_slots=torch.zeros(2, 1, 8)), "swa_slots must have dtype torch.int32 or torch.int64"),
        (dict(swa_slots=torch.zeros(2, 8, dtype=torch.int64)), "swa_slots must be \\[batch, q_len, k\\]"),
        (dict(swa_slots=torch.zeros(3, 1, 8, dtype=torch.int64)), "swa_slots must be \\[batch, q_len, k\\]"),
        (dict(swa_slots=torch.zeros(2, 1, 0, dtype=torch.int64)), "at least one slot per query row"),
        (
            dict(swa_slots=torch.zeros(1, dtype=torch.int32).expand(2, 1, validation.decode.MAX_TABLE_WIDTH + 1)),
            "at most 16777216 slots per query row",
        ),
        (dict(swa_slots=torch.zeros(2, 1, 16, dtype=torch.int64)[..., ::2]), "swa_slots must be contiguous"),
        (dict(swa_lens=torch.zeros(2, 1, dtype=torch.int16)), "swa_lens must have dtype torch.int32 or torch.int64"),
        (dict(swa_lens=torch.zeros(2, dtype=torch.int32)), "swa_lens must be \\[batch, q_len\\]"),
        (dict(extra_cache=make_cache(1, 8)), "extra_cache and extra_slots come together"),
        (dict(extra_slots=torch.zeros(2, 1, 4, dtype=torch.int64)), "extra_cache and extra_slots come together"),
        (dict(extra_lens=torch.zeros(2, 1, dtype=torch.int32)), "extra_lens needs extra_cache and extra_slots"),
        (
            dict(extra_cache=make_cache(1, 8), extra_slots=torch.zeros(1, 1, 4, dtype=torch.int64)),
            "extra_slots must be \\[batch, q_len, k\\]",
        ),
        (dict(sm_scale=None), "sm_scale must be a finite real number"),
        (dict(sm_scale=math.nan), "sm_scale must be a finite real number"),
        (dict(sm_scale=torch.tensor(0.1)), "sm_scale must be a finite real number"),
        (dict(sinks=torch.zeros(4, dtype=torch.bfloat16)), "sinks must have dtype torch.float32"),
        (dict(sinks=torch.zeros(5)), "sinks must be a contiguous \\[num_heads\\] = \\[4\\]"),
        (dict(swa_slots=torch.zeros(2, 1, 8, dtype=torch.int64, device="meta")), "same CUDA device"),
        (dict(sinks=torch.zeros(4, device="meta")), "same CUDA device"),
        (dict(q=[[0.0]]), "q must be a torch.Tensor"),
    ],
    ids=lambda x: x if isinstance(x, str) else None,
)
def test_argument_checks(change, message):
    args = _good()
    args.update(change)
    q, cache, slots = args.pop("q"), args.pop("swa_cache"), args.pop("swa_slots")
    with pytest.raises(ValueError, match=message):
        decode(q, cache, slots, **args)


# ------------------------------------------------------------------ out=


def test_out_is_filled_and_returned(seed):
    """out= gives the values of the call without it, in out (every element, over a dirty out),
    and returns out itself; lse is the same."""
    g = torch.Generator().manual_seed(seed)
    swa, extra = Pool(4, 8, "NHD", 16, g), Pool(3, 32, "HND", 0, g)
    batch, q_len, heads = 3, 2, 8
    q = queries(batch, q_len, heads, g)
    args = dict(
        swa_lens=torch.randint(-1, 17, (batch, q_len), generator=g, dtype=torch.int32),
        extra_cache=extra.cache,
        extra_slots=extra.slots(batch, q_len, 40, g, torch.int32),
        sm_scale=SM_SCALE,
        sinks=torch.randn(heads, generator=g),
    )
    swa_slots = swa.slots(batch, q_len, 16, g)
    want = decode(q, swa.cache, swa_slots, **args)
    out = torch.full(q.shape, math.nan, dtype=torch.bfloat16)
    got = decode(q, swa.cache, swa_slots, out=out, **args)
    assert got[0] is out
    assert torch.equal(out.view(torch.int16), want[0].view(torch.int16))
    assert torch.equal(got[1].view(torch.int32), want[1].view(torch.int32))


def test_out_of_an_empty_batch():
    args = _good()
    q = torch.zeros(0, 1, 4, 512, dtype=torch.bfloat16)
    out = torch.empty_like(q)
    got, lse = decode(q, args["swa_cache"], torch.zeros(0, 1, 8, dtype=torch.int64), sm_scale=SM_SCALE, out=out)
    assert got is out and lse.shape == (0, 1, 4)


@pytest.mark.parametrize(
    ("make_out", "message"),
    [
        (lambda q: torch.empty((*q.shape[:-1], 256), dtype=torch.bfloat16), "out must have q's shape"),
        (lambda q: torch.empty(q.shape[1:], dtype=torch.bfloat16), "out must have q's shape"),
        (lambda q: torch.empty(q.shape), "out must have dtype torch.bfloat16"),
        (lambda q: torch.empty((*q.shape[:-1], 1024), dtype=torch.bfloat16)[..., ::2], "out must be contiguous"),
        (lambda q: torch.empty(q.shape, dtype=torch.bfloat16, device="meta"), "same CUDA device"),
        (lambda q: q, "q overlaps out"),
        (lambda q: [0.0], "out must be a torch.Tensor"),
    ],
    ids=["last dim", "rank", "dtype", "strided", "device", "is q", "not a tensor"],
)
def test_bad_out_is_refused_before_writing(make_out, message):
    """A wrong out raises ValueError like the fused entry's, and nothing is written (a valid-shaped
    but refused out keeps its bytes)."""
    args = _good()
    q, cache, slots = args.pop("q"), args.pop("swa_cache"), args.pop("swa_slots")
    out = make_out(q)
    before = flat_bytes(out) if isinstance(out, torch.Tensor) and out.device.type == "cpu" else None
    with pytest.raises(ValueError, match=message):
        decode(q, cache, slots, out=out, **args)
    if before is not None:
        assert torch.equal(flat_bytes(out), before)


# ------------------------------------------------------------------ CUDA tensors


@pytest.mark.gpu
def test_same_result_on_cuda(seed):
    g = torch.Generator().manual_seed(seed)
    swa, extra = Pool(4, 16, "HND", 16, g), Pool(2, 32, "3D", 0, g)
    batch, q_len, heads = 2, 2, 16
    q = queries(batch, q_len, heads, g)
    swa_slots, extra_slots = swa.slots(batch, q_len, 64, g), extra.slots(batch, q_len, 32, g, torch.int32)
    swa_lens = torch.tensor([[64, 0], [10, 64]], dtype=torch.int32)
    extra_lens = torch.tensor([[0, 0], [32, 5]], dtype=torch.int32)
    sinks = torch.randn(heads, generator=g)
    args = [q, swa.cache, swa_slots, swa_lens, extra.cache, extra_slots, extra_lens, sinks]
    cpu = decode(
        *args[:3],
        swa_lens=swa_lens,
        extra_cache=args[4],
        extra_slots=extra_slots,
        extra_lens=extra_lens,
        sm_scale=SM_SCALE,
        sinks=sinks,
    )
    dev = [a.cuda() for a in args]
    gpu = decode(
        *dev[:3],
        swa_lens=dev[3],
        extra_cache=dev[4],
        extra_slots=dev[5],
        extra_lens=dev[6],
        sm_scale=SM_SCALE,
        sinks=dev[7],
    )
    assert gpu[0].is_cuda and gpu[1].is_cuda
    assert_close((gpu[0].cpu(), gpu[1].cpu()), (cpu[0].double(), cpu[1].double()))
