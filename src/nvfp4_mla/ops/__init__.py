"""The ops on the GPU: one module per op, each its validation, planning, launch and torch custom
ops, on a :class:`~nvfp4_mla.ops.library.KernelLibrary` (the process's by default).

- :mod:`.writers` (the four writer entries, each with its build and kernel path; their kernel's
  build spec in :mod:`.writer_spec`);
- :mod:`.reader` (``nvfp4_dequantize_sparse_mla_cache``);
- :mod:`.entry`: what the writers and the reader are made from, one description an entry (their
  custom ops and fakes, the dispatch to the kernel path or the reference, their registry entry);
- :mod:`.decode` (``sparse_mla_decode``), its backends (:mod:`.decode_mma`, ...) and the rule
  that picks one, and ``plan_sparse_mla_decode`` (a step's work list); what they share in
  :mod:`.decode_backend`;
- :mod:`.registry`: every op's kernels, for precompile, the CLI and CI.
"""

from .decode import SparseMlaDecodePlan, plan_sparse_mla_decode, sparse_mla_decode
from .library import DEFAULT, KernelLibrary
from .reader import nvfp4_dequantize_sparse_mla_cache
from .writers import (
    cake_dsv4_nvfp4_kv_rope_quantize_insert,
    cake_dsv4_nvfp4_rope_quantize_insert,
    nvfp4_quantize_append_sparse_mla_cache,
    nvfp4_quantize_pack_sparse_mla_cache,
)

__all__ = [
    "DEFAULT",
    "KernelLibrary",
    "SparseMlaDecodePlan",
    "cake_dsv4_nvfp4_kv_rope_quantize_insert",
    "cake_dsv4_nvfp4_rope_quantize_insert",
    "nvfp4_dequantize_sparse_mla_cache",
    "nvfp4_quantize_append_sparse_mla_cache",
    "nvfp4_quantize_pack_sparse_mla_cache",
    "plan_sparse_mla_decode",
    "sparse_mla_decode",
]
