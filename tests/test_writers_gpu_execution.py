"""docs/format.md section 7, the execution contract: CUDA-graph capture and replay, torch's current
stream, tensors on a GPU that is not the current one, no host synchronisation, no allocation but
the output, one launch per call (none for empty work), the caller's device left alone.

Results are compared byte for byte with the reference through ``nvfp4_mla.testing``.
"""

from __future__ import annotations

import threading
import time

import pytest
import torch

import nvfp4_mla
from nvfp4_mla import abi, config, jit, kernel_cache
from nvfp4_mla.testing import (
    ARG_NAMES,
    CANARY,
    ENTRIES,
    Case,
    args_of,
    assert_same,
    check,
    clone,
    make_inputs,
    run_reference,
    storage_bytes,
)

pytestmark = pytest.mark.gpu
DEVICE = "cuda"

SLEEP_S = 0.5  # GPU spin that a call must not wait for


@pytest.fixture(autouse=True)
def no_debug_check(monkeypatch):
    """NVFP4_MLA_CHECK=1 synchronises by design; these tests need the default path."""
    monkeypatch.setattr(config, "DEBUG_CHECKS", False)


def call(case: Case, args):
    return getattr(nvfp4_mla, ENTRIES[case.entry])(*args, **case.kwargs())


def warm_up(case: Case, args) -> None:
    """One call on copies: compiles and loads the kernel, and leaves the output's block cached."""
    call(case, [clone(a) for a in args])
    torch.cuda.synchronize()


_cycles_per_second = None


def gpu_sleep(seconds: float) -> None:
    """Queues a spin kernel of about ``seconds`` on the current stream."""
    global _cycles_per_second
    if _cycles_per_second is None:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda._sleep(1000)
        start.record()
        torch.cuda._sleep(20_000_000)
        end.record()
        end.synchronize()
        _cycles_per_second = 20_000_000 / (start.elapsed_time(end) / 1e3)
    torch.cuda._sleep(int(seconds * _cycles_per_second))


def without_sync(fn):
    """``fn()`` under torch's sync debug mode "error": a synchronising torch op in it raises."""
    torch.cuda.set_sync_debug_mode("error")
    try:
        return fn()
    finally:
        torch.cuda.set_sync_debug_mode("default")


def allocation_delta(make):
    """(growth of torch.cuda.memory_allocated while ``make()``'s result is alive, peak growth)."""
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    result = make()
    now, peak = torch.cuda.memory_allocated() - base, torch.cuda.max_memory_allocated() - base
    del result
    return now, peak


ONE_OF_EACH = [  # a call of every entry and query mode, with invalid slots and DP padding
    Case(num_tokens=64, slots=60, num_heads=8, q_head_padded=16, bad_positions=True),
    Case(num_tokens=64, slots=60, num_heads=16, q_head_padded=0, q_inplace=True, bad_positions=True),
    Case(num_tokens=64, slots=60, q_head_padded=0),
    Case(entry="kv", num_tokens=64, slots=60, compress_ratio=2, bad_positions=True),
    Case(entry="append", num_tokens=64, slots=60, slot_dtype=torch.int32),
    Case(entry="pack", page_size=16, pages=4, layout="NHD"),
]


# ---------------------------------------------------------------- (a) CUDA graphs


GRAPH_CASES = [
    Case(num_tokens=48, slots=40, num_heads=8, q_head_padded=16, bad_positions=True),
    Case(
        num_tokens=48,
        slots=40,
        num_heads=16,
        q_head_padded=0,
        q_inplace=True,
        slot_dtype=torch.int32,
        bad_positions=True,
    ),
    Case(entry="kv", num_tokens=48, slots=40, compress_ratio=2, bad_positions=True),
]


@pytest.mark.parametrize("case", GRAPH_CASES, ids=str)
def test_cuda_graph_replay(case, seed):
    """Captured once on static buffers, then replayed three times after copying new random q,
    kv, slots, positions and table into them: each replay's bytes equal the reference on the
    inputs of that replay (the cache keeps what earlier replays wrote)."""
    static = args_of(case.entry, make_inputs(case, DEVICE))
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up outside the capture, as torch recommends
        call(case, static)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = call(case, static)
    if case.q_inplace:
        assert out is static[0], "in place must return q itself"
    for replay in range(3):
        fresh = args_of(case.entry, make_inputs(case, DEVICE))
        for name, dst, src in zip(ARG_NAMES[case.entry], static, fresh):
            if name != "cache":
                dst.copy_(src)
        want, ref_args = run_reference(case.entry, static, case.kwargs(), "cpu")  # inputs of this replay
        graph.replay()
        torch.cuda.synchronize()
        assert_same(case.entry, out, want, static, ref_args, f"{case}, replay {replay}")


# ---------------------------------------------------------------- (b) streams


def test_non_current_stream(seed):
    """Inside ``with torch.cuda.stream(s)`` the call runs on s: the default stream is kept busy
    with a spin kernel, and the results are read on s, after s.synchronize(), while it spins (a
    launch on the default stream would not have run yet)."""
    case = Case(num_tokens=64, slots=60, num_heads=8, q_head_padded=16, bad_positions=True)
    args = args_of(case.entry, make_inputs(case, DEVICE))
    want, ref_args = run_reference(case.entry, args, case.kwargs(), "cpu")
    default, side = torch.cuda.current_stream(), torch.cuda.Stream()
    side.wait_stream(default)  # the inputs are ready
    with torch.cuda.stream(side):
        warm_up(case, args)
    try:
        gpu_sleep(4 * SLEEP_S)
        with torch.cuda.stream(side):
            out = call(case, args)
            side.synchronize()
            assert_same(case.entry, out, want, args, ref_args, f"{case}, on a side stream")  # reads on side
        assert not default.query(), "inconclusive: the default stream's spin ended before the check"
    finally:
        torch.cuda.synchronize()


# ---------------------------------------------------------------- (c) and (f) devices


@pytest.mark.parametrize("case", ONE_OF_EACH, ids=str)
def test_tensors_on_another_gpu(case, seed):
    """Tensors on cuda:1 while cuda:0 is current (and the other way round): bytes equal the
    reference, outputs live on the tensors' GPU, the current device is unchanged."""
    if torch.cuda.device_count() < 2:
        pytest.skip(f"needs two GPUs, found {torch.cuda.device_count()}")
    for current, target in ((0, 1), (1, 0)):
        with torch.cuda.device(current):
            args = args_of(case.entry, make_inputs(case, f"cuda:{target}"))
            check(case.entry, args, case.kwargs(), label=f"{case}, current cuda:{current}, tensors on cuda:{target}")
            assert torch.cuda.current_device() == current, f"{case}: the current device changed"


@pytest.mark.parametrize("case", ONE_OF_EACH, ids=str)
def test_current_device_and_stream_unchanged(case, seed):
    """After a call the current device (torch's and the CUDA runtime's) and the current stream
    are the caller's, also under a non-default stream."""
    import cupy

    side = torch.cuda.Stream()
    for stream in (torch.cuda.current_stream(), side):
        with torch.cuda.stream(stream):
            args = args_of(case.entry, make_inputs(case, DEVICE))
            device, current = torch.cuda.current_device(), torch.cuda.current_stream()
            call(case, args)
            assert torch.cuda.current_device() == device, f"{case}: torch's current device changed"
            assert cupy.cuda.runtime.getDevice() == device, f"{case}: the runtime's current device changed"
            assert torch.cuda.current_stream() == current, f"{case}: the current stream changed"
    torch.cuda.synchronize()


# ---------------------------------------------------------------- (d) no sync, no allocation


@pytest.mark.parametrize("case", ONE_OF_EACH, ids=str)
def test_no_host_synchronisation(case, seed):
    """With the stream blocked behind a spin kernel, the call leaves the stream still busy (so it
    waited for nothing); torch's sync debug mode raises on any synchronising torch op inside the
    call; afterwards the bytes are right."""
    args = args_of(case.entry, make_inputs(case, DEVICE))
    warm_up(case, args)
    want, ref_args = run_reference(case.entry, args, case.kwargs(), "cpu")
    stream = torch.cuda.current_stream()
    gpu_sleep(SLEEP_S)
    start = time.perf_counter()
    out = without_sync(lambda: call(case, args))
    elapsed = time.perf_counter() - start
    busy = not stream.query()
    torch.cuda.synchronize()
    assert busy, f"{case}: the stream's {SLEEP_S} s spin was over when the call returned ({elapsed:.3f} s later)"
    assert_same(case.entry, out, want, args, ref_args, str(case))


# A q_out of 4 MiB, then one call of every entry and query mode.
ALLOCATION_CASES = [Case(num_tokens=256, num_heads=8, q_head_padded=16), *ONE_OF_EACH]


@pytest.mark.parametrize("case", ALLOCATION_CASES, ids=str)
def test_allocates_only_the_output(case, seed):
    """After a warm-up, a call grows torch.cuda.memory_allocated (now and at its peak) exactly as
    much as a torch.empty of its output does (nothing for cache-only and in-place calls), and
    CuPy's memory pool not at all."""
    import cupy

    pool = cupy.get_default_memory_pool()
    args = args_of(case.entry, make_inputs(case, DEVICE))
    want, ref_args = run_reference(case.entry, args, case.kwargs(), "cpu")
    new_output = isinstance(want, torch.Tensor) and want is not ref_args[0]
    warm_up(case, args)
    probe = allocation_delta(lambda: torch.empty_like(want, device=DEVICE) if new_output else None)
    pool_before = pool.used_bytes(), pool.total_bytes()
    result = allocation_delta(lambda: call(case, args))
    assert result == probe, f"{case}: the call allocated (now, peak) {result} bytes; torch.empty of its output {probe}"
    if new_output:
        nbytes = want.numel() * want.element_size()
        assert probe[0] >= nbytes, f"{case}: probe {probe} for an output of {nbytes} bytes"
    assert (pool.used_bytes(), pool.total_bytes()) == pool_before, f"{case}: CuPy's pool grew"


# ---------------------------------------------------------------- (e) empty work, launch count


EMPTY_CASES = [
    Case(num_tokens=0, num_heads=8, q_head_padded=16),
    Case(num_tokens=0, q_head_padded=0),
    Case(num_tokens=0, num_heads=8, q_head_padded=0, q_inplace=True),
    Case(num_tokens=0, num_heads=16, q_head_padded=16, q_inplace=True, apply_q_rope=False),
    Case(num_tokens=7, slots=0, q_head_padded=0),  # cache only, no slots
    Case(entry="kv", num_tokens=0),
    Case(entry="kv", num_tokens=9, slots=0),
    Case(entry="append", num_tokens=0),
    Case(entry="append", num_tokens=5, slots=0),
    Case(entry="pack", pages=0, layout="HND"),
]


@pytest.mark.parametrize("case", EMPTY_CASES, ids=str)
def test_empty_work(case, seed):
    """T = 0 (and cache-only calls with no slots): the right empty result at once, q returned in
    place, nothing written (the canary intact), nothing allocated, no synchronisation."""
    args = args_of(case.entry, make_inputs(case, DEVICE))
    want, ref_args = run_reference(case.entry, args, case.kwargs(), "cpu")
    before = [storage_bytes(a) for a in args]
    holder = []
    delta = allocation_delta(lambda: holder.append(without_sync(lambda: call(case, args))))
    assert delta == (0, 0), f"{case}: allocated (now, peak) {delta} bytes"
    assert_same(case.entry, holder[0], want, args, ref_args, str(case))
    for name, b, a in zip(ARG_NAMES[case.entry], before, args):
        assert torch.equal(b, storage_bytes(a)), f"{case}: {name} was written"
    if "cache" in ARG_NAMES[case.entry]:
        assert (before[ARG_NAMES[case.entry].index("cache")] == CANARY).all()


def gpu_work(fn, ignore=()) -> list[str]:
    """Names of the kernels, copies and memsets that ``fn()`` puts on the GPU (CUPTI, through the
    torch profiler; it sees CuPy's launches too), less the names in ``ignore``."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    names = [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    return [n for n in names if n not in ignore]


@pytest.mark.parametrize(
    "case, launches", [(c, 1) for c in ONE_OF_EACH] + [(c, 0) for c in EMPTY_CASES], ids=lambda c: str(c)
)
def test_one_launch_per_call(case, launches, seed):
    """One kernel and no other GPU work per call; none at all for empty work."""
    noise = set(gpu_work(lambda: None))  # whatever the profiler reports for an empty region
    if len(gpu_work(lambda: torch.cuda._sleep(100), noise)) != 1:
        pytest.skip("the torch profiler does not report GPU kernels here")
    args = args_of(case.entry, make_inputs(case, DEVICE))
    warm_up(case, args)
    work = gpu_work(lambda: call(case, args), noise)
    assert len(work) == launches, f"{case}: expected {launches} launch(es), the GPU ran {work}"


@pytest.mark.parametrize("padded", [0, 8, 128])
def test_output_shapes_of_empty_batch(padded):
    """The T = 0 results have the documented shapes: [0, q_head_padded, 512] BF16 on q's device."""
    case = Case(num_tokens=0, num_heads=5, q_head_padded=padded)
    args = args_of("main", make_inputs(case, DEVICE))
    out = call(case, args)
    assert (tuple(out.shape), out.dtype, out.device) == ((0, padded, abi.HEAD_DIM), torch.bfloat16, args[0].device)


def test_concurrent_first_calls_compile_once(seed, tmp_path, monkeypatch):
    """16 threads make the first call of one new geometry at the same moment: the kernel is
    compiled once and every thread's call writes the reference's bytes."""
    library = nvfp4_mla.KernelLibrary(kernel_cache.KernelCache([tmp_path / "kernels"]))  # nothing loaded or cached yet
    compiles, real_compile = [], jit.compile_kernel

    def counting_compile(spec, arch, key=None):
        compiles.append(spec)
        return real_compile(spec, arch, key)

    monkeypatch.setattr(jit, "compile_kernel", counting_compile)
    case = Case(num_tokens=29, num_heads=3, q_head_padded=8, page_size=7, slot_dtype=torch.int32)
    inputs = [args_of("main", make_inputs(case, DEVICE)) for _ in range(16)]
    gpu_args = [[clone(a) for a in args] for args in inputs]
    results, errors, barrier = [None] * 16, [], threading.Barrier(16)

    def worker(i):
        try:
            barrier.wait()
            results[i] = getattr(nvfp4_mla, ENTRIES[case.entry])(*gpu_args[i], **case.kwargs(), library=library)
            torch.cuda.current_stream().synchronize()
        except Exception as exc:  # reported below, with the thread's number
            errors.append((i, exc))

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    assert len(compiles) == 1, compiles
    for i in range(16):
        want, ref_args = run_reference("main", inputs[i], case.kwargs(), "cpu")
        assert_same("main", results[i], want, gpu_args[i], ref_args, f"thread {i}")
