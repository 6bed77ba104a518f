"""What a run measured, and how its numbers are printed."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

from .grid import Row


@dataclass
class Ceilings:
    """The same run's limits: what no row can beat."""

    copy_bytes_per_s: float | None = None  # bytes read + written per second by a device copy
    launch_eager_s: float | None = None  # empty kernel, back-to-back eager launches
    launch_graph_s: float | None = None  # empty kernel, replayed from a CUDA graph
    add_host_s: float | None = None  # host time of one torch add_ launch
    notes: list[str] = field(default_factory=list)


@dataclass
class RowResult:
    """One row's numbers.

    ``seconds`` maps an arm to its median seconds per call; None: attempted but n/a (the reason is
    in ``notes``); an arm missing from it is not part of this row.
    """

    row: Row
    bytes: float  # modelled bytes of one call
    input_sets: int
    seconds: dict[str, float | None] = field(default_factory=dict)
    calls_per_batch: int = 0  # of the fused eager arm
    host_s: float | None = None
    compile_first_call_s: float | None = None
    notes: list[str] = field(default_factory=list)


class FirstUse(NamedTuple):
    """The first call of a geometry, each in a fresh process."""

    cold_first_call_s: float | None = None  # empty disk cache: compile + load + launch
    compile_kernel_s: float | None = None  # NVRTC alone (jit.compile_kernel, same process, after)
    warm_first_call_s: float | None = None  # warm disk cache: read + load + launch
    import_cupy_s: float | None = None  # once per process, outside the first-call times
    error: str | None = None


class ArmSkipped(Exception):
    """An arm left out on purpose; the message says why."""


def reason(exc: BaseException) -> str:
    """A one-line reason for a failure (the message alone for :class:`ArmSkipped`)."""
    lines = str(exc).strip().splitlines()
    first = lines[0] if lines else ""
    return (first if isinstance(exc, ArmSkipped) else f"{type(exc).__name__}: {first}")[:200]


def format_us(seconds: float | None) -> str:
    """Microseconds with 3 significant digits at most, "n/a" for None."""
    if seconds is None:
        return "n/a"
    us = seconds * 1e6
    return f"{us:.2f}" if us < 10 else f"{us:.1f}" if us < 100 else f"{us:.0f}"


def format_ratio(ratio: float) -> str:
    """``2.50x``, ``12.5x``, ``125x``."""
    return f"{ratio:.2f}x" if ratio < 10 else f"{ratio:.1f}x" if ratio < 100 else f"{ratio:.0f}x"


def format_s(seconds: float | None) -> str:
    """Milliseconds below one second, else seconds; "n/a" for None."""
    if seconds is None:
        return "n/a"
    return f"{seconds * 1e3:.1f} ms" if seconds < 1 else f"{seconds:.2f} s"
