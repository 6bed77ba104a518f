"""The host-time suite (``nvfp4-mla bench host``) on the CPU: dispatch, options and writers (the
timing itself needs a GPU), and the plan signature the writers' warm calls rely on."""

from __future__ import annotations

import csv
from pathlib import Path

import pytest
import torch

import nvfp4_mla.bench.host as host
from nvfp4_mla import validation
from nvfp4_mla.bench import run
from nvfp4_mla.testing import make_cache, random_rows, rope_table


def test_host_is_a_suite_and_says_it_needs_a_gpu(monkeypatch):
    assert "host" in run.SUITES
    assert host.parse_args(["--out", "d"]).out == Path("d")
    monkeypatch.setattr(run, "gpu_unavailable_reason", lambda: "no GPU here")
    with pytest.raises(SystemExit, match="bench host needs a CUDA GPU"):
        run.main(["host"])


def test_writer_gives_the_rows_and_verdicts(tmp_path):
    rows = [
        dict(call="main 8->16, T=1", us=13.0, add_us=6.9, x_add=13.0 / 6.9, target="<= 1.8x", verdict="MISS"),
        dict(call="kv r1, T=1", us=9.7, add_us=6.8, x_add=9.7 / 6.8, target="<= 1.5x", verdict="PASS"),
    ]
    host.write(rows, tmp_path, "NVIDIA H200")
    with (tmp_path / "host_bench.csv").open() as f:
        written = list(csv.DictReader(f))
    assert [r["call"] for r in written] == [r["call"] for r in rows] and list(written[0]) == host.COLUMNS
    text = (tmp_path / "host_bench.md").read_text()
    assert "on NVIDIA H200" in text and "| kv r1, T=1 | 9.70 | 6.80 | 1.43 | <= 1.5x | PASS |" in text


def _main_tensors():
    return (
        random_rows((2, 8, 512)),
        random_rows((2, 512)),
        make_cache(2, 16),
        torch.arange(2),
        torch.arange(2),
        rope_table(16),
    )


@pytest.mark.parametrize(
    "change",
    [
        lambda t: (t[0].float(), *t[1:]),  # dtype
        lambda t: (t[0], torch.zeros(2, 1024, dtype=torch.bfloat16)[:, :512], *t[2:]),  # strides
        lambda t: (t[0], t[1][:1], *t[2:]),  # shape
        lambda t: (*t[:2], make_cache(2, 16, "HND", pad=16), *t[3:]),  # cache strides
        lambda t: (*t[:5], t[5].to("meta")),  # device
    ],
    ids=["dtype", "strides", "shape", "cache strides", "device"],
)
def test_signature_sees_every_metadata_the_checks_read(change):
    tensors = _main_tensors()
    options = (16, True, False)
    assert validation.signature(tensors, options) != validation.signature(change(tensors), options)


def test_signature_keeps_option_types_apart_and_refuses_non_tensors():
    tensors = _main_tensors()
    assert validation.signature(tensors, (16, True, False)) != validation.signature(tensors, (16, 1, False))
    assert validation.signature(tensors, (16.0, True, False)) is None  # the full checks name it
    assert validation.signature(tensors, (16, [True], False)) is None  # unhashable: never looked up
    assert validation.signature(([[0.0] * 512], *tensors[1:]), (16, True, False)) is None
