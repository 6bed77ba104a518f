"""Reference sparse-decode attention over the NVFP4 cache: the DeepSeek-V4 sparse MLA decode.

Pure torch on any device, and the definition that a fused decode kernel is compared with (with a
tolerance: the kernel accumulates in fp32 in its own order).

**Semantics.** Queries ``q[batch, q_len, heads, 512]`` attend to one shared latent KV head, whose
rows are both the keys and the values (512 dims). Each query row ``(b, l)`` gathers up to ``k``
rows from each of up to two caches (a sliding-window pool and an extra, compressed pool) through
its own slot tables ``[batch, q_len, k]``.

- An entry ``j`` of a table is *live* when its slot is valid (``0 <= slot < num_pages *
  page_size``, the reader's rule) and ``j < lens[b, l]`` (lengths clamped to ``[0, k]``; no lengths:
  every entry counts). Masked entries contribute exactly nothing and their records are never used:
  a NaN record in a masked position cannot leak.
- Scores: ``s_j = (q . row_j) * sm_scale`` over the 512 dims for live entries, ``-inf`` for masked
  ones. ``lse = log(sum_j exp(s_j))`` (natural log, over both pools, before the sink).
- Output: ``sum_j exp(s_j - lse) * row_j``, times ``1 / (1 + exp(sink_h - lse))`` when per-head
  ``sinks`` are given (the attention sink: an extra logit with a zero value row).
- A query row with no live entry ("lonely") outputs 0 and ``lse = +inf``.
- ``out`` is the attention output *before* the inverse RoPE that DeepSeek-V4 applies to its last
  64 dims.

**Precision.** The rows are the reader's exact values (:mod:`.reader`). Scores, the log-sum-exp,
the weights, the weighted sum and the sink factor are computed in float64 (the products of BF16
queries and row values are exact there). ``out`` is then rounded to fp32 and to BF16 (nearest even
both times; NaN is BF16 ``0x7FC0``); ``lse`` is rounded to fp32 (NaN ``0x7FC00000``). So the
reference's own error is essentially its final rounding, and a kernel's tolerance measures the
kernel. ``sm_scale`` is used as the Python float it is.
"""

from __future__ import annotations

import torch

from .. import validation
from .numerics import to_bf16
from .reader import canonicalize_nan, nvfp4_dequantize_sparse_mla_cache


def live_entries(slots: torch.Tensor, lens: torch.Tensor | None, capacity: int) -> torch.Tensor:
    """Which entries of a slot table ``[..., k]`` count: a valid slot (``0 <= slot < capacity``)
    among the first ``lens`` (clamped to ``[0, k]``; None: all ``k``). bool, the table's shape."""
    live = (slots >= 0) & (slots < capacity)
    if lens is not None:
        position = torch.arange(slots.shape[-1], device=slots.device)
        live &= position < lens[..., None]  # lens < 0 keeps nothing, lens > k everything: the clamp
    return live


def gather_rows(
    cache: torch.Tensor, slots: torch.Tensor, lens: torch.Tensor | None, capacity: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """The fp32 rows ``[..., k, 512]`` of a slot table's live entries (zeros elsewhere: masked
    entries are read as invalid slots, so their records are never looked at) and the live mask."""
    live = live_entries(slots, lens, capacity)
    rows = nvfp4_dequantize_sparse_mla_cache(cache, torch.where(live, slots, -1), invalid=0.0)
    return rows, live


def masked_scores(q: torch.Tensor, rows: torch.Tensor, live: torch.Tensor, sm_scale: float) -> torch.Tensor:
    """float64 scores ``[batch, q_len, heads, k]``: ``(q . row) * sm_scale``, ``-inf`` where not live.

    ``q`` is ``[batch, q_len, heads, 512]``, ``rows`` ``[batch, q_len, k, 512]`` (finite where not
    live), ``live`` ``[batch, q_len, k]``.
    """
    scores = torch.einsum("blhd,blkd->blhk", q.double(), rows.double()) * sm_scale
    return scores.masked_fill(~live[:, :, None, :], -torch.inf)


def attention_output(
    scores: torch.Tensor, rows: torch.Tensor, live: torch.Tensor, sinks: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """float64 ``out [batch, q_len, heads, 512]`` and ``lse [batch, q_len, heads]`` of
    :func:`masked_scores`: softmax through the log-sum-exp, the sink factor, lonely rows (0, +inf)."""
    lonely = ~live.any(dim=-1)[:, :, None]  # [batch, q_len, 1]: no live entry in any pool
    lse = torch.logsumexp(scores, dim=-1)
    weights = torch.exp(scores - torch.where(lonely, 0.0, lse)[..., None])  # masked: exp(-inf) = 0
    out = torch.einsum("blhk,blkd->blhd", weights, rows.double())
    if sinks is not None:
        out = out / (1.0 + torch.exp(sinks.double() - lse))[..., None]
    out = torch.where(lonely[..., None], 0.0, out)
    return out, torch.where(lonely, torch.inf, lse)


def sparse_mla_decode(
    q: torch.Tensor,
    swa_cache: torch.Tensor,
    swa_slots: torch.Tensor,
    *,
    swa_lens: torch.Tensor | None = None,
    extra_cache: torch.Tensor | None = None,
    extra_slots: torch.Tensor | None = None,
    extra_lens: torch.Tensor | None = None,
    sm_scale: float,
    sinks: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sparse MLA decode attention over one or two NVFP4 caches (semantics in the module docstring).

    Parameters
    ----------
    q
        BF16 ``[batch, q_len, heads, 512]``, contiguous.
    swa_cache, swa_slots
        The sliding-window pool: a cache (docs/format.md section 3) and its int32/int64 slot table
        ``[batch, q_len, k]`` (``k >= 1``; invalid slots are masked).
    swa_lens
        Optional int32 or int64 ``[batch, q_len]``: only the first ``lens`` entries of a row count.
    extra_cache, extra_slots, extra_lens
        The optional second (compressed) pool, likewise; its ``k`` may differ.
    sm_scale
        The softmax scale applied to ``q . row``.
    sinks
        Optional fp32 ``[heads]`` attention-sink logits.
    out
        Optional BF16 ``[batch, q_len, heads, 512]`` output to fill (contiguous, on q's device,
        sharing no memory with the inputs), as in :func:`nvfp4_mla.sparse_mla_decode`. It is
        returned, holding the same values as the result of the call without ``out``.

    Returns
    -------
    tuple[torch.Tensor, torch.Tensor]
        ``out``, BF16 ``[batch, q_len, heads, 512]`` (before the inverse RoPE of the last 64 dims;
        the given ``out`` when there is one), and ``lse``, fp32 ``[batch, q_len, heads]`` (natural
        log of the scaled scores, before the sink; ``+inf`` for a row with nothing live).

    Raises
    ------
    ValueError
        On any argument outside the contract (``out`` included), before anything is written.
    """
    swa, extra = validation.check_decode(
        q, swa_cache, swa_slots, swa_lens, extra_cache, extra_slots, extra_lens, sm_scale, sinks, False, out
    )
    pools = [(swa_cache, swa_slots, swa_lens, swa)]
    if extra is not None and extra_cache is not None and extra_slots is not None:  # validated: all or none
        pools.append((extra_cache, extra_slots, extra_lens, extra))
    gathered = [gather_rows(cache, slots, lens, g.num_pages * g.page_size) for cache, slots, lens, g in pools]
    rows = torch.cat([r for r, _ in gathered], dim=2).double()  # once, for both products
    live = torch.cat([m for _, m in gathered], dim=2)
    scores = masked_scores(q, rows, live, float(sm_scale))
    values, lse = attention_output(scores, rows, live, sinks)
    result = to_bf16(values.float())
    if out is not None:
        result = out.copy_(result)
    return result, canonicalize_nan(lse.float())
