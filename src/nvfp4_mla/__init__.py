"""nvfp4-mla: one-launch CUDA writers of the DeepSeek-V4 NVFP4 paged latent-KV cache.

The entries below take CUDA tensors and run one run-time-compiled kernel on torch's current
stream; ``nvfp4_mla.reference`` has the same entries in pure torch (any device, the definition
of the bytes). SPEC.md is the contract.
"""

from . import abi, reference, validation  # noqa: F401
from .ops import (  # noqa: F401
    Geometry,
    cake_dsv4_nvfp4_kv_rope_quantize_insert,
    cake_dsv4_nvfp4_rope_quantize_insert,
    nvfp4_dequantize_sparse_mla_cache,
    nvfp4_quantize_append_sparse_mla_cache,
    nvfp4_quantize_pack_sparse_mla_cache,
    precompile,
)

__version__ = "0.1.0"
