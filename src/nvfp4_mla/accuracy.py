"""How much accuracy an NVFP4 latent cache costs: the same sparse decode through three caches.

The three caches hold the same latent rows: BF16 (the baseline, 1024 bytes a token), the FP8
format of DeepSeek-V4 serving (:mod:`nvfp4_mla.fp8_cache`, 584 bytes) and this library's NVFP4
record (384 bytes), written by the public writer (the CUDA kernel on a GPU, the reference on the
CPU) and read back by the public reader. Each query attends to its top-k rows as
:func:`nvfp4_mla.reference.sparse_mla_decode` does, in float64 before any output rounding, so the
differences measured are the caches' alone.

**How the rows are made** (:func:`latent_rows`), a model of a normalized DeepSeek-V4 latent row:

- NoPE dims: Gaussian values, each channel with its own spread (log-normal, ``channel_spread``),
  like the per-channel gains of the RMSNorm before the cache;
- a few heavy outlier channels (``num_outliers``): fixed channels with a fixed sign and a magnitude
  ``outlier_strength`` times a typical channel's, as activation outliers are;
- per-token scale variation: every row times a log-normal factor (``token_spread``);
- RoPE dims: a Gaussian pre-rotation vector rotated at the token's position ``0..n-1`` with a real
  RoPE table (:func:`nvfp4_mla.testing.rope_table`) and the library's exact BF16 RoPE.

**Queries** (:func:`make_queries`): random directions scaled so that the scores' noise has a
standard deviation of ``score_spread`` whatever the rows' norms, plus a few planted target rows per
query whose scores are lifted by about ``focus``: attention with a few strong entries over a broad
background. The top-k lists are random sets of cached tokens.

**What this cannot show:** trained latents have structure these rows lack (correlations between
channels, position-dependent content, heavier or rarer outliers); a real indexer picks the top-k by
score, not at random; and the error of one attention output says nothing direct about what it
does downstream (the inverse RoPE, the output projection, later layers, the sampled tokens).
Perplexity or task accuracy of a real model is the test that counts; this study ranks the formats
and shows where NVFP4's error comes from (groups of 16 that share a scale with an outlier).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterator

import torch

from . import (
    abi,
    fp8_cache,
    nvfp4_dequantize_sparse_mla_cache,
    nvfp4_quantize_append_sparse_mla_cache,
    reference,
    sparse_mla_decode,
)
from .device import gpu_unavailable_reason
from .reference import rope_table
from .reference.decode import attention_output, live_entries, masked_scores

CACHE_BYTES = {"bf16": 2 * abi.HEAD_DIM, "fp8": fp8_cache.FP8_RECORD_BYTES, "nvfp4": abi.RECORD_BYTES}
KINDS = tuple(CACHE_BYTES)  # the baseline first
SM_SCALE = abi.HEAD_DIM**-0.5
TOPKS = (128, 256, 512, 1024, 2048)
OUTLIER_STRENGTHS = (1.0, 4.0, 16.0, 64.0)


@dataclasses.dataclass(frozen=True)
class RowModel:
    """How :func:`latent_rows` draws rows (the module docstring says what each field models)."""

    outlier_strength: float = 16.0  # outlier magnitude / a typical channel's spread
    num_outliers: int = 4
    channel_spread: float = 0.5  # std of log(channel spread)
    token_spread: float = 0.3  # std of log(token scale)


def latent_rows(
    num_tokens: int, model: RowModel = RowModel(), *, generator: torch.Generator, device: torch.device | str = "cpu"
) -> torch.Tensor:
    """BF16 latent rows ``[num_tokens, 512]``, RoPE dims already rotated at positions ``0..n-1``.

    Drawn on the CPU from ``generator`` (so the same seed gives the same rows on any device); the
    random draws do not depend on ``model.outlier_strength``, so a sweep over it changes only the
    outliers.
    """
    g = generator
    channel = torch.exp(model.channel_spread * torch.randn(abi.NOPE_DIM, generator=g))
    token = torch.exp(model.token_spread * torch.randn(num_tokens, 1, generator=g))
    nope = torch.randn(num_tokens, abi.NOPE_DIM, generator=g) * channel
    outliers = torch.randperm(abi.NOPE_DIM, generator=g)[: model.num_outliers]
    sign = torch.where(torch.rand(model.num_outliers, generator=g) < 0.5, -1.0, 1.0)
    jitter = 1 + 0.25 * torch.randn(num_tokens, model.num_outliers, generator=g)
    nope[:, outliers] = sign * model.outlier_strength * jitter
    pe = (torch.randn(num_tokens, abi.ROPE_DIM, generator=g) * token).to(torch.bfloat16)
    table = rope_table(num_tokens)
    roped = reference.rope(pe, table[:, : abi.ROPE_PAIRS], table[:, abi.ROPE_PAIRS :])
    return torch.cat(((nope * token).to(torch.bfloat16), roped), dim=1).to(device)


def random_topk(batch: int, num_tokens: int, topk: int, *, generator: torch.Generator) -> torch.Tensor:
    """int64 slot tables ``[batch, 1, topk]``: for each query, ``topk`` distinct tokens at random."""
    order = torch.argsort(torch.rand(batch, num_tokens, generator=generator), dim=1)
    return order[:, None, :topk].contiguous()


def make_queries(
    rows: torch.Tensor,
    slots: torch.Tensor,
    *,
    num_heads: int,
    generator: torch.Generator,
    score_spread: float = 1.0,
    focus: float = 4.0,
    num_targets: int = 4,
    sm_scale: float = SM_SCALE,
) -> torch.Tensor:
    """BF16 queries ``[batch, 1, num_heads, 512]`` for the slot tables ``slots [batch, 1, k]``.

    With ``c_j = row_j - mean row`` (the rows share a large common part where outliers are), each
    head is ``a * z + focus / sm_scale * sum_t c_t / |c_t|^2``: ``z`` a random direction orthogonal
    to the mean row, ``a`` chosen so that the scores ``sm_scale * a * z . row_j`` over the head's
    top-k have standard deviation ``score_spread``, and ``t`` running over ``num_targets`` entries
    of its top-k list, whose scores that lifts by about ``focus``. So the softmax's sharpness stays
    put whatever the outliers do.
    """
    g = generator
    batch, k = slots.shape[0], slots.shape[-1]
    values = rows.double().cpu()
    mean = values.mean(dim=0)
    unit_mean = mean / mean.norm()
    picked = values[slots.cpu()[:, 0]]  # [b, k, 512]
    z = torch.randn(batch, num_heads, abi.HEAD_DIM, generator=g, dtype=torch.float64)
    z -= (z @ unit_mean)[..., None] * unit_mean
    spread = (sm_scale * torch.einsum("bhd,bkd->bhk", z, picked)).std(dim=-1, keepdim=True)
    q = z * (score_spread / spread)
    picks = torch.randint(0, k, (batch, num_heads, num_targets), generator=g)
    centered = picked[torch.arange(batch)[:, None, None], picks] - mean  # [b, h, t, 512]
    q += (focus / sm_scale * centered / centered.square().sum(-1, keepdim=True)).sum(dim=2)
    return q[:, None].to(torch.bfloat16).to(rows.device)


@dataclasses.dataclass
class StudyCaches:
    """The same rows in the three caches; slot ``t`` holds token ``t`` in each."""

    bf16: torch.Tensor  # [n, 512] BF16 rows
    fp8: torch.Tensor  # [n, 584] uint8 FP8 records
    nvfp4: torch.Tensor  # [num_pages, page_size, 384] uint8 cache

    @classmethod
    def build(cls, rows: torch.Tensor, page_size: int = 64) -> StudyCaches:
        """Quantizes ``rows`` into the FP8 and NVFP4 caches. NVFP4 goes through the public
        writer on a usable GPU, else through the reference writer (the same bytes)."""
        n = rows.shape[0]
        pages = math.ceil(n / page_size)
        cache = torch.zeros(pages, page_size, abi.RECORD_BYTES, dtype=torch.uint8, device=rows.device)
        slots = torch.arange(n, device=rows.device)
        on_gpu = rows.is_cuda and gpu_unavailable_reason(rows.device.index) is None
        write = nvfp4_quantize_append_sparse_mla_cache if on_gpu else reference.nvfp4_quantize_append_sparse_mla_cache
        write(rows, slots, cache)
        return cls(rows, fp8_cache.fp8_quantize_rows(rows), cache)

    def read(self, kind: str, slots: torch.Tensor) -> torch.Tensor:
        """fp32 rows ``slots.shape + (512,)`` of cache ``kind`` ("bf16", "fp8" or "nvfp4")."""
        if kind == "bf16":
            return self.bf16[slots].float()
        if kind == "fp8":
            return fp8_cache.fp8_dequantize_rows(self.fp8[slots])
        if kind == "nvfp4":
            return nvfp4_dequantize_sparse_mla_cache(self.nvfp4, slots)
        raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")


@dataclasses.dataclass(frozen=True)
class Decoded:
    """float64 results of one decode: scores ``[b, l, h, k]``, out ``[b, l, h, 512]``, lse ``[b, l, h]``."""

    scores: torch.Tensor
    out: torch.Tensor
    lse: torch.Tensor


def decode(caches: StudyCaches, kind: str, q: torch.Tensor, slots: torch.Tensor, sm_scale: float = SM_SCALE) -> Decoded:
    """The sparse decode of :func:`nvfp4_mla.reference.sparse_mla_decode` (one pool, every slot
    live, no sink) over cache ``kind``, before its output is rounded."""
    rows = caches.read(kind, slots).double()  # once, for both products
    live = live_entries(slots, None, caches.bf16.shape[0])
    scores = masked_scores(q, rows, live, sm_scale)
    out, lse = attention_output(scores, rows, live)
    return Decoded(scores, out, lse)


@dataclasses.dataclass(frozen=True)
class Errors:
    """Errors of a decode against the BF16 cache's, averaged over query rows and heads."""

    rel_error: float  # |out - out_bf16| / |out_bf16| (2-norms over the 512 dims)
    cosine: float  # cosine similarity of out and out_bf16
    top1: float  # fraction whose highest-weight entry is the BF16 decode's
    lse_error: float  # |lse - lse_bf16| (natural log: the relative error of the softmax sum)


def relative_errors(out: torch.Tensor, want: torch.Tensor) -> torch.Tensor:
    """``|out - want| / |want|`` per query row and head (2-norms over the 512 dims)."""
    return (out - want).norm(dim=-1) / want.norm(dim=-1)


def compare(got: Decoded, want: Decoded) -> Errors:
    """:class:`Errors` of ``got`` against ``want`` (the BF16 decode)."""
    cosine = torch.nn.functional.cosine_similarity(got.out, want.out, dim=-1)
    top1 = got.scores.argmax(dim=-1) == want.scores.argmax(dim=-1)  # weights rank as scores do
    return Errors(
        rel_error=relative_errors(got.out, want.out).mean().item(),
        cosine=cosine.mean().item(),
        top1=top1.double().mean().item(),
        lse_error=(got.lse - want.lse).abs().mean().item(),
    )


def _study_inputs(
    topks: tuple[int, ...],
    outlier_strength: float,
    num_tokens: int,
    batch: int,
    num_heads: int,
    seed: int,
    device: torch.device | str,
) -> Iterator[tuple[int, StudyCaches, torch.Tensor, torch.Tensor]]:
    """``(topk, caches, q, slots)`` for each top-k at one outlier strength: ``num_tokens`` rows
    (:func:`latent_rows`, the same draws for every strength) in the three caches, and ``batch``
    queries of ``num_heads`` heads (:func:`make_queries`) over random top-k slot tables."""
    if max(topks) > num_tokens:
        raise ValueError(f"num_tokens ({num_tokens}) must be at least the largest top-k ({max(topks)})")
    rows = latent_rows(
        num_tokens, RowModel(outlier_strength), generator=torch.Generator().manual_seed(seed), device=device
    )
    caches = StudyCaches.build(rows)
    for topk in topks:
        g = torch.Generator().manual_seed(seed + topk)
        slots = random_topk(batch, num_tokens, topk, generator=g).to(device)
        yield topk, caches, make_queries(rows, slots, num_heads=num_heads, generator=g), slots


@dataclasses.dataclass(frozen=True)
class StudyPoint:
    """One cache at one sweep setting."""

    kind: str
    topk: int
    outlier_strength: float
    errors: Errors


def sweep(
    topks: tuple[int, ...] = TOPKS,
    outlier_strengths: tuple[float, ...] = OUTLIER_STRENGTHS,
    *,
    num_tokens: int = 4096,
    batch: int = 8,
    num_heads: int = 16,
    seed: int = 0,
    device: torch.device | str = "cpu",
) -> list[StudyPoint]:
    """FP8 and NVFP4 against BF16 over every top-k and outlier strength.

    For each outlier strength, ``num_tokens`` rows (:func:`latent_rows`, the same draws for every
    strength) go into the three caches; for each top-k, ``batch`` queries of ``num_heads`` heads
    (:func:`make_queries`) decode through each cache. ``num_tokens`` must be at least max(topks).
    """
    points = []
    for strength in outlier_strengths:
        for topk, caches, q, slots in _study_inputs(topks, strength, num_tokens, batch, num_heads, seed, device):
            base = decode(caches, "bf16", q, slots)
            for kind in KINDS[1:]:
                points.append(StudyPoint(kind, topk, strength, compare(decode(caches, kind, q, slots), base)))
    return points


@dataclasses.dataclass(frozen=True)
class FusedPoint:
    """The library's ``sparse_mla_decode`` on the NVFP4 cache at one top-k, against the float64
    decode of the same cache (:func:`decode`) and against the BF16 cache's."""

    topk: int
    rel_error_exact: float  # the float64 NVFP4 decode against BF16 (the cache's own error)
    rel_error_fused: float  # the library's decode against BF16
    max_rel_deviation: float  # largest |fused - exact| / |exact| over rows and heads (2-norms)
    max_lse_deviation: float  # largest |lse_fused - lse_exact|


def fused_study(
    topks: tuple[int, ...] = TOPKS,
    outlier_strength: float = 16.0,
    *,
    num_tokens: int = 4096,
    batch: int = 8,
    num_heads: int = 16,
    seed: int = 0,
    device: torch.device | str = "cpu",
) -> list[FusedPoint]:
    """:func:`nvfp4_mla.sparse_mla_decode` (the fused kernel on a GPU, the reference elsewhere) on
    the sweep's NVFP4 cache: it must give the float64 decode's numbers, up to its BF16 output and
    BF16 probabilities (docs/format.md section 9)."""
    points = []
    for topk, caches, q, slots in _study_inputs(topks, outlier_strength, num_tokens, batch, num_heads, seed, device):
        base, exact = decode(caches, "bf16", q, slots), decode(caches, "nvfp4", q, slots)
        out, lse = sparse_mla_decode(q, caches.nvfp4, slots, sm_scale=SM_SCALE)
        out = out.double()
        points.append(
            FusedPoint(
                topk,
                rel_error_exact=relative_errors(exact.out, base.out).mean().item(),
                rel_error_fused=relative_errors(out, base.out).mean().item(),
                max_rel_deviation=relative_errors(out, exact.out).max().item(),
                max_lse_deviation=(lse.double() - exact.lse).abs().max().item(),
            )
        )
    return points
