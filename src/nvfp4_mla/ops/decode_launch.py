"""The launches of a planned ``sparse_mla_decode`` call (:class:`.decode_planner.DecodePlan`): a
call with lengths deals its work list at the start of its workspace (unless a step's plan is
given), in the attention kernel's blocks or, where a block has too few threads, by the scheduler
launched before it; the attention kernel's blocks walk their part's segments, and the combine
merges the rows cut between parts. Every launch takes raw pointers on
torch's current stream; the workspace comes from torch's caching allocator.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch

from .. import abi
from ..launch import current_raw_stream, new_output
from . import decode_scheduler
from .decode_planner import DecodePlan

if TYPE_CHECKING:
    from typing import TypeAlias

    # A call's pool as the launches take it: (cache, slots, lens, layout), the layout a
    # validation.CacheLayout (num_pages, page_size, page_stride); all None for a missing extra pool.
    SwaPool: TypeAlias = tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, tuple[int, int, int]]
    Pool: TypeAlias = tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None, tuple[int, int, int] | None]

_LOG2E = 1.0 / math.log(2.0)


_NO_POOL = (0, 0, 0, 0, 1, 0, 0, 0, 0)  # the fields of a missing second pool: k = 0, never read
_INT64 = torch.int64


def _pool_params(pool: Pool) -> tuple[int, ...]:
    cache, slots, lens, layout = pool
    if cache is None or slots is None or layout is None:
        return _NO_POOL
    num_pages, page_size, page_stride = layout
    return (
        cache.data_ptr(),
        slots.data_ptr(),
        0 if lens is None else lens.data_ptr(),
        page_stride,
        page_size,
        num_pages * page_size,
        slots.shape[2],
        int(slots.dtype is _INT64),
        int(lens is not None and lens.dtype is _INT64),
    )


def launch(
    plan: DecodePlan,
    q: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    sm_scale: float,
    sinks: torch.Tensor | None,
    swa_pool: SwaPool,
    extra_pool: Pool,
    work: int = 0,
) -> None:
    """The launches of ``plan`` on checked arguments; each pool is ``(cache, slots, lens,
    layout)``, all None for a missing extra pool; ``work``: the address of a step's plan's work
    list (0: a call with lengths writes its own at the start of its workspace). The workspace
    comes from torch's caching allocator on the current stream: the list, then the partials of
    the segments of the rows cut between parts, at their slots."""
    # Each value read once: a decode step makes this call once per layer.
    batch, q_len, num_heads, _ = q.shape
    rows, device, q_ptr = batch * q_len, q.get_device(), q.data_ptr()
    out_ptr, lse_ptr = out.data_ptr(), lse.data_ptr()
    stream = current_raw_stream(device)
    sinks_ptr = 0 if sinks is None else sinks.data_ptr()
    partial_o = partial_ml = 0
    if plan.workspace:
        workspace = new_output(q, (plan.workspace,), (1,), torch.float32, device)
        partial_ml = workspace.data_ptr() + 4 * (plan.workspace - plan.slots * num_heads * 2)
        partial_o = partial_ml - plan.slots * num_heads * abi.HEAD_DIM * 4
    host_list = plan.work  # the host's list, written at planning: read before the kernels' waits
    own_list = 0
    if host_list is not None:
        work = host_list.data_ptr()
    elif not work:
        work = workspace.data_ptr()
        if plan.own_list:  # the attention's blocks deal it
            own_list = 1
        else:
            extra_k = 0 if extra_pool[1] is None else extra_pool[1].shape[2]
            launch_scheduler(plan, stream, work, rows, swa_pool[1].shape[2], swa_pool[2], extra_k, extra_pool[2])
    static = int(host_list is not None)
    plan.attend.launch(
        plan.blocks,
        1,
        1,
        plan.attend.shared_bytes,
        stream,
        q_ptr,
        out_ptr,
        lse_ptr,
        partial_o,
        partial_ml,
        sinks_ptr,
        *_pool_params(swa_pool),
        *_pool_params(extra_pool),
        rows,
        num_heads,
        plan.num_splits,
        float(sm_scale) * _LOG2E,  # type: ignore[arg-type]  # Params' double: struct packs it with "d"
        work,
        static,
        own_list,
        *plan.schedule,
        *(() if plan.q_map is None else (plan.q_map(q_ptr),)),
    )
    if plan.combine is not None:
        plan.combine.launch(
            plan.combine_blocks,
            1,
            1,
            0,
            stream,
            partial_o,
            partial_ml,
            sinks_ptr,
            out_ptr,
            lse_ptr,
            num_heads,
            work + decode_scheduler.PART_INTS * 4 * plan.parts,  # the split rows
            static,
        )


def launch_scheduler(
    plan: DecodePlan,
    stream: int,
    work: int,
    rows: int,
    k_swa: int,
    swa_lens: torch.Tensor | None,
    k_extra: int,
    extra_lens: torch.Tensor | None,
) -> None:
    """The scheduler's launch: the work list of ``plan`` at ``work`` from the rows' lengths."""
    scheduler = plan.scheduler
    assert scheduler is not None
    decode_scheduler.launch(scheduler, stream, work, rows, k_swa, swa_lens, k_extra, extra_lens, plan.schedule)
