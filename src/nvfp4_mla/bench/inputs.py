"""Random inputs of one row, and the rows a call of them inserts."""

from __future__ import annotations

from typing import NamedTuple

import torch

from .. import abi
from .grid import MAX_POSITION, Row


class Inputs(NamedTuple):
    """One call's tensors, named like the entries' arguments (``q`` is None without heads)."""

    q: torch.Tensor | None
    kv: torch.Tensor
    cache: torch.Tensor
    slot_mapping: torch.Tensor
    positions: torch.Tensor

    def clone_written(self) -> Inputs:
        """A copy of what an entry writes (the cache, q in place); the read-only tensors are shared."""
        return self._replace(q=None if self.q is None else self.q.clone(), cache=self.cache.clone())


def make_inputs(row: Row, device: torch.device | str, max_position: int = MAX_POSITION) -> Inputs:
    """Random BF16 rows; positions uniform over the table; slots a random permutation of a pool one
    page larger than the tokens need; a zeroed ``[num_pages, page_size, 384]`` cache."""
    tokens = row.num_tokens
    num_pages = -(-tokens // row.page_size) + 1
    q = torch.randn(tokens, row.num_heads, abi.HEAD_DIM, device=device).to(torch.bfloat16) if row.num_heads else None
    kv = torch.randn(tokens, abi.HEAD_DIM, device=device).to(torch.bfloat16)
    slot_mapping = torch.randperm(num_pages * row.page_size, device=device)[:tokens].to(row.slot_dtype)
    positions = torch.randint(0, max_position, (tokens,), device=device)
    cache = torch.zeros(num_pages, row.page_size, abi.RECORD_BYTES, dtype=torch.uint8, device=device)
    return Inputs(q, kv, cache, slot_mapping, positions)


def inserted_rows(row: Row, sets: list[Inputs]) -> float:
    """Mean number of rows a call inserts (with ``compress_ratio`` 2, the KV entry inserts only the
    rows whose position + 1 is even)."""
    if row.compress_ratio == 1:
        return float(row.num_tokens)
    counts = [int(((s.positions + 1) % row.compress_ratio == 0).sum()) for s in sets]
    return sum(counts) / len(counts)
