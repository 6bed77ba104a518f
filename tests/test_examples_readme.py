"""The README's Python snippets run as written: the CPU ones here, the GPU ones (CUDA tensors, or
a precompile that loads onto a GPU) on a machine with one. A snippet that picks its device
(``"cuda" if torch.cuda.is_available() else "cpu"``) runs everywhere, on the device it picks."""

import re
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[1] / "README.md"
SNIPPETS = re.findall(r"```python\n(.*?)```", README.read_text(), re.DOTALL)


def picks_its_device(code: str) -> bool:
    return "torch.cuda.is_available()" in code


def needs_gpu(code: str) -> bool:
    return ('"cuda"' in code and not picks_its_device(code)) or "precompile(" in code


@pytest.mark.parametrize(
    "code",
    [pytest.param(c, marks=pytest.mark.gpu) if needs_gpu(c) else c for c in SNIPPETS],
    ids=[c.strip().splitlines()[-1][:40] for c in SNIPPETS],
)
def test_readme_snippet_runs_as_written(code, tmp_path, monkeypatch):
    monkeypatch.setenv("NVFP4_MLA_CACHE_DIR", str(tmp_path))  # read at the process's first use only
    monkeypatch.chdir(tmp_path)
    exec(compile(code, str(README), "exec"), {"__name__": "readme_snippet"})


def test_the_readme_has_a_cpu_and_a_gpu_snippet():
    assert len(SNIPPETS) >= 3 and any(map(needs_gpu, SNIPPETS)) and not all(map(needs_gpu, SNIPPETS))
    assert all("import torch" in c for c in SNIPPETS if "torch." in c), "a snippet uses torch without importing it"


def test_the_readme_usage_snippet_runs_on_either_device():
    """The first snippet (### Usage) is the one a new user copies: it runs on a CPU-only machine too."""
    usage = SNIPPETS[0]
    assert picks_its_device(usage) and not needs_gpu(usage)
    assert "nvfp4_mla.rope_table(" in usage and "torch.randn(4096, 64" not in usage
