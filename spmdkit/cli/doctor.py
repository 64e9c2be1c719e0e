"""``spmdkit doctor``: what this environment runs spmdkit on, and whether it is tested.

It prints the versions of Python, jax, jaxlib, flax, optax, orbax-checkpoint,
chex and numpy beside the tested range (:data:`spmdkit.versions.TESTED`), any jax
accelerator plugin (``jax-cuda12-plugin``, ``jax-cuda13-pjrt``, ...), then starts
jax's backend and prints the platform, the devices, the memory kinds of the first
device and whether the partitioner is Shardy. It exits with status 1, and a line
per finding saying what to do, when a version lies outside the tested range, a
package is missing, a plugin is not jaxlib's release, or no backend starts.

Unlike ``demo``, it asks for no virtual devices: it reports the devices jax finds.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections import Counter
from typing import TextIO

from spmdkit import versions
from spmdkit.cli.command import Command

__all__ = ["COMMANDS", "doctor"]

#: Environment variables that change which backend and devices jax starts.
_ENV = ("JAX_PLATFORMS", "XLA_FLAGS", "CUDA_VISIBLE_DEVICES", "XLA_PYTHON_CLIENT_MEM_FRACTION")


def _versions(out: TextIO) -> list[str]:
    """Print the versions table; the findings (one line each) outside the range."""
    checks = versions.check_all()
    plugins = versions.accelerator_plugins()
    width = max(len(c.dist) for c in checks) + 2
    width = max([width, *(len(name) + 2 for name in plugins)])
    out.write("versions (tested range: spmdkit/versions.py):\n")
    for c in checks:
        status = "ok" if c.ok else "OUTSIDE the tested range"
        out.write(f"  {c.dist:<{width}}{c.version or '-':<12}{c.tested!s:<18}{status}\n")
    jaxlib = versions.installed_version("jaxlib")
    mismatched = versions.plugin_advice(plugins, jaxlib)
    for name, version in plugins.items():
        status = "MISMATCH" if name in mismatched else "ok"
        out.write(f"  {name:<{width}}{version:<12}{'==jaxlib':<18}{status}\n")
    if not plugins:
        out.write("  (no jax CUDA or ROCm plugin installed)\n")
    return [c.advice() for c in checks if not c.ok] + list(mismatched.values())


def _memory_kinds(device) -> str:
    """The memory kinds a device addresses, its default marked (older jax: says so)."""
    try:
        kinds = [m.kind for m in device.addressable_memories()]
        default = device.default_memory().kind
    except (AttributeError, NotImplementedError, RuntimeError) as e:
        return f"unknown ({type(e).__name__}: {e})"
    return ", ".join(f"{k} (default)" if k == default else k for k in kinds)


def _backend(out: TextIO) -> list[str]:
    """Start jax's backend and print it; the findings when it does not start."""
    import jax

    try:
        devices = jax.devices()
    except RuntimeError as e:
        out.write(f"backend: failed to start: {e}\n")
        return [
            f"jax could not start a backend ({e}): check JAX_PLATFORMS and that the "
            f'accelerator plugin matches jaxlib (pip install -U "jax[cuda13]" or [cuda12])'
        ]
    first = devices[0]
    backend = jax.default_backend()
    detail = str(getattr(getattr(first, "client", None), "platform_version", ""))
    detail = "; ".join(line for line in detail.splitlines() if line.strip())
    out.write(
        f"backend: {backend}" + (f" ({detail})" if detail and detail != backend else "") + "\n"
    )
    kinds = Counter(d.device_kind for d in devices)
    listed = ", ".join(f"{n} x {kind}" for kind, n in kinds.items())
    out.write(f"devices: {len(devices)} ({listed}); processes: {jax.process_count()}\n")
    out.write(f"memory kinds of device 0: {_memory_kinds(first)}\n")
    shardy = getattr(jax.config, "jax_use_shardy_partitioner", None)
    partitioner = {True: "Shardy", False: "GSPMD"}.get(shardy, "unknown (no such option)")
    out.write(f"partitioner: {partitioner} (jax_use_shardy_partitioner={shardy})\n")
    if versions.accelerator_plugins() and backend == "cpu":
        out.write(
            "note: an accelerator plugin is installed but jax runs on CPU "
            "(no device found, or the plugin failed: see jax's warning above)\n"
        )
    return []


def doctor(*, out: TextIO | None = None, err: TextIO | None = None) -> int:
    """Print the environment spmdkit runs on and check it against the tested range.

    Args:
      out: where the report goes (default: ``sys.stdout``).
      err: where the findings go, one line each with what to do (default: ``sys.stderr``).

    Returns:
      0 when every version is inside the tested range and a backend starts, else 1.

    Example::

        >>> doctor()  # doctest: +SKIP
        spmdkit 0.1.0 at /work/main/spmdkit
        versions (tested range: spmdkit/versions.py):
          python            3.11.7      >=3.11,<3.14      ok
        ...
    """
    import spmdkit

    out = sys.stdout if out is None else out
    err = sys.stderr if err is None else err
    version = versions.installed_version("spmdkit") or "(not installed)"
    out.write(f"spmdkit {version} at {os.path.dirname(spmdkit.__file__)}\n")
    findings = _versions(out)
    for name in _ENV:
        if name in os.environ:
            out.write(f"{name}={os.environ[name]}\n")
    findings += _backend(out)
    for line in findings:
        err.write(f"spmdkit doctor: {line}\n")
    if findings:
        return 1
    out.write("everything is inside the tested range\n")
    return 0


def _configure(parser: argparse.ArgumentParser) -> None:
    del parser  # no options


def _run(args: argparse.Namespace, out: TextIO) -> int:
    del args
    return doctor(out=out)


COMMANDS = [
    Command(
        "doctor",
        "versions, backend, devices and partitioner; exit 1 outside the tested range",
        _configure,
        _run,
    )
]
