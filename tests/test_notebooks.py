"""The notebooks in notebooks/ execute without a cell error and save their plots.

Each notebook runs in a fresh kernel of *this* interpreter (a kernelspec written
to a temporary folder, so the venv's python runs it whatever ``python`` is on
PATH), in a temporary working directory, with ``SPMDKIT_NB_OUT`` pointing there.
"""

import json
import pathlib
import sys

import pytest

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")
pytest.importorskip("ipykernel")
pytest.importorskip("matplotlib")

from jupyter_client.kernelspec import KernelSpecManager  # noqa: E402
from jupyter_client.manager import KernelManager  # noqa: E402

NOTEBOOKS = pathlib.Path(__file__).resolve().parents[1] / "notebooks"

# notebook -> the plots it must save (each a real image, not an empty canvas)
PLOTS = {
    "layout_explorer": [
        "layout_compare.png",
        "layout_params.png",
        "layout_verify.png",
        "layout_pipeline.png",
    ],
    "rules_playground": ["rules_matmul.png", "rules_custom.png"],
    "checkpoint_reshard": ["checkpoint_losses.png"],
}


@pytest.fixture(scope="module")
def kernel_dirs(tmp_path_factory):
    """A kernelspec named ``spmdkit-nb`` that runs ``sys.executable``."""
    root = tmp_path_factory.mktemp("kernels")
    spec_dir = root / "spmdkit-nb"
    spec_dir.mkdir()
    spec = {
        "argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
        "display_name": "spmdkit tests",
        "language": "python",
    }
    (spec_dir / "kernel.json").write_text(json.dumps(spec))
    return [str(root)]


def test_every_notebook_is_tested():
    assert sorted(p.stem for p in NOTEBOOKS.glob("*.ipynb")) == sorted(PLOTS)


def test_notebooks_are_committed_without_outputs():
    for path in NOTEBOOKS.glob("*.ipynb"):
        nb = nbformat.read(path, as_version=4)
        for cell in nb.cells:
            if cell.cell_type == "code":
                assert not cell.outputs and cell.execution_count is None, path.name


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(PLOTS))
def test_notebook_executes(name, tmp_path, monkeypatch, kernel_dirs):
    """Slow step (about a minute for the three): each notebook drives APIs the default
    run tests on their own; this checks the notebooks as documents."""
    monkeypatch.setenv("SPMDKIT_NB_OUT", str(tmp_path))
    monkeypatch.setenv("MPLBACKEND", "module://matplotlib_inline.backend_inline")
    nb = nbformat.read(NOTEBOOKS / f"{name}.ipynb", as_version=4)
    km = KernelManager(
        kernel_name="spmdkit-nb", kernel_spec_manager=KernelSpecManager(kernel_dirs=kernel_dirs)
    )
    client = nbclient.NotebookClient(
        nb,
        km=km,
        timeout=300,
        resources={"metadata": {"path": str(tmp_path)}},
    )
    client.execute()  # raises CellExecutionError naming the cell on any error
    for plot in PLOTS[name]:
        png = tmp_path / plot
        assert png.exists(), f"{name} did not save {plot}"
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        assert png.stat().st_size > 5_000, f"{plot} is nearly empty"
