"""The record ABI of the DeepSeek-V4 NVFP4 paged latent-KV cache (docs/format.md section 3), defined once.

A token's record is 384 bytes: a 352-byte data row (448 NoPE values as packed E2M1 codes, then the
64 RoPE values as BF16) kept with the page's other data rows, and a 32-byte scale slot (28 E4M3
group scales, 4 zero bytes) kept after all of the page's data rows.
"""

from __future__ import annotations

import torch

HEAD_DIM = 512  # latent dims of a query head or KV row
NOPE_DIM = 448  # quantized dims
ROPE_DIM = 64  # rotated dims, stored as BF16
ROPE_PAIRS = ROPE_DIM // 2  # GPT-J pairs; cos_sin_cache row = cos[32] | sin[32]

GROUP_SIZE = 16  # NoPE elements sharing one E4M3 scale
NUM_GROUPS = NOPE_DIM // GROUP_SIZE  # 28

NOPE_BYTES = NOPE_DIM // 2  # 224: two E2M1 codes a byte, element 2j in the low nibble of byte j
ROPE_BYTES = ROPE_DIM * 2  # 128
DATA_BYTES = NOPE_BYTES + ROPE_BYTES  # 352
SCALE_BYTES = 32  # 28 scales + 4 zero bytes
RECORD_BYTES = DATA_BYTES + SCALE_BYTES  # 384

PAGE_ALIGN = 16  # bytes; page stride and tensor base addresses
Q_HEAD_PADDINGS = (8, 16, 32, 64, 128)  # legal q_head_padded values besides 0
COMPRESS_RATIOS = (1, 2)
KV_LAYOUTS = ("HND", "NHD")

# A writer call inserts fewer rows than this, into a cache of fewer slots: the kernel's row and
# slot indices are 32-bit (docs/format.md section 6; 2^30 slots would be 412 GB of records).
MAX_WRITE_ROWS = 1 << 30

E4M3_MAX_CODE = 0x7E  # 448, where scales saturate
E4M3_NAN_CODE = 0x7F
BF16_NAN_BITS = 0x7FC0  # torch's NaN; written to q_out heads whose RoPE row is out of range


def data_offset(page_size: int, entry: int) -> int:
    """Byte offset of entry ``entry``'s data row inside its page."""
    return entry * DATA_BYTES


def scale_offset(page_size: int, entry: int) -> int:
    """Byte offset of entry ``entry``'s scale slot inside its page (after all data rows)."""
    return page_size * DATA_BYTES + entry * SCALE_BYTES


def record_views(cache: torch.Tensor, layout: tuple[int, int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """``[num_pages, page_size, 352]`` data-row and ``[num_pages, page_size, 32]`` scale-slot views
    of a checked cache; ``layout`` is its ``(num_pages, page_size, page_stride)``."""
    num_pages, page_size, page_stride = layout
    base = cache.storage_offset()
    data = cache.as_strided(
        (num_pages, page_size, DATA_BYTES), (page_stride, DATA_BYTES, 1), base + data_offset(page_size, 0)
    )
    scales = cache.as_strided(
        (num_pages, page_size, SCALE_BYTES), (page_stride, SCALE_BYTES, 1), base + scale_offset(page_size, 0)
    )
    return data, scales
