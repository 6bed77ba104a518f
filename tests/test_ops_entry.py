"""The entry descriptions (nvfp4_mla.ops.entry): the eager dispatch made from one routes a call by
the devices of the arguments it routes on, and a description whose names disagree with its kernel
path or its reference is refused before any op is registered. The ops themselves: test_ops_opcheck."""

from __future__ import annotations

import dataclasses
import inspect

import pytest
import torch

from nvfp4_mla import reference
from nvfp4_mla.ops import entry, reader, writers
from nvfp4_mla.testing import make_cache, random_rows, random_slots


class OnCuda(torch.Tensor):
    """A CPU tensor that says it is on CUDA: what the dispatch tests (no GPU needed)."""

    @property
    def is_cuda(self) -> bool:  # type: ignore[override]
        return True


def dispatch_of(description: entry.Entry, kernel):
    """The description's dispatch, with ``kernel`` for its kernel path."""
    names = list(inspect.signature(description.kernel).parameters)[1:]
    return entry.eager_dispatch(dataclasses.replace(description, kernel=kernel), names)


def test_a_cuda_tensor_among_the_routed_arguments_takes_the_kernel_path(monkeypatch):
    calls = []
    append = dispatch_of(writers.APPEND, lambda *a: calls.append(("kernel", a)))
    # patched after the dispatch was made: it looks the reference up on each call
    monkeypatch.setattr(reference, "nvfp4_quantize_append_sparse_mla_cache", lambda *a: calls.append(("ref", a)))
    rows, slots, cache = random_rows((2, 512)), random_slots(2, 16), make_cache(1, 16)
    library = object()
    append(library, rows, slots.as_subclass(OnCuda), cache)  # any routed argument on CUDA
    append(None, rows, slots, cache)  # none: the reference, without the library
    assert [c[0] for c in calls] == ["kernel", "ref"]
    assert calls[0][1][0] is library and calls[1][1] == (rows, slots, cache)


def test_the_reader_routes_on_its_cache_alone(monkeypatch):
    calls = []
    read = dispatch_of(reader.READ, lambda *a: calls.append(("kernel", a)))
    monkeypatch.setattr(reference, "nvfp4_dequantize_sparse_mla_cache", lambda *a, **k: calls.append(("ref", k)))
    cache, slots = make_cache(1, 16), torch.arange(3)
    read(None, cache, slots.as_subclass(OnCuda), torch.float32, 0.0, None)
    read(None, cache.as_subclass(OnCuda), slots, torch.float32, 0.0, None)
    assert [c[0] for c in calls] == ["ref", "kernel"]
    assert calls[0][1] == {"dtype": torch.float32, "invalid": 0.0, "out": None}  # its keyword-only arguments


def _unregistered(description: entry.Entry) -> None:
    before = set(torch._C._dispatch_get_all_op_names())
    with pytest.raises(TypeError):
        entry.make(description)
    assert set(torch._C._dispatch_get_all_op_names()) == before


def test_a_description_that_disagrees_with_its_kernel_path_is_refused():
    ops = (entry.Op("test_only_append", mutates=("cache",)),)
    _unregistered(
        dataclasses.replace(writers.APPEND, args="Tensor latent_kv, Tensor cache, Tensor slot_mapping", ops=ops)
    )
    _unregistered(dataclasses.replace(writers.APPEND, ops=(entry.Op("test_only_append", fixed=(None,)),)))
    _unregistered(dataclasses.replace(writers.APPEND, ops=(entry.Op("test_only_append", "Tensor"),)))  # no fake
    _unregistered(dataclasses.replace(writers.APPEND, name="nvfp4_quantize_pack_sparse_mla_cache", ops=ops))
