"""nvfp4-mla: one-launch CUDA kernels that write and read the DeepSeek-V4 NVFP4 paged latent-KV cache.

The entries below take CUDA tensors and run one run-time-compiled kernel on torch's current
stream; ``nvfp4_mla.reference`` has the same entries in pure torch (any device, the definition
of the bytes). docs/format.md is the contract.
"""

import logging

from . import abi, config, reference, validation
from .device import gpu_unavailable_reason
from .geometry import Geometry, Precompiled, precompile
from .ops import (
    KernelLibrary,
    SparseMlaDecodePlan,
    cake_dsv4_nvfp4_kv_rope_quantize_insert,
    cake_dsv4_nvfp4_rope_quantize_insert,
    nvfp4_dequantize_sparse_mla_cache,
    nvfp4_quantize_append_sparse_mla_cache,
    nvfp4_quantize_pack_sparse_mla_cache,
    plan_sparse_mla_decode,
    sparse_mla_decode,
)
from .records import format_record
from .reference import rope_table

__version__ = "0.1.0"

config.log.addHandler(logging.NullHandler())  # the library logs; the application decides where

__all__ = [
    "Geometry",
    "KernelLibrary",
    "Precompiled",
    "SparseMlaDecodePlan",
    "__version__",
    "abi",
    "cake_dsv4_nvfp4_kv_rope_quantize_insert",
    "cake_dsv4_nvfp4_rope_quantize_insert",
    "format_record",
    "gpu_unavailable_reason",
    "nvfp4_dequantize_sparse_mla_cache",
    "nvfp4_quantize_append_sparse_mla_cache",
    "nvfp4_quantize_pack_sparse_mla_cache",
    "plan_sparse_mla_decode",
    "precompile",
    "reference",
    "rope_table",
    "sparse_mla_decode",
    "validation",
]
