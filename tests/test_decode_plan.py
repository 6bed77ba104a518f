"""``plan_sparse_mla_decode``: a decode step's plan, made once and passed to every call of the step.

Without a GPU: the plan's checks (its arguments, and a call's shapes, device and length tensors
against the plan's), the reference on CPU tensors with a plan, and its refusal under
torch.compile. On the GPU, on every backend of the GPU: a plan reused by many calls gives the
bits of the one-call form (the same work list), ``update`` follows new lengths, also replayed
from a captured graph whose lengths change, two streams at once on one plan, and the refusals.
"""

from __future__ import annotations

import pytest
import torch
from test_decode_gpu import SM_SCALE, Pool, _backends_here, bits_equal, captured, check, exact, lengths, queries
from test_decode_scheduler import late_copy

import nvfp4_mla
from nvfp4_mla.ops import decode

BF16 = torch.bfloat16


def cpu_case(g, batch=2, q_len=3, heads=4, k=40):
    cache = nvfp4_mla.reference.nvfp4_quantize_pack_sparse_mla_cache(torch.randn(4, 64, 512, generator=g).to(BF16))
    q = torch.randn(batch, q_len, heads, 512, generator=g).to(BF16)
    slots = torch.randint(0, 256, (batch, q_len, k), generator=g)
    lens = torch.randint(0, k + 1, (batch, q_len), generator=g)
    return cache, q, slots, lens


def test_a_plan_on_cpu_tensors_runs_the_reference(seed):
    g = torch.Generator().manual_seed(seed)
    cache, q, slots, lens = cpu_case(g)
    plan = nvfp4_mla.plan_sparse_mla_decode(4, slots, swa_lens=lens)
    assert (plan.parts, plan.workspace_bytes, plan.device) == (0, 0, -1)
    got = nvfp4_mla.sparse_mla_decode(q, cache, slots, swa_lens=lens, sm_scale=SM_SCALE, plan=plan)
    want = nvfp4_mla.reference.sparse_mla_decode(q, cache, slots, swa_lens=lens, sm_scale=SM_SCALE)
    assert bits_equal(got[0], want[0]) and bits_equal(got[1], want[1])
    plan.update()  # nothing to do on the CPU


def test_a_call_must_be_the_plans(seed):
    """Another batch, head count, table width or other length tensors: refused with the reason."""
    g = torch.Generator().manual_seed(seed)
    cache, q, slots, lens = cpu_case(g)
    plan = nvfp4_mla.plan_sparse_mla_decode(4, slots, swa_lens=lens)
    call = nvfp4_mla.sparse_mla_decode
    with pytest.raises(ValueError, match="plan= was made for another call"):
        call(q[:1], cache, slots[:1], swa_lens=lens[:1], sm_scale=SM_SCALE, plan=plan)
    with pytest.raises(ValueError, match="plan= was made for another call"):
        call(q[:, :, :2].contiguous(), cache, slots, swa_lens=lens, sm_scale=SM_SCALE, plan=plan)
    with pytest.raises(ValueError, match="plan= was made for another call"):
        call(q, cache, slots[..., :20].contiguous(), swa_lens=lens, sm_scale=SM_SCALE, plan=plan)
    for other in (lens.clone(), None):
        with pytest.raises(ValueError, match="plan= reads the length tensors it was made with"):
            call(q, cache, slots, swa_lens=other, sm_scale=SM_SCALE, plan=plan)
    with pytest.raises(ValueError, match=r"plan must come from nvfp4_mla\.plan_sparse_mla_decode"):
        call(q, cache, slots, swa_lens=lens, sm_scale=SM_SCALE, plan="plan")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="plan= carries the library it was made with"):
        call(q, cache, slots, swa_lens=lens, sm_scale=SM_SCALE, plan=plan, library=nvfp4_mla.KernelLibrary())


def test_batch_invariant_is_the_plans(seed):
    """A plan made with batch_invariant keeps it (the calls through it need not repeat it); a call
    that asks for the other one, or a value that is not a bool, is refused. On CPU tensors the
    reference runs (it depends on no batch)."""
    g = torch.Generator().manual_seed(seed)
    cache, q, slots, lens = cpu_case(g)
    call = nvfp4_mla.sparse_mla_decode
    want = nvfp4_mla.reference.sparse_mla_decode(q, cache, slots, swa_lens=lens, sm_scale=SM_SCALE)
    for invariant in (False, True):
        plan = nvfp4_mla.plan_sparse_mla_decode(4, slots, swa_lens=lens, batch_invariant=invariant)
        assert plan.batch_invariant is invariant and f"batch_invariant={invariant}" in repr(plan)
        for asked in (None, invariant):
            got = call(q, cache, slots, swa_lens=lens, sm_scale=SM_SCALE, plan=plan, batch_invariant=asked)
            assert bits_equal(got[0], want[0]) and bits_equal(got[1], want[1])
        with pytest.raises(ValueError, match=f"batch_invariant={not invariant} but plan= was made with"):
            call(q, cache, slots, swa_lens=lens, sm_scale=SM_SCALE, plan=plan, batch_invariant=not invariant)
    got = call(q, cache, slots, swa_lens=lens, sm_scale=SM_SCALE, batch_invariant=True)
    assert bits_equal(got[0], want[0]) and bits_equal(got[1], want[1])
    with pytest.raises(ValueError, match="batch_invariant must be a bool or None, got 1"):
        call(q, cache, slots, swa_lens=lens, sm_scale=SM_SCALE, batch_invariant=1)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="batch_invariant must be a bool, got None"):
        nvfp4_mla.plan_sparse_mla_decode(4, slots, swa_lens=lens, batch_invariant=None)  # type: ignore[arg-type]


ARGUMENT_CASES = {
    "no heads": (lambda slots, lens: (0, {}), "num_heads must be a positive int"),
    "a bool for heads": (lambda slots, lens: (True, {}), "num_heads must be a positive int"),
    "extra lengths alone": (lambda slots, lens: (4, {"extra_lens": lens}), "extra_lens needs extra_slots"),
    "lengths of another batch": (lambda slots, lens: (4, {"swa_lens": lens[:1]}), r"swa_lens must be \[batch, q_len\]"),
    "extra table of another batch": (
        lambda slots, lens: (4, {"extra_slots": slots[:1]}),
        r"extra_slots must be \[batch, q_len, k\]",
    ),
    "float lengths": (lambda slots, lens: (4, {"swa_lens": lens.float()}), "swa_lens must have dtype"),
    "a 2-D table": (lambda slots, lens: (4, {"swa_slots": slots[0]}), r"swa_slots must be \[batch, q_len, k\]"),
}


@pytest.mark.parametrize("case", ARGUMENT_CASES)
def test_a_plans_arguments_are_checked(seed, case):
    g = torch.Generator().manual_seed(seed)
    _, _, slots, lens = cpu_case(g)
    make, message = ARGUMENT_CASES[case]
    num_heads, kwargs = make(slots, lens)
    kwargs.setdefault("swa_slots", slots)
    with pytest.raises(ValueError, match=message):
        nvfp4_mla.plan_sparse_mla_decode(num_heads, **kwargs)


def test_torch_compile_refuses_a_plan(seed):
    g = torch.Generator().manual_seed(seed)
    cache, q, slots, lens = cpu_case(g)
    plan = nvfp4_mla.plan_sparse_mla_decode(4, slots, swa_lens=lens)

    def step(q):
        return nvfp4_mla.sparse_mla_decode(q, cache, slots, swa_lens=lens, sm_scale=SM_SCALE, plan=plan)

    with pytest.raises(Exception, match="plan= is for eager calls"):
        torch.compile(step, fullgraph=True, backend="eager")(q)


# ---------------------------------------------------------------- on the GPU


def gpu_case(g, batch, heads, k_extra=300):
    swa, extra = Pool(16, 64, g), Pool(64, 64, g)
    swa_slots = swa.slots((batch, 1, 128), g, invalid=0.1)
    extra_slots = extra.slots((batch, 1, k_extra), g, torch.int32, invalid=0.1)
    swa_lens, extra_lens = lengths(batch, 1, 128, g), lengths(batch, 1, k_extra, g, torch.int64)
    q = queries(batch, 1, heads, g)
    sinks = torch.randn(heads, generator=g).to("cuda")
    return q, [(swa, swa_slots, swa_lens), (extra, extra_slots, extra_lens)], sinks


def call(q, pools, sinks, **kwargs):
    (swa, swa_slots, swa_lens), (extra, extra_slots, extra_lens) = pools
    return nvfp4_mla.sparse_mla_decode(
        q,
        swa.cache,
        swa_slots,
        swa_lens=swa_lens,
        extra_cache=extra.cache,
        extra_slots=extra_slots,
        extra_lens=extra_lens,
        sm_scale=SM_SCALE,
        sinks=sinks,
        **kwargs,
    )


def plan_of(pools, heads, library=None):
    (_, swa_slots, swa_lens), (_, extra_slots, extra_lens) = pools
    return nvfp4_mla.plan_sparse_mla_decode(
        heads, swa_slots, swa_lens=swa_lens, extra_slots=extra_slots, extra_lens=extra_lens, library=library
    )


def libraries():
    return [None, *(nvfp4_mla.KernelLibrary(decode_backend=name) for name in _backends_here())]


@pytest.mark.gpu
@pytest.mark.parametrize("heads", [16, 64, 128])
def test_a_plan_serves_many_calls_with_the_bits_of_one_call(seed, heads):
    """The plan's work list is the one a call without it writes: the same bits, call after call,
    on every backend of this GPU; and within the tolerances of the float64 answer."""
    g = torch.Generator().manual_seed(seed)
    q, pools, sinks = gpu_case(g, 40, heads)
    want = exact(q, pools, sinks=sinks)
    for library in libraries():
        plan = plan_of(pools, heads, library)
        alone = call(q, pools, sinks, library=plan.library)
        for _ in range(3):  # layers of a step
            got = call(q, pools, sinks, plan=plan)
            assert bits_equal(got[0], alone[0]) and bits_equal(got[1], alone[1]), repr(plan)
        check(got, want, f"a plan, heads {heads}, {plan!r}")


@pytest.mark.gpu
@pytest.mark.parametrize("rows", [1, 40, 2000])
def test_a_call_with_lengths_deals_the_models_list_in_its_attention(monkeypatch, seed, rows):
    """Without a step's plan, a call with lengths launches no scheduler where its attention blocks
    hold a thread a part boundary: their block 0 writes the CPU model's list at the start of the
    workspace (past 1,536 rows, 4 a thread of 384, a thread loads its rows in turn), and the
    outputs are those of a plan's list. With more parts than an attention block's threads, the
    scheduler deals it."""
    from nvfp4_mla.ops import decode_launch, decode_planner
    from nvfp4_mla.ops import decode_scheduler as ds

    workspaces: list[torch.Tensor] = []
    new_output = decode_launch.new_output

    def recorded(*args):
        workspaces.append(new_output(*args))
        return workspaces[-1]

    scheduled: list[int] = []
    launch_scheduler = decode_launch.launch_scheduler

    def counted(*args):
        scheduled.append(1)
        launch_scheduler(*args)

    monkeypatch.setattr(decode_launch, "new_output", recorded)
    monkeypatch.setattr(decode_launch, "launch_scheduler", counted)
    g = torch.Generator().manual_seed(seed)
    mma = "mma_sync" in _backends_here()
    for heads in (16, 64, 128):
        q, pools, sinks = gpu_case(g, rows, heads)
        (_, swa_slots, swa_lens), (_, extra_slots, extra_lens) = pools
        k_swa, k_extra = swa_slots.shape[2], extra_slots.shape[2]
        many_parts = [nvfp4_mla.KernelLibrary(decode_backend="mma_sync", decode_parts=300)] if mma else []
        for library in [*libraries(), *many_parts]:
            lib = library or nvfp4_mla.KernelLibrary()
            launches = decode_planner.plan(lib, q.get_device(), heads, rows, k_swa, k_extra)
            workspaces.clear()
            scheduled.clear()
            got = call(q, pools, sinks, library=lib)
            assert len(scheduled) == int(not launches.own_list), repr(launches)
            assert launches.own_list == (launches.parts < launches.attend.threads)
            tiles = ds.row_tiles(rows, k_swa, swa_lens, k_extra, extra_lens, launches.tile_tokens)
            want = ds.schedule(tiles, launches.parts, *launches.schedule.costs).ints()
            (workspace,) = [w for w in workspaces if w.shape == (launches.workspace,)]
            assert workspace[: len(want)].view(torch.int32).tolist() == want, (heads, launches.backend)
            planned = call(q, pools, sinks, plan=plan_of(pools, heads, lib))
            assert bits_equal(got[0], planned[0]) and bits_equal(got[1], planned[1]), (heads, launches.backend)


@pytest.mark.gpu
def test_a_plan_without_lengths_holds_the_hosts_list(seed):
    g = torch.Generator().manual_seed(seed)
    q, pools, sinks = gpu_case(g, 3, 128)
    pools = [(p, s, None) for p, s, _ in pools]
    plan = plan_of(pools, 128)
    if plan.parts:
        assert plan.launches is not None and plan.work is plan.launches.work  # kept alive by the plan
    got, alone = call(q, pools, sinks, plan=plan), call(q, pools, sinks)
    assert bits_equal(got[0], alone[0]) and bits_equal(got[1], alone[1])


@pytest.mark.gpu
@pytest.mark.parametrize("heads", [16, 128])
def test_update_follows_new_lengths_also_in_a_graph(seed, heads):
    """``update`` then the layers' calls, eagerly and replayed from one captured graph whose lengths
    change between replays (copied into the plan's tensors): each replay gives the bits of a call
    without a plan on those lengths."""
    g = torch.Generator().manual_seed(seed)
    q, pools, sinks = gpu_case(g, 64, heads)
    (_, _, swa_lens), (_, _, extra_lens) = pools
    for library in libraries():
        plan = plan_of(pools, heads, library)

        def step(plan=plan):
            plan.update()
            return call(q, pools, sinks, plan=plan)

        graph, (out, lse) = captured(step)
        for kind in ("zeros", "full", "one long", "random"):
            n = {"zeros": 0, "full": 300}.get(kind)
            new = torch.full((64, 1), n) if n is not None else torch.randint(0, 301, (64, 1), generator=g)
            if kind == "one long":
                new = torch.ones(64, 1, dtype=torch.int64)
                new[5] = 300
            extra_lens.copy_(new)
            swa_lens.copy_(torch.randint(0, 129, (64, 1), generator=g))
            graph.replay()
            eager = step()
            alone = call(q, pools, sinks, library=plan.library)
            for got in ((out, lse), eager):
                assert bits_equal(got[0], alone[0]) and bits_equal(got[1], alone[1]), f"{kind}, {plan!r}"
        check((out, lse), exact(q, pools, sinks=sinks), f"update in a graph, heads {heads}")


@pytest.mark.gpu
@pytest.mark.parametrize("rows", [40, 2000])
def test_lengths_written_late_by_the_kernel_before(monkeypatch, seed, rows):
    """The kernel before a call (or before ``update``) lets it launch, then writes new lengths:
    the list is the CPU model's of the new lengths and the outputs are the bits of a call on them,
    on every backend of this GPU. The attention blocks deal their list after their dependent-launch
    wait; the scheduler (``update``) deals it from the old lengths before its wait and again after
    it where its build keeps the rows' costs (4 rows a thread: both row counts here)."""
    from nvfp4_mla.ops import decode_launch, decode_planner
    from nvfp4_mla.ops import decode_scheduler as ds

    workspaces: list[torch.Tensor] = []
    new_output = decode_launch.new_output

    def recorded(*args):
        workspaces.append(new_output(*args))
        return workspaces[-1]

    monkeypatch.setattr(decode_launch, "new_output", recorded)
    g = torch.Generator().manual_seed(seed)
    for heads in (16, 64, 128):
        q, pools, sinks = gpu_case(g, rows, heads)
        (_, swa_slots, swa_lens), (_, extra_slots, extra_lens) = pools
        k_swa, k_extra = swa_slots.shape[2], extra_slots.shape[2]
        new, old = extra_lens.clone(), torch.zeros_like(extra_lens)
        for library in libraries():
            plan = plan_of(pools, heads, library)
            launches = decode_planner.plan(plan.library, q.get_device(), heads, rows, k_swa, k_extra)
            want_list, old_list = (
                ds.schedule(
                    ds.row_tiles(rows, k_swa, swa_lens, k_extra, lens, launches.tile_tokens),
                    launches.parts,
                    *launches.schedule.costs,
                ).ints()
                for lens in (new, old)
            )
            assert old_list != want_list  # a list dealt from the old lengths would show
            want = call(q, pools, sinks, library=plan.library)
            extra_lens.copy_(old)
            workspaces.clear()
            late_copy(extra_lens, new)  # the attention kernel comes next on the stream
            got = call(q, pools, sinks, library=plan.library)
            (workspace,) = [w for w in workspaces if w.shape == (launches.workspace,)]
            assert workspace[: len(want_list)].view(torch.int32).tolist() == want_list, (heads, launches.backend)
            extra_lens.copy_(old)
            late_copy(extra_lens, new)  # then the scheduler
            plan.update()
            assert plan.work is not None and plan.work.tolist() == want_list, (heads, launches.backend)
            updated = call(q, pools, sinks, plan=plan)
            for out, lse in (got, updated):
                assert bits_equal(out, want[0]) and bits_equal(lse, want[1]), (heads, launches.backend)


@pytest.mark.gpu
def test_one_plan_on_two_streams_at_once(seed):
    """The list is read-only and the partials come per call from each call's stream."""
    g = torch.Generator().manual_seed(seed)
    q, pools, sinks = gpu_case(g, 32, 128, 2000)
    q2 = queries(32, 1, 128, g)
    plan = plan_of(pools, 128)
    want = call(q, pools, sinks), call(q2, pools, sinks)
    streams = torch.cuda.Stream(), torch.cuda.Stream()
    results = []
    torch.cuda.synchronize()
    for _ in range(3):
        for stream, query in zip(streams, (q, q2)):
            with torch.cuda.stream(stream):
                results.append(call(query, pools, sinks, plan=plan))
    torch.cuda.synchronize()
    for i, got in enumerate(results):
        assert bits_equal(got[0], want[i % 2][0]) and bits_equal(got[1], want[i % 2][1])


@pytest.mark.gpu
def test_a_plan_of_another_device_or_lengths_is_refused(seed):
    g = torch.Generator().manual_seed(seed)
    q, pools, sinks = gpu_case(g, 4, 64)
    cpu_pools = [(p, s.cpu(), None if n is None else n.cpu()) for p, s, n in pools]
    with pytest.raises(ValueError, match="plan= was made for another call"):
        call(q, pools, sinks, plan=plan_of(cpu_pools, 64))  # the CPU's: lengths differ too, the device first
    plan = plan_of(pools, 64)
    (swa, swa_slots, swa_lens), extra = pools
    with pytest.raises(ValueError, match="plan= reads the length tensors it was made with"):
        call(q, [(swa, swa_slots, swa_lens.clone()), extra], sinks, plan=plan)
    if torch.cuda.device_count() > 1:
        with pytest.raises(ValueError):
            call(q.to("cuda:1"), pools, sinks, plan=plan)


@pytest.mark.gpu
def test_a_stale_plan_reads_within_the_tables(seed):
    """Lengths that grew without an update: the rows' tiles past the list are not attended (wrong
    outputs, by contract), and nothing is read outside the tables (the sanitizers' run of this
    test checks the reads); every output finite."""
    g = torch.Generator().manual_seed(seed)
    q, pools, sinks = gpu_case(g, 8, 64)
    (_, _, swa_lens), (_, _, extra_lens) = pools
    swa_lens.zero_()
    extra_lens.fill_(1)
    plan = plan_of(pools, 64)
    swa_lens.fill_(128)
    extra_lens.fill_(300)
    out, lse = call(q, pools, sinks, plan=plan)
    torch.cuda.synchronize()
    assert torch.isfinite(out.float()).all() and torch.isfinite(lse).all()
    assert plan.parts <= decode.MAX_LIST_PARTS
