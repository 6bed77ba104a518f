"""A seeded out-of-bounds write, to prove the sanitizer run can see one (docs/testing.md).

The writer kernel is compiled with its slot bound weakened from ``slot < capacity`` to
``slot <= capacity`` (the source replaced in memory, the kernel kept in memory; the shipped file
is untouched), then one row
is appended at slot == capacity: one record past the end of the cache. Run it under
``compute-sanitizer --tool memcheck`` with ``PYTORCH_NO_CUDA_MEMORY_CACHING=1``; memcheck must
report invalid global writes. With torch's caching allocator on, the stray bytes land inside the
allocator's pool and memcheck cannot see them.

    PYTORCH_NO_CUDA_MEMORY_CACHING=1 compute-sanitizer --tool memcheck python3 benchmarks/seeded_oob.py
"""

import torch

from nvfp4_mla import jit, launch
from nvfp4_mla.ops import writers
from nvfp4_mla.testing import MemoryKernels, random_rows

BOUND = "static_cast<u64>(r.slot[j]) >= static_cast<u64>(p.capacity)"


class MutatedKernels(MemoryKernels):
    """The writer with the weakened bound, compiled into memory."""

    def compile(self, spec: jit.KernelSpec, arch: str) -> bytes:
        source = jit.source(spec.template.file)
        assert source.count(BOUND) == 1, "the seeded mutation no longer matches the kernel source"
        mutated = source.replace(BOUND, BOUND.replace(">=", ">"))
        return jit.compile_kernel(spec, arch, sources={spec.template.file: mutated}).cubin


def main() -> None:
    spec = writers.append_spec(16, torch.int64)
    launcher = MutatedKernels().launcher(0, spec)
    num_pages, page_size = 2, 16
    cache = torch.zeros(num_pages, page_size, 384, dtype=torch.uint8, device="cuda")
    rows = random_rows((1, 512), "cuda")
    slots = torch.tensor([num_pages * page_size], device="cuda")  # == capacity: one past the end
    stream = launch.current_raw_stream(0)
    kv_blocks, blocks = spec.grid(0, 1, launcher.resident_blocks, launcher.device.sms)
    launcher.launch(
        blocks,
        1,
        1,
        0,
        stream,
        0,
        0,
        rows.data_ptr(),
        cache.data_ptr(),
        slots.data_ptr(),
        0,
        0,
        page_size * 384,
        num_pages * page_size,
        0,
        1,
        kv_blocks,
        0,
    )
    torch.cuda.synchronize()
    print("seeded out-of-bounds write launched")


if __name__ == "__main__":
    main()
