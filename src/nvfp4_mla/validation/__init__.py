"""Argument checks (docs/format.md section 6), shared by the reference and the kernel path: one
module per op (``writers``, ``reader``, ``decode``) on the shared checks of ``common``.

Every public entry calls its op's ``check_*`` function before anything else happens; a bad
argument raises ``ValueError`` with a message that names the fix.
"""

from .common import (
    CacheLayout,
    PointerChecks,
    cache_extent,
    check_cache,
    check_flag,
    check_mutable,
    check_pointers,
    check_tensors,
    dense,
    signature,
)
from .decode import check_decode, check_decode_plan
from .reader import READ_DTYPES, check_dequantize, check_read_dtype
from .writers import (
    MAX_PAGE_SIZE,
    PACK_POINTER_CHECKS,
    append_pointer_checks,
    check_append,
    check_compress_ratio,
    check_kv,
    check_main,
    check_pack,
    check_page_size,
    check_q_options,
    check_slot_dtype,
    debug_check_rows,
    kv_pointer_checks,
    main_pointer_checks,
)

__all__ = [
    "MAX_PAGE_SIZE",
    "PACK_POINTER_CHECKS",
    "READ_DTYPES",
    "CacheLayout",
    "PointerChecks",
    "append_pointer_checks",
    "cache_extent",
    "check_append",
    "check_cache",
    "check_compress_ratio",
    "check_decode",
    "check_decode_plan",
    "check_dequantize",
    "check_flag",
    "check_kv",
    "check_main",
    "check_mutable",
    "check_pack",
    "check_page_size",
    "check_pointers",
    "check_q_options",
    "check_read_dtype",
    "check_slot_dtype",
    "check_tensors",
    "debug_check_rows",
    "dense",
    "kv_pointer_checks",
    "main_pointer_checks",
    "signature",
]
