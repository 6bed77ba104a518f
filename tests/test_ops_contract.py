"""The entry contract, the same on every path (docs/format.md sections 6-7): what is refused, and
that a refusal writes nothing.

Each refusal is checked on the reference (CPU), and on the GPU entries where a GPU is present.
The in-place and autograd rules, real bools and ints, non-tensor arguments, memory overlap with
a tensor the call writes, and NVFP4_MLA_CHECK on the reference.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

import nvfp4_mla
from nvfp4_mla import config, launch, reference
from nvfp4_mla.testing import make_cache, random_rows, random_slots, rope_table, storage_bytes

gpu = pytest.mark.gpu


def main_args(device="cpu", num_tokens=6, num_heads=8, page_size=16):
    q = random_rows((num_tokens, num_heads, 512), device)
    kv = random_rows((num_tokens, 512), device)
    cache = make_cache(2, page_size, device=device)
    slots = random_slots(num_tokens, 2 * page_size).to(device)
    positions = torch.randint(0, 64, (num_tokens,)).to(device)
    return [q, kv, cache, slots, positions, rope_table(64, device)]


ENTRY_PATHS = [pytest.param("cpu", reference, id="reference"), pytest.param("cuda", nvfp4_mla, id="gpu", marks=gpu)]


def refused(call, match, *watched):
    """``call()`` raises ValueError matching ``match`` and leaves every byte of ``watched`` as it was."""
    before = [storage_bytes(t) for t in watched]
    with pytest.raises(ValueError, match=match):
        call()
    for t, old in zip(watched, before):
        assert torch.equal(storage_bytes(t), old), "a refused call wrote"


@pytest.mark.parametrize("device, lib", ENTRY_PATHS)
def test_in_place_q_that_requires_grad_is_refused_before_writing(device, lib):
    q, kv, cache, *rest = main_args(device)
    q.requires_grad_(True)
    refused(
        lambda: lib.cake_dsv4_nvfp4_rope_quantize_insert(q, kv, cache, *rest, q_inplace=True),
        "q is written in place but requires grad",
        q.detach(),
        cache,
    )


@pytest.mark.parametrize("device, lib", ENTRY_PATHS)
def test_q_that_requires_grad_is_fine_when_not_written(device, lib):
    q, kv, cache, *rest = main_args(device)
    q.requires_grad_(True)
    out = lib.cake_dsv4_nvfp4_rope_quantize_insert(q, kv, cache, *rest, q_head_padded=8)
    assert out.shape == (6, 8, 512) and not out.requires_grad


@pytest.mark.parametrize("device, lib", ENTRY_PATHS)
def test_inference_tensors_written_outside_inference_mode_are_refused(device, lib):
    with torch.inference_mode():
        q, kv, cache, *rest = main_args(device)
    refused(
        lambda: lib.cake_dsv4_nvfp4_rope_quantize_insert(q, kv, cache.clone(), *rest, q_inplace=True),
        "q is an inference tensor",
    )
    refused(lambda: lib.nvfp4_quantize_append_sparse_mla_cache(kv, rest[0], cache), "cache is an inference tensor")
    with torch.inference_mode():  # inside inference mode they are fine
        lib.cake_dsv4_nvfp4_rope_quantize_insert(q, kv, cache, *rest, q_inplace=True)


@pytest.mark.parametrize("device, lib", ENTRY_PATHS)
def test_new_outputs_are_plain_contiguous_tensors_that_follow_inference_mode(device, lib):
    """q_out, the packed cache, the reader's rows and the decode's out and lse are what torch.empty
    would give: on the inputs' device, contiguous, never requiring grad, inference tensors exactly
    inside inference mode. On the GPU, torch's fast allocation stays in use throughout."""
    q, kv, cache, *rest = main_args(device)
    page = random_rows((1, 16, 512), device)
    slots = rest[0].view(2, 3)
    decode_q = random_rows((1, 2, 16, 512), device)  # one batch row: split, with a workspace
    decode_slots = torch.randint(0, 32, (1, 2, 8), dtype=torch.int32).to(device)
    for inference in (False, True):
        with torch.inference_mode(inference):
            outputs = [
                lib.cake_dsv4_nvfp4_rope_quantize_insert(q, kv, cache, *rest, q_head_padded=8),
                lib.nvfp4_quantize_pack_sparse_mla_cache(page),
                lib.nvfp4_dequantize_sparse_mla_cache(cache, slots),
                lib.nvfp4_dequantize_sparse_mla_cache(cache, slots[:0]),
                *lib.sparse_mla_decode(decode_q, cache, decode_slots, sm_scale=0.05),
            ]
        for out in outputs:
            assert out.is_inference() == inference and not out.requires_grad
            assert out.is_contiguous() and out.device == q.device
    assert launch.fast_empty is launch.output_allocator(), "an entry turned the fast allocation off"


@pytest.mark.parametrize("shape", [(), (5,), (3, 512), (2, 3, 512), (0, 512), (2, 0, 3), (4, 1, 0)])
def test_contiguous_strides_are_torchs(shape):
    assert launch.contiguous_strides(shape) == torch.empty(shape).stride()


def test_new_output_turns_a_raising_fast_allocation_off_but_reraises_out_of_memory(monkeypatch, caplog):
    like = torch.zeros(2, dtype=torch.bfloat16)

    def out_of_memory(shape, strides, dtype):
        raise torch.cuda.OutOfMemoryError("CUDA out of memory")

    monkeypatch.setattr(launch, "fast_empty", out_of_memory)
    with pytest.raises(torch.cuda.OutOfMemoryError):
        launch.new_output(like, (3, 4), (4, 1), torch.uint8, -1)
    assert launch.fast_empty is out_of_memory

    def changed(shape, strides, dtype):
        raise TypeError("_empty_strided_cuda(): incompatible function arguments")

    monkeypatch.setattr(launch, "fast_empty", changed)
    out = launch.new_output(like, (3, 4), (4, 1), torch.uint8, -1)
    assert out.shape == (3, 4) and out.dtype == torch.uint8 and launch.fast_empty is None
    assert "incompatible function arguments" in caplog.text


def test_new_output_takes_new_empty_when_the_fast_allocation_is_elsewhere_or_missing(monkeypatch):
    """launch.new_output keeps torch's fast allocation only on the device asked for."""
    like = torch.zeros(2, dtype=torch.bfloat16)
    fast = torch.empty(3, 4, dtype=torch.uint8)  # stands in for the fast allocation: a CPU tensor, device -1
    monkeypatch.setattr(launch, "fast_empty", lambda shape, strides, dtype: fast)
    assert launch.new_output(like, (3, 4), (4, 1), torch.uint8, -1) is fast
    for allocator in (lambda shape, strides, dtype: fast, None):  # on another device; no fast allocation
        monkeypatch.setattr(launch, "fast_empty", allocator)
        out = launch.new_output(like, (3, 4), (4, 1), torch.uint8, 0)
        assert out is not fast and out.shape == (3, 4) and out.dtype == torch.uint8 and out.device == like.device


@pytest.mark.parametrize("device, lib", ENTRY_PATHS)
def test_in_place_writes_bump_the_version_counter(device, lib):
    q, kv, cache, *rest = main_args(device)
    q_version, cache_version = q._version, cache._version
    assert lib.cake_dsv4_nvfp4_rope_quantize_insert(q, kv, cache, *rest, q_inplace=True) is q
    assert q._version > q_version and cache._version > cache_version
    cache_version = cache._version
    lib.cake_dsv4_nvfp4_kv_rope_quantize_insert(kv, cache, *rest)
    assert cache._version > cache_version


@pytest.mark.parametrize("device, lib", ENTRY_PATHS)
@pytest.mark.parametrize(
    "option, value, match",
    [
        ("q_inplace", "False", "q_inplace must be a bool"),
        ("apply_q_rope", "False", "apply_q_rope must be a bool"),
        ("apply_q_rope", 1, "apply_q_rope must be a bool"),
        ("q_head_padded", 16.0, "q_head_padded must be 0 or one of"),
        ("q_head_padded", True, "q_head_padded must be 0 or one of"),
    ],
)
def test_flags_are_real_bools_and_ints(device, lib, option, value, match):
    q, kv, cache, *rest = main_args(device)
    options = {"q_head_padded": 8, option: value}
    refused(lambda: lib.cake_dsv4_nvfp4_rope_quantize_insert(q, kv, cache, *rest, **options), match, q, cache)


@pytest.mark.parametrize("device, lib", ENTRY_PATHS)
@pytest.mark.parametrize("ratio", [2.0, True, "2"])
def test_compress_ratio_is_a_real_int(device, lib, ratio):
    _, kv, cache, *rest = main_args(device)
    refused(
        lambda: lib.cake_dsv4_nvfp4_kv_rope_quantize_insert(kv, cache, *rest, compress_ratio=ratio),
        "compress_ratio must be one of",
        cache,
    )


@pytest.mark.parametrize("device, lib", ENTRY_PATHS)
@pytest.mark.parametrize("index, name", [(0, "q"), (1, "kv"), (2, "cache"), (3, "slot_mapping"), (5, "cos_sin_cache")])
@pytest.mark.parametrize("kind", ["numpy", "list"])
def test_non_tensors_are_named(device, lib, index, name, kind):
    args = main_args(device)
    args[index] = args[index].cpu().float().numpy() if kind == "numpy" else args[index].tolist()
    with pytest.raises(ValueError, match=rf"{name} must be a torch\.Tensor, got"):
        lib.cake_dsv4_nvfp4_rope_quantize_insert(*args, q_head_padded=8)


def test_pack_and_append_name_non_tensors():
    with pytest.raises(ValueError, match=r"latent_kv must be a torch\.Tensor"):
        reference.nvfp4_quantize_pack_sparse_mla_cache(np.zeros((1, 1, 512)))  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"cache must be a torch\.Tensor"):
        reference.nvfp4_quantize_append_sparse_mla_cache(random_rows((1, 512)), torch.zeros(1, dtype=torch.int64), [0])  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="kv_layout must be one of"):
        reference.nvfp4_quantize_pack_sparse_mla_cache(random_rows((1, 1, 512)), kv_layout=["HND"])  # type: ignore[arg-type]


def _pool_with_kv_inside(device, page_size=16):
    """A cache and a kv tensor carved from one byte pool; ``overlap`` puts kv inside the cache."""
    pool = torch.zeros(4 * page_size * 384 + 6 * 1024, dtype=torch.uint8, device=device)
    cache = pool[: 2 * page_size * 384].view(2, page_size, 384)
    inside = pool[1024 : 1024 + 6 * 1024].view(torch.bfloat16).view(6, 512)
    outside = pool[4 * page_size * 384 :].view(torch.bfloat16).view(6, 512)
    return cache, inside, outside


@pytest.mark.parametrize("device, lib", ENTRY_PATHS)
def test_inputs_overlapping_the_cache_are_refused(device, lib):
    q, _, _, slots, positions, cos_sin = main_args(device)
    cache, inside, outside = _pool_with_kv_inside(device)
    inside.copy_(random_rows((6, 512), device))
    refused(
        lambda: lib.cake_dsv4_nvfp4_kv_rope_quantize_insert(inside, cache, slots, positions, cos_sin),
        "kv overlaps cache",
        cache,
    )
    refused(lambda: lib.nvfp4_quantize_append_sparse_mla_cache(inside, slots, cache), "latent_kv overlaps cache", cache)
    refused(
        lambda: lib.cake_dsv4_nvfp4_rope_quantize_insert(q, inside, cache, slots, positions, cos_sin, q_head_padded=8),
        "kv overlaps cache",
        cache,
    )
    slot_view = cache.view(-1)[: 6 * 8].view(torch.int64)  # slot_mapping inside the cache's bytes
    refused(lambda: lib.nvfp4_quantize_append_sparse_mla_cache(outside, slot_view, cache), "slot_mapping overlaps")
    # Same pool, disjoint bytes: accepted.
    lib.nvfp4_quantize_append_sparse_mla_cache(outside, slots, cache)


@pytest.mark.parametrize("device, lib", ENTRY_PATHS)
def test_in_place_q_overlapping_another_input_is_refused(device, lib):
    q, _, cache, slots, positions, cos_sin = main_args(device)
    inside_q = q.view(-1)[: 6 * 512].view(6, 512)  # contiguous rows in q's bytes
    refused(
        lambda: lib.cake_dsv4_nvfp4_rope_quantize_insert(q, inside_q, cache, slots, positions, cos_sin, q_inplace=True),
        "kv overlaps q",
        q,
        cache,
    )
    # Not in place, q is only read: the same kv is fine.
    lib.cake_dsv4_nvfp4_rope_quantize_insert(q, inside_q, cache, slots, positions, cos_sin, q_head_padded=8)


def test_reference_checks_rows_with_nvfp4_mla_check(monkeypatch):
    q, kv, cache, slots, positions, cos_sin = main_args()
    slots[3] = slots[1]
    monkeypatch.setattr(config, "DEBUG_CHECKS", True)
    refused(
        lambda: reference.cake_dsv4_nvfp4_rope_quantize_insert(q, kv, cache, slots, positions, cos_sin),
        "row 3 repeats slot",
        cache,
    )
    refused(lambda: reference.nvfp4_quantize_append_sparse_mla_cache(kv, slots, cache), "row 3 repeats slot", cache)
    slots[3] = 0 if int(slots[1]) != 0 else 1  # unique again; now a position outside the table
    positions[2] = 64
    refused(
        lambda: reference.cake_dsv4_nvfp4_kv_rope_quantize_insert(kv, cache, slots, positions, cos_sin),
        "row 2 has position 64",
        cache,
    )


def test_compiled_in_place_call_rejects_what_eager_rejects():
    """Under torch.compile the in-place op carries q_head_padded, so the eager rule holds."""
    torch._dynamo.reset()
    args = main_args()
    step = torch.compile(
        lambda *a: nvfp4_mla.cake_dsv4_nvfp4_rope_quantize_insert(*a, q_head_padded=16, q_inplace=True),
        backend="aot_eager",
    )
    with pytest.raises(ValueError):
        step(*args)
    with pytest.raises(ValueError, match="q_inplace needs q_head_padded"):
        nvfp4_mla.reference.cake_dsv4_nvfp4_rope_quantize_insert(*args, q_head_padded=16, q_inplace=True)
