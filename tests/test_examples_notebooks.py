"""examples/quickstart.ipynb and examples/kv_cache_accuracy.ipynb: they run top to bottom (on the CPU
here: they fall back to the reference), and the committed files carry their outputs, plots included,
for readers browsing the repository."""

from pathlib import Path

import pytest

import nvfp4_mla

nbformat = pytest.importorskip("nbformat", reason="nbformat is not installed (pip install -e '.[test]')")
nbclient = pytest.importorskip("nbclient", reason="nbclient is not installed (pip install -e '.[test]')")
pytest.importorskip("ipykernel", reason="ipykernel is not installed (pip install -e '.[test]')")
pytest.importorskip("matplotlib", reason="matplotlib is not installed (pip install -e '.[plot]')")

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
NOTEBOOK = EXAMPLES / "quickstart.ipynb"
ACCURACY_NOTEBOOK = EXAMPLES / "kv_cache_accuracy.ipynb"
PLOTS = {NOTEBOOK: 1, ACCURACY_NOTEBOOK: 3}  # PNGs each saved notebook carries
SRC = str(Path(nvfp4_mla.__file__).resolve().parents[1])
MAX_NOTEBOOK_BYTES = 200_000  # one PNG and some text; more means an output that should not be kept


def outputs(nb) -> list:
    return [output for cell in nb.cells if cell.cell_type == "code" for output in cell.outputs]


def execute(path: Path, tmp_path, monkeypatch):
    # The kernel is this interpreter (jupyter_client runs the "python3" kernelspec with
    # sys.executable); it inherits the environment, so it imports this checkout.
    monkeypatch.setenv("PYTHONPATH", SRC)
    nb = nbformat.read(path, as_version=4)
    client = nbclient.NotebookClient(
        nb, kernel_name="python3", timeout=300, resources={"metadata": {"path": str(tmp_path)}}
    )
    client.execute()
    return nb


def test_quickstart_notebook(tmp_path, monkeypatch):
    nb = execute(NOTEBOOK, tmp_path, monkeypatch)

    text = "\n".join(output.get("text", "") for output in outputs(nb))
    assert "RoPE dims exact: True" in text
    assert "group  0  scale 0x" in text
    assert "empty record: all 384 bytes are 0x00" in text
    assert "cache bytes equal: True" in text or "used nvfp4_mla.reference on the CPU" in text
    assert "q_out bits equal: False" not in text
    assert any("image/png" in output.get("data", {}) for output in outputs(nb))


def test_accuracy_notebook(tmp_path, monkeypatch):
    nb = execute(ACCURACY_NOTEBOOK, tmp_path, monkeypatch)
    text = "\n".join(output.get("text", "") for output in outputs(nb))
    assert "nvfp4           384      38%" in text  # the bytes-per-token table
    assert "sweep: 40 decodes compared" in text
    assert "rel err, library" in text  # the library's decode against the float64 one
    assert sum("image/png" in output.get("data", {}) for output in outputs(nb)) == PLOTS[ACCURACY_NOTEBOOK]


@pytest.mark.parametrize("path", list(PLOTS), ids=lambda path: path.stem)
def test_notebook_is_saved_with_outputs(path):
    nb = nbformat.read(path, as_version=4)
    code_cells = [cell for cell in nb.cells if cell.cell_type == "code"]
    assert all(cell.outputs for cell in code_cells), (
        f"save it executed: jupyter nbconvert --to notebook --execute --inplace examples/{path.name}"
    )
    assert not [output for output in outputs(nb) if output.output_type == "error" or output.get("name") == "stderr"]
    assert sum("image/png" in output.get("data", {}) for output in outputs(nb)) == PLOTS[path]
    assert path.stat().st_size < MAX_NOTEBOOK_BYTES
