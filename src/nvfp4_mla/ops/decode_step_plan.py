"""A decode step's plan: :func:`plan_sparse_mla_decode` and :class:`SparseMlaDecodePlan`
(docs/format.md, "Plans"). The step's work list, made once and passed to every layer's call."""

from __future__ import annotations

import torch

from .. import validation
from ..launch import current_raw_stream
from . import decode_scheduler
from .decode_launch import launch_scheduler
from .decode_planner import DecodePlan, plan
from .library import DEFAULT, KernelLibrary


def _same_tensor(a: torch.Tensor | None, b: torch.Tensor | None) -> bool:
    if a is b:
        return True
    if a is None or b is None or not isinstance(a, torch.Tensor):
        return False
    return a.data_ptr() == b.data_ptr() and a.dtype == b.dtype and a.shape == b.shape and a.device == b.device


class SparseMlaDecodePlan:
    """The work of the ``sparse_mla_decode`` calls of one decode step: one batch shape, one
    device, one pair of length tensors (docs/format.md, "Plans"). Made by
    :func:`plan_sparse_mla_decode`; pass it as ``plan=`` to every call of the step (every layer),
    and call :meth:`update` when the lengths' values change."""

    __slots__ = (
        "_call",
        "batch",
        "batch_invariant",
        "device",
        "extra_lens",
        "k_extra",
        "k_swa",
        "launches",
        "library",
        "num_heads",
        "q_len",
        "swa_lens",
        "work",
        "work_address",
    )

    def __init__(
        self,
        num_heads: int,
        swa_slots: torch.Tensor,
        swa_lens: torch.Tensor | None,
        extra_slots: torch.Tensor | None,
        extra_lens: torch.Tensor | None,
        library: KernelLibrary,
        launches: DecodePlan | None,
        work: torch.Tensor | None,
        batch_invariant: bool,
    ) -> None:
        self.batch, self.q_len, self.k_swa = swa_slots.shape
        self.batch_invariant = batch_invariant
        self.num_heads = num_heads
        self.k_extra = 0 if extra_slots is None else extra_slots.shape[2]
        self.device = swa_slots.get_device()  # -1 off CUDA
        self.swa_lens, self.extra_lens = swa_lens, extra_lens
        self.library: KernelLibrary = library
        self.launches: DecodePlan | None = launches  # None: no CUDA launch (CPU tensors, no rows)
        self.work: torch.Tensor | None = work  # the work list the scheduler writes, or the host's
        self.work_address = 0 if work is None or launches is None or launches.work is not None else work.data_ptr()
        # What check compares a call's q and tables with, in one tuple (it runs on every call).
        self._call = (self.device, self.batch, self.q_len, num_heads, self.k_swa, self.k_extra)

    @property
    def parts(self) -> int:
        """The parts of the work list (0: the call's backend splits by the tables' widths)."""
        return 0 if self.launches is None else self.launches.parts

    @property
    def workspace_bytes(self) -> int:
        """Bytes a call with this plan takes from torch's caching allocator for its partial outputs."""
        if self.launches is None or not self.launches.workspace:
            return 0
        return 4 * self.launches.workspace

    def update(self) -> None:
        """Writes the work list again from the length tensors' values now: one launch of the
        scheduler on the current stream, no host synchronisation, capturable in a CUDA graph. Run
        it on the stream of the calls (or order the streams) before the calls that should follow
        the new lengths. Nothing to do where the plan has no scheduled list (no length tensors,
        CPU tensors)."""
        if self.work_address:
            stream = current_raw_stream(self.device)
            rows = self.batch * self.q_len
            assert self.launches is not None
            launch_scheduler(
                self.launches, stream, self.work_address, rows, self.k_swa, self.swa_lens, self.k_extra, self.extra_lens
            )

    def __repr__(self) -> str:
        where = "cpu" if self.device < 0 else f"cuda:{self.device}"
        return (
            f"SparseMlaDecodePlan(batch={self.batch}, q_len={self.q_len}, num_heads={self.num_heads}, "
            f"k_swa={self.k_swa}, k_extra={self.k_extra}, device={where}, parts={self.parts}, "
            f"batch_invariant={self.batch_invariant})"
        )

    def check(
        self,
        q: torch.Tensor,
        swa_slots: torch.Tensor,
        swa_lens: torch.Tensor | None,
        extra_slots: torch.Tensor | None,
        extra_lens: torch.Tensor | None,
    ) -> None:
        """ValueError unless a call of these arguments (checked ones: q is 4-D, the tables 3-D) is
        one this plan was made for."""
        batch, q_len, num_heads, _ = q.shape
        k_extra = 0 if extra_slots is None else extra_slots.shape[2]
        if (q.get_device(), batch, q_len, num_heads, swa_slots.shape[2], k_extra) != self._call:
            raise ValueError(
                f"plan= was made for another call: {self!r}; this call has q {list(q.shape)} on {q.device}, "
                f"k_swa={swa_slots.shape[2]}, k_extra={k_extra}"
            )
        if not (_same_tensor(swa_lens, self.swa_lens) and _same_tensor(extra_lens, self.extra_lens)):
            raise ValueError(
                "plan= reads the length tensors it was made with: pass the same swa_lens and extra_lens "
                "(or None where the plan has none), and call plan.update() after their values change"
            )


def plan_sparse_mla_decode(
    num_heads: int,
    swa_slots: torch.Tensor,
    *,
    swa_lens: torch.Tensor | None = None,
    extra_slots: torch.Tensor | None = None,
    extra_lens: torch.Tensor | None = None,
    library: KernelLibrary | None = None,
    batch_invariant: bool = False,
) -> SparseMlaDecodePlan:
    """A plan for the ``sparse_mla_decode`` calls of one decode step: ``num_heads`` heads over
    the slot tables ``swa_slots`` (``[batch, q_len, k]``) and ``extra_slots``, with the length
    tensors ``swa_lens`` and ``extra_lens`` that the calls will pass (the same tensors).

    With length tensors on the GPU the plan holds the step's work list: it runs the
    scheduler once here (on the current stream) and again at each :meth:`~SparseMlaDecodePlan.update`,
    and the calls with ``plan=`` launch no scheduler. The list is read-only and shared by the calls;
    their partial outputs come per call from the current stream, so one plan may serve calls on two
    streams at once. A call whose shapes, device or length tensors are not the plan's is refused.
    A plan whose lengths changed without an update gives wrong outputs but reads nothing outside
    the tables (each row's live entries are read from its lengths at each call). With
    ``batch_invariant`` no row is split between blocks, so each row's bits are the same whatever
    else the batch holds (``sparse_mla_decode``'s ``batch_invariant``). On CPU tensors the plan is
    checked and the reference runs. Make the plan outside a CUDA graph capture (it may
    compile kernels and allocate); its ``update`` and the calls may be captured.

    Raises
    ------
    ValueError
        On an argument outside the contract of ``sparse_mla_decode``'s tables and lengths.
    """
    validation.check_decode_plan(num_heads, swa_slots, swa_lens, extra_slots, extra_lens)
    if type(batch_invariant) is not bool:
        raise ValueError(f"batch_invariant must be a bool, got {batch_invariant!r}")
    lib = DEFAULT if library is None else library
    rows = swa_slots.shape[0] * swa_slots.shape[1]
    launches = work = None
    if swa_slots.is_cuda and rows > 0:
        k_extra = 0 if extra_slots is None else extra_slots.shape[2]
        lengths = swa_lens is not None or extra_lens is not None
        launches = plan(
            lib, swa_slots.get_device(), num_heads, rows, swa_slots.shape[2], k_extra, lengths, batch_invariant
        )
        if launches.work is not None:
            work = launches.work  # the host's list: the plan keeps it alive
        elif launches.parts:
            work = torch.empty(decode_scheduler.work_ints(launches.parts), dtype=torch.int32, device=swa_slots.device)
    found = SparseMlaDecodePlan(
        num_heads, swa_slots, swa_lens, extra_slots, extra_lens, lib, launches, work, batch_invariant
    )
    found.update()
    return found
