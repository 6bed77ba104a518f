"""What the one-call form's scheduler costs in a stream of decode calls, on ragged batches:
graph-replayed (the benchmark's timer: ``triton.testing.do_bench_cudagraph``, median), each batch
as ``bench decode --ragged`` draws it (128 window + 2,048 compressed selections, ``extra_lens``)
in four forms:

- ``t_one_call``: ``sparse_mla_decode`` with the lengths (the attention, whose blocks deal the
  list, or the scheduler first where a block has fewer threads than the parts; then the combine);
- ``t_plan``: the same call with a reused plan (no scheduler);
- ``t_update``: ``plan.update()`` (the scheduler's launch) before each reused-plan call;
- ``t_empty``: an empty kernel before each reused-plan call, launched as the decode's kernels are
  (programmatic dependent launch; it lets the next kernel launch, then waits for the one before).

``t_update - t_plan`` is the scheduler's cost in the stream; ``t_empty - t_plan`` that of a kernel
boundary alone. One CSV row a batch on stdout.

    python benchmarks/decode_chain.py [--every N]   # N: time every Nth batch size
"""

from __future__ import annotations

import ctypes

import cupy
import torch
from decode_plan_ab import start

import nvfp4_mla
from nvfp4_mla import launch
from nvfp4_mla.bench import decode_arms, decode_ragged
from nvfp4_mla.bench.timing import DeviceTimer

TIMER = DeviceTimer(reps=1, graph_s=3e-3)  # graph-replayed only
BATCHES = (1, 8, 32, 64, 128)
EMPTY = r"""extern "C" __global__ void empty_dependent() {
    asm volatile("griddepcontrol.launch_dependents;");
    asm volatile("griddepcontrol.wait;" ::: "memory");
}"""


class EmptyKernel:
    """One warp that lets the stream's next kernel launch and waits for the one before, launched
    through ``cuLaunchKernelEx`` with the programmatic-serialization attribute (sm_90 on)."""

    def __init__(self) -> None:
        major, minor = torch.cuda.get_device_capability()
        arch = f"sm_{major}{minor}"
        kernel = cupy.RawKernel(EMPTY, "empty_dependent", options=(f"--gpu-architecture={arch}",), backend="nvrtc")
        self.function = kernel.kernel.ptr
        self.config = ctypes.create_string_buffer(launch._LAUNCH_CONFIG.size)
        self.launch_ex = launch._launch_kernel_ex()

    def __call__(self) -> None:
        stream = launch.current_raw_stream(torch.cuda.current_device())
        attribute = ctypes.addressof(launch._DEPENDENT_LAUNCH_ATTRIBUTE)
        launch._LAUNCH_CONFIG.pack_into(self.config, 0, 1, 1, 1, 32, 1, 1, 0, stream, attribute, 1)
        status = self.launch_ex(ctypes.addressof(self.config), self.function, None, None)
        if status:
            raise RuntimeError(f"cuLaunchKernelEx failed with CUDA error {status}")


def main() -> None:
    args, pools, g = start(__doc__)
    every = args.every
    if torch.cuda.get_device_capability() < (9, 0):
        raise SystemExit("programmatic dependent launch needs sm_90 or newer")
    empty = EmptyKernel()
    extra_k = decode_ragged.RAGGED_EXTRA_K
    print("B,H,lens,live_full,t_one_call,t_plan,t_update,t_empty,scheduler_us,boundary_us")
    for batch in BATCHES[::every]:
        for heads in (64, 128):
            for dist in decode_ragged.RAGGED_DISTRIBUTIONS:
                x = decode_arms.Inputs(batch, 1, heads, extra_k, g, pools)
                lens = decode_ragged.ragged_lengths(dist, batch, extra_k, g).cuda()
                plan = nvfp4_mla.plan_sparse_mla_decode(heads, x.slots[0], extra_slots=x.slots[1], extra_lens=lens)

                def one_call(inputs: decode_arms.Inputs, lens: torch.Tensor = lens) -> object:
                    return decode_arms.fused(pools, inputs, extra_lens=lens)

                def planned(inputs: decode_arms.Inputs, lens: torch.Tensor = lens, plan=plan) -> object:
                    return decode_arms.fused(pools, inputs, extra_lens=lens, plan=plan)

                def updated(inputs: decode_arms.Inputs, plan=plan) -> object:
                    plan.update()
                    return planned(inputs)

                def after_empty(inputs: decode_arms.Inputs) -> object:
                    empty()
                    return planned(inputs)

                times = [TIMER.graph(call, [x]) * 1e6 for call in (one_call, planned, updated, after_empty)]
                live = f"{int(lens.sum()) / (batch * extra_k):.3f}"
                cells = [batch, heads, dist, live, *(f"{t:.2f}" for t in times)]
                cells += [f"{times[2] - times[1]:.2f}", f"{times[3] - times[1]:.2f}"]
                print(",".join(map(str, cells)), flush=True)


if __name__ == "__main__":
    main()
