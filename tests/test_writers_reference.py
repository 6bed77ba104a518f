"""docs/format.md section 5 row semantics of the reference entries, byte for byte.

Every test writes into canary caches (nvfp4_mla.testing.make_cache, 0xA5) and compares EVERY byte of the
cache's storage with an expectation built here: the addressed records are
``reference.quantize_rows`` of the expected BF16 row (roped with ``reference.rope``, both checked
against exact arithmetic in test_reference_numerics), placed by this file's own addressing of
docs/format.md section 3, and every other byte is still the canary.
"""

from __future__ import annotations

import pytest
import torch

from nvfp4_mla import abi, reference
from nvfp4_mla.testing import CANARY, bits, make_cache, random_rows, rope_table, storage_bytes

NAN_BITS = 0x7FC0  # torch's BF16 NaN (positive as an int16)
assert NAN_BITS == abi.BF16_NAN_BITS

# ------------------------------------------------------------------ expectations


def geometry(cache: torch.Tensor) -> tuple[int, int, int]:
    """num_pages, page_size, page stride in bytes, read from the shape per docs/format.md section 3."""
    if cache.dim() == 3:
        page_size = cache.shape[1]
    elif cache.shape[1] == 1:
        page_size = cache.shape[2]
    else:
        page_size = cache.shape[1]
    return cache.shape[0], page_size, cache.stride(0)


def expected_storage(cache: torch.Tensor, records: dict[int, torch.Tensor]) -> torch.Tensor:
    """The canary storage with the records of ``{slot: bf16 row [512]}`` written in."""
    want = torch.full_like(storage_bytes(cache), CANARY)
    num_pages, page_size, stride = geometry(cache)
    if not records:
        return want
    slots = list(records)
    data, scales = reference.quantize_rows(torch.stack([records[s] for s in slots]))
    base = cache.storage_offset()
    for i, slot in enumerate(slots):
        assert 0 <= slot < num_pages * page_size
        page, entry = divmod(slot, page_size)
        start = base + page * stride
        want[start + entry * 352 : start + entry * 352 + 352] = data[i]
        scale_at = start + page_size * 352 + entry * 32
        want[scale_at : scale_at + 32] = scales[i]
        assert scales[i, 28:].tolist() == [0, 0, 0, 0]
    return want


def roped_row(x: torch.Tensor, table: torch.Tensor, row: int) -> torch.Tensor:
    """``x[..., 512]`` with dims 448.. rotated by RoPE row ``row`` of the table; NoPE bitwise."""
    rot = reference.rope(x[..., 448:], table[row, :32], table[row, 32:])
    return torch.cat((x[..., :448], rot), dim=-1)


def assert_storage(cache: torch.Tensor, want: torch.Tensor) -> None:
    got = storage_bytes(cache)
    bad = (got != want).nonzero().flatten()
    assert bad.numel() == 0, f"{bad.numel()} bytes differ, first at storage byte {bad[0].item()}"


def assert_bits(got: torch.Tensor, want: torch.Tensor) -> None:
    assert got.dtype == torch.bfloat16 and got.shape == want.shape
    assert torch.equal(bits(got), bits(want))


def expected_q_out(q, positions, table, q_head_padded, apply_q_rope=True):
    T, H = q.shape[0], q.shape[1]
    out = torch.zeros(T, q_head_padded, 512, dtype=torch.bfloat16)
    for i in range(T):
        p = int(positions[i])
        if not apply_q_rope:
            out[i, :H] = q[i]
        elif 0 <= p < table.shape[0]:
            out[i, :H] = roped_row(q[i], table, p)
        else:
            out[i, :H] = torch.tensor(NAN_BITS, dtype=torch.int16).view(torch.bfloat16)
    return out


def main_records(kv, slot_mapping, positions, table, capacity):
    """{slot: expected row} of the main entry (and of the KV entry with ratio 1)."""
    records = {}
    for i in range(slot_mapping.numel()):
        s, p = int(slot_mapping[i]), int(positions[i])
        if 0 <= s < capacity and 0 <= p < table.shape[0]:
            records[s] = roped_row(kv[i], table, p)
    return records


# ------------------------------------------------------------------ main entry


@pytest.mark.parametrize("layout", ["3D", "HND", "NHD"])
@pytest.mark.parametrize("page_size,pad", [(1, 0), (3, 16), (64, 64), (3, 0), (1, 64), (64, 16)])
@pytest.mark.parametrize("slot_dtype", [torch.int32, torch.int64])
def test_main_layouts(seed, layout, page_size, pad, slot_dtype):
    T, H, hp = 24, 8, 16
    num_pages = max(2, -(-2 * T // page_size))
    cap = num_pages * page_size
    q, kv = random_rows((T, H, 512)), random_rows((T, 512))
    table = rope_table(300)
    positions = torch.randint(0, 300, (T,))
    slots = torch.randperm(cap)[:T].to(slot_dtype)
    # padding entries: negative and out-of-range slots are skipped
    slots[3], slots[7], slots[11] = -1, cap, -(2**31) if slot_dtype == torch.int32 else -(2**40)
    slots[15] = 2**31 - 1 if slot_dtype == torch.int32 else 2**40
    cache = make_cache(num_pages, page_size, layout, pad)
    out = reference.cake_dsv4_nvfp4_rope_quantize_insert(q, kv, cache, slots, positions, table, q_head_padded=hp)
    assert_bits(out, expected_q_out(q, positions, table, hp))
    records = main_records(kv, slots, positions, table, cap)
    assert len(records) == T - 4
    assert_storage(cache, expected_storage(cache, records))


def test_main_padded_pool_bytes_untouched(seed):
    """A full pool: every slot written; the padding bytes after each page stay canary."""
    num_pages, page_size, pad = 4, 3, 64
    cap = num_pages * page_size
    kv, q = random_rows((cap, 512)), random_rows((cap, 8, 512))
    table = rope_table(64)
    positions = torch.randint(0, 64, (cap,))
    cache = make_cache(num_pages, page_size, "NHD", pad)
    slots = torch.randperm(cap)
    reference.cake_dsv4_nvfp4_rope_quantize_insert(q, kv, cache, slots, positions, table, q_head_padded=8)
    got = storage_bytes(cache).view(num_pages, page_size * 384 + pad)
    assert (got[:, page_size * 384 :] == CANARY).all()
    assert (got[:, page_size * 384 :] == CANARY).sum() == num_pages * pad
    assert_storage(cache, expected_storage(cache, main_records(kv, slots, positions, table, cap)))


def test_main_data_parallel_padding(seed):
    T, n, H = 20, 13, 8
    q, kv = random_rows((T, H, 512)), random_rows((T, 512))
    table = rope_table(128)
    positions = torch.randint(0, 128, (T,))
    cache = make_cache(4, 16, "HND", 16)
    slots = torch.randperm(64)[:n]
    out = reference.cake_dsv4_nvfp4_rope_quantize_insert(q, kv, cache, slots, positions, table, q_head_padded=8)
    assert_bits(out, expected_q_out(q, positions, table, 8))  # rows >= n get q_out too
    records = main_records(kv, slots, positions, table, 64)
    assert len(records) == n
    assert_storage(cache, expected_storage(cache, records))
    # n == 0: cache untouched, q_out still written
    cache = make_cache(4, 16)
    out = reference.cake_dsv4_nvfp4_rope_quantize_insert(
        q, kv, cache, torch.empty(0, dtype=torch.int32), positions, table, q_head_padded=16
    )
    assert_bits(out, expected_q_out(q, positions, table, 16))
    assert_storage(cache, expected_storage(cache, {}))


@pytest.mark.parametrize("H,hp", [(1, 8), (5, 8), (8, 8), (12, 16), (16, 128)])
def test_main_q_padding(seed, H, hp):
    T = 6
    q, kv = random_rows((T, H, 512)), random_rows((T, 512))
    table = rope_table(32)
    positions = torch.randint(0, 32, (T,))
    cache = make_cache(2, 8)
    slots = torch.randperm(16)[:T]
    out = reference.cake_dsv4_nvfp4_rope_quantize_insert(q, kv, cache, slots, positions, table, q_head_padded=hp)
    assert out.shape == (T, hp, 512) and out.dtype == torch.bfloat16
    assert (bits(out[:, H:]) == 0).all()  # padded heads: +0 bits
    assert torch.equal(bits(out[:, :H, :448]), bits(q[:, :, :448]))  # NoPE bitwise
    assert_bits(out, expected_q_out(q, positions, table, hp))
    assert_storage(cache, expected_storage(cache, main_records(kv, slots, positions, table, 16)))


def test_main_apply_q_rope_false(seed):
    T, H = 9, 6
    q, kv = random_rows((T, H, 512)), random_rows((T, 512))
    q[0, 0, 448:452] = torch.tensor([float("nan"), -0.0, float("inf"), 1e-40])  # copied bitwise
    table = rope_table(50)
    positions = torch.randint(0, 50, (T,))
    positions[2] = 50  # out of range: not inserted, but the plain copy is unaffected
    cache = make_cache(3, 4, "NHD")
    slots = torch.randperm(12)[:T]
    q_before = q.clone()
    out = reference.cake_dsv4_nvfp4_rope_quantize_insert(
        q, kv, cache, slots, positions, table, q_head_padded=8, apply_q_rope=False
    )
    assert torch.equal(bits(out[:, :H]), bits(q_before))
    assert (bits(out[:, H:]) == 0).all()
    assert torch.equal(bits(q), bits(q_before))
    records = main_records(kv, slots, positions, table, 12)
    assert len(records) == T - 1
    assert_storage(cache, expected_storage(cache, records))  # the cache is still roped


@pytest.mark.parametrize("H", [8, 16])
@pytest.mark.parametrize("hp_same", [False, True])
def test_main_q_inplace(seed, H, hp_same):
    T = 11
    q, kv = random_rows((T, H, 512)), random_rows((T, 512))
    table = rope_table(40)
    positions = torch.randint(0, 40, (T,))
    cache = make_cache(3, 8, "HND", 32)
    slots = torch.randperm(24)[:T]
    q_before = q.clone()
    out = reference.cake_dsv4_nvfp4_rope_quantize_insert(
        q, kv, cache, slots, positions, table, q_head_padded=H if hp_same else 0, q_inplace=True
    )
    assert out is q
    assert torch.equal(bits(q[..., :448]), bits(q_before[..., :448]))  # NoPE untouched
    want = torch.stack([roped_row(q_before[i], table, int(positions[i])) for i in range(T)])
    assert_bits(q, want)
    assert_storage(cache, expected_storage(cache, main_records(kv, slots, positions, table, 24)))


def test_main_q_inplace_without_rope(seed):
    T, H = 7, 32
    q, kv = random_rows((T, H, 512)), random_rows((T, 512))
    table = rope_table(16)
    positions = torch.randint(0, 16, (T,))
    cache = make_cache(1, 7)
    slots = torch.randperm(7).to(torch.int32)
    q_before = q.clone()
    out = reference.cake_dsv4_nvfp4_rope_quantize_insert(
        q, kv, cache, slots, positions, table, q_inplace=True, apply_q_rope=False
    )
    assert out is q
    assert torch.equal(bits(q), bits(q_before))
    assert_storage(cache, expected_storage(cache, main_records(kv, slots, positions, table, 7)))


def test_main_cache_only_equals_kv_entry(seed):
    T = 30
    q, kv = random_rows((T, 8, 512)), random_rows((T, 512))
    table = rope_table(100)
    positions = torch.randint(0, 100, (T,))
    positions[4] = -3
    positions[5] = 100
    slots = torch.randperm(48)[:T]
    slots[6] = -1
    a, b = make_cache(3, 16, "NHD", 16), make_cache(3, 16, "NHD", 16)
    out = reference.cake_dsv4_nvfp4_rope_quantize_insert(q, kv, a, slots, positions, table)
    assert out.shape == (T, 0, 512) and out.dtype == torch.bfloat16
    reference.cake_dsv4_nvfp4_kv_rope_quantize_insert(kv, b, slots, positions, table, compress_ratio=1)
    assert torch.equal(storage_bytes(a), storage_bytes(b))
    records = main_records(kv, slots, positions, table, 48)
    assert len(records) == T - 3
    assert_storage(a, expected_storage(a, records))


def test_main_empty_batch():
    table = rope_table(8)
    q, kv = torch.empty(0, 8, 512, dtype=torch.bfloat16), torch.empty(0, 512, dtype=torch.bfloat16)
    slots, positions = torch.empty(0, dtype=torch.int64), torch.empty(0, dtype=torch.int64)
    cache = make_cache(2, 4, "HND")
    for hp in (0, 8, 16):
        out = reference.cake_dsv4_nvfp4_rope_quantize_insert(q, kv, cache, slots, positions, table, q_head_padded=hp)
        assert out.shape == (0, hp, 512) and out.dtype == torch.bfloat16
    out = reference.cake_dsv4_nvfp4_rope_quantize_insert(q, kv, cache, slots, positions, table, q_inplace=True)
    assert out is q
    reference.cake_dsv4_nvfp4_kv_rope_quantize_insert(kv, cache, slots, positions, table, compress_ratio=2)
    reference.nvfp4_quantize_append_sparse_mla_cache(kv, slots, cache)
    assert_storage(cache, expected_storage(cache, {}))


def test_main_position_safety(seed):
    T, H, hp = 12, 8, 16
    q, kv = random_rows((T, H, 512)), random_rows((T, 512))
    max_position = 20
    # rows of a later window, so that row 0 is not the identity rotation: a reference that rotated
    # out-of-range rows with some in-range row would show
    table = rope_table(max_position + 9)[9:].clone()
    positions = torch.randint(0, max_position, (T,))
    bad = [1, 4, 7, 10]
    positions[1], positions[4], positions[7], positions[10] = -1, max_position, 2**40, -(2**62)
    slots = torch.randperm(24)[:T]
    cache = make_cache(3, 8)
    out = reference.cake_dsv4_nvfp4_rope_quantize_insert(q, kv, cache, slots, positions, table, q_head_padded=hp)
    assert (bits(out[bad, :H]) == NAN_BITS).all()  # live heads: BF16 NaN, all 512 dims
    assert (bits(out[:, H:]) == 0).all()
    assert_bits(out, expected_q_out(q, positions, table, hp))
    records = main_records(kv, slots, positions, table, 24)
    assert len(records) == T - len(bad) and not {int(slots[i]) for i in bad} & set(records)
    assert_storage(cache, expected_storage(cache, records))
    # in place: the bad rows' q is left untouched, the others rotated
    cache = make_cache(3, 8)
    q2 = q.clone()
    reference.cake_dsv4_nvfp4_rope_quantize_insert(q2, kv, cache, slots, positions, table, q_inplace=True)
    good = [i for i in range(T) if i not in bad]
    assert torch.equal(bits(q2[bad]), bits(q[bad]))
    want = torch.stack([roped_row(q[i], table, int(positions[i])) for i in good])
    assert_bits(q2[good], want)
    assert_storage(cache, expected_storage(cache, records))
    # a KV entry with out-of-range positions: the same rows are skipped
    cache = make_cache(3, 8)
    reference.cake_dsv4_nvfp4_kv_rope_quantize_insert(kv, cache, slots, positions, table)
    assert_storage(cache, expected_storage(cache, records))


def test_main_position_safety_empty_table():
    """max_position 0: every row is out of range; nothing read, nothing inserted."""
    q, kv = random_rows((3, 8, 512)), random_rows((3, 512))
    table = torch.empty(0, 64)
    cache = make_cache(1, 4)
    out = reference.cake_dsv4_nvfp4_rope_quantize_insert(
        q, kv, cache, torch.arange(3), torch.zeros(3, dtype=torch.int64), table, q_head_padded=8
    )
    assert (bits(out) == NAN_BITS).all()
    assert_storage(cache, expected_storage(cache, {}))


# ------------------------------------------------------------------ KV entry


def test_kv_entry_compress_ratio_2(seed):
    T = 24
    kv = random_rows((T, 512))
    max_position = 40
    table = rope_table(max_position)
    positions = torch.cat((torch.arange(0, 8), torch.randint(0, max_position, (T - 8,))))
    positions[-1], positions[-2], positions[-3] = -1, max_position + 1, max_position - 1  # 39: row 38
    slots = torch.randperm(32)[:T]
    cache = make_cache(2, 16, "HND", 16)
    reference.cake_dsv4_nvfp4_kv_rope_quantize_insert(kv, cache, slots, positions, table, compress_ratio=2)
    records = {}
    for i in range(T):
        p = int(positions[i])
        if p >= 0 and (p + 1) % 2 == 0 and p // 2 * 2 < max_position:
            records[int(slots[i])] = roped_row(kv[i], table, p // 2 * 2)
    assert int(slots[0]) not in records  # position 0: not inserted
    assert int(slots[1]) in records  # position 1: inserted with RoPE row 0
    assert torch.equal(bits(records[int(slots[1])]), bits(roped_row(kv[1], table, 0)))
    assert int(slots[T - 3]) in records and int(slots[T - 1]) not in records and int(slots[T - 2]) not in records
    assert_storage(cache, expected_storage(cache, records))
    # spelled out for position 3 (row index 3): RoPE row 2, not 3
    dq = reference.nvfp4_dequantize_sparse_mla_cache(cache, slots[3:4])
    assert torch.equal(dq[0, 448:], roped_row(kv[3], table, 2)[448:].float())
    assert not torch.equal(dq[0, 448:], roped_row(kv[3], table, 3)[448:].float())


def test_kv_entry_ratio_1_and_padding(seed):
    T, n = 16, 10
    kv = random_rows((T, 512))
    table = rope_table(64)
    positions = torch.randint(0, 64, (T,))
    slots = torch.randperm(30)[:n].to(torch.int32)
    slots[0] = 30  # out of range
    cache = make_cache(10, 3, "3D", 48)
    reference.cake_dsv4_nvfp4_kv_rope_quantize_insert(kv, cache, slots, positions, table)
    records = main_records(kv, slots, positions, table, 30)
    assert len(records) == n - 1
    assert_storage(cache, expected_storage(cache, records))


# ------------------------------------------------------------------ append and pack


@pytest.mark.parametrize("layout", ["3D", "HND", "NHD"])
def test_append_entry(seed, layout):
    rows = random_rows((20, 512))
    rows[0, 448:452] = torch.tensor([float("nan"), -0.0, float("inf"), 1e-40])  # RoPE dims bitwise
    slots = torch.randperm(21)[:15]
    slots[2], slots[9] = -5, 21
    cache = make_cache(7, 3, layout, 16)
    reference.nvfp4_quantize_append_sparse_mla_cache(rows, slots, cache)
    records = {int(s): rows[i] for i, s in enumerate(slots.tolist()) if 0 <= s < 21}
    assert len(records) == 13
    assert_storage(cache, expected_storage(cache, records))
    got = storage_bytes(cache)
    page, entry = divmod(int(slots[0]), 3)
    at = page * cache.stride(0) + entry * 352 + 224
    assert got[at : at + 8].view(torch.int16).tolist() == bits(rows[0, 448:452]).tolist()


@pytest.mark.parametrize("layout", ["HND", "NHD"])
@pytest.mark.parametrize("page_size", [1, 3, 64])
def test_pack_equals_append(seed, layout, page_size):
    num_pages = 3
    pages = random_rows((num_pages, page_size, 512))
    packed = reference.nvfp4_quantize_pack_sparse_mla_cache(pages, kv_layout=layout)
    shape = (num_pages, 1, page_size, 384) if layout == "HND" else (num_pages, page_size, 1, 384)
    assert packed.shape == shape and packed.dtype == torch.uint8 and packed.is_contiguous()
    cache = make_cache(num_pages, page_size, layout)
    rows = pages.reshape(-1, 512)
    reference.nvfp4_quantize_append_sparse_mla_cache(rows, torch.arange(num_pages * page_size), cache)
    assert torch.equal(storage_bytes(packed), storage_bytes(cache))
    assert_storage(cache, expected_storage(cache, {i: rows[i] for i in range(len(rows))}))
    assert_storage(packed, expected_storage(packed, {i: rows[i] for i in range(len(rows))}))
    assert packed.untyped_storage().nbytes() == num_pages * page_size * 384


def test_pack_default_layout_is_hnd():
    pages = random_rows((2, 4, 512))
    assert reference.nvfp4_quantize_pack_sparse_mla_cache(pages).shape == (2, 1, 4, 384)
