"""The notebooks in notebooks/ execute without a cell error and save their plots.

Each notebook runs in a fresh kernel of *this* interpreter (``notebooks/_build.py``'s
``execute``: a kernelspec written to a temporary folder, so the venv's python runs
it whatever ``python`` is on PATH), in a temporary working directory, with
``SPMDKIT_NB_OUT`` pointing there. With ``SPMDKIT_EXECUTED_NOTEBOOKS=DIR`` set
(``.ci/run`` sets it) the executed notebooks are kept there, for the docs build to
render with their outputs.
"""

import importlib.util
import os
import pathlib

import pytest

nbformat = pytest.importorskip("nbformat")
pytest.importorskip("nbclient")
pytest.importorskip("ipykernel")
pytest.importorskip("matplotlib")

NOTEBOOKS = pathlib.Path(__file__).resolve().parents[1] / "notebooks"
_spec = importlib.util.spec_from_file_location("notebooks_build", NOTEBOOKS / "_build.py")
build = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(build)

# notebook -> the plots it must save (each a real image, not an empty canvas)
PLOTS = {
    "layout_explorer": [
        "layout_compare.png",
        "layout_params.png",
        "layout_picture.png",
        "layout_verify.png",
        "layout_pipeline.png",
    ],
    "rules_playground": ["rules_matmul.png", "rules_custom.png"],
    "checkpoint_reshard": ["checkpoint_losses.png"],
}


def test_every_notebook_is_tested():
    assert sorted(p.stem for p in NOTEBOOKS.glob("*.ipynb")) == sorted(PLOTS)


def test_notebooks_are_committed_without_outputs():
    for path in NOTEBOOKS.glob("*.ipynb"):
        nb = nbformat.read(path, as_version=4)
        for cell in nb.cells:
            if cell.cell_type == "code":
                assert not cell.outputs and cell.execution_count is None, path.name


def test_every_notebook_is_built_by_the_script():
    assert sorted(build.NOTEBOOKS) == sorted(PLOTS)


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(PLOTS))
def test_notebook_executes(name, tmp_path):
    """Slow step (about a minute for the three): each notebook drives APIs the default
    run tests on their own; this checks the notebooks as documents."""
    keep = os.environ.get("SPMDKIT_EXECUTED_NOTEBOOKS")
    nb = build.execute(name, tmp_path, keep=pathlib.Path(keep) if keep else None)
    assert any(c.get("outputs") for c in nb.cells if c.cell_type == "code")
    for plot in PLOTS[name]:
        png = tmp_path / plot
        assert png.exists(), f"{name} did not save {plot}"
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        assert png.stat().st_size > 5_000, f"{plot} is nearly empty"
    if keep:
        assert build.executed_copy(name, pathlib.Path(keep)) is not None
