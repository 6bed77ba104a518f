"""nvfp4-mla: one-launch CUDA kernels that write and read the DeepSeek-V4 NVFP4 paged latent-KV cache.

The entries below take CUDA tensors and run one run-time-compiled kernel on torch's current
stream; ``nvfp4_mla.reference`` has the same entries in pure torch (any device, the definition
of the bytes). docs/format.md is the contract.

The names load on first use (PEP 562), so ``import nvfp4_mla`` alone loads no torch: the
``nvfp4-mla`` command handles a Ctrl-C from its first line on (:mod:`nvfp4_mla.__main__`).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

if TYPE_CHECKING:  # what type checkers see; at run time __getattr__ imports each name on first use
    from . import abi, reference, validation
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

# Each public name and the module that holds it (for a module, the module itself).
_HOMES = {
    "Geometry": ".geometry",
    "KernelLibrary": ".ops",
    "Precompiled": ".geometry",
    "SparseMlaDecodePlan": ".ops",
    "abi": ".abi",
    "cake_dsv4_nvfp4_kv_rope_quantize_insert": ".ops",
    "cake_dsv4_nvfp4_rope_quantize_insert": ".ops",
    "format_record": ".records",
    "gpu_unavailable_reason": ".device",
    "nvfp4_dequantize_sparse_mla_cache": ".ops",
    "nvfp4_quantize_append_sparse_mla_cache": ".ops",
    "nvfp4_quantize_pack_sparse_mla_cache": ".ops",
    "plan_sparse_mla_decode": ".ops",
    "precompile": ".geometry",
    "reference": ".reference",
    "rope_table": ".reference",
    "sparse_mla_decode": ".ops",
    "validation": ".validation",
}

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

if not TYPE_CHECKING:  # hidden from type checkers, so that a misspelt name stays an error there

    def __getattr__(name: str) -> Any:
        """A public name, imported on first use and kept; or a submodule (``nvfp4_mla.ops``), which
        ``import nvfp4_mla`` alone used to load."""
        home = _HOMES.get(name)
        if home is not None:
            module = importlib.import_module(home, __name__)
            value = module if home == f".{name}" else getattr(module, name)
            globals()[name] = value
            return value
        if name.isidentifier() and not name.startswith("__"):
            try:
                return importlib.import_module(f".{name}", __name__)
            except ModuleNotFoundError as exc:
                if exc.name != f"{__name__}.{name}":
                    raise  # the submodule is there; something it imports is not
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
