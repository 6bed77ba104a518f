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
    from . import abi as abi
    from . import reference as reference
    from . import validation as validation
    from .device import gpu_unavailable_reason as gpu_unavailable_reason
    from .geometry import Geometry as Geometry
    from .geometry import Precompiled as Precompiled
    from .geometry import precompile as precompile
    from .ops import KernelLibrary as KernelLibrary
    from .ops import SparseMlaDecodePlan as SparseMlaDecodePlan
    from .ops import nvfp4_dequantize_sparse_mla_cache as nvfp4_dequantize_sparse_mla_cache
    from .ops import plan_sparse_mla_decode as plan_sparse_mla_decode
    from .ops import sparse_mla_decode as sparse_mla_decode
    from .ops.writer_api import *  # noqa: F403  (the writer entries)
    from .records import format_record as format_record
    from .reference import rope_table as rope_table

    __all__: list[str]

# Each public name but the writer entries and the module that holds it (for a module, the module
# itself). The writer entries are listed once, in ``ops.writer_api.__all__``; so ``__all__`` is
# made on first use (PEP 562), and asking for it, or for dir(), loads torch.
_HOMES = {
    "Geometry": ".geometry",
    "KernelLibrary": ".ops",
    "Precompiled": ".geometry",
    "SparseMlaDecodePlan": ".ops",
    "abi": ".abi",
    "format_record": ".records",
    "gpu_unavailable_reason": ".device",
    "nvfp4_dequantize_sparse_mla_cache": ".ops",
    "plan_sparse_mla_decode": ".ops",
    "precompile": ".geometry",
    "reference": ".reference",
    "rope_table": ".reference",
    "sparse_mla_decode": ".ops",
    "validation": ".validation",
}


def _public_names() -> list[str]:
    from .ops import writer_api

    return sorted(["__version__", *_HOMES, *writer_api.__all__])


if not TYPE_CHECKING:  # hidden from type checkers, so that a misspelt name stays an error there

    def __getattr__(name: str) -> Any:
        """A public name, imported on first use and kept; ``__all__``; or a submodule
        (``nvfp4_mla.ops``), which ``import nvfp4_mla`` alone used to load."""
        if name == "__all__":
            value = _public_names()
        elif name in _HOMES:
            module = importlib.import_module(_HOMES[name], __name__)
            value = module if _HOMES[name] == f".{name}" else getattr(module, name)
        elif name.isidentifier() and not name.startswith("__"):
            try:
                return importlib.import_module(f".{name}", __name__)
            except ModuleNotFoundError as exc:
                if exc.name != f"{__name__}.{name}":
                    raise  # the submodule is there; something it imports is not
            if name.startswith("_") or name not in _public_names():  # probes (IPython's _repr_*_) load no torch
                raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
            value = getattr(importlib.import_module(".ops", __name__), name)
        else:
            raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
        globals()[name] = value
        return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_public_names()})
