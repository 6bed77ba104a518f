"""Where the entries take their kernels and how they plan a call: :class:`KernelLibrary`.

The public entries use :data:`DEFAULT`, the process's kernel cache with the shipped choices. Tests
and the benchmark build their own library to run the same entries (same validation, same
launches) on other kernels (kept in memory, stubbed, PTX of an older GPU), with another writer
grid or a decode backend forced; each library has its own plan table, so nothing shipped is
patched or swapped, and ``nvfp4_mla.ops.entries(library)`` gives its entries.

A plan is what an op keeps of a call's signature (its checks, launcher, grid and scalars), so that
a warm call does one lookup. All ops share the library's one bounded table; each op prefixes its
keys with its own name.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from typing import Any

from .. import kernel_cache
from ..jit import KernelSpec
from ..launch import Launcher
from .writer_spec import WriterSpec

# (spec, num_tokens, num_kv_rows, resident_blocks, sms) -> (KV blocks, all blocks): WriterSpec.grid's signature.
GridPolicy = Callable[[WriterSpec, int, int, int, int], tuple[int, int]]

MAX_PLANS = 4096  # the table is cleared when full, so varying batch sizes cannot grow it forever


class KernelLibrary:
    """The kernels and choices the entries run with, and their plan table.

    Parameters
    ----------
    cache
        Where kernels come from (compiled there on first use); None: the process's kernel cache
        (``kernel_cache.default()``, whose layers are read from the environment at first use).
    tune
        Maps each spec an op asks for to the spec it builds (e.g. another number of KV rows a
        warp); None: as asked.
    writer_grid
        The writers' launch grid in place of ``WriterSpec.grid`` (same arguments).
    decode_backend
        The name of the ``sparse_mla_decode`` backend to use (``ops.decode.BACKENDS``); None: the
        selection rule's choice.
    decode_head_tile
        Heads a block of the ``mma_sync`` kernel (16, 32 or 64); None: the plan's choice. A call
        that runs another backend with it set is refused.
    decode_parts
        The parts of the decode's work list, 1 to ``ops.decode.MAX_LIST_PARTS``: a block per part,
        head tile and dim part, each walking its part's segments (a call without length tensors
        then deals its rows' tiles as the scheduler does); None: as many parts as fill the GPU at
        once (without length tensors, the split of the rows by the tables' widths).
    decode_dim_parts
        The parts of a row's 512 output dims for the decode, an item (and block) each: 1, or 2
        (the ``wgmma_sm90`` kernel's half rows); None: the plan's choice. A call whose backend
        has no such form is refused.
    """

    __slots__ = (
        "_cache",
        "decode_backend",
        "decode_dim_parts",
        "decode_head_tile",
        "decode_parts",
        "plans",
        "tune",
        "writer_grid",
    )

    def __init__(
        self,
        cache: kernel_cache.KernelCache | None = None,
        *,
        tune: Callable[[Any], Any] | None = None,
        writer_grid: GridPolicy | None = None,
        decode_backend: str | None = None,
        decode_head_tile: int | None = None,
        decode_parts: int | None = None,
        decode_dim_parts: int | None = None,
    ):
        self._cache = cache
        self.tune = tune
        self.writer_grid = writer_grid
        self.decode_backend = decode_backend
        self.decode_head_tile = decode_head_tile
        self.decode_parts = decode_parts
        self.decode_dim_parts = decode_dim_parts
        # Keyed by (op name, ...): the one lookup a warm call does. Read directly on the hot path.
        self.plans: dict[Hashable, Any] = {}

    @property
    def cache(self) -> kernel_cache.KernelCache:
        return kernel_cache.default() if self._cache is None else self._cache

    def spec(self, spec: Any) -> Any:
        """The spec built for ``spec`` (after :attr:`tune`)."""
        return spec if self.tune is None else self.tune(spec)

    def launcher(self, device_index: int, spec: KernelSpec) -> Launcher:
        """The loaded kernel of ``spec`` (already tuned) on ``device_index``."""
        return self.cache.launcher(device_index, spec)

    def grid(self, spec: WriterSpec, num_tokens: int, num_kv_rows: int, launcher: Launcher) -> tuple[int, int]:
        """The writer's (KV blocks, all blocks) of a launch of ``launcher``."""
        args = (num_tokens, num_kv_rows, launcher.resident_blocks, launcher.device.sms)
        return spec.grid(*args) if self.writer_grid is None else self.writer_grid(spec, *args)

    def remember(self, key: Hashable, plan: Any) -> Any:
        """Stores and returns ``plan`` under ``key`` (a plan miss; the table is bounded)."""
        if len(self.plans) >= MAX_PLANS:
            self.plans.clear()
        self.plans[key] = plan
        return plan


DEFAULT = KernelLibrary()


def check_traceable(library: KernelLibrary | None) -> None:
    """An entry traced by torch.compile runs its custom op, which uses :data:`DEFAULT`."""
    if library is not None:
        raise ValueError("library= is for eager calls: torch.compile traces the entries on the default library")
