"""The arms: one call of each way of doing a row's work, built from a library of entries.

- ``fused``: the row's nvfp4_mla entry, eager calls back to back;
- ``graph``: the same calls replayed from a CUDA graph (device time without host launch cost);
- ``unfused``: torch-level RoPE of q and kv (fp32 math, BF16 result), the zero-padded ``q_out``
  copy, then the library's append kernel: what a stack without the fused writer runs;
- ``compile``: ``torch.compile`` of ``nvfp4_mla.reference``'s entry, the best a user gets
  without the library;
- ``stub``: the no-quantizer arm, the same launch from kernels whose quantizer is stubbed
  (:mod:`.stub`), graph-replayed: the kernel's own memory pattern.

A library is anything with the entries' signatures: ``nvfp4_mla.ops`` (the kernels),
``nvfp4_mla.reference`` (what the CPU tests use), :func:`compiled_reference` or
``stub.kernel_library`` (the entries on other kernels). A new arm is a :func:`fused_call` on its
own library: its name and title go into :data:`ARM_TITLES` and its measurement into
``run.measure_row``; the CSV and the tables follow :data:`ARM_TITLES`.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, NamedTuple, Protocol

import torch

from .. import abi, reference
from .grid import Row
from .inputs import Inputs

ARM_TITLES = {
    "fused": "fused, eager",
    "graph": "fused, CUDA graph",
    "unfused": "unfused (torch RoPE + append)",
    "compile": "torch.compile(reference)",
    "stub": "no quantizer (stub kernels), CUDA graph",
}
EAGER_RATIO_ARMS = ("graph", "unfused", "compile")  # each reported as its time / the fused eager time

Call = Callable[[Inputs], object]


class Library(Protocol):
    """The writer entries an arm calls (``nvfp4_mla.ops`` and ``nvfp4_mla.reference`` are ones)."""

    @property
    def cake_dsv4_nvfp4_rope_quantize_insert(self) -> Callable[..., Any]: ...

    @property
    def cake_dsv4_nvfp4_kv_rope_quantize_insert(self) -> Callable[..., Any]: ...

    @property
    def nvfp4_quantize_append_sparse_mla_cache(self) -> Callable[..., Any]: ...

    @property
    def nvfp4_quantize_pack_sparse_mla_cache(self) -> Callable[..., Any]: ...


def fused_call(row: Row, lib: Library, cos_sin: torch.Tensor) -> Call:
    """One call of the row's entry taken from ``lib``."""
    if row.entry in ("main", "inplace"):
        entry = lib.cake_dsv4_nvfp4_rope_quantize_insert
        in_place = row.entry == "inplace"
        return lambda x: entry(
            x.q,
            x.kv,
            x.cache,
            x.slot_mapping,
            x.positions,
            cos_sin,
            q_head_padded=row.q_head_padded,
            q_inplace=in_place,
        )
    if row.entry == "kv":
        kv_entry = lib.cake_dsv4_nvfp4_kv_rope_quantize_insert
        return lambda x: kv_entry(
            x.kv, x.cache, x.slot_mapping, x.positions, cos_sin, compress_ratio=row.compress_ratio
        )
    if row.entry == "pack":  # the kv rows as whole pages; the new cache is returned
        pack = lib.nvfp4_quantize_pack_sparse_mla_cache
        return lambda x: pack(x.kv.view(-1, row.page_size, abi.HEAD_DIM))
    append = lib.nvfp4_quantize_append_sparse_mla_cache
    return lambda x: append(x.kv, x.slot_mapping, x.cache)


def torch_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """GPT-J RoPE of BF16 ``x[..., 64]`` with plain fp32 torch ops, rounded to BF16.

    What a stack without the fused writer runs. ``reference.rope`` is the bit-exact form (one
    fma per output), but its fp64 emulation would make this peer slower than it needs to be.
    """
    xe, xo = x[..., 0::2].float(), x[..., 1::2].float()
    return torch.stack((xe * cos - xo * sin, xe * sin + xo * cos), dim=-1).flatten(-2).to(torch.bfloat16)


def _cos_sin_rows(cos_sin: torch.Tensor, rope_rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    table = cos_sin[rope_rows]
    return table[:, : abi.ROPE_PAIRS], table[:, abi.ROPE_PAIRS :]


def _roped_kv(kv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    return torch.cat((kv[:, : abi.NOPE_DIM], torch_rope(kv[:, abi.NOPE_DIM :], cos, sin)), dim=1)


def unfused_call(row: Row, lib: Library, cos_sin: torch.Tensor) -> Call | None:
    """Torch-level RoPE (and the zero-padded ``q_out`` copy) followed by ``lib``'s append kernel;
    None for the append and pack rows, which are a quantizing kernel alone."""
    append = lib.nvfp4_quantize_append_sparse_mla_cache
    nope = abi.NOPE_DIM

    def main(x: Inputs) -> torch.Tensor:
        assert x.q is not None
        cos, sin = _cos_sin_rows(cos_sin, x.positions)
        q_out = torch.empty(row.num_tokens, row.q_head_padded, abi.HEAD_DIM, dtype=torch.bfloat16, device=x.q.device)
        if row.q_head_padded > row.num_heads:
            q_out[:, row.num_heads :].zero_()
        q_out[:, : row.num_heads, :nope] = x.q[..., :nope]
        q_out[:, : row.num_heads, nope:] = torch_rope(x.q[..., nope:], cos[:, None], sin[:, None])
        append(_roped_kv(x.kv, cos, sin), x.slot_mapping, x.cache)
        return q_out

    def in_place(x: Inputs) -> torch.Tensor:
        assert x.q is not None
        cos, sin = _cos_sin_rows(cos_sin, x.positions)
        x.q[..., nope:] = torch_rope(x.q[..., nope:], cos[:, None], sin[:, None])
        append(_roped_kv(x.kv, cos, sin), x.slot_mapping, x.cache)
        return x.q

    def kv_only(x: Inputs) -> None:
        # The KV entry's ratio test with tensor ops (no host sync): skipped rows get slot -1.
        ratio = row.compress_ratio
        rope_rows = torch.div(x.positions, ratio, rounding_mode="floor") * ratio
        slots = torch.where((x.positions + 1) % ratio == 0, x.slot_mapping, -1) if ratio > 1 else x.slot_mapping
        cos, sin = _cos_sin_rows(cos_sin, rope_rows)
        append(_roped_kv(x.kv, cos, sin), slots, x.cache)

    calls: dict[str, Call] = {"main": main, "inplace": in_place, "kv": kv_only}
    return calls.get(row.entry)


class Entries(NamedTuple):
    """A :class:`Library` made of callables (the reference through ``torch.compile``, say)."""

    cake_dsv4_nvfp4_rope_quantize_insert: Callable[..., Any]
    cake_dsv4_nvfp4_kv_rope_quantize_insert: Callable[..., Any]
    nvfp4_quantize_append_sparse_mla_cache: Callable[..., Any]
    nvfp4_quantize_pack_sparse_mla_cache: Callable[..., Any]


@functools.cache
def compiled_reference() -> Entries:
    """``torch.compile(..., dynamic=False)`` of the reference entries (graph breaks allowed: the
    reference indexes with data-dependent masks). Built once per process."""
    config = torch._dynamo.config
    # dynamic=False compiles once per shape; the grid has more shapes than dynamo's default limit
    # of 8, past which it would silently run the reference eagerly.
    for names in (
        ("recompile_limit", "cache_size_limit"),
        ("accumulated_recompile_limit", "accumulated_cache_size_limit"),
    ):
        name = next((n for n in names if hasattr(config, n)), None)
        if name is not None:
            setattr(config, name, 4096)
    return Entries(*(torch.compile(getattr(reference, name), dynamic=False) for name in Entries._fields))


def same_outputs(call_a: Call, call_b: Call, inputs: Inputs) -> bool:
    """Whether two arms write the same bytes (cache, q in place, returned ``q_out``) from the same
    state."""
    a, b = inputs.clone_written(), inputs.clone_written()
    out_a, out_b = call_a(a), call_b(b)
    same = torch.equal(a.cache, b.cache)
    if a.q is not None and b.q is not None:
        same = same and torch.equal(a.q.view(torch.int16), b.q.view(torch.int16))
    if isinstance(out_a, torch.Tensor) and isinstance(out_b, torch.Tensor):
        same = same and out_a.shape == out_b.shape and torch.equal(out_a.view(torch.int16), out_b.view(torch.int16))
    return same
