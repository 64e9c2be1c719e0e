"""``spmdkit doctor``: versions beside the tested range, backend, devices, exit status."""

import os
import subprocess
import sys

import jax
import pytest

from spmdkit import versions
from spmdkit.cli import main


def test_this_environment_is_inside_the_range(capsys):
    assert main(["doctor"]) == 0
    captured = capsys.readouterr()
    assert captured.err == ""
    out = captured.out
    for row in versions.TESTED:
        line = next(x for x in out.splitlines() if x.split()[:1] == [row.dist])
        assert line.split()[1:] == [versions.installed_version(row.dist), str(row), "ok"]
    assert f"backend: {jax.default_backend()}" in out
    assert f"devices: {len(jax.devices())} ({len(jax.devices())} x " in out
    assert "memory kinds of device 0: " in out
    assert "partitioner: " in out
    assert out.rstrip().endswith("everything is inside the tested range")


@pytest.mark.parametrize(
    ("dist", "version", "says"),
    [
        (
            "jax",
            "0.13.1",
            'jax 0.13.1 is outside the tested range >=0.10.2,<0.13: pip install "jax',
        ),
        ("python", "3.10.4", "Python 3.10.4 is outside the tested range >=3.11,<3.14"),
        ("orbax-checkpoint", None, 'orbax-checkpoint is not installed: pip install "orbax'),
    ],
)
def test_a_version_outside_the_range_exits_1(monkeypatch, capsys, dist, version, says):
    real = versions.installed_version
    monkeypatch.setattr(versions, "installed_version", lambda d: version if d == dist else real(d))
    assert main(["doctor"]) == 1
    captured = capsys.readouterr()
    (line,) = captured.err.splitlines()  # one finding, one line
    assert line.startswith(f"spmdkit doctor: {says}")
    row = next(x for x in captured.out.splitlines() if x.split()[:1] == [dist])
    assert row.endswith("OUTSIDE the tested range")
    assert "everything is inside" not in captured.out


def test_a_plugin_of_another_release_exits_1(monkeypatch, capsys):
    monkeypatch.setattr(versions, "accelerator_plugins", lambda: {"jax-cuda13-pjrt": "0.0.1"})
    assert main(["doctor"]) == 1
    captured = capsys.readouterr()
    assert "jax-cuda13-pjrt   0.0.1" in captured.out
    assert "MISMATCH" in captured.out
    assert captured.err.startswith("spmdkit doctor: jax-cuda13-pjrt 0.0.1 is not jaxlib ")
    if jax.default_backend() == "cpu":  # a plugin installed, yet jax runs on the CPU
        assert "note: an accelerator plugin is installed but jax runs on CPU" in captured.out


def test_a_backend_that_does_not_start_exits_1(monkeypatch, capsys):
    def fail():
        raise RuntimeError("Unable to initialize backend 'cuda'")

    monkeypatch.setattr(jax, "devices", fail)
    assert main(["doctor"]) == 1
    captured = capsys.readouterr()
    assert "backend: failed to start: Unable to initialize backend 'cuda'" in captured.out
    assert captured.err.startswith("spmdkit doctor: jax could not start a backend")


@pytest.mark.heavy
def test_python_dash_m_spmdkit_doctor():
    res = subprocess.run(
        [sys.executable, "-m", "spmdkit", "doctor"],
        check=False,
        capture_output=True,
        text=True,
        timeout=300,
        env=dict(os.environ, JAX_PLATFORMS="cpu"),
    )
    assert res.returncode == 0, res.stdout + res.stderr
    assert "jax " in res.stdout
    assert "JAX_PLATFORMS=cpu" in res.stdout
    assert "backend: cpu" in res.stdout
