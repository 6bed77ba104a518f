"""Test support: inputs, canary caches, and byte-exact checks of an entry against the reference.

The one home of what the test suite, ``benchmarks/`` (soak, sanitizer workload), the command line
and the benchmark share. Importing it needs neither a GPU nor pytest.

A check (:func:`check`) runs an entry on clones of its inputs, caches filled with the
:data:`CANARY` byte (pool padding included), and :mod:`nvfp4_mla.reference` on other clones, then
compares the returned tensor and every byte of every argument's storage. A difference is reported
by slot, page and record field (docs/format.md section 3) or by element.

- :mod:`.inputs`: RoPE tables, random and crafted rows, slots, positions, canary caches, :class:`Case`;
- :mod:`.checks`: storage bytes, byte locators, :func:`check`;
- :mod:`.kernels`: kernels kept in memory (:class:`MemoryKernels`), among them
  :class:`VirtualArchKernels`, an older GPU's kernel code paths on this one; a forced writer
  grid (:func:`one_kv_block`), for a :class:`nvfp4_mla.KernelLibrary`;
- :mod:`.soak`: the soak loop of ``benchmarks/soak.py`` (import it by name).
"""

from ..reference import rope_table
from .checks import (
    Locator,
    assert_same,
    bits,
    bytes_mismatch,
    cache_locator,
    check,
    check_case,
    clone,
    dirty_allocator,
    e4m3_byte,
    element_locator,
    flat_bytes,
    raw_bytes,
    record_offsets,
    run_reference,
    storage_bytes,
    synchronize,
)
from .inputs import (
    ARG_NAMES,
    CANARY,
    ENTRIES,
    SPECIAL_BITS,
    Case,
    args_of,
    crafted_rows,
    make_cache,
    make_inputs,
    make_positions,
    make_slots,
    make_table,
    random_rows,
    random_slots,
)
from .kernels import MemoryKernels, VirtualArchKernels, one_kv_block

__all__ = [
    "ARG_NAMES",
    "CANARY",
    "ENTRIES",
    "SPECIAL_BITS",
    "Case",
    "Locator",
    "MemoryKernels",
    "VirtualArchKernels",
    "args_of",
    "assert_same",
    "bits",
    "bytes_mismatch",
    "cache_locator",
    "check",
    "check_case",
    "clone",
    "crafted_rows",
    "dirty_allocator",
    "e4m3_byte",
    "element_locator",
    "flat_bytes",
    "make_cache",
    "make_inputs",
    "make_positions",
    "make_slots",
    "make_table",
    "one_kv_block",
    "random_rows",
    "random_slots",
    "raw_bytes",
    "record_offsets",
    "rope_table",
    "run_reference",
    "storage_bytes",
    "synchronize",
]
