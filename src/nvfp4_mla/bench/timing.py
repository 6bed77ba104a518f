"""How an arm is timed: medians from maintained timers, behind one small interface.

- eager: ``torch.utils.benchmark.Timer`` (it synchronizes the device around each batch) over
  batches of back-to-back calls, so eager times at small T are bounded by the host's launch rate;
- graph-replayed: ``triton.testing.do_bench_cudagraph`` (a CUDA graph of back-to-back calls,
  replayed), the device time without host launch cost: the primary number;
- host: the same ``Timer`` on the host clock alone, no device synchronization, over batches that
  each start from an idle device (:func:`host_batches`; the median for the writers' grid, the
  best batch for the reader's parts).

Calls rotate over input sets (see ``grid.input_set_count``) so that they do not find their data
in L2. The measuring code takes any object with :class:`Timer`'s methods; the CPU tests give it
one that runs each call once and returns fixed numbers.
"""

from __future__ import annotations

import itertools
import statistics
import timeit
from collections.abc import Callable
from typing import Any, Protocol

import torch
from torch.utils import benchmark

TARGET_BATCH_S = 4e-3  # one timed eager batch, and one graph, last about this long
MAX_CALLS_PER_BATCH = 200
PROBE_CALLS = 4  # calls of the batch that estimates one call's time
HOST_CALLS = 200  # host time: calls per batch
HOST_BATCHES = 9
# The reader and decode suites: graphs of about 20 ms and the median of 5 eager batches, as in
# their first measurements on the H200.
SUITE_GRAPH_S = 20e-3
SUITE_REPS = 5
# The host and reader suites' eager host time: the best of 5 batches of 4,000 calls (host_pair).
SUITE_HOST_CALLS, SUITE_HOST_BATCHES = 4000, 5


class Timer(Protocol):
    """Median seconds per call of an arm."""

    def eager(self, call: Callable[[Any], object], sets: list[Any]) -> tuple[float, int]:
        """Seconds per call of back-to-back eager calls, and the calls per timed batch."""
        ...

    def graph(self, call: Callable[[Any], object], sets: list[Any]) -> float:
        """Seconds per call replayed from a CUDA graph."""
        ...

    def host(self, call: Callable[[Any], object], inputs: Any) -> float:
        """Host seconds of one eager call."""
        ...


def rotation(call: Callable[[Any], object], sets: list[Any]) -> Callable[[], object]:
    """A no-argument call whose successive invocations take the input sets in turn."""
    next_set = itertools.cycle(sets).__next__
    return lambda: call(next_set())


def host_batches(call: Callable[[Any], object], inputs: Any, calls: int, batches: int) -> list[float]:
    """Host seconds per call of ``batches`` batches of ``calls`` eager calls, host clock.

    After one untimed batch, so that first-call effects (interpreter specialisation, allocator)
    stay out; each batch starts from an idle device, so it keeps up with small calls and the host
    cost, not a full launch queue, is measured.
    """
    timer = benchmark.Timer(stmt="call(inputs)", globals={"call": call, "inputs": inputs}, timer=timeit.default_timer)
    timer.timeit(calls)
    samples = []
    for _ in range(batches):
        torch.cuda.synchronize()
        samples.append(timer.timeit(calls).median)
    return samples


def host_pair(
    call: Callable[[], object],
    reference: Callable[[], object],
    calls: int = SUITE_HOST_CALLS,
    batches: int = SUITE_HOST_BATCHES,
) -> tuple[float, float]:
    """Best host seconds per call of ``call`` and of ``reference`` over ``batches`` batches of
    ``calls`` (:func:`host_batches`), the two's batches alternating so that both see the same host:
    a shared host's speed drifted by 10-30% within one run (measured on the H200 machines)."""
    call_s: list[float] = []
    reference_s: list[float] = []
    for _ in range(batches):
        reference_s += host_batches(lambda _: reference(), None, calls, 1)
        call_s += host_batches(lambda _: call(), None, calls, 1)
    return min(call_s), min(reference_s)


class DeviceTimer:
    """The benchmark's :class:`Timer` on the current CUDA device.

    Parameters
    ----------
    reps
        Timed batches of an eager arm; the median is reported. A graph is replayed triton's fixed
        number of times (10).
    graph_s
        About how long one graph's calls take (triton's ``rep``): it sets the calls captured.
    """

    def __init__(self, reps: int, graph_s: float = TARGET_BATCH_S):
        self.reps = reps
        self.graph_s = graph_s

    def eager(self, call: Callable[[Any], object], sets: list[Any]) -> tuple[float, int]:
        for inputs in sets:  # warm-up: compiles and loads the kernel, touches every set once
            call(inputs)
        timer = benchmark.Timer(stmt="call()", globals={"call": rotation(call, sets)})
        estimate = timer.timeit(PROBE_CALLS).median
        calls = max(1, min(MAX_CALLS_PER_BATCH, int(TARGET_BATCH_S / max(estimate, 1e-7))))
        return statistics.median(timer.timeit(calls).median for _ in range(self.reps)), calls

    def graph(self, call: Callable[[Any], object], sets: list[Any]) -> float:
        from triton.testing import do_bench_cudagraph  # triton comes with torch's CUDA builds only

        call(sets[0])  # compiles, loads and allocates on this stream, outside the capture
        # triton captures and replays on a new stream: the inputs, made on this one, must be ready.
        torch.cuda.synchronize()
        return do_bench_cudagraph(rotation(call, sets), rep=self.graph_s * 1e3, return_mode="median") * 1e-3

    def host(self, call: Callable[[Any], object], inputs: Any) -> float:
        """The median of :func:`host_batches`."""
        return statistics.median(host_batches(call, inputs, HOST_CALLS, HOST_BATCHES))
