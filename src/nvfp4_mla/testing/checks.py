"""Byte-exact checks of an entry against the reference, and reports that locate each wrong byte."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, Protocol

import torch

from .. import abi, ops, reference, validation
from .inputs import ARG_NAMES, ENTRIES, Case, Device, args_of, make_inputs

# Calls with more input elements than this run the reference on their own device (a GPU run of the
# reference is cross-checked against the CPU by the tests); smaller ones on CPU copies.
REF_ON_DEVICE_ELEMENTS = 1 << 23


# ---------------------------------------------------------------- bytes


def e4m3_byte(b: int) -> float:
    """E4M3 (fn) from its bits, written independently of the library (the tests' oracle): sign,
    4 exponent bits (bias 7), 3 mantissa bits; S.1111.111 is NaN."""
    sign = -1.0 if b & 0x80 else 1.0
    e, m = (b >> 3) & 0xF, b & 7
    if e == 0xF and m == 7:
        return math.nan
    return sign * (m / 8 * 2.0**-6 if e == 0 else (1 + m / 8) * 2.0 ** (e - 7))


def raw_bytes(t: torch.Tensor) -> torch.Tensor:
    """Every byte of ``t``'s storage (pool padding included) as a uint8 view on its device."""
    return torch.empty(0, dtype=torch.uint8, device=t.device).set_(t.untyped_storage())


def storage_bytes(t: torch.Tensor) -> torch.Tensor:
    """A CPU copy of every byte of ``t``'s storage (pool padding included)."""
    return raw_bytes(t).to("cpu", copy=True)


def flat_bytes(t: torch.Tensor) -> torch.Tensor:
    """The bytes of ``t``'s elements in order (not its storage), on the CPU."""
    return t.detach().contiguous().reshape(-1).view(torch.uint8).cpu()


def bits(t: torch.Tensor) -> torch.Tensor:
    """The int16 bit patterns of a BF16 tensor, for bitwise comparison (NaN included)."""
    return t.view(torch.int16)


def clone(t: torch.Tensor, device: Device | None = None) -> torch.Tensor:
    """A copy of ``t`` with its whole storage (pool padding too), same sizes, strides and offset."""
    raw = raw_bytes(t).to(t.device if device is None else device, copy=True)
    return raw.view(t.dtype).as_strided(t.shape, t.stride(), t.storage_offset())


def synchronize(device: Device) -> None:
    """Waits for ``device``'s work (nothing to wait for off CUDA)."""
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


# ---------------------------------------------------------------- locating bytes


class Locator(Protocol):
    """Describes the byte at ``offset`` of a storage; ``got``/``want`` are both storages' bytes."""

    def __call__(self, offset: int, got: torch.Tensor | None = None, want: torch.Tensor | None = None) -> str: ...


def element_locator(t: torch.Tensor) -> Locator:
    """Maps a byte offset in ``t``'s storage to its element index (and both values, when given)."""
    shape, size, base = [int(n) for n in t.shape], t.element_size(), int(t.storage_offset())

    def locate(offset: int, got: torch.Tensor | None = None, want: torch.Tensor | None = None) -> str:
        index = offset // size - base
        if not 0 <= index < t.numel():
            return "outside the tensor"
        coords = []
        for extent in reversed(shape):
            index, c = divmod(index, extent)
            coords.append(c)
        coords.reverse()
        part = ""
        if len(shape) >= 2 and shape[-1] == abi.HEAD_DIM:
            part = " (RoPE dim)" if coords[-1] >= abi.NOPE_DIM else " (NoPE dim)"
        if got is None or want is None:
            return f"element {tuple(coords)}{part}"
        start = offset - offset % size
        g, w = (int.from_bytes(bytes(b[start : start + size].tolist()), "little") for b in (got, want))
        return f"element {tuple(coords)}{part}: got {g:#0{2 + 2 * size}x}, want {w:#0{2 + 2 * size}x}"

    return locate


def cache_locator(cache: torch.Tensor, slot_mapping: torch.Tensor | None = None) -> Locator:
    """Maps a byte offset in the cache's storage to slot, page, entry and record field
    (docs/format.md section 3), and names the rows of ``slot_mapping`` that address that slot."""
    num_pages, page_size, page_stride = validation.check_cache(cache)
    base = int(cache.storage_offset())
    scales_start, payload = abi.scale_offset(page_size, 0), page_size * abi.RECORD_BYTES
    slots = None if slot_mapping is None else slot_mapping.cpu().long()

    def locate(offset: int, got: torch.Tensor | None = None, want: torch.Tensor | None = None) -> str:
        page, within = divmod(offset - base, page_stride)
        if offset < base or page >= num_pages:
            return "outside the cache view"
        if within >= payload:
            return f"page {page}: pool padding byte {within - payload}"
        if within < scales_start:
            entry = within // abi.DATA_BYTES
            b = within - abi.data_offset(page_size, entry)
            if b < abi.NOPE_BYTES:
                field = f"data byte {b} (E2M1 of elements {2 * b}, {2 * b + 1}; group {2 * b // abi.GROUP_SIZE})"
            else:
                field = f"data byte {b} (BF16 of RoPE dim {abi.NOPE_DIM + (b - abi.NOPE_BYTES) // 2})"
        else:
            entry = (within - scales_start) // abi.SCALE_BYTES
            b = within - abi.scale_offset(page_size, entry)
            field = f"scale byte {b}" + (f" (group {b})" if b < abi.NUM_GROUPS else " (zero pad)")
        slot = page * page_size + entry
        rows = "" if slots is None else f"; rows with this slot: {(slots == slot).nonzero().flatten().tolist()}"
        return f"slot {slot} (page {page}, entry {entry}), {field}{rows}"

    return locate


def record_offsets(cache: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """``[k, 384]`` storage byte offsets of each slot's record: its data row, then its scale slot
    (through :func:`nvfp4_mla.abi.record_views` applied to a map of storage offsets)."""
    layout = validation.check_cache(cache)
    offsets = torch.arange(cache.untyped_storage().nbytes()).as_strided(
        cache.shape, cache.stride(), cache.storage_offset()
    )
    data, scales = abi.record_views(offsets, layout)
    slots = slots.cpu().long()
    page, entry = slots // layout.page_size, slots % layout.page_size
    return torch.cat((data[page, entry], scales[page, entry]), dim=1)


def bytes_mismatch(got: torch.Tensor, want: torch.Tensor, locate: Locator, what: str, limit: int = 8) -> str | None:
    """None when the byte tensors are equal, else a report of the first ``limit`` differing offsets."""
    if got.shape == want.shape and torch.equal(got, want):
        return None
    if got.shape != want.shape:
        return f"{what}: {got.numel()} bytes, expected {want.numel()}"
    diff = (got != want).nonzero().flatten()
    lines = [f"{what}: {diff.numel()} of {want.numel()} bytes differ; first ones:"]
    for offset in diff[:limit].tolist():
        lines.append(
            f"  byte {offset}: got {int(got[offset]):#04x}, want {int(want[offset]):#04x}; {locate(offset, got, want)}"
        )
    return "\n".join(lines)


# ---------------------------------------------------------------- checks


def _require(condition: bool, message: str) -> None:
    # An explicit raise, not ``assert``: these checks must hold under ``python -O`` too.
    if not condition:
        raise AssertionError(message)


def assert_same(
    entry: str,
    got: Any,
    want: Any,
    args: Sequence[torch.Tensor],
    ref_args: Sequence[torch.Tensor],
    label: str,
) -> None:
    """The result ``got`` of a call on ``args`` against the reference's ``want`` on ``ref_args``:
    the returned tensor and every argument's storage, byte for byte. Raises AssertionError."""
    where = f"{ENTRIES[entry]} [{label}]"
    names = ARG_NAMES[entry]
    problems = []
    if want is None:
        _require(got is None, f"{where}: returned {type(got).__name__}, expected None")
    elif want is ref_args[0]:
        _require(got is args[0], f"{where}: in place it must return q itself")
    else:
        _require(isinstance(got, torch.Tensor), f"{where}: returned {type(got).__name__}")
        _require(
            (got.dtype, tuple(got.shape)) == (want.dtype, tuple(want.shape)),
            f"{where}: returned {got.dtype} {list(got.shape)}, expected {want.dtype} {list(want.shape)}",
        )
        _require(got.device == args[0].device, f"{where}: returned a tensor on {got.device}")
        _require(got.is_contiguous(), f"{where}: returned strides {got.stride()}")
        if got.numel():
            pointer = got.untyped_storage().data_ptr()
            shared = [n for n, a in zip(names, args) if a.untyped_storage().data_ptr() == pointer]
            _require(not shared, f"{where}: the returned tensor shares storage with {shared}")
        locate = cache_locator(want) if entry == "pack" else element_locator(want)
        problems.append(bytes_mismatch(flat_bytes(got), flat_bytes(want), locate, "returned tensor"))
    slots = ref_args[names.index("slot_mapping")] if "slot_mapping" in names else None
    for name, g, r in zip(names, args, ref_args):
        locate = cache_locator(r, slots) if name == "cache" else element_locator(r)
        problems.append(bytes_mismatch(storage_bytes(g), storage_bytes(r), locate, f"argument {name}"))
    reports = [p for p in problems if p]
    _require(not reports, f"{where}:\n" + "\n".join(reports))


def run_reference(
    entry: str, args: Sequence[torch.Tensor], kwargs: dict[str, Any], device: Device
) -> tuple[Any, list[torch.Tensor]]:
    """The reference on copies of ``args`` on ``device``: (its result, its arguments after the call)."""
    ref_args = [clone(a, device) for a in args]
    return getattr(reference, ENTRIES[entry])(*ref_args, **kwargs), ref_args


def dirty_allocator(nbytes: int, device: Device) -> None:
    """Leaves freed 0xFF blocks of ``nbytes`` in torch's caching allocator, so that the output the
    entry allocates next starts as garbage: bytes it does not write then show as mismatches."""
    if torch.device(device).type != "cuda" or nbytes == 0:
        return
    torch.cuda.empty_cache()
    blocks = [torch.full((nbytes,), 0xFF, dtype=torch.uint8, device=device) for _ in range(2)]
    del blocks


def check(
    entry: str,
    args: Sequence[torch.Tensor],
    kwargs: dict[str, Any],
    *,
    label: str,
    ref_device: Device | None = None,
    impl: Any = ops,
    library: ops.KernelLibrary | None = None,
) -> tuple[Any, list[torch.Tensor]]:
    """Runs ``entry`` of ``impl`` (default: the GPU entries of :mod:`nvfp4_mla.ops`, on ``library``
    when given) on clones of ``args`` and the reference on other clones (on ``ref_device``;
    default: the CPU for small calls), then raises AssertionError unless every byte agrees
    (:func:`assert_same`).

    Returns
    -------
    The call's result and the arguments it was given (after the call).
    """
    device = args[0].device
    if ref_device is None:
        ref_device = device if sum(a.numel() for a in args) > REF_ON_DEVICE_ELEMENTS else "cpu"
    want, ref_args = run_reference(entry, args, kwargs, ref_device)
    call_args = [clone(a) for a in args]
    if isinstance(want, torch.Tensor) and want is not ref_args[0]:
        dirty_allocator(want.untyped_storage().nbytes(), device)
    got = getattr(impl, ENTRIES[entry])(*call_args, **(kwargs if library is None else {**kwargs, "library": library}))
    synchronize(device)
    assert_same(entry, got, want, call_args, ref_args, f"{label}; reference on {ref_device}")
    return got, call_args


def check_case(case: Case, device: Device, **options: Any) -> tuple[Any, list[torch.Tensor]]:
    """:func:`check` on fresh inputs of ``case`` on ``device``; ``options`` go to :func:`check`."""
    inputs = make_inputs(case, device)
    return check(case.entry, args_of(case.entry, inputs), case.kwargs(), label=str(case), **options)
