"""Two GPUs: every op off device 0, and tensor-parallel heads through torch.distributed.

In one process, with the tensors on one GPU and the other GPU current (both ways round): the
reader and ``sparse_mla_decode`` (the one-call form and a reused plan) give the bits of the same
call made with the tensors' own GPU current, and the reference's values (the reader's bits, the
decode within its float64 tolerance); torch's and the CUDA runtime's current device are the
caller's after every call; a plan made on one GPU is refused for tensors on the other. A library's
kernels load per GPU (a fresh library's first call on cuda:1 comes after one on cuda:0, with
cuda:0 current), and a call launches on its tensors' GPU's current stream (a side stream of
cuda:1 while cuda:0 is current: ordered behind an event of another stream, done while cuda:1's
default stream still spins).

Then examples/tensor_parallel.py under torchrun: two ranks on two GPUs (NCCL), each rank's heads
bitwise equal to one-GPU calls and all heads within the reference's tolerance. Its one-GPU run
(the split degenerates to all heads) and its run without CUDA (it says so and exits 0) sit here
too, under the GPU marker and without it; every other test needs two GPUs and is skipped, with
the reason, on fewer.
"""

from __future__ import annotations

import dataclasses
import os
import re
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch
from test_decode_gpu import Pool, bits_equal, check, exact, lengths, queries
from test_decode_plan import call
from test_writers_gpu_execution import gpu_sleep

import nvfp4_mla
from nvfp4_mla import kernel_cache

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "tensor_parallel.py"


def _two_gpus_missing() -> str | None:
    count = torch.cuda.device_count()
    if count < 2:
        return f"needs two GPUs, found {count}"
    reason = nvfp4_mla.gpu_unavailable_reason(1)  # the gpu marker asks about the current device only
    return None if reason is None else f"needs two GPUs: {reason}"


TWO_GPUS_MISSING = _two_gpus_missing()


def two_gpus(test):
    """Marks ``test`` as needing two usable GPUs (skipif first: pytest reports its reason before
    the gpu marker's)."""
    return pytest.mark.gpu(pytest.mark.skipif(TWO_GPUS_MISSING is not None, reason=str(TWO_GPUS_MISSING))(test))


@dataclasses.dataclass
class Call:
    """A decode call's tensors on one device: q, both pools as ``(pool, slots, lens)`` (what
    test_decode_gpu's ``exact`` takes: a pool is anything with ``.cache`` and ``.capacity``), sinks."""

    q: torch.Tensor
    pools: list
    sinks: torch.Tensor

    def to(self, device) -> Call:
        pools = [
            (types.SimpleNamespace(cache=p.cache.to(device), capacity=p.capacity), slots.to(device), lens.to(device))
            for p, slots, lens in self.pools
        ]
        return Call(self.q.to(device), pools, self.sinks.to(device))

    def plan(self, library=None) -> nvfp4_mla.SparseMlaDecodePlan:
        (_, swa_slots, swa_lens), (_, extra_slots, extra_lens) = self.pools
        tables = {"swa_lens": swa_lens, "extra_slots": extra_slots, "extra_lens": extra_lens}
        return nvfp4_mla.plan_sparse_mla_decode(self.q.shape[2], swa_slots, **tables, library=library)

    def decode(self, plan=None, library=None) -> tuple[torch.Tensor, torch.Tensor]:
        return call(self.q, self.pools, self.sinks, plan=plan, library=library)

    def exact(self):
        """The float64 answer (on the CPU, whichever GPU the call's tensors are on)."""
        cpu = self.to("cpu")
        return exact(cpu.q, cpu.pools, sinks=cpu.sinks)


def make_call(seed: int, heads: int) -> Call:
    """Two pools of different page sizes, int32 and int64 tables with invalid slots, ragged
    lengths, q_len 2, sinks; made on cuda:0."""
    g = torch.Generator().manual_seed(seed)
    with torch.cuda.device(0):  # test_decode_gpu's helpers make their tensors on the current GPU
        swa, extra = Pool(16, 64, g), Pool(12, 32, g, layout="HND")
        q = queries(3, 2, heads, g)
        pools = [
            (swa, swa.slots((3, 2, 200), g, dtype=torch.int32, invalid=0.05), lengths(3, 2, 200, g)),
            (extra, extra.slots((3, 2, 96), g, invalid=0.05), lengths(3, 2, 96, g, dtype=torch.int64)),
        ]
        sinks = torch.randn(heads, generator=g).to(q.device)
    return Call(q, pools, sinks)


def with_current(device: int, work):
    """``work()`` with cuda:``device`` current; asserts that torch's and the CUDA runtime's current
    device are still that one afterwards."""
    import cupy

    with torch.cuda.device(device):
        result = work()
        assert torch.cuda.current_device() == device, f"torch's current device changed from cuda:{device}"
        assert cupy.cuda.runtime.getDevice() == device, f"the runtime's current device changed from cuda:{device}"
    return result


def on(device: int) -> torch.device:
    return torch.device("cuda", device)


# ---------------------------------------------------------------- one process, two GPUs


@two_gpus
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_reader_runs_on_its_tensors_gpu(seed, dtype):
    """Tensors on the GPU that is not current (called before any read with that GPU current):
    the bits of the call with it current, and the reference's bits."""
    g = torch.Generator().manual_seed(seed)
    with torch.cuda.device(0):
        pool = Pool(8, 64, g, layout="NHD")
        slots = pool.slots((5, 77), g, dtype=torch.int32, invalid=0.1)
    want = nvfp4_mla.reference.nvfp4_dequantize_sparse_mla_cache(pool.cache.cpu(), slots.cpu(), dtype=dtype)
    for current, target in ((0, 1), (1, 0)):
        cache, where = pool.cache.to(target), slots.to(target)

        def read(cache=cache, where=where):
            return nvfp4_mla.nvfp4_dequantize_sparse_mla_cache(cache, where, dtype=dtype)

        got = with_current(current, read)  # before any call with cuda:{target} current
        own = with_current(target, read)
        what = f"reader, {dtype}, tensors on cuda:{target}, cuda:{current} current"
        assert got.device == on(target), what
        assert bits_equal(got, own), f"{what}: not the bits of the call with cuda:{target} current"
        assert bits_equal(got.cpu(), want), f"{what}: not the reference's bits"


@two_gpus
@pytest.mark.parametrize("heads", [16, 128])
def test_the_decode_runs_on_its_tensors_gpu(seed, heads):
    """The one-call form and a plan (made with the other GPU current too), against the same calls
    with the tensors' GPU current: the same bits, within tolerance of the float64 answer."""
    call = make_call(seed, heads)
    want = call.exact()
    for current, target in ((0, 1), (1, 0)):
        here = call.to(target)
        plan = with_current(current, here.plan)
        got = {
            "one call": with_current(current, here.decode),
            "plan": with_current(current, lambda here=here, plan=plan: here.decode(plan=plan)),
        }
        own_plan = with_current(target, here.plan)
        own = {
            "one call": with_current(target, here.decode),
            "plan": with_current(target, lambda here=here, plan=own_plan: here.decode(plan=plan)),
        }
        for form, (out, lse) in got.items():
            what = f"{heads} heads, {form}, tensors on cuda:{target}, cuda:{current} current"
            assert out.device == lse.device == on(target), what
            assert bits_equal(out, own[form][0]) and bits_equal(lse, own[form][1]), (
                f"{what}: not the bits of the call with cuda:{target} current"
            )
            check((out.cpu(), lse.cpu()), want, what)


@two_gpus
def test_a_plan_made_on_one_gpu_is_refused_on_the_other(seed):
    call = make_call(seed, 16)
    for made, used in ((0, 1), (1, 0)):
        plan = with_current(made, call.to(made).plan)
        other = call.to(used)
        for current in (made, used):
            with torch.cuda.device(current), pytest.raises(ValueError, match="plan= was made for another call"):
                other.decode(plan=plan)


def every_op(call: Call, library=None) -> dict[str, tuple[torch.Tensor, ...]]:
    """The reader (over the call's first pool) and the decode, without and with a plan, through
    ``library``: each one's outputs."""
    (swa, slots, _), _ = call.pools
    plan = call.plan(library=library)
    return {
        "reader": (nvfp4_mla.nvfp4_dequantize_sparse_mla_cache(swa.cache, slots, library=library),),
        "decode": call.decode(library=library),
        "decode with a plan": call.decode(plan=plan),
    }


@two_gpus
def test_a_librarys_kernels_load_per_gpu(seed):
    """A fresh library (nothing loaded anywhere): the ops on cuda:0, then on cuda:1 with cuda:0
    still current (loaded there, not cuda:0's kernels), then with cuda:1 current: the bits of
    the default library's calls made with the tensors' GPU current."""
    library = nvfp4_mla.KernelLibrary(kernel_cache.KernelCache())
    call = make_call(seed, 64)
    for current, target in ((0, 0), (0, 1), (1, 1)):
        here = call.to(target)
        got = with_current(current, lambda here=here: every_op(here, library))
        want = with_current(target, lambda here=here: every_op(here))
        for name, results in got.items():
            what = f"a fresh library's {name}, tensors on cuda:{target}, cuda:{current} current"
            assert all(r.device == on(target) for r in results), what
            assert all(bits_equal(a, b) for a, b in zip(results, want[name])), f"{what}: not the default library's bits"


@two_gpus
def test_a_call_launches_on_its_gpus_current_stream(seed):
    """cuda:0 current, a side stream cuda:1's current stream: the decode (one call, and a plan
    made there) runs on the side stream. Its q is written on a third stream of cuda:1 after a
    spin, and the side stream waits for that through an event: a launch anywhere else would read
    q before it is written. cuda:1's default stream spins meanwhile, and the results are read on
    the side stream while it still does: a launch there would not have run yet."""
    call = make_call(seed, 64).to(1)
    want = with_current(1, lambda: (call.decode(), call.decode(plan=call.plan())))
    default, side, producer = torch.cuda.default_stream(1), torch.cuda.Stream(1), torch.cuda.Stream(1)
    q = torch.full_like(call.q, float("nan"))
    late = dataclasses.replace(call, q=q)
    side.wait_stream(default)  # the inputs are ready
    producer.wait_stream(default)
    with torch.cuda.stream(side):  # warm: kernels loaded, plans made, output blocks cached on this stream
        late.decode(plan=late.plan())
    side.synchronize()
    try:
        with torch.cuda.device(1):
            gpu_sleep(2.0)  # cuda:1's default stream
        with torch.cuda.stream(producer):
            gpu_sleep(0.3)
            q.copy_(call.q)
            written = torch.cuda.Event()
            written.record(producer)
        side.wait_event(written)
        with torch.cuda.stream(side), torch.cuda.device(0):
            assert torch.cuda.current_stream(1) == side and torch.cuda.current_device() == 0
            got = with_current(0, lambda: (late.decode(), late.decode(plan=late.plan())))
            done = torch.cuda.Event()
            done.record(side)
        done.synchronize()
        with torch.cuda.stream(side):
            same = [bits_equal(a, b) for g, w in zip(got, want) for a, b in zip(g, w)]
        assert not default.query(), "inconclusive: cuda:1's default stream's spin ended before the check"
        assert all(same), f"(out, lse) of the one call, then of the plan, equal to the calls on cuda:1: {same}"
    finally:
        torch.cuda.synchronize(1)


# ---------------------------------------------------------------- examples/tensor_parallel.py


def torchrun(ranks: int) -> subprocess.CompletedProcess:
    """The example under torchrun (torch's own module, with this interpreter), in the parent's
    environment plus the source tree on PYTHONPATH."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT / "src"), os.environ.get("PYTHONPATH")]))
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={ranks}", str(EXAMPLE)]
    return subprocess.run(command, capture_output=True, text=True, env=env, cwd=ROOT, timeout=540)


def assert_verdicts(done: subprocess.CompletedProcess, ranks: int) -> None:
    output = done.stdout + done.stderr
    assert done.returncode == 0, output
    verdicts = re.findall(rf"^rank (\d+)/{ranks} \(heads .*\): OK: ", done.stdout, re.MULTILINE)
    assert sorted(verdicts) == [str(r) for r in range(ranks)], output
    assert done.stdout.splitlines().count("tensor_parallel: OK") == 1, output


@two_gpus
def test_the_tensor_parallel_example_on_two_gpus():
    assert_verdicts(torchrun(2), 2)


@pytest.mark.gpu
def test_the_tensor_parallel_example_on_one_gpu():
    assert_verdicts(torchrun(1), 1)


@pytest.mark.skipif(nvfp4_mla.gpu_unavailable_reason() is None, reason="a usable GPU: the example's GPU runs check it")
def test_the_tensor_parallel_example_without_cuda_says_so():
    done = torchrun(2)
    assert done.returncode == 0, done.stdout + done.stderr
    assert re.fullmatch(r"tensor_parallel: needs CUDA \(.+\); nothing run\n", done.stdout), done.stdout + done.stderr
