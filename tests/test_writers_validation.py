"""docs/format.md section 6: every validation message, raised as ValueError before anything is written.

The checks run through the reference entries (CPU tensors), and through
``validation.check_main(..., need_cuda=True)`` for the CUDA-only rule. Each rejected call is made
on a canary cache (nvfp4_mla.testing.make_cache) and the cache's storage must still be all canary.
"""

from __future__ import annotations

import math
import re

import pytest
import torch

import nvfp4_mla
from nvfp4_mla import config, reference, validation
from nvfp4_mla.testing import CANARY, make_cache, random_rows, raw_bytes, rope_table, storage_bytes

T, H = 4, 8
# docs/format.md: "cache must be [num_pages, page_size, 384], HND ... or NHD ..."
CACHE_SHAPE = re.compile(re.escape("cache must be [num_pages, page_size, 384], HND ") + ".* or NHD ")


def main_args(num_tokens: int = T, num_heads: int = H, layout: str = "3D") -> dict:
    return dict(
        q=random_rows((num_tokens, num_heads, 512)),
        kv=random_rows((num_tokens, 512)),
        cache=make_cache(2, 4, layout),
        slot_mapping=torch.arange(num_tokens, dtype=torch.int64),
        positions=torch.arange(num_tokens, dtype=torch.int64),
        cos_sin_cache=rope_table(16),
    )


def misaligned(shape, dtype, offset_bytes: int | None = None) -> torch.Tensor:
    """A contiguous tensor starting ``offset_bytes`` (default: one element) past a 16-byte aligned
    allocation."""
    itemsize = torch.empty(0, dtype=dtype).element_size()
    offset = (offset_bytes or itemsize) // itemsize
    buf = torch.zeros(math.prod(shape) + offset, dtype=dtype)
    assert buf.data_ptr() % 16 == 0
    t = buf[offset:].view(shape)
    assert t.is_contiguous() and t.data_ptr() % 16 == offset * itemsize % 16 != 0
    return t


def canary_intact(cache: torch.Tensor) -> bool:
    return bool((storage_bytes(cache) == CANARY).all())


def call_main(args: dict, **options):
    return reference.cake_dsv4_nvfp4_rope_quantize_insert(
        args["q"], args["kv"], args["cache"], args["slot_mapping"], args["positions"], args["cos_sin_cache"], **options
    )


def call_kv(args: dict, **options):
    return reference.cake_dsv4_nvfp4_kv_rope_quantize_insert(
        args["kv"], args["cache"], args["slot_mapping"], args["positions"], args["cos_sin_cache"], **options
    )


def call_append(args: dict):
    return reference.nvfp4_quantize_append_sparse_mla_cache(args["kv"], args["slot_mapping"], args["cache"])


def expect_rejected(call, args: dict, match, **options) -> None:
    """The call raises ValueError containing the literal phrase ``match`` (or matching the compiled
    pattern) and has written nothing."""
    if isinstance(match, str):
        match = re.escape(match)
    cache = args["cache"]
    q_before = args["q"].clone() if "q" in args and args["q"].device.type == "cpu" else None
    with pytest.raises(ValueError, match=match):
        call(args, **options)
    if cache.device.type == "cpu":
        assert canary_intact(cache), "a rejected call wrote into the cache"
    if q_before is not None:
        assert torch.equal(args["q"], q_before), "a rejected call wrote into q"


def test_valid_arguments_are_accepted():
    """The baseline every rejection below perturbs is itself valid (so each test isolates one rule)."""
    for layout in ("3D", "HND", "NHD"):
        args = main_args(layout=layout)
        out = call_main(args, q_head_padded=8)
        assert out.shape == (T, 8, 512)
        assert not canary_intact(args["cache"])
        call_kv(main_args(layout=layout), compress_ratio=2)
    args = main_args()
    call_main(args, q_inplace=True)
    validation.check_main(*main_args().values(), q_head_padded=16, apply_q_rope=True, q_inplace=False, need_cuda=False)  # type: ignore[misc]  # mypy cannot count the 6 tensors


# ------------------------------------------------------------------ q


def test_q_dtype():
    args = main_args()
    args["q"] = args["q"].float()
    expect_rejected(call_main, args, "q must have dtype torch.bfloat16")


@pytest.mark.parametrize("shape", [(T, 512), (T, H, 256), (T, H, 512, 1), (T, H, 513)])
def test_q_shape(shape):
    args = main_args()
    args["q"] = torch.zeros(shape, dtype=torch.bfloat16)
    expect_rejected(call_main, args, "q must be [num_tokens, num_heads, 512]")


def test_q_contiguous():
    args = main_args()
    args["q"] = torch.zeros(T, 2 * H, 512, dtype=torch.bfloat16)[:, ::2]
    assert args["q"].shape == (T, H, 512)
    expect_rejected(call_main, args, "q must be contiguous")


def test_q_heads():
    args = main_args()
    args["q"] = torch.zeros(T, 0, 512, dtype=torch.bfloat16)
    expect_rejected(call_main, args, "q must hold at least one head", q_head_padded=8)


# ------------------------------------------------------------------ kv


def test_kv_dtype():
    args = main_args()
    args["kv"] = args["kv"].half()
    expect_rejected(call_main, args, "kv must have dtype torch.bfloat16")
    expect_rejected(call_kv, args, "kv must have dtype torch.bfloat16")


@pytest.mark.parametrize("shape", [(T, 448), (T, 1, 512), (T * 512,)])
def test_kv_shape(shape):
    args = main_args()
    args["kv"] = torch.zeros(shape, dtype=torch.bfloat16)
    expect_rejected(call_main, args, "kv must be [num_tokens, 512]")
    expect_rejected(call_kv, args, "kv must be [num_tokens, 512]")


def test_kv_contiguous():
    args = main_args()
    args["kv"] = torch.zeros(T, 1024, dtype=torch.bfloat16)[:, :512]
    expect_rejected(call_main, args, "kv must be contiguous")
    expect_rejected(call_kv, args, "kv must be contiguous")


@pytest.mark.parametrize("rows", [T - 1, T + 1, 0])
def test_kv_rows(rows):
    args = main_args()
    args["kv"] = random_rows((rows, 512)) if rows else torch.zeros(0, 512, dtype=torch.bfloat16)
    args["slot_mapping"] = torch.arange(min(rows, T))
    expect_rejected(call_main, args, "kv must hold one row per query token")


# ------------------------------------------------------------------ cache


def test_cache_dtype():
    args = main_args()
    args["cache"] = make_cache(2, 4).view(torch.int8)
    expect_rejected(call_main, args, "cache must have dtype torch.uint8")


@pytest.mark.parametrize(
    "make",
    [
        lambda: make_cache(2, 4).view(2, 4 * 384),  # 2-D
        lambda: torch.full((2, 4, 383), 0xA5, dtype=torch.uint8),
        lambda: torch.full((2, 4, 385), 0xA5, dtype=torch.uint8),
        lambda: torch.full((2, 1, 4, 1, 384), 0xA5, dtype=torch.uint8),  # 5-D
        lambda: torch.full((2, 1, 4, 192), 0xA5, dtype=torch.uint8),
        lambda: torch.full((2, 0, 384), 0xA5, dtype=torch.uint8),  # page_size 0
        lambda: torch.full((384,), 0xA5, dtype=torch.uint8),
    ],
)
def test_cache_shape(make):
    args = main_args()
    args["cache"] = make()
    expect_rejected(call_main, args, CACHE_SHAPE)
    expect_rejected(call_kv, args, CACHE_SHAPE)


def test_cache_singleton_head_dim():
    args = main_args()
    args["cache"] = make_cache(2, 4).view(2, 2, 2, 384)
    expect_rejected(call_main, args, "singleton latent-head dimension")


def test_cache_page_stride_multiple_of_16():
    args = main_args()
    args["cache"] = make_cache(3, 4, "HND", pad=8)
    assert args["cache"].stride(0) == 4 * 384 + 8
    expect_rejected(call_main, args, "multiple of 16")
    expect_rejected(call_kv, args, "multiple of 16")


@pytest.mark.parametrize("offset", [1, 8])
def test_cache_aligned(offset):
    """A cache starting 1 or 8 bytes past an aligned allocation (8 is enough for 8-byte accesses,
    not for the kernels' 16-byte ones)."""
    args = main_args()
    args["cache"] = misaligned((2, 4, 384), torch.uint8, offset)
    raw_bytes(args["cache"]).fill_(CANARY)
    expect_rejected(call_main, args, "cache must be 16-byte aligned")
    expect_rejected(call_kv, args, "cache must be 16-byte aligned")
    expect_rejected(call_append, args, "cache must be 16-byte aligned")


@pytest.mark.parametrize("page_stride", [0, 16, 384, 4 * 384 - 16])
def test_cache_pages_overlap(page_stride):
    """A page stride that is a multiple of 16 but shorter than a page's 4 * 384 bytes: pages
    would share bytes."""
    args = main_args()
    pool = torch.full((3 * 4 * 384,), CANARY, dtype=torch.uint8)
    args["cache"] = pool.as_strided((3, 4, 384), (page_stride, 384, 1))
    expect_rejected(call_main, args, f"cache pages overlap: page stride {page_stride} < page_size * 384 = 1536")
    expect_rejected(call_kv, args, "cache pages overlap")
    expect_rejected(call_append, args, "cache pages overlap")
    with pytest.raises(ValueError, match="cache pages overlap"):
        reference.nvfp4_dequantize_sparse_mla_cache(args["cache"])


# ------------------------------------------------------------------ slot_mapping


@pytest.mark.parametrize("dtype", [torch.int16, torch.uint8, torch.float32])
def test_slot_mapping_dtype(dtype):
    args = main_args()
    args["slot_mapping"] = torch.arange(T).to(dtype)
    expect_rejected(call_main, args, "slot_mapping must have dtype torch.int32 or torch.int64")
    expect_rejected(call_kv, args, "slot_mapping must have dtype torch.int32 or torch.int64")


@pytest.mark.parametrize("bad", ["2d", "strided", "0d"])
def test_slot_mapping_contiguous_1d(bad):
    args = main_args()
    args["slot_mapping"] = {
        "2d": torch.arange(T).view(2, 2),
        "strided": torch.arange(2 * T)[::2],
        "0d": torch.tensor(0),
    }[bad]
    expect_rejected(call_main, args, "contiguous 1D")
    expect_rejected(call_kv, args, "contiguous 1D")


def test_slot_mapping_never_longer():
    args = main_args()
    args["slot_mapping"] = torch.arange(T + 1, dtype=torch.int32)
    expect_rejected(call_main, args, "never longer")
    expect_rejected(call_kv, args, "never longer")


def test_write_range_rows_and_slots():
    """A writer call takes fewer than 2^30 rows and cache slots (the kernel indexes them in 32
    bits). Meta tensors give the shapes without the bytes; the check comes before the device's."""
    big = 1 << 30
    meta_rows = torch.empty((big, 512), dtype=torch.bfloat16, device="meta")
    meta_slots = torch.empty(big, dtype=torch.int64, device="meta")
    small = make_cache(2, 4)
    with pytest.raises(ValueError, match="fewer than 2\\^30"):
        reference.nvfp4_quantize_append_sparse_mla_cache(meta_rows, meta_slots, small)
    with pytest.raises(ValueError, match="fewer than 2\\^30"):
        reference.cake_dsv4_nvfp4_kv_rope_quantize_insert(
            meta_rows, small, meta_slots, torch.empty(big, dtype=torch.int64, device="meta"), rope_table(8)
        )
    huge_cache = torch.empty((big // 64, 64, 384), dtype=torch.uint8, device="meta")
    rows = random_rows((T, 512))
    with pytest.raises(ValueError, match="fewer than 2\\^30"):
        reference.nvfp4_quantize_append_sparse_mla_cache(rows, torch.arange(T), huge_cache)
    with pytest.raises(ValueError, match="fewer than 2\\^30"):
        reference.nvfp4_quantize_pack_sparse_mla_cache(
            torch.empty((big // 64, 64, 512), dtype=torch.bfloat16, device="meta")
        )
    # one below the limit passes the range check (and fails later, on the devices)
    below = torch.empty((big - 1, 512), dtype=torch.bfloat16, device="meta")
    with pytest.raises(ValueError, match="same"):
        reference.nvfp4_quantize_append_sparse_mla_cache(
            below, torch.empty(big - 1, dtype=torch.int64, device="meta"), small
        )


# ------------------------------------------------------------------ positions and cos_sin_cache


def test_positions_int32_rejected():
    args = main_args()
    args["positions"] = torch.arange(T, dtype=torch.int32)
    expect_rejected(call_main, args, "positions must have dtype torch.int64")
    expect_rejected(call_kv, args, "positions must have dtype torch.int64")


@pytest.mark.parametrize("length", [T - 1, T + 1])
def test_positions_one_per_row(length):
    args = main_args()
    args["positions"] = torch.arange(length)
    expect_rejected(call_main, args, "one entry per token row")
    expect_rejected(call_kv, args, "one entry per token row")


def test_positions_1d():
    args = main_args()
    args["positions"] = torch.arange(T).view(2, 2)
    expect_rejected(call_main, args, "positions must be a contiguous 1D")


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16, torch.float16])
def test_cos_sin_cache_dtype(dtype):
    args = main_args()
    args["cos_sin_cache"] = args["cos_sin_cache"].to(dtype)
    expect_rejected(call_main, args, "cos_sin_cache must have dtype torch.float32")
    expect_rejected(call_kv, args, "cos_sin_cache must have dtype torch.float32")


@pytest.mark.parametrize("shape", [(16, 32), (16, 128), (16 * 64,), (1, 16, 64)])
def test_cos_sin_cache_shape(shape):
    args = main_args()
    args["cos_sin_cache"] = torch.zeros(shape)
    expect_rejected(call_main, args, "cos_sin_cache must be [max_position, 64]")
    expect_rejected(call_kv, args, "cos_sin_cache must be [max_position, 64]")


def test_cos_sin_cache_contiguous():
    args = main_args()
    args["cos_sin_cache"] = torch.zeros(64, 16).t()
    assert args["cos_sin_cache"].shape == (16, 64)
    expect_rejected(call_main, args, "cos_sin_cache must be contiguous")
    expect_rejected(call_kv, args, "cos_sin_cache must be contiguous")


# ------------------------------------------------------------------ devices and alignment


def test_must_be_cuda_tensor():
    args = main_args()
    with pytest.raises(ValueError, match=r"q must be a CUDA tensor"):
        validation.check_main(*args.values(), q_head_padded=0, apply_q_rope=True, q_inplace=False, need_cuda=True)  # type: ignore[misc]  # mypy cannot count the 6 tensors
    with pytest.raises(ValueError, match=r"must be a CUDA tensor"):
        validation.check_kv(  # type: ignore[misc, call-arg]  # mypy cannot count the 5 tensors
            *[args[k] for k in ("kv", "cache", "slot_mapping", "positions", "cos_sin_cache")], 1, need_cuda=True
        )
    with pytest.raises(ValueError, match=r"must be a CUDA tensor"):
        validation.check_append(args["kv"], args["slot_mapping"], args["cache"], need_cuda=True)
    with pytest.raises(ValueError, match=r"must be a CUDA tensor"):
        validation.check_pack(random_rows((2, 4, 512)), "HND", need_cuda=True)
    assert canary_intact(args["cache"])


@pytest.mark.parametrize("name", ["cos_sin_cache", "positions", "slot_mapping", "q"])
def test_same_device(name):
    args = main_args()
    args[name] = args[name].to("meta")
    expect_rejected(call_main, args, "same CUDA device")


def test_same_device_kv_entry():
    args = main_args()
    args["kv"] = args["kv"].to("meta")
    expect_rejected(call_kv, args, "same CUDA device")


@pytest.mark.parametrize("offset", [None, 8], ids=["one element", "8 bytes"])
@pytest.mark.parametrize("name", ["q", "kv", "cos_sin_cache"])
def test_16_byte_aligned(name, offset):
    args = main_args()
    args[name] = misaligned(tuple(args[name].shape), args[name].dtype, offset)
    expect_rejected(call_main, args, f"{name} must be 16-byte aligned")
    if name != "q":
        expect_rejected(call_kv, args, f"{name} must be 16-byte aligned")
    if name == "kv":
        expect_rejected(call_append, args, "latent_kv must be 16-byte aligned")


@pytest.mark.parametrize("offset", [2, 8])
def test_pack_16_byte_aligned(offset):
    with pytest.raises(ValueError, match="latent_kv must be 16-byte aligned"):
        reference.nvfp4_quantize_pack_sparse_mla_cache(misaligned((2, 4, 512), torch.bfloat16, offset))


# ------------------------------------------------------------------ dense tensors

NOT_DENSE = ["sparse_csr", "nested", "jagged"]


def not_dense(t: torch.Tensor, kind: str) -> torch.Tensor:
    """``t`` as a sparse CSR tensor (its rows flattened: CSR is 2-D), or a nested tensor of the
    strided or the jagged layout: tensors without the strides (sparse) or the shape (nested) the
    checks read."""
    if kind == "sparse_csr":
        return t.reshape(len(t), -1).to_sparse_csr()
    if kind == "nested":
        return torch.nested.as_nested_tensor([t])
    return torch.nested.nested_tensor([t], layout=torch.jagged)


def decode_args() -> dict:
    """A valid ``sparse_mla_decode`` call with every optional tensor, both pools and ``out``."""
    return dict(
        q=random_rows((1, 1, H, 512)),
        swa_cache=make_cache(2, 4),
        swa_slots=torch.arange(4).view(1, 1, 4),
        swa_lens=torch.tensor([[4]]),
        extra_cache=make_cache(2, 4),
        extra_slots=torch.arange(4).view(1, 1, 4),
        extra_lens=torch.tensor([[3]]),
        sinks=torch.zeros(H),
        out=torch.empty(1, 1, H, 512, dtype=torch.bfloat16),
    )


ENTRIES = {  # entry -> (valid arguments, the call, {argument key: its name in messages})
    "main": (main_args, call_main, {k: k for k in validation.writers.MAIN_NAMES}),
    "kv": (main_args, call_kv, {k: k for k in validation.writers.KV_NAMES}),
    "append": (main_args, call_append, {"kv": "latent_kv", "slot_mapping": "slot_mapping", "cache": "cache"}),
    "pack": (
        lambda: {"latent_kv": random_rows((2, 4, 512))},
        lambda a: reference.nvfp4_quantize_pack_sparse_mla_cache(a["latent_kv"]),
        {"latent_kv": "latent_kv"},
    ),
    # The check is shared (validation.common.check_tensors): the decode entry, CPU tensors
    # and out included, which runs the reference and then checks out.
    "decode": (decode_args, lambda a: nvfp4_mla.sparse_mla_decode(**a, sm_scale=0.1), {k: k for k in decode_args()}),
}


@pytest.mark.filterwarnings("ignore:Sparse CSR tensor support is in beta", "ignore:The PyTorch API of nested tensors")
@pytest.mark.parametrize("kind", NOT_DENSE)
@pytest.mark.parametrize("entry", list(ENTRIES))
def test_sparse_and_nested_tensors_are_named(entry, kind):
    """A sparse or nested tensor in any tensor argument gets a ValueError naming it, not a
    RuntimeError from deep inside torch (a sparse tensor has no strides, a nested one no shape)."""
    make, call, names = ENTRIES[entry]
    call(make())  # the baseline is valid
    for key, name in names.items():
        args = make()
        args[key] = not_dense(args[key], kind)
        with pytest.raises(ValueError, match=re.escape(f"{name} must be a dense tensor")):
            call(args)


@pytest.mark.filterwarnings("ignore:Sparse CSR tensor support is in beta", "ignore:The PyTorch API of nested tensors")
@pytest.mark.parametrize("kind", NOT_DENSE)
def test_kernel_path_names_sparse_and_nested_tensors(kind):
    """The kernel path's signature (read before the checks) never takes such a tensor for a dense
    one (no key, or another key), so the full checks run and name it, before the CUDA rule."""
    args, options = main_args(), ("main", 0, True, False)
    args["cache"] = not_dense(args["cache"], kind)
    assert validation.signature(tuple(args.values()), options) != validation.signature(
        tuple(main_args().values()), options
    )
    with pytest.raises(ValueError, match="cache must be a dense tensor"):
        validation.check_main(*args.values(), q_head_padded=0, apply_q_rope=True, q_inplace=False, need_cuda=True)  # type: ignore[misc]  # mypy cannot count the 6 tensors


# ------------------------------------------------------------------ options


@pytest.mark.parametrize("hp", [7, True, 256, -8, 4, 8.0, None, "16"])
def test_q_head_padded_values(hp):
    args = main_args()
    expect_rejected(call_main, args, "q_head_padded must be 0 or one of (8, 16, 32, 64, 128)", q_head_padded=hp)


def test_q_head_padded_checked_on_empty_batch():
    args = main_args(num_tokens=0)
    expect_rejected(call_main, args, "q_head_padded must be 0 or one of", q_head_padded=7)


def test_q_head_padded_at_least_heads():
    args = main_args(num_heads=16)
    expect_rejected(call_main, args, "at least the number of query heads", q_head_padded=8)
    args = main_args(num_heads=9)
    expect_rejected(call_main, args, "at least the number of query heads", q_head_padded=8)


@pytest.mark.parametrize("heads,hp", [(16, 32), (8, 16), (8, 128)])
def test_q_inplace_with_head_padding(heads, hp):
    args = main_args(num_heads=heads)
    expect_rejected(call_main, args, "q_inplace", q_inplace=True, q_head_padded=hp)


@pytest.mark.parametrize("heads", [1, 4, 12, 24, 256])
def test_q_inplace_unsupported_head_count(heads):
    args = main_args(num_heads=heads)
    expect_rejected(call_main, args, "q_inplace needs num_heads in (8, 16, 32, 64, 128)", q_inplace=True)
    expect_rejected(call_main, args, "q_inplace needs num_heads", q_inplace=True, apply_q_rope=False)


@pytest.mark.parametrize("ratio", [3, 0, 4, -1, True, 2.0, None])
def test_compress_ratio(ratio):
    args = main_args()
    expect_rejected(call_kv, args, "compress_ratio must be one of (1, 2)", compress_ratio=ratio)


# ------------------------------------------------------------------ append and pack entries


def test_append_validation():
    args = main_args()
    args["kv"] = args["kv"].float()
    expect_rejected(call_append, args, "kv must have dtype torch.bfloat16")
    args = main_args()
    args["kv"] = torch.zeros(T, 448, dtype=torch.bfloat16)
    expect_rejected(call_append, args, "kv must be [num_tokens, 512]")
    args = main_args()
    args["slot_mapping"] = torch.arange(T + 1)
    expect_rejected(call_append, args, "never longer")
    args = main_args()
    args["slot_mapping"] = torch.arange(T).view(2, 2).to(torch.int32)
    expect_rejected(call_append, args, "contiguous 1D")
    args = main_args()
    args["cache"] = make_cache(2, 4).view(2, 2, 2, 384)
    expect_rejected(call_append, args, "singleton latent-head dimension")
    args = main_args()
    args["cache"] = make_cache(3, 4, pad=8)
    expect_rejected(call_append, args, "multiple of 16")
    args = main_args()
    args["kv"] = misaligned((T, 512), torch.bfloat16)
    expect_rejected(call_append, args, "16-byte aligned")
    args = main_args()
    args["slot_mapping"] = args["slot_mapping"].to("meta")
    expect_rejected(call_append, args, "same CUDA device")


@pytest.mark.parametrize("layout", ["3D", "hnd", "", None, "NHD "])
def test_pack_bad_kv_layout(layout):
    with pytest.raises(ValueError, match=r"kv_layout must be one of"):
        reference.nvfp4_quantize_pack_sparse_mla_cache(random_rows((2, 4, 512)), kv_layout=layout)


def test_pack_bad_rows():
    with pytest.raises(ValueError, match=re.escape("kv must have dtype torch.bfloat16")):
        reference.nvfp4_quantize_pack_sparse_mla_cache(torch.zeros(2, 4, 512))
    for shape in [(8, 512), (2, 4, 448), (2, 0, 512)]:
        with pytest.raises(ValueError, match=re.escape("latent_kv must be [num_pages, page_size, 512]")):
            reference.nvfp4_quantize_pack_sparse_mla_cache(torch.zeros(shape, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match=r"latent_kv must be contiguous"):
        reference.nvfp4_quantize_pack_sparse_mla_cache(torch.zeros(4, 2, 512, dtype=torch.bfloat16).transpose(0, 1))


# ---------------------------------------------------------------- NVFP4_MLA_CHECK debug checks


def test_debug_check_names_the_first_out_of_range_position():
    positions = torch.tensor([0, 5, 99, -1, 100])
    with pytest.raises(ValueError, match=r"row 3 has position -1, outside cos_sin_cache \[0, 100\)"):
        validation.debug_check_rows(torch.arange(5), 64, positions, 100)
    validation.debug_check_rows(torch.arange(5), 64, positions.clamp(0, 99), 100)


def test_debug_check_ratio_two_checks_the_rope_row():
    validation.debug_check_rows(torch.arange(2), 64, torch.tensor([8, 9]), 10, compress_ratio=2)  # rope rows 8, 8
    with pytest.raises(ValueError, match="row 1 has position 11"):
        validation.debug_check_rows(torch.arange(2), 64, torch.tensor([8, 11]), 10, compress_ratio=2)


@pytest.mark.parametrize("ratio", [1, 2])
def test_debug_check_of_the_kv_entry_skips_padding_rows(monkeypatch, ratio):
    """Rows past slot_mapping are never inserted by the KV entry: their positions are not checked."""
    monkeypatch.setattr(config, "DEBUG_CHECKS", True)
    kv = torch.zeros(3, 512, dtype=torch.bfloat16)
    cache = torch.zeros(2, 16, 384, dtype=torch.uint8)
    table = torch.zeros(10, 64)
    validation.check_kv(kv, cache, torch.arange(2), torch.tensor([1, 3, 12]), table, ratio, need_cuda=False)
    with pytest.raises(ValueError, match="row 1 has position 12"):
        validation.check_kv(kv, cache, torch.arange(2), torch.tensor([1, 12, 3]), table, ratio, need_cuda=False)


def test_debug_check_names_a_repeated_valid_slot():
    slots = torch.tensor([3, -1, 7, -1, 64, 64, 7], dtype=torch.int32)  # -1 and 64 are padding
    with pytest.raises(ValueError, match="row 6 repeats slot 7 of row 2"):
        validation.debug_check_rows(slots, 64)
    validation.debug_check_rows(slots[:6], 64)


@pytest.mark.parametrize("capacity", [1, 64])
def test_debug_check_repeated_slot_zero_and_last(capacity):
    """Slot 0 and the last slot are valid slots like any other: repeating either is refused."""
    for slot in (0, capacity - 1):
        slots = torch.tensor([slot, -1, capacity, slot])
        with pytest.raises(ValueError, match=f"row 3 repeats slot {slot} of row 0"):
            validation.debug_check_rows(slots, capacity)


def test_debug_checks_follow_the_environment_at_import():
    import subprocess
    import sys

    code = "import nvfp4_mla.config as c; print(c.DEBUG_CHECKS)"
    for value, expected in (("1", "True"), ("0", "False"), ("", "False")):
        env = {**__import__("os").environ, "NVFP4_MLA_CHECK": value}
        out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
        assert out.stdout.strip() == expected
