"""The ops on the GPU: one module per op, each its validation, planning, launch and torch custom
ops, on a :class:`~nvfp4_mla.ops.library.KernelLibrary` (the process's by default).

- :mod:`.writers` (the four writer entries, each with its build and kernel path; their kernel's
  build spec in :mod:`.writer_spec`) and :mod:`.writer_api` (their public functions);
- :mod:`.reader` (``nvfp4_dequantize_sparse_mla_cache``);
- :mod:`.entry`: what the writers and the reader are made from, one description an entry (their
  custom ops and fakes, the dispatch to the kernel path or the reference, their registry entry);
- :mod:`.decode` (``sparse_mla_decode``), its backends (:mod:`.decode_mma`, ...) and the rule
  that picks one, and ``plan_sparse_mla_decode`` (a step's work list); what they share in
  :mod:`.decode_backend`;
- :mod:`.registry`: every op's kernels, for precompile, the CLI and CI.
"""

# Names are exported by the PEP 484 forms (``import x as x``, a star import of a module's
# ``__all__``), not by an ``__all__`` here: a writer entry is then listed once, in
# ``writer_api.__all__``, and type checkers still see each name (mypy matches a module against a
# Protocol only by these).
from .decode import SparseMlaDecodePlan as SparseMlaDecodePlan
from .decode import plan_sparse_mla_decode as plan_sparse_mla_decode
from .decode import sparse_mla_decode as sparse_mla_decode
from .library import DEFAULT as DEFAULT
from .library import KernelLibrary as KernelLibrary
from .reader import nvfp4_dequantize_sparse_mla_cache as nvfp4_dequantize_sparse_mla_cache
from .writer_api import *  # noqa: F403
