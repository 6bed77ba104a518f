"""Pure-torch reference of every entry: the definition of the correct bytes (docs/format.md sections 2-5).

Readable and vectorized over rows, heads and groups; runs on the CPU or on CUDA tensors, and
every GPU entry is tested byte for byte against it.
"""

from .decode import sparse_mla_decode
from .numerics import (
    E2M1_VALUES,
    R6,
    bf16_nan,
    e2m1_code,
    e2m1_value,
    e4m3_code,
    e4m3_value,
    flush_subnormal,
    fma_f32,
    group_amax,
    mul_f32,
    quantize_nope,
    quantize_rows,
    rope,
    rope_table,
    to_bf16,
)
from .reader import nvfp4_dequantize_sparse_mla_cache
from .writers import (
    cake_dsv4_nvfp4_kv_rope_quantize_insert,
    cake_dsv4_nvfp4_rope_quantize_insert,
    new_cache,
    nvfp4_quantize_append_sparse_mla_cache,
    nvfp4_quantize_pack_sparse_mla_cache,
)

__all__ = [
    "E2M1_VALUES",
    "R6",
    "bf16_nan",
    "cake_dsv4_nvfp4_kv_rope_quantize_insert",
    "cake_dsv4_nvfp4_rope_quantize_insert",
    "e2m1_code",
    "e2m1_value",
    "e4m3_code",
    "e4m3_value",
    "flush_subnormal",
    "fma_f32",
    "group_amax",
    "mul_f32",
    "new_cache",
    "nvfp4_dequantize_sparse_mla_cache",
    "nvfp4_quantize_append_sparse_mla_cache",
    "nvfp4_quantize_pack_sparse_mla_cache",
    "quantize_nope",
    "quantize_rows",
    "rope",
    "rope_table",
    "sparse_mla_decode",
    "to_bf16",
]
