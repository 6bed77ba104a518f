"""Pure-torch reference of every entry: the definition of the correct bytes (docs/format.md sections 2-5).

Readable and vectorized over rows, heads and groups; runs on the CPU or on CUDA tensors, and
every GPU entry is tested byte for byte against it.
"""

# Exported as nvfp4_mla.ops exports its names (see there): each writer's reference is listed once,
# in ``writers.__all__``.
from .decode import sparse_mla_decode as sparse_mla_decode
from .numerics import *  # noqa: F403
from .reader import nvfp4_dequantize_sparse_mla_cache as nvfp4_dequantize_sparse_mla_cache
from .writers import *  # noqa: F403
