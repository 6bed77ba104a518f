"""The benchmark: the fused writer against what a user runs without it, all in one run.

``nvfp4-mla bench [--quick] [--out DIR] [--reps N] [--compile-budget S] [--entries E ...]
[--kv-rows-per-warp N ...]`` (also ``python -m nvfp4_mla.bench``). Every row of the grid is one
entry and geometry, timed in up to five arms in the same process (:mod:`.arms`): the fused entry
eagerly and replayed from a CUDA graph, torch RoPE + the append kernel, ``torch.compile`` of the
reference, and the no-quantizer arm (:mod:`.stub`: the same launch, graph-replayed, from kernels
whose quantizer functions are stubbed). ``--kv-rows-per-warp`` repeats the KV, append and pack
rows for each count of KV rows a warp (the A/B).

Ceilings from the same run (device copy bandwidth, an empty kernel's launch time, a torch
``add_`` launch's host time) turn times into fractions, and the targets of docs/performance.md
become PASS/MISS verdicts. Outputs: ``bench.csv``, ``bench.md`` (environment, ceilings, first use,
targets, table) and ``bench.png`` under ``bench-results/<GPU name>/`` (or ``--out``); the target
summary and a short table go to stdout last.

Two more suites, each with its own options and outputs in the same folder:
``nvfp4-mla bench reader`` (:mod:`.reader`: the GPU reader's bandwidth, latency and host time) and
``nvfp4-mla bench decode`` (:mod:`.decode`: the fused sparse decode against torch attention on a
BF16 cache and through the reader, with byte and matmul rooflines).

Modules: :mod:`.grid` (rows and the bytes model), :mod:`.inputs`, :mod:`.arms`, :mod:`.stub`, :mod:`.timing`,
:mod:`.ceilings`, :mod:`.results`, :mod:`.targets`, :mod:`.report` and :mod:`.plot` (writers),
:mod:`.probes` (first use in fresh processes, environment) and :mod:`.run` (the grid loop and the
command line, which dispatches the suites). Only timing needs a GPU: the rest runs on the CPU with
``nvfp4_mla.reference`` as the library (tests/test_bench_cpu.py, tests/test_bench_stub.py).
"""

from .run import main

__all__ = ["main"]
