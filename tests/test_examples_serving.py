"""docs/serving.md and examples/decode_step.py run as written.

The page's Python blocks carry a marker on the line before them: ``<!-- runs -->`` blocks use only
this library and torch and run in order as one program (on the CPU through the reference here, on a
GPU with ``device = "cuda"``), ``<!-- runs-gpu -->`` blocks join them on a GPU only, and
``<!-- sketch -->`` blocks (against vLLM's or SGLang's classes) are only compiled. The example runs
in a subprocess: small on the CPU, and on a GPU with its CUDA graph.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SERVING = ROOT / "docs" / "serving.md"
README = ROOT / "README.md"
EXAMPLE = ROOT / "examples" / "decode_step.py"
KINDS = ("runs", "runs-gpu", "sketch")

TEXT = SERVING.read_text()
BLOCKS = [(m.group(1), m.group(2)) for m in re.finditer(r"<!-- ([a-z-]+) -->\n```python\n(.*?)```", TEXT, re.DOTALL)]


def blocks(*kinds: str) -> list[str]:
    return [code for kind, code in BLOCKS if kind in kinds]


def run_blocks(codes: list[str], device: str) -> None:
    """The blocks in order, as one program, with ``device`` set (each compiled under its own name,
    so a failure's traceback says which block)."""
    namespace: dict[str, object] = {"__name__": "serving_doc", "device": device}
    for index, code in enumerate(codes):
        exec(compile(code, f"{SERVING}:block{index}", "exec"), namespace)


def run_example(*args: str) -> str:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT / "src"), os.environ.get("PYTHONPATH")])))
    result = subprocess.run(
        [sys.executable, str(EXAMPLE), *args], capture_output=True, text=True, env=env, cwd=ROOT, timeout=900
    )
    assert result.returncode == 0, result.stdout + result.stderr
    return result.stdout


@pytest.fixture
def private_kernel_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("NVFP4_MLA_CACHE_DIR", str(tmp_path))  # read at the process's first use only
    monkeypatch.chdir(tmp_path)


# ---------------------------------------------------------------- docs/serving.md


def test_every_python_block_is_marked():
    unmarked = len(re.findall(r"```python\n", TEXT)) - len(BLOCKS)
    assert unmarked == 0, f"{unmarked} python block(s) of docs/serving.md carry no <!-- runs/runs-gpu/sketch --> marker"
    assert {kind for kind, _ in BLOCKS} == set(KINDS)
    assert len(blocks("sketch")) >= 2, "a vLLM and an SGLang sketch"


@pytest.mark.parametrize(("kind", "code"), BLOCKS, ids=[f"{i}-{kind}" for i, (kind, _) in enumerate(BLOCKS)])
def test_every_block_is_valid_python(kind, code):
    compile(code, f"{SERVING}:{kind}", "exec")


def test_runnable_blocks_run_on_the_cpu(private_kernel_cache):
    run_blocks(blocks("runs"), "cpu")


@pytest.mark.gpu
def test_runnable_and_gpu_blocks_run_on_a_gpu(private_kernel_cache):
    run_blocks(blocks("runs", "runs-gpu"), "cuda")


def test_the_readme_links_the_serving_page():
    assert "(docs/serving.md)" in README.read_text()


# ---------------------------------------------------------------- examples/decode_step.py


@pytest.mark.parametrize(
    ("option", "form"), [((), "one plan a step"), (("--one-call",), "each call deals its own work")]
)
def test_the_decode_step_example_runs_small_on_the_cpu(option, form):
    output = run_example("--cpu", "--layers", "2", "--batch", "3", "--max-len", "256", *option)
    lines = output.splitlines()
    assert lines[0].startswith("device: cpu") and "reference" in lines[0], output
    assert lines[1].startswith("step: 2 layers, batch 3 ") and lines[1].endswith(form), output
    assert re.match(r"step time: [0-9.]+ ms \(eager, reference", lines[2]), output
    assert re.match(r"attention: [0-9.]+ ms, [0-9]+% of the step", lines[3]), output
    assert lines[4].startswith("cache: 384 B a token (NVFP4) vs 584 B (FlashMLA FP8), 0.658x"), output


@pytest.mark.gpu
def test_the_decode_step_example_runs_on_a_gpu_in_one_graph():
    output = run_example("--layers", "4", "--batch", "8", "--replays", "5")
    assert "captured in one CUDA graph" in output and "(graph-replayed)" in output, output
    assert "one plan a step" in output, output  # the check below reads outputs after the lengths changed
    error = re.search(r"check: layer 0 .* largest difference ([0-9.e+-]+) of the largest value", output)
    assert error and float(error.group(1)) < 2**-5, output
    assert re.search(r"attention: [0-9.]+ ms, [0-9]+% of the step", output), output
