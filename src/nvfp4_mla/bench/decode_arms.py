"""The fused decode benchmark's inputs and arms (:mod:`.decode`, :mod:`.decode_ragged`): two pools
written from the same random BF16 rows by the pack entry, one call's arguments, and the three ways
to attend over them.

**Arms**:

- ``fused``: this kernel on the NVFP4 caches;
- ``torch_bf16``: what a user writes on a BF16 cache: ``index_select`` the rows of both pools,
  ``cat``, ``matmul`` (BF16), fp32 scores with the invalid-slot mask, ``logsumexp``, weights to
  BF16, ``matmul``, sink factor;
- ``torch_reader``: the same on this cache through the reader
  (``nvfp4_dequantize_sparse_mla_cache(..., dtype=bfloat16, invalid=0.0)`` per pool).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from types import ModuleType

import torch

import nvfp4_mla

from .. import abi

PAGE_SIZE = 64
SWA_K = 128
SWA_TOKENS, EXTRA_TOKENS = 1 << 18, 1 << 20
SM_SCALE = (abi.HEAD_DIM + abi.ROPE_DIM) ** -0.5
BF16 = torch.bfloat16


class Pools:
    """The two pools, as BF16 tables and as NVFP4 caches holding the same rows, written by
    ``library``'s pack entry (the CPU tests give small pools and ``nvfp4_mla.reference``)."""

    def __init__(
        self,
        device: torch.device | str = "cuda",
        tokens: tuple[int, int] = (SWA_TOKENS, EXTRA_TOKENS),
        library: ModuleType = nvfp4_mla,
    ):
        self.tables: list[torch.Tensor] = []
        self.caches: list[torch.Tensor] = []
        for count in tokens:
            table = torch.randn(count // PAGE_SIZE, PAGE_SIZE, abi.HEAD_DIM, device=device, dtype=BF16)
            self.caches.append(library.nvfp4_quantize_pack_sparse_mla_cache(table))
            self.tables.append(table.view(count, abi.HEAD_DIM))


class Inputs:
    """One call's arguments, slots drawn over the pools' tokens."""

    def __init__(self, batch: int, q_len: int, heads: int, extra_k: int, g: torch.Generator, pools: Pools) -> None:
        device = pools.tables[0].device
        self.q = torch.randn(batch, q_len, heads, abi.HEAD_DIM, generator=g).to(device, BF16)
        self.slots = [
            torch.randint(0, len(table), (batch, q_len, k), generator=g, dtype=torch.int32).to(device)
            for table, k in zip(pools.tables, (SWA_K, extra_k))
        ]
        self.sinks = torch.randn(heads, generator=g).to(device)


def fused(
    pools: Pools,
    x: Inputs,
    library: nvfp4_mla.KernelLibrary | None = None,
    extra_lens: torch.Tensor | None = None,
    plan: nvfp4_mla.SparseMlaDecodePlan | None = None,
    batch_invariant: bool | None = None,
    swa_lens: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """This kernel on the NVFP4 caches (on ``library``: default the process's), with the pools'
    live counts ``swa_lens`` and ``extra_lens``, a step's ``plan`` and ``batch_invariant`` where
    given."""
    return nvfp4_mla.sparse_mla_decode(
        x.q,
        pools.caches[0],
        x.slots[0],
        swa_lens=swa_lens,
        extra_cache=pools.caches[1],
        extra_slots=x.slots[1],
        extra_lens=extra_lens,
        sm_scale=SM_SCALE,
        sinks=x.sinks,
        library=library,
        plan=plan,
        batch_invariant=batch_invariant,
    )


def attend(
    q: torch.Tensor, rows: torch.Tensor, valid: torch.Tensor, sinks: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The torch attention a user writes on gathered BF16 rows ``[batch, q_len, k, 512]``."""
    scores = torch.matmul(q, rows.transpose(-1, -2)).float() * SM_SCALE
    scores = scores.masked_fill(~valid[:, :, None, :], -math.inf)
    lse = torch.logsumexp(scores, dim=-1)
    weights = torch.exp(scores - lse[..., None]).to(BF16)
    out = torch.matmul(weights, rows) * (1.0 / (1.0 + torch.exp(sinks - lse)))[..., None]
    return out.to(BF16), lse


def torch_bf16(pools: Pools, x: Inputs) -> tuple[torch.Tensor, torch.Tensor]:
    """``index_select`` of the BF16 tables, then :func:`attend`."""
    parts, valid = [], []
    for table, slots in zip(pools.tables, x.slots):
        ok = (slots >= 0) & (slots < table.shape[0])
        index = torch.where(ok, slots, 0).view(-1)
        parts.append(torch.index_select(table, 0, index).view(*slots.shape, abi.HEAD_DIM))
        valid.append(ok)
    return attend(x.q, torch.cat(parts, dim=2), torch.cat(valid, dim=2), x.sinks)


def torch_reader(pools: Pools, x: Inputs) -> tuple[torch.Tensor, torch.Tensor]:
    """The reader on each NVFP4 cache, then :func:`attend`."""
    parts, valid = [], []
    for cache, slots, table in zip(pools.caches, x.slots, pools.tables):
        parts.append(nvfp4_mla.nvfp4_dequantize_sparse_mla_cache(cache, slots, dtype=BF16, invalid=0.0))
        valid.append((slots >= 0) & (slots < table.shape[0]))
    return attend(x.q, torch.cat(parts, dim=2), torch.cat(valid, dim=2), x.sinks)


Arm = Callable[[Pools, Inputs], tuple[torch.Tensor, torch.Tensor]]
ARMS: dict[str, Arm] = {"fused": fused, "torch_bf16": torch_bf16, "torch_reader": torch_reader}
