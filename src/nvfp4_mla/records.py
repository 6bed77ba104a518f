"""Records of a cache as text: :func:`format_record` (one record, what ``nvfp4-mla inspect`` prints),
:func:`summarize_record` (one line) and :func:`first_written_slot`."""

from __future__ import annotations

from collections.abc import Iterable

import torch

from . import abi, reference, validation
from .ops.reader import nvfp4_dequantize_sparse_mla_cache
from .reference.reader import e4m3_signed_value


def _row(label: str, items: Iterable[str], width: int) -> str:
    return f"  {label:<6}" + "".join(f"{x:>{width}}" for x in items)


def format_record(cache: torch.Tensor, slot: int) -> str:
    """One record of a cache as text, as ``nvfp4-mla inspect`` prints it (layout: docs/format.md
    section 3).

    The 28 group scales (code and value), each group's E2M1 codes and their values, and the 64
    RoPE values; or one line saying the record is empty when all its 384 bytes are one value
    (a canary, or zeros), as before any write.

    Parameters
    ----------
    cache : torch.Tensor
        A uint8 cache in any accepted layout (``[num_pages, page_size, 384]``, HND or NHD,
        padded pools included), on any device.
    slot : int
        ``page * page_size + entry``.

    Returns
    -------
    str
        The record, several lines.

    Raises
    ------
    ValueError
        If ``cache`` is not a cache or ``slot`` is outside it.
    """
    cache = cache.detach().cpu()
    layout = validation.check_cache(cache)
    num_pages, page_size, page_stride = layout
    if not 0 <= slot < num_pages * page_size:
        raise ValueError(f"slot {slot} is outside the cache's {num_pages * page_size} slots")
    page, entry = divmod(slot, page_size)
    data_rows, scale_slots = abi.record_views(cache, layout)
    data, scale_slot = data_rows[page, entry], scale_slots[page, entry]
    data_at, scale_at = abi.data_offset(page_size, entry), abi.scale_offset(page_size, entry)
    lines = [
        f"slot {slot} = page {page}, entry {entry}  (cache: {num_pages} pages of {page_size}, "
        f"page stride {page_stride} B)",
    ]
    record = torch.cat((data, scale_slot))
    if torch.all(record == record[0]):
        byte = int(record[0])
        # A written record has zero scale padding, so only all-zero bytes can also be a written row.
        what = "never written, or a written row of 512 zeros" if byte == 0 else "never written"
        lines.append(f"empty record: all {abi.RECORD_BYTES} bytes are 0x{byte:02X} ({what})")
        return "\n".join(lines)

    packed = data[: abi.NOPE_BYTES]
    codes = torch.stack((packed & 0xF, packed >> 4), dim=-1).flatten()  # element 2j: low nibble
    code_values = reference.e2m1_value(codes).tolist()
    scales = scale_slot[: abi.NUM_GROUPS]
    scale_values = e4m3_signed_value(scales).tolist()  # the reader's reading of any scale byte
    values = nvfp4_dequantize_sparse_mla_cache(cache, torch.tensor([slot], device=cache.device))[0].cpu()
    padding = " ".join(f"{b:02X}" for b in scale_slot[abi.NUM_GROUPS :].tolist())
    lines += [
        f"data row at page byte {data_at}, scale slot at page byte {scale_at} (padding bytes {padding})",
        f"NoPE, {abi.NUM_GROUPS} groups of {abi.GROUP_SIZE}: value = E2M1 code value x E4M3 group scale",
    ]
    for g, scale in enumerate(scales.tolist()):
        group = slice(g * abi.GROUP_SIZE, (g + 1) * abi.GROUP_SIZE)
        amax = values[group].abs().max().item()
        lines.append(f"group {g:2}  scale 0x{scale:02X} = {scale_values[g]:g}  (max |value| {amax:g})")
        lines.append(_row("code", (f"{c:X}" for c in codes[group].tolist()), 5))
        lines.append(_row("e2m1", (f"{v:g}" for v in code_values[group]), 5))
    lines.append(f"RoPE, {abi.ROPE_DIM} BF16 values:")
    rope = values[abi.NOPE_DIM :].tolist()
    lines += [_row(f"{i:3}", (f"{v:.4g}" for v in rope[i : i + 8]), 10) for i in range(0, abi.ROPE_DIM, 8)]
    return "\n".join(lines)


def first_written_slot(cache: torch.Tensor) -> int | None:
    """The first slot whose record is not all one byte value (what no write leaves), or None.

    Parameters
    ----------
    cache : torch.Tensor
        A uint8 cache in any accepted layout, on any device.
    """
    layout = validation.check_cache(cache)
    data, scales = abi.record_views(cache.detach(), layout)
    records = torch.cat((data, scales), dim=-1).flatten(0, 1)
    written = (records != records[:, :1]).any(dim=1).nonzero()
    return int(written[0]) if written.numel() else None


def summarize_record(cache: torch.Tensor, slot: int) -> str:
    """One line on a written record: where it is, the range of its group scales and of its values.

    Parameters
    ----------
    cache : torch.Tensor
        A uint8 cache in any accepted layout, on any device.
    slot : int
        ``page * page_size + entry``.
    """
    cache = cache.detach().cpu()
    layout = validation.check_cache(cache)
    page, entry = divmod(slot, layout.page_size)
    _, scale_slots = abi.record_views(cache, layout)
    scales = scale_slots[page, entry, : abi.NUM_GROUPS]
    scale_values = e4m3_signed_value(scales)
    values = nvfp4_dequantize_sparse_mla_cache(cache, torch.tensor([slot]))[0]
    low, high = int(scales.min()), int(scales.max())
    return (
        f"slot {slot} = page {page}, entry {entry}: {abi.NUM_GROUPS} E4M3 group scales 0x{low:02X}..0x{high:02X} "
        f"({scale_values.min().item():g}..{scale_values.max().item():g}), {abi.NOPE_DIM} E2M1 codes, "
        f"{abi.ROPE_DIM} BF16 RoPE values; max |value| {values.abs().max().item():.4g}"
    )
