"""torch.library registration: fake implementations (CPU), the CPU path of the entries and their ops (the
reference), and torch.compile(fullgraph=True) (CPU and GPU). opcheck of every op: tests/test_ops_opcheck.py."""

import pytest
import torch

import nvfp4_mla
from nvfp4_mla import reference
from nvfp4_mla.testing import bits, flat_bytes, make_cache, random_rows, random_slots, rope_table, storage_bytes

BF16 = torch.bfloat16


def meta_inputs(num_tokens=5, num_heads=8, page_size=16):
    q = torch.empty(num_tokens, num_heads, 512, dtype=BF16, device="meta")
    kv = torch.empty(num_tokens, 512, dtype=BF16, device="meta")
    cache = torch.empty(4, page_size, 384, dtype=torch.uint8, device="meta")
    slots = torch.empty(num_tokens, dtype=torch.int64, device="meta")
    positions = torch.empty(num_tokens, dtype=torch.int64, device="meta")
    cos_sin = torch.empty(100, 64, dtype=torch.float32, device="meta")
    return q, kv, cache, slots, positions, cos_sin


@pytest.mark.parametrize("q_head_padded", [0, 8, 128])
def test_fake_main_entry_gives_q_out_shape(q_head_padded):
    out = torch.ops.nvfp4_mla.rope_quantize_insert(*meta_inputs(), q_head_padded, True)
    assert out.shape == (5, q_head_padded, 512) and out.dtype == BF16 and out.device.type == "meta"


def test_fake_cache_writers_return_nothing():
    q, kv, cache, slots, positions, cos_sin = meta_inputs()
    assert torch.ops.nvfp4_mla.rope_quantize_insert_inplace(q, kv, cache, slots, positions, cos_sin, 0, True) is None
    assert torch.ops.nvfp4_mla.kv_rope_quantize_insert(kv, cache, slots, positions, cos_sin, 2) is None
    assert torch.ops.nvfp4_mla.quantize_append(kv, slots, cache) is None


@pytest.mark.parametrize("layout, shape", [("HND", (3, 1, 7, 384)), ("NHD", (3, 7, 1, 384))])
def test_fake_pack_gives_cache_shape(layout, shape):
    pages = torch.empty(3, 7, 512, dtype=BF16, device="meta")
    out = torch.ops.nvfp4_mla.quantize_pack(pages, layout)
    assert out.shape == shape and out.dtype == torch.uint8


def test_compile_traces_without_graph_break_then_validates_at_run():
    """fullgraph=True fails on any graph break while tracing; the traced op then runs the real
    implementation: on these CPU tensors the reference (its bytes), whose validation rejects a bad
    argument at run time."""
    torch._dynamo.reset()
    q, kv = random_rows((4, 8, 512)), random_rows((4, 512))
    args = (q, kv, make_cache(2, 16), random_slots(4, 32), torch.arange(4), rope_table(8))
    step = torch.compile(
        lambda *a: nvfp4_mla.cake_dsv4_nvfp4_rope_quantize_insert(*a, q_head_padded=16),
        fullgraph=True,
        backend="aot_eager",
    )
    got = step(*args)
    want_cache = make_cache(2, 16)
    want = reference.cake_dsv4_nvfp4_rope_quantize_insert(q, kv, want_cache, *args[3:], q_head_padded=16)
    assert torch.equal(bits(got), bits(want)) and torch.equal(storage_bytes(args[2]), storage_bytes(want_cache))
    torch._dynamo.reset()
    with pytest.raises(ValueError, match=r"positions must have dtype torch\.int64"):
        step(*args[:4], args[4].int(), args[5])


def attention_pre_step(q, kv, cache, slots, positions, cos_sin, latent_scale):
    """A small pre-attention step: scale the latent, write the cache, pad and rotate q."""
    q_out = nvfp4_mla.cake_dsv4_nvfp4_rope_quantize_insert(
        q, kv * latent_scale, cache, slots, positions, cos_sin, q_head_padded=16
    )
    return q_out * 2


@pytest.mark.parametrize("q_inplace", [True, False])
def test_compiled_entry_dispatches_to_the_right_op(monkeypatch, q_inplace):
    """On the CPU the op behind the traced call runs the reference: the traced call reaches the op
    of its mode and gives the reference's bytes (q rotated once, in place)."""
    modes = []
    real = reference.cake_dsv4_nvfp4_rope_quantize_insert

    def spy(*args, **kwargs):
        modes.append(kwargs["q_inplace"])
        return real(*args, **kwargs)

    monkeypatch.setattr(reference, "cake_dsv4_nvfp4_rope_quantize_insert", spy)
    torch._dynamo.reset()
    q, kv = random_rows((9, 16, 512)), random_rows((9, 512))
    rest = (random_slots(9, 64), torch.randint(0, 4096, (9,)), rope_table(4096))
    qs, caches = [q.clone(), q.clone()], [make_cache(4, 16) for _ in range(2)]
    options = {"q_inplace": q_inplace, "q_head_padded": 0 if q_inplace else 16}

    def step(q, kv, cache, slots, positions, cos_sin):
        return nvfp4_mla.cake_dsv4_nvfp4_rope_quantize_insert(q, kv, cache, slots, positions, cos_sin, **options) + 0

    got = torch.compile(step, fullgraph=True, backend="aot_eager")(qs[0], kv, caches[0], *rest)
    assert modes == [q_inplace]
    want = real(qs[1], kv, caches[1], *rest, **options)
    assert torch.equal(bits(got), bits(want)) and torch.equal(bits(qs[0]), bits(qs[1]))
    assert torch.equal(storage_bytes(caches[0]), storage_bytes(caches[1]))


def cpu_writer_calls(layout: str):
    """Each writer entry's call on CPU tensors, a fresh cache each: (entry name, args, kwargs)."""
    q, kv = random_rows((6, 8, 512)), random_rows((6, 512))
    slots, positions, cos_sin = random_slots(5, 32), torch.randint(0, 16, (6,)), rope_table(16)
    return [
        ("cake_dsv4_nvfp4_rope_quantize_insert", (q, kv, make_cache(2, 16, layout), slots, positions, cos_sin), {}),
        (
            "cake_dsv4_nvfp4_rope_quantize_insert",
            (q, kv, make_cache(2, 16, layout), slots, positions, cos_sin),
            {"q_head_padded": 16, "apply_q_rope": False},
        ),
        (
            "cake_dsv4_nvfp4_rope_quantize_insert",
            (q.clone(), kv, make_cache(2, 16, layout), slots, positions, cos_sin),
            {"q_inplace": True},
        ),
        (
            "cake_dsv4_nvfp4_kv_rope_quantize_insert",
            (kv, make_cache(2, 16, layout), slots, positions, cos_sin),
            {"compress_ratio": 2},
        ),
        ("nvfp4_quantize_append_sparse_mla_cache", (kv, slots, make_cache(2, 16, layout)), {}),
        ("nvfp4_quantize_pack_sparse_mla_cache", (random_rows((3, 7, 512)),), {"kv_layout": layout}),
    ]


def cloned(x):
    return x.clone() if isinstance(x, torch.Tensor) else x


@pytest.mark.parametrize("layout", ["HND", "NHD"])
def test_public_writers_on_cpu_tensors_run_the_reference(layout):
    """Like the reader and the decode, every writer entry sends CPU tensors to its reference: the
    same result and the same bytes in every argument (a library= is ignored there)."""
    for name, args, kwargs in cpu_writer_calls(layout):
        want_args = [cloned(a) for a in args]
        want = getattr(reference, name)(*want_args, **kwargs)
        got = getattr(nvfp4_mla, name)(*args, library=nvfp4_mla.KernelLibrary(), **kwargs)
        if want is None:
            assert got is None, name
        else:
            assert torch.equal(bits(got), bits(want)), name
        for a, b in zip(args, want_args):
            if isinstance(a, torch.Tensor):
                assert torch.equal(flat_bytes(a), flat_bytes(b)), name
        if kwargs.get("q_inplace"):
            assert got is args[0]


def test_public_writers_on_cpu_tensors_validate():
    """The CPU path refuses what the reference refuses, before anything is written."""
    cache = make_cache(2, 16)
    before = storage_bytes(cache).clone()
    with pytest.raises(ValueError, match=r"positions must have dtype torch\.int64"):
        nvfp4_mla.cake_dsv4_nvfp4_kv_rope_quantize_insert(
            random_rows((4, 512)), cache, torch.arange(4), torch.arange(4, dtype=torch.int32), rope_table(8)
        )
    with pytest.raises(ValueError, match="kv_layout must be one of"):
        nvfp4_mla.nvfp4_quantize_pack_sparse_mla_cache(random_rows((2, 4, 512)), kv_layout="3D")
    assert torch.equal(storage_bytes(cache), before)


@pytest.mark.gpu
@pytest.mark.parametrize("mode", [None, "reduce-overhead"])
def test_compiled_pre_step_matches_eager(seed, mode):
    torch._dynamo.reset()
    device = "cuda"
    q, kv = random_rows((37, 8, 512), device), random_rows((37, 512), device)
    slots, positions = random_slots(33, 5 * 16, device=device), torch.randint(0, 4096, (37,), device=device)
    cos_sin, scale = rope_table(4096, device), torch.tensor(0.5, device=device, dtype=BF16)
    caches = [make_cache(5, 16, "HND", 16, device) for _ in range(2)]
    compiled = torch.compile(attention_pre_step, fullgraph=True, mode=mode)
    for _ in range(3):  # reduce-overhead records a CUDA graph on a later call
        got = compiled(q, kv, caches[0], slots, positions, cos_sin, scale)
    want = attention_pre_step(q, kv, caches[1], slots, positions, cos_sin, scale)
    torch.cuda.synchronize()
    assert torch.equal(bits(got), bits(want))
    assert torch.equal(storage_bytes(caches[0]), storage_bytes(caches[1]))
    ref_cache = make_cache(5, 16, "HND", 16, device)
    reference.cake_dsv4_nvfp4_rope_quantize_insert(
        q, kv * scale, ref_cache, slots, positions, cos_sin, q_head_padded=16
    )
    assert torch.equal(storage_bytes(caches[0]), storage_bytes(ref_cache))


@pytest.mark.gpu
def test_compiled_in_place_rotates_q(seed):
    torch._dynamo.reset()
    device = "cuda"
    q, kv = random_rows((9, 16, 512), device), random_rows((9, 512), device)
    slots, positions = random_slots(9, 64, device=device), torch.randint(0, 4096, (9,), device=device)
    cos_sin = rope_table(4096, device)
    qs, caches = [q.clone(), q.clone()], [make_cache(4, 16, device=device) for _ in range(2)]

    def step(q, kv, cache, slots, positions, cos_sin):
        return (
            nvfp4_mla.cake_dsv4_nvfp4_rope_quantize_insert(q, kv, cache, slots, positions, cos_sin, q_inplace=True) + 0
        )

    got = torch.compile(step, fullgraph=True)(qs[0], kv, caches[0], slots, positions, cos_sin)
    reference.cake_dsv4_nvfp4_rope_quantize_insert(qs[1], kv, caches[1], slots, positions, cos_sin, q_inplace=True)
    torch.cuda.synchronize()
    assert torch.equal(bits(qs[0]), bits(qs[1])) and torch.equal(bits(got), bits(qs[1]))
    assert torch.equal(storage_bytes(caches[0]), storage_bytes(caches[1]))
