"""examples/quickstart.ipynb runs top to bottom (on the CPU here: it falls back to the reference)."""

from pathlib import Path

import pytest

import nvfp4_mla

nbformat = pytest.importorskip("nbformat", reason="nbformat is not installed (pip install -e '.[test]')")
nbclient = pytest.importorskip("nbclient", reason="nbclient is not installed (pip install -e '.[test]')")
pytest.importorskip("ipykernel", reason="ipykernel is not installed (pip install -e '.[test]')")
pytest.importorskip("matplotlib", reason="matplotlib is not installed (pip install -e '.[test]')")

NOTEBOOK = Path(__file__).resolve().parents[1] / "examples" / "quickstart.ipynb"
SRC = str(Path(nvfp4_mla.__file__).resolve().parents[1])


def test_quickstart_notebook(tmp_path, monkeypatch):
    # The kernel is this interpreter (jupyter_client runs the "python3" kernelspec with
    # sys.executable); it inherits the environment, so it imports this checkout.
    monkeypatch.setenv("PYTHONPATH", SRC)
    nb = nbformat.read(NOTEBOOK, as_version=4)
    client = nbclient.NotebookClient(nb, kernel_name="python3", timeout=300, resources={"metadata": {"path": str(tmp_path)}})
    client.execute()

    text = "\n".join(
        output.get("text", "") for cell in nb.cells if cell.cell_type == "code" for output in cell.outputs
    )
    assert "RoPE dims exact: True" in text
    assert "group  0  scale 0x" in text
    assert "cache bytes equal: True" in text or "used nvfp4_mla.reference on the CPU" in text
    assert "q_out bits equal: False" not in text
