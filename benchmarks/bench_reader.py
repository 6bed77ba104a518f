"""Benchmark of the GPU reader, ``nvfp4_dequantize_sparse_mla_cache`` on CUDA tensors, against
the same run's ceilings. Run on a GPU from the repository root::

    PYTHONPATH=src python benchmarks/bench_reader.py --out DIR

It prints a table and writes ``reader_bench.csv`` and ``reader_bench.md`` into DIR.

What is measured (one process, one GPU):

- **copy ceiling**: ``copy_`` of a 1 GiB device tensor, bytes read + written per second,
  back-to-back eager calls (see :func:`copy_ceiling`);
- **bandwidth**: 65,536 (and 262,144) rows, BF16 (and fp32) out, distinct random slots over a
  pool of at least max(256 MiB, 4 x L2), bytes = 384 read + 512 x {2, 4} written + the slot, per
  row, per second of graph-replayed device time, as % of the copy ceiling. Calls rotate over 4
  slot sets with their own outputs, so records are not found in L2. Also sequential slots (the
  same kernel and bytes, DRAM-friendly order) and rows_per_team 1, 2 and 4 side by side (same
  run: an A/B of the kernel's rows in flight);
- **1 row, graph-replayed**: device time of one call replayed from a CUDA graph (slot and
  record then sit in L2, as in a decode loop), next to an empty kernel's;
- **eager host time**: best of 5 batches of 4,000 calls, host clock, over torch ``add_`` on a
  1-element tensor measured the same way; also its parts alone (an empty kernel's launch, the
  output's allocation, the argument checks);
- **4,096 rows vs the pure-torch reference** (``nvfp4_mla.reference`` on the same GPU): eager
  time per call, back to back (CUDA events over 50 calls), BF16 out.

Device time: ``triton.testing.do_bench_cudagraph`` when triton imports, else CUDA events over
a replayed graph of 20 calls (median of 10 replays).

Predictions, written before the first measurement on an H200 (141 GB HBM3e, 60 MB L2):

- copy ceiling about 4.3 TB/s (read + write);
- 65,536 rows BF16: about 85% of the copy ceiling (~24 us). A random 352-byte data row spans 6
  or 7 of HBM's 64-byte bursts and the 32-byte scale slot one, so about 10-15% more bytes move
  than the model counts; fp32 out a little higher (more of the traffic is sequential writes);
  rows_per_team 2 and 4 within a few % of each other, 1 a few % lower;
- 1 row graph-replayed: about 1.6 us (an empty kernel about 0.5 us, plus two dependent L2
  round trips: slot, then record);
- eager host time about 1.4x torch ``add_`` (checks + one allocation + one cuLaunchKernel);
- 4,096 rows: about 40x faster than the reference (its dozen-odd launches and temporaries cost
  about 0.3 ms; the kernel call is host-bound at about 7 us).
"""

from __future__ import annotations

import argparse
import csv
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch

import nvfp4_mla
from nvfp4_mla import abi, kernel_cache, launch, reader, reference, validation
from nvfp4_mla.testing import make_cache, raw_bytes

PAGE_SIZE = 64
HOST_CALLS, HOST_BATCHES = 4000, 5
SLOT_SETS = 4  # calls rotate over these, so a call does not find the previous call's records in L2
read = nvfp4_mla.nvfp4_dequantize_sparse_mla_cache


# ---------------------------------------------------------------- timing


def device_seconds(fn: Callable[[], object]) -> float:
    """Median device seconds of one call of ``fn``, replayed from a CUDA graph."""
    fn()  # compile, load, allocate outside the capture
    torch.cuda.synchronize()
    try:
        from triton.testing import do_bench_cudagraph
    except ImportError:
        do_bench_cudagraph = None
    if do_bench_cudagraph is not None:
        return do_bench_cudagraph(fn, rep=20, return_mode="median") * 1e-3
    calls = 20
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    graph.replay()
    samples = []
    for _ in range(10):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end) * 1e-3 / calls)
    return statistics.median(samples)


def rotating(calls: list[Callable[[], object]]) -> Callable[[], object]:
    """One call that runs ``calls`` in turn (captured in a graph, the turns are baked in)."""
    state = [0]

    def call():
        state[0] = (state[0] + 1) % len(calls)
        return calls[state[0]]()

    return call


def host_seconds(fn: Callable[[], object]) -> float:
    """Best of HOST_BATCHES batches of HOST_CALLS eager calls, host clock, per call; each batch
    starts from an idle device."""
    for _ in range(100):
        fn()
    best = float("inf")
    for _ in range(HOST_BATCHES):
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(HOST_CALLS):
            fn()
        best = min(best, (time.perf_counter() - start) / HOST_CALLS)
    torch.cuda.synchronize()
    return best


def eager_seconds(fn: Callable[[], object], calls: int = 50) -> float:
    """Back-to-back eager calls, CUDA events around them, per call (median of 5)."""
    for _ in range(3):
        fn()
    samples = []
    for _ in range(5):
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(calls):
            fn()
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end) * 1e-3 / calls)
    return statistics.median(samples)


def empty_kernel() -> Callable[[], None]:
    """An empty kernel launched like nvfp4_mla's (cuLaunchKernel through CuPy's driver bindings)."""
    import cupy
    from cupy.cuda import driver

    index = torch.cuda.current_device()
    with cupy.cuda.Device(index):
        function = cupy.RawKernel('extern "C" __global__ void empty() {}', "empty").kernel.ptr
    return lambda: driver.launchKernel(function, 1, 1, 1, 32, 1, 1, 0, launch.current_raw_stream(index), 0, 0)


# ---------------------------------------------------------------- inputs


def copy_ceiling(device: torch.device) -> float:
    """Bytes read + written per second by eager ``copy_`` of a 1 GiB device tensor. Eager, not
    graph-replayed: captured, ``copy_`` becomes a memcpy node, which ran at 2.7 TB/s on the H200
    against 4.3 TB/s eager (a 0.5 ms copy has no host overhead to hide)."""
    source = torch.empty(1 << 30, dtype=torch.uint8, device=device)
    target = torch.empty_like(source)
    return 2 * source.numel() / eager_seconds(lambda: target.copy_(source), calls=20)


def pool_cache(device: torch.device) -> torch.Tensor:
    """A cache of at least max(256 MiB, 4 x L2) of random records (scale bytes 0x00..0x7E, as
    the writers store them)."""
    l2 = getattr(torch.cuda.get_device_properties(device), "L2_cache_size", 0)
    pool_bytes = max(256 << 20, 4 * l2)
    num_pages = -(-pool_bytes // (PAGE_SIZE * abi.RECORD_BYTES))
    cache = make_cache(num_pages, PAGE_SIZE, "HND", device=device)
    storage = raw_bytes(cache)
    storage.copy_(torch.randint(0, 256, storage.shape, dtype=torch.uint8, device=device))
    _, scales = abi.record_views(cache, validation.check_cache(cache))
    scales.copy_(torch.randint(0, abi.E4M3_MAX_CODE + 1, scales.shape, dtype=torch.uint8, device=device))
    return cache


def slot_sets(rows: int, capacity: int, device: torch.device) -> list[torch.Tensor]:
    return [torch.randperm(capacity, device=device)[:rows] for _ in range(SLOT_SETS)]


def row_bytes(dtype: torch.dtype) -> int:
    return abi.RECORD_BYTES + abi.HEAD_DIM * dtype.itemsize + 8  # record, row, int64 slot


# ---------------------------------------------------------------- the measurements


def run(device: torch.device) -> list[dict]:
    results: list[dict] = []

    def add(name: str, value: float, unit: str, target: str = "", note: str = "") -> None:
        results.append(dict(measure=name, value=value, unit=unit, target=target, note=note))
        print(f"{name:58s} {value:12.3f} {unit:6s} {target:10s} {note}")

    copy_bw = copy_ceiling(device)
    torch.cuda.empty_cache()  # the copy's 2 GiB back
    add("copy ceiling: 1 GiB copy_", copy_bw / 1e12, "TB/s")

    cache = pool_cache(device)
    geometry = validation.check_cache(cache)
    capacity = geometry.num_pages * geometry.page_size
    add("pool", cache.numel() / 2**20, "MiB", note=f"{capacity} slots, page_size {PAGE_SIZE}")

    for rows, dtype in ((65_536, torch.bfloat16), (65_536, torch.float32), (262_144, torch.bfloat16)):
        sets = slot_sets(rows, capacity, device)
        outs = [torch.empty(rows, abi.HEAD_DIM, dtype=dtype, device=device) for _ in sets]
        calls = [lambda s=s, o=o, d=dtype: read(cache, s, dtype=d, out=o) for s, o in zip(sets, outs)]
        seconds = device_seconds(rotating(calls))
        share = rows * row_bytes(dtype) / seconds / copy_bw
        goal = ">= 85%" if (rows, dtype) == (65_536, torch.bfloat16) else ""
        label = f"{rows} rows {str(dtype)[6:]}, random slots: % of copy"
        add(label, 100 * share, "%", goal, f"{seconds * 1e6:.1f} us")

    rows = 65_536
    sets = [torch.arange(i * rows, (i + 1) * rows, device=device) for i in range(SLOT_SETS)]
    outs = [torch.empty(rows, abi.HEAD_DIM, dtype=torch.bfloat16, device=device) for _ in sets]
    seconds = device_seconds(
        rotating([lambda s=s, o=o: read(cache, s, dtype=torch.bfloat16, out=o) for s, o in zip(sets, outs)])
    )
    share = rows * row_bytes(torch.bfloat16) / seconds / copy_bw
    add(f"{rows} rows bfloat16, sequential slots: % of copy", 100 * share, "%", note=f"{seconds * 1e6:.1f} us")
    sets = slot_sets(rows, capacity, device)
    outs = [torch.empty(rows, abi.HEAD_DIM, dtype=torch.bfloat16, device=device) for _ in sets]
    fill = reader.fill_pattern(float("nan"), False)
    index = device.index or 0
    for per_team in (1, 2, 4):
        variant = reader.ReaderVariant.of(PAGE_SIZE, torch.int64, torch.bfloat16)._replace(rows_per_team=per_team)
        launcher = kernel_cache.default().launcher(index, variant)
        calls = [
            lambda s=s, o=o, k=launcher, n=variant.rows_per_block: reader.launch(
                k, n, index, cache, s.data_ptr(), o, geometry, rows, fill
            )
            for s, o in zip(sets, outs)
        ]
        seconds = device_seconds(rotating(calls))
        share = rows * row_bytes(torch.bfloat16) / seconds / copy_bw
        add(
            f"A/B rows_per_team={per_team}: 65536 rows bf16, % of copy",
            100 * share,
            "%",
            note=f"{seconds * 1e6:.1f} us",
        )
    del sets, outs

    one = torch.randint(0, capacity, (1,), device=device)
    out_one = torch.empty(1, abi.HEAD_DIM, dtype=torch.bfloat16, device=device)
    add(
        "1 row, graph-replayed",
        1e6 * device_seconds(lambda: read(cache, one, dtype=torch.bfloat16, out=out_one)),
        "us",
        "<= 2.0",
    )
    add("empty kernel, graph-replayed", 1e6 * device_seconds(empty_kernel()), "us")

    scalar = torch.zeros(1, device=device)
    add_s = host_seconds(lambda: scalar.add_(1))
    new_s = host_seconds(lambda: read(cache, one, dtype=torch.bfloat16))
    out_s = host_seconds(lambda: read(cache, one, dtype=torch.bfloat16, out=out_one))
    add("torch add_ host time", 1e6 * add_s, "us")
    add("eager host time / add_ (new output)", new_s / add_s, "x", "<= 1.5", f"{new_s * 1e6:.2f} us")
    add("eager host time / add_ (out=)", out_s / add_s, "x", "", f"{out_s * 1e6:.2f} us")
    # Where the host time goes: the parts of a call, each timed alone the same way.
    launch_s = host_seconds(empty_kernel())
    alloc_s = host_seconds(lambda: cache.new_empty((1, abi.HEAD_DIM), dtype=torch.bfloat16))
    check_s = host_seconds(lambda: validation.check_dequantize(cache, one, torch.bfloat16, 0.0, None, True))
    add("  part: cuLaunchKernel through CuPy (empty kernel)", launch_s / add_s, "x", "", f"{launch_s * 1e6:.2f} us")
    add("  part: the output's new_empty", alloc_s / add_s, "x", "", f"{alloc_s * 1e6:.2f} us")
    add("  part: validation.check_dequantize", check_s / add_s, "x", "", f"{check_s * 1e6:.2f} us")

    slots = torch.randperm(capacity, device=device)[:4096]
    kernel_s = eager_seconds(lambda: read(cache, slots, dtype=torch.bfloat16))
    reference_s = eager_seconds(
        lambda: reference.nvfp4_dequantize_sparse_mla_cache(cache, slots, dtype=torch.bfloat16), calls=10
    )
    add(
        "4096 rows: reference / kernel (eager, back to back)",
        reference_s / kernel_s,
        "x",
        ">= 20",
        f"{kernel_s * 1e6:.1f} us vs {reference_s * 1e6:.0f} us",
    )
    return results


def write(results: list[dict], out: Path, device_name: str) -> None:
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "reader_bench.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(results[0]))
        writer.writeheader()
        writer.writerows(results)
    lines = [
        f"# Reader benchmark on {device_name}",
        "",
        "| measure | value | unit | target | note |",
        "|---|---|---|---|---|",
    ]
    lines += [f"| {r['measure']} | {r['value']:.3f} | {r['unit']} | {r['target']} | {r['note']} |" for r in results]
    (out / "reader_bench.md").write_text("\n".join(lines) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True, help="directory for reader_bench.csv and reader_bench.md")
    args = parser.parse_args()
    reason = launch.gpu_unavailable_reason()
    if reason is not None:
        raise SystemExit(f"bench_reader: {reason}")
    device = torch.device("cuda", torch.cuda.current_device())
    name = torch.cuda.get_device_name(device)
    print(f"{name}, torch {torch.__version__}")
    write(run(device), args.out, name)
    print(f"wrote {args.out / 'reader_bench.csv'} and {args.out / 'reader_bench.md'}")


if __name__ == "__main__":
    main()
