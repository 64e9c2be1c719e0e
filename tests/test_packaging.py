"""Packaging: ``rules/`` and ``models/`` ship as ``spmdkit.rules`` and ``spmdkit.models``.

The repository keeps them as top-level folders; ``pyproject.toml`` maps them
into the ``spmdkit`` distribution (``package-dir``), so its ``packages`` is a list
that every package folder must be on (checked in the default run). The slow step
checks the result twice: in a wheel installed into a fresh virtual environment, and
in the editable install the tests run from. Neither may install a generic top-level
``rules`` or ``models``.
"""

import importlib.metadata
import json
import shutil
import site
import subprocess
import sys
import tomllib
import venv
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SOURCES = ("pyproject.toml", "README.md", "LICENSE", "spmdkit", "rules", "models")
SETUPTOOLS = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]

_PROBE = """
import importlib.util, json, spmdkit, spmdkit.models, spmdkit.rules
from spmdkit.engine.registry import registered_ops
print(json.dumps({
    "spmdkit": spmdkit.__file__,
    "rules": spmdkit.rules.__file__,
    "models": spmdkit.models.__file__,
    "top_level_rules": importlib.util.find_spec("rules") is not None,
    "top_level_models": importlib.util.find_spec("models") is not None,
    "ops": list(registered_ops()),
}))
"""


def _package_folders() -> dict[str, Path]:
    """Every folder of modules under pyproject's ``package-dir`` roots, by the package
    name it installs as (``models/`` -> ``spmdkit.models``), ``__init__.py`` or not."""
    found = {}
    for name, root in SETUPTOOLS["package-dir"].items():
        for module in (REPO / root).rglob("*.py"):
            rel = module.parent.relative_to(REPO / root)
            if "__pycache__" not in rel.parts:
                found[".".join((name, *rel.parts))] = module.parent
    return found


def test_pyproject_lists_every_package_folder():
    """The mapped layout (top-level ``rules/`` and ``models/`` installed inside
    ``spmdkit``) rules out setuptools' package discovery, so ``packages`` is a list:
    a new subpackage missing from it would be left out of the wheel, and only the
    slow step's wheel install would notice. This catches it in the default run."""
    folders = _package_folders()
    listed = set(SETUPTOOLS["packages"])
    missing = sorted(set(folders) - listed)
    assert not missing, f"add {missing} to [tool.setuptools] packages in pyproject.toml"
    stale = sorted(listed - set(folders))
    assert not stale, f"remove {stale} from [tool.setuptools] packages in pyproject.toml"
    no_init = sorted(n for n, d in folders.items() if not (d / "__init__.py").exists())
    assert not no_init, f"give {no_init} an __init__.py (a package, not a namespace)"


def _version(dist: str) -> tuple[int, ...] | None:
    try:
        text = importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None
    return tuple(int(p) for p in text.split(".")[:2] if p.isdigit())


def _can_build_offline() -> bool:
    """True when this environment has what pyproject's build-system asks for."""
    setuptools = _version("setuptools")
    if setuptools is None or setuptools < (69, 0):
        return False
    return _version("wheel") is not None or setuptools >= (70, 1)  # bdist_wheel moved in


def _pip(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess:
    res = subprocess.run(
        [sys.executable, "-m", "pip", "--disable-pip-version-check", *args],
        cwd=cwd,
        check=False,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert res.returncode == 0, f"pip {' '.join(args)} failed:\n{res.stdout}\n{res.stderr}"
    return res


def _probe(python: Path | str, cwd: Path) -> dict:
    # -I: no PYTHONPATH, no user site, no current directory on sys.path
    res = subprocess.run(
        [str(python), "-I", "-c", _PROBE],
        cwd=cwd,
        check=False,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert res.returncode == 0, res.stdout + res.stderr
    return json.loads(res.stdout.strip().splitlines()[-1])


def _site_dirs() -> list[str]:
    """The folders this interpreter imports installed packages from: its own
    site-packages and any another's it reaches by a ``.pth`` path line (a venv that
    shares an older one's packages), which ``site.getsitepackages()`` does not list."""
    own = [p for p in site.getsitepackages() if Path(p).is_dir()]
    shared = [p for p in sys.path if Path(p).name in ("site-packages", "dist-packages")]
    return list(dict.fromkeys(p for p in [*own, *shared] if Path(p).is_dir()))


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    """A wheel built from a copy of the sources (the work tree stays clean)."""
    root = tmp_path_factory.mktemp("wheel")
    src = root / "src"
    src.mkdir()
    for name in SOURCES:
        path = REPO / name
        if path.is_dir():
            shutil.copytree(path, src / name, ignore=shutil.ignore_patterns("__pycache__"))
        elif path.exists():
            shutil.copy2(path, src / name)
    # offline when this environment has the build requirements; else pip fetches them
    isolation = ["--no-build-isolation"] if _can_build_offline() else []
    _pip("wheel", "--no-deps", *isolation, "--wheel-dir", str(root / "dist"), str(src), cwd=root)
    (built,) = (root / "dist").glob("spmdkit-*.whl")
    return built


@pytest.mark.slow
def test_wheel_holds_rules_and_models_inside_spmdkit(wheel):
    names = zipfile.ZipFile(wheel).namelist()
    shipped = {
        "/".join((*package.split("."), module.name))
        for package, folder in _package_folders().items()
        for module in folder.glob("*.py")
    }
    assert shipped <= set(names), sorted(shipped - set(names))
    assert "spmdkit/rules/__init__.py" in names
    assert "spmdkit/rules/matmul.py" in names
    assert "spmdkit/models/__init__.py" in names
    assert "spmdkit/__main__.py" in names
    tops = {n.split("/")[0] for n in names if not n.split("/")[0].endswith(".dist-info")}
    assert tops == {"spmdkit"}  # no generic top-level `rules` or `models` package
    entry_points = next(n for n in names if n.endswith("entry_points.txt"))
    assert "spmdkit = spmdkit.cli:main" in zipfile.ZipFile(wheel).read(entry_points).decode()


@pytest.mark.slow
def test_wheel_install_imports_from_the_venv(wheel, tmp_path):
    env_dir = tmp_path / "venv"
    venv.create(env_dir, with_pip=False, system_site_packages=True)
    python = env_dir / "bin" / "python"
    _pip("--python", str(python), "install", "--no-deps", "--no-index", str(wheel))
    # jax & co. come from this test's environment: add its site-packages as plain paths
    # (a path line in a .pth file does not run the .pth files inside that folder, so
    # the editable install's import hook stays out)
    purelib = subprocess.run(
        [str(python), "-I", "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    deps = _site_dirs()
    (Path(purelib) / "_outer_deps.pth").write_text("\n".join(deps) + "\n")

    cwd = tmp_path / "elsewhere"
    cwd.mkdir()
    found = _probe(python, cwd)
    for key in ("spmdkit", "rules", "models"):
        assert Path(found[key]).is_relative_to(Path(purelib)), (key, found[key])
    assert Path(found["rules"]).parent == Path(purelib) / "spmdkit" / "rules"
    assert Path(found["models"]).parent == Path(purelib) / "spmdkit" / "models"
    assert not found["top_level_rules"]
    assert not found["top_level_models"]
    assert "matmul" in found["ops"] and "softmax" in found["ops"]

    script = env_dir / "bin" / "spmdkit"
    res = subprocess.run(
        [str(script), "rules", "matmul"],
        cwd=cwd,
        check=False,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert res.returncode == 0, res.stderr
    assert res.stdout.startswith("matmul  (family: matmul)")


def _is_editable_here() -> bool:
    """True when spmdkit is installed editable from this repository (pip install -e .)."""
    # several may be found (e.g. the source tree's spmdkit.egg-info when the
    # repository root is on sys.path); the installed one carries direct_url.json
    for dist in importlib.metadata.distributions(name="spmdkit"):
        text = dist.read_text("direct_url.json")
        if not text:
            continue
        info = json.loads(text)
        if info.get("dir_info", {}).get("editable") and info.get("url") == REPO.as_uri():
            return True
    return False


@pytest.mark.slow
def test_editable_install_maps_the_repository_folders(tmp_path):
    if not _is_editable_here():
        pytest.skip("spmdkit is not installed editable from this repository")
    found = _probe(sys.executable, tmp_path)
    assert Path(found["spmdkit"]) == REPO / "spmdkit" / "__init__.py"
    assert Path(found["rules"]) == REPO / "rules" / "__init__.py"
    assert Path(found["models"]) == REPO / "models" / "__init__.py"
    assert not found["top_level_rules"]
    assert not found["top_level_models"]
    assert "matmul" in found["ops"]
