"""The README's Python snippets run as written: the CPU ones here, the GPU ones (CUDA tensors, or
a precompile that loads onto a GPU) on a machine with one."""

import re
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[1] / "README.md"
SNIPPETS = re.findall(r"```python\n(.*?)```", README.read_text(), re.DOTALL)


def needs_gpu(code: str) -> bool:
    return '"cuda"' in code or "precompile(" in code


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
