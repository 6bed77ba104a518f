"""``torch.library.opcheck`` over every custom op of the library (the ``nvfp4_mla`` namespace).

Each op runs opcheck's four checks on small valid inputs: test_schema (the declared mutations and
aliasing match what the op does), test_autograd_registration, test_faketensor (the fake
implementation's outputs match the real ones in shape, dtype and strides) and
test_aot_dispatch_dynamic (the op traced with dynamic shapes through AOT autograd gives the
eager results, mutations included). On the CPU the ops run the reference; the ``gpu`` cases run the
same checks on CUDA tensors, through the kernels. test_every_op_has_cases fails for an op
without a case here, so a new op cannot miss its opcheck.

No input requires grad: the ops have no autograd formula (the writers and the reader are not
differentiable, the decode is inference only), so backward through them raises, as opcheck's
test_aot_dispatch_dynamic would report. Outputs hold no NaN: opcheck compares with
``torch.testing.assert_close``, for which NaN differs from NaN.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

import nvfp4_mla  # noqa: F401  # registers the ops
from nvfp4_mla import abi, reference
from nvfp4_mla.testing import make_cache, random_rows, random_slots, rope_table

NAMESPACE = "nvfp4_mla"
BF16 = torch.bfloat16
SM_SCALE = abi.HEAD_DIM**-0.5
CHECKS = ("test_schema", "test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic")
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


def registered_ops() -> set[str]:
    """The names of every op registered under the library's namespace (the dispatcher's list: the
    ``torch.ops.nvfp4_mla`` namespace object only lists the ops looked up so far)."""
    prefix = NAMESPACE + "::"
    return {
        name[len(prefix) :].split(".")[0] for name in torch._C._dispatch_get_all_op_names() if name.startswith(prefix)
    }


# ---------------------------------------------------------------- inputs


def filled_cache(num_pages: int, page_size: int, device, layout: str = "3D", pad: int = 0) -> torch.Tensor:
    """A cache (a canary one, then every record written from random rows)."""
    cache = make_cache(num_pages, page_size, layout, pad, device)
    capacity = num_pages * page_size
    rows = random_rows((capacity, abi.HEAD_DIM), device)
    reference.nvfp4_quantize_append_sparse_mla_cache(rows, torch.arange(capacity, device=device), cache)
    return cache


def some_invalid(slots: torch.Tensor, capacity: int) -> torch.Tensor:
    """``slots`` with its first entry -1 and its last ``capacity`` (both masked or skipped)."""
    slots = slots.clone()
    flat = slots.view(-1)
    flat[0] = -1
    flat[-1] = capacity
    return slots


def writer_inputs(device, num_tokens: int = 6, num_heads: int = 8, layout: str = "3D"):
    """q, kv, a canary cache of 2 pages of 16, 5 distinct slots (two invalid), positions, a RoPE table."""
    q = random_rows((num_tokens, num_heads, abi.HEAD_DIM), device)
    kv = random_rows((num_tokens, abi.HEAD_DIM), device)
    cache = make_cache(2, 16, layout, 16 if layout == "3D" else 0, device)
    slots = some_invalid(random_slots(num_tokens - 1, 32, device=device), 32)
    positions = torch.randint(0, 64, (num_tokens,), device=device)
    return q, kv, cache, slots, positions, rope_table(64, device)


def decode_inputs(device, extra: bool, batch: int = 2, q_len: int = 2, heads: int = 16):
    """The op's arguments: q, the sliding-window pool (with lengths when ``extra``), then the extra
    pool (or Nones), sm_scale and sinks (with ``extra``)."""
    q = random_rows((batch, q_len, heads, abi.HEAD_DIM), device)
    swa_cache = filled_cache(4, 16, device)
    swa_slots = some_invalid(torch.randint(0, 64, (batch, q_len, 24), device=device), 64)
    if not extra:
        return (q, swa_cache, swa_slots, None, None, None, None, SM_SCALE, None)
    swa_lens = torch.tensor([[24, 7], [0, 30]], dtype=torch.int32, device=device)[:batch, :q_len]
    extra_cache = filled_cache(3, 8, device, "HND", 32)
    extra_slots = some_invalid(torch.randint(0, 24, (batch, q_len, 9), device=device, dtype=torch.int32), 24)
    extra_lens = torch.full((batch, q_len), 9, device=device)
    sinks = torch.randn(heads, device=device)
    return (q, swa_cache, swa_slots, swa_lens, extra_cache, extra_slots, extra_lens, SM_SCALE, sinks)


def rope_insert(device, q_head_padded: int, apply_q_rope: bool = True):
    return (*writer_inputs(device, layout="HND"), q_head_padded, apply_q_rope)


def kv_insert(device, compress_ratio: int):
    _, kv, cache, slots, positions, cos_sin = writer_inputs(device, layout="NHD")
    return kv, cache, slots, positions, cos_sin, compress_ratio


def append(device):
    _, kv, cache, slots, _, _ = writer_inputs(device)
    return kv, slots.int(), cache


def dequantize(device, slots: bool, dtype: torch.dtype, invalid: float):
    cache = filled_cache(3, 16, device, "NHD")
    read = some_invalid(torch.randint(0, 48, (2, 5), device=device), 48) if slots else None
    return cache, read, dtype, invalid


def dequantize_out(device, dtype: torch.dtype):
    cache, slots, _, invalid = dequantize(device, True, dtype, 0.0)
    assert slots is not None
    return cache, slots, dtype, invalid, torch.empty((*slots.shape, abi.HEAD_DIM), dtype=dtype, device=device)


def decode_out(device, extra: bool):
    args = decode_inputs(device, extra)
    return (*args, torch.empty_like(args[0]))


# op -> {case id: the op's arguments on a device}
CASES: dict[str, dict[str, Callable[[str], tuple]]] = {
    "rope_quantize_insert": {
        "padded16": lambda d: rope_insert(d, 16),
        "cache_only": lambda d: rope_insert(d, 0),
        "copy_q": lambda d: rope_insert(d, 8, apply_q_rope=False),
    },
    "rope_quantize_insert_inplace": {
        "rope": lambda d: rope_insert(d, 0),
        "no_rope": lambda d: rope_insert(d, 8, apply_q_rope=False),
    },
    "kv_rope_quantize_insert": {
        "ratio1": lambda d: kv_insert(d, 1),
        "ratio2": lambda d: kv_insert(d, 2),
    },
    "quantize_append": {"int32_slots": append},
    "quantize_pack": {
        "HND": lambda d: (random_rows((3, 7, abi.HEAD_DIM), d), "HND"),
        "NHD": lambda d: (random_rows((2, 16, abi.HEAD_DIM), d), "NHD"),
    },
    "dequantize": {
        # A finite fill (the default is NaN): see the module docstring.
        "slots_fp32": lambda d: dequantize(d, True, torch.float32, -1.5),
        "every_slot_bf16": lambda d: dequantize(d, False, BF16, 0.0),
    },
    "dequantize_out": {
        "fp32": lambda d: dequantize_out(d, torch.float32),
        "bf16": lambda d: dequantize_out(d, BF16),
    },
    "sparse_mla_decode": {
        "one_pool": lambda d: decode_inputs(d, extra=False),
        "two_pools": lambda d: decode_inputs(d, extra=True),
    },
    "sparse_mla_decode_out": {
        "one_pool": lambda d: decode_out(d, extra=False),
        "two_pools": lambda d: decode_out(d, extra=True),
    },
}
PARAMS = [(op, case) for op, cases in CASES.items() for case in cases]


def test_every_op_has_cases():
    """Every op of the namespace has opcheck cases here, and every case names a registered op."""
    ops = registered_ops()
    assert ops, "no op is registered under torch.ops.nvfp4_mla"
    assert ops == set(CASES), (
        f"ops without an opcheck case: {sorted(ops - set(CASES))}; stale: {sorted(set(CASES) - ops)}"
    )
    assert all(CASES.values())


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("op, case", PARAMS, ids=[f"{op}-{case}" for op, case in PARAMS])
def test_opcheck(seed, device, op, case):
    args = CASES[op][case](device)
    result = torch.library.opcheck(getattr(torch.ops.nvfp4_mla, op).default, args, test_utils=CHECKS)
    assert result == dict.fromkeys(CHECKS, "SUCCESS")
