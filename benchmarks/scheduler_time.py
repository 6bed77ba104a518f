"""The decode scheduler's launch alone, each build at each row count, against a torch ``add_`` of
one element: graph-replayed (the benchmark's timer: ``triton.testing.do_bench_cudagraph``, median),
132 parts, ``extra_lens`` uniform in 0-2,048 over 128 + 2,048 selections. One line a row count,
with the build a call of that many rows takes.

    python benchmarks/scheduler_time.py
"""

from __future__ import annotations

import torch

from nvfp4_mla import KernelLibrary
from nvfp4_mla.bench.timing import DeviceTimer
from nvfp4_mla.launch import current_raw_stream
from nvfp4_mla.ops import decode_scheduler as ds

TIMER = DeviceTimer(reps=1, graph_s=10e-3)  # graph-replayed only
PARTS, SWA_K, EXTRA_K, TILE = 132, 128, 2048, 64


def main() -> None:
    lib, device = KernelLibrary(), torch.cuda.current_device()
    one = torch.zeros(1, device="cuda")
    print(f"add_ {TIMER.graph(lambda x: x.add_(1), [one]) * 1e6:.2f} us")
    work = torch.zeros(ds.work_ints(PARTS), dtype=torch.int32, device="cuda")
    schedule = ds.schedule_fields(PARTS, TILE, 1, 1, False)
    for rows in (1, 64, 256, 512, 1024, 2048, 4096, 16384):
        lens = torch.randint(0, EXTRA_K + 1, (rows,), dtype=torch.int32, device="cuda")
        times = []
        for threads in ds.BUILD_THREADS:
            launcher = lib.launcher(device, lib.spec(ds.SchedulerSpec(threads)))

            def call(lens: torch.Tensor, launcher=launcher, rows=rows) -> None:
                stream = current_raw_stream(device)
                ds.launch(launcher, stream, work.data_ptr(), rows, SWA_K, None, EXTRA_K, lens, schedule)

            times.append(f"{threads} threads {TIMER.graph(call, [lens]) * 1e6:.2f} us")
        print(f"{rows} rows: " + ", ".join(times) + f"; taken: {ds.spec_for(rows, PARTS).threads} threads")


if __name__ == "__main__":
    main()
