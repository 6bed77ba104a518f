"""The ``sparse_mla_decode`` op: fused sparse MLA decode attention over the NVFP4 cache, its
custom ops, and the dispatch of a call to the kernels or the reference.

:func:`sparse_mla_decode` has the signature and semantics of
:func:`nvfp4_mla.reference.sparse_mla_decode` (docs/format.md section 9), plus an optional ``out``
and ``plan``. CUDA tensors go to a backend's kernels, other devices to the reference. The parts:
:mod:`.decode_planner` (the backend and the division of the work, a plan a call shape),
:mod:`.decode_launch` (the launches), :mod:`.decode_step_plan` (a decode step's plan).

**Execution.** The call's work list is dealt on the GPU from the rows' live lengths, in the
attention kernel's blocks or by the scheduler (:mod:`.decode_scheduler`) launched first, or comes
from a step's plan (without length tensors, the plan holds one made on the host from the tables'
widths); the attention kernel's blocks (a block per part, head tile and part of the
output dims) walk their part's segments, and the combine (:mod:`.decode_combine`) merges the rows
cut between parts: the work follows the live tokens, not the tables' widths. The list is a
function of the shapes, the device and the lengths, and the combine adds a row's partials in a
fixed order, so equal inputs give equal bits on every run. A warm call does the checks of
:mod:`nvfp4_mla.validation`, one plan lookup and its allocations (the outputs and the workspace,
through torch's caching allocator on the current stream), with no host synchronisation: it can be
captured in a CUDA graph, and its work follows lengths that change between replays.
"""

from __future__ import annotations

import functools

import torch
from torch.autograd.graph import increment_version

from .. import abi, reference, validation
from ..launch import contiguous_strides, new_output
from .decode_launch import launch
from .decode_planner import (
    BACKENDS,
    COMBINE_COST,
    MAX_LIST_PARTS,
    DecodePlan,
    plan,
    select_backend,
    specs,
)
from .decode_schedule import MAX_SPLITS
from .decode_step_plan import SparseMlaDecodePlan, plan_sparse_mla_decode
from .library import DEFAULT, KernelLibrary, check_traceable

# The planner's and the launches' names that the tests, the benchmark and the registry reach
# through this module.
__all__ = [
    "BACKENDS",
    "COMBINE_COST",
    "MAX_LIST_PARTS",
    "MAX_SPLITS",
    "DecodePlan",
    "SparseMlaDecodePlan",
    "launch",
    "plan",
    "plan_sparse_mla_decode",
    "select_backend",
    "sparse_mla_decode",
    "specs",
]


@functools.lru_cache(maxsize=256)  # a serving loop's few batch shapes; a hit costs a hash
def _output_layouts(batch: int, q_len: int, num_heads: int) -> tuple[tuple, tuple, tuple, tuple]:
    """The shapes and contiguous strides of a call's ``out`` and ``lse``, as plain tuples (what
    new_output takes)."""
    out_shape, lse_shape = (batch, q_len, num_heads, abi.HEAD_DIM), (batch, q_len, num_heads)
    return out_shape, contiguous_strides(out_shape), lse_shape, contiguous_strides(lse_shape)


def _decode_cuda(
    lib: KernelLibrary,
    q: torch.Tensor,
    swa_cache: torch.Tensor,
    swa_slots: torch.Tensor,
    swa_lens: torch.Tensor | None,
    extra_cache: torch.Tensor | None,
    extra_slots: torch.Tensor | None,
    extra_lens: torch.Tensor | None,
    sm_scale: float,
    sinks: torch.Tensor | None,
    out: torch.Tensor | None,
    batch_invariant: bool,
    planned: SparseMlaDecodePlan | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    swa, extra = validation.check_decode(
        q, swa_cache, swa_slots, swa_lens, extra_cache, extra_slots, extra_lens, sm_scale, sinks, True, out
    )
    if planned is not None:
        planned.check(q, swa_slots, swa_lens, extra_slots, extra_lens)
    device = q.get_device()
    batch, q_len, num_heads, _ = q.shape
    out_shape, out_strides, lse_shape, lse_strides = _output_layouts(batch, q_len, num_heads)
    if out is not None:
        increment_version(out)  # written in place: autograd and views must see a new version
    else:  # the kernels write every element of out and lse
        out = new_output(q, out_shape, out_strides, torch.bfloat16, device)
    lse = new_output(q, lse_shape, lse_strides, torch.float32, device)
    rows = batch * q_len
    if rows == 0:
        return out, lse
    if planned is None:
        k_swa, k_extra = swa_slots.shape[2], 0 if extra_slots is None else extra_slots.shape[2]
        lengths = swa_lens is not None or extra_lens is not None
        key = ("decode", device, num_heads, rows, k_swa, k_extra, lengths, batch_invariant)  # plan()'s, inline
        found = lib.plans.get(key)
        if found is None:
            found = plan(lib, device, num_heads, rows, k_swa, k_extra, lengths, batch_invariant)
        work = 0
    else:
        found, work = planned.launches, planned.work_address
        assert found is not None  # a plan made on CUDA tensors with rows, as the check found
    pools = (swa_cache, swa_slots, swa_lens, swa), (extra_cache, extra_slots, extra_lens, extra)
    launch(found, q, out, lse, sm_scale, sinks, *pools, work)
    return out, lse


def _decode(
    lib: KernelLibrary,
    q: torch.Tensor,
    swa_cache: torch.Tensor,
    swa_slots: torch.Tensor,
    swa_lens: torch.Tensor | None,
    extra_cache: torch.Tensor | None,
    extra_slots: torch.Tensor | None,
    extra_lens: torch.Tensor | None,
    sm_scale: float,
    sinks: torch.Tensor | None,
    out: torch.Tensor | None,
    batch_invariant: bool = False,
    planned: SparseMlaDecodePlan | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    if isinstance(q, torch.Tensor) and q.is_cuda:
        pools = (swa_cache, swa_slots, swa_lens, extra_cache, extra_slots, extra_lens)
        return _decode_cuda(lib, q, *pools, sm_scale, sinks, out, batch_invariant, planned)
    found = reference.sparse_mla_decode(
        q,
        swa_cache,
        swa_slots,
        swa_lens=swa_lens,
        extra_cache=extra_cache,
        extra_slots=extra_slots,
        extra_lens=extra_lens,
        sm_scale=sm_scale,
        sinks=sinks,
        out=out,
    )
    if planned is not None:  # the reference needs no plan: the arguments checked, then the plan
        planned.check(q, swa_slots, swa_lens, extra_slots, extra_lens)
    return found


# ---------------------------------------------------------------- torch custom ops
# So torch.compile traces the entry without a graph break; eager calls skip the dispatcher.

_Tensor = torch.Tensor
_OptTensor = torch.Tensor | None


@torch.library.custom_op("nvfp4_mla::sparse_mla_decode", mutates_args=())
def _decode_op(
    q: _Tensor,
    swa_cache: _Tensor,
    swa_slots: _Tensor,
    swa_lens: _OptTensor,
    extra_cache: _OptTensor,
    extra_slots: _OptTensor,
    extra_lens: _OptTensor,
    sm_scale: float,
    sinks: _OptTensor,
    batch_invariant: bool = False,
) -> tuple[_Tensor, _Tensor]:
    args = (q, swa_cache, swa_slots, swa_lens, extra_cache, extra_slots, extra_lens, sm_scale, sinks)
    out, lse = _decode(DEFAULT, *args, None, batch_invariant)
    return out, lse


@_decode_op.register_fake
def _(
    q: _Tensor,
    swa_cache: _Tensor,
    swa_slots: _Tensor,
    swa_lens: _OptTensor,
    extra_cache: _OptTensor,
    extra_slots: _OptTensor,
    extra_lens: _OptTensor,
    sm_scale: float,
    sinks: _OptTensor,
    batch_invariant: bool = False,
) -> tuple[_Tensor, _Tensor]:
    return q.new_empty(q.shape), q.new_empty(q.shape[:3], dtype=torch.float32)


@torch.library.custom_op("nvfp4_mla::sparse_mla_decode_out", mutates_args=("out",))
def _decode_out_op(
    q: _Tensor,
    swa_cache: _Tensor,
    swa_slots: _Tensor,
    swa_lens: _OptTensor,
    extra_cache: _OptTensor,
    extra_slots: _OptTensor,
    extra_lens: _OptTensor,
    sm_scale: float,
    sinks: _OptTensor,
    out: _Tensor,
    batch_invariant: bool = False,
) -> _Tensor:
    args = (q, swa_cache, swa_slots, swa_lens, extra_cache, extra_slots, extra_lens, sm_scale, sinks)
    _, lse = _decode(DEFAULT, *args, out, batch_invariant)
    return lse


@_decode_out_op.register_fake
def _(
    q: _Tensor,
    swa_cache: _Tensor,
    swa_slots: _Tensor,
    swa_lens: _OptTensor,
    extra_cache: _OptTensor,
    extra_slots: _OptTensor,
    extra_lens: _OptTensor,
    sm_scale: float,
    sinks: _OptTensor,
    out: _Tensor,
    batch_invariant: bool = False,
) -> _Tensor:
    return q.new_empty(q.shape[:3], dtype=torch.float32)


_is_compiling = torch.compiler.is_compiling


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
    library: KernelLibrary | None = None,
    plan: SparseMlaDecodePlan | None = None,
    batch_invariant: bool | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sparse MLA decode attention read straight from one or two NVFP4 caches.

    The semantics of :func:`nvfp4_mla.reference.sparse_mla_decode` (docs/format.md section 9):
    masked entries (invalid slots, entries past ``lens``) are never read, a row with nothing
    live gives 0 and ``lse = +inf``, ``lse`` is the natural log-sum-exp before the sink. On CUDA
    tensors the kernel accumulates in fp32 with BF16 tensor-core products (P is rounded to BF16
    for P.V); it matches the reference within ``2^-7 |ref| + 2^-8 sum_j w_j |row_j|`` (times
    the sink factor) plus ``2^-126`` for ``out`` and ``1e-4 max(1, |lse|)`` for ``lse``. Other
    devices run the reference.

    Against FlashInfer's SM120 sparse backend,
    ``flashinfer.mla.trtllm_batch_decode_sparse_mla_dsv4(query, swa_kv_cache, workspace_buffer,
    sparse_indices, compressed_kv_cache, ..., bmm1_scale=, sinks=, swa_topk_lens=,
    extra_sparse_indices=, extra_sparse_topk_lens=)``: ``q`` is ``query``; ``swa_cache``,
    ``swa_slots``, ``swa_lens`` are ``swa_kv_cache``, ``sparse_indices`` and ``swa_topk_lens``
    (as ``[batch, q_len]``); ``extra_cache``, ``extra_slots``, ``extra_lens`` are
    ``compressed_kv_cache``, ``extra_sparse_indices`` and ``extra_sparse_topk_lens``; ``sm_scale``
    is ``bmm1_scale`` (``bmm2_scale`` must be 1 there, and has no counterpart); ``sinks`` is
    ``sinks``. No workspace argument: split partials are allocated per call. The caches are this
    library's 384-byte records, not FlashInfer's 584-byte FP8 ones, and ``lse`` is returned too.

    Parameters
    ----------
    q
        BF16 ``[batch, q_len, heads, 512]``, contiguous (the rotated queries).
    swa_cache, swa_slots
        The sliding-window pool: a cache (docs/format.md section 3) and its contiguous int32 or
        int64 slot table ``[batch, q_len, k]`` (``page * page_size + entry``; -1 or any invalid
        slot is masked).
    swa_lens
        Optional contiguous int32 or int64 ``[batch, q_len]``: only the first ``lens`` entries of a
        row count (clamped to ``[0, k]``).
    extra_cache, extra_slots, extra_lens
        The optional second (compressed) pool, likewise; its page size, slot dtype and ``k`` may
        differ from the first pool's.
    sm_scale
        The softmax scale of ``q . row``.
    sinks
        Optional fp32 ``[heads]`` attention-sink logits.
    out
        Optional BF16 ``[batch, q_len, heads, 512]`` output to fill (contiguous, on q's device,
        sharing no memory with the inputs). It is returned.
    library
        The kernels, backend choice and plan table to use on CUDA tensors (tests and benchmarks);
        default: the process's, or the plan's.
    plan
        A plan from :func:`plan_sparse_mla_decode` for this call's shapes, device and length
        tensors: the step's work list, so the call launches no scheduler (docs/format.md,
        "Plans"). Eager calls only.
    batch_invariant
        True: each row's ``out`` and ``lse`` bits are the same whatever else the batch holds
        (at the same heads and table widths): no row is split between blocks, at a cost where
        few rows leave the GPU idle (docs/format.md, "Plans"). None: the plan's, else False. With
        ``plan=`` a value other than the plan's is refused.

    Returns
    -------
    tuple[torch.Tensor, torch.Tensor]
        ``out`` (before the inverse RoPE of its last 64 dims) and ``lse`` fp32 ``[batch, q_len, heads]``.

    Raises
    ------
    ValueError
        On any argument outside the contract, before anything is launched.
    """
    if batch_invariant is not None and type(batch_invariant) is not bool:
        raise ValueError(f"batch_invariant must be a bool or None, got {batch_invariant!r}")
    if _is_compiling():  # traced with fake tensors: the op checks its arguments when it runs
        check_traceable(library)
        if plan is not None:
            raise ValueError("plan= is for eager calls: under torch.compile each call plans its own work")
        args = (q, swa_cache, swa_slots, swa_lens, extra_cache, extra_slots, extra_lens, float(sm_scale), sinks)
        invariant = bool(batch_invariant)
        if out is None:
            return torch.ops.nvfp4_mla.sparse_mla_decode(*args, invariant)
        return out, torch.ops.nvfp4_mla.sparse_mla_decode_out(*args, out, invariant)
    if plan is None:
        lib = DEFAULT if library is None else library
        invariant = bool(batch_invariant)
    elif not isinstance(plan, SparseMlaDecodePlan):
        raise ValueError(f"plan must come from nvfp4_mla.plan_sparse_mla_decode, got {type(plan).__name__}")
    elif library is not None and library is not plan.library:
        raise ValueError("plan= carries the library it was made with: pass library= to plan_sparse_mla_decode")
    elif batch_invariant is not None and batch_invariant is not plan.batch_invariant:
        raise ValueError(
            f"batch_invariant={batch_invariant} but plan= was made with batch_invariant={plan.batch_invariant}: "
            "pass it to plan_sparse_mla_decode"
        )
    else:
        lib, invariant = plan.library, plan.batch_invariant
    pools = (swa_cache, swa_slots, swa_lens, extra_cache, extra_slots, extra_lens)
    return _decode(lib, q, *pools, sm_scale, sinks, out, invariant, plan)
